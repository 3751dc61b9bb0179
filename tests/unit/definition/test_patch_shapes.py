"""Every real patch (patches-eugr/ and the real images' own) on a fixture of the exact source shape.

For each patch, with the project's primitive (imagebuild/patching.py, as the build ships it):
  - applied: every edit applies, every marker is in the result, a .py result parses;
  - already applied: a second run reports already-applied and writes nothing;
  - not needed: on the fixed shape (each anchor replaced by the patch's upstream equivalent);
  - anchor drifted: for each edit, one changed word in its anchor fails the patch loudly, the
    message naming the patch, the file and the anchor, and nothing is written.
Fixtures: tests/fixtures/patch-shapes/<patch name>/ (README.md there).
"""

from __future__ import annotations

import ast
import keyword
import re
import shutil
from pathlib import Path

import pytest

from imagebuild.definition import patching
from tests.conftest import tree_state

ROOT = Path(__file__).resolve().parents[3]
SHAPES = ROOT / "tests" / "fixtures" / "patch-shapes"
REAL_IMAGES = ("glm53-jovian-r12", "dsv4-flash-vision")


def real_patches() -> list[Path]:
    out = sorted((ROOT / "patches-eugr").glob("patch_*.py"))
    for image in REAL_IMAGES:
        out += sorted((ROOT / "docker-images" / image).glob("patch_*.py"))
    return out


PATCHES = real_patches()
IDS = [p.stem for p in PATCHES]


def shape_tree(patch: Path, dst: Path) -> Path:
    """Copy the patch's shape fixture to dst (dropping the .in suffix)."""
    src = SHAPES / patch.stem
    assert src.is_dir(), f"no shape fixture for {patch.name}: add tests/fixtures/patch-shapes/{patch.stem}/"
    for f in src.rglob("*.in"):
        target = dst / f.relative_to(src).with_suffix("")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target)
    return dst


def edits_of(patch: Path) -> list:
    return patching.load_edits(patch)


def drift(anchor: str) -> str:
    """The anchor with its first name (3+ letters, not a keyword) renamed, as upstream might."""
    m = next((m for m in re.finditer(r"[A-Za-z_]{3,}", anchor) if not keyword.iskeyword(m.group(0))), None)
    assert m, f"anchor without a name: {anchor!r}"
    moved = anchor[: m.start()] + m.group(0) + "_moved" + anchor[m.end():]
    assert moved != anchor
    return moved


def test_every_real_patch_has_a_shape_fixture_and_nothing_else_does():
    assert len([p for p in PATCHES if p.parent.name == "patches-eugr"]) == 12, "the seed's twelve"
    fixtures = {d.name for d in SHAPES.iterdir() if d.is_dir()}
    assert fixtures == {p.stem for p in PATCHES}


@pytest.mark.parametrize("patch", PATCHES, ids=IDS)
def test_applied_then_already_applied(patch, tmp_path):
    src = shape_tree(patch, tmp_path / "src")
    edits = edits_of(patch)
    res = patching.apply_edits(patch.name, edits, src)
    assert res.outcome == patching.APPLIED, res.message
    assert [e.outcome for e in res.edits] == [patching.APPLIED] * len(edits)
    for e in edits:
        text = (src / e.file).read_text()
        assert e.marker in text
        if e.file.endswith(".py"):
            ast.parse(text, filename=e.file)
    after = tree_state(src)
    again = patching.apply_edits(patch.name, edits, src)
    assert again.outcome == patching.ALREADY
    assert tree_state(src) == after


@pytest.mark.parametrize("patch", PATCHES, ids=IDS)
def test_not_needed_on_the_fixed_shape(patch, tmp_path):
    src = shape_tree(patch, tmp_path / "src")
    edits = edits_of(patch)
    for e in edits:
        assert e.upstream, f"{patch.name}: edit of {e.file} names no upstream equivalent"
        path = src / e.file
        path.write_text(path.read_text().replace(e.anchor, e.upstream[0] + "\n", 1))
    before = tree_state(src)
    res = patching.apply_edits(patch.name, edits, src)
    assert res.outcome == patching.NOT_NEEDED, res.message
    assert "upstream already has the change" in res.message
    assert tree_state(src) == before


