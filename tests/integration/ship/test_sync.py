"""imagebuild sync against real peers: a containerd-store peer and a classic-store peer, each its own
network namespace, sshd and Docker engine (scripts/peer.sh). No mock of ssh, rsync or docker."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from imagebuild.core import identity
from imagebuild.ship import localblobs
from tests.conftest import run_cli
from tests.syncfixtures import (  # noqa: F401 - fixtures
    _private_sync_cache,
    cache_files,
    env,
    finish,
    listed,
    peer_id,
    peer_identity,
    reset,
    runs,
    sync,
    sync_images_fixture,
    sync_proc,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]

STORES = ["peer", "peer_classic"]


def _state(peer) -> tuple:
    """Everything sync could change on a peer: its images (tags and ids) and its cache's files."""
    images = sorted(peer.docker("image", "ls", "--no-trunc", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}").stdout
                    .split("\n")) if peer.docker_host else []
    files = sorted(str(p) for p in Path(peer.cache).rglob("*")) if peer.cache else []
    return images, files


@pytest.mark.parametrize("store", STORES)
def test_fresh_then_top_layer_then_noop(store, request, sync_images):
    peer = request.getfixturevalue(store)
    imgs = sync_images
    reset(peer)
    imgs.set_local(imgs.v1)
    v1 = identity.inspect(imgs.v1).digest
    r, doc = sync(imgs, peer, peer.addr)
    assert r.code == 0, r.err
    (p,) = doc["peers"]
    assert p["status"] == "synced" and p["identity"] == v1 and p["store"] == ("containerd" if store == "peer"
                                                                               else "classic")
    assert doc["receipt"]["authority"] == "definition"
    # the peer computes the same store-independent identity; the image is listed and runs with --pull never
    assert peer_identity(peer, imgs.local) == v1
    assert listed(peer, imgs.local)
    assert runs(peer, imgs.local) == "version 1"
    # the gate receipt came along: `gate --check-receipt` on the peer knows the image passed
    receipt = Path(peer.cache) / "receipts" / v1.split(":")[1]
    assert list(receipt.glob("*.json")), "no receipt carried"
    with env(DOCKER_HOST=peer.docker_host, IMAGEBUILD_PEER_CACHE=peer.cache,
             IMAGEBUILD_STATE_DIR=str(Path(peer.cache) / "no-local-state")):
        chk = run_cli("--root", str(imgs.root), "gate", imgs.name, "--check-receipt")
    assert chk.code == 0 and "carried by imagebuild sync" in chk.out, chk.out + chk.err
    # nothing of the transfer is left in the cache
    assert cache_files(peer) == []

    # a top-layer-only change: one layer crosses the link, the old image stays as :previous
    v1_peer_id = peer_id(peer, imgs.local)
    imgs.set_local(imgs.v2)
    v2 = identity.inspect(imgs.v2).digest
    top = localblobs.load(imgs.v2).layers[-1]
    before = peer.link_bytes()
    t0 = time.monotonic()
    r, doc = sync(imgs, peer, peer.addr)
    took = time.monotonic() - t0
    on_link = peer.link_bytes() - before
    assert r.code == 0, r.err
    (p,) = doc["peers"]
    assert p["status"] == "synced" and p["layers_sent"] == 1 and p["details"]["layers_needed"] == [top.digest]
    assert on_link <= 1.1 * top.size + (1 << 20), (on_link, top.size)
    assert peer_identity(peer, imgs.local) == v2 and runs(peer, imgs.local) == "version 2"
    assert peer_id(peer, f"{imgs.name}:previous") == v1_peer_id
    assert took < 10, took  # the bench (make bench) holds the 3 s bound; here the machine is shared

    # again: a no-op, under 2 s for the whole command
    t0 = time.monotonic()
    rc, doc, err = finish(sync_proc(imgs, peer, peer.addr))
    took = time.monotonic() - t0
    assert rc == 0, err
    assert doc["peers"][0]["status"] == "unchanged" and "already is identity" in doc["peers"][0]["message"]
    assert took < 2.5, took  # 2 s in make bench, with margin for a loaded test machine


