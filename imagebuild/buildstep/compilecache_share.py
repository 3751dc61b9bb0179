"""A compile stage's compiler cache through the build's registry (docs/build.md, "The second node").

With a registry (``--cache-registry``, or ``registry:`` in imagebuild.yaml), the host copy of a compile
stage's cache (compilecache.py) travels between nodes as one image in the image's repository,
``<registry>/<image>:ccache-<cache id>`` (a cache id too long for a tag is cut and given a hash):

- **pushed** after the stage's take-back, in the background like the stages (registry_cache.py's push
  queue), when the compile had misses (new entries) or the registry holds no cache under the tag yet.
  One layer, a deterministic tar of the host copy's regular files (sorted names, time 0, owner 0, no
  owner names, mode 0644; imagebuild's own bookkeeping files left out), taken under the host copy's
  lock; a config with the label ``io.imagebuild.compiler-cache=<cache id>`` and the platform. A failing
  registry is dropped with the stage cache's one warning; the build never fails for it.
- **pulled** before a stage is built, only when its host copy is absent or empty (a host copy that
  exists wins): by the digest the tag names, verified as a pulled stage is (the manifest hashes to that
  digest; every blob has its size and hashes to its digest; the config names this cache id and the
  platform), extracted into a temporary folder beside the host copy (regular files only, relative
  names without ``..``, a bound on bytes and files), and renamed into place under the lock. Anything
  wrong: one warning naming the registry, the tag, what was expected and what was found; the stage
  builds with an empty cache and nothing half-written stays.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import stat
import tarfile
import time
from pathlib import Path, PurePosixPath

from imagebuild.buildstep import compilecache
from imagebuild.buildstep.registry_cache import Refused, StageCache, _descriptors, verify_pulled
from imagebuild.core import fsutil
from imagebuild.core import registry as reg_mod

log = logging.getLogger("imagebuild")

TAG_PREFIX = "ccache-"
LABEL = "io.imagebuild.compiler-cache"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
# imagebuild's own files in a cache folder: never sent, never accepted from a registry
OWN_FILES = frozenset({compilecache.GENERATION_FILE, compilecache.START_FILE, compilecache.MODE_FILE,
                       compilecache.STATS_FILE, compilecache.STATS_BEFORE_FILE})
MAX_BYTES = 32 << 30  # a pulled cache's bound (ccache's own max_size is 20G), blobs and files alike
MAX_FILES = 2_000_000
_TAG_MAX = 128  # the distribution spec's tag grammar: [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}


def tag_of(cache_id: str) -> str:
    """The registry tag of a cache id: ``ccache-<id>``, or, past 128 characters, its first part and a hash
    (the config's label always names the whole id)."""
    tag = TAG_PREFIX + cache_id
    if len(tag) <= _TAG_MAX:
        return tag
    h = hashlib.sha256(cache_id.encode()).hexdigest()[:16]
    return f"{tag[:_TAG_MAX - 17]}-{h}"


# --------------------------------------------------------------------------------------------- the layer


def cache_files(top: Path) -> list[str]:
    """The regular files of a cache folder that travel, by relative name, sorted (bookkeeping files,
    links and anything else left out)."""
    out = []
    for dirpath, dirs, files in os.walk(top):
        dirs.sort()
        rel = os.path.relpath(dirpath, top)
        for f in files:
            name = f if rel == "." else f"{rel}/{f}"
            if name in OWN_FILES:
                continue
            try:
                if stat.S_ISREG(os.lstat(os.path.join(dirpath, f)).st_mode):
                    out.append(name)
            except OSError:
                pass
    return sorted(out)


def write_layer(top: Path, dest: Path) -> tuple[str, int, int]:
    """The deterministic tar of the cache folder ``top`` into ``dest``: (its sha256 digest, bytes, files)."""
    names = cache_files(top)
    h = hashlib.sha256()

    class _Hashing(io.RawIOBase):
        def __init__(self, f):
            self.f = f

        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            h.update(b)
            return self.f.write(b)

    with open(dest, "wb") as raw:
        sink = _Hashing(raw)
        with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for name in names:
                p = top / name
                with open(p, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    ti = tarfile.TarInfo(name)
                    ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = size, 0, 0o644, 0, 0, "", ""
                    tar.addfile(ti, f)
    return "sha256:" + h.hexdigest(), dest.stat().st_size, len(names)


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_layout(top: Path, layout: Path, cache_id: str, platform: str) -> tuple[str, int, int]:
    """An OCI layout of the cache (one image, ref ``k``): (manifest digest, layer bytes, files)."""
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    part = layout / "layer.tar"
    digest, size, files = write_layer(top, part)
    os.replace(part, blobs / digest.split(":", 1)[1])
    parts = platform.split("/")
    cfg = {"architecture": parts[1], "os": parts[0], **({"variant": parts[2]} if len(parts) > 2 else {}),
           "config": {"Labels": {LABEL: cache_id}}, "rootfs": {"type": "layers", "diff_ids": [digest]}}
    cfg_raw = _canonical(cfg)
    cfg_digest = "sha256:" + hashlib.sha256(cfg_raw).hexdigest()
    (blobs / cfg_digest.split(":", 1)[1]).write_bytes(cfg_raw)
    man = _canonical({"schemaVersion": 2, "mediaType": MANIFEST_TYPE,
                      "config": {"mediaType": CONFIG_TYPE, "digest": cfg_digest, "size": len(cfg_raw)},
                      "layers": [{"mediaType": LAYER_TYPE, "digest": digest, "size": size}]})
    man_digest = "sha256:" + hashlib.sha256(man).hexdigest()
    (blobs / man_digest.split(":", 1)[1]).write_bytes(man)
    (layout / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (layout / "index.json").write_text(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": MANIFEST_TYPE, "digest": man_digest, "size": len(man),
                       "annotations": {"org.opencontainers.image.ref.name": "k"}}]}))
    return man_digest, size, files


