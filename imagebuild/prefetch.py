"""``imagebuild prefetch``: pin every git source by SHA, compose the forks, pack deterministic
tarballs and write the lock, so that the build needs no network.

Per image (docs/prefetch.md):

1. **Fast path**: when every pin is a SHA, the lock's ``sources`` section matches the definition
   and every tarball still has the lock's digest, nothing is run at all (no git, no network).
2. **Resolve** (network only for what is unpinned, or with ``--refresh``): ref names and bare PR
   numbers via ``git ls-remote`` (``refs/pull/N/head``); PR state from the GitHub API when
   reachable.
3. **Fetch** into the mirror cache (gitcache.py) only the commits that are missing, by raw SHA.
4. **Compose** (compose.py): base, then each PR merged in order; record the tree hash.
5. **FetchContent** (fetchcontent.py): every declaration in the composed tree must be pinned.
6. **Submodules** of sources that want them, fetched by the SHAs their parents record.
7. **Pack** (tarball.py) ``deps-src/<image>/src/<name>-<tree12>.tar.gz`` + ``SHA256SUMS``.
8. **Commit**: versions.env pins written back in place, then the lock (the commit point; a
   failure or interruption before it leaves the previous lock and tarballs as they were), then
   ``SHA256SUMS`` and the removal of tarballs no lock refers to.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import compose as compose_mod
from . import definition as d
from . import fetchcontent, gitcache, lock, packages, state, tarball
from .errors import CommandFailed, DefinitionError, OperationFailed, Problem, UsageError
from .fsutil import atomic_write_text, sha256_file

log = logging.getLogger("imagebuild")

REPORT_SCHEMA = "imagebuild.prefetch"
REPORT_VERSION = 1
SHA_RE = re.compile(r"[0-9a-f]{40}\Z")
SUMS_FILE = "SHA256SUMS"
GITHUB_API_DEFAULT = "https://api.github.com"


# ------------------------------------------------------------------------------------------------ model


@dataclass
class Pin:
    """One git source of one image, being resolved."""

    name: str
    repo: str
    ref: str  # 40-hex once resolved
    prs: list[list]  # [[number, sha or None], ...]
    opts: d.SourceOptions
    ref_key: str
    prs_key: str

    def shas(self) -> list[str]:
        return [self.ref] + [sha for _, sha in self.prs]

    def what(self, sha: str) -> str:
        if sha == self.ref:
            return self.ref_key
        for num, s in self.prs:
            if s == sha:
                return f"{self.prs_key} {num}"
        return self.name

    def prs_value(self) -> str:
        return " ".join(f"{n}@{s}" if s else str(n) for n, s in self.prs)


@dataclass
class ImageReport:
    image: str
    status: str = "ok"  # "ok" (written) or "unchanged" (fast path)
    lock: str | None = None
    build_id: str | None = None
    sources: dict = field(default_factory=dict)
    pinned: list[dict] = field(default_factory=list)  # versions.env keys written back
    moved: list[dict] = field(default_factory=list)  # --refresh: PR heads that moved
    pr_states: list[dict] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    packages: dict | None = None  # base images, wheels, apt (packages.summary)

    def as_dict(self) -> dict:
        return {"image": self.image, "status": self.status, "lock": self.lock, "build_id": self.build_id,
                "sources": self.sources, "pinned": self.pinned, "moved": self.moved,
                "pr_states": self.pr_states, "notices": self.notices, "packages": self.packages}


@dataclass
class Report:
    images: list[ImageReport]
    cache: str
    network_operations: int
    fetches: int
    retries: int
    seconds: float

    def as_dict(self) -> dict:
        return {"schema": REPORT_SCHEMA, "version": REPORT_VERSION, "cache": self.cache,
                "network_operations": self.network_operations, "fetches": self.fetches,
                "retries": self.retries, "images": [i.as_dict() for i in self.images]}


# ------------------------------------------------------------------------------------------------ entry


def prefetch(root: Path, images: list[str] | None = None, *, refresh: list[str] | None = None,
             offline: bool = False, jobs: int = 4, cache_dir: str | os.PathLike | None = None) -> Report:
    """Prefetch ``images`` (default: every image with git sources). ``refresh``: None = no
    refresh, [] = every source, [NAME...] = those sources."""
    t0 = time.monotonic()
    if jobs < 1:
        raise UsageError(f"--jobs {jobs}: expected a positive number")
    if offline and refresh is not None:
        raise UsageError("--refresh needs the network; it cannot be combined with --offline")
    root = Path(root).resolve()
    if images:
        defns = [d.load(root, n) for n in images]
    else:  # every image with git sources or packages (a broken definition is reported, not skipped)
        defns = [x for x in (d.load(root, n) for n in d.list_images(root))
                 if x.sources or packages.has_packages(x)]
    names = [x.name for x in defns]
    if refresh:
        known = {s for defn in defns for s in defn.sources}
        unknown = [r for r in refresh if r not in known]
        if unknown:
            raise UsageError(f"--refresh {unknown[0]}: no such git source in "
                             f"{', '.join(names) or 'any image'}",
                             hint=f"known sources: {', '.join(sorted(known)) or 'none'}")
    cache = gitcache.Cache(gitcache.default_cache_dir(cache_dir), offline=offline)
    reports = []
    for defn in defns:
        ir = _prefetch_image(defn, cache, refresh, jobs)
        if packages.has_packages(defn):  # base images by digest, wheels, apt debs (packages.py)
            _, prep = packages.prefetch_packages(root, defn.name, offline=offline)
            ir.packages = packages.summary(prep)
            ir.lock, ir.build_id = defn.rel(lock.lock_path(defn.dir)), _build_id(defn)
        reports.append(ir)
    st = cache.stats
    return Report(reports, str(cache.root), st.network, st.fetch, st.retries, time.monotonic() - t0)


def _pmap(fn: Callable, items: Iterable, jobs: int) -> list:
    """``fn`` over ``items`` with ``jobs`` threads; the first error (in item order) is raised."""
    items = list(items)
    if jobs <= 1 or len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=min(jobs, len(items))) as ex:
        futs = [ex.submit(fn, i) for i in items]
        return [f.result() for f in futs]


# ------------------------------------------------------------------------------------------------ image


def _pins(defn: d.Definition) -> dict[str, Pin]:
    out = {}
    for name, src in sorted(defn.sources.items()):
        opts = defn.source_options.get(name) or d.default_source_options(name)
        out[name] = Pin(name, src.repo, src.ref, [[p.number, p.sha] for p in src.prs], opts,
                        f"{name}_REF", f"{name}_PRS")
    return out


def _prefetch_image(defn: d.Definition, cache: gitcache.Cache, refresh: list[str] | None, jobs: int) -> ImageReport:
    rep = ImageReport(defn.name)
    ddir = state.deps_dir(defn.root, defn.name)
    srcdir = ddir / "src"
    lock_disp = defn.rel(lock.lock_path(defn.dir))
    old_lock = lock.read(defn.dir, lock_disp)
    pins = _pins(defn)
    refreshing = refresh is not None and (not refresh or any(n in pins for n in refresh))
    if not pins:
        log.info("%s: no git sources", defn.name)
        rep.status = "unchanged"
        return rep

    if not refreshing and old_lock is not None:
        fast = _fast_path(defn, pins, old_lock)
        if fast is not None:
            log.info("%s: %d sources unchanged (lock and tarballs verified; nothing fetched)",
                     defn.name, len(pins))
            rep.status = "unchanged"
            rep.sources = fast
            rep.lock = lock_disp
            rep.build_id = _build_id(defn)
            return rep

    _clean_stale_tmp(srcdir)
    log.info("%s: %d git sources", defn.name, len(pins))

    # 2. resolve
    todo = [p for p in pins.values()
            if not SHA_RE.match(p.ref) or any(s is None for _, s in p.prs)
            or (refresh is not None and (not refresh or p.name in refresh) and p.prs)]
    _pmap(lambda p: _resolve(p, cache, refresh, rep), todo, jobs)

    # 3. fetch, grouped by URL (one fetch per mirror)
    by_url: dict[str, list[Pin]] = {}
    for p in pins.values():
        by_url.setdefault(p.repo, []).append(p)
    _pmap(lambda item: _fetch(cache, item[0], item[1]), sorted(by_url.items()), jobs)

    # 4. compose
    composed: dict[str, compose_mod.Composed] = {}

    def do_compose(p: Pin) -> None:
        m = cache.mirror(p.repo)
        composed[p.name] = _local(lambda: compose_mod.compose(m, p.name, p.ref, [(n, s) for n, s in p.prs]))

    _pmap(do_compose, pins.values(), jobs)

    # 5. FetchContent
    scans = _check_fetchcontent(defn, pins, composed, cache, rep)

    # 6. submodules + 7. pack
    srcdir.mkdir(parents=True, exist_ok=True)

    def do_pack(p: Pin) -> dict:
        m = cache.mirror(p.repo)
        c = composed[p.name]
        tree = _local(lambda: compose_mod.subtree(m, p.name, c.commit, p.opts.subdir))
        entries = _entries(cache, p, m, c.commit, p.opts.subdir, p.opts.submodules, p.repo, "")
        fname = f"{p.name.lower()}-{tree[:12]}.tar.gz"
        dest = srcdir / fname
        log.info("  %s: packing %d files into %s", p.name, len(entries), defn.rel(dest))
        digest = _local(lambda: tarball.pack(entries, dest, c.epoch))
        parent_scan = scans.get(p.opts.dependency_of) if p.opts.dependency_of else None
        decl = parent_scan.get(p.opts.declares.lower()) if parent_scan else None
        return {
            "repo": p.repo, "ref": p.ref, "prs": [{"number": n, "sha": s} for n, s in p.prs],
            "commit": c.commit, "tree": tree, "source_date_epoch": c.epoch,
            "tarball": d.display_path(defn.root, dest), "sha256": digest,
            "dependency_of": p.opts.dependency_of,
            "declared_as": _declared_as(decl) if decl else None,
            "env": p.opts.env, "subdir": p.opts.subdir, "submodules": p.opts.submodules,
            "fetchcontent": ([_decl_entry(x, pins, p.name) for x in sorted(scans[p.name].values(),
                                                                             key=lambda x: x.name.lower())]
                             if p.name in scans else None),
        }

    entries = _pmap(do_pack, pins.values(), jobs)
    sources = {p.name: e for p, e in zip(pins.values(), entries, strict=True)}

    # 8. commit: versions.env, the lock (the commit point), then SHA256SUMS and pruning
    updates = {}
    for p in pins.values():
        src = defn.sources[p.name]
        if src.ref != p.ref:
            updates[p.ref_key] = p.ref
            rep.pinned.append({"key": p.ref_key, "from": src.ref, "to": p.ref})
        old = src.pins()["prs"]
        new = [f"{n}@{s}" for n, s in p.prs]
        if old != new:
            updates[p.prs_key] = p.prs_value()
            rep.pinned.append({"key": p.prs_key, "from": " ".join(old), "to": p.prs_value()})
    if updates:
        defn.env.update(updates)
        for u in rep.pinned:
            log.info("  pinned %s=%s in %s", u["key"], u["to"], defn.env.display)
    lock.update_sections(defn.dir, defn.name, {"sources": sources})
    sums = "".join(f"{e['sha256']}  {Path(e['tarball']).name}\n"
                   for e in sorted(sources.values(), key=lambda e: Path(e["tarball"]).name))
    atomic_write_text(srcdir / SUMS_FILE, sums)
    _prune(srcdir, {Path(e["tarball"]).name for e in sources.values()})
    rep.sources = sources
    rep.lock = lock_disp
    rep.build_id = _build_id(defn)
    log.info("%s: wrote %s (build id %s)", defn.name, lock_disp, rep.build_id)
    return rep


def _build_id(defn: d.Definition) -> str:
    from .plan import make_plan

    return make_plan(d.load(defn.root, defn.name)).build_id


def _local(fn):
    """Run a local git step; a failing git command becomes an OperationFailed with its output."""
    try:
        return fn()
    except CommandFailed as exc:
        raise OperationFailed(exc.message) from None


# ------------------------------------------------------------------------------------------------ fast path


def _fast_path(defn: d.Definition, pins: dict[str, Pin], old: dict) -> dict | None:
    """The lock's sources when they still describe the definition and the tarballs are intact."""
    srcs = old.get("sources")
    if not isinstance(srcs, dict) or set(srcs) != set(pins):
        return None
    for p in pins.values():
        e = srcs[p.name]
        if not isinstance(e, dict):
            return None
        if not SHA_RE.match(p.ref) or any(s is None for _, s in p.prs):
            return None
        want = {"repo": p.repo, "ref": p.ref, "prs": [{"number": n, "sha": s} for n, s in p.prs],
                "dependency_of": p.opts.dependency_of, "env": p.opts.env, "subdir": p.opts.subdir,
                "submodules": p.opts.submodules}
        if any(e.get(k) != v for k, v in want.items()):
            return None
        if (e.get("fetchcontent") is not None) != p.opts.scan_fetchcontent:
            return None
        decl = e.get("declared_as")
        if decl is not None and str(decl.get("name", "")).lower() != p.opts.declares.lower():
            return None
        tb = e.get("tarball")
        if not isinstance(tb, str):
            return None
        path = defn.root / tb
        if not path.is_file() or sha256_file(path) != e.get("sha256"):
            return None
    sums = state.deps_dir(defn.root, defn.name) / "src" / SUMS_FILE
    if not sums.is_file():
        return None
    return srcs


