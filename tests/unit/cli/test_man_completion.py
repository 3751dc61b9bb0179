"""The man page and the shell completions generate from the parser (``make man completion``,
scripts/man_completion.py; issue 23, section 4), and they hold every command."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from imagebuild.cli import main as cli

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "man_completion.py"


def _gen(what: str, out: Path, env_extra=None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "SOURCE_DATE_EPOCH": "0", **(env_extra or {})}
    return subprocess.run([sys.executable, str(SCRIPT), what, "--out", str(out)], capture_output=True, text=True,
                          env=env, timeout=120)


def test_the_man_page_has_every_command(tmp_path):
    res = _gen("man", tmp_path)
    assert res.returncode == 0, res.stderr
    page = tmp_path / "man" / "imagebuild.1"
    text = page.read_text()
    assert text.startswith('.TH IMAGEBUILD "1" "1970\\-01\\-01" "imagebuild ')
    if shutil.which("groff") is None:
        pytest.skip("groff is not installed: the page's rendering is not checked")
    shown = subprocess.run(["groff", "-man", "-Tutf8", str(page)], capture_output=True, text=True, check=True,
                           timeout=60).stdout
    shown = re.sub(r".\x08", "", shown).replace("\u2010", "-")  # bold and underline by overstriking
    for name in cli._command_parsers(cli.build_parser()):
        assert f"imagebuild {name}" in shown, name
    assert _gen("man", tmp_path).returncode == 0 and page.read_text() == text  # same page again


def test_bash_completion_completes_commands_and_options(tmp_path):
    res = _gen("completion", tmp_path)
    assert res.returncode == 0, res.stderr
    script = tmp_path / "completion" / "imagebuild.bash"
    assert (tmp_path / "completion" / "_imagebuild").read_text().startswith("#compdef imagebuild")

    def complete(*words: str) -> list[str]:
        line = " ".join(words)
        prog = (f'source "{script}"; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; COMP_LINE="{line}"; '
                f'COMP_POINT=${{#COMP_LINE}}; _shtab_imagebuild imagebuild "{words[-1]}" "{words[-2]}"; '
                'printf "%s\\n" "${COMPREPLY[@]}"')
        return subprocess.run(["bash", "-c", prog], capture_output=True, text=True, check=True,
                              timeout=60).stdout.split()

    assert sorted(complete("imagebuild", "bu")) == ["build", "bundle"]
    assert "config" in complete("imagebuild", "con")
    assert {"--no-cache", "--no-gate"} <= set(complete("imagebuild", "build", "--no-"))


def test_a_missing_generator_is_said_plainly(tmp_path):
    # an interpreter with no site-packages: shtab and argparse_manpage cannot be imported
    res = subprocess.run([sys.executable, "-S", str(SCRIPT), "man", "--out", str(tmp_path)], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}, timeout=60)
    assert res.returncode == 2 and "is missing: pip install" in res.stderr and "Traceback" not in res.stderr