def extract(layer: Path, dest: Path, *, max_bytes: int = MAX_BYTES, max_files: int = MAX_FILES) -> tuple[int, int]:
    """The cache tar ``layer`` into the new folder ``dest``: (files, bytes). Only regular files under
    relative names without ``..`` (no links, devices, folders entries or imagebuild's own files), no name
    twice, at most ``max_bytes`` and ``max_files``; anything else raises Refused (the caller removes
    ``dest``)."""
    dest.mkdir()
    seen: set[str] = set()
    total = 0
    try:
        with tarfile.open(layer, mode="r:") as tar:
            for m in tar:
                name = m.name
                p = PurePosixPath(name)
                if not m.isreg():
                    kind = ("a symlink" if m.issym() else "a hard link" if m.islnk() else "a folder" if m.isdir()
                            else "a device" if (m.ischr() or m.isblk()) else "a FIFO" if m.isfifo() else "not a file")
                    raise Refused(f"its layer holds {name!r}, {kind}: only regular files are taken")
                if (not name or "\x00" in name or p.is_absolute() or any(c in ("..", ".", "") for c in name.split("/"))):
                    raise Refused(f"its layer holds the name {name!r}: only plain relative names are taken")
                if name in OWN_FILES:
                    raise Refused(f"its layer holds {name!r}, a file of imagebuild's own")
                if name in seen:
                    raise Refused(f"its layer holds {name!r} twice")
                seen.add(name)
                total += m.size
                if len(seen) > max_files or total > max_bytes:
                    raise Refused(f"its layer holds more than {max_files} files or {max_bytes} bytes (the bound)")
                out = dest / name
                out.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(m)
                fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
                with os.fdopen(fd, "wb") as f:
                    left = m.size
                    while left:
                        chunk = src.read(min(left, 1 << 20))
                        if not chunk:
                            raise Refused(f"its layer ends inside {name!r}")
                        f.write(chunk)
                        left -= len(chunk)
    except tarfile.TarError as exc:
        raise Refused(f"its layer is not a tar ({exc})") from None
    return len(seen), total