def test_store_combinations(sync_images, peer, peer_classic, peer_small):
    """Identity after sync equals the source's on every store combination (the source engine being
    containerd here, or a peer's engine: classic)."""
    imgs = sync_images
    for p in (peer, peer_classic, peer_small):
        reset(p)
    imgs.set_local(imgs.v1)
    want = identity.inspect(imgs.v1).digest
    # containerd -> classic, then classic (peer_classic's engine as the source) -> containerd and -> classic
    r, _ = sync(imgs, peer_classic, peer_classic.addr)
    assert r.code == 0, r.err
    for dest in (peer, peer_small):
        with env(IMAGEBUILD_PEER_MIN_FREE_GB="0.01"):  # the small peer has 320 MiB in all
            r, doc = sync(imgs, dest, dest.addr, source=peer_classic.docker_host)
        assert r.code == 0, r.err
        assert doc["source"] == "docker-save"  # a classic store has no blob files: docker save, spooled
        assert peer_identity(dest, imgs.local) == want and listed(dest, imgs.local)
        assert runs(dest, imgs.local) == "version 1"
    # containerd (the peer's engine as the source: its own content store) -> classic
    reset(peer_classic)
    r, doc = sync(imgs, peer_classic, peer_classic.addr, source=peer.docker_host)
    assert r.code == 0, r.err
    assert doc["source"] == "content-store"
    assert peer_identity(peer_classic, imgs.local) == want and runs(peer_classic, imgs.local) == "version 1"


def test_several_peers_in_parallel_and_a_partial_failure(sync_images, peer, peer_classic):
    imgs = sync_images
    reset(peer)
    reset(peer_classic)
    imgs.set_local(imgs.v1)
    # one ssh config for both: the peers' own files list one host each, so write one with both
    cfg = Path(peer.ssh_config).parent / "both_config"
    cfg.write_text(Path(peer.ssh_config).read_text() + Path(peer_classic.ssh_config).read_text())
    ssh = f"ssh -F {cfg}"
    r, doc = sync(imgs, peer, peer.addr, peer_classic.addr, "--jobs", "2", ssh=ssh)
    assert r.code == 0, r.err
    assert [p["status"] for p in doc["peers"]] == ["synced", "synced"]
    assert "sent" in r.err and "ETA" in r.err  # progress per peer
    # one of three unreachable: the others still get it, the report names who has it, exit 1
    imgs.set_local(imgs.v2)
    r, doc = sync(imgs, peer, peer.addr, "root@127.0.0.1", peer_classic.addr, ssh=ssh)
    assert r.code == 1
    by = {p["peer"]: p for p in doc["peers"]}
    assert by["root@127.0.0.1"]["status"] == "failed" and "cannot reach" in by["root@127.0.0.1"]["message"]
    assert doc["have_image"] == [peer.addr, peer_classic.addr]
    with env(IMAGEBUILD_SSH=ssh):
        text = run_cli("--root", str(imgs.root), "sync", peer.addr, "root@127.0.0.1")
    assert text.code == 1 and "the image is on: " + peer.addr in text.out


def test_unreachable_peer_fails_clearly_and_changes_nothing(sync_images, peer):
    imgs = sync_images
    before = _state(peer)
    r, doc = sync(imgs, peer, "root@127.0.0.1")
    assert r.code == 1
    assert "cannot reach root@127.0.0.1 over ssh" in doc["peers"][0]["message"]
    assert "Traceback" not in r.err
    assert _state(peer) == before


def test_peer_without_docker(sync_images, peer_nodocker):
    imgs = sync_images
    before = sorted(Path(peer_nodocker.cache).rglob("*"))
    r, doc = sync(imgs, peer_nodocker, peer_nodocker.addr)
    assert r.code == 1
    msg = doc["peers"][0]["message"]
    assert "docker: command not found on the peer" in msg and "install Docker" in msg
    assert sorted(Path(peer_nodocker.cache).rglob("*")) == before


def test_peer_with_a_too_small_disk(sync_images, peer_small):
    imgs = sync_images
    reset(peer_small)
    imgs.set_local(imgs.big)
    try:
        before = _state(peer_small)
        with env(IMAGEBUILD_PEER_MIN_FREE_GB="0.01"):
            r, doc = sync(imgs, peer_small, peer_small.addr)
        assert r.code == 3, r.err
        msg = doc["peers"][0]["message"]
        assert doc["peers"][0]["status"] == "refused" and "not enough disk on" in msg and "free on" in msg
        assert _state(peer_small) == before
    finally:
        imgs.set_local(imgs.v1)


