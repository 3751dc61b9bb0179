"""build: (1) a no-op rebuild (every stage key present) of the five-stage test image, against a
plain `docker buildx build` of the same five fully cached stages; (2) a whole chain of three
300 MB stages rebuilt with --no-cache, every stage exported into the stage store with its file times clamped
(layerclamp.py),
against the same chain built with plain `docker buildx build --load` (issue 9: at most 1.3x)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import Benchmark, sh

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from imagebuild.buildstep import builder as build_mod  # noqa: E402
from imagebuild.definition import reader as definition  # noqa: E402
from imagebuild.plan import planner as plan  # noqa: E402
from tests.buildfixtures import IMAGE, remove_images, staged_project  # noqa: E402

_state: dict = {}


def _imagebuild(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return sh(sys.executable, "-m", "imagebuild", "--root", str(root), *args,
              env={**os.environ, **(env or {})})


# --------------------------------------------------------------------------------------------- no-op


def _setup():
    tmp = Path(tempfile.mkdtemp(prefix="bench-build-"))
    root = staged_project(tmp / "project")
    _state.update(tmp=tmp, root=root, env={"IMAGEBUILD_STAGES": str(tmp / "stages")})
    _imagebuild(root, "build", IMAGE, "--no-gate", env=_state["env"])
    # the baseline's inputs: the very contexts and args imagebuild passes
    defn = definition.load(root, IMAGE)
    p = plan.make_plan(defn)
    cmds = []
    prev = None
    for st in p.stages:
        ctx = tmp / "ctx" / st.name
        build_mod.make_context(root, st, ctx, st.source_date_epoch)
        src = tmp / "src" / st.name
        src.mkdir(parents=True)
        for vf in build_mod.verify_sources(defn, st):
            shutil.copy(vf.path, src / vf.name)
        tag = f"imagebuild-bench/{IMAGE}:{st.name}"
        argv = ["docker", "buildx", "build", "--progress", "plain", "--provenance=false", "--network", "none",
                "--load", "-t", tag, "-f", str(root / st.dockerfile), "--build-context", f"imagebuild-src={src}"]
        args = {**st.build_args(), "SOURCE_DATE_EPOCH": str(st.source_date_epoch),
                **build_mod._parallel_args(st, build_mod.guards.host_jobs(), False)}
        if st.parent_kind == "stage":
            args["PARENT"] = prev
        for k, v in args.items():
            argv += ["--build-arg", f"{k}={v}"]
        cmds.append(argv + [str(ctx)])
        prev = tag
    _state["cmds"] = cmds
    _baseline()  # warm: the baseline's own tags exist, every step is a cache hit from here on


def _teardown():
    remove_images(f"imagebuild/{IMAGE}", IMAGE, f"imagebuild-bench/{IMAGE}")
    shutil.rmtree(_state["tmp"], ignore_errors=True)


def _ours():
    _imagebuild(_state["root"], "build", IMAGE, "--no-gate", env=_state["env"])


def _baseline():
    for argv in _state["cmds"]:
        sh(*argv)


# --------------------------------------------------------------------------------------------- chain

CHAIN = "bench-chain"
CHAIN_STAGES = ("one", "two", "three")
# ~300 MB a stage: 150 MB that does not compress (like compiled kernels; pseudo-random from a fixed
# seed, so that two builds have the same content) and 150 MB of text
CHAIN_DOCKERFILE = """\
ARG PARENT
FROM ${PARENT}
ARG N
RUN mkdir -p /data/$N \\
    && python3 -c "import random, sys; random.seed('$N'); sys.stdout.buffer.write(random.randbytes(150 << 20))" \\
       > /data/$N/blob \\
    && seq 1 21000000 > /data/$N/text
"""


def _chain_project(root: Path) -> Path:
    d = root / "docker-images" / CHAIN
    d.mkdir(parents=True)
    (d / "versions.env").write_text("BASE_IMAGE=imagebuild-test/debian:bookworm\n" +
                                    "".join(f"N_{n.upper()}={n}\n" for n in CHAIN_STAGES))
    stages = []
    parent = "BASE_IMAGE"
    for n in CHAIN_STAGES:
        (d / f"Dockerfile.{n}").write_text(CHAIN_DOCKERFILE.replace("ARG N\n", f"ARG N_{n.upper()}\n")
                                           .replace("$N", f"$N_{n.upper()}"))
        stages.append(f"  - name: {n}\n    from: {parent}\n")
        parent = n
    (d / "image.yaml").write_text("platform: linux/amd64\nstages:\n" + "".join(stages))
    return root


def _chain_setup():
    tmp = Path(tempfile.mkdtemp(prefix="bench-chain-"))
    root = _chain_project(tmp / "project")
    _state.update(ctmp=tmp, croot=root, cenv={"IMAGEBUILD_STAGES": str(tmp / "stages"),
                                              "IMAGEBUILD_STATE_DIR": str(tmp / "state")},
                  identities=[])
    p = plan.make_plan(definition.load(root, CHAIN))
    empty = tmp / "context"
    empty.mkdir()
    cmds, prev = [], "imagebuild-test/debian:bookworm"
    for st in p.stages:
        tag = f"imagebuild-bench/{CHAIN}:{st.name}"
        argv = ["docker", "buildx", "build", "--progress", "plain", "--provenance=false", "--sbom=false",
                "--network", "none", "--no-cache", "--load", "-t", tag, "-f", str(root / st.dockerfile),
                "--build-arg", f"PARENT={prev}", "--build-arg", f"N_{st.name.upper()}={st.name}",
                "--build-arg", f"SOURCE_DATE_EPOCH={st.source_date_epoch}", str(empty)]
        cmds.append(argv)
        prev = tag
    _state["chain_cmds"] = cmds


def _chain_teardown():
    remove_images(f"imagebuild/{CHAIN}", CHAIN, f"imagebuild-bench/{CHAIN}")
    shutil.rmtree(_state["ctmp"], ignore_errors=True)
    ids = _state.get("identities") or []
    if len(set(ids)) != 1:
        print(f"bench-chain: NOT REPRODUCIBLE: the --no-cache builds gave identities {ids}", file=sys.stderr)
    else:
        print(f"bench-chain: every --no-cache build gave identity {ids[0]}", file=sys.stderr)


def _chain_ours():
    _imagebuild(_state["croot"], "-q", "build", CHAIN, "--no-cache", "--no-gate", env=_state["cenv"])
    rec = json.loads((sorted((_state["ctmp"] / "state" / "builds" / CHAIN).iterdir())[-1] / "record.json").read_text())
    _state["identities"].append(rec["release"]["identity"])


def _chain_baseline():
    for argv in _state["chain_cmds"]:
        sh(*argv)


def benchmarks():
    return [
        Benchmark("build no-op rebuild (5 stages, all keys present)", _ours, _baseline, repeat=5,
                  setup=_setup, teardown=_teardown,
                  note="baseline: docker buildx build of the 5 fully cached stages"),
        Benchmark("reproducible chain vs plain --load (3 stages x 300 MB, --no-cache)", _chain_ours,
                  _chain_baseline, repeat=3, setup=_chain_setup, teardown=_chain_teardown,
                  note="ours: every stage exported into the stage store, its file times clamped, the release "
                  "loaded; the same identity every run (checked). baseline: plain --load of each stage"),
    ]


if __name__ == "__main__":
    subprocess.run([sys.executable, str(Path(__file__).parent / "run.py"), "build"], check=True)
