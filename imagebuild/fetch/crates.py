"""Vendoring a tree's Rust crates from its ``Cargo.lock`` files alone: no cargo on the host, no
extracted tree (docs/prefetch.md, "Rust crates").

- **Read**: only the Cargo.lock blobs, from the git mirror (``git cat-file``). Every package with a
  ``source`` is a crate to vendor; one without is the tree's own (a path or workspace member).
- **Registry crates** (``registry+URL`` / ``sparse+URL``): the ``.crate`` file whose sha256 the
  lock records (``checksum``). Where it comes from is the machine's cargo configuration, as cargo
  would read it: ``IMAGEBUILD_CARGO_CONFIG`` when set, else ``$CARGO_HOME/config.toml``, else
  ``~/.cargo/config.toml``; its ``[source.crates-io] replace-with`` chain ends in a sparse registry
  (``registry = "sparse+URL"``: the download URL is the ``dl`` of its ``config.json``) or a
  directory source (``directory = PATH``: crates already unpacked). No registry host name is
  built in: with no such configuration prefetch stops and says what to configure. A downloaded
  ``.crate`` is checked against the lock's sha256 and kept in the cache (``<cache>/crates/
  <sha256>.crate``), so a second prefetch, or ``--offline``, needs no network.
- **Git crates** (``git+URL?rev=..#<commit>``): the commit, fetched through the git cache like every
  other git source (git's own configuration applies: the ``url.<base>.insteadOf`` mirror map,
  credentials, proxies); the package's folder (the ``Cargo.toml`` whose ``[package] name`` is the
  crate's) is copied from that commit.
- **Write**: ``<name>-<version>/`` per crate, with a ``.cargo-checksum.json`` cargo's directory
  sources accept (the sha256 of every file; ``package``: the lock's checksum, null for git crates),
  and the source replacement config (crates-io, every other registry and every git source of the
  locks to the vendored folder, as ``DIR_PLACEHOLDER``). The folder is packed by the caller
  (fetch/cargo.py's tarball layout), keyed by the Cargo.lock files.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import tarfile
import time
import tomllib
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from imagebuild.core import fsutil
from imagebuild.core.errors import OperationFailed
from imagebuild.core.fsutil import atomic_write_bytes
from imagebuild.fetch import gitcache, tarball
from imagebuild.fetch.gitcache import OfflineMissing

log = logging.getLogger("imagebuild")

CONFIG_ENV = "IMAGEBUILD_CARGO_CONFIG"
DIR_PLACEHOLDER = "@IMAGEBUILD_CARGO_VENDOR_DIR@"
# how cargo names crates.io in a Cargo.lock (its source identity, not where anything is downloaded)
CRATES_IO_SOURCE = "registry+https://github.com/rust-lang/crates.io-index"
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
JOBS = 8
# the bound of a cargo config file or a directory source's .cargo-checksum.json (fsutil.read_bytes)
CONFIG_MAX = 8 << 20


@dataclass(frozen=True)
class Crate:
    name: str
    version: str
    source: str  # as in the lock: registry+URL, sparse+URL, git+URL?query#commit
    checksum: str | None
    lockfile: str  # the first Cargo.lock that lists it

    @property
    def dirname(self) -> str:
        return f"{self.name}-{self.version}"

    @property
    def kind(self) -> str:
        return "git" if self.source.startswith("git+") else "registry"


def parse_lock(text: str, path: str) -> list[Crate]:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise OperationFailed(f"{path}: not a Cargo.lock (TOML: {exc})") from None
    meta = doc.get("metadata") or {}
    out = []
    for i, pkg in enumerate(doc.get("package") or ()):
        if not isinstance(pkg, dict) or not isinstance(pkg.get("name"), str) or not isinstance(pkg.get("version"), str):
            raise OperationFailed(f"{path}: [[package]] #{i + 1} has no name or version")
        src = pkg.get("source")
        if not src:
            continue  # the tree's own package
        ck = pkg.get("checksum")
        if ck is None and isinstance(meta, dict):  # a v1 lockfile keeps them in [metadata]
            ck = meta.get(f"checksum {pkg['name']} {pkg['version']} ({src})")
        if ck is not None and not (isinstance(ck, str) and SHA256_RE.match(ck)):
            raise OperationFailed(f"{path}: crate {pkg['name']} {pkg['version']}: checksum {ck!r} is not a sha256")
        out.append(Crate(pkg["name"], pkg["version"], src, ck, path))
    return out


def git_source(source: str) -> tuple[str, str, str | None, str | None]:
    """(url, commit, reference kind, reference) of a ``git+URL?rev=X#commit`` source."""
    rest, _, commit = source[len("git+"):].partition("#")
    url, _, query = rest.partition("?")
    kind = ref = None
    for k, v in urllib.parse.parse_qsl(query):
        if k in ("rev", "branch", "tag"):
            kind, ref = k, v
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise OperationFailed(f"git source {source!r}: no commit after '#'")
    return url, commit, kind, ref


