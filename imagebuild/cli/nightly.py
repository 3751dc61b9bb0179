"""Command line of ``nightly``, ``report`` and ``diff`` (argument parsing and output only; cli.py
registers them). Docs: docs/nightly.md, docs/cli.md."""

from __future__ import annotations

import argparse

from imagebuild.cli import common

# Only argparse here: cli.py registers these commands on every start (--version, list, ...), which
# must not pay for what only these commands use (tests/unit/cli/test_startup.py).

NIGHTLY_EPILOG = """
nightly exit code: the worst of the images' results, in this order (worst last):
  0 ok, 3 refused (serving container, lock held), 4 gate failed, 1 a step failed,
  2 bad input (a definition error), 130 interrupted

nightly environment:
  IMAGEBUILD_NOTIFY   default for --notify: a command run with the report's path (Markdown)
  GITHUB_TOKEN        optional, for PR states from the GitHub API (never shown, never in a report)
  IMAGEBUILD_SSH      how to reach the peers (default ssh), as for doctor
"""


def register(sub, epilog: str) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    sp = sub.add_parser(
        "nightly", help="the whole chain per image: prefetch, build, gate, promote, copy to the peers, gc, and a report",
        description="For each IMAGE in turn: prefetch (with --refresh, PR heads and followed branches move), "
        "build every stage offline (skipped by key), gate the candidate, promote it to IMAGE:local only on a "
        "passing receipt, copy :local to the peers; then gc under the retention, and write the run report "
        "(Markdown + JSON, atomically; the last N kept). A failed gate never promotes or copies; a serving "
        "container stops the run before anything is built (exit 3); one image failing does not stop the next. "
        "Details: docs/nightly.md.", epilog=epilog + NIGHTLY_EPILOG, formatter_class=fmt)
    sp.add_argument("images", nargs="+", metavar="IMAGE", help="image definitions, built in this order")
    sp.add_argument("--peer", action="append", metavar="PEER", default=[],
                    help="copy :local to this SSH peer (repeatable; PEER,PEER works; default: peers: in imagebuild.yaml)")
    sp.add_argument("--no-peers", action="store_true", help="copy to no peer, whatever imagebuild.yaml says")
    # deprecated: it took every word after it (`--peers dgx4 IMAGE` made IMAGE a peer); now one value or none
    sp.add_argument("--peers", nargs="?", const="", metavar="PEER[,PEER]", default=None, help=argparse.SUPPRESS)
    sp.add_argument("--refresh", action="store_true",
                    help="move pinned PR heads and followed branches to their latest commits (prefetch --refresh)")
    sp.add_argument("--report-dir", metavar="DIR", help="where reports go (default .imagebuild/nightly)")
    sp.add_argument("--keep-reports", type=common.count(0, 100_000), default=14, metavar="N", help="keep the last N reports (default 14)")
    sp.add_argument("--keep-builds", type=common.count(0, 100_000), default=3, metavar="N",
                    help="gc retention: also keep the last N builds per image (default 3; docs/build.md, 'Disk')")
    sp.add_argument("--no-gc", action="store_true", help="do not run gc at the end")
    sp.add_argument("--notify", metavar="CMD", default=None,
                    help="run CMD with the report's path as its last argument (default $IMAGEBUILD_NOTIFY)")
    sp.add_argument("--progress", choices=("auto", "tty", "plain", "quiet", "rawjson"), default=None,
                    help="the builds' progress on stderr (as for build)")
    sp.add_argument("--json", action="store_true", help="print the report (schema imagebuild.nightly-report, "
                    "version 1)")
    sp.set_defaults(func=cmd_nightly)

    sp = sub.add_parser(
        "report", help="print a nightly run report",
        description="Print a nightly report: the latest (default), or RUN (a run id or a unique prefix). With "
        "IMAGE, the latest report that covers IMAGE, and only its part. Reports live in .imagebuild/nightly/ "
        "(or --report-dir). --history [N] and --html read every night from the history "
        "(<state>/nightly-history.jsonl, kept for good) and the kept reports.", epilog=epilog, formatter_class=fmt)
    sp.add_argument("args", nargs="*", metavar="[IMAGE] [latest|RUN]", help="an image, a run, or both")
    sp.add_argument("--report-dir", metavar="DIR", help="where the reports are (default .imagebuild/nightly)")
    sp.add_argument("--summary", action="store_true", help="only the summary lines")
    sp.add_argument("--json", action="store_true", help="print the report's JSON (with --history: the history's)")
    sp.add_argument("--history", nargs="?", const=str(30), default=None, metavar="N",
                    help="a table of the last N nights (default 30), per image: each stage's time, image size, "
                    "cache hit rate, gate result, what moved upstream (from <state>/nightly-history.jsonl)")
    sp.add_argument("--html", action="store_true",
                    help="print the history as one self-contained HTML page with charts (every night, or the "
                    "last N with --history N); the nightly writes it beside each report")
    sp.set_defaults(func=cmd_report)

    sp = sub.add_parser(
        "diff", help="what changed between two built images: pins, patches, packages, layers",
        description="Compare two images the engine holds (any references: IMAGE:local, IMAGE:previous, "
        "IMAGE:b-<build id>, an id): the pins and patch outcomes they carry (/opt/imagebuild), their Python "
        "distributions and dpkg packages, and their layers with sizes. Starts no process in either image when "
        "the lists are baked in; otherwise lists Python distributions in a throwaway --network none container.",
        epilog=epilog, formatter_class=fmt)
    sp.add_argument("ref1", metavar="REF1", help="the older image")
    sp.add_argument("ref2", metavar="REF2", help="the newer image")
    sp.add_argument("--limit", type=common.count(1, 1_000_000), default=50, metavar="N", help="show at most N rows per section (default 50)")
    sp.add_argument("--json", action="store_true", help="print JSON (schema imagebuild.image-diff, version 1)")
    sp.set_defaults(func=cmd_diff)


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
    import sys

    from imagebuild.core.errors import UsageError

    if args.peers is not None:
        print("warning: --peers is deprecated: use --peer PEER (repeatable) or --no-peers", file=sys.stderr)
    given = [p for v in [*args.peer, *([args.peers] if args.peers is not None else [])] for p in v.split(",") if p]
    if args.no_peers and given:
        raise UsageError("--no-peers and --peer cannot be used together")
    if args.no_peers or args.peers == "":
        return ()
    return tuple(dict.fromkeys(given)) if given else configured


