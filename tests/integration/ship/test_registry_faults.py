"""The registry failing part-way, for real: a real ``docker-registry`` behind a small loopback proxy
(tests/registryproxy.py) that cuts a connection in the middle of a blob or answers 500, under real
builds (stage cache, release publish) and real syncs through the registry."""

from __future__ import annotations

import json

import pytest

from imagebuild.buildstep.stagestore import StageStore
from tests.conftest import run_cli
from tests.fleetfixtures import (  # noqa: F401 - fixtures
    build,
    fleet_project,
    netns_peers_fixture,
    node_fixture,
    registry_fixture,
    remove_fleet_images,
    statuses,
    unique_name,
)
from tests.registryproxy import RegistryProxy

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture
def proxy(registry):
    p = RegistryProxy(registry.port)
    try:
        yield p
    finally:
        p.close()


@pytest.mark.parametrize("cut_with", ["eof", "reset"])
def test_a_connection_cut_mid_blob_is_a_transfer_failure_not_bad_content(cut_with, engine_info, registry, proxy,
                                                                         tmp_path, node):
    name = unique_name()
    root = fleet_project(tmp_path / "p", name)
    try:
        node("A")
        code, a, err = build(root, name, "--cache-registry", f"{registry.addr}/cut{cut_with}", "--no-gate")
        assert code == 0, err
        store = StageStore.for_image(None, name)
        runner = next(s for s in a["stages"] if s["name"] == "runner")
        layer = json.loads(store.blob(runner["manifest"]).read_bytes())["layers"][-1]["digest"]
        proxy.cut, proxy.cut_with = {layer}, cut_with  # every GET of the runner stage's own layer is cut half-way
        node("B")
        code, b, err = build(root, name, "--cache-registry", f"{proxy.addr}/cut{cut_with}", "--no-gate")
        assert code == 0, err
        assert statuses(b) == {"base": "pulled", "tools": "pulled", "app": "pulled", "patched": "pulled",
                               "runner": "built"}
        assert "the registry's content does not verify" not in err
        assert "a transfer failure (the connection was cut part-way), not content that does not verify" in err
        ev = next(e for e in b["registry"]["events"] if e.get("stage") == "runner" and e["action"] != "miss"
                  and e["action"] != "hit")
        assert ev["action"] == "error" and b["registry"]["refused"] == 0, b["registry"]
        # the registry stayed in use: the rebuilt stage is the same bytes, pushed again through it
        assert b["release"]["identity"] == a["release"]["identity"]
        assert not b["registry"]["down"]
    finally:
        remove_fleet_images(name)


def test_a_500_while_publishing_is_a_warning_like_a_stopped_registry(engine_info, registry, proxy, tmp_path, node):
    name = unique_name()
    root = fleet_project(tmp_path / "p", name, gate=True)
    # the registry answers 500 when :local is to move (the last step of publishing the release)
    proxy.fail = lambda method, path: method == "PUT" and path.endswith("/manifests/local")
    try:
        node("P")
        code, rec, err = build(root, name, "--cache-registry", f"{proxy.addr}/pub")
        assert code == 0, err  # built, gated and promoted here: that stands
        assert proxy.failed, "the proxy never answered 500"
        assert rec["promotion"]["status"] == "promoted"
        assert rec["publish"]["status"] == "failed" and "500" in rec["publish"]["reason"], rec["publish"]
        assert "failed while publishing the release" in err
        # the same as a registry that is not there at all
        proxy.fail = lambda method, path: True
        (root / "docker-images" / name / "files" / "motd.txt").write_text("version two\n")
        code, rec2, err = build(root, name, "--cache-registry", f"{proxy.addr}/pub")
        assert code == 0, err
        assert rec2["publish"]["status"] in ("failed", "skipped"), rec2["publish"]
    finally:
        remove_fleet_images(name)


def test_sync_via_registry_reports_what_the_peer_really_pulled(netns_peers, registry, tmp_path, node, monkeypatch):
    """A classic-store peer that got the image's layers by ssh has no registry digests for them: its
    engine pulls every layer again. The report says so (from the pull's own lines), as the registry's
    access log counts it."""
    peers, ssh = netns_peers
    classic = peers[1]
    name = unique_name()
    reg = f"{registry.addr}/pulled"
    root = fleet_project(tmp_path / "p", name, gate=True)
    monkeypatch.setenv("IMAGEBUILD_SSH", ssh)
    try:
        node("V")
        code, v1, err = build(root, name, "--cache-registry", reg)
        assert code == 0, err
        res = run_cli("--root", str(root), "sync", "--image", name, "--json", classic.addr)  # over ssh
        assert res.code == 0, res.err
        (root / "docker-images" / name / "files" / "motd.txt").write_text("version two\n")
        code, v2, err = build(root, name, "--cache-registry", reg)
        assert code == 0, err
        n0 = len(registry.blob_gets())
        res = run_cli("--root", str(root), "sync", "--via", "registry", "--registry", reg, "--image", name,
                      "--json", classic.addr)
        assert res.code == 0, res.err
        (p,) = json.loads(res.out)["peers"]
        assert p["status"] == "synced" and p["store"] == "classic", p
        served = sum(sz for _, sz in registry.blob_gets()[n0:])  # the peer's pull, and this host's config read
        configs = 64 << 10
        # the probe found one layer missing; the engine fetched much more, and the report says what
        assert p["details"]["bytes_needed"] < served / 2, (p["details"]["bytes_needed"], served)
        assert served - configs <= p["bytes_sent"], (p["bytes_sent"], served)
        pulled = p["details"]["registry"]["pulled_bytes"]
        assert served - configs <= pulled <= served, (pulled, served)
    finally:
        remove_fleet_images(name)
        for pe in peers:
            remove_fleet_images(name, docker_host=pe.docker_host)
