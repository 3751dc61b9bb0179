"""imagebuild report: a nightly report, or the history of the nights as a table or an HTML page
(ops/report.py, ops/history.py, ops/htmlpage.py)."""

from __future__ import annotations

import sys

from imagebuild.cli import common, options
from imagebuild.core.errors import (
    EXIT_OK,
    ImagebuildError,
    UsageError,
)

EXAMPLES = (
    "imagebuild report",
    "imagebuild report example --summary",
    "imagebuild report latest --json",
)


def add_parser(sub) -> None:
    sp = sub.add_parser(
        "report", help="print a nightly run report",
        description="Print a nightly report: the latest (default), or RUN (a run id or a unique prefix). With "
        "IMAGE, the latest report that covers IMAGE, and only its part. Reports live in .imagebuild/nightly/ "
        "(or --report-dir). --history [N] and --html read every night from the history "
        "(<state>/nightly-history.jsonl, kept for good) and the kept reports.", examples=EXAMPLES)
    sp.add_argument("args", nargs="*", metavar="[IMAGE] [latest|RUN]", help="an image, a run, or both")
    sp.add_argument("--report-dir", metavar="DIR", help="where the reports are (default .imagebuild/nightly)")
    sp.add_argument("--summary", action="store_true", help="only the summary lines")
    options.json_flag(sp, help="print the report's JSON (with --history: the history's)")
    sp.add_argument("--history", nargs="?", const=str(30), default=None, metavar="N",
                    help="a table of the last N nights (default 30), per image: each stage's time, image size, "
                    "cache hit rate, gate result, what moved upstream (from <state>/nightly-history.jsonl)")
    sp.add_argument("--html", action="store_true",
                    help="print the history as one self-contained HTML page with charts (every night, or the "
                    "last N with --history N); the nightly writes it beside each report")
    sp.set_defaults(func=run)


def _history_nights(value: str | None, args) -> int | None:
    """``--history [N]``: N nights (default 30); a word that is not a number is the IMAGE argument."""
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


def run(args) -> int:
    from pathlib import Path

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
        return _history(args, ctx, rdir, image)
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


def _history(args, ctx, rdir, image) -> int:
    from pathlib import Path

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
