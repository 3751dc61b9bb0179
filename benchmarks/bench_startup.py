"""Start-up: the commands people run all day, as whole processes, against the interpreter's own
start (`python -c pass`, the floor no Python program goes below).

Acceptance (issue 9, section 9): `--version`, `list`, `validate` and `plan --no-engine` each under
100 ms (the "ours" column; the ratio only says how much above the floor).
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
                      note="baseline: python -c pass; target: ours < 100 ms") for name, argv in cases]
