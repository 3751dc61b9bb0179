"""Argument parsing: no abbreviations, global options before or after the command, -v with -q
refused, and help texts that describe only commands that exist (issue 9, section 8)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from imagebuild.cli import parser as cli
from tests.conftest import run_cli, tree_state

DOCS = Path(__file__).resolve().parents[3] / "docs"
# commands that are planned but not there yet: help never names them, docs say "planned"
PLANNED: tuple[str, ...] = ()  # sync (issue 12) and nightly (issue 13) landed; the fleet (issue 14) is options of build, sync, rollback (docs/fleet.md)


def _commands() -> dict:
    return cli.command_parsers(cli.build_parser())


@pytest.mark.parametrize("argv, meant", [
    (["build", "tiny", "--fo"], "--force"),
    (["build", "tiny", "--no-c"], "--no-cache"),
    (["plan", "tiny", "--no-eng"], "--no-engine"),
    (["plan", "tiny", "--js"], "--json"),
    (["--ro", "x", "list"], None),
])
def test_options_are_never_abbreviated(project, argv, meant):
    before = tree_state(project)
    res = run_cli("--root", str(project), *argv)
    assert res.code == 2, res
    assert "Traceback" not in res.err
    if meant:  # (--ro before the command: argparse then takes 'x' for the command and says so)
        assert "unrecognized arguments" in res.err and f"did you mean {meant}" in res.err
    assert res.out == "" and tree_state(project) == before


@pytest.mark.parametrize("argv, meant", [
    (["report", "--histroy"], "--history"),
    (["build", "tiny", "--forse"], "--force"),
    (["gc", "--dyr-run"], "--dry-run"),
])
def test_a_mistyped_option_gets_a_did_you_mean(project, argv, meant):
    """Issue 35: `report --histroy` got no did-you-mean, where `build --fo` did."""
    res = run_cli("--root", str(project), *argv)
    assert res.code == 2 and "unrecognized arguments" in res.err, res
    assert f"(did you mean {meant}?)" in res.err, res.err


@pytest.mark.parametrize("argv", [
    ["--root", "{root}", "--debug", "list"],
    ["list", "--root", "{root}", "--debug"],
    ["--debug", "list", "--root", "{root}"],
    ["list", "--root={root}", "-q"],
    ["-v", "list", "--root", "{root}"],
    ["plan", "tiny", "--no-engine", "--root", "{root}", "-v"],
    ["validate", "tiny", "--root", "{root}", "--quiet"],
])
def test_global_options_after_the_command(project, argv):
    res = run_cli(*[a.replace("{root}", str(project)) for a in argv])
    assert res.code == 0, res


def test_global_options_before_the_command_are_kept(project):
    args = cli.parse(cli.build_parser(), ["--root", str(project), "--debug", "plan", "tiny"])
    assert args.root == str(project) and args.debug is True and args.verbose is False
    args = cli.parse(cli.build_parser(), ["plan", "tiny", "--debug", "--root", str(project)])
    assert args.root == str(project) and args.debug is True


@pytest.mark.parametrize("argv", [["-v", "-q", "list"], ["list", "-v", "-q"], ["-v", "list", "-q"],
                                  ["--quiet", "plan", "tiny", "--verbose"]])
def test_verbose_and_quiet_together_is_a_usage_error(project, argv):
    res = run_cli("--root", str(project), *argv)
    assert res.code == 2, res
    assert "-v/--verbose and -q/--quiet cannot be used together" in res.err
    assert res.out == ""


def _help_texts() -> dict[str, str]:
    p = cli.build_parser()
    texts = {"imagebuild": p.format_help()}
    for name, sp in _commands().items():
        texts[name] = sp.format_help()
    return texts


def test_help_names_only_commands_that_exist():
    commands = set(_commands())
    for where, text in _help_texts().items():
        flat = " ".join(text.split())
        for word in PLANNED:
            assert not re.search(rf"\b{word}\b", flat), f"{where} --help mentions {word!r}, which does not exist"
        for m in re.finditer(r"\bimagebuild ([a-z][a-z-]+)", flat):
            assert m.group(1) in commands, f"{where} --help names 'imagebuild {m.group(1)}'"
        for m in re.finditer(r"-> ([a-z]+)", flat):
            assert m.group(1) in commands | {"promotion"}, f"{where} --help names {m.group(1)!r} as a step"


def test_docs_name_only_commands_that_exist_or_say_planned():
    commands = set(_commands())
    text = (DOCS / "cli.md").read_text()
    for m in re.finditer(r"`imagebuild ([a-z][a-z-]+)", text):
        assert m.group(1) in commands, f"docs/cli.md names `imagebuild {m.group(1)}`"
    for doc in sorted(DOCS.glob("*.md")):
        for n, line in enumerate(doc.read_text().splitlines(), start=1):
            for word in PLANNED:
                if re.search(rf"(?<![\w-]){word}\b", line) and "planned" not in line:
                    pytest.fail(f"{doc.name}:{n} mentions {word!r} without saying it is planned: {line.strip()}")


def test_every_command_documented():
    text = (DOCS / "cli.md").read_text()
    for name in _commands():
        assert f"### `imagebuild {name}" in text, f"docs/cli.md has no section for {name}"
