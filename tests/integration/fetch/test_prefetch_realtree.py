"""Discovery and prefetch on the REAL vLLM tree: the public snapshot of local-inference-lab/vllm at
28be48fa944d8c58aeffd1ab1b56e27828c6b268 (../shared/upstream/vllm-28be48fa.tar.gz, sha256 below),
served from a loopback git daemon.

The snapshot is a `git archive`, not a clone, so the served commit is a STAND-IN: the same tree
committed here with a fixed identity and date (its SHA is not 28be48fa). Every assertion below is
read from the tree's CMake files (see ../shared/upstream/README.md). The dependency repositories
are stand-ins too (tiny repos with the tags and submodule paths the tree asks for), so their
commits differ from the SHAs the tree declares: prefetch reports each as an override, and the
test checks that it does.

Skipped (reported as skipped) where ../shared/upstream is absent, as on a fresh clone in CI.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from imagebuild.fetch import depcheck, fetchcontent, gitcache
from tests.conftest import run_cli
from tests.gitfixtures import GitDaemon, UpstreamFactory, git

SNAPSHOT_SHA256 = "434d26d8746a4d4e947d99b9d9f70dd5376f557977b4f0775d50a46e85b4afc4"
UPSTREAM = Path(os.environ.get("IMAGEBUILD_SHARED_UPSTREAM",
                               Path(__file__).resolve().parents[4] / "shared" / "upstream"))
SNAPSHOT = UPSTREAM / "vllm-28be48fa.tar.gz"
IMAGE = "pf10-realtree"
CPU_ONLY = {"oneDNN": "CPU-only (cmake/cpu_extension.cmake); this image builds for CUDA",
            "arm_compute": "CPU-only (Arm Compute Library for the aarch64 CPU backend); this image builds for CUDA"}

# what the tree declares, read from its files (../shared/upstream/README.md)
EXPECTED = {
    "cutlass": ("CMakeLists.txt", 355, "${CUTLASS_REVISION}", "v4.4.2", None, "VLLM_CUTLASS_SRC_DIR"),
    "vllm-flash-attn": ("cmake/external_projects/vllm_flash_attn.cmake", 43,
                        "bce29425653ec0fbc579d329883030e832d15ada", None, ["csrc/cutlass"], "VLLM_FLASH_ATTN_SRC_DIR"),
    "flashmla": ("cmake/external_projects/flashmla.cmake", 19, "a6ec2ba7bd0a7dff98b3f4d3e6b52b159c48d78b", None, None,
                 "FLASH_MLA_SRC_DIR"),
    "deepgemm": ("cmake/external_projects/deepgemm.cmake", 20, "891d57b4db1071624b5c8fa0d1e51cb317fa709f", None,
                 ["third-party/cutlass", "third-party/fmt"], "DEEPGEMM_SRC_DIR"),
    "qutlass": ("cmake/external_projects/qutlass.cmake", 17, "830d2c4537c7396e14a02a46fbddd18b5d107c65", None, None,
                "QUTLASS_SRC_DIR"),
    "triton_kernels": ("cmake/external_projects/triton_kernels.cmake", 17, "${DEFAULT_TRITON_KERNELS_TAG}", "v3.6.0",
                       None, "TRITON_KERNELS_SRC_DIR"),
}

pytestmark = pytest.mark.skipif(not SNAPSHOT.is_file(), reason=f"the real vLLM snapshot is not here ({SNAPSHOT})")


@pytest.fixture(autouse=True)
def _fast(monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_RETRY_DELAY", "0.05")
    monkeypatch.setenv("IMAGEBUILD_GIT_RETRIES", "3")
    monkeypatch.delenv("IMAGEBUILD_CACHE", raising=False)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The snapshot committed as a stand-in commit and served, plus stand-in dependency repos."""
    assert hashlib.sha256(SNAPSHOT.read_bytes()).hexdigest() == SNAPSHOT_SHA256, "not the expected snapshot"
    base = tmp_path_factory.mktemp("realtree")
    served = base / "served"
    served.mkdir()
    with GitDaemon(served) as d:
        f = UpstreamFactory(served, d)
        vllm = f.create("vllm", {"README.md": "placeholder\n"}, message="placeholder")
        with tarfile.open(SNAPSHOT) as tf:
            tf.extractall(base / "x", filter="data")
        work = vllm.work
        git("rm", "-q", "-r", ".", cwd=work)
        subprocess.run(["cp", "-a", f"{base / 'x' / 'vllm'}/.", str(work)], check=True)
        git("add", "-A", ".", cwd=work)
        stand_in = vllm.commit({}, "stand-in commit: the tree of local-inference-lab/vllm 28be48fa (snapshot)")
        # stand-in dependencies: only what the tree asks of them (tags, subfolders, submodule paths)
        cutlass = f.create("cutlass", {"include/cutlass/cutlass.h": "// stand-in\n"})
        cutlass.tag("v4.4.2")
        triton = f.create("triton", {"python/triton_kernels/triton_kernels/__init__.py": "# stand-in\n"})
        triton.tag("v3.6.0")
        fmt = f.create("fmt", {"include/fmt/core.h": "// stand-in\n"})
        ck = f.create("composable_kernel", {"ck.hpp": "// stand-in, never asked for\n"})
        fa = f.create("flash-attention", {"CMakeLists.txt": "project(vllm_flash_attn)\n"})
        fa.add_submodule("csrc/cutlass", cutlass)
        fa.add_submodule("csrc/composable_kernel", ck)
        dg = f.create("DeepGEMM", {"CMakeLists.txt": "project(deep_gemm)\n"})
        dg.add_submodule("third-party/cutlass", cutlass)
        dg.add_submodule("third-party/fmt", fmt)
        mla = f.create("FlashMLA", {"setup.py": "# stand-in\n"})
        qut = f.create("qutlass", {"CMakeLists.txt": "project(qutlass)\n"})
        yield {"base": base, "daemon": d, "vllm": vllm, "stand_in": stand_in, "cutlass": cutlass, "triton": triton,
               "fa": fa, "dg": dg, "mla": mla, "qut": qut, "ck": ck}


