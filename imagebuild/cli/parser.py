"""The top-level parser, made from the command modules: ``build_parser(only=None)`` and ``parse``.

Every command is declared by a module of its own, ``cli/commands/COMMAND.py``: its ``add_parser(sub)``
adds its subparser and options (the shared ones from cli/options.py), its ``run(args)`` runs it and
prints what it gives. Here: the order and groups of the commands, the top-level help (exit codes,
environment, docs), the global options every command takes, the help's formatting, and the parsing
with its suggestions for a mistyped command or option. The entry point is cli/main.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib import import_module

from imagebuild import __version__
from imagebuild.core.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_GATE_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REFUSED,
)

# Every command, in the order they are registered (the man page's order); command NAME is declared and
# run by the module imagebuild.cli.commands.NAME, imported only when that command runs or when the
# top-level help lists them all
COMMANDS = ("list", "plan", "validate", "doctor", "prefetch", "bundle", "unbundle", "gate", "build", "sync", "log",
            "shell", "gc", "df", "patch", "rollback", "config", "help", "nightly", "report", "diff")

# The commands in the top-level help, by step (a command no group names is listed under "other")
GROUPS = (
    ("define and inspect", ("list", "validate", "plan", "config")),
    ("fetch", ("prefetch", "bundle", "unbundle")),
    ("build and check", ("build", "gate", "shell", "patch", "log")),
    ("ship", ("sync", "rollback")),
    ("operate", ("nightly", "report", "diff", "df", "gc", "doctor")),
    ("help", ("help",)),
)


def command_module(name: str):
    """The module that declares and runs command ``name`` (cli/commands/NAME.py)."""
    return import_module(f"imagebuild.cli.commands.{name}")


def examples() -> dict[str, tuple[str, ...]]:
    """Each command's examples (the end of its --help, the man page's EXAMPLES)."""
    return {name: command_module(name).EXAMPLES for name in COMMANDS}


def _docs_dir() -> str:
    """Where the Markdown docs are: the checkout's docs/ when running from one, else where pip or pipx
    installed them (<prefix>/share/doc/imagebuild, pyproject.toml's data-files)."""
    top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    here = os.path.join(top, "docs")
    if os.path.isfile(os.path.join(here, "cli.md")):
        return here
    return os.path.join(sys.prefix, "share", "doc", "imagebuild")


# the exit codes, as the top-level help and the man page's EXIT STATUS say them (docs/cli.md has the table;
# cli/main.py maps the errors to them)
EXIT_CODES = (
    (EXIT_OK, "success"),
    (EXIT_FAILED, "an operation failed (docker, git, network, a failed check in doctor)"),
    (EXIT_BAD_INPUT, "bad input or configuration (definition errors, bad flags)"),
    (EXIT_REFUSED, "refused by a guard rail (serving container running, wrong architecture, lock held)"),
    (EXIT_GATE_FAILED, "the image's gate failed"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C)"),
)

EPILOG = "exit codes:\n" + "".join(f"  {code:<5}{what}\n" for code, what in EXIT_CODES) + f"""
environment:
  IMAGEBUILD_ROOT   project root (folder holding docker-images/); default: nearest one above the
                    current folder
  NO_COLOR          no colour in output
  all the variables read, with what each does: imagebuild config --env

With no command: this help, exit 2. Each command's options and examples: imagebuild help COMMAND
(or COMMAND --help).

docs: {_docs_dir()}/ (cli.md: every command; image-definition.md, build.md, gate.md, nightly.md, ...);
the man page (make man before the install): man imagebuild
"""

SHORT_EPILOG = "exit codes, environment variables, docs: imagebuild --help"


def _command_epilog(examples: Sequence[str], extra: str | None) -> str:
    """A command's epilog: its examples, then what it adds (its environment, ...), then a pointer to the
    top-level help (which alone carries EPILOG)."""
    parts = ["examples:\n" + "\n".join(f"  {e}" for e in examples)] if examples else []
    extra = (extra or "").strip("\n")
    return "\n\n".join([*parts, *([extra] if extra else []), SHORT_EPILOG]) + "\n"


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs: each line that does not start with a space is wrapped to the terminal's
    width; indented lines (examples, tables) are kept as written."""

    def _fill_text(self, text, width, indent):
        import textwrap

        return "".join(line + "\n" if not line or line[0] == " " else
                       textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent) + "\n"
                       for line in text.splitlines())


class _TopFormatter(_Formatter):
    """The top-level help: the commands grouped by step (GROUPS), each with its one-line help."""

    def _format_action(self, action):
        if not isinstance(action, argparse._SubParsersAction):
            return super()._format_action(action)
        import textwrap

        helps = {a.dest: a.help or "" for a in action._get_subactions()}
        grouped = [(title, [n for n in names if n in helps]) for title, names in GROUPS]
        rest = [n for n in helps if not any(n in names for _, names in GROUPS)]
        if rest:
            grouped.append(("other", rest))
        w = max(len(n) for n in helps) + 2
        out = []
        for title, names in grouped:
            if not names:
                continue
            out.append(f"  {title}:\n")
            for n in names:
                lines = textwrap.wrap(helps[n], max(30, self._width - w - 6)) or [""]
                out.append(f"    {n:<{w}}{lines[0]}\n" + "".join(f"    {'':<{w}}{ln}\n" for ln in lines[1:]))
        return "".join(out)


class _Parser(argparse.ArgumentParser):
    """Exit 2 with usage on bad flags, as documented; options are never abbreviated (``--fo`` is not
    ``--force``); the global options work before and after the command."""

    def __init__(self, *args, **kw):
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)

    def _get_formatter(self):
        # argparse asks shutil for the width (importing shutil, bz2, lzma: ~5 ms) on every add_argument
        return self.formatter_class(prog=self.prog, width=_terminal_width())

    def error(self, message: str):  # exit 2 with usage, as documented
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def _terminal_width() -> int:
    """shutil.get_terminal_size().columns without importing shutil."""
    try:
        return int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        pass
    try:
        return os.get_terminal_size(sys.__stdout__.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 80


def _global_options(p: argparse.ArgumentParser, *, after_command: bool = False) -> None:
    """--root, --debug, -v, -q: on the main parser, and again on every command's parser so that
    ``imagebuild plan X --debug`` works too. After the command they default to SUPPRESS: a value
    given before the command is then kept."""
    unset = {"default": argparse.SUPPRESS} if after_command else {}
    g = p.add_argument_group("global options (before or after the command)") if after_command else p
    g.add_argument("--root", metavar="DIR", **(unset or {"default": os.environ.get("IMAGEBUILD_ROOT")}),
                   help="project root holding docker-images/ (default: $IMAGEBUILD_ROOT, else the nearest "
                   "folder at or above the current one that has docker-images/)")
    g.add_argument("--debug", action="store_true", **unset,
                   help="show tracebacks and debug logs (every command run)")
    g.add_argument("-v", "--verbose", action="store_true", **unset,
                   help="more on stderr: every command run (+ docker ...) and, for build, each stage's log lines")
    g.add_argument("-q", "--quiet", action="store_true", **unset,
                   help="only warnings and errors on stderr (not with -v)")


class _SubParsers(argparse._SubParsersAction):
    """``add_parser(name, help=, description=, examples=, epilog=)`` for the command modules: the epilog
    is made of the examples, the command's own ``epilog`` (its environment, ...) and SHORT_EPILOG; the
    help is formatted by _Formatter; the global options are added."""

    only: str | None = None  # build_parser(only=...): the other commands get a stand-in

    def add_parser(self, name, *, examples: Sequence[str] = (), **kw):
        if self.only is not None and name != self.only:
            real, self._parser_class = self._parser_class, _Unused
            try:
                return super().add_parser(name, **kw)
            finally:
                self._parser_class = real
        kw["epilog"] = _command_epilog(examples, kw.get("epilog"))
        kw.setdefault("formatter_class", _Formatter)
        sp = super().add_parser(name, **kw)
        _global_options(sp, after_command=True)
        return sp


class _Unused:
    """A command's parser when another command runs: its options are never parsed or shown, and
    building them costs start-up time (argparse looks up translations for every option)."""

    def __init__(self, **kw):
        pass

    def __getattr__(self, name):
        return lambda *a, **kw: self


def command_in(argv: Sequence[str]) -> str:
    """The command named in ``argv`` (the first word that is not an option or --root's value), or
    "" when there is none (``--version``, ``--help``, a usage error: no command parser is needed)."""
    it = iter(argv)
    for word in it:
        if word == "--root":
            next(it, None)
        elif word in ("-h", "--help"):
            return ""
        elif not word.startswith("-"):
            return word
    return ""


NO_COMMAND = "-"  # build_parser(only=NO_COMMAND): no command's parser, and no command module imported


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, that command's options are built (its module alone imported) and the
    others' are not: they are registered by name (argparse's choices, a typo's suggestion). ``only=""``:
    no command's options, but every command's help line (the top-level help); NO_COMMAND: names only."""
    p = _Parser(
        prog="imagebuild",
        description="Reproducible, offline, staged builds of vLLM serving images for DGX Spark (GB10) "
        "clusters: definitions -> plan -> prefetch -> build -> gate -> promotion to IMAGE:local.",
        epilog=EPILOG, formatter_class=_TopFormatter)
    p.add_argument("--version", action="version", version=f"imagebuild {__version__}")
    _global_options(p)
    p.register("action", "parsers", _SubParsers)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser, title="commands")
    sub.required = True
    sub.only = only
    for name in COMMANDS:
        if only and name != only:  # its name only: its module is not imported
            sub.add_parser(name)
        else:  # every command (the top-level help lists each one's help), or the one that runs
            command_module(name).add_parser(sub)
    return p


def command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Command name -> its parser (a stand-in for those ``build_parser(only=...)`` did not build)."""
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def unknown_command(parser, word: str, commands) -> None:
    """Exit 2: ``word`` is no command; the closest ones suggested."""
    import difflib

    close = difflib.get_close_matches(word, list(commands), n=3, cutoff=0.6)
    parser.error(f"unknown command {word[:40]!r}" + (f": did you mean {' or '.join(close)}?" if close else "")
                 + " (imagebuild help lists the commands)")


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """parse_args, with a suggestion for an unknown command or option and -v/-q refused together (exit 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    word = command_in(argv)
    commands = command_parsers(parser)
    if word and commands and word not in commands:
        unknown_command(parser, word, commands)
    if word == "prefetch":  # the old spelling of one source's refresh (--refresh takes no value now)
        argv = [("--refresh-source=" + a.split("=", 1)[1]) if a.startswith("--refresh=") else a for a in argv]
    args, extra = parser.parse_known_args(argv)
    sp = command_parsers(parser).get(getattr(args, "command", None), parser)
    if extra:
        msg = f"unrecognized arguments: {' '.join(extra)}"
        known = [o for a in sp._actions for o in a.option_strings if o.startswith("--")]
        for tok in extra:
            name = tok.split("=", 1)[0]
            starts = [o for o in known if name.startswith("--") and o.startswith(name)]
            if starts:
                msg += f" (options are never abbreviated: did you mean {' or '.join(starts)}?)"
                break
            import difflib

            close = difflib.get_close_matches(name, known, n=2, cutoff=0.75) if name.startswith("--") else []
            if close:  # a typo (--histroy)
                msg += f" (did you mean {' or '.join(close)}?)"
                break
        sp.error(msg)
    if args.verbose and args.quiet:
        sp.error("-v/--verbose and -q/--quiet cannot be used together")
    return args