# ------------------------------------------------------------------------------------------------ resolve


def _resolve(p: Pin, cache: gitcache.Cache, refresh: list[str] | None, rep: ImageReport) -> None:
    m = cache.mirror(p.repo)
    patterns = []
    ref_is_name = not SHA_RE.match(p.ref)
    if ref_is_name:
        patterns += [f"refs/heads/{p.ref}", f"refs/tags/{p.ref}", f"refs/tags/{p.ref}^{{}}"]
    refreshing = refresh is not None and (not refresh or p.name in refresh)
    want_prs = [n for n, s in p.prs if s is None or refreshing]
    patterns += [f"refs/pull/{n}/head" for n in want_prs]
    if not patterns:
        return
    log.info("  %s: resolving %s on %s", p.name,
             ", ".join(([p.ref] if ref_is_name else []) + [f"PR {n}" for n in want_prs]), gitcache.redact(p.repo))
    if cache.offline:
        raise gitcache.OfflineMissing(
            f"{p.name}: --offline, but {p.ref_key if ref_is_name else p.prs_key} is not pinned to a commit "
            f"({p.ref if ref_is_name else ', '.join(str(n) for n in want_prs)})",
            hint="run prefetch once with the network to pin it")
    refs = m.ls_remote(patterns, p.name)
    if ref_is_name:
        sha = (refs.get(f"refs/tags/{p.ref}^{{}}") or refs.get(f"refs/tags/{p.ref}")
               or refs.get(f"refs/heads/{p.ref}"))
        if not sha:
            raise gitcache.RemoteMissing(f"{p.name}: {p.ref_key}={p.ref}: no branch or tag of that name on "
                                         f"{gitcache.redact(p.repo)}",
                                         hint=f"set {p.ref_key} to a full 40-hex commit sha")
        p.ref = sha
    states = _github_states(p.repo, want_prs)
    for item in p.prs:
        n, old = item
        if n not in want_prs:
            continue
        head = refs.get(f"refs/pull/{n}/head")
        st = states.get(n)
        if st:
            rep.pr_states.append({"source": p.name, "number": n, **st})
            if st.get("state") == "closed" and not st.get("merged"):
                msg = f"{p.name}: PR {n} is closed and unmerged"
                rep.notices.append(msg)
                log.warning("  warning: %s", msg)
        if head is None:
            if old is None:
                raise gitcache.RemoteMissing(
                    f"{p.name}: pull request {n} not found: {gitcache.redact(p.repo)} has no refs/pull/{n}/head",
                    hint=f"check the number in {p.prs_key}; a closed PR whose ref is gone can still be used "
                    f"pinned as {n}@<sha>")
            msg = f"{p.name}: PR {n}: refs/pull/{n}/head is gone upstream; keeping the pinned {old[:12]}"
            rep.notices.append(msg)
            log.warning("  warning: %s", msg)
            continue
        if old is not None and old != head:
            rep.moved.append({"source": p.name, "number": n, "from": old, "to": head})
            log.info("  %s: PR %d moved %s -> %s", p.name, n, old[:12], head[:12])
        item[1] = head