def _project(base: Path, real: dict, *, deps: bool) -> Path:
    root = base / "project"
    img = root / "docker-images" / IMAGE
    img.mkdir(parents=True, exist_ok=True)
    env = ["BASE_IMAGE=imagebuild-test/busybox:1",
           "# STAND-IN: the snapshot's tree committed here (the real commit is 28be48fa944d8c58aeffd1ab1b56e27828c6b268)",
           f"VLLM_REPO={real['vllm'].url()}", f"VLLM_REF={real['stand_in']}", "VLLM_REQUIRE_RUST_FRONTEND=1"]
    sources = ["sources:", "  VLLM:", "    cargo_switch: VLLM_REQUIRE_RUST_FRONTEND", "    exclude:"] + [f'      {n}: "{r}"' for n, r in CPU_ONLY.items()]
    if deps:  # stand-in repositories for every CUDA dependency (their commits are not the declared ones)
        env += [f"CUTLASS_REPO={real['cutlass'].url()}", "CUTLASS_REF=v4.4.2",
                f"FLASH_ATTN_REPO={real['fa'].url()}", f"FLASH_ATTN_REF={real['fa'].head()}  # override: a stand-in head",
                f"FLASHMLA_REPO={real['mla'].url()}", f"FLASHMLA_REF={real['mla'].head()}  # override: a stand-in head",
                f"DEEPGEMM_REPO={real['dg'].url()}", f"DEEPGEMM_REF={real['dg'].head()}  # override: a stand-in head",
                f"QUTLASS_REPO={real['qut'].url()}", f"QUTLASS_REF={real['qut'].head()}  # override: a stand-in head",
                f"TRITON_KERNELS_REPO={real['triton'].url()}", "TRITON_KERNELS_REF=v3.6.0"]
        sources += ["  CUTLASS: {dependency_of: VLLM}",
                    "  FLASH_ATTN: {dependency_of: VLLM, declares: vllm-flash-attn}",
                    "  FLASHMLA: {dependency_of: VLLM}",
                    "  DEEPGEMM: {dependency_of: VLLM}",
                    "  QUTLASS: {dependency_of: VLLM}",
                    "  TRITON_KERNELS: {dependency_of: VLLM, subdir: python/triton_kernels/triton_kernels}"]
    (img / "versions.env").write_text("\n".join(env) + "\n")
    (img / "image.yaml").write_text("platform: linux/amd64\n" + "\n".join(sources) + "\n"
                                    "stages:\n  - name: wheel\n    from: BASE_IMAGE\n    sources: [VLLM]\n")
    (img / "Dockerfile.wheel").write_text("ARG PARENT\nFROM ${PARENT}\nRUN true\n")
    return root


