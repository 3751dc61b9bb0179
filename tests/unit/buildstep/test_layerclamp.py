"""layerclamp: a stage's own layers get no file time later than its SOURCE_DATE_EPOCH, and
nothing else in them changes (issue 9, item 2: the same key gives the same bytes)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile

import pytest
import zstandard

from imagebuild.buildstep import layerclamp
from imagebuild.buildstep.stagestore import StageStore
from imagebuild.core.errors import OperationFailed

EPOCH = 1_700_000_000
LATER = EPOCH + 123_456
EARLIER = EPOCH - 1000


def _tar(fmt: int, mtime: float, *, extra: bool = True) -> bytes:
    """A layer-like tar: folders, files, links, a long name, a whiteout, an xattr (PAX)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        def add(name, kind=tarfile.REGTYPE, data=b"", **kw):
            ti = tarfile.TarInfo(name)
            ti.type, ti.mtime, ti.mode, ti.uid, ti.gid = kind, kw.pop("mtime", mtime), 0o755, 1000, 1000
            for k, v in kw.items():
                setattr(ti, k, v)
            ti.size = len(data) if kind == tarfile.REGTYPE else 0
            t.addfile(ti, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        add("data", tarfile.DIRTYPE)
        add("data/blob", data=bytes(range(256)) * 700 + b"x")  # not a multiple of 512
        add("data/old", data=b"kept as it was\n", mtime=EARLIER)
        add("data/link", tarfile.SYMTYPE, linkname="blob")
        add("data/hard", tarfile.LNKTYPE, linkname="data/blob")
        add("data/.wh.gone")
        if extra:
            add("data/" + "long-name-" * 15, data=b"long\n")
            if fmt == tarfile.PAX_FORMAT:
                add("data/xattr", data=b"x", pax_headers={"SCHILY.xattr.user.k": "v"})
    return buf.getvalue()


def _clamp(data: bytes, epoch: int = EPOCH) -> tuple[bytes, int]:
    out = io.BytesIO()
    n = layerclamp.clamp_tar(io.BytesIO(data), out.write, epoch)
    return out.getvalue(), n


def _members(data: bytes) -> list[dict]:
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        out = []
        for m in t.getmembers():
            f = t.extractfile(m) if m.isfile() else None
            out.append({"name": m.name, "type": m.type, "mode": m.mode, "uid": m.uid, "gid": m.gid,
                        "size": m.size, "link": m.linkname, "mtime": m.mtime, "data": f.read() if f else None,
                        "pax": {k: v for k, v in m.pax_headers.items() if k not in ("mtime", "atime", "ctime")}})
        return out


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("mtime", [LATER, LATER + 0.25])
def test_only_later_times_change(fmt, mtime):
    if fmt == tarfile.USTAR_FORMAT and mtime != int(mtime):
        mtime = int(mtime)
    raw = _tar(fmt, mtime, extra=fmt != tarfile.USTAR_FORMAT)
    out, n = _clamp(raw)
    before, after = _members(raw), _members(out)
    assert n > 0 and len(before) == len(after)
    for b, a in zip(before, after, strict=True):
        assert a["mtime"] == min(int(b["mtime"]), EPOCH) if b["mtime"] > EPOCH else a["mtime"] == b["mtime"]
        assert {k: v for k, v in a.items() if k != "mtime"} == {k: v for k, v in b.items() if k != "mtime"}
    assert max(m["mtime"] for m in after) == EPOCH
    if fmt != tarfile.PAX_FORMAT:  # only PAX records can change a length: the same blocks, two zero ones at the end
        with tarfile.open(fileobj=io.BytesIO(raw)) as t:
            t.getmembers()
            assert len(out) == t.offset + 1024
    assert _clamp(out) == (out, 0)  # nothing later left: the second pass changes nothing


def test_a_tar_without_later_times_passes_as_it_is():
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        raw = _tar(fmt, EARLIER + 0.5)
        out, n = _clamp(raw)
        assert n == 0 and out == raw[:len(out)] and raw[len(out):] == bytes(len(raw) - len(out))
        assert out.endswith(bytes(1024)) and not out.endswith(bytes(1536))  # exactly two zero blocks


def test_the_same_content_at_other_times_gives_the_same_bytes():
    """What a RUN step writes at two build times: the same bytes after clamping."""
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        a, _ = _clamp(_tar(fmt, LATER))
        b, _ = _clamp(_tar(fmt, LATER + 86400 * 30))
        assert a == b


def test_pax_time_records_are_clamped_and_lengths_stay_right():
    raw = _tar(tarfile.PAX_FORMAT, LATER + 0.123456789)
    assert b"mtime=" in raw
    out, _ = _clamp(raw)
    with tarfile.open(fileobj=io.BytesIO(out)) as t:
        for m in t.getmembers():
            if "mtime" in m.pax_headers:
                assert float(m.pax_headers["mtime"]) <= EPOCH
    assert layerclamp._pax_record(b"mtime", b"1") == b"11 mtime=1\n"
    assert layerclamp._pax_record(b"path", b"x" * 90) == b"99 path=" + b"x" * 90 + b"\n"
    assert layerclamp._pax_record(b"path", b"x" * 91) == b"101 path=" + b"x" * 91 + b"\n"  # not 100: 3 digits


def test_gnu_atime_ctime_and_base256_fields():
    raw = bytearray(_tar(tarfile.GNU_FORMAT, LATER, extra=False))
    # the first header: GNU atime and ctime later than the epoch, mtime in base-256
    raw[345:357] = b"%011o\0" % LATER
    raw[357:369] = b"%011o\0" % (LATER + 5)
    raw[136:148] = bytes([0x80]) + (LATER + 7).to_bytes(11, "big")
    layerclamp._set_checksum(raw_h := bytearray(raw[:512]))
    raw[:512] = raw_h
    out, n = _clamp(bytes(raw))
    assert n >= 1
    assert layerclamp._num(out[136:148]) == EPOCH
    assert layerclamp._num(out[345:357]) == EPOCH and layerclamp._num(out[357:369]) == EPOCH
    assert layerclamp._num(bytes([0xFF] * 11 + [0xFE])) == -2


@pytest.mark.parametrize("damage", ["truncated", "checksum", "pax"])
def test_what_is_not_a_tar_is_refused(damage):
    raw = bytearray(_tar(tarfile.PAX_FORMAT, LATER + 0.5))
    if damage == "truncated":
        raw = raw[:len(raw) // 2]
    elif damage == "checksum":
        raw[0] ^= 0x01
    else:  # the first PAX header's record length, made wrong (its checksum kept right)
        start = 512
        raw[start:start + 2] = b"99"
    with pytest.raises(layerclamp.TarError):
        _clamp(bytes(raw))


# --------------------------------------------------------------------------------------------- layout


def _put(d, data: bytes) -> str:
    h = hashlib.sha256(data).hexdigest()
    p = d / "blobs" / "sha256" / h
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return "sha256:" + h


def _two_frames(data: bytes) -> bytes:
    half = len(data) // 2
    return zstandard.ZstdCompressor().compress(data[:half]) + zstandard.ZstdCompressor().compress(data[half:])


def _layout(d, own_mtime: float, *, own: bytes | None = None, frames=None) -> tuple[StageStore, str, list[str]]:
    """An OCI layout as BuildKit leaves it: a gzip base layer (the parent's, times later than the
    epoch: never touched) and the stage's own zstd layer."""
    base_tar = _tar(tarfile.GNU_FORMAT, LATER, extra=False)
    own_tar = own if own is not None else _tar(tarfile.PAX_FORMAT, own_mtime)
    base = _put(d, gzip.compress(base_tar, mtime=0))
    mine = _put(d, (frames or zstandard.ZstdCompressor().compress)(own_tar))
    diff_ids = ["sha256:" + hashlib.sha256(t).hexdigest() for t in (base_tar, own_tar)]
    cfg = json.dumps({"architecture": "amd64", "os": "linux", "created": "2023-11-14T22:13:20Z",
                      "rootfs": {"type": "layers", "diff_ids": diff_ids}}, separators=(",", ":")).encode()
    c = _put(d, cfg)
    m = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": c, "size": len(cfg)},
                    "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": base,
                                "size": (d / "blobs/sha256" / base[7:]).stat().st_size},
                               {"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd", "digest": mine,
                                "size": (d / "blobs/sha256" / mine[7:]).stat().st_size}]},
                   separators=(",", ":")).encode()
    man = _put(d, m)
    (d / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": man, "size": len(m),
         "annotations": {"io.containerd.image.name": "s"}}]}))
    (d / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    return StageStore(d), man, diff_ids


def test_clamp_stage_rewrites_only_the_stages_own_layers(tmp_path):
    store, man, diff_ids = _layout(tmp_path / "a", LATER)
    before = {p.name for p in (tmp_path / "a/blobs/sha256").iterdir()}
    base_desc = store.read_json_blob(man)["layers"][0]
    done = layerclamp.clamp_stage(store, man, diff_ids[:1], EPOCH)
    assert done.manifest != man and done.layers == 1 and done.headers > 0
    assert store.complete(done.manifest)
    m = store.read_json_blob(done.manifest)
    new_ids = store.diff_ids(done.manifest)
    assert new_ids[0] == diff_ids[0] and new_ids[1] != diff_ids[1]  # the parent's layer as it was
    assert m["layers"][0] == base_desc
    assert m["layers"][1]["mediaType"] == layerclamp.LAYER_ZSTD
    tar = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(store.blob(m["layers"][1]["digest"]).read_bytes())).read()
    assert "sha256:" + hashlib.sha256(tar).hexdigest() == new_ids[1]
    assert max(x["mtime"] for x in _members(tar)) == EPOCH
    # the config is BuildKit's bytes but for the diff id
    cfg = store.config(done.manifest)
    assert cfg["created"] == "2023-11-14T22:13:20Z" and cfg["architecture"] == "amd64"
    # index.json names the new manifest; the replaced blobs are gone, nothing half-written is left
    idx = json.loads((tmp_path / "a/index.json").read_text())
    assert [e["digest"] for e in idx["manifests"]] == [done.manifest]
    after = {p.name for p in (tmp_path / "a/blobs/sha256").iterdir()}
    assert man[7:] not in after and not any(n.startswith(".") for n in after)
    assert len(after) == len(before)  # manifest, config, own layer replaced; base kept