def cmd_nightly(args) -> int:
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
    import os
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


def _history_nights(value: str | None, args) -> int | None:
    """``--history [N]``: N nights (default 30); a word that is not a number is the IMAGE argument."""
    from imagebuild.core.errors import UsageError
    from imagebuild.ops import history as history_mod

    if value is None:
        return None
    if value.isdigit() and 1 <= int(value) <= 1_000_000:
        return int(value)
    if value and not value.startswith("-") and not value.isdigit():
        args.args.insert(0, value)
        return history_mod.DEFAULT_NIGHTS
    raise UsageError(f"--history {value}: expected a number of nights (1 or more)",
                     hint="imagebuild report [IMAGE] --history 30")


def cmd_history(args, ctx, rdir, image) -> int:
    import sys
    from pathlib import Path

    from imagebuild.core.errors import EXIT_OK, ImagebuildError
    from imagebuild.ops import history as history_mod
    from imagebuild.ops import htmlpage
    from imagebuild.ops import report as report_mod

    kept, pairs = [], []
    for s in report_mod.stored(rdir):
        try:
            kept.append(s.load())
        except ImagebuildError:  # a foreign file in the report folder: the history file still counts
            continue
        pairs.append((s.json_path, kept[-1]))
    h = history_mod.load(history_mod.path(ctx), kept)
    rows = history_mod.last_nights(h, args.nights, image)
    if h.skipped:
        print(f"warning: {h.skipped} unreadable line(s) in {history_mod.path(ctx)} skipped", file=sys.stderr)
        for why in h.bad[:10]:
            print(f"  {why}", file=sys.stderr)
        if len(h.bad) > 10:
            print(f"  ... and {len(h.bad) - 10} more", file=sys.stderr)
    if args.html:
        tonight = kept[0] if kept else None
        if tonight is not None and image is not None:
            listed = tonight.get("images")
            tonight = {**tonight, "images": [i for i in (listed if isinstance(listed, list) else [])
                                             if isinstance(i, dict) and i.get("image") == image]}
        # the page goes to stdout: its links to reports and logs are relative to the current folder
        links = htmlpage.night_links(rows, pairs, ctx.root, Path.cwd())
        sys.stdout.write(htmlpage.render(rows, tonight, links=links))
    elif args.json:
        common.print_json({"schema": history_mod.SCHEMA, "version": history_mod.VERSION,
                           "file": str(history_mod.path(ctx)), "nights": len({r["run_id"] for r in rows}),
                           "rows": rows})
    else:
        sys.stdout.write(history_mod.render_table(rows))
    return EXIT_OK


