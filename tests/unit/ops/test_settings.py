"""``imagebuild config`` (issue 23, section 4): every setting with its origin, and one list of the
environment variables imagebuild reads, kept in step with the code and with docs/cli.md's table."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from imagebuild.ops import settings
from tests.conftest import run_cli

PACKAGE = Path(__file__).resolve().parents[3] / "imagebuild"
CLI_DOC = PACKAGE.parent / "docs" / "cli.md"
ENV_NAME = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+|[A-Z]{4,}")
# read, but nobody sets them for imagebuild: the process's own search path
NOT_LISTED = {"PATH"}
# IMAGEBUILD_* names imagebuild sets for others (build args, the --notify hook, helper containers)
SET_FOR_OTHERS = {"IMAGEBUILD_IMAGE", "IMAGEBUILD_STAGE", "IMAGEBUILD_BUILD_ID", "IMAGEBUILD_REPORT_MD",
                  "IMAGEBUILD_REPORT_JSON", "IMAGEBUILD_NIGHTLY_STATUS", "IMAGEBUILD_NIGHTLY_EXIT",
                  "IMAGEBUILD_SSH_CONTROL"}


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id in ("environ", "env"))


def variables_read(package: Path = PACKAGE) -> dict[str, str]:
    """Every environment variable the code reads -> one file that reads it: ``os.environ.get(X)``,
    ``os.environ[X]``, ``X in os.environ``, ``os.getenv(X)`` with X a string or a module's string
    constant; tuples of names bound to ``*_ENV``; and every ``"IMAGEBUILD_..."`` string (a name
    looked up through a helper such as ``num("IMAGEBUILD_GIT_RETRIES", ...)``)."""
    found: dict[str, str] = {}
    for f in sorted(package.rglob("*.py")):
        tree = ast.parse(f.read_text(encoding="utf-8"))
        consts: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                name, v = node.targets[0].id, node.value
                if isinstance(v, ast.Constant) and isinstance(v.value, str):
                    consts[name] = v.value
                elif name.endswith("_ENV") and isinstance(v, ast.Tuple | ast.List):
                    for e in v.elts:
                        if isinstance(e, ast.Constant) and isinstance(e.value, str):
                            found.setdefault(e.value, str(f))

        def value(n: ast.AST, consts=consts) -> str | None:
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                return n.value
            return consts.get(n.id) if isinstance(n, ast.Name) else None

        for node in ast.walk(tree):
            v = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                if node.func.attr in ("get", "pop") and _is_environ(node.func.value) or node.func.attr == "getenv":
                    v = value(node.args[0])
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
                v = value(node.slice)
            elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In | ast.NotIn) \
                    and _is_environ(node.comparators[0]):
                v = value(node.left)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"IMAGEBUILD_[A-Z0-9_]*[A-Z0-9]", node.value):
                v = node.value
            if v and ENV_NAME.fullmatch(v):
                found.setdefault(v, str(f))
    return {k: v for k, v in found.items() if k not in NOT_LISTED and k not in SET_FOR_OTHERS}


def documented() -> list[str]:
    text = CLI_DOC.read_text(encoding="utf-8")
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([A-Z][A-Z0-9_]+)` \|", section, flags=re.M)


def test_the_list_names_exactly_the_variables_the_code_reads():
    listed = [n for n, _ in settings.VARIABLES]
    assert len(listed) == len(set(listed))
    read = variables_read()
    assert sorted(set(read) - set(listed)) == [], "read by the code but not in ops/settings.VARIABLES"
    assert sorted(set(listed) - set(read)) == [], "in ops/settings.VARIABLES but read nowhere"
    assert "IMAGEBUILD_GITHUB_API" in listed


def test_docs_table_is_the_same_list():
    assert sorted(documented()) == sorted(n for n, _ in settings.VARIABLES)


def test_the_scanner_sees_a_new_variable(tmp_path):
    """The check above can fail: a module that reads a variable nobody listed is found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text('import os\nX_ENV = "SOME_NEW_VAR"\n\ndef f():\n'
                              '    return os.environ.get(X_ENV), os.environ["OTHER_VAR"], "IMAGEBUILD_NEW_ONE"\n')
    assert set(variables_read(pkg)) == {"SOME_NEW_VAR", "OTHER_VAR", "IMAGEBUILD_NEW_ONE"}


