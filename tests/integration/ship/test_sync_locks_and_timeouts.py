"""Two syncs of one image to one peer, an older build after a newer one, and a frozen peer engine:
each against real peers (scripts/peer.sh: own sshd and Docker engine, containerd and classic store)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from imagebuild.core import identity
from imagebuild.ship import sync as sync_mod
from tests.conftest import run_cli
from tests.syncfixtures import (  # noqa: F401 - fixtures
    _private_sync_cache,
    cache_files,
    env,
    finish,
    peer_identity,
    reset,
    runs,
    sync,
    sync_images_fixture,
    sync_proc,
    wait_for,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]


class _Stderr:
    """A child's stderr lines, collected in a thread, each with the time it came."""

    def __init__(self, proc):
        self.lines: list[tuple[float, str]] = []
        self.out: list[str] = []
        self.t = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.t.start()
        self.t_out = threading.Thread(target=lambda: self.out.append(proc.stdout.read()), daemon=True)
        self.t_out.start()

    def _read(self, proc):
        for line in proc.stderr:
            self.lines.append((time.monotonic(), line))

    def has(self, text: str) -> bool:
        return any(text in ln for _, ln in self.lines)

    def first(self, text: str) -> int:
        return next(i for i, (_, ln) in enumerate(self.lines) if text in ln)

    def text(self) -> str:
        return "".join(ln for _, ln in self.lines)


def _finish(proc, err: _Stderr, timeout: float = 600):
    proc.wait(timeout)  # subprocess.TimeoutExpired past it
    err.t.join(10)
    err.t_out.join(10)
    import json

    try:
        doc = json.loads("".join(err.out))
    except ValueError:
        doc = None
    return proc.returncode, doc


def _one_sync_while_another_sends(imgs, peer, first: str, then: str):
    """From an empty peer: a sync of ``first`` as :local, and once it sends, a sync of ``then`` as :local;
    each one's (exit code, report, _Stderr)."""
    reset(peer)
    imgs.set_local(first)
    a = sync_proc(imgs, peer, peer.addr)
    ea = _Stderr(a)
    wait_for(lambda: ea.has("sending") or a.poll() is not None, timeout=120, every=0.01)
    imgs.set_local(then)
    b = sync_proc(imgs, peer, peer.addr)
    eb = _Stderr(b)
    return (*_finish(a, ea), ea), (*_finish(b, eb), eb)


@pytest.mark.parametrize("store", ["peer", "peer_classic"])
def test_two_syncs_of_one_image_to_one_peer_never_mix_and_the_newer_build_stays(store, request, sync_images):
    peer = request.getfixturevalue(store)
    imgs = sync_images
    newer, older = identity.inspect(imgs.big2).digest, identity.inspect(imgs.big).digest
    try:
        # the newer build's sync starts first; an older build's sync starts while it sends the 300 MB layer
        (rc_a, doc_a, ea), (rc_b, doc_b, eb) = _one_sync_while_another_sends(imgs, peer, imgs.big2, imgs.big)
        assert rc_a == 0 and doc_a["peers"][0]["status"] == "synced", ea.text()
        # the later one waited for the earlier one, then refused to put an older build over it
        assert eb.has("waiting for it"), eb.text()
        assert rc_b == 3 and doc_b["peers"][0]["status"] == "refused", eb.text()
        assert "newer build" in doc_b["peers"][0]["message"]
        assert peer_identity(peer, imgs.local) == newer
        assert runs(peer, imgs.local) == "version 2"
        # the other order: the older build first, then the newer one, which waits and wins
        (rc_a, _, ea), (rc_b, doc_b, eb) = _one_sync_while_another_sends(imgs, peer, imgs.big, imgs.big2)
        assert rc_a == 0, ea.text()
        assert rc_b == 0 and doc_b["peers"][0]["status"] == "synced", eb.text()
        assert peer_identity(peer, imgs.local) == newer and peer_identity(peer, f"{imgs.name}:previous") == older
        with env(IMAGEBUILD_SSH=peer.ssh_env):
            g = run_cli("gc", "--peer", peer.addr)
        assert g.code == 0, g.out + g.err
        assert cache_files(peer) == []
    finally:
        imgs.set_local(imgs.v1)


