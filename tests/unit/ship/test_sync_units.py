"""sync's pure parts: agent output parsing, chain ids, names, peer lists, the gc plan, the report."""

from __future__ import annotations

import gzip
import json

import pytest

from imagebuild.core import config
from imagebuild.core.errors import DefinitionError, UsageError
from imagebuild.ship import localblobs, peer, peergc, sync


def test_chain_ids_follow_the_oci_rule():
    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    import hashlib

    assert peer.chain_ids([a]) == [a]
    assert peer.chain_ids([a, b]) == [a, "sha256:" + hashlib.sha256(f"{a} {b}".encode()).hexdigest()]
    # the same layer on another base is another chain
    assert peer.chain_ids([b, b])[1] != peer.chain_ids([a, b])[1]


def test_parse_sections_and_errors():
    text = "@@meta\ncache /c\n@@info\n{\"x\": 1}\n@@rc 0\n@@error busy the lock is held\n"
    sections, err = peer.parse_sections(text)
    assert sections["meta"] == "cache /c"
    assert sections["info"].splitlines() == ['{"x": 1}', "@@rc 0"]
    assert err == ("busy", "the lock is held")
    assert sync._rc(sections["info"]) == 0


def test_probe_parsing_of_a_peer_without_docker():
    res = peer.AgentResult("h", 0, "", {"meta": "cache /c\ntool rsync /usr/bin/rsync"}, 0)
    st = peer.parse_probe("h", res)
    assert st.docker_error and "docker: command not found" in st.docker_error
    assert st.cache == "/c"


def test_known_blobs_only_of_images_still_there():
    st = peer.PeerState("h")
    st.images = [peer.PeerImage("sha256:1", [], [])]
    st.records = [{"image_id": "sha256:1", "blobs": ["sha256:x"]}, {"image_id": "sha256:gone", "blobs": ["sha256:y"]}]
    assert st.known_blobs() == {"sha256:x"}


@pytest.mark.parametrize("ref,prev", [("glm53:local", "glm53:previous"), ("reg:5000/a/b:local", "reg:5000/a/b:previous"),
                                      ("glm53:candidate", None), ("glm53@sha256:" + "0" * 64, None)])
def test_previous_ref(ref, prev):
    assert sync.previous_ref(ref) == prev


def test_staging_ref_is_our_own_name():
    assert sync.staging_ref("sha256:" + "ab" * 32).startswith("imagebuild-incoming:abab")


def test_resolve_image(tmp_path):
    (tmp_path / "docker-images" / "one").mkdir(parents=True)
    (tmp_path / "docker-images" / "one" / "image.yaml").write_text("stages: []\n")
    assert sync.resolve_image(tmp_path, None, None) == ("one", "one:local")
    assert sync.resolve_image(tmp_path, "one", None) == ("one", "one:local")
    assert sync.resolve_image(tmp_path, "one:b-123", None) == ("one", "one:b-123")
    assert sync.resolve_image(tmp_path, "other/x:tag", None) == (None, "other/x:tag")
    with pytest.raises(DefinitionError, match="image definition 'two' has 1 problem"):
        sync.resolve_image(tmp_path, "two", None)
    (tmp_path / "docker-images" / "two").mkdir()
    (tmp_path / "docker-images" / "two" / "image.yaml").write_text("stages: []\n")
    with pytest.raises(UsageError, match="which image"):
        sync.resolve_image(tmp_path, None, None)


def test_peer_lists_from_the_config(tmp_path):
    (tmp_path / "imagebuild.yaml").write_text("peers: [dgx4]\npeer_lists:\n  rack2: [dgx5, root@dgx6]\n")
    assert sync.resolve_peers(tmp_path, []) == ["dgx4"]
    assert sync.resolve_peers(tmp_path, ["@rack2", "dgx4", "dgx5"]) == ["dgx5", "root@dgx6", "dgx4"]
    with pytest.raises(UsageError, match="no peer list '@rack9'"):
        sync.resolve_peers(tmp_path, ["@rack9"])
    (tmp_path / "imagebuild.yaml").write_text("peer_lists:\n  rack2: dgx5\n")
    with pytest.raises(DefinitionError) as exc:
        config.load(tmp_path)
    assert "peer_lists.rack2" in exc.value.render()
    (tmp_path / "imagebuild.yaml").write_text("")
    with pytest.raises(UsageError, match="no peer to sync to"):
        sync.resolve_peers(tmp_path, [])


