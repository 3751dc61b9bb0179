"""The help text, byte for byte: ``imagebuild --help`` and ``imagebuild COMMAND --help`` of every
command at COLUMNS=100 equal the files under golden/help/ (issue 35, section 5: the help stays the
same while the code that declares it moves). Only the public entry point ``main`` is used.

After a deliberate change of the help: ``IMAGEBUILD_GOLDEN_WRITE=1 pytest tests/unit/cli/test_help_golden.py``
rewrites the files; review their diff."""

from __future__ import annotations

import io
import os
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from imagebuild.cli.main import main

GOLDEN = Path(__file__).resolve().parent / "golden" / "help"
DOCS = str(Path(__file__).resolve().parents[3] / "docs")
WRITE = os.environ.get("IMAGEBUILD_GOLDEN_WRITE") == "1"


def _help(monkeypatch, *argv: str) -> str:
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.delenv("IMAGEBUILD_ROOT", raising=False)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err), pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0 and err.getvalue() == "", argv
    text = out.getvalue()
    # the docs folder is this checkout's (or the install's): its paragraph is wrapped around the path,
    # so it is compared with the path replaced and the lines joined
    head, sep, docs = text.partition("\ndocs: ")
    if sep:
        text = head + "\ndocs: " + " ".join(docs.split()).replace(DOCS + "/", "<docs>/") + "\n"
    return text


def _commands(top: str) -> list[str]:
    section = top.split("\ncommands:\n", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"^    (\S+) ", section, re.M)


def _check(name: str, text: str) -> None:
    path = GOLDEN / f"{name}.txt"
    if WRITE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.read_text(encoding="utf-8") == text, f"the help of {name!r} changed (golden: {path})"


def test_top_level_help_is_unchanged(monkeypatch):
    _check("imagebuild", _help(monkeypatch))


def test_every_command_help_is_unchanged(monkeypatch):
    commands = _commands(_help(monkeypatch))
    assert len(commands) >= 20 and "build" in commands and "nightly" in commands
    for name in commands:
        _check(f"imagebuild-{name}", _help(monkeypatch, name))
    files = sorted(p.stem for p in GOLDEN.glob("imagebuild-*.txt"))
    assert files == sorted(f"imagebuild-{n}" for n in commands), "a golden file of no command, or a command without one"
