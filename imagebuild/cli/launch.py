"""The ``imagebuild`` console script (pyproject.toml): ``cli.main`` with the start-up of the
read-only commands cut (docs/cli.md, "Start-up time").

Nothing else imports this module. Its import turns the cyclic garbage collector off before the
command's modules are imported (the collector's passes over the objects those imports create are
~5% of ``plan``). A command that is not read-only turns it back on before it runs; ``list``,
``validate`` and ``plan`` run without it (reference counting still frees what they drop) and end
with ``os._exit`` once stdout and stderr are flushed: freeing every module and object at exit
is another ~6 ms, and they hold nothing a teardown would close.
"""

from __future__ import annotations

import gc

gc.disable()

import os  # noqa: E402
import sys  # noqa: E402

from imagebuild.cli.main import READ_ONLY_COMMANDS, _command_in  # noqa: E402
from imagebuild.cli.main import main as cli_main  # noqa: E402


def main() -> None:
    argv = sys.argv[1:]
    read_only = _command_in(argv) in READ_ONLY_COMMANDS
    if not read_only:
        gc.enable()
    code = cli_main(argv)
    if read_only:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (BrokenPipeError, ValueError):
            pass
        else:
            os._exit(code)
    sys.exit(code)
