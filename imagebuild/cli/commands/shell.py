"""imagebuild shell: a shell (or a command) where a stage's RUN steps run (buildstep/shell.py)."""

from __future__ import annotations

import argparse

from imagebuild.cli import common, options

EXAMPLES = (
    "imagebuild shell example app",
    "imagebuild shell example app -- ls /imagebuild/context",
)


def add_parser(sub) -> None:
    sp = sub.add_parser("shell", help="a shell in a stage: a container of its parent with its inputs, no network",
                        description="Start a container where STAGE's RUN steps run, to see why one failed: FROM "
                        "the stage's parent (the earlier stage's image from the stage store, or the pinned base "
                        "image), --network none (unless the stage declares network: true), the stage's build args "
                        "in the environment, and its inputs, checked against the lock, mounted read-only where "
                        "the build mounts them: /imagebuild/context (what its COPY lines read), /imagebuild/src "
                        "(imagebuild-src), /imagebuild/wheels, /imagebuild/apt. With COMMAND, runs it instead of a "
                        "shell and exits with its code. The container and its temporary tag are removed at the "
                        "end. Details: docs/build.md.",
                        examples=EXAMPLES)
    options.image_argument(sp)
    sp.add_argument("stage", metavar="STAGE", help="the stage whose RUN steps the shell is for")
    sp.add_argument("run_argv", metavar="COMMAND", nargs=argparse.REMAINDER,
                    help="run this (after --) instead of an interactive shell")
    sp.set_defaults(func=run)


def run(args) -> int:
    from imagebuild.buildstep import shell as shell_mod

    command = args.run_argv[1:] if args.run_argv[:1] == ["--"] else args.run_argv
    return shell_mod.shell(common.ctx(args), args.image, args.stage, command or None)
