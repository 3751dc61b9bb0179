"""Issue 29, section 4, against real git upstreams on a loopback `git daemon`:

- a stage without sources of its own that patches what an earlier stage built (glm53's runner applies
  patch_cuda_sm12x.py to the installed vllm) has its patches checked at prefetch on the composed tree of
  the stage it uses, after that stage's own patches, and `plan` shows the outcome: the r12 shape of
  the sm12x branch would apply; another shape (28be48fa's `major in (10, 12)`) fails loudly, never
  skips; a tree without the feature (`_get_backend_priorities`) is not applicable;
- a composed source without pull requests gets a version (its history is fetched), never null.

The patch is glm53's own file, unchanged; the upstream holds only the file it edits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.gitfixtures import GitDaemon, UpstreamFactory, git

REPO = Path(__file__).resolve().parents[3]
IMAGE = "sm12x"
PATCH = REPO / "docker-images" / "glm53-jovian-r12" / "patch_cuda_sm12x.py"

R12 = (REPO / "tests" / "fixtures" / "patch-shapes" / "patch_cuda_sm12x" / "vllm" / "platforms" / "cuda.py.in").read_text()
OTHER = """\
def _get_backend_priorities(use_mla, device_capability):
    if use_mla:
        if device_capability.major in (10, 12):
            return [
                AttentionBackendEnum.FLASHINFER_MLA,
                AttentionBackendEnum.TRITON_MLA,
            ]
    return []
