"""The command line: argument parsing and printing only, ``main(argv) -> exit code``.

Takes argv and the environment, makes one ``Context``, calls one step's entry point and prints what
it gives (data on stdout, progress on stderr, ``--json`` where the output is data), mapping the
errors of ``core.errors`` to the documented exit codes. Nothing imports it.
- ``main``: every command but the nightly's; ``nightly``: ``nightly``, ``report`` and ``diff``.
"""

__all__ = ["main", "nightly"]
