"""One verified file that carries an image's prefetched inputs to a node that cannot reach GitHub.

``imagebuild bundle IMAGE -o FILE`` writes a plain tar, not compressed (the source tarballs in it
are plain tars too: compress the bundle for the trip with any tool and decompress it before
``unbundle``, which seeks over the members to read every header first), holding, under their
project paths:

- ``docker-images/<image>/lock.json`` and ``versions.env`` (the pins prefetch wrote);
- every file the lock names: each source tarball (``deps-src/<image>/src/``, with its
  ``SHA256SUMS``), each wheel and the generated ``requirements.txt``, each deb and the generated
  ``Packages`` and ``install.sh``;
- ``SHA256SUMS`` (every file above, ``sha256sum -c`` format) and ``imagebuild-bundle.json`` (the
  manifest: image, lock sha256, each file's size and sha256, the definition's digest), last.

Every file is checked against the lock while it is written: a damaged or missing local file
stops the bundle (nothing is left at FILE). The archive is deterministic: sorted names, mtime 0,
owner 0, mode 0644, so the same lock and files give the same bytes.

``imagebuild unbundle FILE`` writes nothing before it has read the tar's headers and checked the
manifest (every field's type and shape): every member must be a regular file inside the project,
listed once in the manifest, of exactly the size it lists, so the manifest bounds what is written.
Each member then streams, hashed, into a temporary folder inside the project; every file is checked
against the bundled lock (nothing missing, nothing extra), the definition is validated with the
bundle's versions.env, and only then are the files moved into place: the prefetched folders first,
``versions.env``, then ``lock.json`` (the commit point). A bad bundle changes nothing. After it,
``imagebuild build IMAGE`` needs no
network (base images aside: unbundle says which ones the local engine lacks).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from imagebuild.core import context as context_mod
from imagebuild.core import lock as lock_mod
from imagebuild.core import state
from imagebuild.core.errors import (
    DefinitionError,
    OperationFailed,
    Problem,
    UsageError,
)
from imagebuild.core.fsutil import atomic_write_bytes, sha256_tree
from imagebuild.core.units import human_bytes
from imagebuild.definition import reader as d

log = logging.getLogger("imagebuild")

SCHEMA = "imagebuild.bundle"
VERSION = 1
MANIFEST = "imagebuild-bundle.json"
SUMS = "SHA256SUMS"
SRC_SUMS = "SHA256SUMS"  # beside the source tarballs (prefetch.SUMS_FILE)
_CHUNK = 4 << 20


def _copy_hashed(src, write, size: int, h, short: Exception) -> None:
    """Copy exactly ``size`` bytes of ``src`` to ``write`` in chunks, hashing them into ``h``;
    ``short`` is raised when ``src`` ends first."""
    left = size
    while left:
        chunk = src.read(min(_CHUNK, left))
        if not chunk:
            raise short
        h.update(chunk)
        write(chunk)
        left -= len(chunk)


@dataclass(frozen=True)
class Item:
    path: str  # project-relative, posix
    sha256: str | None  # what the lock says (None: not in the lock, e.g. versions.env)


@dataclass
class Result:
    image: str
    file: str
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    notices: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)  # unbundle: definition files that changed

    def as_dict(self) -> dict:
        return {"schema": SCHEMA + ("-result"), "version": VERSION, "image": self.image, "file": self.file,
                "files": self.files, "bytes": self.bytes, "notices": self.notices, "replaced": self.replaced}


# ------------------------------------------------------------------------------------------------ what


def _safe(rel: str, where: str) -> str:
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not rel or "\\" in rel:
        raise OperationFailed(f"{where}: path {rel!r} is not inside the project")
    return p.as_posix()


def items(image: str, lock: dict, lock_disp: str) -> list[Item]:
    """Every file of the image's prefetched inputs the lock names, with its locked sha256."""
    out: dict[str, Item] = {}

    def add(rel: str, sha: str | None, where: str) -> None:
        rel = _safe(rel, f"{lock_disp}: {where}")
        if not rel.startswith(f"deps-src/{image}/"):
            raise OperationFailed(f"{lock_disp}: {where}: {rel!r} is not under deps-src/{image}/")
        if not isinstance(sha, str) or len(sha) != 64:
            raise OperationFailed(f"{lock_disp}: {where}: no sha256 for {rel!r}",
                                  hint=f"imagebuild prefetch {image}")
        out[rel] = Item(rel, sha)

    for name, e in sorted((lock.get("sources") or {}).items()):
        if not isinstance(e, dict) or not e.get("tarball"):
            raise OperationFailed(f"{lock_disp}: sources.{name}: no tarball", hint=f"imagebuild prefetch {image}")
        add(e["tarball"], e.get("sha256"), f"sources.{name}")
        if isinstance(e.get("cargo"), dict):  # its vendored Rust crates (fetch/cargo.py)
            add(str(e["cargo"].get("tarball")), e["cargo"].get("sha256"), f"sources.{name}.cargo")
            from imagebuild.fetch.rust_dist import lock_files  # only for a tree with Rust crates

            for tb, sha in lock_files(e["cargo"]):  # its pinned Rust toolchain (fetch/rust_dist.py)
                add(tb, sha, f"sources.{name}.cargo.toolchain_dist")
    if lock.get("sources"):
        out[f"deps-src/{image}/src/{SRC_SUMS}"] = Item(f"deps-src/{image}/src/{SRC_SUMS}", _src_sums_sha(lock))
    for section, extra in (("wheels", "install_requirements"), ("apt", "generated")):
        for stage, e in sorted((lock.get(section) or {}).items()):
            if not isinstance(e, dict):
                continue
            base = _safe(e.get("dir") or f"deps-src/{image}/{section}/{stage}", f"{section}.{stage}.dir")
            for f in e.get("files") or []:
                if isinstance(f, dict) and f.get("from_stage"):  # installed by a stage above: in its folder
                    continue
                add(f"{base}/{f['filename']}", f.get("sha256"), f"{section}.{stage}.files")
            if section == "wheels" and isinstance(e.get(extra), dict):
                add(f"{base}/{PurePosixPath(e[extra]['path']).name}", e[extra].get("sha256"),
                    f"{section}.{stage}.{extra}")
            elif section == "apt" and isinstance(e.get(extra), dict):
                for fn, sha in sorted(e[extra].items()):
                    add(f"{base}/{fn}", sha, f"{section}.{stage}.{extra}")
    return [out[k] for k in sorted(out)]


