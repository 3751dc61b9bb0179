"""imagebuild nightly: the whole chain per image and the run report (ops/nightly.py); under a CI runner
also its folds, annotations and outputs (cli/actions.py). Docs: docs/nightly.md."""

from __future__ import annotations

import argparse
import os
import sys

from imagebuild.cli import common, options
from imagebuild.core.errors import UsageError

EXAMPLES = (
    "imagebuild nightly example",
    "imagebuild nightly --refresh --peer dgx4 example",
    "imagebuild nightly --no-peers --no-gc example",
)

NIGHTLY_EPILOG = """
nightly exit code: the worst of the images' results, in this order (worst last):
  0 ok, 3 refused (serving container, lock held), 4 gate failed, 1 a step failed,
  2 bad input (a definition error), 130 interrupted

nightly environment:
  IMAGEBUILD_NOTIFY   default for --notify: a command run with the report's path (Markdown)
  GITHUB_TOKEN        optional, for PR states from the GitHub API (never shown, never in a report)
  IMAGEBUILD_SSH      how to reach the peers (default ssh), as for doctor
"""


def add_parser(sub) -> None:
    sp = sub.add_parser(
        "nightly", help="the whole chain per image: prefetch, build, gate, promote, copy to the peers, gc, and a report",
        description="For each IMAGE in turn: prefetch (with --refresh, PR heads and followed branches move), "
        "build every stage offline (skipped by key), gate the candidate, promote it to IMAGE:local only on a "
        "passing receipt, copy :local to the peers; then gc under the retention, and write the run report "
        "(Markdown + JSON, atomically; the last N kept). A failed gate never promotes or copies; a serving "
        "container stops the run before anything is built (exit 3); one image failing does not stop the next. "
        "Details: docs/nightly.md.", epilog=NIGHTLY_EPILOG, examples=EXAMPLES)
    sp.add_argument("images", nargs="+", metavar="IMAGE", help="image definitions, built in this order")
    sp.add_argument("--peer", action="append", metavar="PEER", default=[],
                    help="copy :local to this SSH peer (repeatable; PEER,PEER works; default: peers: in imagebuild.yaml)")
    sp.add_argument("--no-peers", action="store_true", help="copy to no peer, whatever imagebuild.yaml says")
    # deprecated: it took every word after it (`--peers dgx4 IMAGE` made IMAGE a peer); now one value or none
    sp.add_argument("--peers", nargs="?", const="", metavar="PEER[,PEER]", default=None, help=argparse.SUPPRESS)
    sp.add_argument("--refresh", action="store_true",
                    help="move pinned PR heads and followed branches to their latest commits (prefetch --refresh)")
    sp.add_argument("--report-dir", metavar="DIR", help="where reports go (default .imagebuild/nightly)")
    sp.add_argument("--keep-reports", type=options.count(0, 100_000), default=14, metavar="N", help="keep the last N reports (default 14)")
    sp.add_argument("--keep-builds", type=options.count(0, 100_000), default=3, metavar="N",
                    help="gc retention: also keep the last N builds per image (default 3; docs/build.md, 'Disk')")
    sp.add_argument("--no-gc", action="store_true", help="do not run gc at the end")
    sp.add_argument("--notify", metavar="CMD", default=None,
                    help="run CMD with the report's path as its last argument (default $IMAGEBUILD_NOTIFY)")
    options.progress(sp, help="the builds' progress on stderr (as for build)")
    options.json_flag(sp, help="print the report (schema imagebuild.nightly-report, "
                      "version 1)")
    sp.set_defaults(func=run)


def _shown(p) -> str:
    """A path as the user can paste it: relative to the current folder when under it."""
    from pathlib import Path

    p = Path(p).resolve()
    try:
        return str(p.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def _peers(args, configured: tuple[str, ...]) -> tuple[str, ...]:
    """--peer (repeatable, PEER,PEER), --no-peers, the deprecated --peers [PEER,PEER], else imagebuild.yaml."""


    if args.peers is not None:
        print("warning: --peers is deprecated: use --peer PEER (repeatable) or --no-peers", file=sys.stderr)
    given = [p for v in [*args.peer, *([args.peers] if args.peers is not None else [])] for p in v.split(",") if p]
    if args.no_peers and given:
        raise UsageError("--no-peers and --peer cannot be used together")
    if args.no_peers or args.peers == "":
        return ()
    return tuple(dict.fromkeys(given)) if given else configured


def run(args) -> int:
    from pathlib import Path

    from imagebuild.ops import nightly as nightly_mod

    ctx = common.ctx(args)
    root = ctx.root
    peers = _peers(args, ctx.config.peers)
    opts = nightly_mod.Options(peers=peers, refresh=args.refresh,
                               report_dir=Path(args.report_dir) if args.report_dir else None,
                               keep_reports=args.keep_reports, keep_builds=args.keep_builds, gc=not args.no_gc,
                               notify=args.notify, progress=args.progress)
    doc, stored = nightly_mod.nightly(ctx, args.images, opts)
    _actions(doc, stored, root, args.json)
    if args.json:
        common.print_json(doc)
    else:
        from imagebuild.ops import report as report_mod

        where = (["--root", _shown(root)] if Path.cwd().resolve() != Path(root).resolve() else [])
        extra = ["--report-dir", _shown(stored.md_path.parent)] if args.report_dir else []
        print(f"report: {_shown(stored.md_path)} (JSON beside it; "
              f"imagebuild {' '.join([*where, 'report', doc['run_id'], *extra])})")
        print("\n".join(report_mod.summary_lines(doc)))
    return doc["exit_code"]


def _actions(doc: dict, stored, root, json_mode: bool) -> None:
    """Under GitHub Actions or a Gitea-family runner: folds, annotations, $GITHUB_OUTPUT (cli/actions.py)."""
    import sys

    from imagebuild.cli import actions

    if not actions.under_actions():
        return
    out = sys.stderr if json_mode else sys.stdout
    for line in actions.commands(doc, root):
        print(line, file=out)
    out.flush()
    if os.environ.get("GITHUB_OUTPUT"):
        actions.write_outputs(os.environ["GITHUB_OUTPUT"], doc, stored, root)