# ----------------------------------------------------------------------------------- configuration


def config_file() -> Path | None:
    explicit = os.environ.get(CONFIG_ENV)
    if explicit:
        return Path(explicit)
    home = Path(os.environ["CARGO_HOME"]) if os.environ.get("CARGO_HOME") else Path.home() / ".cargo"
    for name in ("config.toml", "config"):
        if (home / name).is_file():
            return home / name
    return None


@dataclass(frozen=True)
class Registry:
    kind: str  # "sparse" or "directory"
    where: str  # the sparse index URL (without sparse+) or the directory
    origin: str  # the config file and source that say so


def registry_for(source: str) -> Registry:
    """Where the crates of a registry ``source`` of a Cargo.lock come from (the machine's cargo config)."""
    cfg = config_file()
    doc: dict = {}
    if cfg is not None:
        try:
            doc = tomllib.loads(fsutil.read_text(cfg, CONFIG_MAX))
        except UnicodeDecodeError as exc:
            raise OperationFailed(f"{cfg}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except OSError as exc:
            raise OperationFailed(f"{CONFIG_ENV}={cfg}: cannot read it ({exc.strerror})",
                                  hint="point it at a cargo config file (config.toml)") from None
        except tomllib.TOMLDecodeError as exc:
            raise OperationFailed(f"{cfg}: not TOML ({exc})") from None
    sources = doc.get("source") if isinstance(doc.get("source"), dict) else {}
    if source == CRATES_IO_SOURCE:
        name = "crates-io"
    else:
        bare = source.removeprefix("registry+")
        name = next((n for n, t in sources.items() if isinstance(t, dict) and t.get("registry") in (bare, source)), None)
        if name is None and source.startswith("sparse+"):
            return Registry("sparse", source[len("sparse+"):], "the Cargo.lock's own source")
    seen = []
    while name is not None and name not in seen:
        seen.append(name)
        t = sources.get(name) if isinstance(sources.get(name), dict) else {}
        if isinstance(t.get("replace-with"), str):
            name = t["replace-with"]
            continue
        reg, dir_ = t.get("registry"), t.get("directory")
        if isinstance(dir_, str):
            return Registry("directory", dir_, f"{cfg}: [source.{name}]")
        if isinstance(reg, str) and reg.startswith("sparse+") and len(seen) > 1:
            return Registry("sparse", reg[len("sparse+"):], f"{cfg}: [source.{name}]")
        break
    raise OperationFailed(
        f"no registry to take the crates of {source} from: "
        + (f"{cfg} does not replace it with a sparse registry or a directory source" if cfg
           else f"no cargo config ({CONFIG_ENV}, $CARGO_HOME/config.toml, ~/.cargo/config.toml)"),
        hint="prefetch reads crates from the machine's cargo config, never from a built-in host: add "
        "[source.crates-io] replace-with = \"mirror\" and [source.mirror] registry = \"sparse+<index URL>/\" "
        "(or directory = \"<path>\"); docs/prefetch.md, \"Rust crates\"")


# ------------------------------------------------------------------------------------------ download


def http_get(url: str, what: str) -> bytes:
    import urllib.error  # only when something is downloaded (http.client, ssl: slow to import)
    import urllib.request

    timeout = float(os.environ.get("CARGO_HTTP_TIMEOUT", "30"))
    attempts = 1 + int(os.environ.get("CARGO_NET_RETRY", "2"))
    last = ""
    for attempt in range(attempts):
        if attempt:
            time.sleep(min(2.0 ** attempt, 10.0) * float(os.environ.get("IMAGEBUILD_RETRY_DELAY", "1")))
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (the configured registry)
                return resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403, 404, 410):
                raise OperationFailed(f"{what}: {gitcache.redact(url)}: HTTP {exc.code}") from None
            last = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            last = str(getattr(exc, "reason", exc))
    raise OperationFailed(f"{what}: {gitcache.redact(url)}: {last} (after {attempts} attempts)",
                          hint="check the network and the cargo config's registry; retries: CARGO_NET_RETRY, "
                          "timeout: CARGO_HTTP_TIMEOUT")