def cmd_report(args) -> int:
    import sys
    from pathlib import Path

    from imagebuild.core.errors import EXIT_OK, ImagebuildError
    from imagebuild.definition import reader as defn_mod
    from imagebuild.ops import report as report_mod

    ctx = common.ctx(args)
    root = ctx.root
    rdir = Path(args.report_dir) if args.report_dir else report_mod.default_dir(ctx)
    args.nights = _history_nights(args.history, args)
    if args.html and args.nights is None:
        args.nights = 0  # --html alone: every night in the history
    if args.nights is not None:
        if args.summary:
            from imagebuild.core.errors import UsageError

            raise UsageError("--summary is for one report; --history and --html show the nights")
        image = None
        if args.args:
            if len(args.args) > 1:
                from imagebuild.core.errors import UsageError

                raise UsageError(f"with --history or --html: expected at most one IMAGE, got {' '.join(args.args)}",
                                 hint=f"images: {', '.join(defn_mod.list_images(root)) or 'none'}")
            image = args.args[0]
            defn_mod.require_image(root, image)
        return cmd_history(args, ctx, rdir, image)
    if len(args.args) > 2:
        from imagebuild.core.errors import UsageError

        raise UsageError("too many arguments", hint="imagebuild report [IMAGE] [latest|RUN]")
    image = which = None
    if len(args.args) == 2:
        image, which = args.args
    elif len(args.args) == 1:
        a = args.args[0]
        if a != "latest" and (root / defn_mod.IMAGES_DIR / a).is_dir():
            image = a
        elif a == "latest" or a[:1].isdigit():  # a run id (or its prefix) starts with its date
            which = a
        else:  # neither a run nor an image: a mistyped image, said as every command says it
            image = a
    if image is not None:
        defn_mod.check_image_name(image)
    try:
        st = report_mod.find(rdir, which, image)
    except ImagebuildError:
        if image is not None:  # a mistyped image (not a removed one the reports still hold): said as everywhere
            defn_mod.require_image(root, image)
        raise
    doc = st.load()
    if image is not None:
        doc = {**doc, "images": [i for i in doc["images"] if i.get("image") == image]}
    if args.json:
        common.print_json(doc)
    elif args.summary:
        print("\n".join(report_mod.summary_lines(doc)))
    else:
        from imagebuild.core import fsutil
        from imagebuild.core.printable import printable

        text = None
        if image is None:
            try:
                text = fsutil.read_text(st.md_path, errors="replace")
            except OSError:  # gone, or no regular file: rendered from the JSON
                text = None
        sys.stdout.write(printable(text if text is not None else report_mod.render_markdown(doc)))
    return EXIT_OK


def cmd_diff(args) -> int:
    from imagebuild.core.errors import EXIT_OK, ImagebuildError, UsageError
    from imagebuild.ops import imagediff

    for name, value in (("REF1", args.ref1), ("REF2", args.ref2)):
        if not value or value.startswith("-") or not value.isprintable() or any(c.isspace() for c in value):
            raise UsageError(f"{name} {value!r}: expected an image reference (IMAGE:TAG, an id), not an option "
                             "or an empty word", hint="imagebuild diff IMAGE:previous IMAGE:local")

    try:
        ctx = common.ctx(args)
    except ImagebuildError:  # two references can be compared outside a project (no inventory cache then)
        ctx = None
    a = imagediff.inventory(args.ref1, ctx)
    b = imagediff.inventory(args.ref2, ctx)
    d = imagediff.diff(a, b)
    if args.json:
        common.print_json(d)
    else:
        print(imagediff.render(d, limit=args.limit))
    return EXIT_OK
