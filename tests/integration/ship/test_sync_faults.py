"""sync when things go wrong: the sender killed (kill -9) at several points, and the hazards measured on
this machine class (../shared/FACTS.md, "Moving an image to a peer"), each against a real peer."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import pytest

from imagebuild.core import identity
from imagebuild.ship import localblobs
from imagebuild.ship import sync as sync_mod
from tests.conftest import run_cli
from tests.syncfixtures import (  # noqa: F401 - fixtures
    _private_sync_cache,
    cache_files,
    env,
    finish,
    load_leases,
    peer_id,
    peer_identity,
    reset,
    runs,
    sync,
    sync_images_fixture,
    sync_proc,
    wait_for,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]

POINTS = ["rsync-25%", "rsync-75%", "before-load", "during-load", "before-promote"]


class _Stderr:
    """Collects a child's stderr lines in a thread (so the test can wait for one)."""

    def __init__(self, proc):
        self.lines: list[str] = []
        self.t = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.t.start()

    def _read(self, proc):
        for line in proc.stderr:
            self.lines.append(line)

    def has(self, text: str) -> bool:
        return any(text in ln for ln in self.lines)


def _received(peer, hexname: str) -> int:
    base = Path(peer.cache)  # incoming/, or the image's own partial/<lock>/ while rsync writes
    return sum(p.stat().st_size for p in [*base.glob("incoming/*"), *base.glob("partial/*/*")]
               if p.name.lstrip(".").startswith(hexname))


def _start_fresh(imgs, peer):
    """The peer holds v1 as :local; the big image is to come."""
    reset(peer)
    imgs.set_local(imgs.v1)
    r, _ = sync(imgs, peer, peer.addr)
    assert r.code == 0, r.err
    imgs.set_local(imgs.big)
    return peer_id(peer, imgs.local)


def _kill_once(imgs, peer, point: str, big_layer) -> None:
    extra = {"IMAGEBUILD_SYNC_PAUSE": {"before-load": "load", "before-promote": "promote"}.get(point, "")}
    proc = sync_proc(imgs, peer, peer.addr, extra_env=extra)
    err = _Stderr(proc)
    h = big_layer.digest.split(":")[1]
    if point.startswith("rsync-"):
        frac = int(point[6:-1]) / 100
        wait_for(lambda: _received(peer, h) >= frac * big_layer.size or proc.poll() is not None, timeout=120,
                 every=0.005)
    elif point == "during-load":
        wait_for(lambda: err.has("loading on the peer") or proc.poll() is not None, timeout=120, every=0.005)
        # the sender says so just before it sends the load's lines: kill it only once the peer's agent
        # has them (it writes stage/<run>.layers right before it calls ib_load), or the load never starts
        stage = Path(peer.cache) / "stage"
        wait_for(lambda: any(stage.glob("*.layers")) or proc.poll() is not None, timeout=120, every=0.005)
        time.sleep(0.2)
    else:
        wait_for(lambda: err.has("paused before") or proc.poll() is not None, timeout=120)
    assert proc.poll() is None, f"sync ended before the kill at {point}: {''.join(err.lines)}"
    os.kill(proc.pid, signal.SIGKILL)  # the sender, kill -9
    proc.wait()
    if point.startswith("rsync-"):
        partial = _received(peer, h)
        assert 0 < partial < big_layer.size, (point, partial)


@pytest.mark.parametrize("store,points", [("peer", POINTS), ("peer_classic", ["rsync-75%", "during-load"])])
def test_kill_the_sender_at_several_points(store, points, request, sync_images):
    peer = request.getfixturevalue(store)
    imgs = sync_images
    big = localblobs.load(imgs.big)
    big_layer = max(big.layers, key=lambda la: la.size)
    want = identity.inspect(imgs.big).digest
    try:
        for point in points:
            before = _start_fresh(imgs, peer)
            _kill_once(imgs, peer, point, big_layer)
            # the peer's :local is intact
            assert peer_id(peer, imgs.local) == before, point
            if point == "during-load":
                # the peer's load goes on without the sender and lands under the staging name, never :local
                staging = sync_mod.staging_ref(want)
                wait_for(lambda s=staging: peer_id(peer, s), timeout=300, every=0.5)
                assert peer_id(peer, imgs.local) == before
            # the rerun finishes, sending at most what was left (plus 10%)
            rc, doc, err = finish(sync_proc(imgs, peer, peer.addr))
            assert rc == 0, (point, err)
            p = doc["peers"][0]
            assert p["status"] == "synced" and peer_identity(peer, imgs.local) == want, point
            remaining = p["details"].get("bytes_needed", 0) - p["details"].get("bytes_resumed", 0) \
                if p["details"] else 0
            sent = p["details"].get("rsync_bytes_sent", 0)
            assert sent <= 1.1 * remaining + (64 << 10), (point, sent, remaining)
            if point.startswith("rsync-"):
                assert p["details"]["bytes_resumed"] > 0.2 * big_layer.size, point
            assert runs(peer, imgs.local) == "version 1"
            # nothing half-written survives gc --peer: no partial blob, no work folder, no load lease
            with env(IMAGEBUILD_SSH=peer.ssh_env):
                g = run_cli("gc", "--peer", peer.addr)
            assert g.code == 0, g.out + g.err
            assert cache_files(peer) == [], point
            assert load_leases(peer) == [], point
    finally:
        imgs.set_local(imgs.v1)