# --------------------------------------------------------------------------------------------- pull


def _lock(cache_id: str) -> Path:
    return compilecache.cache_root() / f".{cache_id}.lock"


def host_empty(cache_id: str) -> bool:
    d = compilecache.host_dir(cache_id)
    try:
        return not d.is_dir() or not any(d.iterdir())
    except OSError:
        return True


def pull(cache: StageCache, cache_id: str, stage: str) -> dict | None:
    """The registry's cache for ``cache_id`` into its (absent or empty) host copy, verified; what it
    brought ({digest, bytes, files, seconds, tag}), or None (none there, refused, or the registry failed:
    the stage builds with an empty cache)."""
    if cache.down or not host_empty(cache_id):
        return None
    reg, tag = cache.reg, tag_of(cache_id)
    t0 = time.monotonic()
    try:
        raw = reg_mod.inspect_raw(reg, reg.ref(cache.image, tag), what=f"looking up the compiler cache {cache_id}")
    except reg_mod.RegistryError as exc:
        if exc.kind == "missing":
            cache._event(stage=stage, key=cache_id, action="ccache-miss", tag=tag)
        else:
            cache._failed(exc, stage, cache_id)
        return None
    digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    root = compilecache.cache_root()
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{cache_id}.pull.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        try:
            m = json.loads(raw)
            if not isinstance(m, dict) or m.get("mediaType", MANIFEST_TYPE) != MANIFEST_TYPE:
                raise Refused("the tag names no OCI image manifest")
            descs = _descriptors(m)
            if len(descs) != 2:
                raise Refused(f"its manifest names {len(descs) - 1} layers, expected one")
            if sum(d["size"] for d in descs) > MAX_BYTES:
                raise Refused(f"its blobs are {sum(d['size'] for d in descs)} bytes, more than the bound {MAX_BYTES}")
        except ValueError:
            return _refuse(cache, stage, cache_id, tag, digest, "the manifest is not JSON")
        except Refused as exc:
            return _refuse(cache, stage, cache_id, tag, digest, str(exc))
        oci = tmp / "oci"
        oci.mkdir(parents=True)
        try:
            reg_mod.copy(reg, f"docker://{reg.at(cache.image, digest)}", f"oci:{oci}:k", src_remote=True,
                         dest_remote=False, what=f"pulling the compiler cache {cache_id}")
        except reg_mod.RegistryError as exc:
            if exc.kind in ("corrupt", "missing"):
                return _refuse(cache, stage, cache_id, tag, digest, f"the registry's content does not verify "
                               f"({exc.message})" if exc.kind == "corrupt" else f"gone since the lookup ({exc.message})")
            cache._failed(exc, stage, cache_id)
            return None
        blobs = oci / "blobs" / "sha256"
        dest = compilecache.host_dir(cache_id)
        try:
            _verify(blobs, raw, digest, descs, cache_id, cache.platform)
            files, nbytes = extract(blobs / descs[1]["digest"].split(":", 1)[1], tmp / "files")
            with fsutil.held(_lock(cache_id)):
                if not host_empty(cache_id):  # another clone's build filled it meanwhile: the local copy wins
                    return None
                if dest.is_dir():
                    dest.rmdir()
                (tmp / "files").rename(dest)
        except Refused as exc:
            return _refuse(cache, stage, cache_id, tag, digest, str(exc))
        except OSError as exc:  # this node's disk, not the registry's content
            cache._warn(f"the compiler cache {cache_id} from registry {cache.reg} could not be written under "
                        f"{compilecache.cache_root()} ({exc.strerror or exc}); stage {stage} builds with an empty "
                        "compiler cache")
            return None
        got = {"tag": tag, "digest": digest, "bytes": descs[1]["size"], "files": files,  # the layer's, as pushed
               "seconds": round(time.monotonic() - t0, 3)}
        cache._event(stage=stage, key=cache_id, action="ccache-pulled", digest=digest, bytes=got["bytes"],
                     seconds=got["seconds"])
        log.debug("compiler cache %s: %d files, %d bytes from %s", cache_id, files, nbytes, reg)
        return got
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _verify(blobs: Path, raw: bytes, digest: str, descs: list[dict], cache_id: str, platform: str) -> None:
    have_id = verify_pulled(blobs, raw, digest, descs, platform).get(LABEL)
    if have_id != cache_id:
        raise Refused(f"its config's label {LABEL} is {have_id!r}, expected {cache_id!r}")


