"""Run every benchmarks/bench_*.py and print one row per benchmark: ours, baseline, ratio.

    python benchmarks/run.py [NAME-SUBSTRING ...]
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from harness import measure  # noqa: E402


def main(argv: list[str]) -> int:
    rows = []
    for path in sorted(HERE.glob("bench_*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        for b in mod.benchmarks():
            if argv and not any(a in b.name for a in argv):
                continue
            print(f"running {b.name} ...", file=sys.stderr, flush=True)
            rows.append(measure(b))
    w = max([len(r.name) for r in rows] + [9])
    print(f"{'benchmark':<{w}}  {'ours':>10}  {'baseline':>10}  {'ratio':>7}  runs  note")
    for r in rows:
        print(f"{r.name:<{w}}  {r.ours_s:>9.3f}s  {r.baseline_s:>9.3f}s  {r.ratio:>7.2f}  {r.runs:>4}  {r.note}")
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "latest.json").write_text(json.dumps({"schema": "imagebuild.bench", "version": 1,
                                                 "rows": [r.as_dict() for r in rows]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
