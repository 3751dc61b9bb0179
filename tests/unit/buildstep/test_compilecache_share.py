"""The compiler cache's registry image (buildstep/compilecache_share.py), without a registry: the tag of a
cache id, the deterministic layer, and the safe extraction (regular files under plain relative names,
bounded; anything else refused with nothing left behind)."""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from pathlib import Path

import pytest

from imagebuild.buildstep import compilecache as cc
from imagebuild.buildstep import compilecache_share as share
from imagebuild.buildstep.registry_cache import Refused

TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def _tree(top: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_bytes(data)


def _read(top: Path) -> dict[str, bytes]:
    return {p.relative_to(top).as_posix(): p.read_bytes() for p in sorted(top.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("cache_id", ["glm53-vllm-ccache", "a", "x" * 128, "A.b_c-" + "9" * 122])
def test_the_tag_follows_the_tag_grammar(cache_id):
    tag = share.tag_of(cache_id)
    assert TAG_RE.match(tag), tag
    if len(cache_id) <= 121:
        assert tag == "ccache-" + cache_id
    else:  # cut, with a hash of the whole id: two long ids that share a beginning differ
        assert tag != share.tag_of(cache_id[:-1] + "z")


def test_the_layer_is_deterministic_and_leaves_imagebuilds_own_files_out(tmp_path):
    files = {"0/1/abcR": b"result", "0/1/abcM": b"manifest", "0/stats": b"counters", "ccache.conf": b""}
    own = {name: b"bookkeeping" for name in share.OWN_FILES}
    a, b = tmp_path / "a", tmp_path / "b"
    _tree(a, {**files, **own})
    _tree(b, dict(reversed(list(files.items()))))  # another order of creation, other times, no own files
    os.utime(b / "0/stats", (1, 1))
    (a / "link").symlink_to("0/stats")  # never travels
    da, sa, na = share.write_layer(a, tmp_path / "a.tar")
    db, sb, nb = share.write_layer(b, tmp_path / "b.tar")
    assert (da, sa, na) == (db, sb, nb) and na == 4
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
    with tarfile.open(tmp_path / "a.tar") as t:
        ms = t.getmembers()
    assert [m.name for m in ms] == sorted(files)
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in ms} == {(0, 0, 0, "", "", 0o644)}
    # and it extracts to the same files
    assert share.extract(tmp_path / "a.tar", tmp_path / "out") == (4, sum(len(v) for v in files.values()))
    assert _read(tmp_path / "out") == files


def test_the_layout_is_one_image_labelled_with_the_cache_id(tmp_path):
    _tree(tmp_path / "c", {"0/xR": b"1"})
    digest, size, files = share.write_layout(tmp_path / "c", tmp_path / "oci", "my-cache", "linux/arm64")
    blobs = tmp_path / "oci" / "blobs" / "sha256"
    man = json.loads((blobs / digest.split(":")[1]).read_bytes())
    cfg = json.loads((blobs / man["config"]["digest"].split(":")[1]).read_bytes())
    assert cfg["config"]["Labels"] == {share.LABEL: "my-cache"}
    assert (cfg["os"], cfg["architecture"]) == ("linux", "arm64")
    assert [ly["size"] for ly in man["layers"]] == [size] and files == 1
    assert json.loads((tmp_path / "oci" / "index.json").read_text())["manifests"][0]["digest"] == digest


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as t:
        for ti, data in members:
            if ti.isreg():
                ti.size = len(data)
                t.addfile(ti, io.BytesIO(data))
            else:
                t.addfile(ti)
    return path


def _reg(name: str) -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), b"ok"


def _sym(name: str, target: str) -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname = tarfile.SYMTYPE, target
    return ti, b""


def _dev(name: str) -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.type = tarfile.CHRTYPE
    return ti, b""


def _hard(name: str, target: str) -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname = tarfile.LNKTYPE, target
    return ti, b""


@pytest.mark.parametrize("members, why", [
    ([_reg("0/aR"), _reg("../escaped")], "plain relative names"),
    ([_reg("0/../../escaped")], "plain relative names"),
    ([_reg("/etc/escaped")], "plain relative names"),
    ([_reg("0/aR"), _sym("0/link", "/etc/passwd")], "a symlink"),
    ([_sym("0", "/tmp"), _reg("0/aR")], "a symlink"),
    ([_hard("0/h", "/etc/passwd")], "a hard link"),
    ([_dev("0/null")], "a device"),
    ([_reg("0/aR"), _reg("0/aR")], "twice"),
    ([_reg(cc.GENERATION_FILE)], "imagebuild's own"),
])
def test_extraction_refuses_and_leaves_nothing(tmp_path, members, why):
    layer = _tar(tmp_path / "bad.tar", members)
    out = tmp_path / "files"
    with pytest.raises(Refused, match=re.escape(why)):
        share.extract(layer, out)
    # the caller removes the folder it gave; outside it nothing was written
    assert not (tmp_path / "escaped").exists() and not (tmp_path.parent / "escaped").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.tar", "files"]


def test_extraction_is_bounded(tmp_path):
    big = tarfile.TarInfo("0/bigR")
    layer = _tar(tmp_path / "big.tar", [(big, b"x" * 4096)])
    with pytest.raises(Refused, match="the bound"):
        share.extract(layer, tmp_path / "a", max_bytes=4095)
    assert not any((tmp_path / "a").rglob("*R"))  # refused before it was written
    many = _tar(tmp_path / "many.tar", [_reg(f"0/{i}R") for i in range(5)])
    with pytest.raises(Refused, match="the bound"):
        share.extract(many, tmp_path / "b", max_files=4)
    assert share.extract(many, tmp_path / "c", max_files=5) == (5, 10)


def test_a_truncated_layer_is_refused(tmp_path):
    layer = _tar(tmp_path / "t.tar", [(tarfile.TarInfo("0/aR"), b"y" * 100_000)])
    data = layer.read_bytes()
    layer.write_bytes(data[:2048])
    with pytest.raises(Refused):
        share.extract(layer, tmp_path / "files")


def test_pulling_leaves_the_host_copy_alone_when_it_exists(tmp_path, monkeypatch):
    monkeypatch.setenv(cc.ENV_DIR, str(tmp_path / "host"))
    _tree(cc.host_dir("x"), {"0/aR": b"local"})
    assert not share.host_empty("x") and share.host_empty("y")
    (cc.host_dir("y")).mkdir()
    assert share.host_empty("y")

    class Down:  # never asked: a host copy that exists wins before any registry call
        down = None
    assert share.pull(Down(), "x", "compile") is None


def test_the_stage_line_says_where_the_cache_came_from():
    stats = cc.parse_stats("direct_cache_hit\t4\ncache_miss\t0\ncache_size_kibibyte\t2048\n")
    assert "from the registry" not in cc.line({**stats, "seeded_from": "host"})
    line = cc.line({**stats, "seeded_from": "registry", "pulled": {"bytes": 1}})
    assert line.endswith("2 MiB; from the registry)") and "4 hits" in line
    from imagebuild.ops import report

    assert report.compilecache_line({**stats, "seeded_from": "registry"}) == line  # the report's line too


def test_verification_names_what_it_expected_and_found(tmp_path):
    import hashlib

    _tree(tmp_path / "c", {"0/xR": b"1"})
    digest, _size, _files = share.write_layout(tmp_path / "c", tmp_path / "oci", "mine", "linux/amd64")
    blobs = tmp_path / "oci" / "blobs" / "sha256"
    raw = (blobs / digest.split(":")[1]).read_bytes()
    man = json.loads(raw)
    descs = [man["config"], *man["layers"]]
    share._verify(blobs, raw, digest, descs, "mine", "linux/amd64")  # its own: accepted
    with pytest.raises(Refused, match="label io.imagebuild.compiler-cache is 'mine', expected 'yours'"):
        share._verify(blobs, raw, digest, descs, "yours", "linux/amd64")
    with pytest.raises(Refused, match="its platform is linux/amd64, the definition's is linux/arm64"):
        share._verify(blobs, raw, digest, descs, "mine", "linux/arm64")
    # a config that is JSON but no object, under its own right digest: refused, not a crash
    bad = b"[1, 2]"
    bad_digest = "sha256:" + hashlib.sha256(bad).hexdigest()
    (blobs / bad_digest.split(":")[1]).write_bytes(bad)
    with pytest.raises(Refused, match="not a JSON object"):
        share._verify(blobs, raw, digest, [{"digest": bad_digest, "size": len(bad)}, *man["layers"]], "mine",
                      "linux/amd64")
    # a layer whose bytes changed
    layer = blobs / man["layers"][0]["digest"].split(":")[1]
    layer.write_bytes(layer.read_bytes()[:-1] + b"x")
    with pytest.raises(Refused, match="its content was changed"):
        share._verify(blobs, raw, digest, descs, "mine", "linux/amd64")
