"""One verified file that carries an image's prefetched inputs to a node that cannot reach GitHub.

``imagebuild bundle IMAGE -o FILE`` writes a plain tar (its contents are compressed already)
holding, under their project paths:

- ``docker-images/<image>/lock.json`` and ``versions.env`` (the pins prefetch wrote);
- every file the lock names: each source tarball (``deps-src/<image>/src/``, with its
  ``SHA256SUMS``), each wheel and the generated ``requirements.txt``, each deb and the generated
  ``Packages`` and ``install.sh``;
- ``SHA256SUMS`` (every file above, ``sha256sum -c`` format) and ``imagebuild-bundle.json`` (the
  manifest: image, lock sha256, each file's size and sha256, the definition's digest), last.

Every file is checked against the lock while it is written: a damaged or missing local file
stops the bundle (nothing is left at FILE). The archive is deterministic: sorted names, mtime 0,
owner 0, mode 0644, so the same lock and files give the same bytes.

``imagebuild unbundle FILE`` reads the bundle into a temporary folder inside the project,
checks every member against the manifest and ``SHA256SUMS`` and every file against the
bundled lock (nothing missing, nothing extra, no path outside its place), and only then moves
the files into place: the prefetched folders first, ``versions.env``, then ``lock.json`` (the
commit point). A bad bundle changes nothing. After it, ``imagebuild build IMAGE`` needs no
network (base images aside: unbundle says which ones the local engine lacks).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
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
from imagebuild.definition import reader as d

log = logging.getLogger("imagebuild")

SCHEMA = "imagebuild.bundle"
VERSION = 1
MANIFEST = "imagebuild-bundle.json"
SUMS = "SHA256SUMS"
SRC_SUMS = "SHA256SUMS"  # beside the source tarballs (prefetch.SUMS_FILE)
_CHUNK = 4 << 20


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
    if lock.get("sources"):
        out[f"deps-src/{image}/src/{SRC_SUMS}"] = Item(f"deps-src/{image}/src/{SRC_SUMS}", _src_sums_sha(lock))
    for section, extra in (("wheels", "install_requirements"), ("apt", "generated")):
        for stage, e in sorted((lock.get(section) or {}).items()):
            if not isinstance(e, dict):
                continue
            base = _safe(e.get("dir") or f"deps-src/{image}/{section}/{stage}", f"{section}.{stage}.dir")
            for f in e.get("files") or []:
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
        left = size
        while left:
            chunk = src.read(min(_CHUNK, left))
            if not chunk:
                raise OperationFailed(f"{name}: changed while it was being bundled")
            h.update(chunk)
            self._write(chunk)
            left -= len(chunk)
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
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    manifest_files = []
    total = 0
    try:
        with open(tmp, "wb") as raw:
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
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    log.info("%s: bundled %d files (%.1f MB) into %s", image, len(manifest_files), total / 1e6, output)
    return Result(image, str(output), len(manifest_files), total, time.monotonic() - t0)


def _bytes(data: bytes):
    import io
    return io.BytesIO(data)


# ------------------------------------------------------------------------------------------------ unbundle


def unbundle(ctx: context_mod.Context | Path, file: Path) -> Result:
    """Verify ``file`` completely, then put its files in place under the project's root."""
    t0 = time.monotonic()
    file = Path(file)
    if not file.is_file():
        raise UsageError(f"{file}: no such bundle file")
    root = context_mod.of(ctx).root
    deps = root / "deps-src"
    made = not deps.exists()
    for old in deps.glob(".unbundle-*.tmp") if deps.is_dir() else ():  # left by a killed run
        pid = old.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    stage = Path(tempfile.mkdtemp(prefix=f".unbundle-{os.getpid()}-", suffix=".tmp", dir=_mkdir(deps)))
    done = False
    try:
        got = _read(file, stage)
        man = _manifest(file, got, stage)
        image = man["image"]
        d.check_image_name(image)
        res = Result(image, str(file))
        img_dir = root / d.IMAGES_DIR / image
        if not (img_dir / d.IMAGE_FILE).is_file():
            raise DefinitionError([Problem(d.display_path(root, img_dir), "no such image definition here: the "
                                             "bundle carries the pins and prefetched files, not the definition",
                                             key="IMAGE", hint="check out the project (the same commit as where "
                                             "the bundle was made) first")], image=image)
        lock_rel = f"{d.IMAGES_DIR}/{image}/{lock_mod.LOCK_FILE}"
        env_rel = f"{d.IMAGES_DIR}/{image}/{d.VERSIONS_FILE}"
        try:
            lk = json.loads((stage / lock_rel).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise OperationFailed(f"{file}: the bundled {lock_rel} is unreadable: {exc}") from None
        if lk.get("schema") != lock_mod.LOCK_SCHEMA or lk.get("image") != image:
            raise OperationFailed(f"{file}: the bundled {lock_rel} is not the lock of {image}")
        wanted = {it.path: it.sha256 for it in items(image, lk, f"{file}: {lock_rel}")}
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
        if man.get("definition_sha256") != definition_digest(img_dir):
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
        res.files = len(got)
        res.bytes = sum(f["size"] for f in man["files"])
        res.notices += _missing_images(lk)
        res.seconds = time.monotonic() - t0
        log.info("%s: unbundled %d files (%.1f MB) from %s", image, res.files, res.bytes / 1e6, file)
        done = True
        return res
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if made and not done:  # leave the project as it was
            try:
                deps.rmdir()
            except OSError:
                pass


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


def _read(file: Path, stage: Path) -> dict[str, str]:
    """Extract every member into ``stage`` (regular files only, paths checked); {path: sha256}."""
    out: dict[str, str] = {}
    try:
        with tarfile.open(file, mode="r:") as tf:
            for m in tf:
                name = m.name
                if not m.isreg():
                    raise OperationFailed(f"{file}: member {name!r} is not a regular file; refusing the bundle")
                rel = _safe(name, str(file))
                if rel in out:
                    raise OperationFailed(f"{file}: member {rel!r} appears twice; refusing the bundle")
                dest = stage / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                h = hashlib.sha256()
                src = tf.extractfile(m)
                with open(dest, "wb") as f:
                    while chunk := src.read(_CHUNK):
                        h.update(chunk)
                        f.write(chunk)
                out[rel] = h.hexdigest()
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise OperationFailed(f"{file}: not a readable bundle ({exc})",
                              hint="copy it again; `imagebuild bundle IMAGE -o FILE` makes one") from None
    return out


def _manifest(file: Path, got: dict[str, str], stage: Path) -> dict:
    if MANIFEST not in got or SUMS not in got:
        raise OperationFailed(f"{file}: no {MANIFEST} / {SUMS}: not an imagebuild bundle (or cut short)",
                              hint="copy it again")
    try:
        man = json.loads((stage / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OperationFailed(f"{file}: unreadable {MANIFEST}: {exc}") from None
    if not isinstance(man, dict) or man.get("schema") != SCHEMA or man.get("version") != VERSION:
        raise OperationFailed(f"{file}: {MANIFEST} is not a {SCHEMA} version {VERSION} manifest")
    if got[SUMS] != man.get("sums_sha256"):
        raise OperationFailed(f"{file}: {SUMS} does not match the manifest")
    listed = {f["path"]: f["sha256"] for f in man.get("files") or []}
    sums = {}
    for line in (stage / SUMS).read_text(encoding="utf-8").splitlines():
        sha, _, rel = line.partition("  ")
        sums[rel] = sha
    members = {k: v for k, v in got.items() if k not in (MANIFEST, SUMS)}
    if listed != sums or set(listed) != set(members):
        raise OperationFailed(f"{file}: the manifest, {SUMS} and the members do not agree")
    for rel, sha in sorted(members.items()):
        if listed[rel] != sha:
            raise OperationFailed(f"{file}: {rel} is damaged (sha256 {sha}, the manifest says {listed[rel]})",
                                  hint="copy the bundle again")
    for k in (MANIFEST, SUMS):
        got.pop(k)
    return man


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
    if not imgs:
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
