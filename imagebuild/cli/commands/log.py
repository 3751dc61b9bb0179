"""imagebuild log: the recorded build runs, one run's record, or one stage's log (core/runs.py)."""

from __future__ import annotations

import sys

from imagebuild.cli import common, options
from imagebuild.core import lazy
from imagebuild.core.errors import (
    EXIT_OK,
    UsageError,
)
from imagebuild.core.printable import printable
from imagebuild.core.units import short_digest

defn_mod = lazy.module("imagebuild.definition.reader")
log = lazy.logger()

EXAMPLES = (
    "imagebuild log",
    "imagebuild log example latest",
    "imagebuild log example latest --stage base",
)


def add_parser(sub) -> None:
    sp = sub.add_parser("log", help="list build runs, or show one run's record and logs",
                        description="Without RUN: the recorded build runs (of IMAGE, or of every image), newest "
                        "first, with their status, build id, start and duration. With RUN (a run id, a unique prefix of one, or "
                        "'latest'): that run's stages and log paths; with --stage, that stage's full log. Every "
                        "run keeps its own folder under .imagebuild/builds/IMAGE/RUN/ (record.json, logs/).",
                        examples=EXAMPLES)
    options.image_argument(sp, nargs="?", help="image name (default: every image)")
    sp.add_argument("run", metavar="RUN", nargs="?", help="run id, a unique prefix of one, or 'latest'")
    sp.add_argument("--stage", metavar="STAGE", help="print this stage's log (needs IMAGE; 'release' for the release "
                    "step)")
    sp.add_argument("-n", "--limit", type=options.count(1, 1_000_000), metavar="N", default=None,
                    help="list only the newest N runs")
    options.json_flag(sp, "imagebuild.log, version 1")
    sp.set_defaults(func=run)


def run(args) -> int:
    from imagebuild.core import runs as runs_mod

    ctx = common.ctx(args)
    if args.image:  # one of this project's images, else exit 2
        from imagebuild.ops import gc as gc_mod

        gc_mod.check_known(ctx, args.image)
    if args.run is None and args.stage is None:
        runs = runs_mod.list_runs(ctx, args.image)[:args.limit]
        if args.json:
            common.print_json({"schema": "imagebuild.log", "version": 1, "runs": [r.summary() for r in runs]})
            return EXIT_OK
        if not runs:
            print("no build runs recorded" + (f" for {args.image}" if args.image else ""))
            return EXIT_OK
        iw = max(5, *(len(r.image) for r in runs))
        rw = max(3, *(len(r.run_id) for r in runs))
        print(f"{'IMAGE':<{iw}}  {'RUN':<{rw}}  {'STATUS':<12} {'BUILD':<16} {'STARTED':<20} {'TOOK':>8}  NOTE")
        for r in runs:
            s = r.summary()
            note = "; ".join(x for x in (f"failed at {s['failed_stage']}" if s["failed_stage"] else "",
                                         s["promotion"] or "") if x)
            print(f"{r.image:<{iw}}  {r.run_id:<{rw}}  {s['status']:<12} {s['build_id'] or '-':<16} "
                  f"{(s['started'] or '-')[:19]:<20} {_took(s['started'], s['finished']):>8}  {note}".rstrip())
        return EXIT_OK
    if not args.image:
        raise UsageError("RUN and --stage need an IMAGE", hint="imagebuild log IMAGE [RUN] [--stage STAGE]")
    if args.stage is not None and not defn_mod.STAGE_RE.match(args.stage) and args.stage != "release":
        raise UsageError(f"--stage {args.stage!r}: expected a stage name (or 'release')",
                         hint=f"imagebuild log {args.image} {args.run or 'latest'} lists the run's stages")
    run = runs_mod.find_run(ctx, args.image, args.run)
    if args.stage is not None:
        path = run.dir / "logs" / f"{args.stage}.log"
        if not path.is_file():
            have = ", ".join(p.stem for p in run.logs()) or "none"
            raise UsageError(f"run {run.run_id} of {args.image} has no log for stage {args.stage!r}",
                             hint=f"logs of that run: {have}")
        with open(path, "rb") as f:  # printable text only (a log written before imagebuild stripped it all)
            for raw in f:
                sys.stdout.write(printable(raw.decode("utf-8", "replace")))
        return EXIT_OK
    if args.json:
        common.print_json({"schema": "imagebuild.log", "version": 1, "run": run.summary(), "record": run.record,
                     "logs": [ctx.show(p) for p in run.logs()]})
        return EXIT_OK
    s = run.summary()
    for p in run.problems():  # a record not written by a build (edited, another version): shown as far as it goes
        log.warning("warning: %s: %s (shown as -)", ctx.show(run.dir / "record.json"), p)
    print(f"run       {run.run_id}  ({args.image}, {s['status']})")
    print(f"build id  {s['build_id'] or '-'}")
    print(f"started   {s['started'] or '-'}  finished {s['finished'] or '-'}  took {_took(s['started'], s['finished'])}")
    for st in run.stages():
        took = f"{st['seconds']:.1f} s" if st["seconds"] is not None else ""
        print(f"  {st['name'] or '-':<16} {st['status'] or '-':<8} {took:>9}  {st['log'] or ''}")
    if s["identity"]:
        print(f"identity  {short_digest(s['identity'])}")
    if s["promotion"]:
        print(f"promotion {s['promotion']}")
    for p in run.logs():
        print(f"log       {ctx.show(p)}")
    return EXIT_OK


def _took(started: str | None, finished: str | None) -> str:
    """A run's duration from its record's ISO times (``1h02m``, ``3m05s``, ``12s``), ``-`` when unknown."""
    from datetime import datetime

    try:
        secs = (datetime.fromisoformat(finished) - datetime.fromisoformat(started)).total_seconds()
    except (TypeError, ValueError):
        return "-"
    if secs < 0:
        return "-"
    h, rest = divmod(int(round(secs)), 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"