def test_a_sync_still_locked_out_after_the_wait_is_refused_busy(sync_images, peer):
    imgs = sync_images
    reset(peer)
    imgs.set_local(imgs.v2)
    a = sync_proc(imgs, peer, peer.addr, extra_env={"IMAGEBUILD_SYNC_PAUSE": "promote"})
    ea = _Stderr(a)
    try:
        wait_for(lambda: ea.has("paused before") or a.poll() is not None, timeout=120)
        assert a.poll() is None, ea.text()
        t0 = time.monotonic()
        rc, doc, err = finish(sync_proc(imgs, peer, peer.addr, extra_env={"IMAGEBUILD_SYNC_LOCK_WAIT": "2"}))
        assert rc == 3, err
        p = doc["peers"][0]
        assert p["status"] == "refused" and p["message"].startswith("busy: another imagebuild sync"), p
        assert time.monotonic() - t0 < 30
        assert peer_identity(peer, imgs.local) is None  # nothing moved
    finally:
        os.killpg(a.pid, signal.SIGKILL)
        a.wait()
    # the killed sender's session is gone, and with it the lock: the next sync runs at once
    rc, doc, err = finish(sync_proc(imgs, peer, peer.addr, extra_env={"IMAGEBUILD_SYNC_LOCK_WAIT": "20"}))
    assert rc == 0 and doc["peers"][0]["status"] == "synced", err
    imgs.set_local(imgs.v1)


def test_the_tag_never_moves_to_an_older_build_unless_forced(sync_images, peer_classic):
    peer = peer_classic
    imgs = sync_images
    reset(peer)
    try:
        imgs.set_local(imgs.v2)
        r, doc = sync(imgs, peer, peer.addr)
        assert r.code == 0, r.err
        imgs.set_local(imgs.v1)  # built before v2
        r, doc = sync(imgs, peer, peer.addr)
        assert r.code == 3, r.err
        p = doc["peers"][0]
        assert p["status"] == "refused" and "newer build" in p["message"] and "--force" in p["message"], p
        assert runs(peer, imgs.local) == "version 2"
        r, doc = sync(imgs, peer, peer.addr, "--force")
        assert r.code == 0 and doc["peers"][0]["status"] == "synced", r.err
        assert runs(peer, imgs.local) == "version 1"
    finally:
        imgs.set_local(imgs.v1)


def _dockerd_pid(peer) -> int:
    return int((Path(peer.dir) / "docker.pid").read_text().strip())


