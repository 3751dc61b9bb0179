"""The REAL glm53-jovian-r12 definition prefetched and planned against the real upstream trees.

../shared/upstream's snapshots of local-inference-lab/vllm (28be48fa) and local-inference-lab/b12x
(36bce2c1) are served from a loopback `git daemon` as the vLLM and b12x remotes: git's
`url.<loopback>.insteadOf https://github.com/` sends every https://github.com/... URL of the real
versions.env there, so the definition's repository URLs are used unchanged.

STAND-INS (only for what no machine here has; each is marked where it is made):
  - the vLLM and b12x commits: the snapshots are `git archive`s, so each tree is committed here
    (a stand-in commit, on the branch the real pin follows); their SHAs replace the real base SHAs;
  - the PR heads 550-557 and 260, 267-270: stand-in commits (one marker file each) served as
    refs/pull/N/head; versions.env keeps the real bare numbers, which prefetch pins;
  - the tree pins VLLM_TREE and B12X_TREE: the trees the stand-in heads compose to (computed here with
    git merge-tree); the real contract trees are first shown to be refused on the stand-ins;
  - the FetchContent dependencies: tiny stand-in repositories with the tags and submodule paths the
    tree asks for; SHA pins that do not exist there are replaced by the stand-in heads;
  - the base image and platform: the local test busybox and linux/amd64 (no arm64 CUDA image and no
    registry here), and the package stanzas (python/requirements/apt) are left out: package prefetch
    needs the CUDA index and the Ubuntu archive (tests/integration/fetch/test_packages.py covers it).
Everything else is the real definition: sources, exclusions, overrides, stages, Dockerfiles, patches.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests import realtrees
from tests.conftest import run_cli, tree_state
from tests.gitfixtures import GitDaemon, UpstreamFactory, free_port, git

ROOT = realtrees.ROOT
IMAGE = "glm53-jovian-r12"
VLLM_PRS = (550, 552, 553, 554, 555, 557)
B12X_PRS = (260, 267, 268, 269, 270)  # the lab's published r12 contract


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base = tmp_path_factory.mktemp("real-remotes")
    trees = base / "trees"
    vllm_tree = realtrees.extract(realtrees.VLLM, trees)
    b12x_tree = realtrees.extract(realtrees.B12X, trees)
    root = base / "served"
    root.mkdir()
    with GitDaemon(root) as d:
        f = UpstreamFactory(root, d)
        vllm = f.create("local-inference-lab/vllm")
        vllm_base = realtrees.stand_in_commit(vllm, vllm_tree, "dev/jovian-judgement")
        for n in VLLM_PRS:  # STAND-IN PR heads
            vllm.pull_request(n, {f"imagebuild-stand-in/pr{n}.txt": f"stand-in head of PR {n}\n"})
        b12x = f.create("local-inference-lab/b12x")
        b12x_base = realtrees.stand_in_commit(b12x, b12x_tree, "master")
        for n in B12X_PRS:
            b12x.pull_request(n, {f"imagebuild-stand-in/pr{n}.txt": f"stand-in head of PR {n}\n"})
        # STAND-IN dependency repositories: only what the tree asks of them
        cutlass = f.create("NVIDIA/cutlass", {"include/cutlass/cutlass.h": "// stand-in\n"})
        cutlass.tag("v4.4.2")
        fmt = f.create("fmtlib/fmt", {"include/fmt/core.h": "// stand-in\n"})
        ck = f.create("ROCm/composable_kernel", {"ck.hpp": "// stand-in, never asked for\n"})
        fa = f.create("vllm-project/flash-attention", {"CMakeLists.txt": "project(vllm_flash_attn)\n"})
        fa.add_submodule("csrc/cutlass", cutlass, url="https://github.com/NVIDIA/cutlass.git")
        fa.add_submodule("csrc/composable_kernel", ck, url="https://github.com/ROCm/composable_kernel.git")
        dg = f.create("deepseek-ai/DeepGEMM", {"CMakeLists.txt": "project(deep_gemm)\n"})
        dg.add_submodule("third-party/cutlass", cutlass, url="https://github.com/NVIDIA/cutlass.git")
        dg.add_submodule("third-party/fmt", fmt, url="https://github.com/fmtlib/fmt.git")
        triton = f.create("triton-lang/triton", {"python/triton_kernels/triton_kernels/__init__.py": "# stand-in\n"})
        triton.tag("v3.5.1")
        heads = {
            "FLASH_ATTN": fa.head(), "DEEPGEMM": dg.head(),
            "FLASHMLA": f.create("vllm-project/FlashMLA", {"setup.py": "# stand-in\n"}).head(),
            "QUTLASS": f.create("IST-DASLab/qutlass", {"CMakeLists.txt": "project(qutlass)\n"}).head(),
            "MSA": f.create("vllm-project/MSA", {"setup.py": "# stand-in\n"}).head(),
            "TML_FA4": f.create("vllm-project/tml-fa4", {"setup.py": "# stand-in\n"}).head(),
            "FLASHKDA": f.create("vllm-project/FlashKDA", {"setup.py": "# stand-in\n"}).head(),
        }
        trees = {"VLLM": _composed_tree(vllm, vllm_base, VLLM_PRS), "B12X": _composed_tree(b12x, b12x_base, B12X_PRS)}
        yield {"daemon": d, "vllm": vllm_base, "b12x": b12x_base, "heads": heads, "trees": trees}
    shutil.rmtree(base, ignore_errors=True)  # ~350 MB of trees and repositories: do not keep them around


def _composed_tree(up, base: str, prs) -> str:
    """The tree of ``base`` with the served PR heads merged in order, computed with git itself."""
    cur = base
    tree = git("rev-parse", f"{base}^{{tree}}", cwd=up.bare)
    for n in prs:
        head = git("rev-parse", f"refs/pull/{n}/head", cwd=up.bare)
        tree = git("merge-tree", "--write-tree", cur, head, cwd=up.bare).splitlines()[0]
        cur = git("commit-tree", tree, "-p", cur, "-p", head, "-m", f"merge {n}", cwd=up.bare)
    return tree


def _project(tmp: Path, served: dict, *, real_trees: bool = False) -> Path:
    root = tmp / "project"
    shutil.copytree(ROOT / "docker-images" / IMAGE, root / "docker-images" / IMAGE)
    shutil.copytree(ROOT / "patches-eugr", root / "patches-eugr")
    img = root / "docker-images" / IMAGE
    env = (img / "versions.env").read_text()
    stand_ins = {  # STAND-IN pins: only those the served stand-ins cannot honour
        "CUDA_BASE": "imagebuild-test/busybox:1",
        "VLLM_REF": f"dev/jovian-judgement@{served['vllm']}",
        "B12X_REF": f"master@{served['b12x']}",
        **{f"{k}_REF": v for k, v in served["heads"].items()},
        **({} if real_trees else {f"{k}_TREE": v for k, v in served["trees"].items()}),
    }
    for key, value in stand_ins.items():
        why = "; override: a stand-in head, the declared commit is not in the stand-in repository" \
            if key in {f"{k}_REF" for k in served["heads"]} else ""
        env, n = re.subn(rf"^{key}=\S+", f"{key}={value}  # STAND-IN (tests/integration/fetch/{Path(__file__).name}){why}",
                         env, count=1, flags=re.M)
        assert n == 1, key
    (img / "versions.env").write_text(env)
    y = (img / "image.yaml").read_text()
    y = y.replace("platform: linux/arm64", "platform: linux/amd64  # STAND-IN: no arm64 base here")
    y = re.sub(r"^python:\n(?:  .*\n)+\n", "", y, flags=re.M)  # STAND-IN: no package prefetch
    y = re.sub(r"^    apt: \S+.*\n", "", y, flags=re.M)
    y = re.sub(r"    requirements:\n(?:      .*\n)+", "", y)
    assert "requirements" not in y and "apt:" not in y and "python:" not in y
    (img / "image.yaml").write_text(y)
    return root


@pytest.fixture
def github(monkeypatch, served):
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", f"url.git://127.0.0.1:{served['daemon'].port}/.insteadOf")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", "https://github.com/")
    monkeypatch.setenv("IMAGEBUILD_GITHUB_API", f"http://127.0.0.1:{free_port()}")  # nothing listens: no PR states
    monkeypatch.setenv("IMAGEBUILD_RETRY_DELAY", "0.05")
    monkeypatch.setenv("IMAGEBUILD_GIT_RETRIES", "2")


def test_prefetch_plan_and_dry_run_of_the_real_definition(served, github, engine_ready, tmp_path, monkeypatch):
    # the real tree pins (the r12 contract's) are refused on the stand-in heads, both in one run, nothing written
    real = _project(tmp_path / "real-trees", served, real_trees=True)
    before = tree_state(real)
    r = run_cli("--root", str(real), "prefetch", IMAGE, "--cache", str(tmp_path / "cache"))
    assert r.code == 2, r.err
    assert "VLLM_TREE" in r.err and "not the pinned tree 237bc2b7bb297ab69b83704fad0b9f6628bfcde8" in r.err
    assert "B12X_TREE" in r.err and "not the pinned tree aace94c2fcc0657c1aa255e9480277c8f30240fc" in r.err
    assert f"is tree {served['trees']['VLLM']}" in r.err and f"is tree {served['trees']['B12X']}" in r.err
    assert tree_state(real) == before
    assert not (real / "deps-src").exists()
    root = _project(tmp_path, served)
    r = run_cli("--root", str(root), "prefetch", IMAGE, "--cache", str(tmp_path / "cache"), "--json")
    assert r.code == 0, r.err
    rep = json.loads(r.out)["images"][0]
    s = rep["sources"]
    assert set(s) == {"VLLM", "B12X", "CUTLASS", "FLASH_ATTN", "FLASHMLA", "DEEPGEMM", "QUTLASS", "TRITON_KERNELS",
                      "MSA", "TML_FA4", "FLASHKDA"}
    # the PR heads were pinned from bare numbers and merged in order
    assert [p["number"] for p in s["VLLM"]["prs"]] == list(VLLM_PRS)
    assert [p["number"] for p in s["B12X"]["prs"]] == list(B12X_PRS)
    assert {n: (s[n]["source_tree"], s[n]["tree_pin"]) for n in ("VLLM", "B12X")} == {
        n: (t, t) for n, t in served["trees"].items()}
    env = (root / "docker-images" / IMAGE / "versions.env").read_text()
    assert re.search(r'^VLLM_PRS="550@[0-9a-f]{40} 552@[0-9a-f]{40} 553@', env, re.M)
    # exclusions with their reasons, submodules as declared, overrides as the tree reads them
    assert [x["name"] for x in s["VLLM"]["excluded"]] == ["arm_compute", "oneDNN"]
    assert all("CPU-only" in x["reason"] for x in s["VLLM"]["excluded"])
    assert [x["path"] for x in s["FLASH_ATTN"]["submodules"]] == ["csrc/cutlass"]
    assert [x["path"] for x in s["DEEPGEMM"]["submodules"]] == ["third-party/cutlass", "third-party/fmt"]
    assert {n: e["override"]["name"] for n, e in s.items() if e.get("override")}.items() >= {
        "CUTLASS": "VLLM_CUTLASS_SRC_DIR", "FLASH_ATTN": "VLLM_FLASH_ATTN_SRC_DIR", "FLASHMLA": "FLASH_MLA_SRC_DIR",
        "DEEPGEMM": "DEEPGEMM_SRC_DIR", "QUTLASS": "QUTLASS_SRC_DIR", "TRITON_KERNELS": "TRITON_KERNELS_SRC_DIR"}.items()
    notices = "\n".join(rep["notices"])
    # the three the r12 fork declares and this older snapshot does not are reported, not dropped
    for name in ("MSA", "TML_FA4", "FLASHKDA"):
        assert name in notices, notices
    # plan: stages in order, the vllm stage mounts the fork and its nine dependencies
    plan = json.loads(run_cli("--root", str(root), "plan", IMAGE, "--json").out)
    assert [st["name"] for st in plan["stages"]] == ["apt", "torch", "vllm-wheel", "b12x-wheel", "runner"]
    mounts = {st["name"]: st.get("mounts") for st in plan["stages"]}
    assert len(mounts["vllm-wheel"]["mounts"]) == 10
    assert [x["name"] for x in mounts["vllm-wheel"]["excluded"]] == ["arm_compute", "oneDNN"]
    assert plan["unpinned"] == []
    # every patch of the vllm-wheel stage was checked on the composed tree at prefetch: in the lock and
    # in the plan, not-applicable ones with their reason, none failing (as `imagebuild patch --check`)
    checked = s["VLLM"]["patch_check"]["vllm-wheel"]
    assert len(checked) == 12 and not any(c["outcome"] == "failed" for c in checked), checked
    na = [c for c in checked if c["outcome"] == "not-applicable"]
    assert na and all(c["message"] for c in na)
    pc = next(st for st in plan["stages"] if st["name"] == "vllm-wheel")["patch_check"]
    assert [(c["patch"], c["outcome"]) for c in pc] == [(c["patch"], c["outcome"]) for c in checked]
    assert not any(c["stale"] for c in pc)
    # the runner's own patch (patch_cuda_sm12x.py, applied to the installed vllm) was checked on the composed
    # tree's vllm/ too, after the vllm-wheel patches: this snapshot has the sm12x MLA branch in another shape
    # (`major in (10, 12)`), so it fails, said at prefetch and in the plan (it used to be skipped, silently)
    (rc,) = s["VLLM"]["patch_check"]["runner"]
    assert (rc["patch"], rc["outcome"]) == ("patch_cuda_sm12x.py", "failed"), rc
    assert "stage 'runner': patch patch_cuda_sm12x.py fails on the composed VLLM" in notices
    rpc = next(st for st in plan["stages"] if st["name"] == "runner")["patch_check"]
    assert [(c["patch"], c["outcome"]) for c in rpc] == [("patch_cuda_sm12x.py", "failed")]
    # every composed source has a version (VLLM and B12X: setuptools-scm's form of the composed commit)
    assert all(s[n]["version"] and s[n]["version"].endswith("+g" + s[n]["commit"][:9]) for n in ("VLLM", "B12X"))
    text_plan = run_cli("--root", str(root), "plan", IMAGE).out
    assert f"   patch       not-applicable  {na[0]['patch']}" in text_plan, text_plan
    # a patch edited after prefetch is marked stale
    edited = root / "patches-eugr" / na[0]["patch"]
    edited.write_text(edited.read_text() + "\n# edited\n")
    pc = next(st for st in json.loads(run_cli("--root", str(root), "plan", IMAGE, "--json").out)["stages"]
              if st["name"] == "vllm-wheel")["patch_check"]
    assert [c["stale"] for c in pc if c["patch"] == na[0]["patch"]] == [True]
    # dry run: every stage would run with --network none (it builds nothing: the disk guard may be low)
    monkeypatch.setenv("IMAGEBUILD_MIN_FREE_GB", "0")
    dry = run_cli("--root", str(root), "build", IMAGE, "--dry-run", "--json")
    assert dry.code == 0, dry.err
    doc = json.loads(dry.out)
    assert [st["name"] for st in doc["stages"]] == ["apt", "torch", "vllm-wheel", "b12x-wheel", "runner"]
    assert all(st["network"] in (False, "none") for st in doc["stages"]), doc["stages"]
    text = run_cli("--root", str(root), "build", IMAGE, "--dry-run").out
    print(text)
    assert text.count("; network none)") == 5, text
    # every docker invocation of the build, shown: each stage with --network none
    cmds = [ln for ln in text.splitlines() if ln.strip().startswith("docker buildx build")]
    assert len(cmds) == 5 and all(" --network none " in c for c in cmds), text
