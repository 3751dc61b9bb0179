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


KV_B12X_SHAPE = '''\
# Shape fixture: the B12X fork's KV sizing (a final snapshot after profiling; FACTS.md).
class Worker:
    def determine_available_memory(self, profile_result) -> int:
        final_profile_snapshot = MemorySnapshot(device=self.device)
        late_persistent_memory = max(
            profile_result.after_profile.free_memory - final_profile_snapshot.free_memory, 0
        )
        free_gpu_memory = final_profile_snapshot.free_memory
        return free_gpu_memory - late_persistent_memory

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate GPU KV cache with the specified kv_cache_config."""
        self.model_runner.initialize_kv_cache(kv_cache_config)
'''


def _kv(tmp_path, text):
    (p,) = [p for p in PATCHES if p.name == "patch_vllm_spark_kv_cache_cleanup.py"]
    f = tmp_path / "vllm" / "v1" / "worker" / "gpu_worker.py"
    f.parent.mkdir(parents=True)
    f.write_text(text)
    return p, f


def test_kv_cleanup_knows_the_b12x_forks_shape(tmp_path):
    p, f = _kv(tmp_path, KV_B12X_SHAPE)
    res = patching.apply_edits(p.name, edits_of(p), tmp_path)
    assert res.outcome == patching.APPLIED, res.message
    assert "another shape of the code" in res.edits[0].message
    text = f.read_text()
    ast.parse(text)
    # the leftovers are dropped before the final snapshot is taken, the fork's accounting untouched
    assert text.index("torch.cuda.empty_cache()") < text.index("final_profile_snapshot = MemorySnapshot(")
    assert "late_persistent_memory = max(" in text and "profile_result.after_profile.measure()" not in text
    assert patching.apply_edits(p.name, edits_of(p), tmp_path).outcome == patching.ALREADY


def test_kv_cleanup_skips_a_tree_that_cleans_up_natively_and_fails_an_unknown_shape(tmp_path):
    native = KV_B12X_SHAPE.replace("        final_profile_snapshot = MemorySnapshot(device=self.device)\n",
                                   "        torch.cuda.empty_cache()\n        profile_result.after_profile.measure()\n"
                                   "        final_profile_snapshot = MemorySnapshot(device=self.device)\n")
    p, f = _kv(tmp_path / "native", native)
    res = patching.apply_edits(p.name, edits_of(p), tmp_path / "native")
    assert res.edits[0].outcome == patching.NOT_NEEDED, res.message
    unknown = KV_B12X_SHAPE.replace("final_profile_snapshot = MemorySnapshot(device=self.device)",
                                    "snapshot = take_snapshot()").replace("final_profile_snapshot", "snapshot")
    p, f = _kv(tmp_path / "unknown", unknown)
    before = f.read_text()
    res = patching.apply_edits(p.name, edits_of(p), tmp_path / "unknown")
    assert res.outcome == patching.FAILED and "nor any of its 1 other shape(s)" in res.message, res.message
    assert f.read_text() == before


def test_kv_cleanup_keeps_a_transient_peak_headroom_counted(tmp_path):
    p, f = _kv(tmp_path, (SHAPES / "patch_vllm_spark_kv_cache_cleanup" / "vllm" / "v1" / "worker"
                          / "gpu_worker.py.in").read_text())
    assert patching.apply_edits(p.name, edits_of(p), tmp_path).outcome == patching.APPLIED
    assert '+ getattr(profile_result, "transient_peak_headroom", 0)' in f.read_text()


@pytest.mark.parametrize("cuda13_list", ["7.5;8.0;8.6;8.7;8.9;9.0;10.0;11.0;12.0;12.1",
                                         "7.5;8.0;8.6;8.7;8.9;9.0;10.0;10.3;11.0;12.0;12.1"])
def test_preserve_sm12x_is_not_needed_on_a_tree_that_keeps_12_1(tmp_path, cuda13_list):
    """A tree whose CUDA 13 allow-list already has 12.1 (alone, or with the 10.3 subarchitecture)."""
    (p,) = [p for p in PATCHES if p.name == "patch_vllm_preserve_sm12x_target.py"]
    src = shape_tree(p, tmp_path / "src")
    cm = src / "CMakeLists.txt"
    cm.write_text(cm.read_text().replace('"7.5;8.0;8.6;8.7;8.9;9.0;10.0;11.0;12.0"', f'"{cuda13_list}"'))
    before = tree_state(src)
    res = patching.apply_edits(p.name, edits_of(p), src, required=True)
    assert res.outcome == patching.NOT_NEEDED, res.message
    assert tree_state(src) == before