def test_ungated_image_is_refused_everywhere(sync_images, peer, peer_classic):
    imgs = sync_images
    reset(peer)
    imgs.set_local(imgs.ungated)
    try:
        before = (_state(peer), _state(peer_classic))
        cfg = Path(peer.ssh_config).parent / "both_config"
        cfg.write_text(Path(peer.ssh_config).read_text() + Path(peer_classic.ssh_config).read_text())
        r, doc = sync(imgs, peer, peer.addr, peer_classic.addr, ssh=f"ssh -F {cfg}")
        assert r.code == 3
        assert [p["status"] for p in doc["peers"]] == ["refused", "refused"]
        assert "no passing receipt" in doc["peers"][0]["message"] and "--force" in doc["peers"][0]["message"]
        assert (_state(peer), _state(peer_classic)) == before
        # --force syncs it, and says so
        r, doc = sync(imgs, peer, peer.addr, "--force")
        assert r.code == 0 and doc["forced"] is True and "syncing anyway (--force)" in r.err
    finally:
        imgs.set_local(imgs.v1)


def test_a_serving_container_keeps_the_tag_unless_forced(sync_images, peer):
    imgs = sync_images
    reset(peer)
    imgs.set_local(imgs.v1)
    assert sync(imgs, peer, peer.addr)[0].code == 0
    old = peer_id(peer, imgs.local)
    run = peer.docker("run", "-d", "--pull", "never", "--network", "none", "--name", "serving", imgs.local,
                      "sleep", "600")
    assert run.returncode == 0, run.stderr
    try:
        imgs.set_local(imgs.v2)
        r, doc = sync(imgs, peer, peer.addr)
        assert r.code == 3
        assert "running containers use" in doc["peers"][0]["message"] and "serving" in doc["peers"][0]["message"]
        assert peer_id(peer, imgs.local) == old
        r, doc = sync(imgs, peer, peer.addr, "--force")
        assert r.code == 0 and "moving the tag anyway (--force)" in r.err
        assert peer_identity(peer, imgs.local) == identity.inspect(imgs.v2).digest
        # the serving container still runs its own image
        assert peer.docker("inspect", "--format", "{{.State.Running}} {{.Image}}", "serving").stdout.split() == \
            ["true", old]
    finally:
        peer.docker("rm", "-f", "serving")
        imgs.set_local(imgs.v1)


def test_dry_run_changes_nothing(sync_images, peer):
    imgs = sync_images
    reset(peer)
    before = _state(peer)
    r, doc = sync(imgs, peer, peer.addr, "--dry-run")
    assert r.code == 0
    assert doc["peers"][0]["status"] == "dry-run" and "would sync" in doc["peers"][0]["message"]
    assert _state(peer) == before


def test_gc_peer_bounds_records_and_receipts(sync_images, peer):
    imgs = sync_images
    reset(peer)
    # back to v1, the older build, takes --force (docs/sync.md: the tag never moves to an older build)
    for ref, extra in ((imgs.v1, ()), (imgs.v2, ()), (imgs.v1, ("--force",))):
        imgs.set_local(ref)
        assert sync(imgs, peer, peer.addr, *extra)[0].code == 0
    assert len(list((Path(peer.cache) / "records").glob("*.json"))) == 2
    with env(IMAGEBUILD_SSH=peer.ssh_env):
        dry = run_cli("gc", "--peer", peer.addr, "--keep", "1", "--dry-run", "--json")
        assert dry.code == 0, dry.err
        assert len(list((Path(peer.cache) / "records").glob("*.json"))) == 2
        plan = json.loads(dry.out)["peers"][0]
        assert [a["kind"] for a in plan["remove"]].count("record") == 1
        done = run_cli("gc", "--peer", peer.addr, "--keep", "1")
    assert done.code == 0, done.err
    recs = list((Path(peer.cache) / "records").glob("*.json"))
    assert len(recs) == 1 and json.loads(recs[0].read_text())["identity"] == identity.inspect(imgs.v1).digest
    assert "freed" in done.out


def test_doctor_checks_what_sync_needs(sync_images, peer, peer_nodocker):
    with env(IMAGEBUILD_SSH=peer.ssh_env):
        r = run_cli("doctor", "--peer", peer.addr, "--json")
    by = {c["name"]: c for c in json.loads(r.out)["checks"]}
    for name in (f"peer {peer.addr}", f"peer {peer.addr} rsync", f"peer {peer.addr} sync tools",
                 f"peer {peer.addr} image store", f"peer {peer.addr} sync cache"):
        assert by[name]["status"] in ("ok", "warn"), by.get(name)
    assert "containerd" in by[f"peer {peer.addr} image store"]["detail"]
    with env(IMAGEBUILD_SSH=peer_nodocker.ssh_env):
        r = run_cli("doctor", "--peer", peer_nodocker.addr, "--json")
    by = {c["name"]: c for c in json.loads(r.out)["checks"]}
    assert r.code == 1 and by[f"peer {peer_nodocker.addr}"]["status"] == "fail"