def _github_states(url: str, numbers: list[int]) -> dict[int, dict]:
    """PR state from the GitHub API (only for github.com URLs, only when reachable)."""
    m = re.match(r"(?:https?://(?:[^@/]+@)?github\.com/|git@github\.com:|ssh://git@github\.com/)"
                 r"([^/]+)/([^/]+?)(?:\.git)?/?\Z", url)
    if not m or not numbers:
        return {}
    import requests  # only needed here

    api = os.environ.get("IMAGEBUILD_GITHUB_API", GITHUB_API_DEFAULT).rstrip("/")
    headers = {"Accept": "application/vnd.github+json", "User-Agent": "imagebuild"}
    token = os.environ.get("GITHUB_TOKEN")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    out: dict[int, dict] = {}
    for n in numbers:
        for attempt in range(3):
            try:
                r = requests.get(f"{api}/repos/{m.group(1)}/{m.group(2)}/pulls/{n}", headers=headers, timeout=5)
            except requests.RequestException as exc:
                log.debug("GitHub API unreachable (%s): PR states not reported", type(exc).__name__)
                return out
            if r.status_code in (500, 502, 503, 504) and attempt < 2:
                time.sleep(0.5 * (2 ** attempt))
                continue
            if r.status_code != 200:
                log.debug("GitHub API answered %d for PR %d: state not reported", r.status_code, n)
                break
            try:
                data = r.json()
            except ValueError:
                break
            out[n] = {"state": data.get("state"), "merged": bool(data.get("merged"))}
            break
    return out


