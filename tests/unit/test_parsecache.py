"""The parse cache (imagebuild/parsecache.py): a cached result is the fresh result, every input of
an entry's name changes it and nothing else does, and a bad entry or an unsafe folder is never
trusted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from imagebuild.core import parsecache, yamlread
from imagebuild.definition import dockerfile, gatespec
from imagebuild.definition import reader as definition
from tests.conftest import run_cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "parse"
    monkeypatch.setenv("IMAGEBUILD_PARSE_CACHE", str(d))
    monkeypatch.setattr(parsecache, "_state", {})
    return d


def _entries(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if not p.name.endswith(".tmp")) if d.is_dir() else []


@pytest.mark.parametrize("name", ["example", "glm53-jovian-r12", "dsv4-flash-vision"])
def test_a_definition_read_from_the_cache_equals_the_fresh_read(cache, monkeypatch, name):
    monkeypatch.setenv("IMAGEBUILD_PARSE_CACHE", "off")
    monkeypatch.setattr(parsecache, "_state", {})
    fresh = definition.load(REPO, name)
    assert not cache.exists()

    monkeypatch.setenv("IMAGEBUILD_PARSE_CACHE", str(cache))
    monkeypatch.setattr(parsecache, "_state", {})
    first = definition.load(REPO, name)  # fills the cache
    written = _entries(cache)
    # image.yaml and gate.yaml (YAML), the gate spec, each Dockerfile and each patch script (a file
    # that two stages share, once)
    dfn_files = {s.dockerfile for s in fresh.stages}
    patches = {i.path.read_bytes() for s in fresh.stages for i in s.inputs if i.kind == "patch"}
    assert len(written) == 3 + len(dfn_files) + len(patches)

    computed = []
    monkeypatch.setattr(parsecache, "_write", lambda d, p, v: computed.append(p))
    cached = definition.load(REPO, name)
    assert computed == [], "a second read parsed again"
    assert cached == fresh == first
    assert cached.gate == fresh.gate and cached.stages == fresh.stages


def test_the_cached_pieces_equal_the_fresh_ones(cache):
    texts = {p: p.read_text() for p in (REPO / "docker-images").rglob("*") if p.is_file()}
    for path, text in texts.items():
        if path.name.startswith("Dockerfile"):
            assert dockerfile.parse(text) == dockerfile._parse(text) == dockerfile.parse(text)
        elif path.suffix == ".yaml":
            assert yamlread.load(text) == yamlread._load(text) == yamlread.load(text)
        if path.name == "gate.yaml":
            assert gatespec.parse(text, "g", path) == gatespec._parse(text, "g", path) == gatespec.parse(text, "g", path)


def test_every_input_of_an_entry_name_changes_it_and_nothing_else_does(cache, monkeypatch):
    base = parsecache.key("yaml", ("a: 1\n",))
    assert parsecache.key("yaml", ("a: 1\n",)) == base  # the same inputs: the same entry
    assert parsecache.key("dockerfile", ("a: 1\n",)) != base  # the parser
    assert parsecache.key("yaml", ("a: 2\n",)) != base  # the text
    assert parsecache.key("yaml", ("a: 1\n ",)) != base  # one trailing byte
    # arguments are delimited: moving a byte from one argument to the next is a different entry
    assert parsecache.key("gatespec", ("ab", "c")) != parsecache.key("gatespec", ("a", "bc"))
    assert parsecache.key("gatespec", ("t", "f", "")) != parsecache.key("gatespec", ("t", "f", "/p"))
    # the code: a library (or one of our modules) edited, upgraded or touched
    lib = cache.parent / "lib" / "yaml"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("__version__ = '6.0.1'\n")
    monkeypatch.syspath_prepend(str(lib.parent))
    monkeypatch.setattr(parsecache, "_state", {})
    with_lib = parsecache.key("yaml", ("a: 1\n",))
    assert with_lib != base
    (lib / "__init__.py").write_text("__version__ = '6.0.2'\n")
    monkeypatch.setattr(parsecache, "_state", {})
    assert parsecache.key("yaml", ("a: 1\n",)) != with_lib
    # the environment, the folder, the time: not inputs
    monkeypatch.setenv("IMAGEBUILD_PARSE_CACHE", str(cache.parent / "elsewhere"))
    assert parsecache.key("yaml", ("a: 1\n",)) == parsecache.key("yaml", ("a: 1\n",))


@pytest.mark.parametrize("file, old, new, error", [
    ("Dockerfile.tools", "COPY files/tool.sh /opt/tiny/tool.sh", "COPY --from=alpine:3 /x /x",
     "Dockerfile.tools:4"),
    ("image.yaml", "platform:", "platfrom:", "image.yaml:"),
    ("patch_hello.py", "", "def f(:\n", "patch_hello.py:1"),
])
def test_an_edited_file_is_read_afresh(cache, project, file, old, new, error):
    assert run_cli("--root", str(project), "validate", "tiny").code == 0
    assert _entries(cache)
    path = project / "docker-images" / "tiny" / file
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1) if old else new + text)
    res = run_cli("--root", str(project), "validate", "tiny")
    assert res.code == 2 and error in res.err, res.err
    path.write_text(text)  # and back: valid again (from the cache)
    assert run_cli("--root", str(project), "validate", "tiny").code == 0


def test_errors_are_never_stored(cache):
    with pytest.raises(yamlread.YamlError):
        yamlread.load("a: [1,\n")
    with pytest.raises(Exception):  # noqa: B017 (DefinitionError)
        gatespec.parse("checks:\n  - id: x\n    kind: nope\n", "g.yaml")
    # only the valid YAML under the invalid spec was stored
    assert [yamlread.load("checks:\n  - id: x\n    kind: nope\n")] == [
        parsecache._read(p)[0] for p in _entries(cache)]


def test_a_damaged_entry_is_ignored_and_replaced(cache):
    text = "a: 1\nb: [x, y]\n"
    good = yamlread.load(text)
    (entry,) = _entries(cache)
    data = bytearray(entry.read_bytes())
    data[-3] ^= 0xFF  # one flipped bit in the payload: its digest no longer matches
    entry.write_bytes(bytes(data))
    assert yamlread.load(text) == good
    assert entry.read_bytes() != bytes(data), "the damaged entry was not replaced"
    entry.write_bytes(b"short")
    assert yamlread.load(text) == good


def test_a_forged_entry_with_a_valid_digest_only_holds_what_its_name_says(cache):
    """An entry holds the result for its own name's inputs; another text never reaches it."""
    yamlread.load("a: 1\n")
    yamlread.load("a: 2\n")
    assert len(_entries(cache)) == 2
    assert yamlread.load("a: 1\n").value["a"].value == 1
    assert yamlread.load("a: 2\n").value["a"].value == 2


