"""The anchor-patch primitive (imagebuild/patching.py), its CLI, and `imagebuild patch`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from imagebuild.buildstep import guards
from imagebuild.definition import patching
from tests.conftest import run_cli, tree_state

SRC = 'def greet():\n    return "hello"\n'
PATCH = '''from imagebuild_patching import Edit

EDITS = [Edit(file="greet.py", anchor='    return "hello"\\n',
              replacement='    return "HELLO"  # imagebuild-patch: loud\\n', marker="imagebuild-patch: loud",
              upstream=['return "HELLO"'])]
'''


def _setup(tmp_path: Path, src: str = SRC, patch: str = PATCH) -> tuple[Path, Path]:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "greet.py").write_text(src)
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "patch_loud.py").write_text(patch)
    return tmp_path / "src", tmp_path / "patches" / "patch_loud.py"


def test_applied_then_already_applied_and_idempotent(tmp_path):
    src, p = _setup(tmp_path)
    (r,) = patching.apply_all([p], src)
    assert r.outcome == "applied"
    after = (src / "greet.py").read_text()
    assert 'return "HELLO"  # imagebuild-patch: loud' in after
    (r,) = patching.apply_all([p], src)
    assert r.outcome == "already-applied"
    assert (src / "greet.py").read_text() == after


def test_upstream_equivalent_is_not_needed(tmp_path):
    src, p = _setup(tmp_path, src='def greet():\n    return "HELLO"\n')
    (r,) = patching.apply_all([p], src)
    assert r.outcome == "not-needed" and "upstream already has the change" in r.message


@pytest.mark.parametrize("src,why", [('def greet():\n    return "hi"\n', "not found"),
                                     ('def greet():\n    return "hello"\n    return "hello"\n', "found 2 times")])
def test_anything_else_fails_naming_patch_file_anchor(tmp_path, src, why, monkeypatch):
    import sys

    # as on a machine without PYTHONDONTWRITEBYTECODE: importing the patch must not leave __pycache__
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    s, p = _setup(tmp_path, src=src)
    before = tree_state(tmp_path)
    (r,) = patching.apply_all([p], s)
    assert r.outcome == "failed"
    assert "patch_loud.py" in r.message and "greet.py" in r.message and "return \"hello\"" in r.message
    assert why in r.message
    assert tree_state(tmp_path) == before  # nothing written


def test_python_result_must_parse(tmp_path):
    bad = PATCH.replace('# imagebuild-patch: loud', '( # imagebuild-patch: loud')
    s, p = _setup(tmp_path, patch=bad)
    (r,) = patching.apply_all([p], s)
    assert r.outcome == "failed" and "does not parse" in r.message
    assert (s / "greet.py").read_text() == SRC


def test_cli_check_record_and_exit_codes(tmp_path):
    s, p = _setup(tmp_path)
    prim = Path(patching.__file__)
    rec = tmp_path / "out" / "patches.json"
    chk = subprocess.run([sys.executable, str(prim), "apply", "--src", str(s), "--check", str(p.parent)],
                         capture_output=True, text=True)
    assert chk.returncode == 0 and "would-apply" in chk.stderr and (s / "greet.py").read_text() == SRC
    run = subprocess.run([sys.executable, str(prim), "apply", "--src", str(s), "--record", str(rec), str(p.parent)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    data = json.loads(rec.read_text())
    assert data["schema"] == "imagebuild.patches" and data["patches"]["patch_loud.py"]["outcome"] == "applied"
    (s / "greet.py").write_text('def greet():\n    return "bye"\n')
    fail = subprocess.run([sys.executable, str(prim), "apply", "--src", str(s), str(p)], capture_output=True, text=True)
    assert fail.returncode == 1 and "failed" in fail.stderr


def test_imagebuild_patch_command(project, tmp_path):
    src = tmp_path / "checkout"
    src.mkdir()
    (src / "greet.py").write_text(SRC)
    res = run_cli("--root", str(project), "patch", "staged", "--src", str(src), "--check", "--json")
    assert res.code == 0, res.err
    assert json.loads(res.out)["patches"][0]["outcome"] == "would-apply"
    assert (src / "greet.py").read_text() == SRC
    assert run_cli("--root", str(project), "patch", "staged", "--src", str(src)).code == 0
    res = run_cli("--root", str(project), "patch", "staged", "--src", str(src))
    assert res.code == 0 and "already-applied" in res.out
    (src / "greet.py").write_text('def greet():\n    return "moved"\n')
    res = run_cli("--root", str(project), "patch", "staged", "--src", str(src), "--check")
    assert res.code == 1 and "patch_greet.py" in res.err and "greet.py" in res.err and "anchor" in res.err


def test_jobs_rule():
    j = guards.jobs_rule(20, 121.0, env={})
    assert j.max_jobs == 20 and j.nvcc_threads == 2  # (121 - 8) // 4 = 28, capped by cores
    j = guards.jobs_rule(20, 24.0, env={})
    assert j.max_jobs == 4
    assert guards.jobs_rule(20, 5.0, env={}).max_jobs == 1
    assert guards.jobs_rule(20, 121.0, jobs=3, env={}).max_jobs == 3
    j = guards.jobs_rule(20, 121.0, env={"MAX_JOBS": "2", "NVCC_THREADS": "4"})
    assert (j.max_jobs, j.nvcc_threads) == (2, 4)


def test_serving_patterns():
    p = guards.ServingPatterns()
    assert p.match({"Command": '"vllm serve /models/x --port 8000"'})
    assert p.match({"Command": '"python3 -m vllm.entrypoints.openai.api_server"'})
    assert p.match({"Command": '"sleep 1"', "Labels": "a=b,imagebuild.role=serve"})
    assert not p.match({"Command": '"sleep 1"', "Names": "web"})
    p = guards.ServingPatterns.from_env({"IMAGEBUILD_SERVING_NAMES": "vllm-*", "IMAGEBUILD_SERVING_COMMANDS": ""})
    assert p.match({"Command": '"vllm serve x"', "Names": "vllm-head"}) == "name matches 'vllm-*'"
    assert not p.match({"Command": '"vllm serve x"', "Names": "other"})


def test_platform_guard():
    assert guards.check_platform("linux/amd64", emulate=False, engine_arch="x86_64") is None
    with pytest.raises(guards.GuardRefused):
        guards.check_platform("linux/arm64", emulate=False, engine_arch="x86_64")
    assert "emulation" in guards.check_platform("linux/arm64", emulate=True, engine_arch="x86_64")


PATCH_B = '''from imagebuild_patching import Edit

EDITS = [Edit(file="greet.py", anchor='    return "HELLO"  # imagebuild-patch: loud\\n',
              replacement='    return "HELLO!"  # imagebuild-patch: louder\\n', marker="imagebuild-patch: louder")]
'''


def test_check_simulates_the_patches_in_order(tmp_path):
    """B anchors on A's output: --check says both would apply, in memory, writing nothing."""
    src, a = _setup(tmp_path)
    b = a.parent / "patch_louder.py"
    b.write_text(PATCH_B)
    before = tree_state(tmp_path)
    ra, rb = patching.apply_all([a, b], src, write=False)
    assert (ra.outcome, rb.outcome) == ("would-apply", "would-apply"), rb.message
    assert tree_state(tmp_path) == before
    # the same through the primitive's CLI (as the build runs it), and then for real
    chk = subprocess.run([sys.executable, str(Path(patching.__file__)), "apply", "--src", str(src), "--check",
                          str(a.parent)], capture_output=True, text=True)
    assert chk.returncode == 0 and chk.stderr.count("would-apply") == 2, chk.stderr
    assert tree_state(tmp_path) == before
    ra, rb = patching.apply_all([a, b], src)
    assert (ra.outcome, rb.outcome) == ("applied", "applied")
    assert 'return "HELLO!"' in (src / "greet.py").read_text()
    # B alone, on the unpatched tree, cannot apply: the simulation is not a free pass
    (src / "greet.py").write_text(SRC)
    (rb,) = patching.apply_all([b], src, write=False)
    assert rb.outcome == "failed" and "not found" in rb.message