def test_cli_usage_errors(sync_images):
    r = run_cli("--root", str(sync_images.root), "sync", "--image", "nosuch", "dgx4")
    assert r.code == 2 and "docker-images/nosuch: IMAGE: no such image definition" in r.err
    r = run_cli("--root", str(sync_images.root), "sync", "--image", sync_images.name)
    assert r.code == 2 and "no peer to sync to" in r.err
    r = run_cli("--root", str(sync_images.root), "sync", "@rack", "--image", sync_images.name)
    assert r.code == 2 and "no peer list '@rack'" in r.err


def test_missing_source_image_is_a_clear_error(sync_images, peer):
    r, _ = sync(sync_images, peer, peer.addr, "--image", "imagebuild-test/nope:missing")
    assert r.code == 1 and "not found in the engine" in r.err and "Traceback" not in r.err


def test_the_sender_never_asks_a_registry(sync_images, peer):
    """Hazard: a peer engine asked to run an image it lacks tries Docker Hub. Every run sync does on a
    peer says --pull never: the peer's engine log shows no pull, and the verification of a missing image
    fails at once with 'No such image', not with a registry error."""
    imgs = sync_images
    reset(peer)
    imgs.set_local(imgs.v1)
    assert sync(imgs, peer, peer.addr)[0].code == 0
    log = (Path(peer.dir) / "dockerd.log").read_text()
    assert "registry-1.docker.io" not in log and "pull access denied" not in log
    from imagebuild.ship import peer as peer_mod
    from imagebuild.ship import peer_agent

    with env(IMAGEBUILD_SSH=peer.ssh_env):
        conn = peer_mod.Connection(peer.addr)
        try:
            t0 = time.monotonic()
            res = conn.agent(peer_agent.call("ib_verify_step", "imagebuild-test/not-on-the-peer:x"))
            took = time.monotonic() - t0
        finally:
            conn.close()
    run_out = res.section("run")
    assert "@@rc 0" not in run_out and ("No such image" in run_out or "No such image" in res.section("inspect"))
    assert "docker.io" not in run_out.replace("docker.io/library/", "") or "No such image" in run_out
    assert took < 20
    subprocess.run(["true"])


@pytest.mark.parametrize("known", ["changed", "unknown"])
def test_a_changed_or_unknown_host_key_is_refused(sync_images, peer, tmp_path, known):
    """The peer fixture's client knows the peer's host key (scripts/peer.sh writes known_hosts and
    StrictHostKeyChecking yes); with another key on record, or none, sync changes nothing on the peer,
    and doctor says what is wrong with the key (issue 22, security 6)."""
    import re

    kh = tmp_path / "known_hosts"
    if known == "changed":
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
        kh.write_text(f"{peer.addr} {' '.join((tmp_path / 'other.pub').read_text().split()[:2])}\n")
    else:
        kh.write_text("")
    cfg = tmp_path / "ssh_config"
    cfg.write_text(re.sub(r"UserKnownHostsFile \S+", f"UserKnownHostsFile {kh}", Path(peer.ssh_config).read_text()))
    ssh = f"ssh -F {cfg}"
    before = _state(peer)
    r, doc = sync(sync_images, peer, peer.addr, ssh=ssh)
    assert r.code == 1, r.err
    assert doc["peers"][0]["status"] == "failed" and "host key" in doc["peers"][0]["message"].lower(), doc
    assert _state(peer) == before
    with env(IMAGEBUILD_SSH=ssh):
        r = run_cli("doctor", "--peer", peer.addr, "--json")
    check = {c["name"]: c for c in json.loads(r.out)["checks"]}[f"peer {peer.addr}"]
    assert r.code == 1 and check["status"] == "fail"
    assert ("has CHANGED" if known == "changed" else "is not in known_hosts") in check["detail"], check


def test_imagebuild_never_turns_host_key_checking_off():
    root = Path(__file__).resolve().parents[3]
    hits = [p for p in (root / "imagebuild").rglob("*.py") if "StrictHostKeyChecking" in p.read_text()]
    assert hits == []
    assert "StrictHostKeyChecking no" not in (root / "scripts" / "peer.sh").read_text()
