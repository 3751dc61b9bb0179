"""The blobs of a local image, read from where they already are on this host (for ``imagebuild sync``).

An image in the engine is a tree of content-addressed blobs: an index (maybe), a manifest, a config,
the compressed layers. Sync sends a peer only the layers it lacks, so it needs each blob as a file,
without exporting the whole image first. Where from, in order:

1. **The engine's containerd content store** (containerd image store): the blobs are files named by
   their digest (``<DockerRootDir>/containerd/daemon/io.containerd.content.v1.content/blobs/sha256/``,
   or ``/var/lib/containerd/...``; ``$IMAGEBUILD_CONTENT_STORE`` adds folders). Read only, and every
   byte that is sent is first checked against its digest (a file that does not match is never used).
   Why not the engine's API: ``docker save`` (and ``ctr content get``) stream content through
   containerd's gRPC API, measured at 20-35 MB/s on this machine class, while the files read at
   disk speed.
2. **``docker save``** (the classic store, or a content store this user may not read): streamed, each
   blob written once into the spool (``$XDG_CACHE_HOME/imagebuild/sync/spool/``, by digest, checked),
   so an interrupted sync does not save again, and a re-run of a spooled image does not save at all.

Nothing here changes the engine.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import struct
import tarfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from imagebuild.buildstep.stagestore import digest_hex as _hex
from imagebuild.core import engine as engine_mod
from imagebuild.core import fsutil, state
from imagebuild.core import identity as identity_mod
from imagebuild.core import run as run_mod
from imagebuild.core.errors import OperationFailed
from imagebuild.core.fsutil import atomic_write_json, canonical_json

log = logging.getLogger("imagebuild")

INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
INLINE_MAX = 1 << 20  # blobs up to this size that are not layers travel inside the load call
_CHUNK = 1 << 20
CONTENT_SUBDIR = "io.containerd.content.v1.content/blobs/sha256"


def cache_dir() -> Path:
    return state.cache_home() / "imagebuild" / "sync"


@dataclass(frozen=True)
class Blob:
    digest: str
    size: int
    media_type: str


@dataclass(frozen=True)
class Layer:
    digest: str
    size: int
    media_type: str
    diff_id: str
    chain_id: str

    @property
    def compressed(self) -> bool:
        return self.media_type.endswith(("+gzip", "+zstd", ".gzip", ".zstd")) or "gzip" in self.media_type \
            or "zstd" in self.media_type


@dataclass
class LocalImage:
    ref: str
    data: dict  # docker image inspect
    identity: identity_mod.ImageIdentity
    target: Blob  # what the peer's index.json points at
    config_digest: str
    layers: list[Layer]  # of the platform manifest, base first
    inline: dict[str, bytes]  # index, manifests, configs, small attestation blobs
    files: dict[str, Path]  # digest -> file, for every non-inline blob (layers first)
    source: str  # content-store | docker-save
    extra: list[Blob] = field(default_factory=list)  # large non-layer blobs (attestations), sent like layers
    unpacked: dict[str, int] | None = None  # diff id -> unpacked bytes (unpacked_sizes), once asked

    def blob_digests(self) -> list[str]:
        return [*self.inline, *(la.digest for la in self.layers), *(b.digest for b in self.extra)]

    def compressed_size(self) -> int:
        return sum(la.size for la in self.layers)

    def index_json(self, name: str) -> bytes:
        """The OCI layout's index.json for the peer's load: our target, named ``name``."""
        repo, _, tag = name.rpartition(":")
        full = repo if "/" in repo and "." in repo.split("/")[0] else f"docker.io/{'library/' if '/' not in repo else ''}{repo}"
        desc = {"mediaType": self.target.media_type, "digest": self.target.digest, "size": self.target.size,
                "annotations": {"io.containerd.image.name": f"{full}:{tag}", "org.opencontainers.image.ref.name": tag}}
        return json.dumps({"schemaVersion": 2, "mediaType": INDEX_TYPES[0], "manifests": [desc]}).encode()

    def manifest_json(self, name: str) -> bytes:
        """The docker-save manifest.json (what the classic store's load reads)."""
        return json.dumps([{"Config": f"blobs/sha256/{_hex(self.config_digest)}", "RepoTags": [name],
                            "Layers": [f"blobs/sha256/{_hex(la.digest)}" for la in self.layers]}]).encode()

    def inline_b64(self) -> dict[str, str]:
        return {d: base64.b64encode(b).decode() for d, b in self.inline.items()}


# --------------------------------------------------------------------------------------------- verification


class Verifier:
    """sha256 of local files, remembered by (path, inode, size, mtime) so that a file is hashed once."""

    def __init__(self, path: Path | None = None):
        self.path = path or cache_dir() / "verified.json"
        try:
            self.known = json.loads(fsutil.read_text(self.path))
        except (OSError, ValueError):
            self.known = {}
        self.dirty = False

    @staticmethod
    def _key(p: Path) -> str:
        st = p.stat()
        return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"

    def check(self, p: Path, digest: str) -> bool:
        try:
            key = self._key(p)
        except OSError:
            return False
        if self.known.get(str(p)) == [key, digest]:
            return True
        h = hashlib.sha256()
        try:
            with open(p, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
        except OSError:
            return False
        ok = "sha256:" + h.hexdigest() == digest
        if ok:
            self.known[str(p)] = [key, digest]
            self.dirty = True
        return ok

    def save(self) -> None:
        if self.dirty:
            # keep it small: only entries whose files still exist
            self.known = {k: v for k, v in self.known.items() if os.path.exists(k)}
            try:
                atomic_write_json(self.path, self.known)
            except OSError:
                pass
            self.dirty = False


# --------------------------------------------------------------------------------------------- where blobs are


def content_dirs(info: engine_mod.EngineInfo) -> list[Path]:
    """Folders where the engine's content store keeps blobs by digest (read only)."""
    out = [Path(p) for p in os.environ.get("IMAGEBUILD_CONTENT_STORE", "").split(os.pathsep) if p]
    if info.containerd_store:
        root = Path(info.root_dir or "/var/lib/docker")
        out += [root / "containerd" / "daemon" / CONTENT_SUBDIR, Path("/var/lib/containerd") / CONTENT_SUBDIR]
    return [d for d in dict.fromkeys(out) if os.access(d, os.R_OK | os.X_OK)]


def spool_dir() -> Path:
    return cache_dir() / "spool"


class _Finder:
    def __init__(self, dirs: list[Path], verifier: Verifier):
        self.dirs = dirs
        self.verifier = verifier

    def locate(self, digest: str, size: int | None = None) -> Path | None:
        h = _hex(digest)
        for d in self.dirs:
            p = d / h
            try:
                if p.is_file() and (size is None or p.stat().st_size == size):
                    return p
            except OSError:
                continue
        return None

    def read(self, digest: str) -> bytes | None:
        """A small blob's bytes, checked against its digest."""
        p = self.locate(digest)
        if p is None:
            return None
        try:
            data = fsutil.read_bytes(p)
        except OSError:
            return None
        return data if "sha256:" + hashlib.sha256(data).hexdigest() == digest else None


def _media_type(doc: dict, fallback: str | None = None) -> str:
    mt = doc.get("mediaType")
    if mt:
        return mt
    if fallback:
        return fallback
    return INDEX_TYPES[0] if "manifests" in doc else MANIFEST_TYPES[0]


def _platform_matches(p: dict, data: dict) -> bool:
    if not p:
        return False
    if p.get("os") != data.get("Os") or p.get("architecture") != data.get("Architecture"):
        return False
    want = data.get("Variant") or None
    return want is None or (p.get("variant") or None) == want


def _resolve(ref: str, data: dict, target_digest: str, finder: _Finder, source: str) -> LocalImage | None:
    """The image's blob tree from ``finder``; None when a blob is missing there."""
    raw = finder.read(target_digest)
    if raw is None:
        return None
    top = json.loads(raw)
    target = Blob(target_digest, len(raw), _media_type(top))
    inline: dict[str, bytes] = {target_digest: raw}
    extra: list[Blob] = []
    files: dict[str, Path] = {}
    if target.media_type in INDEX_TYPES:
        entries = top.get("manifests") or []
        is_att = [((e.get("annotations") or {}).get("vnd.docker.reference.type") == "attestation-manifest")
                  for e in entries]
        plat = [e for e, att in zip(entries, is_att, strict=True) if not att and _platform_matches(e.get("platform") or {}, data)]
        if not plat:
            plat = [e for e, att in zip(entries, is_att, strict=True) if not att]
        if not plat:
            return None
        chosen = plat[0]
        others = [e for e, att in zip(entries, is_att, strict=True) if not att and e is not chosen]
        keep_index = not others
        if keep_index:
            # attestation manifests travel too (small), so that the peer's index is the source's
            for e, att in zip(entries, is_att, strict=True):
                if not att:
                    continue
                mraw = finder.read(e["digest"])
                if mraw is None:
                    keep_index = False
                    break
                m = json.loads(mraw)
                blobs = [m.get("config") or {}, *(m.get("layers") or [])]
                got = {}
                for b in blobs:
                    if not b.get("digest"):
                        continue
                    if int(b.get("size") or 0) <= INLINE_MAX:
                        data_b = finder.read(b["digest"])
                        if data_b is None:
                            keep_index = False
                            break
                        got[b["digest"]] = data_b
                    else:
                        p = finder.locate(b["digest"], int(b["size"]))
                        if p is None:
                            keep_index = False
                            break
                        files[b["digest"]] = p
                        extra.append(Blob(b["digest"], int(b["size"]), b.get("mediaType", "")))
                if not keep_index:
                    break
                inline[e["digest"]] = mraw
                inline.update(got)
        if not keep_index:
            inline = {}
            extra, files = [], {}
        mraw = finder.read(chosen["digest"])
        if mraw is None:
            return None
        manifest = json.loads(mraw)
        mblob = Blob(chosen["digest"], len(mraw), _media_type(manifest, chosen.get("mediaType")))
        if not keep_index:
            target = mblob
        inline[chosen["digest"]] = mraw
    else:
        manifest = top
    cfg_desc = manifest.get("config") or {}
    cfg_digest = cfg_desc.get("digest")
    cfg_raw = finder.read(cfg_digest) if cfg_digest else None
    if cfg_raw is None:
        return None
    inline[cfg_digest] = cfg_raw
    config = json.loads(cfg_raw)
    diff_ids = list((config.get("rootfs") or {}).get("diff_ids") or [])
    descs = manifest.get("layers") or []
    if len(diff_ids) != len(descs):
        raise OperationFailed(f"{ref}: its manifest names {len(descs)} layers but its config {len(diff_ids)}")
    if diff_ids != list((data.get("RootFS") or {}).get("Layers") or []):
        raise OperationFailed(f"{ref}: the blobs found for it on this host ({source}) are not the image that "
                              "docker image inspect describes (diff ids differ)",
                              hint="rerun; if it persists, report it (IMAGEBUILD_SYNC_SOURCE=save forces docker save)")
    from imagebuild.ship.peer import chain_ids

    chains = chain_ids(diff_ids)
    layers = []
    for desc, diff, chain in zip(descs, diff_ids, chains, strict=True):
        p = finder.locate(desc["digest"], int(desc["size"]))
        if p is None:
            return None
        files[desc["digest"]] = p
        layers.append(Layer(desc["digest"], int(desc["size"]), desc.get("mediaType", ""), diff, chain))
    # layers first in ``files`` (the order rsync sends them in)
    ordered = {la.digest: files[la.digest] for la in layers}
    ordered.update({k: v for k, v in files.items() if k not in ordered})
    ident = identity_mod.from_inspect(data)
    return LocalImage(ref, data, ident, target, cfg_digest, layers, inline, ordered, source, extra)


# --------------------------------------------------------------------------------------------- docker save


def _spool_record(local_id: str) -> Path:
    return spool_dir() / "images" / f"{_hex(local_id) if local_id.startswith('sha256:') else local_id}.json"


def _save_to_spool(ref: str, local_id: str, verifier: Verifier) -> str:
    """``docker save ref`` into the spool (each blob once, checked); the target digest it names."""
    spool = spool_dir()
    spool.mkdir(parents=True, exist_ok=True)
    log.info("reading %s with docker save (the engine's content store is not readable here)", ref)
    proc = run_mod.popen(["docker", "save", ref], stdin=False, hint="is the Docker engine healthy?")
    index = None
    try:
        assert proc.stdout is not None
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tf:
            for m in tf:
                if m.name in ("index.json", "./index.json"):
                    f = tf.extractfile(m)
                    index = json.loads(f.read()) if f else None
                    continue
                name = m.name.removeprefix("./")
                if not (m.isfile() and name.startswith("blobs/sha256/")):
                    continue
                h = name.rsplit("/", 1)[1]
                dst = spool / h
                if dst.is_file() and dst.stat().st_size == m.size:
                    continue
                f = tf.extractfile(m)
                if f is None:
                    continue
                tmp = spool / f".{h}.{os.getpid()}.tmp"
                sha = hashlib.sha256()
                with open(tmp, "wb") as out:
                    while chunk := f.read(_CHUNK):
                        sha.update(chunk)
                        out.write(chunk)
                if sha.hexdigest() != h:
                    tmp.unlink(missing_ok=True)
                    raise OperationFailed(f"docker save {ref} gave blob {h[:12]} whose content does not match its name")
                os.replace(tmp, dst)
    finally:
        run_mod.check_popen(proc, hint="is the Docker engine healthy?")
    if not isinstance(index, dict) or not index.get("manifests"):
        raise OperationFailed(f"docker save {ref} wrote no OCI index.json (engine too old?)",
                              hint="sync needs Docker >= 25")
    top = index["manifests"][0]
    atomic_write_json(_spool_record(local_id), {"ref": ref, "target": top["digest"]})
    return top["digest"]


# --------------------------------------------------------------------------------------------- entry point


def load(ref: str, *, verifier: Verifier | None = None) -> LocalImage:
    """The blobs of ``ref`` in the local engine (see the module doc for where they are read from)."""
    verifier = verifier or Verifier()
    data = identity_mod.inspect_data(ref, hint=f"docker image ls; the image to sync must be in this engine ({ref})")
    mode = os.environ.get("IMAGEBUILD_SYNC_SOURCE", "auto")
    local_id = data.get("Id") or ""
    target = (data.get("Descriptor") or {}).get("digest") or local_id
    if mode != "save" and target.startswith("sha256:"):
        # the usual places first (no `docker info`, 0.1-0.2 s), then the engine's own root
        dirs = content_dirs(engine_mod.EngineInfo(True, containerd_store=True))
        img = _resolve(ref, data, target, _Finder(dirs, verifier), "content-store") if dirs else None
        if img is None:
            info = engine_mod.probe()
            more = [d for d in content_dirs(info) if d not in dirs] if info.containerd_store else []
            img = _resolve(ref, data, target, _Finder(more, verifier), "content-store") if more else None
            if img is None and info.containerd_store:
                log.info("%s: some blobs are not in the content store folders %s", ref,
                         ", ".join(map(str, dirs + more)) or "(none readable)")
        if img is not None:
            return img
    spool = _Finder([spool_dir()], verifier)
    rec = _spool_record(local_id) if local_id else None
    if rec is not None and rec.is_file():
        try:
            target = json.loads(fsutil.read_text(rec))["target"]
            img = _resolve(ref, data, target, spool, "docker-save")
            if img is not None:
                return img
        except (OSError, ValueError, KeyError):
            pass
    target = _save_to_spool(ref, local_id or ref, verifier)
    img = _resolve(ref, data, target, spool, "docker-save")
    if img is None:
        raise OperationFailed(f"docker save {ref} did not give every blob of the image")
    return img


# --------------------------------------------------------------------------------------------- sizes


TRAILER_TRUSTED_BELOW = (1 << 32) // 16  # a gzip layer this small would need a ratio over 16 to wrap ISIZE
_SIZES_LOCK = threading.Lock()


def unpacked_sizes(img: LocalImage) -> dict[str, int]:
    """diff id -> the bytes each layer takes unpacked, as this host's engine measured them (``docker
    history``: one entry per entry of the config's history, those with a layer in layer order; the
    containerd store reports each layer's snapshot, the classic store its diff). {} when the two do
    not line up (the caller estimates then). Asked once per image."""
    with _SIZES_LOCK:
        if img.unpacked is not None:
            return img.unpacked
        img.unpacked = {}
        try:
            cfg = json.loads(img.inline[img.config_digest])
            hist = [h for h in (cfg.get("history") or []) if isinstance(h, dict)]
            out = run_mod.output(["docker", "history", "--no-trunc", "-H=false", "--format", "{{.Size}}",
                                  img.data.get("Id") or img.ref],
                                 timeout=120)
            sizes = [int(x) for x in out.split()][::-1]  # oldest first, as the config lists them
        except (KeyError, ValueError, OperationFailed):
            return img.unpacked
        if len(sizes) != len(hist):
            return img.unpacked
        with_layer = [n for n, h in zip(sizes, hist, strict=True) if not h.get("empty_layer")]
        if len(with_layer) == len(img.layers):
            img.unpacked = {la.diff_id: n for la, n in zip(img.layers, with_layer, strict=True)}
        return img.unpacked


def unpacked_estimate(layer: Layer, path: Path | None, known: int | None = None) -> int:
    """About how many bytes the layer takes unpacked (for the peer's disk check): ``known`` (the
    engine's own figure, ``unpacked_sizes``) when given; exact for uncompressed layers; else from the
    gzip trailer or the zstd frame header when they can say, else 3x.

    The gzip trailer (ISIZE) holds the size modulo 4 GiB: a 7.0 GiB layer reads as 3.0 GiB. It is
    trusted only for a layer small enough that it cannot have wrapped at any usual ratio (under
    TRAILER_TRUSTED_BELOW, 256 MiB); above that, the larger of the trailer (unwrapped up to the
    compressed size) and 3x."""
    if known is not None and known >= 0:
        return known
    if not layer.compressed:
        return layer.size
    guess = layer.size * 3
    if path is None:
        return guess
    try:
        with open(path, "rb") as f:
            if "gzip" in layer.media_type and layer.size >= 18:
                f.seek(-4, os.SEEK_END)
                isize = struct.unpack("<I", f.read(4))[0]
                # the true size is isize + k * 4 GiB, and deflate does not shrink anything much below
                # its compressed size
                low = isize + max(0, -(-(int(layer.size * 0.9) - isize) // (1 << 32))) * (1 << 32)
                if layer.size < TRAILER_TRUSTED_BELOW and isize >= layer.size * 0.9:
                    return isize
                return max(low, guess)
            if "zstd" in layer.media_type:
                head = f.read(18)
                if len(head) >= 6 and head[:4] == b"\x28\xb5\x2f\xfd":
                    fhd = head[4]
                    fcs_flag, single = fhd >> 6, (fhd >> 5) & 1
                    pos = 5 + (0 if single else 1) + [0, 1, 2, 4][fhd & 3]
                    n = [1 if single else 0, 2, 4, 8][fcs_flag]
                    if n and len(head) >= pos + n:
                        v = int.from_bytes(head[pos:pos + n], "little") + (256 if n == 2 else 0)
                        if v >= layer.size:
                            return v
    except OSError:
        pass
    return guess


def identity_document_digest(data: dict) -> str:
    return "sha256:" + hashlib.sha256(canonical_json(data)).hexdigest()
