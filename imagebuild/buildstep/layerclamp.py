"""Clamp the file times in a stage's new layers to its SOURCE_DATE_EPOCH, in the stage store.

A RUN step writes its files with the build's wall-clock time, so the same key would give new
layer bytes on every build. After BuildKit has exported a stage into the stage store (plain OCI
layout, zstd), this module rewrites the stage's *own* layers (those after its parent's) so that
no time in them is later than the epoch, and writes the stage's config and manifest again.

- Only times change. Each tar header is copied byte for byte except its mtime field (and, in a
  GNU header, atime and ctime), and the ``mtime``/``atime``/``ctime`` records of PAX headers;
  each only when later than the epoch, and then its checksum (and a PAX header's size). A later
  ``mtime`` record of a file's own PAX header is dropped (its header field holds the clamped
  second), so sub-second and whole-second build times give the same bytes. File data, names,
  modes, owners, xattrs, hard links and whiteouts pass through untouched.
- One pass: decompress, patch headers, compress once (zstd, level ZSTD_LEVEL, every core; the
  bytes do not depend on the number of workers). BuildKit's own ``rewrite-timestamp`` compressed
  each new layer, decompressed, rewrote and compressed it again, and re-read every parent layer;
  the chain cost 1.21-1.32x a plain ``--load``, and about 1.0x with this (docs/build.md, Reproducibility).
- The config is BuildKit's bytes with the new diff ids put in place of the old; the manifest
  names the new config and layers; ``index.json`` names the new manifest. Every blob is written
  to a temp file and renamed, then the replaced blobs (the raw layer, config, manifest) are
  removed unless another stage ref names them.
- The records of when a tool ran (``reproducible.RECORDS_OF_WHEN``: dpkg's and apt's logs, ldconfig's
  aux-cache, ...) are left out of the stage's own layers, each regular file with the PAX or GNU
  long-name headers that describe it: the one place that list is applied (docs/build.md).
- A layer without a later time or such a record is kept as it is (same blob); a stage with none
  keeps its manifest.
  A rewritten layer ends with exactly two zero blocks (what BuildKit's Go tar writer writes).

No process is started here; the caller gives the parent's diff ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from imagebuild.buildstep.reproducible import DROPPED, normalized
from imagebuild.buildstep.stagestore import StageStore
from imagebuild.core import fsutil
from imagebuild.core.errors import OperationFailed
from imagebuild.core.fsutil import atomic_write_bytes
from imagebuild.core.units import human_bytes

BLOCK = 512
CHUNK = 1 << 20
ZSTD_LEVEL = 3
LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
TMP_PREFIX = ".clamp-"  # temp blobs; a killed run's are removed at the next build of the image
_ZERO = bytes(BLOCK)
_HEADER_ONLY = frozenset(b"123456")  # hard link, symlink, char, block, dir, fifo: no data
_PAX_TIMES = (b"mtime", b"atime", b"ctime")


class TarError(ValueError):
    """The layer is not a tar stream this module can read."""


@dataclass(frozen=True)
class Clamped:
    manifest: str  # the stage's manifest now (the same digest when nothing was later than the epoch)
    layers: int  # layers rewritten
    headers: int  # tar headers changed
    bytes: int  # uncompressed bytes read
    seconds: float
    dropped: tuple[str, ...] = ()  # records of when a tool ran, left out (reproducible.RECORDS_OF_WHEN)

    def summary(self) -> str:
        if not self.layers:
            return f"file times: none later than the epoch ({human_bytes(self.bytes)} read, {self.seconds:.1f} s)"
        out = (f"file times clamped in {self.layers} layer(s), {self.headers} header(s), "
               f"{human_bytes(self.bytes)}, {self.seconds:.1f} s")
        if self.dropped:
            out += f"; left out (records of when a tool ran): {', '.join(self.dropped)}"
        return out


# --------------------------------------------------------------------------------------------- tar


def _num(field: bytes) -> int:
    """A tar numeric field: octal text, or GNU base-256 (first byte 0x80 or 0xff)."""
    if field and field[0] & 0x80:
        if field[0] == 0xFF:
            return int.from_bytes(field, "big", signed=True)
        return int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise TarError(f"bad numeric field {field!r}") from None


def _octal(value: int, width: int) -> bytes:
    return b"%0*o\0" % (width - 1, value)


def _checksum_ok(h: bytes) -> bool:
    stored = _num(h[148:156])
    blanked = h[:148] + b" " * 8 + h[156:]
    unsigned = sum(blanked)
    # some old writers summed signed bytes
    return stored == unsigned or stored == unsigned - 256 * sum(1 for b in blanked if b > 127)


def _set_checksum(h: bytearray) -> None:
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)


def _pax_record(key: bytes, value: bytes) -> bytes:
    body = b" " + key + b"=" + value + b"\n"
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n += 1
    return str(n).encode() + body


def _clamp_pax(data: bytes, epoch: int, *, drop_mtime: bool) -> bytes | None:
    """PAX records with times later than ``epoch`` set to it; None when none is.

    ``drop_mtime`` (a file's own PAX header, whose ustar header gets the clamped mtime): a later
    ``mtime`` record is dropped instead, as a writer leaves it out for a whole-second time, so a
    sub-second build time and a whole-second one give the same bytes."""
    from decimal import Decimal, InvalidOperation

    out, pos, changed = [], 0, False
    while pos < len(data):
        if data[pos:].strip(b"\0") == b"":  # padding after the last record
            break
        sp = data.find(b" ", pos)
        try:
            n = int(data[pos:sp]) if sp > pos else 0
        except ValueError:
            n = 0
        if n <= 0 or pos + n > len(data) or data[pos + n - 1:pos + n] != b"\n":
            raise TarError("bad PAX record")
        rec = data[pos:pos + n]
        key, eq, value = rec[sp - pos + 1:-1].partition(b"=")
        pos += n
        if eq and key in _PAX_TIMES:
            try:
                later = Decimal(value.decode("ascii")) > epoch
            except (InvalidOperation, UnicodeDecodeError):
                raise TarError(f"bad PAX {key.decode()} record {value!r}") from None
            if later:
                changed = True
                if drop_mtime and key == b"mtime":
                    continue
                rec = _pax_record(key, str(epoch).encode())
        out.append(rec)
    return b"".join(out) if changed else None


class _Exact:
    """``read(n)`` that returns n bytes unless the stream ends."""

    def __init__(self, raw):
        self.raw = raw

    def read(self, n: int) -> bytes:
        b = self.raw.read(n)
        if len(b) == n or not b:
            return b
        parts = [b]
        got = len(b)
        while got < n:
            more = self.raw.read(n - got)
            if not more:
                break
            parts.append(more)
            got += len(more)
        return b"".join(parts)


def _pax_path(data: bytes) -> str | None:
    """The ``path`` record of PAX header data, if any."""
    pos = 0
    while pos < len(data):
        sp = data.find(b" ", pos)
        try:
            n = int(data[pos:sp]) if sp > pos else 0
        except ValueError:
            return None
        if n <= 0:
            return None
        key, eq, value = data[sp + 1:pos + n - 1].partition(b"=")
        if eq and key == b"path":
            return value.decode("utf-8", "surrogateescape")
        pos += n
    return None


def _ustar_name(h: bytes) -> str:
    name = h[0:100].split(b"\0", 1)[0]
    if h[257:263] == b"ustar\0":  # POSIX: a prefix field (GNU headers keep atime/ctime there)
        prefix = h[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")


_REGULAR = frozenset(b"07\0")


def clamp_tar(src, write, epoch: int, drop: frozenset[str] = frozenset(),
              dropped: list[str] | None = None) -> int:
    """Copy the tar stream ``src`` (``read(n)``) to ``write(bytes)`` with every time later than
    ``epoch`` set to it; returns the number of headers changed. TarError for what is not a tar.

    A regular file whose path is in ``drop`` (``reproducible.RECORDS_OF_WHEN``) is left out, with
    the PAX or GNU long-name headers that describe it; its path goes to ``dropped`` and it counts
    as a changed header."""
    r = _Exact(src)
    changed = 0
    pending: list[bytes] = []  # headers that describe the next member (PAX 'x', GNU 'L'/'K'), not yet written
    pax_path: str | None = None
    long_name: str | None = None
    while True:
        h = r.read(BLOCK)
        if not h:
            for p in pending:
                write(p)
            return changed  # no end-of-archive blocks: accepted, as Go's reader does
        if len(h) < BLOCK:
            raise TarError("the stream ends inside a header")
        if h == _ZERO:  # end of archive: two zero blocks, as Go writes it; the padding after them is read
            for p in pending:
                write(p)
            write(_ZERO + _ZERO)  # (it is part of the diff id) but not written: record padding would
            while r.read(CHUNK):  # otherwise depend on the headers a clamp removed
                pass
            return changed
        if not _checksum_ok(h):
            raise TarError("a header's checksum does not match (not a tar stream?)")
        hdr = bytearray(h)
        kind = hdr[156]
        size = _num(h[124:136])
        dirty = False
        if kind in (ord("x"), ord("g")):  # PAX: the records are the data
            data = r.read(size + (-size) % BLOCK)
            if len(data) < size + (-size) % BLOCK:
                raise TarError("the stream ends inside a PAX header")
            if kind == ord("x") and drop:
                pax_path = _pax_path(data[:size]) or pax_path
            new = _clamp_pax(data[:size], epoch, drop_mtime=kind == ord("x"))
            if new == b"":  # it held only a later mtime: the file's own header says it now
                changed += 1
                continue
            if new is not None:
                size, dirty = len(new), True
                hdr[124:136] = _octal(size, 12)
                data = new + bytes((-len(new)) % BLOCK)
        elif kind in (ord("L"), ord("K")):  # GNU long name / long link: the name is the data
            data = r.read(size + (-size) % BLOCK)
            if len(data) < size + (-size) % BLOCK:
                raise TarError("the stream ends inside a GNU long-name header")
            if kind == ord("L"):
                long_name = data[:size].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        else:
            data = None
        if _num(h[136:148]) > epoch:
            hdr[136:148], dirty = _octal(epoch, 12), True
        if h[257:265] == b"ustar  \0":  # GNU header: atime and ctime fields too
            for off in (345, 357):
                if _num(h[off:off + 12]) > epoch:
                    hdr[off:off + 12], dirty = _octal(epoch, 12), True
        if dirty:
            _set_checksum(hdr)
            changed += 1
        if data is not None:
            if kind == ord("g"):  # global: describes no one member
                write(bytes(hdr))
                write(data)
            else:
                pending.append(bytes(hdr) + data)
            continue
        name = pax_path or long_name or _ustar_name(h)
        pax_path = long_name = None
        skip = bool(drop) and kind in _REGULAR and normalized(name) in drop
        if skip:
            changed += 1
            if dropped is not None:
                dropped.append(normalized(name))
        else:
            for p in pending:
                write(p)
            write(bytes(hdr))
        pending = []
        emit = (lambda b: None) if skip else write
        if kind == ord("S") and h[482]:  # old GNU sparse: extension blocks follow the header
            while True:
                ext = r.read(BLOCK)
                if len(ext) < BLOCK:
                    raise TarError("the stream ends inside a sparse header")
                emit(ext)
                if not ext[504]:
                    break
        left = 0 if kind in _HEADER_ONLY else size + (-size) % BLOCK
        while left:
            chunk = r.read(min(left, CHUNK))
            if not chunk:
                raise TarError("the stream ends inside a file's data")
            emit(chunk)
            left -= len(chunk)


# --------------------------------------------------------------------------------------------- layers


def _decompressed(f, media_type: str):
    """A ``read(n)`` object over a layer blob's tar stream."""
    if media_type.endswith(("+zstd", ".zstd")):  # OCI ...tar+zstd, Docker ...diff.tar.zstd
        import zstandard

        # a blob may hold several frames (concurrent encoders write them): read them all
        return zstandard.ZstdDecompressor().stream_reader(f, read_size=CHUNK, read_across_frames=True)
    if media_type.endswith(("+gzip", ".gzip")):
        return _Gunzip(f)
    if media_type.endswith(".tar"):
        return f
    raise TarError(f"layer media type {media_type!r} is not a tar (plain, gzip or zstd)")


class _Gunzip:
    def __init__(self, f):
        self.f, self.d, self.buf = f, zlib.decompressobj(zlib.MAX_WBITS | 16), b""

    def read(self, n: int) -> bytes:
        while len(self.buf) < n:
            raw = self.f.read(CHUNK)
            if not raw:
                self.buf += self.d.flush()
                break
            self.buf += self.d.decompress(raw)
            if self.d.eof and self.d.unused_data:  # concatenated members
                rest = self.d.unused_data
                self.d = zlib.decompressobj(zlib.MAX_WBITS | 16)
                self.buf += self.d.decompress(rest)
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


class _Tee:
    """Counts and hashes what it is given (the tar before and after, the blob) and passes it on."""

    def __init__(self, sink=None):
        self.h, self.n, self.sink = hashlib.sha256(), 0, sink

    def write(self, b) -> int:
        self.h.update(b)
        self.n += len(b)
        if self.sink is not None:
            self.sink(b)
        return len(b)


class _Reading:
    """Reads from ``src`` and gives what it read to ``tee`` (the layer's tar as it was)."""

    def __init__(self, src, tee: _Tee):
        self.src, self.tee = src, tee

    def read(self, n: int) -> bytes:
        b = self.src.read(n)
        self.tee.write(b)
        return b


def workers() -> int:
    return max(1, os.cpu_count() or 1)


def clamp_layer(store: StageStore, desc: dict, diff_id: str, epoch: int,
                dropped: list[str] | None = None) -> tuple[dict, str, int, int] | None:
    """Rewrite one layer blob of the store: (new descriptor, new diff id, headers changed, bytes
    read), or None when no time in it is later than ``epoch`` and it holds none of
    ``reproducible.RECORDS_OF_WHEN`` (nothing is written then); the paths left out go to ``dropped``.
    The blob's tar must hash to ``diff_id`` (what the config says it is)."""
    import zstandard

    src = store.blob(desc["digest"])
    d = src.parent
    tmp = d / f"{TMP_PREFIX}{os.getpid()}-{time.monotonic_ns()}.tmp"
    orig = _Tee()
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            out = _Tee(fout.write)  # the compressed blob: its digest and size
            zc = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=workers())
            with zc.stream_writer(out, closefd=False, write_size=CHUNK) as zw:
                new = _Tee(zw.write)
                changed = clamp_tar(_Reading(_decompressed(fin, str(desc.get("mediaType", ""))), orig),
                                    new.write, epoch, DROPPED, dropped)
            if "sha256:" + orig.h.hexdigest() != diff_id:
                raise OperationFailed(f"layer {desc['digest']} in {store.dir}: its content is "
                                      f"sha256:{orig.h.hexdigest()}, but the image config says {diff_id}",
                                      hint="the stage store was changed behind imagebuild's back; "
                                      "rebuild the stage (imagebuild build --no-cache)")
            if not changed:
                return None
            fout.flush()
            os.fsync(fout.fileno())
        digest = "sha256:" + out.h.hexdigest()
        os.chmod(tmp, 0o644)
        os.replace(tmp, store.blob(digest))
    except (TarError, zstandard.ZstdError, zlib.error) as exc:
        raise OperationFailed(f"layer {desc['digest']} in {store.dir} cannot be read as a tar: {exc}",
                              hint="rebuild the stage; if it happens again, report it with the stage's log") from None
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    return ({"mediaType": LAYER_ZSTD, "digest": digest, "size": out.n}, "sha256:" + new.h.hexdigest(),
            changed, orig.n)