def test_imagebuild_patch_check_runs_the_set_in_order(project, tmp_path):
    d = project / "docker-images" / "staged"
    (d / "patch_louder.py").write_text(PATCH_B.replace("imagebuild-patch: loud", "imagebuild-patch: greet-loud"))
    y = d / "image.yaml"
    y.write_text(y.read_text().replace("patches: [patch_greet.py]", "patches: [patch_greet.py, patch_louder.py]"))
    src = tmp_path / "checkout"
    src.mkdir()
    (src / "greet.py").write_text(SRC)
    before = tree_state(tmp_path)
    res = run_cli("--root", str(project), "patch", "staged", "--src", str(src), "--check", "--json")
    assert res.code == 0, res.err
    assert [p["outcome"] for p in json.loads(res.out)["patches"]] == ["would-apply", "would-apply"]
    assert tree_state(tmp_path) == before


def test_anchor_not_found_shows_its_whitespace(tmp_path):
    tabbed = PATCH.replace("anchor='    return", "anchor='\\treturn")
    src, p = _setup(tmp_path, patch=tabbed)
    (r,) = patching.apply_all([p], src)
    assert r.outcome == "failed"
    assert "anchor '\\treturn \"hello\"\\n' not found" in r.message, r.message
    # and where the same text stands with other whitespace
    assert "closest match: greet.py:2 has '    return \"hello\"'" in r.message, r.message
    # trailing blanks are visible too
    trailing = PATCH.replace('return "hello"\\n\'', 'return "hello"  \\n\'')
    assert trailing != PATCH
    (tmp_path / "t").mkdir()
    src2, p2 = _setup(tmp_path / "t", patch=trailing)
    (r,) = patching.apply_all([p2], src2)
    assert "anchor '    return \"hello\"  \\n' not found" in r.message, r.message