# ------------------------------------------------------------------------------------------------ fetch


def _fetch(cache: gitcache.Cache, url: str, pins: list[Pin]) -> None:
    m = cache.mirror(url)
    shas = [s for p in pins for s in p.shas()]
    shallow = all(not p.prs for p in pins)
    name = "/".join(p.name for p in pins)
    missing = m.missing(shas)
    if cache.offline:
        if missing:
            p = next(p for p in pins if missing[0] in p.shas())
            raise gitcache.OfflineMissing(
                f"{p.name}: --offline: commit {missing[0]} ({p.what(missing[0])}) is not in the cache "
                f"{m.path}", hint="run prefetch once without --offline")
        if not shallow and m.is_shallow():
            raise gitcache.OfflineMissing(f"{name}: --offline: the cached mirror {m.path} is shallow and "
                                          "merging the PRs needs history", hint="run once without --offline")
        return
    if not missing and not (not shallow and m.is_shallow()):
        return
    try:
        m.fetch(shas, name, shallow=shallow)
    except gitcache.RemoteMissing as exc:
        # name the versions.env key that holds the missing sha
        for p in pins:
            for s in p.shas():
                if s in exc.message:
                    raise gitcache.RemoteMissing(
                        f"{p.name}: commit {s} ({p.what(s)}) does not exist on {gitcache.redact(url)} "
                        f"({exc.message.split(': ', 2)[-1]})",
                        hint=f"check {p.what(s).split()[0]} in versions.env") from None
        raise