def test_off_and_unsafe_folders_are_not_used(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("IMAGEBUILD_PARSE_CACHE", "off")
    monkeypatch.setattr(parsecache, "_state", {})
    assert yamlread.load("a: 1\n").value["a"].value == 1
    assert not cache.exists()

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)  # others could plant entries (pickles): never read, never written
    monkeypatch.setenv("IMAGEBUILD_PARSE_CACHE", str(shared))
    monkeypatch.setattr(parsecache, "_state", {})
    assert yamlread.load("a: 1\n").value["a"].value == 1
    assert list(shared.iterdir()) == []


def test_gc_removes_old_entries_and_dead_writers_temp_files(cache):
    import time

    yamlread.load("a: 1\n")
    (old,) = _entries(cache)
    tmp = cache / ".x.123.tmp"
    tmp.write_bytes(b"half")
    fresh_tmp = cache / ".y.456.tmp"
    fresh_tmp.write_bytes(b"being written")
    long_ago = time.time() - parsecache.MAX_AGE_S - 60
    os.utime(old, (long_ago, long_ago))
    os.utime(tmp, (time.time() - 7200, time.time() - 7200))
    stale = {p.name for p, _ in parsecache.stale_entries()}
    assert stale == {old.name, tmp.name}
    yamlread.load("b: 2\n")  # a new entry: kept
    assert {p.name for p, _ in parsecache.stale_entries()} == stale


@pytest.mark.parametrize("forged", [
    ("r", "subprocess:Popen", {}),  # a class outside this package: never rebuilt
    ("r", "imagebuild.core.yamlread:Node", {"value": 1}),  # a record of the wrong shape
    ("x", 1),  # an unknown tag
])
def test_an_entry_with_a_valid_digest_but_foreign_content_is_a_miss(cache, forged):
    import marshal

    from imagebuild.core.parsecache import _DIGEST_SIZE, blake2b

    text = "a: 1\n"
    good = yamlread.load(text)
    (entry,) = _entries(cache)
    payload = marshal.dumps(forged)
    entry.write_bytes(blake2b(payload, digest_size=_DIGEST_SIZE).digest() + payload)
    assert yamlread.load(text) == good
    assert parsecache._read(entry) == (good,), "the foreign entry was not replaced"



def test_a_batch_keeps_its_entries_only_when_it_ends_well(cache):
    with pytest.raises(RuntimeError):
        with parsecache.batch():
            yamlread.load("a: 1\n")
            with parsecache.batch():
                yamlread.load("b: 1\n")
            assert _entries(cache) == []  # the inner batch writes with the outer one
            raise RuntimeError("a problem found later in the definition")
    assert _entries(cache) == []
    with parsecache.batch():
        yamlread.load("a: 1\n")
        with parsecache.batch():
            yamlread.load("b: 1\n")
        assert _entries(cache) == []
    assert len(_entries(cache)) == 2


def test_an_invalid_definition_keeps_nothing(cache, project):
    df = project / "docker-images" / "tiny" / "Dockerfile.tools"
    df.write_text(df.read_text().replace("COPY files/tool.sh /opt/tiny/tool.sh", "COPY --from=alpine:3 /x /x"))
    assert run_cli("--root", str(project), "validate", "tiny").code == 2
    assert _entries(cache) == []
