"""The options that several commands declare, each declared once here and added by the command modules
(cli/commands/): ``--json``, the IMAGE argument, ``--jobs`` (with the old ``-j``), ``--progress``, a
whole-number type, and a deprecated spelling of an option. The global options (--root, --debug, -v,
-q), which every command takes, are added by cli/parser.py."""

from __future__ import annotations

import argparse
import sys


def count(lo: int, hi: int):
    """An argparse ``type`` for a whole number in [lo, hi]: anything else (``-1``, ``10**20``, ``abc``)
    is a usage error (exit 2) naming the flag, before any work starts."""
    def parse(text: str) -> int:
        try:
            n = int(text, 10)
        except ValueError:
            n = None
        if n is None or not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"expected a whole number from {lo} to {hi}, got {text[:32]!r}")
        return n

    parse.__name__ = "count"
    return parse


def json_flag(sp, schema: str | None = None, *, help: str | None = None) -> None:
    """``--json``: print the command's data as JSON (``schema``: its name and version, said in the help)."""
    sp.add_argument("--json", action="store_true", help=help or f"print JSON (schema {schema})")


def image_argument(sp, *, nargs: str | None = None, help: str = "image name (a folder under docker-images/)") -> None:
    """The IMAGE argument: a definition name (``nargs="?"``: optional)."""
    sp.add_argument("image", metavar="IMAGE", **({"nargs": nargs} if nargs else {}), help=help)


def jobs(sp, *, help: str) -> None:
    """``--jobs N`` (default 4) of the commands that run things in parallel, and its old spelling ``-j``
    (build's -j is MAX_JOBS)."""
    sp.add_argument("--jobs", type=count(1, 256), default=4, metavar="N", help=help)
    deprecated(sp, "-j", dest="jobs", type=count(1, 256), use="--jobs (-j is build's MAX_JOBS)")


PROGRESS_MODES = ("auto", "tty", "plain", "quiet", "rawjson")  # buildstep/progress.py MODES (not imported: start-up)


def progress(sp, *, help: str) -> None:
    """``--progress MODE`` of the commands that build (build, nightly); None: the environment's default."""
    sp.add_argument("--progress", choices=PROGRESS_MODES, default=None, help=help)


class DeprecatedOption(argparse.Action):
    """An old spelling that still works, with a warning on stderr naming the new one."""

    def __init__(self, option_strings, dest, use: str = "", **kw):
        self.use = use
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"warning: {option_string} is deprecated here: use {self.use}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def deprecated(sp, *flags: str, dest: str, use: str, **kw) -> None:
    """Add ``flags`` as a hidden, deprecated spelling of option ``dest`` (the same type and value)."""
    sp.add_argument(*flags, dest=dest, action=DeprecatedOption, use=use, default=argparse.SUPPRESS,
                    help=argparse.SUPPRESS, **kw)
