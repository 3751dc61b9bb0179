"""The entry point: ``main(argv) -> exit code`` (the console script ``imagebuild``, ``python -m imagebuild``).

Builds the parser for the command named (cli/parser.py, from the command modules in cli/commands/),
parses, sets up logging, runs the command's ``run`` and maps what it raises to the documented exit codes:
an ImagebuildError (core/errors.py) to its own code, Ctrl-C (or SIGTERM, SIGHUP) to 130, a closed pipe
to 0, anything else to 1 as an internal error.

Conventions (docs/cli.md): data on stdout, progress and logs on stderr, ``--json`` where the
output is data, documented exit codes, no traceback unless ``--debug``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from imagebuild.cli import common, parser
from imagebuild.core import interrupts, lazy
from imagebuild.core.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    ImagebuildError,
    shown,
)

traceback = lazy.module("traceback")


def main(argv: Sequence[str] | None = None) -> int:
    entry = argv is None  # the process's own entry point (console script, python -m); tests pass argv
    argv = sys.argv[1:] if argv is None else list(argv)
    command = parser.command_in(argv)
    top_help = not command and ("--version" not in argv or any(a in ("-h", "--help") for a in argv))
    # the named command's parser alone; with no command, the others' help lines only when the top-level
    # help is printed (a bare --version imports no command's module)
    top = parser.build_parser(only=command or ("" if top_help else parser.NO_COMMAND))
    if not command and not any(a in ("-h", "--help", "--version") for a in argv):
        top.print_help()  # bare `imagebuild` (or only global options): the help, exit 2 (docs/cli.md)
        return EXIT_BAD_INPUT
    args = parser.parse(top, argv)
    try:
        args.json_lines = _json_lines(args)
    except ImagebuildError as exc:  # a bad IMAGEBUILD_PROGRESS: said the usual way
        print(common.verdicts(exc.render(), sys.stderr), file=sys.stderr)
        return exc.exit_code
    _setup_logging(args)
    # SIGINT, SIGTERM and SIGHUP end the run like Ctrl-C (every ``finally`` runs, exit 130); the ones
    # that follow the first are swallowed, so they cannot cut its cleanup short (core/interrupts.py)
    old_handlers = interrupts.install()
    try:
        return _dispatch(args, entry)
    finally:
        if not entry:  # an in-process caller gets its own handlers back
            interrupts.restore(old_handlers)


def _dispatch(args: argparse.Namespace, entry: bool) -> int:
    """Run the command; each family of what it raises becomes its documented exit code (docs/cli.md)."""
    try:
        return args.func(args)
    except ImagebuildError as exc:
        if args.debug:
            traceback.print_exc()
        common.say(args, "error", exc.render() if getattr(args, "json_lines", False) else
                   common.verdicts(exc.render(), sys.stderr))
        return exc.exit_code
    except KeyboardInterrupt:
        if entry:  # the cleanup is done: no late signal may turn this 130 into a death by signal
            interrupts.ignore_until_exit()
        common.say(args, "error", "interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_OK
    except Exception as exc:  # a bug: say so plainly, with the traceback behind --debug
        if args.debug:
            traceback.print_exc()
        common.say(args, "error", f"internal error: {type(exc).__name__}: {exc}\n  (rerun with --debug for the "
                   "traceback; please report it)")
        return EXIT_FAILED


def _setup_logging(args) -> None:
    """Configure the "imagebuild" logger: now if logging is loaded, else when something first imports
    it (``list``, ``validate`` and ``plan --no-engine`` never do: ~10 ms saved on each start)."""
    if "logging" in sys.modules or args.verbose or args.debug:  # -v: every command run is logged
        _configure_logging(args)
    elif not any(isinstance(f, _WhenImported) for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenImported("logging", lambda: _configure_logging(args)))


class _WhenImported:
    """A meta path entry that runs ``then()`` right after module ``name`` is first imported."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        from importlib.util import find_spec

        spec = find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then(module):
            exec_module(module)
            self.then()

        spec.loader.exec_module = exec_then
        return spec


def _json_lines(args) -> bool:
    """``--progress rawjson`` (or its environment default) on build or nightly: stderr carries JSON lines
    only, BuildKit's and, wrapped as ``{"imagebuild": {"level": ..., "message": ...}}``, imagebuild's own
    (its notes, warnings and the final error), so a tool can read every line."""
    if not hasattr(args, "progress"):
        return False
    from imagebuild.buildstep import progress as progress_mod

    return progress_mod.resolve_mode(args.progress, isatty=False) == "rawjson"


def _configure_logging(args) -> None:
    import logging

    # -v: also every command run ("+ docker ...") and the build logs as they come; --debug: and tracebacks
    level = logging.DEBUG if (args.debug or args.verbose) else logging.WARNING if args.quiet else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    if getattr(args, "json_lines", False):
        class JsonLines(logging.Formatter):
            def format(self, record: logging.LogRecord) -> str:
                return common.json_line(record.levelname.lower(), shown(record.getMessage()))

        handler.setFormatter(JsonLines())
    else:
        class Shown(logging.Formatter):  # printable text, no URL userinfo (core/errors.shown)
            def format(self, record: logging.LogRecord) -> str:
                return shown(super().format(record))

        handler.setFormatter(Shown("%(message)s"))
    logger = logging.getLogger("imagebuild")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False


__all__ = ["main"]