def _drift_cases():
    for p in PATCHES:
        for i in range(len(edits_of(p))):
            yield pytest.param(p, i, id=f"{p.stem}-edit{i + 1}")


@pytest.mark.parametrize("patch,index", list(_drift_cases()))
def test_anchor_drift_fails_naming_patch_file_and_anchor(patch, index, tmp_path):
    src = shape_tree(patch, tmp_path / "src")
    edits = edits_of(patch)
    e = edits[index]
    path = src / e.file
    text = path.read_text()
    assert text.count(e.anchor) == 1, f"fixture of {patch.name} must hold the anchor of edit {index + 1} once"
    path.write_text(text.replace(e.anchor, drift(e.anchor), 1))
    before = tree_state(src)
    res = patching.apply_edits(patch.name, edits, src)
    assert res.outcome == patching.FAILED
    first_line = e.anchor.strip().splitlines()[0][:40]
    assert patch.name in res.message and e.file in res.message and first_line in res.message, res.message
    assert "not found" in res.message
    assert tree_state(src) == before  # all or nothing: no file written


def test_markers_are_unique_and_never_prefixes_of_each_other():
    """A marker that is a prefix of another would make a later edit look already applied."""
    markers = [e.marker for p in PATCHES for e in edits_of(p)]
    assert len(markers) == len(set(markers))
    for a in markers:
        for b in markers:
            assert a == b or a not in b, (a, b)


def test_a_check_sees_what_earlier_patches_would_change(tmp_path):
    """The plugin stage's patches chain (the MM gate edits the line supports_multimodal adds): `--check`
    reports them as the build applies them, in order, and writes nothing."""
    img = ROOT / "docker-images" / "dsv4-flash-vision"
    chain = [img / "patch_dsv4_supports_multimodal.py", img / "patch_dsv4_mm_gate.py"]
    src = shape_tree(chain[0], tmp_path / "src")
    before = tree_state(src)
    checked = patching.apply_all(chain, src, write=False)
    assert [r.outcome for r in checked] == [patching.WOULD_APPLY, patching.WOULD_APPLY]
    assert tree_state(src) == before
    applied = patching.apply_all(chain, src)
    assert [r.outcome for r in applied] == [patching.APPLIED, patching.APPLIED]
    text = (src / "dsv4_vision" / "model.py").read_text()
    assert 'supports_multimodal = os.environ.get("VLLM_DSV4_MM", "0") == "1"' in text
    assert "    supports_multimodal = True\n" not in text


@pytest.mark.parametrize("patch", [p for p in PATCHES if any(e.applies_if for e in edits_of(p))], ids=lambda p: p.stem)
def test_without_the_code_it_repairs_a_patch_is_not_applicable(patch, tmp_path):
    """On its own fixture with every ``applies_if`` string taken out, a patch is not-applicable (or,
    when it is REQUIRED, fails) and writes nothing; with its file gone, the same."""
    _, required = patching.load_patch(patch)
    edits = edits_of(patch)
    for case in ("code", "file"):
        src = shape_tree(patch, tmp_path / case)
        for e in edits:
            path = src / e.file
            if case == "file":
                path.unlink(missing_ok=True)
            elif e.applies_if:
                text = path.read_text()
                for s in e.applies_if:
                    text = text.replace(s, "")
                path.write_text(text)
        before = tree_state(src)
        res = patching.apply_edits(patch.name, edits, src, required=required)
        assert res.outcome == (patching.FAILED if required else patching.NOT_APPLICABLE), (case, res.message)
        assert tree_state(src) == before


def test_a_required_patch_never_skips(tmp_path):
    """patch_vllm_preserve_sm12x_target.py makes the sm_121a kernels: a tree without its file fails."""
    (p,) = [p for p in PATCHES if p.name == "patch_vllm_preserve_sm12x_target.py"]
    edits, required = patching.load_patch(p)
    assert required is True
    src = shape_tree(p, tmp_path / "src")
    for e in edits:
        (src / e.file).unlink(missing_ok=True)
    res = patching.apply_edits(p.name, edits, src, required=required)
    assert res.outcome == patching.FAILED and "required (REQUIRED = True)" in res.message, res.message
