"""Past one build node, against real parts only: the ``peer`` fixture's own Docker engine reached over
ssh (``--engine ssh://...``), a real Debian ``docker-registry`` on loopback as the shared stage cache
and release registry, skopeo and docker push. Each test builds its own copy of the five-stage
``staged`` definition under a unique name; "node A" and "node B" are two project copies with two
stage stores (IMAGEBUILD_STAGES), on this engine and on the peer's."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from imagebuild.buildstep import registry_cache
from imagebuild.buildstep.stagestore import StageStore
from imagebuild.core import registry as registry_mod
from tests.conftest import run_cli
from tests.fleetfixtures import (  # noqa: F401 - fixtures
    STAGES,
    build,
    engine_of,
    fleet_project,
    netns_peers_fixture,
    node_fixture,
    peer_engine_id,
    peer_ready_fixture,
    registry_fixture,
    remove_fleet_images,
    start_registry,
    statuses,
    unique_name,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]


# ------------------------------------------------------------------------------------------ registry cache


def test_node_a_pushes_node_b_pulls_every_stage_and_builds_none(peer_ready, registry, tmp_path, node, monkeypatch):
    peer = peer_ready
    name = unique_name()
    reg = f"{registry.addr}/fleet"
    root_a = fleet_project(tmp_path / "a", name, gate=True)
    root_b = fleet_project(tmp_path / "b", name, gate=True)
    monkeypatch.setenv("IMAGEBUILD_SSH", peer.ssh_env)
    try:
        node("A")
        code, a, err = build(root_a, name, "--cache-registry", reg)
        assert code == 0, err
        assert statuses(a) == dict.fromkeys(STAGES, "built")
        assert a["registry"]["pushed"] == 5 and a["registry"]["down"] is None
        assert a["publish"]["status"] == "published" and a["publish"]["moved"]

        # node B: another project copy, another stage store, the peer's engine, and no prefetched
        # inputs at all: a stage the registry holds needs none
        node("B")
        for p in (root_b / "deps-src").rglob("*.tar*"):
            p.unlink()
        code, b, err = build(root_b, name, "--cache-registry", reg, "--engine", engine_of(peer))
        assert code == 0, err
        assert statuses(b) == dict.fromkeys(STAGES, "pulled"), statuses(b)
        assert not any(s["status"] == "built" for s in b["stages"])
        assert b["registry"]["pulled"] == 5 and b["registry"]["pushed"] == 0
        assert b["release"]["identity"] == a["release"]["identity"]
        assert b["engine"]["id"] == peer_engine_id(peer)
        assert b["promotion"]["status"] == "promoted"  # gated on the peer, with node B's own receipt
        assert b["publish"]["release"]["pushed"] is False  # b-<id> already holds this very image
        # pulled stages are the pushed bytes, and their patch records came along
        assert [s["manifest"] for s in b["stages"]] == [s["manifest"] for s in a["stages"]]
        patched = next(s for s in b["stages"] if s["name"] == "patched")
        assert patched["patches"]["patches"]["patch_greet.py"]["outcome"] == "applied"
        # a third run on node B: everything in its own store, nothing pulled again
        code, b2, err = build(root_b, name, "--cache-registry", reg, "--engine", engine_of(peer))
        assert code == 0, err
        assert statuses(b2) == dict.fromkeys(STAGES, "skipped")
    finally:
        remove_fleet_images(name)
        remove_fleet_images(name, docker_host=peer.docker_host)


def _push_from_node_a(root: Path, name: str, reg: str, node) -> dict:
    node("A")
    code, a, err = build(root, name, "--cache-registry", reg, "--no-gate")
    assert code == 0, err
    assert a["registry"]["pushed"] == 5
    return a


def test_tampered_blob_is_refused_and_the_stage_rebuilt(engine_info, registry, tmp_path, node):
    name = unique_name()
    reg = f"{registry.addr}/tamper"
    root = fleet_project(tmp_path / "p", name)
    try:
        a = _push_from_node_a(root, name, reg, node)
        # the runner stage's own layer (its manifest's last), changed in the registry's storage
        store = StageStore.for_image(None, name)
        runner = next(s for s in a["stages"] if s["name"] == "runner")
        layer = json.loads(store.blob(runner["manifest"]).read_bytes())["layers"][-1]["digest"]
        blob = registry.blob_path(layer)
        original = blob.read_bytes()
        blob.write_bytes(original[:-16] + bytes(16))
        try:
            node("C")
            code, c, err = build(root, name, "--cache-registry", reg, "--no-gate")
        finally:
            blob.write_bytes(original)
        assert code == 0, err
        assert statuses(c) == {"base": "pulled", "tools": "pulled", "app": "pulled", "patched": "pulled",
                               "runner": "built"}
        assert c["registry"]["refused"] == 1
        ev = next(e for e in c["registry"]["events"] if e["action"] == "refused")
        assert ev["stage"] == "runner" and ev["key"] == runner["key"] and ev["digest"] == runner["manifest"]
        assert "refused stage runner" in err and runner["key"] in err and reg in err
        # the rebuilt stage is the same bytes (reproducible), and nothing of the tampered blob entered the store
        assert c["stages"][-1]["manifest"] == runner["manifest"]
        assert c["release"]["identity"] == a["release"]["identity"]
        from imagebuild.core.fsutil import sha256_file

        assert "sha256:" + sha256_file(StageStore.for_image(None, name).blob(layer)) == layer
    finally:
        remove_fleet_images(name)


def test_a_key_whose_registry_content_is_another_stage_is_refused(engine_info, registry, tmp_path, node):
    name = unique_name()
    reg = f"{registry.addr}/moved"
    root = fleet_project(tmp_path / "p", name)
    try:
        a = _push_from_node_a(root, name, reg, node)
        r = registry_mod.parse(reg)
        base, tools = a["stages"][0], a["stages"][1]
        # the tools key's tag now names the base stage's manifest (valid content, wrong key)
        registry_mod.copy(r, f"docker://{r.at(name, base['manifest'])}",
                          f"docker://{r.ref(name, registry_cache.stage_tag(tools['key']))}",
                          src_remote=True, dest_remote=True, what="test: moving a tag")
        node("D")
        code, d, err = build(root, name, "--cache-registry", reg, "--no-gate")
        assert code == 0, err
        assert statuses(d)["tools"] == "built" and statuses(d)["base"] == "pulled"
        assert f"key {tools['key']}" in err and "expected stage 'tools'" in err
        # the rebuilt stage was pushed again under its key: the tag names the right stage now
        raw = registry_mod.inspect_raw(r, r.ref(name, registry_cache.stage_tag(tools["key"])), what="test")
        import hashlib

        assert "sha256:" + hashlib.sha256(raw).hexdigest() == tools["manifest"]
    finally:
        remove_fleet_images(name)


def test_registry_going_away_mid_build_falls_back_to_building_here(engine_info, tmp_path, node):
    own = start_registry(tmp_path / "registry")
    name = unique_name()
    reg = f"{own.addr}/away"
    root = fleet_project(tmp_path / "p", name)
    try:
        a = _push_from_node_a(root, name, reg, node)
        stages = node("E")
        flag = tmp_path / "hold"
        flag.write_text("")
        env = {**os.environ, "IMAGEBUILD_STAGES": str(stages),
               registry_cache.HOLD_ENV: f"before-pull:app:{flag}"}
        proc = subprocess.Popen([sys.executable, "-m", "imagebuild", "--root", str(root), "build", name, "--json",
                                 "--cache-registry", reg, "--no-gate"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        err_lines = []
        deadline = time.monotonic() + 300
        for line in proc.stderr:
            err_lines.append(line)
            if "holding before pull of app" in line:
                own.stop()  # the registry goes away between two stages
                flag.unlink()
                break
            assert time.monotonic() < deadline
        out, rest = proc.communicate(timeout=600)
        err = "".join(err_lines) + rest
        assert proc.returncode == 0, err
        e = json.loads(out)
        assert statuses(e) == {"base": "pulled", "tools": "pulled", "app": "built", "patched": "built",
                               "runner": "built"}
        assert e["registry"]["down"] and own.addr in e["registry"]["down"]
        assert "the build goes on without the registry cache" in err
        assert any("registry" in w for w in e["warnings"])
        assert e["release"]["identity"] == a["release"]["identity"]
    finally:
        own.stop()
        remove_fleet_images(name)


def test_unreachable_registry_from_the_start_builds_everything_here(engine_info, tmp_path, node):
    name = unique_name()
    root = fleet_project(tmp_path / "p", name)
    try:
        node("F")
        code, f, err = build(root, name, "--cache-registry", "127.0.0.1:9/none", "--no-gate")
        assert code == 0, err
        assert statuses(f) == dict.fromkeys(STAGES, "built")
        assert f["registry"]["down"] and "127.0.0.1:9/none" in err
    finally:
        remove_fleet_images(name)


# ------------------------------------------------------------------------------------------ release tags


def _tags(reg: str, name: str) -> dict[str, str | None]:
    import hashlib

    r = registry_mod.parse(reg)
    out = {}
    for tag in ("local", "previous"):
        try:
            raw = registry_mod.inspect_raw(r, r.ref(name, tag), what="test")
            out[tag] = "sha256:" + hashlib.sha256(raw).hexdigest()
        except registry_mod.RegistryError:
            out[tag] = None
    return out


def test_release_tags_after_the_gate_and_rollback_in_the_registry(engine_info, registry, tmp_path, node):
    name = unique_name()
    reg = f"{registry.addr}/rel"
    root = fleet_project(tmp_path / "p", name, gate=True)
    d = root / "docker-images" / name
    try:
        node("R")
        code, v1, err = build(root, name, "--cache-registry", reg)
        assert code == 0, err
        p1 = v1["publish"]
        assert p1["status"] == "published" and p1["release"]["tag"] == f"b-{v1['build_id']}"
        assert _tags(reg, name) == {"local": p1["release"]["digest"], "previous": None}

        (d / "files" / "motd.txt").write_text("version two\n")
        code, v2, err = build(root, name, "--cache-registry", reg)
        assert code == 0, err
        p2 = v2["publish"]
        assert v2["build_id"] != v1["build_id"] and p2["moved"]
        assert _tags(reg, name) == {"local": p2["release"]["digest"], "previous": p1["release"]["digest"]}

        # a build whose gate fails pushes no release tag and moves nothing
        (d / "files" / "motd.txt").write_text("version three\n")
        gate = d / "gate.yaml"
        gate.write_text(gate.read_text().replace("greet-loud", "no-such-marker"))
        code, _, err = build(root, name, "--cache-registry", reg)
        assert code == 4, err
        assert _tags(reg, name) == {"local": p2["release"]["digest"], "previous": p1["release"]["digest"]}
        r = registry_mod.parse(reg)
        runs = sorted((root / ".imagebuild" / "builds" / name).iterdir())
        v3 = json.loads((runs[-1] / "record.json").read_text())
        with pytest.raises(registry_mod.RegistryError) as e:
            registry_mod.inspect_raw(r, r.ref(name, f"b-{v3['build_id']}"), what="test")
        assert e.value.kind == "missing"
        # b-<v1> is immutable: still the first image
        raw = registry_mod.inspect_raw(r, r.ref(name, p1["release"]["tag"]), what="test")
        import hashlib

        assert "sha256:" + hashlib.sha256(raw).hexdigest() == p1["release"]["digest"]

        res = run_cli("--root", str(root), "rollback", name, "--registry", reg, "--json")
        assert res.code == 0, res.err
        doc = json.loads(res.out)
        assert doc["local_digest"] == p1["release"]["digest"] and doc["local_identity"] == v1["release"]["identity"]
        assert _tags(reg, name) == {"local": p1["release"]["digest"], "previous": p2["release"]["digest"]}
        res = run_cli("--root", str(root), "rollback", name, "--registry", reg)
        assert res.code == 0, res.err
        assert _tags(reg, name) == {"local": p2["release"]["digest"], "previous": p1["release"]["digest"]}
    finally:
        remove_fleet_images(name)


# ------------------------------------------------------------------------------------------ credentials


def test_credentials_come_from_the_docker_config_and_are_never_shown(engine_info, tmp_path, node, monkeypatch):
    user, password = "builder", "Pw-" + os.urandom(6).hex()
    htp = tmp_path / "htpasswd"
    r = subprocess.run(["htpasswd", "-Bbn", user, password], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail("htpasswd (apache2-utils) is needed: scripts/testbed.sh installs it")
    htp.write_text(r.stdout)
    own = start_registry(tmp_path / "registry", htpasswd=htp)
    name = unique_name()
    reg = f"{own.addr}/auth"
    root = fleet_project(tmp_path / "p", name, gate=True)
    try:
        # no credentials: the registry refuses, the build goes on without it
        monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "empty-docker-config"))
        node("G0")
        code, g0, err = build(root, name, "--cache-registry", reg, "--no-gate")
        assert code == 0, err
        assert g0["registry"]["down"] and "docker login" in err

        cfg = tmp_path / "docker-config"
        cfg.mkdir()
        (cfg / "config.json").write_text(json.dumps({"auths": {own.addr: {
            "auth": base64.b64encode(f"{user}:{password}".encode()).decode()}}}))
        monkeypatch.setenv("DOCKER_CONFIG", str(cfg))
        node("G1")
        res = run_cli("--root", str(root), "build", name, "--json", "--cache-registry", reg, "-v")
        assert res.code == 0, res.err
        g1 = json.loads(res.out)
        assert g1["registry"]["pushed"] == 5 and g1["publish"]["status"] == "published"
        shown = res.out + res.err
        for p in (root / ".imagebuild").rglob("*"):
            if p.is_file():
                shown += p.read_text(errors="replace")
        labels = subprocess.run(["docker", "image", "inspect", "--format", "{{json .Config.Labels}}",
                                 f"{name}:candidate"], capture_output=True, text=True).stdout
        for secret in (password, base64.b64encode(f"{user}:{password}".encode()).decode()):
            assert secret not in shown and secret not in labels
    finally:
        own.stop()
        remove_fleet_images(name)


# ------------------------------------------------------------------------------------------ sync through the registry


def _gets_since(registry, before: int) -> list[tuple[str, int]]:
    return registry.blob_gets()[before:]


def test_sync_via_registry_through_ssh_tunnels_moves_each_missing_layer_once_per_peer(
        netns_peers, registry, tmp_path, node, monkeypatch):
    from tests.fleetfixtures import veth_tx

    peers, ssh = netns_peers
    name = unique_name()
    reg = f"{registry.addr}/sync"
    root = fleet_project(tmp_path / "p", name, gate=True)
    d = root / "docker-images" / name
    monkeypatch.setenv("IMAGEBUILD_SSH", ssh)
    try:
        node("S")
        code, v1, err = build(root, name, "--cache-registry", reg)
        assert code == 0, err
        assert v1["promotion"]["status"] == "promoted"
        # the peers' engines cannot reach this host's loopback registry: only the tunnel can
        probe = peers[0].docker("pull", f"{registry.addr}/sync/{name}:local")
        assert probe.returncode != 0

        n0, tx0 = len(registry.blob_gets()), [veth_tx(p) for p in peers]
        res = run_cli("--root", str(root), "sync", "--via", "registry", "--registry", reg, "--image", name,
                      "--json", *[p.addr for p in peers])
        assert res.code == 0, res.err
        doc = json.loads(res.out)
        assert doc["via"] == "registry" and doc["registry"]["tunnel"] is True
        gets = _gets_since(registry, n0)
        assert [r["store"] for r in doc["peers"]] == ["containerd", "classic"]
        for p, r in zip(peers, doc["peers"], strict=True):
            assert r["status"] == "synced", r
            assert r["identity"] == v1["release"]["identity"]  # verified on the peer, as with ssh
            assert r["details"]["registry"]["tunnel"] and r["details"]["registry"]["pulled"].startswith("127.0.0.1:")
            got = p.docker("image", "inspect", "--format", "{{.Id}}", f"{name}:local")
            assert got.returncode == 0 and got.stdout.strip() == r["details"]["image_id"]
            # the receipt came along; the registry's reference was removed again
            assert list(Path(p.cache, "receipts").rglob("*.json"))
            names = p.docker("image", "ls", "--format", "{{.Repository}}").stdout.split()
            assert not any(n.startswith("127.0.0.1:") for n in names), names
        # every blob crossed at most once per peer, and every layer a peer lacked crossed once for it
        per_blob: dict[str, int] = {}
        for dg, _ in gets:
            per_blob[dg] = per_blob.get(dg, 0) + 1
        layers = {la for r in doc["peers"] for la in r["details"]["layers_needed"]}
        assert layers and all(per_blob.get(la) == len(peers) for la in layers), (layers, per_blob)
        # other blobs: the config, which this host also reads once to check the identity it pushed
        assert all(n <= len(peers) + 1 for n in per_blob.values()), per_blob
        sent = [veth_tx(p) - t for p, t in zip(peers, tx0, strict=True)]
        pulled = sum(sz for _, sz in gets) // len(peers)
        assert all(s >= pulled for s in sent), (sent, pulled)

        # again: every peer already holds the identity, nothing moves
        n1 = len(registry.blob_gets())
        res = run_cli("--root", str(root), "sync", "--via", "registry", "--registry", reg, "--image", name,
                      "--json", *[p.addr for p in peers])
        assert res.code == 0, res.err
        assert [r["status"] for r in json.loads(res.out)["peers"]] == ["unchanged"] * len(peers)
        assert not {dg for dg, _ in _gets_since(registry, n1)} & layers  # (the config is read to check the tag)

        # a one-file change: only the layers that changed move, once per peer
        (d / "files" / "motd.txt").write_text("version two\n")
        code, v2, err = build(root, name, "--cache-registry", reg)
        assert code == 0, err
        n2 = len(registry.blob_gets())
        res = run_cli("--root", str(root), "sync", "--via", "registry", "--registry", reg, "--image", name,
                      "--json", *[p.addr for p in peers])
        assert res.code == 0, res.err
        doc2 = json.loads(res.out)
        assert [r["status"] for r in doc2["peers"]] == ["synced"] * len(peers)
        need2 = {la for r in doc2["peers"] for la in r["details"]["layers_needed"]}
        assert 0 < len(need2) < len(layers)
        gets2 = [dg for dg, _ in _gets_since(registry, n2)]
        assert {dg for dg in gets2} - need2 <= {json.loads(peers[0].docker(
            "image", "inspect", f"{name}:local").stdout)[0]["Id"]} | _configs(registry, reg, name), gets2
        assert all(gets2.count(la) == len(peers) for la in need2)
        for p, r1, r2 in zip(peers, doc["peers"], doc2["peers"], strict=True):
            assert r2["identity"] == v2["release"]["identity"]
            prev = p.docker("image", "inspect", "--format", "{{.Id}}", f"{name}:previous")
            assert prev.stdout.strip() == r1["details"]["image_id"]  # the former :local, as with ssh
    finally:
        remove_fleet_images(name)
        for p in peers:
            remove_fleet_images(name, docker_host=p.docker_host)


def _configs(registry, reg: str, name: str) -> set[str]:
    """The config digests of the image tags the sync pushed (a pull fetches the config blob too)."""
    import hashlib

    r = registry_mod.parse(reg)
    out = set()
    tags = subprocess.run(["skopeo", "list-tags", "--tls-verify=false", f"docker://{r.repo(name)}"],
                          capture_output=True, text=True)
    for tag in json.loads(tags.stdout or '{"Tags": []}')["Tags"]:
        raw = registry_mod.inspect_raw(r, r.ref(name, tag), what="test")
        m = json.loads(raw)
        if "config" in m:
            out.add(m["config"]["digest"])
        out.add("sha256:" + hashlib.sha256(raw).hexdigest())
    return out


def test_sync_via_registry_refuses_an_image_without_a_receipt_and_pushes_nothing(netns_peers, registry, tmp_path,
                                                                                node, monkeypatch):
    peers, ssh = netns_peers
    name = unique_name()
    reg = f"{registry.addr}/norcpt"
    root = fleet_project(tmp_path / "p", name, gate=True)
    monkeypatch.setenv("IMAGEBUILD_SSH", ssh)
    try:
        node("N")
        code, _, err = build(root, name, "--no-gate")
        assert code == 0, err
        res = run_cli("--root", str(root), "sync", "--via", "registry", "--registry", reg, "--image",
                      f"{name}:candidate", "--json", peers[0].addr)
        assert res.code == 3, res.err
        assert json.loads(res.out)["peers"][0]["status"] == "refused"
        r = registry_mod.parse(reg)
        tags = subprocess.run(["skopeo", "list-tags", "--tls-verify=false", f"docker://{r.repo(name)}"],
                              capture_output=True, text=True)
        assert tags.returncode != 0 or json.loads(tags.stdout)["Tags"] in ([], None)

        # forced, to a registry that is not there: exit 1 naming it, no traceback, no peer touched
        res = run_cli("--root", str(root), "sync", "--via", "registry", "--registry", "127.0.0.1:9/gone", "--image",
                      f"{name}:candidate", "--force", peers[0].addr)
        assert res.code == 1, res.err
        assert "127.0.0.1:9/gone" in res.err and "Traceback" not in res.err
        assert peers[0].docker("image", "inspect", f"{name}:candidate").returncode != 0
    finally:
        remove_fleet_images(name)