def _put_blob(store: StageStore, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    p = store.blob(digest)
    if not p.is_file():
        atomic_write_bytes(p, data)
    return digest


def clamp_stage(store: StageStore, manifest: str, parent_diff_ids: list[str], epoch: int) -> Clamped:
    """Clamp the layers of ``manifest`` after those it shares with the parent (``parent_diff_ids``,
    base first); returns the stage's manifest after it (see the module doc)."""
    t0 = time.monotonic()
    m_bytes = fsutil.read_bytes(store.blob(manifest))
    m = json.loads(m_bytes)
    c_desc = m["config"]
    c_bytes = fsutil.read_bytes(store.blob(c_desc["digest"]))
    diff_ids = list(json.loads(c_bytes)["rootfs"]["diff_ids"])
    layers = list(m["layers"])
    if len(diff_ids) != len(layers):
        raise OperationFailed(f"manifest {manifest} in {store.dir}: {len(layers)} layers but "
                              f"{len(diff_ids)} diff ids in its config", hint="rebuild the stage")
    keep = 0
    while keep < min(len(diff_ids), len(parent_diff_ids)) and diff_ids[keep] == parent_diff_ids[keep]:
        keep += 1
    replaced: list[str] = []
    dropped: list[str] = []
    n_layers = n_headers = n_bytes = 0
    for i in range(keep, len(layers)):
        res = clamp_layer(store, layers[i], diff_ids[i], epoch, dropped)
        if res is None:
            continue
        desc, new_id, headers, read = res
        c_bytes = c_bytes.replace(f'"{diff_ids[i]}"'.encode(), f'"{new_id}"'.encode())
        replaced.append(layers[i]["digest"])
        layers[i] = {**{k: v for k, v in layers[i].items() if k != "annotations"}, **desc}
        n_layers, n_headers, n_bytes = n_layers + 1, n_headers + headers, n_bytes + read
    if not n_layers:
        return Clamped(manifest, 0, 0, n_bytes, round(time.monotonic() - t0, 3))
    dropped = sorted(set(dropped))
    new_config = _put_blob(store, c_bytes)
    m["config"] = {**c_desc, "digest": new_config, "size": len(c_bytes)}
    m["layers"] = layers
    new_m_bytes = json.dumps(m, separators=(",", ":")).encode()
    new_manifest = _put_blob(store, new_m_bytes)
    _index_names(store, manifest, new_manifest, len(new_m_bytes))
    _remove_unless_named(store, [*replaced, c_desc["digest"], manifest], keep={new_manifest})
    return Clamped(new_manifest, n_layers, n_headers, n_bytes, round(time.monotonic() - t0, 3), tuple(dropped))


def _index_names(store: StageStore, old: str, new: str, size: int) -> None:
    """``index.json`` (BuildKit's) names the new manifest where it named the old one."""
    p = store.dir / "index.json"
    try:
        idx = json.loads(fsutil.read_text(p))
    except (OSError, ValueError):
        return
    for e in idx.get("manifests") or []:
        if isinstance(e, dict) and e.get("digest") == old:
            e["digest"], e["size"] = new, size
    atomic_write_bytes(p, json.dumps(idx, separators=(",", ":")).encode())


def _remove_unless_named(store: StageStore, digests: list[str], keep: set[str]) -> None:
    named: set[str] = set()
    for ref in store.refs():
        named.add(ref.manifest)
        named.update(store.manifest_blobs(ref.manifest) or ())
    for m in keep:
        named.add(m)
        named.update(store.manifest_blobs(m) or ())
    for dg in digests:
        if dg not in named:
            try:
                os.unlink(store.blob(dg))
            except FileNotFoundError:
                pass


def remove_stale_tmp(store: StageStore) -> list[Path]:
    """Temp blobs of a clamp that was killed (call only with the image's build lock held)."""
    d = store.dir / "blobs" / "sha256"
    gone = sorted(d.glob(f"{TMP_PREFIX}*.tmp")) if d.is_dir() else []
    for p in gone:
        try:
            p.unlink()
        except FileNotFoundError:
            pass
    return gone

