"""The compiler cache through the build's registry (buildstep/compilecache_share.py), with real parts only:
the engine's BuildKit, real ccache in the compile stage, a real Debian ``docker-registry`` on loopback and
skopeo. The first node builds the compile bed with the registry and pushes its cache; a second node (a
fresh clone, its own empty host cache and stage store, the cache mount dropped) after a change that moves
the stage key but no compiled source hits every object from the registry's cache; a forged cache under
the tag (another cache id's label, a blob changed in the registry's storage) is refused with a warning and
the stage compiles cold, leaving nothing half-written."""

from __future__ import annotations

import json
import shutil
import uuid

import pytest

from imagebuild.buildstep import compilecache
from imagebuild.buildstep import compilecache_share as share
from imagebuild.core import registry as registry_mod
from tests.conftest import run_cli
from tests.fleetfixtures import node_fixture, registry_fixture  # noqa: F401 - fixtures
from tests.integration.buildstep.test_compilecache import (
    _clean_up,
    _compile_project,
    _drop_cache_mount,
    _source,
)

pytestmark = [pytest.mark.engine]

N = 4  # compiled objects


def _project(tmp_path, monkeypatch) -> tuple:
    """The compile bed under a name and a cache id of this test's own (the engine is shared): (name, root,
    the image folder, the cache id)."""
    name = f"ccshare{uuid.uuid4().hex[:6]}"
    root, d, old_id = _compile_project(tmp_path, monkeypatch, name)
    cache_id = f"ccshare-{uuid.uuid4().hex[:12]}"
    df = d / "Dockerfile.compile"
    df.write_text(df.read_text().replace(old_id, cache_id))
    for i in range(N):
        _source(d, i)
    return name, root, d, cache_id


def _node(tmp_path, monkeypatch, node, label: str):
    """Another node's caches: its own host compiler cache (empty) and stage store."""
    monkeypatch.setenv(compilecache.ENV_DIR, str(tmp_path / f"ccache-{label}"))
    node(label)


def _build(root, name: str, reg: str, *args) -> tuple[dict, dict, str]:
    res = run_cli("--root", str(root), "build", name, "--json", "--no-gate", "--cache-registry", reg, *args)
    assert res.code == 0, res.err
    rec = json.loads(res.out)
    return rec, next(s for s in rec["stages"] if s["name"] == "compile"), res.err


def _clone(src, dst):
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns(".imagebuild"))
    return dst


def _no_leftovers() -> None:
    root = compilecache.cache_root()
    assert not list(root.glob(".*.tmp-*")) and not list(root.glob(".*.old-*")), sorted(root.iterdir())


