"""The console script (imagebuild/launch.py): read-only commands end early without losing output
or their exit code; every other command runs with the garbage collector on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "project"
SCRIPT = Path(sys.executable).parent / "imagebuild"

pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="the console script is installed by make install")


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *argv], capture_output=True, text=True, cwd=REPO, timeout=60)


def test_a_read_only_command_writes_all_its_output_through_a_pipe():
    res = _run("--root", str(FIXTURE), "plan", "tiny", "--no-engine", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["image"] == "tiny"  # flushed whole before os._exit
    # a reader that stops early: no traceback, no "Exception ignored" noise
    cut = subprocess.run(f"'{SCRIPT}' --root '{REPO}' validate --json | head -c 1", shell=True,
                         capture_output=True, text=True, timeout=60)
    assert cut.stdout == "{" and cut.stderr == "", cut.stderr


def test_a_read_only_command_keeps_its_exit_code_and_its_error():
    res = _run("--root", str(FIXTURE), "validate", "no-such-image")
    assert res.returncode == 2
    assert "no such image definition" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("argv, collector", [
    (["plan", "tiny", "--no-engine"], False),
    (["log", "tiny"], True),  # not read-only in this sense: runs as any program does
])
def test_the_collector_is_off_only_for_read_only_commands(argv, collector):
    code = ("import gc, sys\n"
            f"sys.argv = ['imagebuild', '--root', {str(FIXTURE)!r}, *{argv!r}]\n"
            "import imagebuild.cli.launch as launch, imagebuild.cli.main as cli\n"
            "real = cli.main\n"
            "launch.cli_main = lambda a: (print('collector', [gc.isenabled()], file=sys.stderr, flush=True),\n"
            "                             real(a))[1]\n"
            "launch.main()\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert f"collector [{collector}]" in res.stderr, res.stderr