# ------------------------------------------------------------------------------------------------ FetchContent


def _check_fetchcontent(defn, pins: dict[str, Pin], composed, cache, rep: ImageReport) -> dict:
    scans: dict[str, dict[str, fetchcontent.Declaration]] = {}
    problems: list[Problem] = []
    for p in pins.values():
        if not p.opts.scan_fetchcontent:
            continue
        m = cache.mirror(p.repo)
        decls = _local(lambda m=m, p=p: fetchcontent.scan(m, composed[p.name].commit))
        scans[p.name] = decls
        deps = {q.opts.declares.lower(): q for q in pins.values() if q.opts.dependency_of == p.name}
        for key, decl in sorted(decls.items()):
            q = deps.get(key)
            if q is None:
                upper = re.sub(r"[^A-Z0-9_]", "_", decl.name.upper())
                what = (f"GIT_REPOSITORY {decl.repository}" if decl.repository else
                        f"URL {decl.url}" if decl.url else f"SOURCE_DIR {decl.source_dir}")
                problems.append(Problem(
                    defn.env.display,
                    f"{p.name} declares the FetchContent dependency {decl.name!r} at {decl.where} "
                    f"({what}" + (f", GIT_TAG {decl.tag}" if decl.tag else "") +
                    f") in commit {composed[p.name].commit[:12]}, but nothing pins it: the build would "
                    "fetch it from the network",
                    key=f"{upper}_REPO",
                    hint=f"add {upper}_REPO=<url> and {upper}_REF=<40-hex sha> to versions.env, and "
                    f"'sources: {{{upper}: {{dependency_of: {p.name}, declares: {decl.name}}}}}' to image.yaml"))
                continue
            _compare_tag(p, q, decl, cache, rep)
        for key, q in sorted(deps.items()):
            if key not in decls:
                msg = (f"{q.name}: image.yaml says it is a dependency of {p.name} declared as {q.opts.declares!r}, "
                       f"but {p.name} at {composed[p.name].commit[:12]} declares no such FetchContent dependency")
                rep.notices.append(msg)
                log.warning("  warning: %s", msg)
    if problems:
        raise DefinitionError(problems, image=defn.name)
    return scans


