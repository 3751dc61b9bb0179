"""plan: validate + plan the example definition and ask the engine which stages exist,
against what a shell script does for the same answer (hash the inputs, inspect each tag)."""

from __future__ import annotations

import sys
from pathlib import Path

from harness import Benchmark, sh

ROOT = Path(__file__).resolve().parents[1]
IMG = ROOT / "docker-images" / "example"


def _ours():
    sh(sys.executable, "-m", "imagebuild", "--root", str(ROOT), "plan", "example", "--json")


def _baseline():
    files = sorted(str(p) for p in IMG.rglob("*") if p.is_file())
    sh("bash", "-c", 'sha256sum "$@" >/dev/null; for s in toolchain app runner; do '
       'docker image inspect "imagebuild/example:$s" >/dev/null 2>&1 || true; done', "_", *files)


def benchmarks():
    return [Benchmark("plan example (3 stages, engine check)", _ours, _baseline, repeat=5,
                      note="baseline: sha256sum inputs + docker image inspect per stage")]
