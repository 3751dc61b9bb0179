"""First contact (issue 23, section 4): bare ``imagebuild`` prints the help, ``imagebuild help CMD``
works, a mistyped command gets a suggestion, the commands are grouped by step, each command's help
ends with examples (the long epilog only in the top-level help), descriptions are wrapped, and the
schema versions the help names are the ones the code writes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from imagebuild.cli import parser as cli
from tests.conftest import run_cli

PACKAGE = Path(__file__).resolve().parents[3] / "imagebuild"


def _commands() -> dict:
    return cli.command_parsers(cli.build_parser())


def test_bare_imagebuild_prints_the_help_and_exits_2(tmp_path):
    res = run_cli()
    assert res.code == 2 and res.out.startswith("usage: imagebuild") and "commands:" in res.out
    res = run_cli("--root", str(tmp_path))
    assert res.code == 2 and "commands:" in res.out


def test_help_command(capsys):
    for name in _commands():
        a, b = run_cli("help", name), run_cli(name, "--help")
        assert a.code == 0 and a.out == b.out and a.out.startswith(f"usage: imagebuild {name}"), name
    top = run_cli("help")
    assert top.code == 0 and top.out == run_cli("--help").out


@pytest.mark.parametrize("argv, meant", [
    (["biuld", "example"], "build"), (["valdiate"], "validate"), (["nigthly", "x"], "nightly"),
    (["help", "rolback"], "rollback"), (["--debug", "synk"], "sync"),
])
def test_a_mistyped_command_gets_a_suggestion(argv, meant):
    res = run_cli(*argv)
    assert res.code == 2 and f"did you mean {meant}" in res.err and "Traceback" not in res.err, res
    assert res.out == ""


def test_an_unknown_command_with_no_close_one():
    res = run_cli("frobnicate")
    assert res.code == 2 and "unknown command 'frobnicate'" in res.err and "did you mean" not in res.err


def test_commands_are_grouped_by_step():
    grouped = [n for _, names in cli.GROUPS for n in names]
    assert len(grouped) == len(set(grouped))
    assert sorted(grouped) == sorted(_commands()), "a command in no group (or a group naming none)"
    out = run_cli("--help").out
    section = out.split("\ncommands:\n", 1)[1].split("\n\n", 1)[0]
    for title, names in cli.GROUPS:
        assert f"\n  {title}:\n" in "\n" + section
        for n in names:
            assert re.search(rf"^    {re.escape(n)} +\S", section, re.M), n


def test_examples_in_every_command_and_the_long_epilog_only_at_the_top():
    top = run_cli("--help").out
    assert "exit codes:" in top and "IMAGEBUILD_ROOT" in top
    docs = re.search(r"^docs: (\S+)/ ", top, re.M).group(1)  # docs that exist where this imagebuild runs
    assert (Path(docs) / "cli.md").is_file() and (Path(docs) / "image-definition.md").is_file()
    for name, sp in _commands().items():
        text = sp.format_help()
        examples = text.split("\nexamples:\n", 1)[1].split("\n\n", 1)[0].splitlines()
        assert len(examples) >= 2 and all(e.startswith(f"  imagebuild {name}") or
                                          re.match(rf"  [A-Z_]+=\S+ imagebuild {name}", e) for e in examples), name
        assert "exit codes:" not in text and "130  interrupted" not in text, name
        assert text.rstrip().endswith(cli.SHORT_EPILOG), name


def test_descriptions_are_wrapped(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    for name, sp in cli.command_parsers(cli.build_parser()).items():
        for line in sp.format_help().splitlines():
            if line and not line.startswith(" "):
                assert len(line) <= 80, f"{name}: {line}"


def schema_versions(package: Path = PACKAGE) -> dict[str, set[int]]:
    """schema name -> the versions the code writes it with: ``X_SCHEMA``/``X_VERSION`` constants, and
    dict literals ``{"schema": S, "version": N}`` (S or N a literal or a module constant)."""
    out: dict[str, set[int]] = {}
    for f in sorted(package.rglob("*.py")):
        tree = ast.parse(f.read_text(encoding="utf-8"))
        consts = {n.targets[0].id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                  and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name) and isinstance(n.value, ast.Constant)}

        def val(n, consts=consts):
            if isinstance(n, ast.Constant):
                return n.value
            if isinstance(n, ast.Name):
                return consts.get(n.id)
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add):
                a, b = val(n.left), val(n.right)
                return a + b if isinstance(a, str) and isinstance(b, str) else None
            return None

        for name, v in consts.items():
            if isinstance(v, str) and v.startswith("imagebuild.") and name.endswith("SCHEMA"):
                ver = consts.get(name[: -len("SCHEMA")] + "VERSION")
                if isinstance(ver, int):
                    out.setdefault(v, set()).add(ver)
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                d = {val(k): val(v) for k, v in zip(node.keys, node.values, strict=True) if k is not None}
                if isinstance(d.get("schema"), str) and isinstance(d.get("version"), int):
                    out.setdefault(d["schema"], set()).add(d["version"])
    return out


def test_help_names_the_schema_versions_the_code_writes():
    written = schema_versions()
    assert written["imagebuild.plan"] == {2} and written["imagebuild.bundle-result"] == {1}
    texts = {"imagebuild": cli.build_parser().format_help(),
             **{n: sp.format_help() for n, sp in _commands().items()}}
    seen = 0
    for where, text in texts.items():
        flat = " ".join(text.split())
        for m in re.finditer(r"schema (imagebuild\.[a-z-]+), version (\d+)", flat):
            assert m.group(1) in written, f"{where}: {m.group(1)} is written nowhere"
            assert written[m.group(1)] == {int(m.group(2))}, f"{where} --help: {m.group(0)}, the code: {written[m.group(1)]}"
            seen += 1
    assert seen >= 15