def _compare_tag(parent: Pin, dep: Pin, decl: fetchcontent.Declaration, cache, rep: ImageReport) -> None:
    tag = decl.tag
    if not tag or "${" in tag:
        return
    if re.fullmatch(r"[0-9a-f]{7,40}", tag):
        if dep.ref.startswith(tag):
            return
        declared = tag
    else:
        declared = _tag_commit(cache.mirror(dep.repo), tag, dep.name, cache.offline)
        if declared is None or declared == dep.ref:
            return
        declared = f"{tag} ({declared[:12]})"
    msg = (f"{dep.name}: pinned {dep.ref[:12]} differs from {declared} that {parent.name} declares for "
           f"{decl.name!r} at {decl.where} (an override: make sure it is deliberate)")
    rep.notices.append(msg)
    log.warning("  note: %s", msg)


_TAGS_FILE = "imagebuild-tags.json"
_tags_lock = threading.Lock()


def _tag_commit(m: gitcache.Mirror, tag: str, source: str, offline: bool) -> str | None:
    """The commit a tag names upstream, remembered in the mirror (no network the second time)."""
    f = m.path / _TAGS_FILE
    with _tags_lock:
        known = json.loads(f.read_text()) if f.is_file() else {}
    if tag in known:
        return known[tag]
    if offline:
        return None
    try:
        refs = m.ls_remote([f"refs/tags/{tag}", f"refs/tags/{tag}^{{}}"], source)
    except OperationFailed as exc:
        log.warning("  %s: cannot check tag %s: %s", source, tag, exc.message)
        return None
    sha = refs.get(f"refs/tags/{tag}^{{}}") or refs.get(f"refs/tags/{tag}")
    if sha and m.exists:
        with _tags_lock:
            known = json.loads(f.read_text()) if f.is_file() else {}
            known[tag] = sha
            atomic_write_text(f, json.dumps(known, indent=1, sort_keys=True) + "\n")
    return sha


def _declared_as(decl: fetchcontent.Declaration) -> dict:
    return {"name": decl.name, "file": decl.file, "line": decl.line, "repository": decl.repository,
            "tag": decl.tag}


def _decl_entry(decl: fetchcontent.Declaration, pins: dict[str, Pin], parent: str) -> dict:
    by = [q.name for q in pins.values()
          if q.opts.dependency_of == parent and q.opts.declares.lower() == decl.name.lower()]
    return {**decl.as_dict(), "pinned_by": by[0] if by else None}


# ------------------------------------------------------------------------------------------------ pack


def resolve_submodule_url(parent_url: str, url: str) -> str:
    """A .gitmodules URL relative to its superproject's URL (``../x.git``, as git reads it), or as is."""
    if not url.startswith(("./", "../")):
        return url
    base, rel = parent_url.rstrip("/"), url
    scheme = base.find("://")
    while rel.startswith(("./", "../")):
        if rel.startswith("./"):
            rel = rel[2:]
            continue
        rel = rel[3:]
        host_end = base.find("/", scheme + 3) if scheme >= 0 else base.find(":")
        cut = base.rfind("/")
        if scheme < 0 and cut < 0:
            cut = base.rfind(":")
        if cut < 0 or (scheme >= 0 and (host_end < 0 or cut < host_end)):
            raise OperationFailed(f"submodule URL {url!r} climbs above {parent_url!r}")
        base = base[:cut] if base[cut] == "/" else base[:cut + 1]
    return base + ("" if base.endswith(":") else "/") + rel


