"""The command line: argument parsing and printing only, ``main(argv) -> exit code``.

Takes argv and the environment, makes one ``Context``, calls one step's entry point and prints what
it gives (data on stdout, progress on stderr, ``--json`` where the output is data), mapping the
errors of ``core.errors`` to the documented exit codes. Nothing imports it.
- ``main``: the entry point; ``parser``: the top-level parser; ``commands/COMMAND.py``: each command's
  options and run function; ``options``: the options several commands share; ``common``: what their
  run functions share; ``actions``: what nightly tells a CI runner.
"""

__all__ = ["main"]
