"""arm64 under emulation: a rebuild of the small linux/arm64 definition (tests/fixtures/arm64: apt under QEMU,
an aarch64 wheel, the runner) with the stage store warm, against plain `docker buildx build --platform
linux/arm64` of the same Dockerfiles, contexts and args with a warm BuildKit cache (issue 32). Needs the test
bed's arm64 base and aarch64 handler (scripts/testbed.sh); skipped with the reason otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import Benchmark, sh

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from imagebuild.buildstep import builder as build_mod  # noqa: E402
from imagebuild.core import emulation  # noqa: E402
from imagebuild.definition import reader as definition  # noqa: E402
from imagebuild.fetch import packages  # noqa: E402
from imagebuild.plan import planner as plan  # noqa: E402

IMAGE = "ib-arm64"
BASE = "imagebuild-test/debian-arm64:bookworm"
_state: dict = {}


def _imagebuild(root: Path, *args: str) -> subprocess.CompletedProcess:
    return sh(sys.executable, "-m", "imagebuild", "--root", str(root), *args, env={**os.environ, **_state["env"]})


def _setup():
    tmp = Path(tempfile.mkdtemp(prefix="bench-arm64-"))
    root = tmp / "project"
    shutil.copytree(ROOT / "tests" / "fixtures" / "arm64", root)
    _state.update(tmp=tmp, root=root, env={"IMAGEBUILD_STAGES": str(tmp / "stages"),
                                           "IMAGEBUILD_STATE_DIR": str(tmp / "state")})
    _imagebuild(root, "prefetch", IMAGE)
    _imagebuild(root, "build", IMAGE, "--emulate", "--no-gate")
    defn = definition.load(root, IMAGE)
    p = plan.make_plan(defn)
    cmds, prev = [], None
    for st in p.stages:
        ctx = tmp / "ctx" / st.name
        build_mod.make_context(root, st, ctx, st.source_date_epoch)
        tag = f"imagebuild-bench/{IMAGE}:{st.name}"
        argv = ["docker", "buildx", "build", "--progress", "plain", "--provenance=false", "--network", "none",
                "--platform", "linux/arm64", "--load", "-t", tag, "-f", str(root / st.dockerfile)]
        for name, path in packages.stage_contexts(defn, st.name).items():
            argv += ["--build-context", f"{name}={path}"]
        args = {**st.build_args(), "SOURCE_DATE_EPOCH": str(st.source_date_epoch)}
        if st.parent_kind == "stage":
            args["PARENT"] = prev
        for k, v in args.items():
            argv += ["--build-arg", f"{k}={v}"]
        cmds.append(argv + [str(ctx)])
        prev = tag
    _state["cmds"] = cmds
    _baseline()  # warm: from here on every step of the baseline is a cache hit


def _teardown():
    subprocess.run(["docker", "image", "rm", *(f"imagebuild-bench/{IMAGE}:{s}" for s in ("base", "pydeps", "app")),
                    f"{IMAGE}:candidate"], capture_output=True)
    shutil.rmtree(_state["tmp"], ignore_errors=True)


def _ours():
    _imagebuild(_state["root"], "build", IMAGE, "--emulate", "--no-gate")


def _baseline():
    for argv in _state["cmds"]:
        sh(*argv)


def benchmarks():
    h = emulation.handler_for("arm64")
    have_base = subprocess.run(["docker", "image", "inspect", BASE], capture_output=True).returncode == 0
    if not (h and h.in_containers and have_base):
        print(f"bench_arm64: skipped (no aarch64 handler with the F flag, or no {BASE}: scripts/testbed.sh)",
              file=sys.stderr)
        return []
    return [Benchmark("arm64 runner chain rebuild under emulation (3 stages, store warm)", _ours, _baseline,
                      repeat=5, setup=_setup, teardown=_teardown,
                      note="baseline: docker buildx build --platform linux/arm64 of the same 3 stages, BuildKit "
                      "cache warm")]


if __name__ == "__main__":
    subprocess.run([sys.executable, str(Path(__file__).parent / "run.py"), "arm64"], check=True)
