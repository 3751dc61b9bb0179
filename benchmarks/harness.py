"""The benchmark harness every capability adds to.

A benchmark module ``benchmarks/bench_<capability>.py`` defines ``benchmarks()`` returning a
list of ``Benchmark``: a name, our command, and the plain-tool baseline doing the same job,
each a callable run ``repeat`` times (after ``setup``). ``make bench`` runs them all in one go
and prints one row per benchmark: ours, baseline, and the ratio ours/baseline (below 1.0 means
imagebuild is faster). Results also go to benchmarks/results/latest.json.
"""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Benchmark:
    name: str
    ours: Callable[[], object]
    baseline: Callable[[], object]
    repeat: int = 5
    setup: Callable[[], object] | None = None
    teardown: Callable[[], object] | None = None
    note: str = ""
    per_run_setup: Callable[[], object] | None = None


@dataclass
class Row:
    name: str
    ours_s: float
    baseline_s: float
    runs: int
    note: str = ""
    ours_all: list[float] = field(default_factory=list)
    baseline_all: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.ours_s / self.baseline_s if self.baseline_s else float("inf")

    def as_dict(self) -> dict:
        return {"name": self.name, "ours_s": self.ours_s, "baseline_s": self.baseline_s, "ratio": self.ratio,
                "runs": self.runs, "note": self.note, "ours_all": self.ours_all,
                "baseline_all": self.baseline_all}


def _time(fn: Callable[[], object], per_run_setup) -> float:
    if per_run_setup:
        per_run_setup()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(b: Benchmark) -> Row:
    if b.setup:
        b.setup()
    try:
        ours, base = [], []
        # interleave so that machine noise hits both sides alike
        for _ in range(b.repeat):
            ours.append(_time(b.ours, b.per_run_setup))
            base.append(_time(b.baseline, b.per_run_setup))
    finally:
        if b.teardown:
            b.teardown()
    return Row(b.name, statistics.median(ours), statistics.median(base), b.repeat, b.note, ours, base)


def sh(*argv: str, **kw) -> subprocess.CompletedProcess:
    """Run a command for a benchmark; fail loudly (a benchmark of a failing command is a lie)."""
    return subprocess.run(list(argv), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw)
