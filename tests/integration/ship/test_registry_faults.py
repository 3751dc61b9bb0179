"""The registry failing part-way, for real: a real ``docker-registry`` behind a small loopback proxy
(tests/registryproxy.py) that cuts a connection in the middle of a blob or answers 500, under real
builds (stage cache, release publish) and real syncs through the registry."""

from __future__ import annotations

import json

import pytest

from imagebuild.build.stagestore import StageStore
from tests.fleetfixtures import (  # noqa: F401 - fixtures
    build,
    fleet_project,
    node_fixture,
    remove_fleet_images,
    start_registry,
    statuses,
    unique_name,
)
from tests.registryproxy import RegistryProxy

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    reg = start_registry(tmp_path_factory.mktemp("registry"))
    try:
        yield reg
    finally:
        reg.stop()


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