def test_a_wrong_file_under_a_blob_name_is_caught(sync_images, peer):
    """Hazard: rsync trusting size and mtime delivered the wrong image. A blob-named file of the right
    size and mtime but other bytes in the peer's cache is never loaded as the image: the load (or the
    identity check) rejects it, the cached blobs are checked, the bad one is sent again."""
    imgs = sync_images
    _start_fresh(imgs, peer)
    big = localblobs.load(imgs.big)
    la = max(big.layers, key=lambda x: x.size)
    src = big.files[la.digest]
    bogus = Path(peer.cache) / "incoming" / la.digest.split(":")[1]
    bogus.parent.mkdir(parents=True, exist_ok=True)
    with open(bogus, "wb") as f:
        f.truncate(la.size)
    st = src.stat()
    os.utime(bogus, ns=(st.st_atime_ns, st.st_mtime_ns))
    try:
        r, doc = sync(imgs, peer, peer.addr)
        assert r.code == 0, r.err
        assert "did not match their digest" in r.err
        assert peer_identity(peer, imgs.local) == identity.inspect(imgs.big).digest
        assert runs(peer, imgs.local) == "version 1"
    finally:
        imgs.set_local(imgs.v1)


def _thin_tar(img: localblobs.LocalImage, name: str, skip: set[str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        def add(n, data):
            ti = tarfile.TarInfo(n)
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))

        add("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add("index.json", img.index_json(name))
        add("manifest.json", img.manifest_json(name))
        for d, data in img.inline.items():
            add(f"blobs/sha256/{d.split(':')[1]}", data)
        for la in img.layers:
            if la.digest not in skip:
                add(f"blobs/sha256/{la.digest.split(':')[1]}", img.files[la.digest].read_bytes())
    return buf.getvalue()


def test_a_broken_image_under_the_staging_name_is_not_promoted(sync_images, peer, tmp_path):
    """Hazard: a failed load leaves an image that docker image inspect shows with the right id (docker
    load even exits 0: "Error unpacking image"), that does not run. sync checks the listing and a real
    run --pull never, not inspect alone, and loads it again."""
    imgs = sync_images
    _start_fresh(imgs, peer)
    big = localblobs.load(imgs.big)
    la = max(big.layers, key=lambda x: x.size)
    staging = sync_mod.staging_ref(big.identity.digest)
    tar = tmp_path / "broken.tar"
    tar.write_bytes(_thin_tar(big, staging, {la.digest}))
    load = peer.docker("load", "-i", str(tar))
    assert load.returncode == 0  # docker load says it worked ...
    # ... inspect finds it, with the source's very id (engine 28: with an empty config; engine 26: complete)
    assert peer_id(peer, staging) == big.target.digest
    assert peer.docker("run", "--rm", "--pull", "never", staging, "true").returncode != 0  # it does not run
    try:
        r, doc = sync(imgs, peer, peer.addr)
        assert r.code == 0, r.err
        assert peer_identity(peer, imgs.local) == big.identity.digest
        assert runs(peer, imgs.local) == "version 1"
    finally:
        imgs.set_local(imgs.v1)


def _peer_load_pid(peer) -> int | None:
    sock = peer.docker_host.removeprefix("unix://")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            if cmd[:2] != [b"docker", b"load"]:
                continue
            if f"DOCKER_HOST=unix://{sock}".encode() in (d / "environ").read_bytes():
                return int(d.name)
        except OSError:
            continue
    return None


def test_a_load_interrupted_on_the_peer_leaks_nothing_past_gc(sync_images, peer):
    """Hazard: an interrupted load on a containerd peer leaks disk through leases (docker image prune
    reclaims nothing). gc --peer removes the leases of loads this tool started, with their partial writes."""
    imgs = sync_images
    _start_fresh(imgs, peer)
    ingest = Path(peer.data_root) / "containerd" / "daemon" / "io.containerd.content.v1.content" / "ingest"
    proc = None
    try:
        # the engine leaves a lease only when the load dies while it is writing content: a kill that
        # lands before or after that leaves none; try again, at most 3 times
        for attempt in range(3):
            if attempt:
                _start_fresh(imgs, peer)  # nothing of the failed try left: the load starts from the blobs again
            proc = sync_proc(imgs, peer, peer.addr)
            err = _Stderr(proc)
            pid = wait_for(lambda: _peer_load_pid(peer), timeout=180, every=0.01)
            time.sleep(1.0)  # let it write a part
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # the load was done first: nothing interrupted, try again
                finish(proc)
                leases = []
                continue
            rc, doc, _ = finish(proc)
            assert rc == 1 and "docker load failed on the peer" in doc["peers"][0]["message"], err.lines
            leases = load_leases(peer)
            if leases:
                break
        assert leases, "expected an interrupted load to leave a lease (3 tries)"
        with env(IMAGEBUILD_SSH=peer.ssh_env):
            g = run_cli("gc", "--peer", peer.addr, "--json")
        assert g.code == 0, g.err
        removed = [a for a in json.loads(g.out)["peers"][0]["remove"] if a["kind"] == "lease"]
        assert removed
        assert load_leases(peer) == []
        assert not ingest.is_dir() or not any(ingest.iterdir())
        rc, doc, e = finish(sync_proc(imgs, peer, peer.addr))
        assert rc == 0, e
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        imgs.set_local(imgs.v1)
        subprocess.run(["true"])
