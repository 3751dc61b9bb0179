"""Start-up: the everyday commands import only what they use (docs/cli.md, "Start-up time"). The
times are measured by `make bench` (benchmarks/bench_startup.py, bench_plan.py); this guards the
imports, which decide them, in a fresh interpreter per command."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
FIXTURE = REPO / "tests" / "fixtures" / "project"

# never on these paths: the docker/test stack, and what only building, gating or logging needs
HEAVY = {"python_on_whales", "docker", "testinfra", "pytest", "git", "requests", "pydantic", "rich",
         "typing", "packaging", "logging", "subprocess", "tempfile", "shutil",
         "socket", "threading", "platform", "difflib", "imagebuild.core.run", "imagebuild.buildstep.builder", "imagebuild.gate.runner",
         "imagebuild.fetch.prefetch", "imagebuild.ops.doctor"}
# what a command may add, because it uses it
USES = {
    # the real definitions' gate specs have PEP 440 specifiers (packaging, which imports typing)
    "repo": {"packaging", "typing"},
    # the plan's provenance asks git (three processes at once: provenance.py)
    "plan": {"imagebuild.core.run", "subprocess", "threading",
             # the stage key hashes each context as the tar stream the build sends (context_stream.py)
             "shutil"},
}
NEVER_FOR = {  # and not even these where the command has no use for them
    "--version": {"yaml", "imagebuild.definition.reader", "hashlib", "json", "pathlib"},
    "list": {"imagebuild.plan.planner"},
    "validate": {"imagebuild.plan.planner"},
}


def _run(code: str) -> set[str]:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(REPO)})
    assert r.returncode == 0, r.stderr
    return set(ast.literal_eval(r.stdout.strip().splitlines()[-1]))


def _modules_after(argv: list[str]) -> set[str]:
    """The modules loaded once ``imagebuild ARGV`` ran (its stdout swallowed)."""
    # what the interpreter's start-up (site, an editable install's finder) loaded is not ours: subtract it
    return _run("import sys, io, contextlib\n"
                "before = set(sys.modules)\n"
                "from imagebuild.cli.main import main\n"
                "with contextlib.redirect_stdout(io.StringIO()):\n"
                "    try:\n"
                f"        main({argv!r})\n"
                "    except SystemExit:\n"
                "        pass\n"
                "print(sorted(set(sys.modules) - before))\n")


@pytest.mark.parametrize("argv", [
    ["--version"],
    ["--root", str(REPO), "list"],
    ["--root", str(REPO), "validate"],
    ["--root", str(FIXTURE), "validate"],
    ["--root", str(REPO), "plan", "example", "--no-engine"],
    ["--root", str(FIXTURE), "plan", "tiny", "--no-engine", "--json"],
], ids=lambda a: " ".join(x for x in a if not x.startswith("/")))
def test_everyday_commands_import_only_what_they_use(argv):
    loaded = _modules_after(argv)
    command = next((a for a in argv if not a.startswith("-") and not a.startswith("/")), "--version")
    allowed = USES.get(command, set()) | (USES["repo"] if str(REPO) in argv else set())
    unwanted = (HEAVY | NEVER_FOR.get(command, set())) - allowed
    assert not (loaded & unwanted), f"{' '.join(argv)} imports {sorted(loaded & unwanted)}"


def test_python_on_whales_and_pytest_only_where_used():
    """They are imported by the modules that use them, when those run (build, gate), not before."""
    for module in ("imagebuild.cli.main", "imagebuild.definition.reader", "imagebuild.plan.planner", "imagebuild.core.engine",
                   "imagebuild.fetch.packages", "imagebuild.fetch.prefetch", "imagebuild.buildstep.builder", "imagebuild.gate.receipts"):
        loaded = _run(f"import sys, {module}; print(sorted(sys.modules))")
        assert not loaded & {"python_on_whales", "docker", "testinfra", "pytest"}, (module, loaded)


def test_a_command_parser_alone_knows_every_command_name():
    """build_parser(only=...) registers the other commands by name only (their modules not imported),
    so a typo still lists every command."""
    from imagebuild.cli import parser as cli

    def choices(parser):
        return set(cli.command_parsers(parser))

    everything = choices(cli.build_parser())
    assert set(cli.COMMANDS) == everything
    for command in ("plan", "list", "nightly", "report"):
        assert choices(cli.build_parser(only=command)) == everything, command


def test_rich_only_where_the_live_view_is_drawn():
    """rich (buildstep/live.py) is imported when a build draws on a terminal, not by the builder itself."""
    for module in ("imagebuild.cli.main", "imagebuild.buildstep.builder", "imagebuild.buildstep.progress",
                   "imagebuild.ops.nightly"):
        loaded = _run(f"import sys, {module}; print(sorted(sys.modules))")
        assert not {m for m in loaded if m == "rich" or m.startswith("rich.")}, module
    loaded = _run("import sys, imagebuild.buildstep.live; print(sorted(sys.modules))")
    assert "rich.live" in loaded  # the check can fail
