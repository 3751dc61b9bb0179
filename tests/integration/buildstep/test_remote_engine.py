"""``imagebuild build --engine ssh://...`` against the ``peer`` fixture's own Docker engine over ssh:
every engine call of the build goes there (guards included), the node's facts come from it, and
the build gives the same identity as on this engine. Each test builds its own copy of the
five-stage ``staged`` definition under a unique name, with its own stage store."""

from __future__ import annotations

import pytest

from imagebuild.buildstep import guards
from imagebuild.buildstep.stagestore import StageStore
from tests.buildfixtures import image_id
from tests.fleetfixtures import (  # noqa: F401 - fixtures
    BUSYBOX,
    STAGES,
    build,
    engine_of,
    fleet_project,
    node_fixture,
    peer_engine_id,
    peer_ready_fixture,
    remove_fleet_images,
    statuses,
    unique_name,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]

# ------------------------------------------------------------------------------------------ remote engine


def test_remote_engine_build_gives_the_local_identity(peer_ready, tmp_path, node, monkeypatch):
    peer = peer_ready
    name = unique_name()
    root = fleet_project(tmp_path / "p", name)
    monkeypatch.setenv("IMAGEBUILD_SSH", peer.ssh_env)
    try:
        node("remote")
        code, remote, err = build(root, name, "--engine", engine_of(peer))
        assert code == 0, err
        assert statuses(remote) == dict.fromkeys(STAGES, "built")
        # every engine call went to the peer: its engine id, its node's facts (over ssh), its image store
        eng = remote["engine"]
        assert eng["id"] == peer_engine_id(peer) and eng["endpoint"] == engine_of(peer)
        assert eng["facts"]["source"] == "ssh" and eng["facts"]["data_root"] == peer.data_root
        f = eng["facts"]
        assert remote["stages"][1]["args"]["MAX_JOBS"] == str(guards.jobs_rule(f["cores"], f["mem_available_gib"],
                                                                              env={}).max_jobs)
        assert peer.docker("image", "inspect", f"{name}:candidate").returncode == 0
        assert image_id(f"{name}:candidate") is None, "the remote build put an image on this engine"
        # the stages came back into this node's stage store (OCI layouts written by the client)
        store = StageStore.for_image(None, name)
        remote_manifests = {s["name"]: store.lookup(s["key"]).manifest for s in remote["stages"]}

        node("local")
        code, local, err = build(root, name)
        assert code == 0, err
        assert statuses(local) == dict.fromkeys(STAGES, "built")
        assert local["engine"]["endpoint"] == "local"
        assert local["release"]["identity"] == remote["release"]["identity"]
        store = StageStore.for_image(None, name)
        assert {s["name"]: store.lookup(s["key"]).manifest for s in local["stages"]} == remote_manifests
    finally:
        remove_fleet_images(name)
        remove_fleet_images(name, docker_host=peer.docker_host)


def test_remote_guards_use_the_remote_node(peer_ready, tmp_path, node, monkeypatch):
    peer = peer_ready
    name = unique_name()
    root = fleet_project(tmp_path / "p", name)
    monkeypatch.setenv("IMAGEBUILD_SSH", peer.ssh_env)
    node("guards")
    # a serving container on the peer refuses the build (exit 3), naming it; none runs on this engine
    cname = f"serve-{name}"
    r = peer.docker("run", "-d", "--name", cname, "--pull", "never", "--network", "none", "--label",
                    "imagebuild.role=serve", BUSYBOX, "sleep", "600")
    assert r.returncode == 0, r.stderr
    try:
        code, _, err = build(root, name, "--engine", engine_of(peer))
        assert code == 3 and cname in err, err
    finally:
        peer.docker("rm", "-f", cname)
    # the disk guard measures the peer's data root
    monkeypatch.setenv("IMAGEBUILD_MIN_FREE_GB", "100000")
    code, _, err = build(root, name, "--engine", engine_of(peer))
    assert code == 3 and f"{engine_of(peer)}:{peer.data_root}" in err, err
    monkeypatch.delenv("IMAGEBUILD_MIN_FREE_GB")
    # a base image the peer lacks is refused before BuildKit could ask Docker Hub for it
    defn = root / "docker-images" / name / "versions.env"
    defn.write_text(defn.read_text().replace(f"BASE_IMAGE={BUSYBOX}", "BASE_IMAGE=imagebuild-test/absent:1"))
    code, _, err = build(root, name, "--engine", engine_of(peer))
    assert code == 1 and "imagebuild-test/absent:1" in err and engine_of(peer) in err, err
    # an engine that does not answer: exit 1, naming it
    code, _, err = build(root, name, "--engine", "ssh://root@10.77.255.254")
    assert code == 1 and "ssh://root@10.77.255.254" in err and "not reachable" in err, err