def _refuse(cache: StageCache, stage: str, cache_id: str, tag: str, digest: str, why: str) -> None:
    cache._event(stage=stage, key=cache_id, action="ccache-refused", digest=digest, detail=why)
    cache._warn(f"registry {cache.reg}: refused the compiler cache {cache.reg.repo(cache.image)}:{tag} (cache id "
                f"{cache_id}, manifest {digest}): {why}; stage {stage} builds with an empty compiler cache")
    return None


# --------------------------------------------------------------------------------------------- push


def push(cache: StageCache, cache_id: str, stage: str, figures: dict) -> None:
    """Queue the push of the host copy of ``cache_id`` (after its take-back; ``figures``: the compile's);
    what it did is ``pushed(cache)[stage]`` once ``cache.finish`` returned (the push thread never touches
    the record's figures while the build writes them)."""
    if cache.down:
        return
    misses, seeded = figures.get("misses") or 0, figures.get("seeded_from")
    cache.submit(stage, cache_id, lambda: _done(cache, stage, _push(cache, cache_id, stage, misses, seeded)))


def pushed(cache: StageCache) -> dict[str, dict]:
    """{stage: what its compiler cache's push did} (``push``)."""
    with cache._lock:
        return dict(cache.ccache_pushed)


def _done(cache: StageCache, stage: str, result: dict | None) -> None:
    if result is not None:
        with cache._lock:
            cache.ccache_pushed[stage] = result


def _push(cache: StageCache, cache_id: str, stage: str, misses: int, seeded: str | None) -> dict | None:
    reg, tag = cache.reg, tag_of(cache_id)
    t0 = time.monotonic()
    if not misses:  # nothing new compiled: pushed only when the registry holds no cache yet
        if seeded == "registry":
            return {"tag": tag, "skipped": "every call hit the cache pulled from the registry"}
        try:
            reg_mod.inspect_raw(reg, reg.ref(cache.image, tag), what=f"looking up the compiler cache {cache_id}")
            return {"tag": tag, "skipped": "every call hit, and the registry holds a cache"}
        except reg_mod.RegistryError as exc:
            if exc.kind != "missing":
                cache._failed(exc, stage, cache_id)
                return {"tag": tag, "failed": exc.message}
    tmp = cache._tmp("outgoing")
    try:
        layout = tmp / "oci"
        src = compilecache.host_dir(cache_id)
        if not src.is_dir():
            return None
        with fsutil.held(_lock(cache_id)):  # a take-back of another clone waits: the tar is one state
            digest, size, files = write_layout(src, layout, cache_id, cache.platform)
        dg = tmp / "digest"
        try:
            reg_mod.copy(reg, f"oci:{layout}:k", f"docker://{reg.ref(cache.image, tag)}", src_remote=False,
                         dest_remote=True, digestfile=dg, what=f"pushing the compiler cache {cache_id}")
        except reg_mod.RegistryError as exc:
            cache._failed(exc, stage, cache_id)
            return {"tag": tag, "failed": exc.message}
        got = dg.read_text().strip() if dg.is_file() else None
        if got != digest:
            cache._event(stage=stage, key=cache_id, action="error",
                         detail=f"the registry stored the compiler cache as {got}, expected {digest}")
            return {"tag": tag, "failed": f"stored as {got}, expected {digest}"}
        secs = round(time.monotonic() - t0, 3)
        cache._event(stage=stage, key=cache_id, action="ccache-pushed", digest=digest, bytes=size, seconds=secs)
        return {"tag": tag, "digest": digest, "bytes": size, "files": files, "seconds": secs}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