def test_two_builds_at_other_times_give_the_same_manifest(tmp_path):
    s1, m1, ids1 = _layout(tmp_path / "a", LATER)
    s2, m2, ids2 = _layout(tmp_path / "b", LATER + 3600.5)
    assert m1 != m2
    assert layerclamp.clamp_stage(s1, m1, ids1[:1], EPOCH).manifest == \
        layerclamp.clamp_stage(s2, m2, ids2[:1], EPOCH).manifest


def test_a_layer_of_several_zstd_frames_is_read_whole(tmp_path):
    s1, m1, ids1 = _layout(tmp_path / "a", LATER)
    s2, m2, ids2 = _layout(tmp_path / "b", LATER, frames=_two_frames)
    assert m1 != m2  # other blobs, the same content
    assert layerclamp.clamp_stage(s1, m1, ids1[:1], EPOCH).manifest == \
        layerclamp.clamp_stage(s2, m2, ids2[:1], EPOCH).manifest


def test_zstd_bytes_do_not_depend_on_the_number_of_workers(tmp_path, monkeypatch):
    out = []
    for n in (1, 3):
        monkeypatch.setattr(layerclamp, "workers", lambda n=n: n)
        s, m, ids = _layout(tmp_path / f"w{n}", LATER, own=_tar(tarfile.PAX_FORMAT, LATER) * 3)
        out.append(layerclamp.clamp_stage(s, m, ids[:1], EPOCH).manifest)
    assert out[0] == out[1]