def test_discovery_on_the_real_tree(real, tmp_path):
    """Each dependency with its file:line, commit or resolved tag, submodule paths, override names and
    how the tree reads them, and the CPU-only ones with the branch that makes them CPU-only."""
    cache = gitcache.Cache(tmp_path / "cache")
    m = cache.mirror(real["vllm"].url())
    m.fetch([real["stand_in"]], "VLLM", shallow=True)
    scan = fetchcontent.scan(m, real["stand_in"])
    decls = scan.declarations
    assert set(decls) == set(EXPECTED) | {"onednn", "arm_compute"}
    for name, (file, line, tag, value, subs, override) in EXPECTED.items():
        dcl = decls[name]
        assert (dcl.file, dcl.line, dcl.tag) == (file, line, tag), name
        assert dcl.tag_value == (value or tag), name
        assert dcl.submodule_paths == subs, name
        assert dcl.override == override, name
        ov, err, _ = depcheck.override_for(scan, dcl, None, name.upper(), name)
        assert err is None and ov["name"] == override and ov["via"] == "env", name
        assert dcl.kind == "declare" and dcl.alternatives == [], name
        assert any("VLLM_GPU_LANG STREQUAL \"CUDA\"" in w for w in dcl.when) or name == "cutlass"
    assert decls["cutlass"].tag_resolved.origin == ["CMakeLists.txt:341"]
    assert decls["triton_kernels"].tag_resolved.origin == ["cmake/external_projects/triton_kernels.cmake:3"]
    env_at, var_at = scan.how_read("TRITON_KERNELS_SRC_DIR")
    assert env_at and not var_at  # read from the environment only
    assert scan.how_read("VLLM_CUTLASS_SRC_DIR")[1]  # also a CMake variable (-D works)
    # vllm-flash-attn's submodules come through a variable set in two branches
    assert decls["vllm-flash-attn"].submodules == ["${VLLM_FLASH_ATTN_GIT_SUBMODULES}"]
    # the CPU-only ones: oneDNN declared twice with other values, arm_compute populated directly
    one = decls["onednn"]
    assert (one.file, one.line, one.tag) == ("cmake/cpu_extension.cmake", 299,
                                             "9c5be1cc59e368aebf0909e6cf20f981ea61462a")
    assert [(a.line, a.tag) for a in one.alternatives] == [(307, "v3.10")]
    acl = decls["arm_compute"]
    assert (acl.kind, acl.file, acl.line, acl.tag) == ("populate", "cmake/cpu_extension.cmake", 239, "v52.6.0")
    for dcl in (one, acl):
        assert 'CMakeLists.txt:135: if (VLLM_TARGET_DEVICE STREQUAL "cpu")' in dcl.when
    assert depcheck.guard_names(acl) == ["ACL_ROOT_DIR"]


def test_prefetch_the_real_tree_names_what_is_missing(real, tmp_path):
    root = _project(tmp_path, real, deps=False)
    r = run_cli("--root", str(root), "prefetch", "--cache", str(tmp_path / "c"))
    assert r.code == 2, r.err
    for name, (file, line, _tag, _value, _subs, override) in EXPECTED.items():
        assert f"'{name}' at {file}:{line}" in r.err, name
        assert f"env: {override}" in r.err, name
    assert "GIT_TAG ${CUTLASS_REVISION} = v4.4.2" in r.err and "TRITON_KERNELS_REF=v3.6.0" in r.err
    # the CPU-only ones are excluded, so not named
    assert "'oneDNN'" not in r.err and "'arm_compute'" not in r.err
    assert not (root / "docker-images" / IMAGE / "lock.json").exists()


def test_prefetch_and_plan_the_real_tree_with_stand_in_dependencies(real, tmp_path):
    root = _project(tmp_path, real, deps=True)
    r = run_cli("--root", str(root), "prefetch", "--cache", str(tmp_path / "c"), "--json")
    assert r.code == 0, r.err
    rep = json.loads(r.out)["images"][0]
    s = rep["sources"]
    # overrides as the tree reads them
    assert {n: e["override"]["name"] for n, e in s.items() if e["override"]} == {
        "CUTLASS": "VLLM_CUTLASS_SRC_DIR", "FLASH_ATTN": "VLLM_FLASH_ATTN_SRC_DIR", "FLASHMLA": "FLASH_MLA_SRC_DIR",
        "DEEPGEMM": "DEEPGEMM_SRC_DIR", "QUTLASS": "QUTLASS_SRC_DIR", "TRITON_KERNELS": "TRITON_KERNELS_SRC_DIR"}
    # submodules as the tree declares them: flash-attention's composable_kernel is not packed
    assert [x["path"] for x in s["FLASH_ATTN"]["submodules"]] == ["csrc/cutlass"]
    assert [x["path"] for x in s["DEEPGEMM"]["submodules"]] == ["third-party/cutlass", "third-party/fmt"]
    # tags through variables compared: the stand-in tags match; the stand-in commits are reported
    assert s["CUTLASS"]["declared_as"]["matches"] is True and s["TRITON_KERNELS"]["declared_as"]["matches"] is True
    assert s["FLASH_ATTN"]["declared_as"]["matches"] is False
    assert any(n.startswith("FLASH_ATTN: pinned") and "differs from bce29425653e" in n for n in rep["notices"])
    assert [x["name"] for x in s["VLLM"]["excluded"]] == ["arm_compute", "oneDNN"]
    # the snapshot has no rust/Cargo.lock: no crates vendored, the Rust frontend switched off
    assert s["VLLM"]["cargo"] is None
    assert "VLLM_REQUIRE_RUST_FRONTEND=0\n" in (root / "docker-images" / IMAGE / "versions.env").read_text()
    assert {"key": "VLLM_REQUIRE_RUST_FRONTEND", "from": "1", "to": "0"} in rep["pinned"]
    assert any("'oneDNN' is declared more than once" in n for n in rep["notices"])
    plan = json.loads(run_cli("--root", str(root), "plan", IMAGE, "--no-engine", "--json").out)
    mounts = plan["stages"][0]["mounts"]
    assert len(mounts["mounts"]) == 7 and [x["name"] for x in mounts["excluded"]] == ["arm_compute", "oneDNN"]
