"""build: a no-op rebuild (every stage key present) of the five-stage test image, against a plain
`docker buildx build` of the same five fully cached stages (same Dockerfiles, args, contexts,
--network none, --load), and the cost of the digest-stable OCI export of one stage."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import Benchmark, sh

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from imagebuild import build as build_mod  # noqa: E402
from imagebuild import definition, plan  # noqa: E402
from tests.buildfixtures import IMAGE, remove_images, staged_project  # noqa: E402

_state: dict = {}


def _setup():
    tmp = Path(tempfile.mkdtemp(prefix="bench-build-"))
    root = staged_project(tmp / "project")
    _state.update(tmp=tmp, root=root)
    sh(sys.executable, "-m", "imagebuild", "--root", str(root), "build", IMAGE, "--no-gate")
    # the baseline's inputs: the very contexts and args imagebuild passes
    p = plan.make_plan(definition.load(root, IMAGE))
    lock = build_mod.lock_mod.read(root / "docker-images" / IMAGE)
    epoch = build_mod.source_date_epoch(lock)
    cmds = []
    for st in p.stages:
        ctx = tmp / "ctx" / st.name
        build_mod.make_context(root, st, ctx, epoch)
        src = tmp / "src" / st.name
        src.mkdir(parents=True)
        for vf in build_mod.verify_sources(root, definition.load(root, IMAGE), lock, st.sources, st.name):
            shutil.copy(vf.path, src / vf.name)
        argv = ["docker", "buildx", "build", "--progress", "plain", "--provenance=false", "--network", "none",
                "--load", "-t", f"imagebuild-bench/{IMAGE}:{st.name}", "-f", str(root / st.dockerfile), "--build-context", f"imagebuild-src={src}"]
        args = {**st.build_args(), "SOURCE_DATE_EPOCH": str(epoch),
                **build_mod._parallel_args(st, build_mod.guards.host_jobs(), False)}
        for k, v in args.items():
            argv += ["--build-arg", f"{k}={v}"]
        cmds.append(argv + [str(ctx)])
    _state["cmds"] = cmds
    _baseline()  # warm: the baseline's own tags exist, every step is a cache hit from here on


def _teardown():
    remove_images(f"imagebuild/{IMAGE}", IMAGE, f"imagebuild-bench/{IMAGE}")
    shutil.rmtree(_state["tmp"], ignore_errors=True)


def _ours():
    sh(sys.executable, "-m", "imagebuild", "--root", str(_state["root"]), "build", IMAGE, "--no-gate")


def _baseline():
    for argv in _state["cmds"]:
        sh(*argv)


def _oci_stage():
    sh(sys.executable, "-m", "imagebuild", "--root", str(_state["root"]), "build", IMAGE, "--no-gate",
       "--from", "runner", "--no-cache", "--reproducible", "final")


def _plain_stage():
    sh(sys.executable, "-m", "imagebuild", "--root", str(_state["root"]), "build", IMAGE, "--no-gate",
       "--from", "runner", "--no-cache", "--reproducible", "none")


def benchmarks():
    return [
        Benchmark("build no-op rebuild (5 stages, all keys present)", _ours, _baseline, repeat=5,
                  setup=_setup, teardown=_teardown,
                  note="baseline: docker buildx build of the 5 fully cached stages"),
        Benchmark("build one no-compile stage --no-cache: OCI+rewrite-timestamp vs plain --load", _oci_stage,
                  _plain_stage, repeat=3, setup=_setup, teardown=_teardown,
                  note="cost of the digest-stable export (busybox-sized image)"),
    ]


if __name__ == "__main__":
    subprocess.run([sys.executable, str(Path(__file__).parent / "run.py"), "build"], check=True)
