"""Pure parts of issue 10: the CMake walk (commands, includes, conditions, variables, reads), the
FetchContent check with fakes, image.yaml exclusions and submodule lists, NAME_REF=<name>@<sha>,
and the generated imagebuild-src script."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from imagebuild.core.errors import DefinitionError
from imagebuild.definition import reader as d
from imagebuild.definition.source_options import SourceOptions
from imagebuild.fetch import depcheck
from imagebuild.fetch.fetchcontent import commands, scan_files
from imagebuild.plan import source_mounts

FIXTURES = Path(__file__).parents[2] / "fixtures" / "project"


def test_commands_quoting_brackets_comments_and_lines():
    text = ('set(A "x;y" [[b]] c\\;d)  # comment (\n'
            '#[==[ set(NOT_ME 1) ]==]\n'
            'if (DEFINED ENV{X} AND NOT Y)\n'
            '  message("multi\n line ${A}")\n'
            'endif()\n'
            'weird text without a call\n'
            'set(B [=[\nfirst\n]=])\n')
    cmds = commands(text)
    assert [(c.name, c.line) for c in cmds] == [("set", 1), ("if", 3), ("message", 4), ("endif", 6), ("set", 8)]
    assert [(a.text, a.quoted) for a in cmds[0].args] == [("A", False), ("x;y", True), ("b", True), ("c\\;d", False)]
    assert cmds[4].args[1].text == "first\n"


def _scan(files: dict[str, str], extra: set[str] = frozenset()):
    return scan_files({p: t for p, t in files.items()}, set(files) | set(extra))


def test_include_order_conditions_and_variables():
    s = _scan({
        "CMakeLists.txt": "include(FetchContent)\nif(GPU)\n  include(${CMAKE_CURRENT_LIST_DIR}/tools/v.cmake)\n"
                          "endif()\ninclude(Deps)\n",
        "tools/v.cmake": 'set(REV "v1.2")\nset(REV2 "${REV}" CACHE STRING "doc")\n',
        "cmake/Deps.cmake": "if(NOT DEFINED ENV{DEP_DIR})\n  FetchContent_Declare(dep GIT_REPOSITORY u GIT_TAG ${REV2})\n"
                            "endif()\n",
        "cmake/unused.cmake": "set(OTHER 1)\n"})
    assert s.files == ["CMakeLists.txt", "tools/v.cmake", "cmake/Deps.cmake", "cmake/unused.cmake"]
    dep = s.declarations["dep"]
    assert dep.tag_value == "v1.2" and dep.tag_resolved.origin == ["tools/v.cmake:2", "tools/v.cmake:1"]
    assert dep.when == ("CMakeLists.txt:5: include(Deps)", "cmake/Deps.cmake:1: if (NOT DEFINED ENV{DEP_DIR})")
    assert s.how_read("DEP_DIR") == (["cmake/Deps.cmake:1"], [])
    assert s.how_read("GPU") == ([], ["CMakeLists.txt:2"])


@pytest.mark.parametrize("sets,value,note", [
    ("", None, "X is not set in the scanned CMake files"),
    ('set(X "a")\nset(X "b")\n', None, "set to several values in the tree: 'a', 'b'"),
    ('set(X "a")\nset(X "a")\n', "a", None),
    ("set(X $ENV{Y})\n", None, "reads the environment variable Y"),
    ('set(X "${X}")\n', None, "nested too deep"),
])
def test_unresolvable_values_are_said(sets, value, note):
    s = _scan({"CMakeLists.txt": sets + "FetchContent_Declare(d GIT_REPOSITORY u GIT_TAG ${X})\n"})
    r = s.declarations["d"].tag_resolved
    assert r.value == value
    assert (note is None and r.note is None) or note in r.note


def test_merge_keeps_alternatives_and_override_and_ignores_populate_by_name():
    s = _scan({"CMakeLists.txt":
               "if(D)\n FetchContent_Declare(x SOURCE_DIR ${D})\nelse()\n"
               " FetchContent_Declare(x GIT_REPOSITORY u GIT_TAG v1)\nendif()\n"
               "FetchContent_Declare(x GIT_REPOSITORY u GIT_TAG v1)\n"
               "FetchContent_Declare(x GIT_REPOSITORY u GIT_TAG v2)\n"
               "FetchContent_Populate(x)\n"
               "FetchContent_Populate(y GIT_REPOSITORY w GIT_TAG v3 SOURCE_DIR ${B}/y)\n"})
    x = s.declarations["x"]
    assert (x.line, x.lines, x.override, x.override_where) == (4, [2, 4, 6], "D", "CMakeLists.txt:2")
    assert [(a.line, a.tag) for a in x.alternatives] == [(7, "v2")]
    assert s.declarations["y"].kind == "populate"


class _P:
    def __init__(self, name, repo="u", **opts):
        self.name, self.repo = name, repo
        self.opts = SourceOptions(name, opts.pop("scan", not opts.get("dependency_of")),
                                  opts.pop("dependency_of", None), opts.pop("declares", name.lower()),
                                  opts.pop("env", None), None, opts.pop("submodules", None),
                                  exclude=opts.pop("exclude", ()))


TREE = {"CMakeLists.txt":
        "if (DEFINED ENV{A_DIR})\n set(A_DIR $ENV{A_DIR})\nendif()\n"
        "if(A_DIR)\n FetchContent_Declare(a SOURCE_DIR ${A_DIR})\nelse()\n"
        " FetchContent_Declare(a GIT_REPOSITORY https://x/a.git GIT_TAG v1 GIT_SUBMODULES one)\nendif()\n"
        "FetchContent_Declare(b-dash GIT_REPOSITORY https://x/b.git GIT_TAG v2)\n"
        "FetchContent_Declare(cpu GIT_REPOSITORY https://x/cpu.git GIT_TAG v3)\n"}


def _check(pins):
    s = _scan(TREE)
    return depcheck.check({p.name: p for p in pins}, {"TOP": s}, {"TOP": "0" * 40}, env_file="versions.env",
                          yaml_file="image.yaml", env_keys={f"{p.name}_REPO" for p in pins})


def test_check_with_fakes_overrides_exclusions_submodules():
    res = _check([_P("TOP", exclude=(("cpu", "CPU-only"),)), _P("A", dependency_of="TOP", declares="a"),
                  _P("B", dependency_of="TOP", declares="b-dash", submodules=False)])
    assert not res.problems
    assert res.deps["A"].override["name"] == "A_DIR" and res.deps["A"].override["via"] == "env"
    assert res.deps["A"].submodules.paths == ["one"]
    # FetchContent's own variable keeps the dash: -D only
    assert res.deps["B"].override == {"name": "FETCHCONTENT_SOURCE_DIR_B-DASH", "via": "cmake",
                                      "from": "FetchContent's own variable", "env_read_at": [],
                                      "cmake_read_at": ["FetchContent (FETCHCONTENT_SOURCE_DIR_<NAME> of 'b-dash')"]}
    assert res.excluded["TOP"][0]["name"] == "cpu"


def test_check_with_fakes_errors():
    res = _check([_P("TOP"), _P("A", dependency_of="TOP", declares="a", env="A_DIRR"),
                  _P("B", dependency_of="TOP", declares="b-dash")])
    msgs = [p.render() for p in res.problems]
    assert any("sources.A.env: override 'A_DIRR' of A is not read" in m and "A_DIR (environment at CMakeLists.txt:1"
               in m for m in msgs)
    assert any("CPU_REPO" in m and "'cpu' at CMakeLists.txt:10" in m and "CPU_REF=v3" in m for m in msgs)


@pytest.mark.parametrize("setting,paths,warn", [
    (None, ["one"], None), (True, None, "packing every submodule"), (False, [], "the tarball lacks one"),
    (("one",), ["one"], None), (("one", "two"), ["one", "two"], "it also packs two"),
])
def test_submodule_settings(setting, paths, warn):
    s = _scan(TREE)
    opts = SourceOptions("A", False, "TOP", "a", None, None, setting)
    sub, w = depcheck.submodules_for(opts, s.declarations["a"])
    assert sub.paths == paths
    assert (w is None) if warn is None else (warn in w)


def _project(tmp_path: Path, yaml_tail: str, env_tail: str = "") -> Path:
    root = tmp_path / "p"
    shutil.copytree(FIXTURES, root)
    img = root / "docker-images" / "tiny"
    (img / "versions.env").write_text((img / "versions.env").read_text() + env_tail)
    (img / "image.yaml").write_text((img / "image.yaml").read_text() + yaml_tail)
    return root


def test_exclude_and_submodules_options_are_checked(tmp_path):
    sha = "0123456789abcdef0123456789abcdef01234567"
    root = _project(tmp_path, 'sources:\n  DEMO:\n    exclude: {oneDNN: "", arm: 3, ok: "fine", OK: "twice"}\n'
                    "  DEP:\n    dependency_of: DEMO\n    declares: ok\n    submodules: [../up, a, a]\n",
                    f"DEP_REPO=https://example.invalid/dep.git\nDEP_REF={sha}\n")
    with pytest.raises(DefinitionError) as ei:
        d.load(root, "tiny")
    text = ei.value.render()
    assert "sources.DEMO.exclude.oneDNN: exclusion of 'oneDNN' needs a reason" in text
    assert "sources.DEMO.exclude.arm: exclusion of 'arm' needs a reason" in text
    assert "'OK' is excluded twice" in text
    assert "submodule path '../up' must be a relative path" in text and "'a' is listed twice" in text


def test_pin_and_exclusion_of_the_same_dependency(tmp_path):
    sha = "0123456789abcdef0123456789abcdef01234567"
    root = _project(tmp_path, 'sources:\n  DEMO:\n    exclude: {dep: "not needed"}\n  DEP: {dependency_of: DEMO}\n',
                    f"DEP_REPO=https://example.invalid/dep.git\nDEP_REF={sha}\n")
    with pytest.raises(DefinitionError) as ei:
        d.load(root, "tiny")
    assert "DEP pins 'dep' for DEMO, which also excludes it ('not needed')" in ei.value.render()


@pytest.mark.parametrize("ref,ok,follows", [
    ("dev/jovian-judgement@" + "a" * 40, True, "dev/jovian-judgement"),
    ("v4.4.2@" + "b" * 40, True, "v4.4.2"),
    ("main@abc", False, None), ("@" + "a" * 40, False, None), ("a..b@" + "a" * 40, False, None),
])
def test_ref_that_remembers_what_it_follows(tmp_path, ref, ok, follows):
    root = _project(tmp_path, "", f"DEP_REPO=https://example.invalid/dep.git\nDEP_REF={ref}\n")
    if ok:
        src = d.load(root, "tiny").sources["DEP"]
        assert (src.follows, src.ref) == (follows, ref.rpartition("@")[2]) and src.pinned
    else:
        with pytest.raises(DefinitionError) as ei:
            d.load(root, "tiny")
        assert "DEP_REF" in ei.value.render()


def test_generated_script_extracts_and_sets_overrides(tmp_path):
    """Run the generated script for real with sh, its fixed paths mapped into a temp folder. TOP is a
    plain tar (tarball format 2), DEP and CM gzip (a lock packed by format 1): each is extracted."""
    import gzip
    import hashlib

    from tests.buildfixtures import tar_bytes as tar

    top, dep = tar({"CMakeLists.txt": b"project(x)\n"}), gzip.compress(tar({"inc/dep.h": b"// dep\n"}), mtime=0)
    lock = {"sources": {
        "TOP": {"tarball": "deps-src/i/src/top.tar", "sha256": hashlib.sha256(top).hexdigest(), "tarball_format": 2,
                "excluded": [{"name": "cpu", "reason": "CPU-only; it's fine", "file": "CMakeLists.txt", "line": 9}]},
        "DEP": {"tarball": "deps-src/i/src/dep.tar.gz", "sha256": hashlib.sha256(dep).hexdigest(), "tarball_format": 1,
                "dependency_of": "TOP", "override": {"name": "DEP_SRC_DIR", "via": "env"}},
        "CM": {"tarball": "deps-src/i/src/cm.tar.gz", "sha256": hashlib.sha256(dep).hexdigest(),
               "dependency_of": "TOP", "override": {"name": "FETCHCONTENT_SOURCE_DIR_C-M", "via": "cmake"}}}}
    ms = source_mounts.source_mounts(lock, "build", ["TOP"])
    assert [m.name for m in ms.mounts] == ["TOP", "CM", "DEP"]
    assert ms.key_inputs()["tarballs"] == {"TOP.tar": lock["sources"]["TOP"]["sha256"],
                                           "CM.tar.gz": lock["sources"]["CM"]["sha256"],
                                           "DEP.tar.gz": lock["sources"]["DEP"]["sha256"]}
    assert '*.gz) tar -xzf "' in ms.script() and '*) tar -xf "' in ms.script()  # by suffix, as BusyBox needs
    ctx, work = tmp_path / "ctx", tmp_path / "work"
    ctx.mkdir()
    for name, data in (("TOP.tar", top), ("DEP.tar.gz", dep), ("CM.tar.gz", dep)):
        (ctx / name).write_bytes(data)
    script = ms.script().replace(source_mounts.MOUNT, str(ctx)).replace(source_mounts.WORK, str(work))
    (ctx / source_mounts.SCRIPT).write_text(script)
    out = subprocess.run(["sh", "-c", f'CMAKE_ARGS=-DX=1; . {ctx}/{source_mounts.SCRIPT} && '
                          'echo "$DEP_SRC_DIR|$CMAKE_ARGS|$IMAGEBUILD_SRC_TOP"'], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{work}/dep|-DX=1 -DFETCHCONTENT_SOURCE_DIR_C-M={work}/cm|{work}/top"
    assert (work / "dep" / "inc" / "dep.h").read_text() == "// dep\n"
    assert (work / "top" / "CMakeLists.txt").read_text() == "project(x)\n"
    assert "cpu is excluded on purpose (CPU-only; it's fine; declared by TOP at CMakeLists.txt:9)" in out.stderr
    # a tarball that is not the lock's stops it
    (ctx / "DEP.tar.gz").write_bytes(gzip.compress(top, mtime=0))
    out = subprocess.run(["sh", "-c", f". {ctx}/{source_mounts.SCRIPT} && echo reached"], capture_output=True,
                         text=True)
    assert out.returncode != 0 and "reached" not in out.stdout and "does not match the lock's sha256" in out.stderr
    assert ms.script() == source_mounts.source_mounts(lock, "build", ["TOP"]).script()  # deterministic