class _Dl:
    """The download URL template of each sparse registry (its config.json ``dl``), read once."""

    def __init__(self):
        self._dl: dict[str, str] = {}

    def url(self, reg: Registry, c: Crate) -> str:
        if reg.where not in self._dl:
            base = reg.where if reg.where.endswith("/") else reg.where + "/"
            raw = http_get(base + "config.json", f"registry {gitcache.redact(reg.where)} ({reg.origin})")
            try:
                dl = json.loads(raw)["dl"]
            except (ValueError, KeyError, TypeError):
                raise OperationFailed(f"{gitcache.redact(base)}config.json has no \"dl\" ({reg.origin})") from None
            self._dl[reg.where] = dl
        dl = self._dl[reg.where]
        def pre(n: str) -> str:  # the index's directory prefix of a name (cargo's registry docs)
            return {1: "1", 2: "2", 3: f"3/{n[:1]}"}.get(len(n), f"{n[:2]}/{n[2:4]}")

        marks = {"{crate}": c.name, "{version}": c.version, "{prefix}": pre(c.name), "{lowerprefix}": pre(c.name.lower()),
                 "{sha256-checksum}": c.checksum or ""}
        if not any(k in dl for k in marks):
            return f"{dl.rstrip('/')}/{c.name}/{c.version}/download"
        for k, v in marks.items():
            dl = dl.replace(k, v)
        return dl


# --------------------------------------------------------------------------------------------- vendor


@dataclass
class Result:
    registry: int
    git: int
    config: str


def _checksum_json(folder: Path, package: str | None) -> None:
    files = {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}
    (folder / ".cargo-checksum.json").write_text(json.dumps({"files": files, "package": package}, sort_keys=True))


def _unpack_crate(data: bytes, c: Crate, out: Path) -> None:
    top = c.dirname
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tf:
            for mem in tf.getmembers():
                parts = PurePosixPath(mem.name).parts
                if not parts or parts[0] != top or ".." in parts:
                    raise OperationFailed(f"crate {c.name} {c.version}: {mem.name!r} is outside {top}/")
            tf.extractall(out, filter="data")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise OperationFailed(f"crate {c.name} {c.version}: not a .crate archive ({exc})") from None
    (out / top / ".cargo-ok").unlink(missing_ok=True)
    _checksum_json(out / top, c.checksum)