"""
NONE = "def get_attn_backend_cls():\n    return 'FLASH_ATTN'\n"
# a patch of the wheel stage that edits the same file: the runner's check sees the tree as installed
WHEEL_PATCH = '''\
"""Test patch: a comment at the top of the file, applied in the wheel stage."""
from imagebuild_patching import Edit

EDITS = [Edit(file="vllm/platforms/cuda.py", anchor="def _get_backend_priorities(",
              replacement="# imagebuild-patch: wheel-stage\\ndef _get_backend_priorities(",
              marker="imagebuild-patch: wheel-stage", applies_if=["_get_backend_priorities"])]
'''


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base = tmp_path_factory.mktemp("sm12x-remotes")
    (base / "served").mkdir()
    with GitDaemon(base / "served") as d:
        f = UpstreamFactory(base / "served", d)
        up = f.create("lab/vllm", {"vllm/__init__.py": "", "vllm/platforms/cuda.py": R12})
        shas = {"r12": up.head()}
        shas["other"] = up.commit({"vllm/platforms/cuda.py": OTHER}, "the sm12x branch in another shape")
        shas["none"] = up.commit({"vllm/platforms/cuda.py": NONE}, "no backend priorities at all")
        shas["count_other"] = int(git("rev-list", "--count", shas["other"], cwd=up.bare))
        yield {"url": up.url(), **shas}


def _project(base: Path, served: dict, which: str) -> Path:
    root = base / "project"
    img = root / "docker-images" / IMAGE
    img.mkdir(parents=True)
    (img / "versions.env").write_text(f"BASE_IMAGE=imagebuild-test/busybox:1\nVLLM_REPO={served['url']}\n"
                                      f"VLLM_REF={served[which]}\n")
    (img / "image.yaml").write_text(
        "platform: linux/amd64\n"
        "sources:\n  VLLM:\n    scan_fetchcontent: false\n"
        "stages:\n"
        "  - name: wheel\n    from: BASE_IMAGE\n    sources: [VLLM]\n    patches: [patch_wheel_stage.py]\n"
        "  - name: runner\n    from: BASE_IMAGE\n    patches: [patch_cuda_sm12x.py]\n")
    (img / "Dockerfile.wheel").write_text("ARG PARENT\nFROM ${PARENT}\nRUN true\n")
    (img / "Dockerfile.runner").write_text("ARG STAGE_WHEEL\nARG PARENT\nFROM ${STAGE_WHEEL} AS wheel\n"
                                           "FROM ${PARENT}\nCOPY --from=wheel / /wheel/\n")
    (img / "patch_wheel_stage.py").write_text(WHEEL_PATCH)
    shutil.copyfile(PATCH, img / "patch_cuda_sm12x.py")
    return root


def _prefetch(root: Path, cache: Path):
    r = run_cli("--root", str(root), "prefetch", IMAGE, "--cache", str(cache), "--json")
    assert r.code == 0, r.err
    return json.loads(r.out)["images"][0], r


@pytest.mark.parametrize("which, outcome", [("r12", "would-apply"), ("other", "failed"), ("none", "not-applicable")])
def test_the_runner_patch_is_checked_at_prefetch(served, tmp_path, which, outcome):
    root = _project(tmp_path, served, which)
    rep, r = _prefetch(root, tmp_path / "cache")
    (entry,) = rep["sources"]["VLLM"]["patch_check"]["runner"]
    assert (entry["patch"], entry["outcome"]) == ("patch_cuda_sm12x.py", outcome), entry
    notices = "\n".join(rep["notices"])
    plan = json.loads(run_cli("--root", str(root), "plan", IMAGE, "--json", "--no-engine").out)
    (pc,) = next(st for st in plan["stages"] if st["name"] == "runner")["patch_check"]
    assert (pc["patch"], pc["outcome"], pc["stale"]) == ("patch_cuda_sm12x.py", outcome, False)
    if outcome == "failed":  # loud: named at prefetch (stderr and the report) and in the plan
        assert "not found" in entry["message"] and "device_capability.major == 12" in entry["message"]
        assert "stage 'runner': patch patch_cuda_sm12x.py fails on the composed VLLM" in notices
        assert "stage 'runner': patch patch_cuda_sm12x.py fails on the composed VLLM" in r.err
        text = run_cli("--root", str(root), "plan", IMAGE, "--no-engine").out
        assert "   patch       failed          patch_cuda_sm12x.py" in text, text
    else:
        assert "patch_cuda_sm12x.py" not in notices
    if outcome == "not-applicable":
        assert "none of '_get_backend_priorities'" in entry["message"], entry["message"]
    # the wheel stage's own patch was checked first, on the same tree
    (wheel,) = rep["sources"]["VLLM"]["patch_check"]["wheel"]
    assert wheel["outcome"] == ("not-applicable" if which == "none" else "would-apply")


def test_a_source_without_prs_gets_a_version(served, tmp_path):
    root = _project(tmp_path, served, "other")
    rep, _ = _prefetch(root, tmp_path / "cache")
    v = rep["sources"]["VLLM"]
    assert v["prs"] == [] and v["commit"] == served["other"]
    # setuptools-scm's form for the commit, with its history counted (was null: fetched at depth 1)
    assert v["version"] == f"0.1.dev{served['count_other']}+g{served['other'][:9]}"
    lock = json.loads((root / "docker-images" / IMAGE / "lock.json").read_text())
    assert lock["sources"]["VLLM"]["version"] == v["version"]
    # offline from that cache: the same, no network
    again = run_cli("--root", str(root), "prefetch", IMAGE, "--cache", str(tmp_path / "cache"), "--offline")
    assert again.code == 0, again.err


def test_the_patch_check_never_extracts_the_whole_tarball(served, tmp_path, monkeypatch):
    """Issue 33 (3): the patches are checked on a lazily populated tree read from the git mirror, not on
    a second full unpack of the packed tarball; the verdicts are those of the full unpack (see
    test_patchcheck_lazy.py for the real tree)."""
    import tarfile

    def refuse(*_a, **_k):
        raise AssertionError("the patch check extracted the whole tarball")

    monkeypatch.setattr(tarfile.TarFile, "extractall", refuse)
    rep, r = _prefetch(_project(tmp_path, served, "r12"), tmp_path / "cache")
    assert [e["outcome"] for e in rep["sources"]["VLLM"]["patch_check"]["runner"]] == ["would-apply"]
    assert [e["outcome"] for e in rep["sources"]["VLLM"]["patch_check"]["wheel"]] == ["would-apply"]
    assert "checked on the whole tree extracted" not in r.err


def test_a_patch_the_lazy_tree_cannot_follow_is_checked_on_the_full_unpack(served, tmp_path):
    """A patch that starts a process at import (it could read the tree outside Python's open): the check
    falls back to the extracted tarball, says why in the log, and gives the same verdict."""
    root = _project(tmp_path, served, "other")
    img = root / "docker-images" / IMAGE
    (img / "patch_wheel_stage.py").write_text("import subprocess\nsubprocess.run(['true'], check=True)\n"
                                              + WHEEL_PATCH)
    r = run_cli("-v", "--root", str(root), "prefetch", IMAGE, "--cache", str(tmp_path / "cache"), "--json")
    assert r.code == 0, r.err
    rep = json.loads(r.out)["images"][0]
    assert "stage runner's patches checked on the whole tree extracted" in r.err, r.err
    assert "subprocess.Popen" in r.err
    (entry,) = rep["sources"]["VLLM"]["patch_check"]["runner"]
    assert entry["outcome"] == "failed" and "device_capability.major == 12" in entry["message"]