def test_a_frozen_peer_engine_ends_within_the_bound_and_the_healthy_peer_is_reported_first(
        sync_images, peer, peer_classic):
    imgs = sync_images
    reset(peer)
    reset(peer_classic)
    cfg = Path(peer.ssh_config).parent / "both_config"
    cfg.write_text(Path(peer.ssh_config).read_text() + Path(peer_classic.ssh_config).read_text())
    ssh = f"ssh -F {cfg}"
    pid = _dockerd_pid(peer)
    try:
        # the healthy peer holds the big layer already: it needs only the top one (a second or two)
        imgs.set_local(imgs.big)
        r, _ = sync(imgs, peer_classic, peer_classic.addr)
        assert r.code == 0, r.err
        imgs.set_local(imgs.big2)
        p = sync_proc(imgs, peer, peer.addr, peer_classic.addr, "--jobs", "2",
                      extra_env={"IMAGEBUILD_SSH": ssh, "IMAGEBUILD_SYNC_TIMEOUT": "20",
                                 "IMAGEBUILD_SYNC_HEARTBEAT": "2"})
        err = _Stderr(p)
        # the frozen one: its engine stops the moment its load starts
        wait_for(lambda: err.has(f"{peer.addr}: loading on the peer") or p.poll() is not None, timeout=180,
                 every=0.005)
        os.kill(pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            rc, doc = _finish(p, err, timeout=120)
        except Exception:
            os.killpg(p.pid, signal.SIGKILL)
            raise
        took = time.monotonic() - frozen_at
        assert rc == 1, err.text()
        by = {x["peer"]: x for x in doc["peers"]}
        assert by[peer_classic.addr]["status"] == "synced"
        bad = by[peer.addr]
        assert bad["status"] == "failed" and "the load did not finish within 20 s" in bad["message"], bad
        assert "IMAGEBUILD_SYNC_TIMEOUT" in bad["message"]
        assert took < 20 + 30, took
        # each peer's result as it ends: the healthy one long before the frozen one's
        assert err.first(f"{peer_classic.addr}: synced after") < err.first(f"{peer.addr}: failed after"), err.text()
        # a heartbeat while the frozen peer loads: peer, step, time so far, bytes sent
        beats = [ln for _, ln in err.lines if f"{peer.addr}: still loading on the peer" in ln]
        assert len(beats) >= 3 and "sent to it" in beats[0], err.text()
        assert peer_identity(peer_classic, imgs.local) == identity.inspect(imgs.big2).digest
    finally:
        os.kill(pid, signal.SIGCONT)
        imgs.set_local(imgs.v1)
    # the engine back: the load it was doing ends on the peer; a rerun syncs
    rc, doc, e = finish(sync_proc(imgs, peer, peer.addr, extra_env={"IMAGEBUILD_SYNC_TIMEOUT": "120"}))
    assert rc == 0, e
    reset(peer)


def test_a_frozen_peer_engine_during_the_probe_is_bounded_too(sync_images, peer):
    imgs = sync_images
    reset(peer)
    pid = _dockerd_pid(peer)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        p = sync_proc(imgs, peer, peer.addr, extra_env={"IMAGEBUILD_SYNC_TIMEOUT": "5"})
        try:
            rc, doc, err = finish(p, timeout=90)
        except Exception:
            os.killpg(p.pid, signal.SIGKILL)
            raise
        assert rc == 1, err
        assert "the probe did not finish within 5 s" in doc["peers"][0]["message"]
        assert time.monotonic() - t0 < 60
    finally:
        os.kill(pid, signal.SIGCONT)


def test_the_unpacked_sizes_come_from_the_engine(sync_images):
    from imagebuild.ship import localblobs

    img = localblobs.load(sync_images.big)
    sizes = localblobs.unpacked_sizes(img)
    assert set(sizes) == {la.diff_id for la in img.layers}
    big = max(img.layers, key=lambda la: la.size)
    # the 300 MB of /data/big.bin, unpacked, whatever the blob's compression
    assert 300_000_000 <= sizes[big.diff_id] < 310_000_000


def _child_rsync(pid: int) -> int | None:
    """The rsync this sender (``pid``) started, if it runs."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if comm == "rsync" and int(rest[1]) == pid:
            return int(d.name)
    return None


def _read_so_far(pid: int, hexname: str) -> int:
    """How far process ``pid`` has read its open file named ``hexname`` (0: not open)."""
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.path.basename(os.readlink(fd)) == hexname:
                    info = Path(f"/proc/{pid}/fdinfo/{fd.name}").read_text()
                    return int(info.split("pos:", 1)[1].split()[0])
            except (OSError, IndexError, ValueError):
                continue
    except OSError:
        pass
    return 0


def _blob_files(peer, hexname: str) -> list[Path]:
    base = Path(peer.cache)
    return [p for p in [*base.glob("incoming/*"), *base.glob("partial/*/*")] if p.name.lstrip(".").startswith(hexname)]


@pytest.mark.parametrize("store", ["peer", "peer_classic"])
def test_syncs_of_two_images_that_share_a_layer_to_one_peer_never_write_the_same_file(store, request, sync_images):
    """Two different images (two tags: two sync locks, so they run side by side) that share the 300 MB
    layer, started 0.1 s apart to one peer. The second one's rsync is stopped part-way and let go on just
    as the first one's load reads the layer: with one shared file in incoming/, its writes land in the
    file the load reads (tar: file changed as we read it). Each sync writes its own file: both succeed."""
    from imagebuild.ship import localblobs

    peer = request.getfixturevalue(store)
    imgs = sync_images
    big = localblobs.load(imgs.big)
    shared = max(big.layers, key=lambda la: la.size)
    assert shared.digest in {la.digest for la in localblobs.load(imgs.big2).layers}
    hexname = shared.digest.split(":")[1]
    want_a, want_b = identity.inspect(imgs.big).digest, identity.inspect(imgs.big2).digest
    reset(peer)
    imgs.set_local(imgs.big)
    stopped = None
    a = b = None
    try:
        a = sync_proc(imgs, peer, peer.addr)
        ea = _Stderr(a)
        time.sleep(0.1)
        # both send the layer (the second does not wait for the first: test_sync_corpus.py has that case)
        b = sync_proc(imgs, peer, peer.addr, "--image", imgs.big2, "--force",
                      extra_env={"IMAGEBUILD_SYNC_WAIT_SHARED": "0"})
        eb = _Stderr(b)
        # the second sync's rsync, once it sends the layer's bytes (so the peer's side of it has chosen
        # the file it writes and from where): stopped
        wait_for(lambda: (eb.has("sending") and _child_rsync(b.pid)) or b.poll() is not None, timeout=180,
                 every=0.005)
        assert b.poll() is None, eb.text()
        stopped = _child_rsync(b.pid)
        wait_for(lambda: _read_so_far(stopped, hexname) > 16 << 20 or b.poll() is not None, timeout=120,
                 every=0.002)
        os.kill(stopped, signal.SIGSTOP)
        # the first one's load reads the layer: the second one's rsync goes on now. Until then it is held
        # back, never for as long as its own streamed load's stall bound (a blob that has not grown for
        # that long fails the load, as designed): on a loaded machine the first one's transfer alone may
        # take longer than that (issue 34)
        stage = Path(peer.cache) / "stage"
        _hold_back(stopped, lambda: (ea.has("loading on the peer") and any(stage.glob("*.layers")))
                   or a.poll() is not None, timeout=360, bound=sync_mod.stream_stall_s(),
                   read=lambda: _read_so_far(stopped, hexname))
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        rc_a, doc_a = _finish(a, ea)
        rc_b, doc_b = _finish(b, eb)
        assert rc_a == 0 and doc_a["peers"][0]["status"] == "synced", ea.text()
        assert rc_b == 0 and doc_b["peers"][0]["status"] == "synced", eb.text()
        assert not eb.has("waiting for it")  # they ran side by side
        # both images are on the peer, each the source's identity, and run
        assert peer_identity(peer, imgs.local) == want_a
        assert peer_identity(peer, imgs.big2) == want_b
        assert runs(peer, imgs.local) == "version 1" and runs(peer, imgs.big2) == "version 2"
        # nothing left: no blob in incoming/, no partial file, no work folder (without gc --peer)
        assert _blob_files(peer, hexname) == []
        assert cache_files(peer) == []
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
        for p in (a, b):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        imgs.set_local(imgs.v1)
        reset(peer)


def _hold_back(pid: int, done, *, timeout: float, bound: float, read) -> None:
    """Keep the stopped process ``pid`` stopped until ``done()`` (or ``timeout`` s), but every quarter of
    ``bound`` (the stall bound of what it feeds) let it read 2 MiB more (``read()``: how far it has read)
    and stop it again: what waits on it never sees it still for ``bound`` s, however long ``done`` takes on
    a loaded machine, and it never runs long enough to finish its transfer (a whole second of running did,
    once: 300 MB under one second on a quiet peer, and the race this sets up was gone)."""
    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end, "the first sync never started its load"
        last = time.monotonic()
        while not done() and time.monotonic() - last < bound / 4:
            time.sleep(0.005)
        if done():
            return
        start = read()
        os.kill(pid, signal.SIGCONT)
        moving = time.monotonic()
        while read() - start < 2 << 20 and time.monotonic() - moving < min(1.0, bound / 20):
            time.sleep(0.001)
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return  # it finished its transfer all the same: the outcome is still checked below


def _ingested(peer) -> int:
    """The bytes the peer's containerd has taken in so far of its largest ingest in progress (ctr content
    active: REF SIZE AGE)."""
    import json
    import subprocess

    info = peer.docker("info", "--format", "{{json .Containerd}}").stdout
    addr = json.loads(info)["Address"]
    out = subprocess.run(["ctr", "-a", addr, "-n", "moby", "content", "active"], capture_output=True,
                         text=True).stdout
    units = {"B": 1, "kB": 1e3, "KiB": 1 << 10, "MB": 1e6, "MiB": 1 << 20, "GB": 1e9, "GiB": 1 << 30}
    got = [0.0]
    for ln in out.splitlines()[1:]:
        m = re.fullmatch(r"([0-9.]+)\s*([A-Za-z]+)", ln.split("\t")[1].strip() if "\t" in ln else "")
        if m and m.group(2) in units:
            got.append(float(m.group(1)) * units[m.group(2)])
    return int(max(got))


def test_on_a_containerd_peer_the_load_starts_while_the_blobs_still_arrive(sync_images, peer):
    """The peer's docker load of a fresh image starts with the transfer, and its engine takes in the
    300 MB layer while that layer still arrives: the sender's rsync is stopped once more than 48 MiB of
    the layer are on the peer, and then containerd has already ingested more than 16 MiB (the other blobs
    are smaller than that) of a layer that is still partial; let go, the sync ends with the source's
    image."""
    from imagebuild.ship import localblobs

    imgs = sync_images
    layers = localblobs.load(imgs.big).layers
    big = max(layers, key=lambda la: la.size)
    assert all(la.size < 16 << 20 for la in layers if la is not big)
    hexname = big.digest.split(":")[1]
    reset(peer)
    imgs.set_local(imgs.big)
    base = Path(peer.cache)
    seen, ingesting = [], []

    def partial_now() -> int:
        return sum(p.stat().st_size for p in _blob_files(peer, hexname) if p.exists())

    p = sync_proc(imgs, peer, peer.addr)
    err = _Stderr(p)
    stopped = None
    try:
        wait_for(lambda: (err.has("sending") and _child_rsync(p.pid)) or p.poll() is not None, timeout=180,
                 every=0.005)
        sender = _child_rsync(p.pid)
        assert sender and p.poll() is None, err.text()
        wait_for(lambda: partial_now() > 48 << 20 or p.poll() is not None, timeout=120, every=0.002)
        os.kill(sender, signal.SIGSTOP)
        stopped = sender
        got = partial_now()
        seen.append(got)
        assert any(base.glob("attempts/*.json")) and 0 < got < big.size, (got, err.text())
        # the load reads what has arrived (within a second: it looks every 50 ms)
        wait_for(lambda: _ingested(peer) > 16 << 20, timeout=3, every=0.05)
        ingesting.append(_ingested(peer))
        assert partial_now() < big.size
        os.kill(sender, signal.SIGCONT)
        stopped = None
        rc, doc = _finish(p, err)
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        imgs.set_local(imgs.v1)
    assert seen, err.text()
    assert ingesting, f"the layer was partial at {seen[:3]}... bytes, but nothing was ingested meanwhile"
    assert rc == 0 and doc["peers"][0]["status"] == "synced", err.text()
    assert doc["peers"][0]["details"]["load"] == "streamed"
    assert peer_identity(peer, imgs.local) == identity.inspect(imgs.big).digest
    assert runs(peer, imgs.local) == "version 1"
    assert cache_files(peer) == []
    reset(peer)


def _locks_free(peer) -> bool:
    """No sync session holds an image's lock on the peer (flock -n on each locks/*.lock)."""
    import subprocess

    locks = list((Path(peer.cache) / "locks").glob("*.lock"))
    return all(subprocess.run(["flock", "-n", str(f), "true"]).returncode == 0 for f in locks)