def _registry_crate(c: Crate, out: Path, cache_dir: Path, offline: bool, dl: _Dl, source_name: str) -> None:
    where = f"{source_name}: {c.lockfile}: crate {c.name} {c.version}"
    if not c.checksum:
        reg = registry_for(c.source)
        if reg.kind != "directory":
            raise OperationFailed(f"{where}: the Cargo.lock records no checksum for a registry crate")
    cached = cache_dir / f"{c.checksum}.crate" if c.checksum else None
    if cached is not None and cached.is_file():
        data = cached.read_bytes()
        if hashlib.sha256(data).hexdigest() == c.checksum:
            _unpack_crate(data, c, out)
            return
        cached.unlink()
    reg = registry_for(c.source)
    if reg.kind == "directory":
        src = Path(reg.where) / c.dirname
        if not (src / "Cargo.toml").is_file():
            raise OperationFailed(f"{where}: not in the directory source {reg.where} ({reg.origin})")
        recorded = None
        try:
            recorded = json.loads(fsutil.read_text(src / ".cargo-checksum.json", CONFIG_MAX)).get("package")
        except (OSError, ValueError, AttributeError):  # absent, unreadable, special (fsutil.UnfitFile): no record
            pass
        if c.checksum and recorded and recorded != c.checksum:
            raise OperationFailed(f"{where}: the directory source's package checksum {recorded} is not the "
                                  f"lock's {c.checksum} ({reg.origin})")
        shutil.copytree(src, out / c.dirname, symlinks=True, ignore=shutil.ignore_patterns(".cargo-checksum.json"))
        _checksum_json(out / c.dirname, c.checksum)
        return
    if offline:
        raise OfflineMissing(f"{where}: --offline: not in the crates cache ({cache_dir})",
                             hint="run prefetch without --offline once to fill the cache")
    url = dl.url(reg, c)
    data = http_get(url, where)
    got = hashlib.sha256(data).hexdigest()
    if got != c.checksum:
        raise OperationFailed(f"{where}: {gitcache.redact(url)} has sha256 {got}, the Cargo.lock says {c.checksum}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(cached, data)
    _unpack_crate(data, c, out)


def _git_crate(c: Crate, out: Path, cache: gitcache.Cache, source_name: str) -> None:
    url, commit, _kind, _ref = git_source(c.source)
    where = f"{source_name}: {c.lockfile}: crate {c.name} {c.version} (git {gitcache.redact(url)})"
    m = cache.mirror(url)
    m.fetch([commit], where)
    listing = tarball.list_tree(m, commit)
    folder = None
    for _mode, sha, path in listing:
        if PurePosixPath(path).name != "Cargo.toml":
            continue
        try:
            doc = tomllib.loads(m.out("cat-file", "blob", sha))
        except tomllib.TOMLDecodeError:
            continue
        pkg = doc.get("package")
        if isinstance(pkg, dict) and pkg.get("name") == c.name:
            folder = str(PurePosixPath(path).parent)
            break
    if folder is None:
        raise OperationFailed(f"{where}: commit {commit[:12]} has no Cargo.toml of package {c.name}")
    prefix = "" if folder == "." else folder + "/"
    others = {str(PurePosixPath(p).parent) + "/" for _m, _s, p in listing
              if PurePosixPath(p).name == "Cargo.toml" and p.startswith(prefix) and p != prefix + "Cargo.toml"}
    dest = out / c.dirname
    dest.mkdir()
    for mode, sha, path in listing:
        if not path.startswith(prefix) or mode == "160000" or any(path.startswith(o) for o in others):
            continue
        rel = path[len(prefix):]
        if rel.split("/")[0] in ("target", ".git"):
            continue
        p = dest / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        data = m.git("cat-file", "blob", sha).stdout
        if mode == "120000":
            os.symlink(data.decode("utf-8", "surrogateescape"), p)
        else:
            p.write_bytes(data)
            if mode == "100755":
                p.chmod(0o755)
    _checksum_json(dest, None)


def vendor(source_name: str, lock_texts: list[tuple[str, str]], out: Path, cache: gitcache.Cache) -> Result:
    """Vendor every crate of ``lock_texts`` ((path, text) of each Cargo.lock) into ``out`` (a new,
    empty folder). Raises OperationFailed naming the source, the Cargo.lock and the crate."""
    crates: dict[str, Crate] = {}
    for path, text in lock_texts:
        for c in parse_lock(text, path):
            prev = crates.get(c.dirname)
            if prev is None:
                crates[c.dirname] = c
            elif (prev.source.split("#")[0], prev.checksum) != (c.source.split("#")[0], c.checksum) \
                    and prev.source != c.source:
                raise OperationFailed(f"{source_name}: crate {c.dirname} comes from two sources "
                                      f"({prev.lockfile}: {prev.source}; {c.lockfile}: {c.source}): one vendor "
                                      "folder cannot hold both")
    out.mkdir(parents=True, exist_ok=True)
    cache_dir = cache.root / "crates"
    dl = _Dl()
    reg = [c for c in crates.values() if c.kind == "registry"]
    git = [c for c in crates.values() if c.kind == "git"]
    for c in reg + git:
        if not (c.source.startswith(("registry+", "sparse+", "git+"))):
            raise OperationFailed(f"{source_name}: {c.lockfile}: crate {c.dirname}: source {c.source!r} is of a "
                                  "kind prefetch cannot vendor")
    with ThreadPoolExecutor(max_workers=JOBS) as ex:
        futs = [ex.submit(_registry_crate, c, out, cache_dir, cache.offline, dl, source_name) for c in reg]
        for f in futs:
            f.result()
    for c in git:
        _git_crate(c, out, cache, source_name)
    return Result(len(reg), len(git), replacement_config(crates.values()))


def replacement_config(crates) -> str:
    """The source replacement that points cargo at the vendored folder (``DIR_PLACEHOLDER``)."""
    lines: list[str] = []
    regs = sorted({c.source for c in crates if c.kind == "registry"})
    gits = sorted({c.source.split("#")[0] for c in crates if c.kind == "git"})
    lines += ["[source.crates-io]", 'replace-with = "vendored-sources"', ""]
    for s in regs:
        if s == CRATES_IO_SOURCE:
            continue
        value = s.removeprefix("registry+")
        lines += [f'[source."{s}"]', f"registry = {json.dumps(value)}", 'replace-with = "vendored-sources"', ""]
    for s in gits:
        url, _c, kind, ref = git_source(s + "#" + "0" * 40)
        lines += [f'[source."{s}"]', f"git = {json.dumps(url)}"]
        if kind:
            lines.append(f"{kind} = {json.dumps(ref)}")
        lines += ['replace-with = "vendored-sources"', ""]
    lines += ["[source.vendored-sources]", f'directory = "{DIR_PLACEHOLDER}"']
    return "\n".join(lines) + "\n"
