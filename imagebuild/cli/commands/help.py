"""imagebuild help: the top-level help, or one command's (the same as COMMAND --help)."""

from __future__ import annotations

from imagebuild.cli import parser
from imagebuild.core.errors import EXIT_OK

EXAMPLES = (
    "imagebuild help",
    "imagebuild help build",
)


def add_parser(sub) -> None:
    sp = sub.add_parser("help", help="show the top-level help, or one command's help",
                        description="Print the help of COMMAND (the same as imagebuild COMMAND --help), or "
                        "without COMMAND the top-level help: the commands by step, the exit codes, the "
                        "environment, where the docs are.",
                        examples=EXAMPLES)
    sp.add_argument("topic", metavar="COMMAND", nargs="?", help="a command")
    sp.set_defaults(func=run)


def run(args) -> int:
    if not args.topic:
        parser.build_parser().print_help()
        return EXIT_OK
    top = parser.build_parser(only=args.topic)
    commands = parser.command_parsers(top)
    if args.topic not in commands:
        parser.unknown_command(top, args.topic, commands)
    commands[args.topic].print_help()
    return EXIT_OK
