"""Start-up: the commands people run all day, as whole processes, against the interpreter's own
start (`python -c pass`, the floor no Python program goes below).

Target (docs/cli.md, "Start-up time"): `--version` under 100 ms. `list`, `validate` and `plan
--no-engine` are measured and reported, with no target: their start-up machinery was retired
(docs/design.md) since it cost more to keep than the tens of milliseconds it saved. The ratio only
says how much above the floor.
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness import Benchmark, sh

ROOT = Path(__file__).resolve().parents[1]
IMAGEBUILD = str(Path(sys.executable).parent / "imagebuild")


def _floor():
    sh(sys.executable, "-c", "pass")


def _run(*argv: str):
    return lambda: sh(IMAGEBUILD, *argv)


def benchmarks():
    root = ("--root", str(ROOT))
    cases = [("imagebuild --version", ("--version",)), ("imagebuild list", (*root, "list")),
             ("imagebuild validate", (*root, "validate")),
             ("imagebuild plan example --no-engine", (*root, "plan", "example", "--no-engine"))]
    return [Benchmark(f"start-up: {name}", _run(*argv), _floor, repeat=21,
                      note="baseline: python -c pass" + ("; target: ours < 100 ms" if argv == ("--version",) else ""))
            for name, argv in cases]
