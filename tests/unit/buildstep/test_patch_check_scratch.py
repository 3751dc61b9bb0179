"""`imagebuild patch --check` never imports a patch into this process and never touches the checkout:
the patches run in another process on a scratch copy, twice, and a set that a second apply still
changes fails as not idempotent (issue 22: an import-time side effect edited the source; a set that
was not idempotent passed --check)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_cli, tree_state

IMG = "pc"

PATCH = '''from imagebuild_patching import Edit
{extra}
EDITS = [Edit(file="app.py", anchor={anchor!r}, replacement={replacement!r}, marker={marker!r})]
'''


def _project(root: Path, patches: dict[str, str]) -> tuple[Path, Path]:
    d = root / "docker-images" / IMG
    d.mkdir(parents=True)
    (d / "versions.env").write_text("BASE_IMAGE=imagebuild-test/busybox:1\n")
    names = sorted(patches)
    (d / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: s\n    from: BASE_IMAGE\n"
                                  f"    patches: [{', '.join(names)}]\n")
    (d / "Dockerfile.s").write_text("ARG PARENT\nFROM ${PARENT}\n")
    for n, text in patches.items():
        (d / n).write_text(text)
    src = root / "src"
    src.mkdir()
    (src / "app.py").write_text("x = 1\n")
    return root, src


def test_an_import_time_side_effect_never_reaches_the_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path / "..")  # where this process runs
    side = PATCH.format(extra="import pathlib\npathlib.Path('app.py').write_text('clobbered\\n')  # at import",
                        anchor="x = 1\n", replacement="x = 2  # patched: p1\n", marker="patched: p1")
    root, src = _project(tmp_path, {"patch_a.py": side})
    before = tree_state(src)
    r = run_cli("--root", str(root), "patch", IMG, "--src", str(src), "--check", "--json")
    assert tree_state(src) == before  # the checkout is untouched, side effect included
    assert not (Path.cwd() / "app.py").exists()  # nor where this process runs: it ran in the scratch copy
    # what the side effect did, it did to the scratch copy, where the patch then no longer applies
    assert r.code == 1 and [p["outcome"] for p in json.loads(r.out)["patches"]] == ["failed"], r.err


def test_a_set_that_is_not_idempotent_fails_the_check(tmp_path):
    a = PATCH.format(extra="", anchor="x = 1\n", replacement="x = 2  # patched: pa\n", marker="patched: pa")
    b = PATCH.format(extra="", anchor="x = 2  # patched: pa\n", replacement="x = 1  # patched: pb\n",
                     marker="patched: pb")
    root, src = _project(tmp_path, {"patch_a.py": a, "patch_b.py": b})
    before = tree_state(src)
    r = run_cli("--root", str(root), "patch", IMG, "--src", str(src), "--check", "--json")
    assert r.code == 1, r.out + r.err
    doc = json.loads(r.out)
    out = {p["patch"]: p for p in doc["patches"]}
    assert out["patch_a.py"]["outcome"] == "failed" and "not idempotent" in out["patch_a.py"]["message"]
    assert out["patch_b.py"]["outcome"] == "would-apply"
    assert tree_state(src) == before


def test_an_idempotent_set_checks_as_before(tmp_path):
    a = PATCH.format(extra="", anchor="x = 1\n", replacement="x = 2  # patched: ok\n", marker="patched: ok")
    root, src = _project(tmp_path, {"patch_a.py": a})
    r = run_cli("--root", str(root), "patch", IMG, "--src", str(src), "--check", "--json")
    assert r.code == 0, r.err
    assert [p["outcome"] for p in json.loads(r.out)["patches"]] == ["would-apply"]
    assert (src / "app.py").read_text() == "x = 1\n"