def test_nothing_later_keeps_the_manifest_and_writes_nothing(tmp_path):
    store, man, ids = _layout(tmp_path / "a", EARLIER)
    before = sorted(p.name for p in (tmp_path / "a").rglob("*"))
    done = layerclamp.clamp_stage(store, man, ids[:1], EPOCH)
    assert done.manifest == man and done.layers == 0
    assert sorted(p.name for p in (tmp_path / "a").rglob("*")) == before


def test_without_the_parents_layers_every_layer_is_the_stages_own(tmp_path):
    store, man, ids = _layout(tmp_path / "a", LATER)
    done = layerclamp.clamp_stage(store, man, [], EPOCH)  # FROM scratch: the base layer is its own too
    assert done.layers == 2 and store.diff_ids(done.manifest)[0] != ids[0]


def test_a_blob_that_is_not_what_the_config_says_is_refused(tmp_path):
    store, man, ids = _layout(tmp_path / "a", LATER)
    m = store.read_json_blob(man)
    p = store.blob(m["layers"][1]["digest"])
    p.write_bytes(zstandard.ZstdCompressor().compress(_tar(tarfile.PAX_FORMAT, LATER + 1, extra=False)))
    before = sorted(x.name for x in (tmp_path / "a").rglob("*"))
    with pytest.raises(OperationFailed, match="the image config says"):
        layerclamp.clamp_stage(store, man, ids[:1], EPOCH)
    assert sorted(x.name for x in (tmp_path / "a").rglob("*")) == before
    p.write_bytes(b"not zstd at all")
    with pytest.raises(OperationFailed, match="cannot be read as a tar"):
        layerclamp.clamp_stage(store, man, ids[:1], EPOCH)
    assert sorted(x.name for x in (tmp_path / "a").rglob("*")) == before


def test_stale_temp_blobs_are_removed(tmp_path):
    store, _, _ = _layout(tmp_path / "a", LATER)
    stale = tmp_path / "a/blobs/sha256" / f"{layerclamp.TMP_PREFIX}123-456.tmp"
    stale.write_bytes(b"half")
    assert layerclamp.remove_stale_tmp(store) == [stale] and not stale.exists()
