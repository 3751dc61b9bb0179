"""The man page and the shell completions generate from the parser (``make man completion``,
scripts/man_completion.py; issue 23, section 4), and they hold every command."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from imagebuild.cli import parser as cli

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
    for name in cli.command_parsers(cli.build_parser()):
        assert f"imagebuild {name}" in shown, name
    assert _gen("man", tmp_path).returncode == 0 and page.read_text() == text  # same page again


def test_the_man_page_has_a_name_line_its_own_sections_examples_and_no_build_path(tmp_path):
    """Issue 35: NAME had no line (whatis found nothing), the exit codes and the environment landed in
    COMMENTS as reflowed text, the commands' examples were lost, and the checkout's docs path was baked in."""
    from imagebuild.ops.settings import VARIABLES

    res = _gen("man", tmp_path)
    assert res.returncode == 0, res.stderr
    text = (tmp_path / "man" / "imagebuild.1").read_text()
    assert re.search(r"^\.SH NAME\nimagebuild \\- \S.+$", text, re.M), text[:300]
    heads = re.findall(r"^\.SH (.+)$", text, re.M)
    assert "COMMENTS" not in heads and heads[-4:] == ["EXIT STATUS", "ENVIRONMENT", "EXAMPLES", "SEE ALSO"], heads
    status = text.split(".SH EXIT STATUS\n", 1)[1].split(".SH ", 1)[0]
    assert re.findall(r"^\\fB(\d+)\\fR$", status, re.M) == ["0", "1", "2", "3", "4", "130"]
    env = text.split(".SH ENVIRONMENT\n", 1)[1].split(".SH ", 1)[0]
    assert env.count(".TP") == len(VARIABLES) and "\\fBIMAGEBUILD_HEARTBEAT_S\\fR" in env
    examples = text.split(".SH EXAMPLES\n", 1)[1].split(".SH ", 1)[0]
    for name, lines in cli.examples().items():
        assert f".SS imagebuild {name}" in examples, name
        assert all(e.replace("-", "\\-") in examples for e in lines), name
    assert str(ROOT) not in text and "/docs/" not in text  # no path of this build tree
    if shutil.which("lexgrog"):  # what mandb feeds whatis and apropos
        got = subprocess.run(["lexgrog", str(tmp_path / "man" / "imagebuild.1")], capture_output=True, text=True,
                             timeout=60)
        assert got.returncode == 0 and '"imagebuild - reproducible, offline' in got.stdout, got.stdout + got.stderr


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


def test_completion_completes_images_commands_after_help_and_peers(tmp_path, project):
    """Issue 35: completion completed flags only; now the project's image names (docker-images/), the
    command names after `help`, and the peers (and @lists) of imagebuild.yaml, read by the shell."""
    res = _gen("completion", tmp_path)
    assert res.returncode == 0, res.stderr
    script = tmp_path / "completion" / "imagebuild.bash"
    (project / "imagebuild.yaml").write_text("peers:\n  - dgx4\n  - 'dgx5'  # the second\n"
                                             "peer_lists:\n  rack2: [dgx6, dgx7]\n")

    def complete(*words: str, cwd: Path = project, env: dict | None = None) -> list[str]:
        line = " ".join(words)
        prog = (f'source "{script}"; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; COMP_LINE="{line}"; '
                f'COMP_POINT=${{#COMP_LINE}}; _shtab_imagebuild imagebuild "{words[-1]}" "{words[-2]}"; '
                'printf "%s\\n" "${COMPREPLY[@]}"')
        return subprocess.run(["bash", "-c", prog], capture_output=True, text=True, check=True, cwd=cwd,
                              env={"PATH": "/usr/bin:/bin", **(env or {})}, timeout=60).stdout.split()

    assert complete("imagebuild", "build", "") == ["mirror", "staged", "tiny"]
    assert complete("imagebuild", "plan", "st") == ["staged"]
    assert complete("imagebuild", "build", "t", cwd=project / "docker-images" / "tiny") == ["tiny"]  # from below
    assert complete("imagebuild", "--root", str(project), "log", "m", cwd=tmp_path) == ["mirror"]
    assert complete("imagebuild", "nightly", "t", cwd=tmp_path, env={"IMAGEBUILD_ROOT": str(project)}) == ["tiny"]
    assert complete("imagebuild", "sync", "--image", "ti") == ["tiny"]
    assert sorted(complete("imagebuild", "help", "b")) == ["build", "bundle"]
    assert "doctor" in complete("imagebuild", "help", "")
    assert complete("imagebuild", "sync", "dg") == ["dgx4", "dgx5"]
    assert complete("imagebuild", "sync", "@") == ["@rack2"]
    assert sorted(complete("imagebuild", "doctor", "--peer", "")) == ["@rack2", "dgx4", "dgx5"]
    assert complete("imagebuild", "build", "", cwd=tmp_path) == []  # no project here: nothing, no error


def test_a_missing_generator_is_said_plainly(tmp_path):
    # an interpreter with no site-packages: shtab and argparse_manpage cannot be imported
    res = subprocess.run([sys.executable, "-S", str(SCRIPT), "man", "--out", str(tmp_path)], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}, timeout=60)
    assert res.returncode == 2 and "is missing: pip install" in res.stderr and "Traceback" not in res.stderr