# ------------------------------------------------------------------ not applicable, required, every patch

PATCH_TARGETED = '''from imagebuild_patching import Edit

EDITS = [Edit(file="greet.py", anchor='    return "hello"\\\\n',
              replacement='    return "HELLO"  # imagebuild-patch: loud\\\\n', marker="imagebuild-patch: loud",
              upstream=['return "HELLO"'], applies_if=["def greet("])]
'''


def test_a_missing_target_file_is_not_applicable_and_writes_nothing(tmp_path):
    src, p = _setup(tmp_path)
    (src / "greet.py").unlink()
    before = tree_state(tmp_path)
    (r,) = patching.apply_all([p], src)
    assert r.outcome == patching.NOT_APPLICABLE
    assert r.message == "not applicable: greet.py is not in the tree"
    assert [e.outcome for e in r.edits] == [patching.NOT_APPLICABLE]
    assert tree_state(tmp_path) == before


def test_absent_code_is_not_applicable_but_a_drifted_shape_still_fails(tmp_path):
    # the code the patch repairs is not there at all: not applicable
    src, p = _setup(tmp_path, src="def other():\n    return 1\n", patch=PATCH_TARGETED)
    (r,) = patching.apply_all([p], src)
    assert r.outcome == patching.NOT_APPLICABLE and "has none of 'def greet('" in r.message, r.message
    # it is there, in another shape: failed, pointing at the closest match
    (src / "greet.py").write_text('def greet():\n    return "hi"\n')
    (r,) = patching.apply_all([p], src)
    assert r.outcome == patching.FAILED and "not found" in r.message


def test_a_required_patch_fails_where_it_is_not_applicable(tmp_path):
    src, p = _setup(tmp_path, patch=PATCH + "REQUIRED = True\n")
    (src / "greet.py").unlink()
    (r,) = patching.apply_all([p], src)
    assert r.outcome == patching.FAILED
    assert "required (REQUIRED = True), but greet.py is not in the tree" in r.message
    # a REQUIRED that is not a bool is refused
    p.write_text(PATCH + "REQUIRED = 'yes'\n")
    (r,) = patching.apply_all([p], src)
    assert r.outcome == patching.FAILED and "REQUIRED must be True or False" in r.message


def test_the_cli_exits_0_for_not_applicable(tmp_path):
    src, p = _setup(tmp_path)
    (src / "greet.py").unlink()
    r = subprocess.run([sys.executable, patching.__file__, "apply", "--src", str(src), "--json", str(p)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["patches"][0]["outcome"] == "not-applicable"
    assert "patch patch_loud.py: not-applicable (not applicable: greet.py is not in the tree)" in r.stderr


def test_check_reports_every_patch_applying_stops_at_the_first_failure(tmp_path):
    src, p = _setup(tmp_path, src='def greet():\n    return "hi"\n')  # patch_loud fails here
    second = tmp_path / "patches" / "patch_second.py"
    second.write_text(PATCH.replace("greet.py", "other.py").replace("loud", "second"))
    (src / "other.py").write_text(SRC)
    checked = patching.apply_all([p, second], src, write=False)
    assert [r.outcome for r in checked] == ["failed", "would-apply"]
    applied = patching.apply_all([p, second], src)
    assert [r.outcome for r in applied] == ["failed"]
    assert (src / "other.py").read_text() == SRC


def test_a_drifted_anchor_points_at_the_closest_match(tmp_path):
    patch = ("from imagebuild_patching import Edit\n"
             "EDITS = [Edit(file='greet.py', anchor='    a = 1\\n    b = 2\\n    c = 3\\n',\n"
             "              replacement='    a = 1  # imagebuild-patch: abc\\n', marker='imagebuild-patch: abc')]\n")
    src, p = _setup(tmp_path, src="def f():\n    x = 0\n    a = 1\n    b = 2\n    c = 4\n", patch=patch)
    (r,) = patching.apply_all([p], src)
    assert r.outcome == patching.FAILED
    assert ("closest match: greet.py:3, where its first 2 line(s) match; greet.py:5 has '    c = 4' where the "
            "anchor has '    c = 3'") in r.message, r.message