def test_a_link_cut_mid_stream_frees_the_peer_within_seconds(sync_images, peer):
    """The sender's rsync is killed (a cut link) while the streamed load reads the 300 MB layer: the
    sync fails, and the peer's load ends once rsync's receiver is gone, not after the stall bound (60 s):
    within 15 s the image's lock on the peer is free and no docker load of the cache is left. The rerun
    then syncs the source's image."""
    from imagebuild.ship import localblobs

    imgs = sync_images
    big = max(localblobs.load(imgs.big).layers, key=lambda la: la.size)
    hexname = big.digest.split(":")[1]
    reset(peer)
    imgs.set_local(imgs.big)
    try:
        p = sync_proc(imgs, peer, peer.addr)
        err = _Stderr(p)
        wait_for(lambda: (err.has("sending") and _child_rsync(p.pid)) or p.poll() is not None, timeout=180,
                 every=0.005)
        sender = _child_rsync(p.pid)
        assert sender and p.poll() is None, err.text()
        part = lambda: sum(f.stat().st_size for f in _blob_files(peer, hexname) if f.exists())  # noqa: E731
        wait_for(lambda: part() > 48 << 20 or p.poll() is not None, timeout=120, every=0.002)
        assert 0 < part() < big.size
        os.kill(sender, signal.SIGKILL)
        rc, _ = _finish(p, err, timeout=120)
        assert rc == 1, err.text()
        t0 = time.monotonic()
        wait_for(lambda: _locks_free(peer), timeout=15, every=0.1)
        assert time.monotonic() - t0 < 15
        attempts = list((Path(peer.cache) / "attempts").glob("*.json"))
        assert all('"failed"' in a.read_text() for a in attempts), [a.read_text() for a in attempts]
        r, doc = sync(imgs, peer, peer.addr)
        assert r.code == 0 and doc["peers"][0]["status"] == "synced", r.err
        assert peer_identity(peer, imgs.local) == identity.inspect(imgs.big).digest
    finally:
        imgs.set_local(imgs.v1)
        reset(peer)
