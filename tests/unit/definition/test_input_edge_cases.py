"""Input edge cases seen end to end (issue 9, section 8): each gives exit 2, names file:line, and
writes nothing -- through `validate` and through `plan`."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import run_cli, tree_state
from tests.unit.definition.test_definition_errors import IMG, _append, _edit, _write


def _bytes(rel, data: bytes):
    def f(root: Path):
        (root / rel).write_bytes(data)
    return f


def _append_bytes(rel, data: bytes):
    def f(root: Path):
        with open(root / rel, "ab") as fh:
            fh.write(data)
    return f


def _alias_bomb(levels: int) -> str:
    lines = ['l0: &l0 ["x","x","x","x","x","x","x","x","x","x"]']
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


def _many_big_args(root: Path):
    """Nine pins of 120 kB: each fits one argument, together they do not fit one command line."""
    _append(f"{IMG}/versions.env", "".join(f"BIG{i}={'x' * 120_000}\n" for i in range(9)))(root)
    _edit(f"{IMG}/Dockerfile.tools", "ARG TOOL_VERSION\n",
          "ARG TOOL_VERSION\n" + "".join(f"ARG BIG{i}\n" for i in range(9)))(root)


ENV = f"{IMG}/versions.env"
YML = f"{IMG}/image.yaml"

# (id, mutation, file named, line or key named, words that must appear)
CASES = [
    # YAML: anchors/aliases refused where they stand, size bounded
    ("yaml-alias", _edit(YML, "  - name: runner\n    from: app",
                         "  - name: runner\n    from: &p app\n  - name: runner2\n    from: *p"),
     YML, ":13", "anchors and aliases are not supported"),
    ("yaml-merge-key", _edit(YML, "  - name: runner\n    from: app",
                             "  - &r {name: runner, from: app}\n  - <<: *r\n    name: runner2"),
     YML, ":12", "anchors and aliases are not supported"),
    ("yaml-alias-bomb", _append(YML, _alias_bomb(9)), YML, ":14", "anchors and aliases"),
    ("yaml-too-deep", _append(YML, "deep: " + "[" * 100 + "]" * 100 + "\n"), YML, ":14", "nested more than 64"),
    ("yaml-too-big", _append(YML, "# " + "x" * (1 << 20) + "\n"), YML, "", "larger than 1048576 bytes"),
    # versions.env: bytes bash reads differently
    ("env-nul", _append_bytes(ENV, b"X=1\x002\n"), ENV, ":13", "NUL byte"),
    ("env-invalid-utf8", _append_bytes(ENV, b"X=caf\xe9\n"), ENV, ":13", "not valid UTF-8"),
    ("env-crlf", _append_bytes(ENV, b"NEW_PIN=1.2.0\r\n"), ENV, ":13", "CRLF"),
    ("env-crlf-whole-file", lambda r: (r / ENV).write_bytes((r / ENV).read_bytes().replace(b"\n", b"\r\n")),
     ENV, ":1", "CRLF"),
    ("env-bare-cr", _append_bytes(ENV, b"X=1\r2\n"), ENV, ":13", "carriage return"),
    ("env-control-char", _append_bytes(ENV, b"X=1\x1b[0m\n"), ENV, ":13", "control character"),
    ("env-form-feed", _append_bytes(ENV, b"X=1\x0c\nY=2\n"), ENV, ":13", "control character"),
    ("yaml-invalid-utf8", _append_bytes(YML, b"# caf\xe9\n"), YML, ":14", "not valid UTF-8"),
    ("dockerfile-invalid-utf8", _append_bytes(f"{IMG}/Dockerfile.app", b"# caf\xe9\n"),
     f"{IMG}/Dockerfile.app", ":10", "not valid UTF-8"),
    # a value too long for one command-line argument
    ("env-value-too-long", _edit(ENV, "TOOL_VERSION=1.0", "TOOL_VERSION=" + "x" * 140_000), ENV, ":4",
     "131072 bytes"),
    ("stage-args-too-long", _many_big_args, f"{IMG}/Dockerfile.tools", ":12", "more than 1048576 bytes"),
    # image pins live in versions.env: no literal image in COPY --from / RUN --mount from=
    ("copy-from-literal-image", _edit(f"{IMG}/Dockerfile.tools", "COPY files/tool.sh /opt/tiny/tool.sh",
                                      "COPY --from=busybox:1 /bin/busybox /opt/busybox"),
     f"{IMG}/Dockerfile.tools", ":4", "COPY --from='busybox:1' names an image outside versions.env"),
    ("copy-from-digest", _edit(f"{IMG}/Dockerfile.tools", "COPY files/tool.sh /opt/tiny/tool.sh",
                               "COPY --from=docker.io/library/alpine@sha256:" + "a" * 64 + " /x /x"),
     f"{IMG}/Dockerfile.tools", ":4", "outside versions.env"),
    ("copy-from-stage-name", _edit(f"{IMG}/Dockerfile.tools", "COPY files/tool.sh /opt/tiny/tool.sh",
                                   "COPY --from=base /opt/tiny/base /x"),
     f"{IMG}/Dockerfile.tools", ":4", "${STAGE_BASE}"),
    ("run-mount-from-literal", _edit(f"{IMG}/Dockerfile.base", "RUN mkdir",
                                     "RUN --mount=type=bind,from=alpine:3,target=/a mkdir"),
     f"{IMG}/Dockerfile.base", ":3", "RUN --mount from='alpine:3' names an image outside versions.env"),
    ("run-mount-from-literal-continued", _edit(f"{IMG}/Dockerfile.base", "RUN mkdir",
                                               "RUN --mount=type=cache,target=/c \\\n    --mount=source=/x,from=ghcr.io/o/i:1,target=/i \\\n    mkdir"),
     f"{IMG}/Dockerfile.base", ":3", "from='ghcr.io/o/i:1'"),
    # a name that only starts with imagebuild- is no context imagebuild passes: an image (issue 22, security 4)
    ("copy-from-imagebuild-named-image", _edit(f"{IMG}/Dockerfile.tools", "COPY files/tool.sh /opt/tiny/tool.sh",
                                               "COPY --from=imagebuild-test/busybox:1 /bin/busybox /x"),
     f"{IMG}/Dockerfile.tools", ":4", "'imagebuild-test/busybox:1' is no build context imagebuild passes"),
    ("run-mount-from-imagebuild-named-image", _edit(f"{IMG}/Dockerfile.base", "RUN mkdir",
                                                    "RUN --mount=type=bind,from=imagebuild-evil.example.com/x:1,target=/a mkdir"),
     f"{IMG}/Dockerfile.base", ":3", "'imagebuild-evil.example.com/x:1' is no build context imagebuild passes"),
    ("copy-from-unknown-stage-context", _edit(f"{IMG}/Dockerfile.tools", "COPY files/tool.sh /opt/tiny/tool.sh",
                                              "COPY --from=imagebuild-stage-nope /x /x"),
     f"{IMG}/Dockerfile.tools", ":4", "is no build context imagebuild passes"),
    ("copy-from-unknown-variable", _edit(f"{IMG}/Dockerfile.tools", "COPY files/tool.sh /opt/tiny/tool.sh",
                                         "COPY --from=${NOPE} /x /x"),
     f"{IMG}/Dockerfile.tools", ":4", "NOPE"),
    # patch scripts are compiled (never run) when the definition is read
    ("patch-syntax-error", _write(f"{IMG}/patch_hello.py", "EDITS = [\n    Edit(file='a',\n]\n"),
     f"{IMG}/patch_hello.py", ":3", "does not compile"),
    ("patch-shared-syntax-error", _write("patches-eugr/patch_shared.py", "def f(:\n    pass\n"),
     "patches-eugr/patch_shared.py", ":1", "does not compile"),
    ("patch-invalid-utf8", _bytes(f"{IMG}/patch_hello.py", b"X = 1\nY = '\xff'\n"), f"{IMG}/patch_hello.py", ":2",
     "not valid UTF-8"),
]


@pytest.mark.parametrize("command", ["validate", "plan"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_bad_input_exit_2_names_file_line_writes_nothing(project, case, command):
    _id, mutate, file, where, needle = case
    mutate(project)
    before = tree_state(project)
    argv = ["plan", "tiny", "--no-engine"] if command == "plan" else ["validate", "tiny"]
    t0 = time.monotonic()
    res = run_cli("--root", str(project), *argv)
    elapsed = time.monotonic() - t0
    assert res.code == 2, res
    assert "Traceback" not in res.err
    assert res.out == ""
    assert f"{file}{where}" in res.err, res.err
    assert needle in res.err, res.err
    assert tree_state(project) == before
    assert elapsed < 5, f"{_id}: took {elapsed:.1f} s"


@pytest.mark.parametrize("dockerfile, old, new", [
    # named stages, ${STAGE_*}, ${PARENT}, versions.env image keys and build contexts stay allowed
    ("Dockerfile.app", "COPY --from=basefiles", "COPY --from=basefiles"),
    ("Dockerfile.app", "COPY --from=basefiles", "COPY --from=${STAGE_BASE}"),
    ("Dockerfile.app", "COPY --from=basefiles", "COPY --from=$STAGE_BASE"),
    ("Dockerfile.app", "COPY --from=basefiles", "COPY --from=0"),
    ("Dockerfile.app", "COPY patches/ /opt/tiny/patches/",
     "COPY patches/ /opt/tiny/patches/\nRUN --mount=type=bind,from=basefiles,source=/opt,target=/o true"),
    ("Dockerfile.app", "COPY patches/ /opt/tiny/patches/",
     "COPY patches/ /opt/tiny/patches/\nRUN --mount=type=cache,target=/root/.cache --mount=type=bind,"
     "from=imagebuild-src,target=/src true"),
    ("Dockerfile.app", "ARG APP_FLAVOUR", "ARG APP_FLAVOUR\nARG BASE_IMAGE\n"
     "COPY --from=${BASE_IMAGE} /bin/sh /opt/sh"),
])
def test_allowed_from_references(project, dockerfile, old, new):
    _edit(f"{IMG}/{dockerfile}", old, new)(project)
    res = run_cli("--root", str(project), "validate", "tiny")
    assert res.code == 0, res.err


def test_crlf_hint_names_the_fix(project):
    _append_bytes(ENV, b"NEW_PIN=1.2.0\r\n")(project)
    res = run_cli("--root", str(project), "validate", "tiny")
    assert "$'1.2.0\\r'" in res.err and "hint:" in res.err


def test_alias_bomb_is_refused_fast_and_small(project):
    """9 nested alias levels once took 2.4 GB and 90 s: now refused at the first anchor."""
    import resource

    (project / YML).write_text((project / YML).read_text() + _alias_bomb(9))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    res = run_cli("--root", str(project), "validate", "tiny")
    assert res.code == 2 and f"{YML}:14" in res.err
    assert time.monotonic() - t0 < 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 50_000  # KiB


def test_yaml_limits_apply_to_the_gate_spec_too(project):
    gate = project / IMG / "gate.yaml"
    gate.write_text("checks:\n  - &c {id: a, run: 'true'}\n  - *c\n")
    res = run_cli("--root", str(project), "validate", "tiny")
    assert res.code == 2 and f"{IMG}/gate.yaml:2" in res.err and "anchors and aliases" in res.err


# ------------------------------------------------------------------------------------------------ issue 22
# accepted although wrong: each is now a problem naming its file, line and key


def _copy_tiny(project, new: str):
    import shutil

    shutil.copytree(project / "docker-images" / "tiny", project / "docker-images" / new)
    return project / "docker-images" / new


def test_empty_gate_checks_are_a_problem(project):
    d = _copy_tiny(project, "gated")
    (d / "gate.yaml").write_text("checks: []\n")
    with open(d / "image.yaml", "a") as f:
        f.write("gate: gate.yaml\n")
    r = run_cli("--root", str(project), "validate", "gated")
    assert r.code == 2 and "docker-images/gated/gate.yaml:1: checks: expected at least one check" in r.err, r.err


@pytest.mark.parametrize("key", ["IMAGEBUILD_BUILD_ID", "IMAGEBUILD_IMAGE", "IMAGEBUILD_X", "STAGE_APP",
                                 "STAGE_NOPE", "PARENT", "TARGETPLATFORM", "BUILDARCH"])
def test_reserved_names_in_versions_env(project, key):
    env = project / "docker-images" / "tiny" / "versions.env"
    n = len(env.read_text().splitlines()) + 1
    with open(env, "a") as f:
        f.write(f"{key}=x\n")
    r = run_cli("--root", str(project), "validate", "tiny")
    assert r.code == 2, r.err
    assert f"docker-images/tiny/versions.env:{n}: {key}: {key} is provided by imagebuild" in r.err, r.err
    assert r.err.count(f"versions.env:{n}:") == 1  # said once, also where a Dockerfile declares it


@pytest.mark.parametrize("folder", ["Tiny", "t\u00efny", "ti\nny", "x" * 120])
def test_misnamed_definition_folders_are_listed_invalid(project, folder):
    _copy_tiny(project, folder)
    r = run_cli("--root", str(project), "list", "--json")
    rows = {row["name"]: row for row in __import__("json").loads(r.out)["images"]}
    assert r.code == 0 and rows[folder]["valid"] is False, r.out
    r = run_cli("--root", str(project), "list")
    assert "INVALID      the folder name is no image name" in r.out
    r = run_cli("--root", str(project), "validate")
    assert r.code == 2 and "its name is no image name" in r.err and "Traceback" not in r.err, r.err


def test_fifos_and_folders_where_a_file_belongs_are_named_not_read(tmp_path):
    """A FIFO hung `gate --spec` and definition reads; a folder was reported as missing."""
    import os

    from imagebuild.core.errors import DefinitionError
    from imagebuild.definition import gatespec
    from imagebuild.definition import reader as definition

    fifo = tmp_path / "gate.yaml"
    os.mkfifo(fifo)
    with pytest.raises(DefinitionError) as ei:
        gatespec.load(fifo)
    assert "is not a regular file, expected a gate spec file" in ei.value.render()
    d = tmp_path / "docker-images" / "x"
    d.mkdir(parents=True)
    os.mkfifo(d / "versions.env")
    (d / "image.yaml").mkdir()
    with pytest.raises(DefinitionError) as ei:
        definition.load(tmp_path, "x")
    assert "versions.env: is not a regular file, expected a file" in ei.value.render()
    assert "image.yaml: is a folder, expected a file" in ei.value.render()


def test_oversized_definition_files_are_refused_before_they_are_read(tmp_path):
    """A 200 MB versions.env was accepted (429 MB RAM) and a 200 MB image.yaml read whole before it
    was refused: the size is checked first (sparse files here: nothing is written)."""
    import resource

    from imagebuild.core.errors import DefinitionError
    from imagebuild.definition import gatespec
    from imagebuild.definition import reader as definition

    d = tmp_path / "docker-images" / "x"
    d.mkdir(parents=True)
    for name in ("versions.env", "image.yaml"):
        with open(d / name, "wb") as f:
            f.truncate(200 << 20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(DefinitionError) as ei:
        definition.load(tmp_path, "x")
    text = ei.value.render()
    assert "versions.env: is 209715200 bytes: larger than 8388608 bytes (8 MiB)" in text
    assert "image.yaml: is 209715200 bytes" in text
    big = tmp_path / "gate.yaml"
    with open(big, "wb") as f:
        f.truncate(200 << 20)
    with pytest.raises(DefinitionError) as ei:
        gatespec.load(big)
    assert "the limit for a gate spec" in ei.value.render()
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 100 * 1024, grown_kib  # nothing close to 200 MB was read


def test_an_oversized_run_record_is_not_read_whole(tmp_path):
    from imagebuild.core import runs

    d = tmp_path / "run"
    d.mkdir()
    with open(d / "record.json", "wb") as f:
        f.truncate(300 << 20)
    assert runs._read(d) == {}
