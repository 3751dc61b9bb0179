"""The house (docs/design.md): imagebuild's subpackages are layers along the data flow, and imports run
one way, down the flow. Checked from the code's own imports (every ``import`` statement, at module
level or inside a function, and every ``lazy.module("imagebuild...")``), so the rules hold after the
change that made them:

- no module imports a subpackage above its own;
- no import cycle between modules, anywhere;
- a module of another subpackage is reached only through a name that subpackage's ``__init__.py``
  lists in ``__all__`` (its entry points); the rest of a subpackage is its own business;
- an ``__init__.py`` imports nothing (so importing a subpackage costs nothing and closes no cycle);
- the top level holds only ``__init__`` and ``__main__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "imagebuild"

# lowest first: a subpackage may import its own modules and those of the subpackages before it
LAYERS = ("core", "definition", "plan", "fetch", "gate", "buildstep", "ship", "ops", "cli")
TOP_LEVEL = {"__init__", "__main__"}


def modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package``."""
    out = {}
    for p in sorted(package.rglob("*.py")):
        parts = list(p.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _targets(name: str, node: ast.AST, mods: dict[str, Path]) -> list[tuple[str, str | None]]:
    """(module imported, the name taken from a package or None) for one import statement of ``name``."""
    is_pkg = mods[name].name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found: list[tuple[str, str | None]] = []
    if isinstance(node, ast.Import):
        for a in node.names:
            found.append((a.name, None))
        return found
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = here[: len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
        module = ".".join(base)
    else:
        module = node.module or ""
    for a in node.names:
        sub = f"{module}.{a.name}"
        found.append((sub, None) if sub in mods else (module, a.name))
    return found


def import_edges(package: Path) -> tuple[dict[str, Path], list[tuple[str, str, str | None, int]]]:
    """Every import inside ``package``: (importer, imported module, name taken from a package, line)."""
    mods = modules(package)
    top = package.name
    edges = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            targets: list[tuple[str, str | None]] = []
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = _targets(name, node, mods)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "module"
                  and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                  and node.args[0].value.startswith(top + ".")):
                targets = [(node.args[0].value, None)]  # lazy.module("imagebuild.core.run")
            for module, taken in targets:
                if module == top or module.startswith(top + "."):
                    while module not in mods and "." in module:
                        module = module.rpartition(".")[0]
                    edges.append((name, module, taken, node.lineno))
    return mods, edges


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def _all_of(path: Path) -> set[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def cycles(mods: dict[str, Path], edges) -> list[list[str]]:
    """The import cycles between modules (strongly connected components of more than one module)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for a, b, _taken, _line in edges:
        if a != b:
            graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def violations(package: Path) -> list[str]:
    """Every broken rule of the module doc, as one line each (empty: the house holds)."""
    mods, edges = import_edges(package)
    top = package.name
    problems = []
    for name, path in mods.items():
        parts = name.split(".")
        if len(parts) == 2 and path.name != "__init__.py" and parts[1] not in TOP_LEVEL:
            problems.append(f"{name}: a top-level module; it belongs in one of {', '.join(LAYERS)}")
        if len(parts) >= 2 and parts[1] not in LAYERS and parts[1] not in TOP_LEVEL:
            problems.append(f"{name}: {parts[1]}/ is not a layer of the house (tests/unit/test_layering.py LAYERS)")
    for a, b, taken, line in edges:
        where = f"{mods[a].relative_to(package.parent)}:{line}"
        if mods[a].name == "__init__.py" and a != top:
            problems.append(f"{where}: {a}/__init__.py imports {b}: an __init__ names its entry points, imports nothing")
        la, lb = layer_of(a), layer_of(b)
        if la is None or lb is None or la == lb:
            continue
        if LAYERS.index(lb) > LAYERS.index(la):
            problems.append(f"{where}: {la} imports {b}, a layer above it ({' < '.join(LAYERS)})")
            continue
        entry = b.split(".")[2] if b.count(".") >= 2 else taken
        public = _all_of(package / lb / "__init__.py")
        if entry not in public:
            problems.append(f"{where}: {a} reaches {top}.{lb}.{entry}, which {lb}/__init__.py does not list in __all__")
    for comp in cycles(mods, edges):
        problems.append("import cycle: " + " <-> ".join(comp))
    return problems


def test_the_house_holds():
    assert violations(PACKAGE) == []


def test_every_layer_says_what_it_takes_and_gives():
    for layer in LAYERS:
        init = PACKAGE / layer / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc.splitlines()) >= 3, f"{init}: a docstring of what the step takes and gives"
        public = _all_of(init)
        assert public, f"{init}: __all__ names the entry points"
        for entry in public:
            assert (PACKAGE / layer / f"{entry}.py").is_file(), f"{init}: __all__ names {entry!r}, not a module"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "imagebuild"
    for rel, text in files.items():
        p = pkg / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for layer in LAYERS:
        init = pkg / layer / "__init__.py"
        if not init.exists():
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text('"""x"""\n__all__ = ["a"]\n')
    (pkg / "__init__.py").write_text("")
    return pkg


@pytest.mark.parametrize("files, expected", [
    ({"core/a.py": "from imagebuild.definition import a\n", "definition/a.py": ""}, "a layer above it"),
    ({"plan/a.py": "def f():\n    from imagebuild.ship import a\n", "ship/a.py": ""}, "a layer above it"),
    ({"core/a.py": "from imagebuild.core import b\n", "core/b.py": "def f():\n    from . import a\n"},
     "import cycle: imagebuild.core.a <-> imagebuild.core.b"),
    ({"core/a.py": "", "core/b.py": "", "plan/a.py": "from imagebuild.core.b import x\n"},
     "does not list in __all__"),
    ({"core/a.py": "run = lazy.module('imagebuild.gate.a')\n", "gate/a.py": ""}, "a layer above it"),
    ({"core/a.py": "", "core/__init__.py": '"""x"""\n__all__ = ["a"]\nfrom . import a\n'}, "imports nothing"),
    ({"helpers.py": ""}, "a top-level module"),
])
def test_the_check_finds_each_kind_of_break(tmp_path, files, expected):
    """The check can fail: a planted break of each rule is reported."""
    problems = violations(_tree(tmp_path, files))
    assert any(expected in p for p in problems), problems


def test_a_clean_tree_passes(tmp_path):
    assert violations(_tree(tmp_path, {"core/a.py": "", "plan/a.py": "from imagebuild.core import a\n"})) == []


def test_declared_dependencies_are_imported():
    """A declared dependency nothing imports is a defect (docs/design.md, "Dependencies")."""
    import re
    import tomllib

    root = PACKAGE.parent
    data = tomllib.loads((root / "pyproject.toml").read_text())
    names = {re.split(r"[<>=!\[; ]", d, maxsplit=1)[0].lower() for d in data["project"]["dependencies"]}
    module_of = {"pyyaml": "yaml", "pytest-testinfra": "testinfra", "zstandard": "zstandard", "uv": "uv"}
    text = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    for name in sorted(names):
        mod = module_of.get(name, name.replace("-", "_"))
        used = re.search(rf"^\s*(import|from) {mod}\b|lazy\.module\(\"{mod}\b|\"-m\", \"{mod}\"", text, re.M)
        assert used, f"{name} is declared in pyproject.toml but no module of imagebuild imports {mod}"


def test_subprocesses_start_only_in_core_run():
    """One module starts subprocesses (core/run.py, docs/design.md): no other module imports
    ``subprocess`` (or reaches it through ``lazy.module``), ``os.system`` or ``os.posix_spawn``."""
    bad = []
    for name, path in modules(PACKAGE).items():
        if name == "imagebuild.core.run":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            hit = None
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "subprocess" for a in node.names):
                hit = "import subprocess"
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "subprocess":
                hit = "from subprocess import"
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "module" \
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "subprocess":
                hit = 'lazy.module("subprocess")'
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" \
                    and node.attr in ("system", "popen", "posix_spawn", "posix_spawnp", "execv", "execvp", "fork"):
                hit = f"os.{node.attr}"
            if hit:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {hit}")
    assert bad == [], "subprocesses start only through imagebuild/core/run.py:\n" + "\n".join(bad)


# pytest's default norecursedirs and the build-output folders of common .gitignore files (GitHub's
# Python one: build/, dist/): a package or a test folder so named goes unseen by those tools
BUILD_OUTPUT_NAMES = ("*.egg", ".*", "_darcs", "build", "CVS", "dist", "node_modules", "venv", "{arch}")


def test_no_package_or_test_folder_is_named_like_build_output():
    from fnmatch import fnmatch

    tests = PACKAGE.parent / "tests"
    folders = [d for top in (PACKAGE, tests) for d in [top, *top.rglob("*")] if d.is_dir()
               and d.name != "__pycache__" and (any(d.glob("*.py")) or (d == top))]
    assert len(folders) > 10
    bad = [str(d.relative_to(PACKAGE.parent)) for d in folders
           if any(fnmatch(d.name, pat) for pat in BUILD_OUTPUT_NAMES)]
    assert bad == [], f"named like build output (pytest and .gitignore files skip them): {bad}"


CLI_MODULE_MAX_LINES = 500


def test_the_cli_is_split_one_module_per_command():
    """cli/main.py is the entry point; each command is declared and run by cli/commands/COMMAND.py
    (docs/design.md, "The command line's own house"), and no module of cli/ is a second main.py."""
    from imagebuild.cli import parser

    cli = PACKAGE / "cli"
    long = {str(p.relative_to(PACKAGE)): n for p in sorted(cli.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > CLI_MODULE_MAX_LINES}
    assert long == {}, f"over {CLI_MODULE_MAX_LINES} lines: split them"
    listed = list(parser.command_parsers(parser.build_parser()))
    assert listed == list(parser.COMMANDS)
    modules = sorted(p.stem for p in (cli / "commands").glob("*.py") if p.stem != "__init__")
    assert modules == sorted(listed), "a command without its module, or a module of no command"
    for name in listed:
        mod = parser.command_module(name)
        assert callable(mod.add_parser) and callable(mod.run) and mod.EXAMPLES, name
        only = parser.command_parsers(parser.build_parser(only=name))[name]
        assert only.get_default("func") is mod.run, f"{name}: its parser runs another module's code"