def _src_sums_sha(lock: dict) -> str:
    """The sha256 of deps-src/<image>/src/SHA256SUMS as prefetch writes it for this lock."""
    packed = {PurePosixPath(x["tarball"]).name: x["sha256"] for e in (lock.get("sources") or {}).values()
              for x in (e, e.get("cargo")) if isinstance(x, dict)}
    for e in (lock.get("sources") or {}).values():
        if isinstance(e, dict) and isinstance(e.get("cargo"), dict) and e["cargo"].get("toolchain_dist"):
            from imagebuild.fetch.rust_dist import lock_files  # only for a pinned Rust toolchain

            packed.update({PurePosixPath(tb).name: sha for tb, sha in lock_files(e["cargo"])})
    text = "".join(f"{sha}  {name}\n" for name, sha in sorted(packed.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def definition_digest(img_dir: Path) -> str:
    """The digest of a definition folder without what prefetch writes (lock.json, versions.env)."""
    h = hashlib.sha256()
    for p in sorted(img_dir.rglob("*")):
        if p.is_file() and p.name not in (lock_mod.LOCK_FILE, d.VERSIONS_FILE) and "__pycache__" not in p.parts:
            h.update(f"{p.relative_to(img_dir).as_posix()} {sha256_tree(p)}\n".encode())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ bundle


class _TarWriter:
    """A plain tar of regular files, written in large blocks (the archive's bytes are what
    tarfile writes: GNU headers, 512-byte padding, two zero blocks and a 10240-byte record)."""

    def __init__(self, raw):
        self.raw = raw
        self.written = 0

    def add(self, name: str, src, size: int, h) -> None:
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = size, 0, 0o644, 0, 0, "", ""
        self._write(ti.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape"))
        _copy_hashed(src, self._write, size, h, OperationFailed(f"{name}: changed while it was being bundled"))
        self._write(b"\0" * (-size % tarfile.BLOCKSIZE))

    def close(self) -> None:
        end = 2 * tarfile.BLOCKSIZE
        end += -(self.written + end) % tarfile.RECORDSIZE
        self._write(b"\0" * end)

    def _write(self, data: bytes) -> None:
        self.raw.write(data)
        self.written += len(data)


def bundle(ctx: context_mod.Context | Path, image: str, output: Path) -> Result:
    """Write the bundle of ``image`` to ``output`` (atomically); every file checked against the lock."""
    t0 = time.monotonic()
    root = context_mod.of(ctx).root
    defn = d.load(root, image)
    lock_disp = defn.rel(lock_mod.lock_path(defn.dir))
    lk = lock_mod.read(defn.dir, lock_disp)
    if lk is None:
        raise OperationFailed(f"{image}: no {lock_disp}: nothing to bundle", hint=f"imagebuild prefetch {image}")
    want = [Item(defn.rel(lock_mod.lock_path(defn.dir)), None), Item(defn.rel(defn.dir / d.VERSIONS_FILE), None)]
    want += items(image, lk, lock_disp)
    output = Path(output).resolve()
    if output.is_dir() or (output.exists() and not output.is_file()):  # a rename would replace it
        raise UsageError(f"-o {output}: is a folder or a device, not a file: refusing to replace it")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    manifest_files = []
    total = 0
    try:
        try:
            raw = open(tmp, "wb")
        except OSError as exc:
            raise UsageError(f"-o {output}: cannot write in {output.parent}: {exc.strerror or exc}") from None
        with raw:
            tf = _TarWriter(raw)
            for it in want:
                src = root / it.path
                if not src.is_file():
                    raise OperationFailed(f"{it.path}: listed in {lock_disp} but missing",
                                          hint=f"imagebuild prefetch {image} (it fetches or repacks it)")
                size = src.stat().st_size
                h = hashlib.sha256()
                with open(src, "rb") as f:
                    tf.add(it.path, f, size, h)
                got = h.hexdigest()
                if it.sha256 is not None and got != it.sha256:
                    raise OperationFailed(f"{it.path}: sha256 {got} does not match {lock_disp} ({it.sha256}); "
                                          "refusing to bundle a damaged file",
                                          hint=f"imagebuild prefetch {image} (it repacks or re-fetches it)")
                manifest_files.append({"path": it.path, "size": size, "sha256": got})
                total += size
            sums = "".join(f"{f['sha256']}  {f['path']}\n" for f in manifest_files).encode()
            tf.add(SUMS, _bytes(sums), len(sums), hashlib.sha256())
            man = {"schema": SCHEMA, "version": VERSION, "image": image,
                   "lock": defn.rel(lock_mod.lock_path(defn.dir)),
                   "lock_sha256": next(f["sha256"] for f in manifest_files if f["path"].endswith("/lock.json")),
                   "definition_sha256": definition_digest(defn.dir), "files": manifest_files,
                   "sums_sha256": hashlib.sha256(sums).hexdigest()}
            data = (json.dumps(man, indent=2, sort_keys=True) + "\n").encode()
            tf.add(MANIFEST, _bytes(data), len(data), hashlib.sha256())
            tf.close()
        # no fsync: a bundle is a transport file, and unbundle verifies every byte of it
        os.replace(tmp, output)
    except OSError as exc:  # the disk filled, the folder went away: the bundle is not written
        tmp.unlink(missing_ok=True)
        raise OperationFailed(f"-o {output}: could not write the bundle: {exc.strerror or exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    log.info("%s: bundled %d files (%s) into %s", image, len(manifest_files), human_bytes(total), output)
    return Result(image, str(output), len(manifest_files), total, time.monotonic() - t0)


def _bytes(data: bytes):
    import io
    return io.BytesIO(data)


# ------------------------------------------------------------------------------------------------ unbundle


def unbundle(ctx: context_mod.Context | Path, file: Path) -> Result:
    """Verify ``file`` completely, then put its files in place under the project's root.

    Nothing is written before the tar's headers and its manifest are checked: every member must
    be a regular file the manifest lists, of the size it says (so the manifest's sizes bound what
    is written, and a sparse or oversized member is refused unread). The members are then hashed
    while they stream into a temporary folder, checked against the bundled lock, the definition is
    validated with the bundle's versions.env, and only then is anything moved into place."""
    t0 = time.monotonic()
    if not str(file).strip():
        raise UsageError("unbundle: expected a bundle file, got an empty name")
    file = Path(file)
    if not file.is_file():  # a FIFO would hang the read; a folder is no bundle; neither is "missing"
        what = ("is a folder" if file.is_dir() else "is not a regular file (a FIFO, socket or device)"
                if file.exists() else "no such bundle file")
        raise UsageError(f"{file}: {what}" + (", expected a bundle file" if file.exists() else ""))
    root = context_mod.of(ctx).root
    try:
        tf = tarfile.open(file, mode="r:", tarinfo=_Header)
    except (tarfile.TarError, EOFError, OSError, _Bad) as exc:
        raise _unreadable(file, exc) from None
    with tf:
        heads = _headers(file, tf)
        man = _manifest(file, tf, heads)
        image = man["image"]
        img_dir = root / d.IMAGES_DIR / image
        if not (img_dir / d.IMAGE_FILE).is_file():
            raise DefinitionError([Problem(d.display_path(root, img_dir), "no such image definition here: the "
                                             "bundle carries the pins and prefetched files, not the definition",
                                             key="IMAGE", hint="check out the project (the same commit as where "
                                             "the bundle was made) first")], image=image)
        total = sum(f["size"] for f in man["files"])
        deps = root / "deps-src"
        made = not deps.exists()
        for old in deps.glob(".unbundle-*.tmp") if deps.is_dir() else ():  # left by a killed run
            pid = old.name.split("-")[1]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        _room(file, _mkdir(deps), total)
        stage = Path(tempfile.mkdtemp(prefix=f".unbundle-{os.getpid()}-", suffix=".tmp", dir=deps))
        done = False
        try:
            got = _extract(file, tf, heads, man, stage)
            res = _verify_and_install(root, file, man, got, stage, img_dir)
            res.files = len(got)
            res.bytes = total
            res.seconds = time.monotonic() - t0
            log.info("%s: unbundled %d files (%s) from %s", image, res.files, human_bytes(res.bytes), file)
            done = True
            return res
        finally:
            shutil.rmtree(stage, ignore_errors=True)
            if made and not done:  # leave the project as it was
                try:
                    deps.rmdir()
                except OSError:
                    pass


def _verify_and_install(root: Path, file: Path, man: dict, got: dict[str, str], stage: Path,
                        img_dir: Path) -> Result:
    image = man["image"]
    res = Result(image, str(file))
    lock_rel = f"{d.IMAGES_DIR}/{image}/{lock_mod.LOCK_FILE}"
    env_rel = f"{d.IMAGES_DIR}/{image}/{d.VERSIONS_FILE}"
    try:
        lk = json.loads((stage / lock_rel).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OperationFailed(f"{file}: the bundled {lock_rel} is unreadable: {exc}") from None
    if not isinstance(lk, dict) or lk.get("schema") != lock_mod.LOCK_SCHEMA or lk.get("image") != image:
        raise OperationFailed(f"{file}: the bundled {lock_rel} is not the lock of {image}")
    wanted = {it.path: it.sha256 for it in _lock_items(file, image, lk, lock_rel)}
    wanted.update({lock_rel: None, env_rel: None})
    extra = sorted(set(got) - set(wanted))
    missing = sorted(set(wanted) - set(got))
    if extra or missing:
        raise OperationFailed(f"{file}: does not match its lock: " + "; ".join(
            ([f"missing {', '.join(missing[:5])}"] if missing else []) +
            ([f"not in the lock: {', '.join(extra[:5])}"] if extra else [])))
    for rel, sha in sorted(wanted.items()):
        if sha is not None and got[rel] != sha:
            raise OperationFailed(f"{file}: {rel} has sha256 {got[rel]}, the bundled lock says {sha}")
    if man["lock_sha256"] != got[lock_rel]:
        raise OperationFailed(f"{file}: {MANIFEST}: lock_sha256 is {man['lock_sha256']}, the bundled {lock_rel} "
                              f"has {got[lock_rel]}")
    # the definition as it will be after the install (its own files, the bundle's pins) must be valid
    d.load(root, image, versions=stage / env_rel, versions_display=f"{file}: {env_rel}")
    if man["definition_sha256"] != definition_digest(img_dir):
        res.notices.append(f"the definition here ({d.display_path(root, img_dir)}) differs from the one the "
                           "bundle was prefetched for (image.yaml, Dockerfiles or files): build with the "
                           "same project commit")
    # everything is verified: move it into place, the lock last
    _install(root, stage, image, lk, res)
    for rel in (env_rel, lock_rel):
        dest = root / rel
        new = (stage / rel).read_bytes()
        if dest.is_file() and dest.read_bytes() == new:
            continue
        if dest.is_file():
            res.replaced.append(rel)
        atomic_write_bytes(dest, new)
    res.notices += _missing_images(lk)
    return res


def _lock_items(file: Path, image: str, lk: dict, lock_rel: str) -> list[Item]:
    """items() of a bundled lock, whose shape nothing has checked yet: a malformed one is an error
    naming it, never a crash."""
    try:
        return items(image, lk, f"{file}: {lock_rel}")
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise OperationFailed(f"{file}: the bundled {lock_rel} is malformed ({type(exc).__name__}: "
                              f"{str(exc)[:80]}): not a lock prefetch wrote", hint="bundle it again") from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


_MAX_META = 16 << 20  # the manifest and SHA256SUMS: far more than any real image needs
_MAX_HEADER = 1 << 20  # a long-name or pax header (tarfile reads one whole into memory)
_MAX_MEMBERS = 100_000
_SHA_RE = re.compile(r"[0-9a-f]{64}")


class _Bad(Exception):
    """A tar header this reader refuses (raised inside tarfile's header parsing)."""


class _Header(tarfile.TarInfo):
    """tarfile's header, refusing an extended header (GNU long name, pax) bigger than _MAX_HEADER:
    tarfile reads one whole into memory before anything else can look at it."""

    def _proc_gnulong(self, tarfile):
        self._small()
        return super()._proc_gnulong(tarfile)

    def _proc_pax(self, tarfile):
        self._small()
        return super()._proc_pax(tarfile)

    def _small(self) -> None:
        if self.size > _MAX_HEADER:
            raise _Bad(f"an extended tar header of {self.size} bytes (at most {_MAX_HEADER})")


def _unreadable(file: Path, exc: BaseException) -> OperationFailed:
    return OperationFailed(f"{file}: not a readable bundle ({exc})",
                           hint="copy it again; `imagebuild bundle IMAGE -o FILE` makes one")


def _headers(file: Path, tf: tarfile.TarFile) -> dict[str, tarfile.TarInfo]:
    """Every member's header, read without its data (tarfile seeks over it): regular files only,
    each once, each path inside the project."""
    heads: dict[str, tarfile.TarInfo] = {}
    try:
        for m in tf:
            name = m.name
            if m.type not in (tarfile.REGTYPE, tarfile.AREGTYPE) or m.issparse():
                sparse = m.issparse() or m.type == tarfile.GNUTYPE_SPARSE
                raise OperationFailed(f"{file}: member {name!r} is not a regular file"
                                      + (f" (a sparse file of {m.size} bytes)" if sparse else "")
                                      + "; refusing the bundle (nothing was extracted)")
            rel = _safe(name, str(file))
            if rel in heads:
                raise OperationFailed(f"{file}: member {rel!r} appears twice; refusing the bundle")
            heads[rel] = m
            if len(heads) > _MAX_MEMBERS:
                raise OperationFailed(f"{file}: more than {_MAX_MEMBERS} members: not an imagebuild bundle")
    except (tarfile.TarError, EOFError, OSError, _Bad) as exc:
        raise _unreadable(file, exc) from None
    return heads


def _read_member(file: Path, tf: tarfile.TarFile, m: tarfile.TarInfo) -> bytes:
    try:
        data = tf.extractfile(m).read(m.size)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise _unreadable(file, exc) from None
    if len(data) != m.size:
        raise _unreadable(file, f"member {m.name!r} is cut short")
    return data


def _bad_manifest(file: Path, key: str, expected: str, got: object) -> OperationFailed:
    from imagebuild.core.errors import excerpt

    return OperationFailed(f"{file}: {MANIFEST}: {key}: expected {expected}, got {excerpt(got)}",
                           hint="not a manifest `imagebuild bundle` wrote: bundle it again")


def _manifest(file: Path, tf: tarfile.TarFile, heads: dict[str, tarfile.TarInfo]) -> dict:
    """The manifest, read and checked field by field before any member is extracted; the members'
    names and sizes must be exactly what it lists, and SHA256SUMS exactly what it implies."""
    if MANIFEST not in heads or SUMS not in heads:
        raise OperationFailed(f"{file}: no {MANIFEST} / {SUMS}: not an imagebuild bundle (or cut short)",
                              hint="copy it again")
    for name in (MANIFEST, SUMS):
        if heads[name].size > _MAX_META:
            raise OperationFailed(f"{file}: member {name} is {heads[name].size} bytes (at most {_MAX_META}): "
                                  "not an imagebuild bundle")
    try:
        man = json.loads(_read_member(file, tf, heads[MANIFEST]).decode("utf-8"))
    except ValueError as exc:
        raise OperationFailed(f"{file}: unreadable {MANIFEST}: {exc}") from None
    if not isinstance(man, dict) or man.get("schema") != SCHEMA or man.get("version") != VERSION \
            or isinstance(man.get("version"), bool):
        raise OperationFailed(f"{file}: {MANIFEST} is not a {SCHEMA} version {VERSION} manifest")
    image = man.get("image")
    if not isinstance(image, str) or not d.NAME_RE.match(image):
        raise _bad_manifest(file, "image", "an image name (a folder name under docker-images/)", image)
    lock_rel = f"{d.IMAGES_DIR}/{image}/{lock_mod.LOCK_FILE}"
    if man.get("lock") != lock_rel:
        raise _bad_manifest(file, "lock", repr(lock_rel), man.get("lock"))
    for key in ("lock_sha256", "definition_sha256", "sums_sha256"):
        if not isinstance(man.get(key), str) or not _SHA_RE.fullmatch(man[key]):
            raise _bad_manifest(file, key, "a sha256 (64 lower-case hex digits)", man.get(key))
    files = man.get("files")
    if not isinstance(files, list) or not files:
        raise _bad_manifest(file, "files", "a list of {path, size, sha256}", files)
    allowed = (lock_rel, f"{d.IMAGES_DIR}/{image}/{d.VERSIONS_FILE}")
    seen: set[str] = set()
    for i, f in enumerate(files):
        where = f"files[{i}]"
        if not isinstance(f, dict) or set(f) != {"path", "size", "sha256"}:
            raise _bad_manifest(file, where, "an object with exactly path, size and sha256", f)
        path, size, sha = f["path"], f["size"], f["sha256"]
        if not isinstance(path, str) or not path or _unsafe(path) \
                or not (path in allowed or path.startswith(f"deps-src/{image}/")):
            raise _bad_manifest(file, f"{where}.path", f"a path under deps-src/{image}/ or {lock_rel}", path)
        if path in seen or path in (MANIFEST, SUMS):
            raise _bad_manifest(file, f"{where}.path", "a path listed once", path)
        seen.add(path)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise _bad_manifest(file, f"{where}.size", "a whole number of bytes >= 0", size)
        if not isinstance(sha, str) or not _SHA_RE.fullmatch(sha):
            raise _bad_manifest(file, f"{where}.sha256", "a sha256 (64 lower-case hex digits)", sha)
    for rel in allowed:
        if rel not in seen:
            raise _bad_manifest(file, "files", f"a list naming {rel}", sorted(seen)[:3])
    members = set(heads) - {MANIFEST, SUMS}
    extra, missing = sorted(members - seen), sorted(seen - members)
    if extra:
        raise OperationFailed(f"{file}: member {extra[0]!r} is not in the manifest; refusing the bundle"
                              + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    if missing:
        raise OperationFailed(f"{file}: the manifest lists {missing[0]!r}, which the bundle lacks "
                              "(cut short?)", hint="copy it again")
    for f in files:
        if heads[f["path"]].size != f["size"]:
            raise OperationFailed(f"{file}: member {f['path']!r} is {heads[f['path']].size} bytes, the manifest "
                                  f"says {f['size']}; refusing the bundle")
    sums = "".join(f"{f['sha256']}  {f['path']}\n" for f in files).encode()
    if heads[SUMS].size != len(sums) or _read_member(file, tf, heads[SUMS]) != sums \
            or hashlib.sha256(sums).hexdigest() != man["sums_sha256"]:
        raise OperationFailed(f"{file}: the manifest, {SUMS} and the members do not agree")
    return man


def _unsafe(rel: str) -> bool:
    p = PurePosixPath(rel)
    return p.is_absolute() or ".." in p.parts or "\\" in rel or p.as_posix() != rel \
        or any(not part.isprintable() for part in p.parts)


def _room(file: Path, where: Path, total: int) -> None:
    """The manifest's sizes bound what unbundle writes: refuse up front where they do not fit."""
    free = shutil.disk_usage(where).free
    if total + (64 << 20) > free:
        raise OperationFailed(f"{file}: its files take {human_bytes(total)}, {where} has {human_bytes(free)} free",
                              hint="free disk (imagebuild gc), then unbundle again")


def _extract(file: Path, tf: tarfile.TarFile, heads: dict[str, tarfile.TarInfo], man: dict,
             stage: Path) -> dict[str, str]:
    """Stream each listed member into ``stage``, at most its manifest size, hashing as it goes; a
    member whose bytes are not the manifest's sha256 stops it. {path: sha256}."""
    out: dict[str, str] = {}
    for f in man["files"]:
        rel, m = f["path"], heads[f["path"]]
        dest = stage / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        try:
            src = tf.extractfile(m)
            with open(dest, "xb") as w:
                _copy_hashed(src, w.write, f["size"], h, _Bad(f"member {rel!r} is cut short"))
        except (tarfile.TarError, EOFError, OSError, _Bad) as exc:
            raise _unreadable(file, exc) from None
        out[rel] = h.hexdigest()
        if out[rel] != f["sha256"]:
            raise OperationFailed(f"{file}: {rel} is damaged (sha256 {out[rel]}, the manifest says {f['sha256']})",
                                  hint="copy the bundle again")
    return out


def _install(root: Path, stage: Path, image: str, lk: dict, res: Result) -> None:
    """Move the verified prefetched files into place. Source tarballs go beside the ones there (a
    tarball's name says what it holds); each wheels/apt stage folder is swapped whole, as prefetch
    leaves it (the build refuses extra files there)."""
    sdeps = stage / "deps-src" / image
    ddeps = state.deps_dir(root, image)
    src = sdeps / "src"
    if src.is_dir():
        _mkdir(ddeps / "src")
        for f in sorted(src.iterdir()):
            os.replace(f, ddeps / "src" / f.name)
    for kind in ("wheels", "apt"):
        kdir = sdeps / kind
        if not kdir.is_dir():
            continue
        for sd in sorted(kdir.iterdir()):
            dest = _mkdir(ddeps / kind) / sd.name
            old = dest.with_name(f".{sd.name}.old.{os.getpid()}")
            if dest.exists():
                os.replace(dest, old)
            os.replace(sd, dest)
            shutil.rmtree(old, ignore_errors=True)


def _missing_images(lk: dict) -> list[str]:
    """Base images the lock pins that the local engine does not have (a warning, not an error)."""
    imgs = lk.get("images") or {}
    if not imgs or not isinstance(imgs, dict):
        return []
    from imagebuild.core import run as run_mod

    out = []
    for key, e in sorted(imgs.items()):
        ref = e.get("ref") if isinstance(e, dict) else None
        if not ref:
            continue
        try:
            r = run_mod.run(["docker", "image", "inspect", "--format", "{{.Id}}", ref], check=False, timeout=60)
        except (OperationFailed, OSError):
            return [f"no Docker engine answered: cannot check that the base images ({', '.join(sorted(imgs))}) "
                    "are here"]
        if r.returncode != 0:
            out.append(f"base image {key}={ref} is not in the local engine: the build needs it "
                       "(`docker save` it where it is and `docker load` it here)")
    return out