def _entries(cache, p: Pin, m: gitcache.Mirror, commit: str, subdir: str | None, submodules: bool,
             url: str, prefix: str, depth: int = 0) -> list[tarball.Entry]:
    """Archive entries of ``commit`` (under ``subdir``), with its submodules when asked."""
    listing = _local(lambda: tarball.list_tree(m, commit))
    out: list[tarball.Entry] = []
    links: list[tuple[str, str]] = []
    sub_prefix = (subdir.rstrip("/") + "/") if subdir else ""
    for mode, sha, path in listing:
        if sub_prefix and not path.startswith(sub_prefix):
            continue
        rel = path[len(sub_prefix):]
        if mode == "160000":
            links.append((path, sha))
            continue
        out.append(tarball.Entry(prefix + rel, mode, sha, m))
    if not submodules or not links:
        return out
    if depth > 8:
        raise OperationFailed(f"{p.name}: submodules nested deeper than 8 levels")
    urls = _gitmodules(m, commit)
    fetch_jobs = []
    for path, sha in links:
        sub_url = urls.get(path)
        if sub_url is None:
            raise OperationFailed(f"{p.name}: submodule at {path!r} (commit {sha[:12]}) has no URL in .gitmodules "
                                  f"of {commit[:12]}")
        fetch_jobs.append((path, sha, resolve_submodule_url(url, sub_url)))
    for path, sha, sub_url in fetch_jobs:
        sm = cache.mirror(sub_url)
        missing = sm.missing([sha])
        label = f"{p.name}:{path}"
        if missing:
            if cache.offline:
                raise gitcache.OfflineMissing(f"{label}: --offline: submodule commit {sha} is not in the cache {sm.path}",
                                              hint="run prefetch once without --offline")
            try:
                sm.fetch([sha], label, shallow=True)
            except gitcache.RemoteMissing as exc:
                raise gitcache.RemoteMissing(f"{label}: submodule commit {sha} not found on "
                                             f"{gitcache.redact(sub_url)}: {exc.message}") from None
        rel = path[len(sub_prefix):]
        out += _entries(cache, p, sm, sha, None, True, sub_url, prefix + rel + "/", depth + 1)
    return out


def _gitmodules(m: gitcache.Mirror, commit: str) -> dict[str, str]:
    r = m.git("config", "--blob", f"{commit}:.gitmodules", "-z", "--get-regexp", r"^submodule\..*\.(path|url)$",
              check=False)
    if r.returncode not in (0, 1):
        return {}
    paths: dict[str, str] = {}
    urls: dict[str, str] = {}
    for rec in r.stdout.decode("utf-8", "replace").split("\0"):
        if not rec:
            continue
        key, _, value = rec.partition("\n")
        name, _, kind = key[len("submodule."):].rpartition(".")
        (paths if kind == "path" else urls)[name] = value
    return {paths[n]: urls[n] for n in paths if n in urls}


# ------------------------------------------------------------------------------------------------ housekeeping


def _clean_stale_tmp(srcdir: Path) -> None:
    """Remove temp files an interrupted prefetch left (their process is gone)."""
    if not srcdir.is_dir():
        return
    for f in srcdir.glob(".*.tmp"):
        parts = f.name.split(".")
        pid = int(parts[-3]) if len(parts) >= 4 and parts[-3].isdigit() else None
        if pid is not None and pid != os.getpid() and _alive(pid):
            continue
        try:
            f.unlink()
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


def _prune(srcdir: Path, keep: set[str]) -> None:
    for f in srcdir.glob("*.tar.gz"):
        if f.name not in keep:
            try:
                f.unlink()
            except OSError:
                pass


# ------------------------------------------------------------------------------------------------ output


def render(report: Report) -> str:
    lines = []
    for ir in report.images:
        lines.append(f"{ir.image}: {ir.status}  lock {ir.lock or '-'}  build id {ir.build_id or '-'}")
        for name, e in sorted(ir.sources.items()):
            prs = " ".join(f"#{x['number']}@{x['sha'][:12]}" for x in e.get("prs", []))
            extra = f" (dependency of {e['dependency_of']})" if e.get("dependency_of") else ""
            lines.append(f"  {name:<16} {e['ref'][:12]}{' + ' + prs if prs else ''}  tree {e['tree'][:12]}  "
                         f"{e['tarball']}{extra}")
        for u in ir.pinned:
            lines.append(f"  pinned {u['key']}: {u['from'] or '-'} -> {u['to']}")
        for mv in ir.moved:
            lines.append(f"  moved  {mv['source']} PR {mv['number']}: {mv['from'][:12]} -> {mv['to'][:12]}")
        for s in ir.pr_states:
            lines.append(f"  state  {s['source']} PR {s['number']}: {s['state']}"
                         f"{' (merged)' if s.get('merged') else ''}")
        for n in ir.notices:
            lines.append(f"  note   {n}")
        if ir.packages is not None:
            lines += packages.render(ir.packages)
    lines.append(f"network operations: {report.network_operations} (fetches {report.fetches}, "
                 f"retries {report.retries}); cache {report.cache}")
    return "\n".join(lines)
