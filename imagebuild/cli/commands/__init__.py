"""One module per command: ``imagebuild COMMAND`` is declared and run by ``cli/commands/COMMAND.py``.

Each has ``add_parser(sub)`` (its subparser, description, options and examples; the options several
commands share come from cli/options.py), ``run(args) -> exit code`` (calls the step's entry point and
prints what it gives) and ``EXAMPLES`` (the end of its --help). cli/parser.py lists them (COMMANDS) and
imports only the one that runs; cli/main.py is the entry point.
"""
