"""What every command's run function (cli/commands/) shares: the project root, the command's context,
JSON output, verdict colours, imagebuild's own lines on stderr. The options they share: cli/options.py."""

from __future__ import annotations

import os
import sys

from imagebuild.core import lazy
from imagebuild.core.errors import ImagebuildError

json = lazy.module("json")
defn_mod = lazy.module("imagebuild.definition.reader")


def root(args):
    """The project root: ``--root``, ``$IMAGEBUILD_ROOT``, or the nearest folder above holding docker-images/."""
    return defn_mod.find_root(explicit=args.root)


def ctx(args):
    """The command's context (core.context.Context): project root, settings, state, engine, output."""
    from imagebuild.core.context import Context

    return Context.for_root(root(args), progress=getattr(args, "progress", "auto"),
                            verbose=bool(getattr(args, "verbose", False)))


def ctx_or_none(args):
    """The context, or None outside a project for the commands that also work there (``gate REF
    --spec``, ``sync REF``, ``diff``); an explicit ``--root`` that is no project is still an error."""
    try:
        return ctx(args)
    except ImagebuildError:
        if args.root:
            raise
        return None


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def shown_name(name: str) -> str:
    """An image name as a line can show it: itself, or an excerpt of an odd one (a folder name)."""
    from imagebuild.core.errors import excerpt

    return name if name.isprintable() and name.isascii() and len(name) <= 32 else excerpt(name)


def red(text: str, stream=None) -> str:
    """``text`` in red when ``stream`` (stdout) is a terminal and NO_COLOR is not set."""
    stream = stream or sys.stdout
    if os.environ.get("NO_COLOR") or not getattr(stream, "isatty", lambda: False)():
        return text
    return f"\033[31m{text}\033[0m"


_VERDICT_COLOURS = {"PASS": "32", "PASSED": "32", "FAIL": "31", "FAILED": "31", "error:": "31"}


def verdicts(text: str, stream=None) -> str:
    """``text`` with each line's leading PASS/PASSED (green), FAIL/FAILED or ``error:`` (red) coloured,
    only when ``stream`` is a terminal and NO_COLOR is not set (a pipe or a log gets plain text)."""
    stream = stream or sys.stdout
    if os.environ.get("NO_COLOR") or not getattr(stream, "isatty", lambda: False)():
        return text
    out = []
    for ln in text.split("\n"):
        word = ln.split(" ", 1)[0].rstrip(":") if ln.startswith(("PASS", "FAIL", "error:")) else ""
        word = "error:" if ln.startswith("error:") else word
        code = _VERDICT_COLOURS.get(word)
        out.append(f"\033[{code}m{word}\033[0m{ln[len(word):]}" if code else ln)
    return "\n".join(out)


def json_line(level: str, message: str) -> str:
    """One line of imagebuild's own as the JSON line ``--progress rawjson`` puts on stderr."""
    return json.dumps({"imagebuild": {"level": level, "message": message}}, ensure_ascii=False)


def say(args, level: str, text: str) -> None:
    """A line of imagebuild's own on stderr (an error, 'interrupted'): a JSON line under rawjson."""
    print(json_line(level, text) if getattr(args, "json_lines", False) else text, file=sys.stderr)