def test_a_second_node_starts_from_the_first_nodes_compiler_cache(engine_info, registry, tmp_path, monkeypatch,
                                                                 node):
    name, root1, d, cache_id = _project(tmp_path, monkeypatch)
    reg = f"{registry.addr}/ccshare"
    r = registry_mod.parse(reg)
    tag = share.tag_of(cache_id)
    try:
        # the first node: cold, and its cache pushed after the take-back
        _node(tmp_path, monkeypatch, node, "1")
        rec, st, _err = _build(root1, name, reg)
        cc = st["compiler_cache"]
        assert (cc["hits"], cc["misses"], cc["seeded_from"]) == (0, N, "none"), cc
        pushed = cc["pushed"]
        assert pushed["tag"] == tag and pushed["digest"].startswith("sha256:") and pushed["files"] > N, pushed
        raw = registry_mod.inspect_raw(r, r.ref(name, tag), what="test")
        import hashlib

        assert "sha256:" + hashlib.sha256(raw).hexdigest() == pushed["digest"]
        assert any(e["action"] == "ccache-pushed" for e in rec["registry"]["events"])
        assert rec["registry"]["pushed"] == 1  # the stage; the cache is counted apart
        # a rebuild on the first node: every call a hit, the registry holds a cache already: not pushed again
        (d / "src" / "notes.txt").write_text("no compiled source\n")
        _rec, st, _err = _build(root1, name, reg)
        assert st["compiler_cache"]["seeded_from"] == "host" and st["compiler_cache"]["misses"] == 0
        assert "skipped" in st["compiler_cache"]["pushed"], st["compiler_cache"]

        # the second node: a fresh clone, empty caches, no cache mount; a change that moves the stage key
        # and touches no compiled source
        root2 = _clone(root1, tmp_path / "clone2")
        (root2 / "docker-images" / name / "src" / "notes.txt").write_text("the second node\n")
        _node(tmp_path, monkeypatch, node, "2")
        _drop_cache_mount(cache_id)
        rec, st, err = _build(root2, name, reg)
        assert st["status"] == "built"
        cc = st["compiler_cache"]
        assert (cc["hits"], cc["misses"], cc["uncacheable"]) == (N, 0, 0), cc
        assert cc["seeded_from"] == "registry" and cc["pulled"]["digest"] == pushed["digest"], cc
        assert cc["pulled"]["bytes"] > 0 and cc["pulled"]["seconds"] >= 0
        assert "compiler cache from the registry" in err and "from the registry" in compilecache.line(cc)
        assert "skipped" in cc["pushed"]  # every call hit what it pulled: nothing to send back
        assert not any("refused" in w for w in rec["warnings"]), rec["warnings"]
        _no_leftovers()

        # a forged cache under the tag: another cache id's label (a real layer, a valid image)
        _node(tmp_path, monkeypatch, node, "3")
        _drop_cache_mount(cache_id)
        forged = tmp_path / "forged"
        other = tmp_path / "other-cache"
        (other / "0").mkdir(parents=True)
        (other / "0" / "xR").write_bytes(b"not this cache")
        share.write_layout(other, forged, "someone-else", "linux/amd64")
        registry_mod.copy(r, f"oci:{forged}:k", f"docker://{r.ref(name, tag)}", src_remote=False, dest_remote=True,
                          what="test: forging the tag")
        rec, st, err = _build(root2, name, reg, "--no-cache")
        cc = st["compiler_cache"]
        assert (cc["hits"], cc["misses"], cc["seeded_from"]) == (0, N, "none"), cc
        assert f"refused the compiler cache {r.repo(name)}:{tag}" in err and "'someone-else'" in err, err
        assert any(e["action"] == "ccache-refused" for e in rec["registry"]["events"])
        _no_leftovers()

        # a blob changed in the registry's storage under the first node's cache (its tag moved back)
        registry_mod.copy(r, f"docker://{r.at(name, pushed['digest'])}", f"docker://{r.ref(name, tag)}",
                          src_remote=True, dest_remote=True, what="test: the tag back")
        layer = json.loads(raw)["layers"][0]["digest"]
        blob = registry.blob_path(layer)
        original = blob.read_bytes()
        changed = bytearray(original)
        changed[600] ^= 0xFF  # inside the first file's bytes (a tar ends in zero blocks: its last bytes are 0)
        blob.write_bytes(bytes(changed))
        _node(tmp_path, monkeypatch, node, "4")
        _drop_cache_mount(cache_id)
        try:
            rec, st, err = _build(root2, name, reg, "--no-cache")
        finally:
            blob.write_bytes(original)
        cc = st["compiler_cache"]
        assert (cc["hits"], cc["misses"], cc["seeded_from"]) == (0, N, "none"), cc
        assert f"refused the compiler cache {r.repo(name)}:{tag}" in err, err
        assert rec["status"] == "ok"
        _no_leftovers()
        # the host copy the cold compile took back is whole and the node's own from now on
        assert (compilecache.host_dir(cache_id) / compilecache.STATS_FILE).is_file()
    finally:
        _clean_up(name, cache_id)


def test_a_registry_that_does_not_answer_leaves_the_compiler_cache_to_the_host(engine_info, tmp_path, monkeypatch,
                                                                             node):
    """Nothing listens at the registry's address: one warning, the registry dropped, the stage compiles
    from an empty cache and its take-back fills the host copy; nothing is pulled or pushed."""
    from tests.fleetfixtures import free_port

    name, root, _d, cache_id = _project(tmp_path, monkeypatch)
    _node(tmp_path, monkeypatch, node, "1")
    try:
        rec, st, err = _build(root, name, f"127.0.0.1:{free_port()}/none")
        cc = st["compiler_cache"]
        assert (cc["hits"], cc["misses"], cc["seeded_from"]) == (0, N, "none") and "pushed" not in cc, cc
        assert rec["registry"]["down"] and err.count("the build goes on without the registry cache") == 1, err
        assert not any(e["action"].startswith("ccache-") for e in rec["registry"]["events"])
        assert (compilecache.host_dir(cache_id) / compilecache.STATS_FILE).is_file()
        _no_leftovers()
    finally:
        _clean_up(name, cache_id)