def test_unpacked_estimate_reads_the_gzip_trailer(tmp_path):
    data = b"hello world\n" * 100000
    p = tmp_path / "blob"
    p.write_bytes(gzip.compress(data))
    layer = localblobs.Layer("sha256:" + "0" * 64, p.stat().st_size, "application/vnd.oci.image.layer.v1.tar+gzip",
                             "", "")
    assert localblobs.unpacked_estimate(layer, p) == len(data)
    plain = localblobs.Layer("sha256:" + "0" * 64, 1234, "application/vnd.oci.image.layer.v1.tar", "", "")
    assert localblobs.unpacked_estimate(plain, None) == 1234
    unknown = localblobs.Layer("sha256:" + "0" * 64, 1000, "application/vnd.oci.image.layer.v1.tar+zstd", "", "")
    assert localblobs.unpacked_estimate(unknown, None) == 3000


def test_report_schema_and_exit_codes():
    ok = sync.PeerResult("a", "synced", 10, 1.0, "m", "sha256:x")
    ref = sync.PeerResult("b", "refused", 0, 0.1, "disk", None)
    bad = sync.PeerResult("c", "failed", 0, 0.1, "unreachable", None)
    r = sync.SyncReport("img", "img:local", "sha256:x", [ok, ref])
    d = r.as_dict()
    assert d["schema"] == "imagebuild.sync" and d["version"] == 1 and d["ok"] is False
    assert d["have_image"] == ["a"] and r.exit_code == 3
    assert sync.SyncReport("img", "img:local", "sha256:x", [ok, ref, bad]).exit_code == 1
    assert sync.SyncReport("img", "img:local", "sha256:x", [ok]).exit_code == 0
    text = sync.render(r)
    assert "refused" in text and "the image is on: a" in text
    json.dumps(d)


def _gc_listing(now: int, lease_created: str, lease_labels: str) -> peer.AgentResult:
    pend_old = json.dumps({"run": "old", "ref": "x:local", "identity": "sha256:" + "1" * 64,
                           "blobs": ["sha256:" + "a" * 64]})
    pend_new = json.dumps({"run": "new", "ref": "x:local", "identity": "sha256:" + "2" * 64,
                           "blobs": ["sha256:" + "b" * 64]})
    attempt = json.dumps({"run": "old", "started": now - 100, "finished": None, "status": "running"})
    text = "\n".join([
        "@@meta", "cache /c", f"now {now}",
        "@@incoming", f"10 {now} /c/incoming/{'a' * 64}", f"20 {now} /c/incoming/{'b' * 64}",
        f"5 {now} /c/incoming/.{'c' * 64}.XyZ12",
        "@@stage", "8 /c/stage/old",
        "@@tmp",
        "@@pending", f"{now - 90000} {pend_old}", f"{now - 60} {pend_new}",
        "@@records",
        "@@attempts", f"{now - 100} {attempt}",
        "@@receipts",
        "@@images", f"sha256:9\t[\"imagebuild-incoming:{'1' * 24}\"]\t[]",
        f"sha256:8\t[\"imagebuild-incoming:{'2' * 24}\"]\t[]",
        "@@containerd", "overlayfs\t{}\t/d",
        "@@leases", "address /run/c.sock", "ID CREATED AT LABELS",
        f"123-abcd {lease_created} {lease_labels}",
        "@@end"])
    sections, _ = peer.parse_sections(text)
    return peer.AgentResult("h", 0, text, sections, 0)