def _rows(res) -> dict[str, dict]:
    return {r["name"]: r for r in json.loads(res.out)["settings"]}


def test_config_origins(project, tmp_path, monkeypatch):
    for var in ("IMAGEBUILD_ROOT", "IMAGEBUILD_STATE_DIR", "IMAGEBUILD_STAGES", "IMAGEBUILD_CACHE",
                "IMAGEBUILD_LOCK_DIR", "IMAGEBUILD_PEER_CACHE", "XDG_CACHE_HOME", "IMAGEBUILD_SSH", "DOCKER_HOST"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (project / "imagebuild.yaml").write_text("peers: [dgx4]\nregistry: 127.0.0.1:5000/ib\n")
    res = run_cli("--root", str(project), "config", "--json")
    assert res.code == 0, res
    rows = _rows(res)
    assert rows["root"] == {"name": "root", "value": str(project), "origin": "flag", "via": "--root"}
    assert rows["state"]["value"] == str(project / ".imagebuild") and rows["state"]["origin"] == "default"
    assert rows["stage store"]["value"] == str(tmp_path / "home/.cache/imagebuild/stages")
    assert rows["peers"] == {"name": "peers", "value": ["dgx4"], "origin": "imagebuild.yaml", "via": "peers"}
    assert rows["registry"]["value"] == "127.0.0.1:5000/ib" and rows["registry"]["origin"] == "imagebuild.yaml"
    assert rows["peer lists"]["origin"] == "default"

    monkeypatch.setenv("IMAGEBUILD_STAGES", str(tmp_path / "st"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("IMAGEBUILD_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_secretvalue123")
    res = run_cli("--root", str(project), "config", "--json", "--env")
    rows = _rows(res)
    assert rows["stage store"] == {"name": "stage store", "value": str(tmp_path / "st"), "origin": "environment",
                                   "via": "IMAGEBUILD_STAGES"}
    assert rows["git mirror cache"]["value"] == str(tmp_path / "xdg/imagebuild/git")
    assert rows["git mirror cache"]["origin"] == "environment" and rows["git mirror cache"]["via"] == "XDG_CACHE_HOME"
    assert rows["lock folder"]["via"] == "IMAGEBUILD_LOCK_DIR"
    env = {e["name"]: e for e in json.loads(res.out)["environment"]}
    assert set(env) == {n for n, _ in settings.VARIABLES}
    assert env["GITHUB_TOKEN"]["set"] and "ghp_secretvalue123" not in res.out
    human = run_cli("--root", str(project), "config")
    assert human.code == 0 and "ghp_secretvalue123" not in human.out
    assert re.search(r"^stage store\s+\S+/st\s+environment \(IMAGEBUILD_STAGES\)$", human.out, re.M), human.out


def test_config_root_from_the_environment_and_outside_a_project(project, tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_ROOT", str(project))
    res = run_cli("config", "--json")
    assert _rows(res)["root"]["origin"] == "environment" and _rows(res)["root"]["via"] == "IMAGEBUILD_ROOT"
    monkeypatch.delenv("IMAGEBUILD_ROOT")
    monkeypatch.chdir(tmp_path)
    res = run_cli("config", "--json")
    assert res.code == 0, res
    assert _rows(res)["root"]["value"] is None and _rows(res)["state"]["value"] is None
    assert run_cli("--root", str(tmp_path), "config").code == 2


def test_config_names_a_bad_imagebuild_yaml(project):
    (project / "imagebuild.yaml").write_text("peers: [dgx4]\nregistyr: x\n")
    res = run_cli("--root", str(project), "config")
    assert res.code == 2 and "imagebuild.yaml:2" in res.err and "registry" in res.err


@pytest.mark.parametrize("argv", [["config", "--help"], ["--help"]])
def test_help_points_at_the_list(argv, capsys):
    res = run_cli(*argv)
    assert res.code == 0 and "config --env" in res.out
