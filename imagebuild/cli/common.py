"""What every command's code in cli/ shares: the project root, the command's context, JSON output."""

from __future__ import annotations

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


def count(lo: int, hi: int):
    """An argparse ``type`` for a whole number in [lo, hi]: anything else (``-1``, ``10**20``, ``abc``)
    is a usage error (exit 2) naming the flag, before any work starts."""
    def parse(text: str) -> int:
        import argparse

        try:
            n = int(text, 10)
        except ValueError:
            n = None
        if n is None or not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"expected a whole number from {lo} to {hi}, got {text[:32]!r}")
        return n

    parse.__name__ = "count"
    return parse