def test_gc_plan_keeps_a_young_pending_sync_and_removes_the_rest():
    import time
    from datetime import UTC, datetime

    now = int(time.time())
    created = datetime.fromtimestamp(now - 50, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    g = peergc.plan("h", _gc_listing(now, created, "containerd.io/gc.expire=2030-01-01T00:00:00Z"), keep=5)
    removed = {(a.kind, a.what) for a in g.remove}
    assert ("incoming", f"/c/incoming/{'a' * 64}") in removed  # its sync is a day old
    assert not any(w.endswith("b" * 64) for _, w in removed)  # the young pending sync resumes it
    assert ("incoming", f"/c/incoming/.{'c' * 64}.XyZ12") in removed  # a partial nobody resumes
    assert ("stage", "/c/stage/old") in removed
    assert ("pending", "/c/pending/old.json") in removed
    assert ("staging-image", f"imagebuild-incoming:{'1' * 24}") in removed
    assert ("staging-image", f"imagebuild-incoming:{'2' * 24}") not in removed
    assert ("lease", "123-abcd") in removed
    assert any("pending sync new" in k for k in g.kept)


def test_gc_plan_never_touches_other_leases():
    import time
    from datetime import UTC, datetime

    now = int(time.time())
    long_ago = datetime.fromtimestamp(now - 5000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    g = peergc.plan("h", _gc_listing(now, long_ago, "containerd.io/gc.expire=2030-01-01T00:00:00Z"), keep=5)
    assert not [a for a in g.remove if a.kind == "lease"]  # created outside every load attempt of ours
    created = datetime.fromtimestamp(now - 50, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    g = peergc.plan("h", _gc_listing(now, created, "buildkit/lease.temporary=x,containerd.io/gc.expire=y"), keep=5)
    assert not [a for a in g.remove if a.kind == "lease"]  # BuildKit's


GIB = 1 << 30


def _wrapped_gzip_layer(tmp_path, compressed: int, real: int):
    """A layer that says it is ``compressed`` bytes of gzip (metadata) over a small file whose gzip
    trailer holds ``real`` modulo 4 GiB, as the real multi-GB layer's does (nothing of 4 GiB written)."""
    p = tmp_path / "blob"
    body = gzip.compress(b"x" * 1000)
    p.write_bytes(body[:-4] + (real % (1 << 32)).to_bytes(4, "little"))
    diff = "sha256:" + "d" * 64
    return localblobs.Layer("sha256:" + "1" * 64, compressed, "application/vnd.oci.image.layer.v1.tar+gzip",
                            diff, diff), p


def test_a_wrapped_gzip_trailer_is_not_taken_for_the_size(tmp_path):
    # 7.0 GiB unpacked, 2.5 GiB compressed: the trailer says 3.0 GiB
    layer, p = _wrapped_gzip_layer(tmp_path, int(2.5 * GIB), 7 * GIB)
    assert localblobs.unpacked_estimate(layer, p) >= 7 * GIB
    # the engine's own figure wins when known
    assert localblobs.unpacked_estimate(layer, p, 7 * GIB) == 7 * GIB
    # a trailer below the compressed size has wrapped at least once
    layer, p = _wrapped_gzip_layer(tmp_path, int(4.5 * GIB), 5 * GIB)
    assert localblobs.unpacked_estimate(layer, p) >= 5 * GIB


def test_the_disk_guard_counts_a_layer_over_4_gib_whole(tmp_path):
    from imagebuild.core.errors import GuardRefused

    layer, p = _wrapped_gzip_layer(tmp_path, int(2.5 * GIB), 7 * GIB)
    img = localblobs.LocalImage("x:local", {}, None, None, "sha256:" + "c" * 64, [layer], {}, {layer.digest: p},
                                "content-store")
    img.unpacked = {layer.diff_id: 7 * GIB}  # what `docker history` of the engine says (unpacked_sizes)
    st = peer.PeerState("h", cache="/c")
    st.df_cache = st.df_docker = peer.DiskFree(int(9.5 * GIB), "/", "")
    w = sync._PeerSync.__new__(sync._PeerSync)
    w.s, w.host = type("S", (), {"img": img})(), "h"
    # 2.5 GiB sent + 2.5 GiB loaded + 7 GiB unpacked + 1 GiB free is more than 9.5 GiB (with 3 GiB it was not)
    with pytest.raises(GuardRefused, match="not enough disk on h"):
        w._check_disk(st, [layer], layer.size)


def test_what_a_pull_fetched_comes_from_its_own_lines():
    from imagebuild.ship import registry_sync

    a, b, c = ("sha256:" + x * 64 for x in "abc")
    blobs = {a: 1000, b: 2000, c: 30}
    out = (f"{a[7:19]}: Already exists\n{b[7:19]}: Pulling fs layer\n{b[7:19]}: Download complete\n"
           f"{b[7:19]}: Pull complete\nDigest: sha256:{'d' * 64}\nStatus: Downloaded newer image\n")
    assert registry_sync.pulled_blobs(out, blobs) == {b: 2000}
    assert registry_sync.pulled_blobs(f"{a[7:19]}: Already exists\n", blobs) == {}
    assert registry_sync.pulled_blobs("Status: Image is up to date\n", blobs) is None


def test_build_times_compare_across_formats():
    assert sync._when("2026-12-01T10:04:03.700886158Z") > sync._when("2026-12-01T10:04:03.321324506Z")
    assert sync._when("2026-12-01T10:04:03Z") == sync._when("2026-12-01T12:04:03+02:00")
    assert sync._when("1980-01-01T00:00:00Z") < sync._when("2026-12-01T10:04:03Z")
    assert sync._when("yesterday") is None and sync._when(None) is None


def test_the_sync_bounds_from_the_environment(monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_SYNC_TIMEOUT", "20")
    assert sync.step_timeout() == 20 and sync.load_timeout(10 ** 12) == 20
    monkeypatch.delenv("IMAGEBUILD_SYNC_TIMEOUT")
    assert sync.step_timeout() == sync.STEP_TIMEOUT_S
    assert sync.load_timeout(20_000_000_000) == sync.LOAD_BASE_S + 2000  # 600 s + 1 s per 10 MB
    for bad in ("abc", "-1", "0"):
        monkeypatch.setenv("IMAGEBUILD_SYNC_TIMEOUT", bad)
        with pytest.raises(UsageError, match="IMAGEBUILD_SYNC_TIMEOUT"):
            sync.sync(None, ["dgx4"], ref="x:local")
    monkeypatch.delenv("IMAGEBUILD_SYNC_TIMEOUT")
    monkeypatch.setenv("IMAGEBUILD_SYNC_HEARTBEAT", "0")
    assert sync.heartbeat_every() == 0


def test_the_older_build_rule_compares_like_with_like():
    from imagebuild.core.errors import GuardRefused

    def worker(built, created):
        w = sync._PeerSync.__new__(sync._PeerSync)
        img = type("I", (), {"data": {"Created": created}})()
        w.s = type("S", (), {"built": built, "img": img, "ref": "x:local", "force": False, "image": "x"})()
        w.host, w.res = "h", sync.PeerResult("h", "failed", 0, 0.0, "", None)
        return w

    def peer_with(built, created):
        st = peer.PeerState("h")
        st.target = {"Id": "sha256:" + "e" * 64, "Created": created, "RootFS": {"Layers": []}, "Config": {}}
        st.records = [{"image_id": "sha256:" + "e" * 64, "built": built}]
        return st

    pinned = "1980-01-01T00:00:00Z"  # a reproducible build's Created
    # both have build records: the records decide
    with pytest.raises(GuardRefused, match="newer build"):
        worker("2026-12-01T09:00:00Z", pinned)._check_not_older(peer_with("2026-12-01T10:00:00Z", pinned))
    worker("2026-12-01T11:00:00Z", pinned)._check_not_older(peer_with("2026-12-01T10:00:00Z", pinned))
    # no record here (built on another node): the creation times, equal for reproducible builds: no refusal
    worker(None, pinned)._check_not_older(peer_with("2026-12-01T10:00:00Z", pinned))
    with pytest.raises(GuardRefused):
        worker(None, "2026-12-01T09:00:00Z")._check_not_older(peer_with(None, "2026-12-01T10:00:00Z"))


def test_gc_plan_treats_an_images_partial_folder_like_incoming():
    import time

    now = int(time.time())
    res = _gc_listing(now, "2030-01-01T00:00:00Z", "x=y")
    lock = "0" * 24
    text = res.text.replace("@@stage", f"12 {now} /c/partial/{lock}/{'b' * 64}\n"
                                        f"13 {now} /c/partial/{lock}/{'d' * 64}\n@@stage")
    sections, _ = peer.parse_sections(text)
    g = peergc.plan("h", peer.AgentResult("h", 0, text, sections, 0), keep=5)
    removed = {a.what: a.op for a in g.remove if a.kind == "incoming"}
    assert f"/c/partial/{lock}/{'b' * 64}" not in removed  # the young pending sync resumes it
    assert removed[f"/c/partial/{lock}/{'d' * 64}"] == f"rmblob /c/partial/{lock}/{'d' * 64} {'d' * 64}"


def test_probe_counts_the_images_partial_blobs_as_there_for_the_resume():
    text = "\n".join(["@@meta", "cache /c", "tool docker /usr/bin/docker",
                      "@@info", json.dumps({"ServerVersion": "28.5.2", "Driver": "overlayfs"}),
                      "@@incoming", f"100 1 /c/incoming/{'a' * 64}",
                      "@@partial", f"40 1 /c/partial/{'0' * 24}/{'b' * 64}", f"7 1 /c/partial/{'0' * 24}/{'a' * 64}",
                      "@@end"])
    sections, _ = peer.parse_sections(text)
    st = peer.parse_probe("h", peer.AgentResult("h", 0, text, sections, 0))
    assert st.incoming == {"a" * 64: 100, "b" * 64: 40}


@pytest.mark.parametrize("size", [0, 1, 511, 512, 513, 300_000_000, (8 << 30) - 1, 8 << 30, 9 << 30])
def test_a_blob_tar_header_reads_back_as_the_blob_with_its_exact_size(size, tmp_path):
    """The streamed load's tar (ib_stream_tar) is each header, the blob's bytes and zeros to 512: GNU tar and
    Python's tarfile read the entry back with the blob's name and size (sizes of 8 GiB and more through
    a pax header), owned by nobody, mode 0644, time 0; a sparse file stands in for the bytes."""
    import subprocess
    import tarfile

    from imagebuild.ship.sync import blob_tar_header

    hexname = "ab" * 32
    hdr = blob_tar_header(hexname, size)
    assert len(hdr) % 512 == 0 and len(hdr) == (512 if size < 8 << 30 else 1536)
    t = tmp_path / "x.tar"
    with open(t, "wb") as f:
        f.write(hdr)
        f.truncate(len(hdr) + size + (-size % 512) + 1024)  # the bytes (zeros here), the padding, the end
    with tarfile.open(t) as tf:
        (m,) = tf.getmembers()
    assert (m.name, m.size, m.mode, m.mtime, m.uid, m.gid, m.uname, m.gname) == \
        (f"blobs/sha256/{hexname}", size, 0o644, 0, 0, 0, "", "")
    assert m.isreg()
    listed = subprocess.run(["tar", "-tvf", str(t)], capture_output=True, text=True, check=True).stdout.split()
    assert listed[2] == str(size) and listed[-1] == f"blobs/sha256/{hexname}"


def test_the_progress_line_gives_the_rate_in_binary_units_and_the_time_left_at_it():
    from imagebuild.ship.sync import _rate_and_eta

    assert _rate_and_eta(300 << 20, 900 << 20, 1.0) == ("300.0 MiB/s", "0:00:02")
    assert _rate_and_eta(1 << 30, 1 << 30, 4.0) == ("256.0 MiB/s", "0:00:00")
    assert _rate_and_eta(0, 10, 0.0) == ("0 B/s", "0:00:00")
    assert _rate_and_eta(1 << 20, (1 << 20) * 7201, 1.0)[1] == "2:00:00"


def test_the_load_streams_only_where_the_peers_dd_reads_by_byte_offsets(monkeypatch):
    """A containerd peer whose probe says dd-bytes (GNU dd) gets the streamed load; one without it (a
    BusyBox dd) the present path; the agent's own check runs on this machine's dd."""
    import subprocess

    from imagebuild.ship import peer_agent

    la = localblobs.Layer("sha256:" + "a" * 64, 100, "application/vnd.oci.image.layer.v1.tar+gzip",
                          "sha256:" + "b" * 64, "sha256:" + "b" * 64)
    for meta, want in (("cache /c\ndd-bytes yes", True), ("cache /c", False)):
        st = peer.parse_probe("h", peer.AgentResult("h", 0, "", {"meta": meta}, 0))
        st.containerd_store = True
        assert st.dd_bytes is want
        assert sync._PeerSync._can_stream(object.__new__(sync._PeerSync), st, [la], set()) is want
    monkeypatch.setenv("IMAGEBUILD_SYNC_STREAM", "0")
    assert not sync._PeerSync._can_stream(object.__new__(sync._PeerSync), st, [la], set())
    line = next(ln for ln in peer_agent.AGENT.splitlines() if "dd-bytes yes" in ln)
    assert subprocess.run(["sh", "-c", line], capture_output=True, text=True).stdout == "dd-bytes yes\n"


def test_an_image_name_where_a_peer_goes_is_said(tmp_path):
    """`imagebuild sync hce4-slow` with hce4-slow a definition: exit 2 naming the right form; a peer of
    imagebuild.yaml with that name, or any other word, is a peer."""
    for name in ("hce4-slow", "other"):
        (tmp_path / "docker-images" / name).mkdir(parents=True)
        (tmp_path / "docker-images" / name / "image.yaml").write_text("stages: []\n")
    with pytest.raises(UsageError, match="'hce4-slow' is an image of this project") as exc:
        sync.image_named_as_peer(tmp_path, ["hce4-slow"])
    assert exc.value.hint == "imagebuild sync --image hce4-slow PEER"
    with pytest.raises(UsageError) as exc:
        sync.image_named_as_peer(tmp_path, ["dgx4", "hce4-slow"])
    assert exc.value.hint == "imagebuild sync --image hce4-slow dgx4"
    sync.image_named_as_peer(tmp_path, ["dgx4", "root@dgx5"])  # peers
    (tmp_path / "imagebuild.yaml").write_text("peers: [dgx4]\npeer_lists:\n  odd: [hce4-slow]\n")
    sync.image_named_as_peer(tmp_path, ["hce4-slow"])  # a configured peer of that name is a peer
    with pytest.raises(UsageError) as exc:
        sync.image_named_as_peer(tmp_path, ["other"])
    assert exc.value.hint == "imagebuild sync --image other (the peers of imagebuild.yaml)"
    sync.image_named_as_peer(None, ["hce4-slow"])  # outside a project: nothing to compare with
