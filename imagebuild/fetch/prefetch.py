"""``imagebuild prefetch``: pin every git source by SHA, compose the forks, pack deterministic
tarballs and write the lock, so that the build needs no network.

Per image (docs/prefetch.md):

1. **Fast path**: when every pin is a SHA, the lock's ``sources`` section matches the definition
   and every tarball still has the lock's digest, nothing is run at all (no git, no network).
2. **Resolve** (network only for what is unpinned, or with ``--refresh``): ref names and bare PR
   numbers via ``git ls-remote`` (``refs/pull/N/head``); PR state from the GitHub API when
   reachable. A name is pinned as ``<name>@<sha>`` (``--refresh`` moves it).
3. **Fetch** into the mirror cache (gitcache.py) only the commits that are missing, by raw SHA.
4. **Compose** (compose.py): base, then each PR merged in order; record the tree hash.
5. **FetchContent** (fetchcontent.py reads, depcheck.py decides): every declaration in the
   composed tree pinned or excluded with a reason, each override one the tree reads, tags given
   through variables resolved and compared.
6. **Submodules** as the declaration asks (or image.yaml lists), fetched by the SHAs their
   parents record.
7. **Pack** (tarball.py) ``deps-src/<image>/src/<name>-<id12>.tar`` + ``SHA256SUMS``, only
   what changed: a tarball the lock already has for the same content is kept.
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

from imagebuild.core import context as context_mod
from imagebuild.core import fsutil, lock, state
from imagebuild.core.errors import (
    CommandFailed,
    DefinitionError,
    ImagebuildError,
    OperationFailed,
    Problem,
    UsageError,
)
from imagebuild.core.fsutil import (
    atomic_write_text,
    canonical_json,
    sha256_bytes,
    sha256_file,
)
from imagebuild.definition import reader as d
from imagebuild.fetch import cargo as cargo_mod
from imagebuild.fetch import compose as compose_mod
from imagebuild.fetch import depcheck, fetchcontent, gitcache, packages, rust_dist, tarball
from imagebuild.fetch import rust as rust_mod

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
    follows: str | None = None  # the branch or tag the pin follows (NAME_REF=<name>@<sha>)
    env_display: str = "versions.env"  # how errors name the file
    ref_line: int | None = None  # NAME_REF's line in it
    ref_comment: str | None = None  # the comment on that line (an override's reason: "# override: ...")
    tree: str | None = None  # NAME_TREE: the tree the composition must produce (None: not pinned)
    tree_line: int | None = None  # NAME_TREE's line in versions.env

    def ref_value(self) -> str:
        """NAME_REF as versions.env holds it: ``<name>@<sha>`` when it follows a name."""
        return f"{self.follows}@{self.ref}" if self.follows else self.ref

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
    moved: list[dict] = field(default_factory=list)  # --refresh: PR heads and followed branches that moved
    pr_states: list[dict] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    packages: dict | None = None  # base images, wheels, apt (packages.summary)
    would_write: dict | None = None  # --dry-run: the pins and lock sources a run would write
    error: dict | None = None  # status "failed": {exit_code, message, hint} (several images: the run goes on)

    def as_dict(self) -> dict:
        return {"image": self.image, "status": self.status, "lock": self.lock, "build_id": self.build_id,
                "sources": self.sources, "pinned": self.pinned, "moved": self.moved,
                "pr_states": self.pr_states, "notices": self.notices, "packages": self.packages,
                "would_write": self.would_write, "error": self.error}


@dataclass
class Report:
    images: list[ImageReport]
    cache: str
    network_operations: int
    fetches: int
    retries: int
    seconds: float

    @property
    def exit_code(self) -> int:
        """The worst (highest) exit code of the images that failed; 0 when none did."""
        return max((i.error["exit_code"] for i in self.images if i.error), default=0)

    def as_dict(self) -> dict:
        return {"schema": REPORT_SCHEMA, "version": REPORT_VERSION, "cache": self.cache,
                "network_operations": self.network_operations, "fetches": self.fetches,
                "retries": self.retries, "exit_code": self.exit_code, "images": [i.as_dict() for i in self.images]}


# ------------------------------------------------------------------------------------------------ entry


def prefetch(ctx: context_mod.Context | Path, images: list[str] | None = None, *, refresh: list[str] | None = None,
             offline: bool = False, jobs: int = 4, cache_dir: str | os.PathLike | None = None,
             dry_run: bool = False) -> Report:
    """Prefetch ``images`` (default: every image with git sources). ``refresh``: None = no
    refresh, [] = every source, [NAME...] = those sources. ``dry_run``: resolve refs and PR heads
    (the mirror cache may fetch), then report what versions.env and the lock would get; write neither,
    compose and pack nothing, leave packages alone."""
    t0 = time.monotonic()
    if jobs < 1:
        raise UsageError(f"--jobs {jobs}: expected a positive number")
    if offline and refresh is not None:
        raise UsageError("--refresh needs the network; it cannot be combined with --offline")
    ctx = context_mod.of(ctx)
    root = ctx.root
    # Several images (none named: every image with git sources or packages): each one on its own, a
    # failure reported in its row and the run going on to the next; the exit code is the worst.
    # One image named: its error is raised as it is.
    go_on = not images or len(images) > 1
    defns: list = []
    failed: dict[str, ImageReport] = {}
    for n in images or d.list_images(root):
        try:
            x = d.load(root, n)
        except DefinitionError as exc:
            if not go_on:
                raise
            failed[n] = _failed(n, exc)
            defns.append(n)
            continue
        if images or x.sources or packages.has_packages(x):
            defns.append(x)
    loaded = [x for x in defns if not isinstance(x, str)]
    names = [x.name for x in loaded]
    if refresh:
        known = {s for defn in loaded for s in defn.sources}
        unknown = [r for r in refresh if r not in known]
        if unknown:
            raise UsageError(f"--refresh {unknown[0]}: no such git source in "
                             f"{', '.join(names) or 'any image'}",
                             hint=f"known sources: {', '.join(sorted(known)) or 'none'}")
    cache = gitcache.Cache(gitcache.default_cache_dir(cache_dir), offline=offline)
    reports = []
    for defn in defns:
        if isinstance(defn, str):
            reports.append(failed[defn])
            continue
        try:
            reports.append(_prefetch_one(ctx, defn, cache, refresh, jobs, offline, dry_run))
        except ImagebuildError as exc:
            if not go_on:
                raise
            reports.append(_failed(defn.name, exc))
    st = cache.stats
    return Report(reports, str(cache.root), st.network, st.fetch, st.retries, time.monotonic() - t0)


def _prefetch_one(ctx: context_mod.Context, defn: d.Definition, cache: gitcache.Cache, refresh: list[str] | None,
                  jobs: int, offline: bool, dry_run: bool) -> ImageReport:
    """One image's prefetch: its git sources, then its packages; the lock written once."""
    if dry_run:
        return _prefetch_image(defn, cache, refresh, jobs, dry_run=True)
    with lock.batch(defn.dir, defn.name):  # the lock is written once, when every step succeeded
        ir = _prefetch_image(defn, cache, refresh, jobs)
        if packages.has_packages(defn):  # base images by digest, wheels, apt debs (packages.py)
            pdefn, prep = packages.prefetch_packages(ctx, defn.name, offline=offline)
            ir.packages = packages.summary(prep)
            for w in check_rust_toolchain(pdefn, lock.read(defn.dir)):  # before the lock is written
                ir.notices.append(w)
                log.warning("warning: %s", w)
    if ir.lock is not None or packages.has_packages(defn):
        ir.lock = defn.rel(lock.lock_path(defn.dir))
        ir.build_id = _build_id(defn)  # one id, from the lock as written: the same on stderr and stdout
        log.info("%s: lock %s (build id %s)", defn.name, ir.lock, ir.build_id)
    return ir


def _failed(image: str, exc: ImagebuildError) -> ImageReport:
    """The row of an image whose prefetch failed, the run going on: its error as the CLI would print it
    (on stderr now, in full), and in the report (the first line of its message, the exit code)."""
    log.error("%s", exc.render())
    return ImageReport(image, status="failed", error={"exit_code": exc.exit_code, "message": exc.message,
                                                      "hint": exc.hint})


def _pmap(fn: Callable, items: Iterable, jobs: int) -> list:
    """``fn`` over ``items`` with ``jobs`` threads; the first error (in item order) is raised."""
    items = list(items)
    if jobs <= 1 or len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=min(jobs, len(items))) as ex:
        futs = [ex.submit(fn, i) for i in items]
        return [f.result() for f in futs]


# ------------------------------------------------------------------------------------------------ image


def _line_comment(defn: d.Definition, key: str) -> str | None:
    line = defn.env.line_of(key)
    if not line or line > len(defn.env.lines):
        return None
    text = defn.env.lines[line - 1]
    return text.split("#", 1)[1].strip() if "#" in text else None


def _pins(defn: d.Definition) -> dict[str, Pin]:
    out = {}
    for name, src in sorted(defn.sources.items()):
        opts = defn.source_options.get(name) or d.default_source_options(name)
        out[name] = Pin(name, src.repo, src.ref, [[p.number, p.sha] for p in src.prs], opts,
                        f"{name}_REF", f"{name}_PRS", src.follows, defn.env.display,
                        defn.env.line_of(f"{name}_REF"), _line_comment(defn, f"{name}_REF"),
                        src.tree, defn.env.line_of(f"{name}_TREE"))
    return out


def _prefetch_image(defn: d.Definition, cache: gitcache.Cache, refresh: list[str] | None, jobs: int,
                    dry_run: bool = False) -> ImageReport:
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
        fast, why = _fast_path(defn, pins, old_lock)
        if fast is not None:
            log.info("%s: %d sources unchanged (lock and tarballs verified; nothing fetched)",
                     defn.name, len(pins))
            rep.status = "unchanged"
            rep.sources = fast
            rep.lock = lock_disp
            return rep
        log.info("%s: %s", defn.name, why)

    if not dry_run:
        _clean_stale_tmp(srcdir)
    log.info("%s: %d git sources", defn.name, len(pins))

    # 2. resolve
    todo = [p for p in pins.values()
            if not SHA_RE.match(p.ref) or any(s is None for _, s in p.prs)
            or (refresh is not None and (not refresh or p.name in refresh) and (p.prs or p.follows))]
    _pmap(lambda p: _resolve(p, cache, refresh, rep), todo, jobs)
    if dry_run:  # what a run would write, from the resolved pins alone
        updates = _ref_updates(defn, pins, rep)
        old = (old_lock or {}).get("sources") if isinstance((old_lock or {}).get("sources"), dict) else {}
        rep.status = "dry-run"
        rep.would_write = {
            "versions_env": {"file": defn.env.display, "set": updates},
            "lock": {"file": lock_disp, "sources": [
                {"source": p.name, "ref": p.ref, "prs": [{"number": n, "sha": s} for n, s in p.prs],
                 "changed": not isinstance(old.get(p.name), dict) or old[p.name].get("ref") != p.ref
                 or [(x.get("number"), x.get("sha")) for x in old[p.name].get("prs") or []] != list(p.prs)}
                for p in pins.values()]},
            "packages": "not checked (--dry-run)" if packages.has_packages(defn) else None}
        return rep

    # 3. fetch (grouped by URL: one fetch per mirror) and 4. compose, the scanned sources first:
    # a FetchContent problem is reported before any dependency is downloaded
    composed: dict[str, compose_mod.Composed] = {}

    def do_compose(p: Pin) -> None:
        m = cache.mirror(p.repo)
        composed[p.name] = _local(lambda: compose_mod.compose(m, p.name, p.ref, [(n, s) for n, s in p.prs]))

    def fetch_and_compose(group: list[Pin]) -> None:
        by_url: dict[str, list[Pin]] = {}
        for p in group:
            by_url.setdefault(p.repo, []).append(p)
        _pmap(lambda item: _fetch(cache, item[0], item[1]), sorted(by_url.items()), jobs)
        _pmap(do_compose, group, jobs)

    fetch_and_compose([p for p in pins.values() if p.opts.scan_fetchcontent])
    # 4b. tree pins (NAME_TREE): a composition that is not the pinned tree stops here, before anything
    # else is read from it; every source with a tree pin is composed first, so all differences show at once
    wrong_trees = tree_problems(pins.values(), composed)
    if wrong_trees:
        fetch_and_compose([p for p in pins.values() if p.name not in composed and p.tree])
        raise DefinitionError(tree_problems(pins.values(), composed), image=defn.name)

    # 5. FetchContent: every declaration pinned or excluded, overrides read by the tree, tags compared
    scans, check = _check_fetchcontent(defn, pins, composed, cache, rep)
    fetch_and_compose([p for p in pins.values() if not p.opts.scan_fetchcontent])
    problems = tree_problems(pins.values(), composed)
    declared = {}
    for q, info in sorted(check.deps.items()):  # every pin that differs from its tree, in one report
        if info.decl is not None:
            declared[q], problem = _compare_tag(pins[pins[q].opts.dependency_of], pins[q], info.decl, cache, rep)
            if problem is not None:
                problems.append(problem)
    if problems:
        raise DefinitionError(problems, image=defn.name)

    # 6. submodules + 7. pack (only what changed: a tarball the lock already has is kept)
    srcdir.mkdir(parents=True, exist_ok=True)
    old_sources = (old_lock or {}).get("sources") if isinstance((old_lock or {}).get("sources"), dict) else {}

    packed_entries: dict[str, list[tarball.Entry]] = {}

    def do_pack(p: Pin) -> dict:
        m = cache.mirror(p.repo)
        c = composed[p.name]
        tree = _local(lambda: compose_mod.subtree(m, p.name, c.commit, p.opts.subdir))
        info = check.deps.get(p.name)
        subs = info.submodules if info else depcheck.submodules_for(p.opts, None)[0]
        entries, packed_subs = _entries(cache, p, m, c.commit, p.opts.subdir, subs, p.repo, "")
        packed_entries[p.name] = entries  # what the patch check reads its files from (_check_patches)
        pid = packed_id(tree, packed_subs, c.epoch)
        fname = f"{p.name.lower()}-{pid[:12]}{tarball.SUFFIX}"
        dest = srcdir / fname
        digest = _reusable(defn, p, old_sources.get(p.name), dest, pid, rep)
        if digest is None:
            log.info("  %s: packing %d files into %s", p.name, len(entries), defn.rel(dest))
            digest = _local(lambda: tarball.pack(entries, dest, c.epoch))
        version = _local(lambda: compose_mod.scm_version(m, c.commit))
        if version is None and not p.opts.dependency_of:  # never a null version where a build reads one
            raise OperationFailed(f"{p.name}: cannot derive the version of the composed commit {c.commit[:12]}: "
                                  f"the mirror {m.path} is shallow, so its history cannot be counted",
                                  hint="run prefetch without --offline (it fetches the history), or remove "
                                  "that mirror folder")
        crates = _rust_dist(defn, p, _cargo(defn, p, m, c.commit, old_sources.get(p.name), srcdir, rep, cache),
                            old_sources.get(p.name), srcdir, cache)
        decl = info.decl if info else None
        scanned = p.name in scans
        return {
            "repo": gitcache.redact(p.repo), "ref": p.ref, "follows": p.follows,  # never a credential
            "prs": [{"number": n, "sha": s} for n, s in p.prs],
            "commit": c.commit, "tree": tree, "source_tree": c.tree, "tree_pin": p.tree,
            "source_date_epoch": c.epoch,
            "version": version,
            "packed_id": pid, "tarball_format": tarball.FORMAT,
            "tarball": d.display_path(defn.root, dest), "sha256": digest,
            "dependency_of": p.opts.dependency_of,
            "declared_as": declared.get(p.name) if decl else None,
            "env": info.override["name"] if info and info.override else None,
            "override": info.override if info else None,
            "subdir": p.opts.subdir,
            "submodules": packed_subs,
            "submodules_wanted": subs.as_dict(),
            "options": p.opts.setting(),
            "fetchcontent": ([_decl_entry(x, pins, p) for x in sorted(scans[p.name].declarations.values(),
                                                                        key=lambda x: x.name.lower())]
                             if scanned else None),
            "excluded": check.excluded.get(p.name) if scanned else None,
            "cargo": crates,
        }

    # a run that fails before the lock is written (the commit point) takes its new tarballs with it:
    # deps-src holds what the lock names, and what the previous lock named, nothing else
    before = {f.name for f in srcdir.iterdir()}

    def drop_new() -> None:
        for f in srcdir.iterdir():
            if f.name not in before and f.is_file() and not f.is_symlink():
                f.unlink(missing_ok=True)
    lock.on_abort(defn.dir, drop_new)  # a later step of this image fails: the lock is not written either
    try:
        entries = _pmap(do_pack, pins.values(), jobs)
        sources = {p.name: e for p, e in zip(pins.values(), entries, strict=True)}

        # 8. commit: versions.env, the lock (the commit point), then SHA256SUMS and pruning
        updates = _ref_updates(defn, pins, rep)
        for p in pins.values():
            if p.opts.cargo_switch:  # 1 when the composed tree has Rust crates (vendored), else 0
                want = "1" if sources[p.name]["cargo"] else "0"
                have = defn.env.get(p.opts.cargo_switch)
                if have != want:
                    updates[p.opts.cargo_switch] = want
                    rep.pinned.append({"key": p.opts.cargo_switch, "from": have or "", "to": want})
        if updates:
            defn.env.update(updates)
            for u in rep.pinned:
                log.info("  pinned %s=%s in %s", u["key"], u["to"], defn.env.display)
        for name, per_stage in _check_patches(defn, sources, rep, packed_entries).items():
            sources[name]["patch_check"] = per_stage
        lock.update_sections(defn.dir, defn.name, {"sources": sources})
    except BaseException:
        drop_new()
        raise
    packed = {Path(x["tarball"]).name: x["sha256"] for e in sources.values()
              for x in (e, e.get("cargo")) if isinstance(x, dict)}
    packed.update({Path(tb).name: sha for e in sources.values() for tb, sha in rust_dist.lock_files(e.get("cargo"))})
    sums = "".join(f"{sha}  {name}\n" for name, sha in sorted(packed.items()))

    def commit() -> None:  # after the lock (the commit point): SHA256SUMS, then the old tarballs go
        atomic_write_text(srcdir / SUMS_FILE, sums)
        _prune(srcdir, set(packed))

    lock.after_write(defn.dir, commit)
    rep.sources = sources
    rep.lock = lock_disp
    return rep


def _ref_updates(defn: d.Definition, pins: dict[str, Pin], rep: ImageReport) -> dict[str, str]:
    """The versions.env values the resolved ``pins`` change (NAME_REF, NAME_PRS), each also listed
    in ``rep.pinned``."""
    updates = {}
    for p in pins.values():
        src = defn.sources[p.name]
        old_ref = f"{src.follows}@{src.ref}" if src.follows else src.ref
        if old_ref != p.ref_value():
            updates[p.ref_key] = p.ref_value()
            rep.pinned.append({"key": p.ref_key, "from": old_ref, "to": p.ref_value()})
        old = src.pins()["prs"]
        new = [f"{n}@{s}" for n, s in p.prs]
        if old != new:
            updates[p.prs_key] = p.prs_value()
            rep.pinned.append({"key": p.prs_key, "from": " ".join(old), "to": p.prs_value()})
    return updates


def _check_patches(defn: d.Definition, sources: dict, rep: ImageReport,
                   packed: dict[str, list[tarball.Entry]] | None = None) -> dict:
    """Check each patching stage's patches against a composed tree, as the build will apply them,
    without writing anything: {source: {stage: [outcome, ...]}}.

    A stage with sources: the composed tree of its first source. A stage without sources of its own
    that installs what earlier stages built (their images reach it through ``STAGE_*`` build args; glm53's
    runner patches the installed ``vllm`` package): the composed tree of each such stage's first source
    (its ``vllm/`` is the installed package, at the same relative paths), with that stage's own patches
    applied first, as the installed package has them. A patch is recorded under the first of those
    trees where it is not ``not-applicable`` (else under the first tree).

    The patches run in another process, twice (definition/patchcheck.py: nothing of a patch runs here),
    on the tree the tarball was packed from (``packed``: its entries), populated lazily: a path is made
    (at its size, mode and mtime) when the patch run looks it up, and a file gets its bytes from the git
    mirror when the patch run first opens it (definition/lazytree.py), so only the files the patches read are read,
    not the whole tree a second time. When a patch does what that cannot follow (a subprocess, ctypes),
    the check is redone, said in the log, on the packed tarball (the bytes the build gets) extracted.
    The outcomes go into the lock, so that `imagebuild plan` shows, offline, which patches apply,
    which are not needed and which do not apply to this tree (with the reason); a patch that would
    fail is said now, not an hour into the build."""
    import tarfile
    import tempfile

    from imagebuild.definition import patchcheck, patching

    def patch_paths(st) -> list:
        return [i.path for i in st.inputs if i.kind == "patch"]

    by_arg = {d.stage_arg(s.name): s for s in defn.stages}
    out: dict = {}
    for st in defn.stages:
        paths = patch_paths(st)
        if not paths:
            continue
        if st.sources:
            trees = [(st.sources[0], [])] if st.sources[0] in sources else []
        else:
            used = [by_arg.get(a) for a in st.stage_deps]
            trees = [(u.sources[0], patch_paths(u)) for u in used
                     if u is not None and u.sources and u.sources[0] in sources]
        if not trees:
            continue
        found = {}
        for name, before in trees:
            res, why = None, "the packed entries are not known"
            if packed and name in packed:
                listing = [(e.path, e.mode, e.sha, e.repo.path) for e in packed[name]]
                res, why = patchcheck.check_lazy([*before, *paths], listing, int(sources[name]["source_date_epoch"]))
            if res is None:
                log.info("  %s: stage %s's patches checked on the whole tree extracted: %s", name, st.name, why)
                with tempfile.TemporaryDirectory(prefix="imagebuild-patch-check-") as tmp:
                    with tarfile.open(defn.root / sources[name]["tarball"]) as tf:
                        tf.extractall(tmp, filter="data")
                    res = patchcheck.check([*before, *paths], Path(tmp), copy=False)
            found[name] = res[len(before):]
        for i in range(len(paths)):
            name = next((n for n, _ in trees if found[n][i].outcome != patching.NOT_APPLICABLE), trees[0][0])
            r = found[name][i]
            out.setdefault(name, {}).setdefault(st.name, []).append(
                {"patch": r.patch, "outcome": r.outcome, "message": r.message, "sha256": r.sha256})
            if r.outcome == patching.FAILED:
                msg = (f"stage {st.name!r}: patch {r.patch} fails on the composed {name} "
                       f"({r.message.splitlines()[0] if r.message else 'failed'}); the build would stop there "
                       f"(imagebuild patch {defn.name} --src <checkout> --check shows every patch)")
                rep.notices.append(msg)
                log.warning("  warning: %s", msg)
    return out


def packed_id(tree: str, submodules: list[dict], epoch: int) -> str:
    """The digest of everything that decides a tarball's bytes: the format, the packed tree, the
    submodule commits packed with it and the mtime. It names the tarball, so the name changes
    whenever the bytes would (not only when the top-level tree does)."""
    doc = {"format": tarball.FORMAT, "tree": tree, "epoch": epoch,
           "submodules": [[s["path"], s["commit"]] for s in submodules]}
    return sha256_bytes(canonical_json(doc))


def _reusable(defn: d.Definition, p: Pin, old: dict | None, dest: Path, pid: str, rep: ImageReport) -> str | None:
    """The sha256 of the tarball already at ``dest`` when the lock has it for exactly this content
    (nothing to repack); None when it must be packed. A damaged one is said, not silently redone."""
    if not isinstance(old, dict) or old.get("packed_id") != pid or not dest.is_file():
        return None
    if old.get("tarball") != d.display_path(defn.root, dest):
        return None
    got = sha256_file(dest)
    if got == old.get("sha256"):
        log.info("  %s: %s unchanged (kept)", p.name, defn.rel(dest))
        return got
    msg = (f"{p.name}: {defn.rel(dest)} does not match the lock (sha256 {got}, the lock says {old.get('sha256')}): "
           "corrupted or changed since the last prefetch; repacking it")
    rep.notices.append(msg)
    log.warning("  warning: %s", msg)
    return None


def _cargo(defn: d.Definition, p: Pin, m: gitcache.Mirror, commit: str, old: dict | None, srcdir: Path,
           rep: ImageReport, cache: gitcache.Cache) -> dict | None:
    """The lock's ``cargo`` record of a source: its Cargo.lock files vendored into one tarball
    (fetch/cargo.py, fetch/crates.py); None when the packed tree has none. Kept as it is when the
    lock already has the same Cargo.lock files and the tarball is intact."""
    listing = _local(lambda: tarball.list_tree(m, commit))
    locks = cargo_mod.find_lockfiles(listing, p.opts.subdir)
    if not locks:
        return None
    vid = cargo_mod.vendor_id(locks)
    dest = srcdir / f"{p.name.lower()}-cargo-vendor-{vid[:12]}{tarball.SUFFIX}"
    shown = d.display_path(defn.root, dest)
    prev = old.get("cargo") if isinstance(old, dict) else None
    if isinstance(prev, dict) and prev.get("vendor_id") == vid and prev.get("tarball") == shown and dest.is_file():
        got = sha256_file(dest)
        if got == prev.get("sha256"):
            log.info("  %s: %s unchanged (kept; %s crates)", p.name, defn.rel(dest), prev.get("crates"))
            return _with_rust_version(prev, m, listing, p.opts.subdir, locks)
        msg = (f"{p.name}: {defn.rel(dest)} does not match the lock (sha256 {got}, the lock says "
               f"{prev.get('sha256')}): vendoring its crates again")
        rep.notices.append(msg)
        log.warning("  warning: %s", msg)
    log.info("  %s: vendoring the crates of %s into %s", p.name, ", ".join(x.path for x in locks), defn.rel(dest))
    v = cargo_mod.vendor(p.name, m, commit, p.opts.subdir, locks, dest, cache=cache)
    log.info("  %s: %d crates vendored from the Cargo.lock (%d from a registry, %d from git)", p.name, v.crates,
             v.registry, v.git)
    return _with_rust_version({"format": cargo_mod.FORMAT, "vendor_id": vid, "tarball": shown, "sha256": v.tarball_sha256,
                               "lockfiles": [{"path": x.path, "blob": x.blob} for x in locks], "crates": v.crates,
                               "config": v.config, "registry_crates": v.registry, "git_crates": v.git,
                               "crates_rust_version": v.rust_version},
                              m, listing, p.opts.subdir, locks)


def _rust_dist(defn: d.Definition, p: Pin, rec: dict | None, old: dict | None, srcdir: Path,
               cache: gitcache.Cache) -> dict | None:
    """``rec`` with ``toolchain_dist`` (fetch/rust_dist.py) when the source asks for the toolchain its
    tree names (``rust_toolchain: dist``), without it otherwise."""
    if rec is None:
        return None
    rec = {k: v for k, v in rec.items() if k != "toolchain_dist"}
    if p.opts.rust_toolchain != "dist":
        return rec
    prev = ((old or {}).get("cargo") or {}).get("toolchain_dist") if isinstance((old or {}).get("cargo"), dict) else None
    return {**rec, "toolchain_dist": rust_dist.fetch(p.name, rec.get("toolchain"), defn.platform, srcdir, defn.root,
                                                     cache, prev, lambda x: d.display_path(defn.root, x))}


def _with_rust_version(rec: dict, m: gitcache.Mirror, listing, subdir: str | None, locks) -> dict:
    """``rec`` with what Rust the tree asks for (fetch/rust.py, read from the commit every time: the
    toolchain file, editions, the Cargo.lock version and rust-version are not in the vendor id):
    ``rust_needs`` ([version, file, what asks]), ``toolchain`` (the channel file, or None) and
    ``rust_version``: [version, who], the highest of them and of the vendored crates' rust-version."""
    prefix = (subdir.rstrip("/") + "/") if subdir else ""
    blobs = {path[len(prefix):]: sha for _, sha, path in listing if path.startswith(prefix)}
    needs, chains = rust_mod.tree_needs(blobs, [x.path for x in locks],
                                        lambda b: _local(lambda: m.out("cat-file", "blob", b)))
    top = rust_mod.highest(needs)
    pairs = [(top.version, top.who)] if top else []
    crates = rec.get("crates_rust_version")
    found = cargo_mod.highest(pairs + ([tuple(crates)] if isinstance(crates, list) and len(crates) == 2 else []))
    protoc = rust_mod.protoc_need(blobs, [x.path for x in locks], lambda b: _local(lambda: m.out("cat-file", "blob", b)))
    return {**rec, "rust_needs": [n.as_list() for n in needs], "protoc": protoc,
            "toolchain": {"file": chains[0].file, "channel": chains[0].channel} if chains else None,
            "rust_version": list(found) if found else None}


PROTOC_PACKAGE = "protobuf-compiler"  # Debian's and Ubuntu's protoc
RUSTC_PACKAGE = re.compile(r"^rustc(?:-\d+\.\d+)?$")  # Debian/Ubuntu: rustc, or a versioned rustc-1.NN


def check_rust_toolchain(defn: d.Definition, data: dict | None) -> list[str]:
    """Refuse a lock whose Rust crates cannot build: the ``rustc`` that an apt list of a stage building
    a source with vendored crates installs (its own or a stage's below it) must be at least the highest
    ``rust-version`` the tree or its crates declare (OperationFailed naming both). Returns warnings: a
    stage whose apt lists install no rustc (its base image must carry one)."""
    warnings: list[str] = []
    if not data:
        return warnings
    srcs, apt = data.get("sources") or {}, data.get("apt") or {}
    by_name = {st.name: st for st in defn.stages}
    for st in defn.stages:
        for name in st.sources:
            rec = (srcs.get(name) or {}).get("cargo") if isinstance(srcs.get(name), dict) else None
            if not isinstance(rec, dict):
                continue
            need = rec.get("rust_version")
            pc = rec.get("protoc")
            if isinstance(pc, dict) and pc.get("needed"):  # a build script runs protoc: an apt list must install it
                has, cur = False, st
                while cur is not None and not has:
                    has = any(str(f.get("name")) == PROTOC_PACKAGE for f in (apt.get(cur.name) or {}).get("files") or ())
                    cur = by_name.get(cur.parent.name) if cur.parent.kind == "stage" else None
                if not has:
                    lst = st.apt.display if st.apt else f"an apt list of stage {st.name!r}"
                    raise OperationFailed(
                        f"{name}: {'; '.join(pc.get('build_scripts') or ())} runs the protobuf compiler (protoc), and no "
                        f"apt list of stage {st.name!r} or of the stages below it installs {PROTOC_PACKAGE}: the stage's "
                        "cargo build would stop there",
                        hint=f"add {PROTOC_PACKAGE} to {lst} (prefetch pins it and fetches its debs like the others), "
                        "or a tree whose build uses the pure-Rust protox (vllm#52892)")
            td = rec.get("toolchain_dist")
            if isinstance(td, dict):  # the pinned toolchain the tree names: it must reach the rest too
                if isinstance(need, list) and len(need) == 2 and cargo_mod.version_tuple(need[0]) \
                        and (cargo_mod.version_tuple(str(td.get("version"))) or (0,)) < cargo_mod.version_tuple(need[0]):
                    raise OperationFailed(
                        f"{name}: {td.get('file')}: Rust {td.get('version')} (channel {td.get('channel')}) is older than "
                        f"the Rust {need[0]} that {need[1]} asks for: stage {st.name!r} could not cargo-build it",
                        hint="name a newer channel in the toolchain file")
                continue
            rustc, chain, cur = None, [], st
            while cur is not None:
                chain.append(cur.name)
                for f in (apt.get(cur.name) or {}).get("files") or ():
                    if RUSTC_PACKAGE.match(str(f.get("name", ""))) and cargo_mod.version_tuple(str(f.get("version", ""))):
                        if rustc is None or cargo_mod.version_tuple(f["version"]) > cargo_mod.version_tuple(rustc[1]):
                            rustc = (f["name"], f["version"], cur)
                cur = by_name.get(cur.parent.name) if cur.parent.kind == "stage" else None
            lockfiles = ", ".join(x.get("path", "?") for x in rec.get("lockfiles") or ())
            if rustc is None:  # the base image may carry one: say so, the stage stops by name without it
                warnings.append(
                    f"stage {st.name!r} builds the Rust crates of {name} ({lockfiles}), but no apt list of it or of "
                    f"the stages below it installs rustc: its base image must have a Rust toolchain"
                    + (f" of at least {need[0]} ({need[1]})" if isinstance(need, list) and len(need) == 2 else ""))
                continue
            if isinstance(need, list) and len(need) == 2 and cargo_mod.version_tuple(need[0]) \
                    and cargo_mod.version_tuple(rustc[1]) < cargo_mod.version_tuple(need[0]):
                lst = rustc[2].apt.display if rustc[2].apt else f"stage {rustc[2].name!r}"
                have = cargo_mod.version_tuple(rustc[1])
                also = [f"{n[0]}: {n[1]} ({n[2]})" for n in rec.get("rust_needs") or ()
                        if isinstance(n, list) and len(n) == 3 and (cargo_mod.version_tuple(n[0]) or (0,)) > have
                        and f"{n[1]} ({n[2]})" != need[1]]
                raise OperationFailed(
                    f"{lst}: {rustc[0]}={rustc[1]} is older than the Rust {need[0]} that {need[1]} of {name} asks for: "
                    f"stage {st.name!r} needs it to cargo-build {lockfiles}"
                    + (f" (also too old for {'; '.join(also)})" if also else ""),
                    hint="pin a Rust toolchain at least that new in that apt list (`apt-cache search --names-only "
                    "^rustc` in the base lists the archive's versioned toolchains, rustc-1.NN), or a tree that asks "
                    "for less")
    return warnings


def _build_id(defn: d.Definition) -> str:
    from imagebuild.plan.planner import make_plan

    return make_plan(d.load(defn.root, defn.name)).build_id


def _local(fn):
    """Run a local git step; a failing git command becomes an OperationFailed with its output."""
    try:
        return fn()
    except CommandFailed as exc:
        raise OperationFailed(exc.message) from None


# ------------------------------------------------------------------------------------------------ fast path


def _fast_path(defn: d.Definition, pins: dict[str, Pin], old: dict) -> tuple[dict | None, str]:
    """(the lock's sources, "") when they still describe the definition and the tarballs are
    intact; else (None, why not)."""
    srcs = old.get("sources")
    if not isinstance(srcs, dict) or set(srcs) != set(pins):
        return None, "the lock's sources differ from the definition's"
    for p in pins.values():
        e = srcs[p.name]
        if not isinstance(e, dict):
            return None, f"{p.name}: no lock entry"
        if not SHA_RE.match(p.ref) or any(s is None for _, s in p.prs):
            return None, f"{p.name}: not pinned yet"
        want = {"repo": gitcache.redact(p.repo), "ref": p.ref, "follows": p.follows,
                "prs": [{"number": n, "sha": s} for n, s in p.prs], "options": p.opts.setting(),
                "tree_pin": p.tree}
        changed = [k for k, v in want.items() if e.get(k) != v]
        if changed:
            return None, f"{p.name}: {', '.join(changed)} changed since the lock was written"
        if e.get("tarball_format") != tarball.FORMAT:  # format 1: gzip (.tar.gz), repacked as a plain tar
            return None, (f"{p.name}: the lock's tarball is of format {e.get('tarball_format')}, this imagebuild "
                          f"packs format {tarball.FORMAT}: repacking")
        tb = e.get("tarball")
        if not isinstance(tb, str):
            return None, f"{p.name}: no tarball in the lock"
        path = defn.root / tb
        if not path.is_file():
            return None, f"{p.name}: {tb} is missing"
        if sha256_file(path) != e.get("sha256"):
            return None, f"{p.name}: {tb} does not match the lock's sha256"
        if "cargo" not in e:
            return None, f"{p.name}: the lock predates the Rust crates scan (Cargo.lock files)"
        cg = e["cargo"]
        if cg is not None:
            if not isinstance(cg, dict) or cg.get("format") != cargo_mod.FORMAT or not isinstance(cg.get("tarball"), str):
                return None, f"{p.name}: the lock's cargo record is of another format"
            bad = rust_dist.intact(defn.root, cg)
            if bad or (p.opts.rust_toolchain == "dist") != isinstance(cg.get("toolchain_dist"), dict):
                return None, f"{p.name}: {bad or 'the pinned Rust toolchain does not follow rust_toolchain'}"
            if "rust_needs" not in cg:
                return None, f"{p.name}: the lock predates reading the Rust the tree asks for (toolchain file, edition)"
            cpath = defn.root / cg["tarball"]
            if not cpath.is_file() or sha256_file(cpath) != cg.get("sha256"):
                return None, f"{p.name}: {cg['tarball']} is missing or does not match the lock's sha256"
        if p.opts.cargo_switch and defn.env.get(p.opts.cargo_switch) != ("1" if cg else "0"):
            return None, f"{p.name}: {p.opts.cargo_switch} in versions.env does not follow the lock's Rust crates"
        if not p.opts.dependency_of and not e.get("version"):
            return None, f"{p.name}: the lock has no version for it (written from a history-less mirror)"
    checked = {st for e in srcs.values() if isinstance(e, dict) for st in (e.get("patch_check") or {})}
    by_arg = {d.stage_arg(s.name): s for s in defn.stages}
    for st in defn.stages:  # a patching stage without sources of its own is checked too (_check_patches)
        used = [u for u in (by_arg.get(a) for a in st.stage_deps) if u is not None and u.sources]
        if not st.sources and used and any(i.kind == "patch" for i in st.inputs) and st.name not in checked:
            return None, f"stage {st.name}: the lock predates the check of its patches on the composed tree"
    sums = state.deps_dir(defn.root, defn.name) / "src" / SUMS_FILE
    if not sums.is_file():
        return None, f"{defn.rel(sums)} is missing"
    return srcs, ""


# ------------------------------------------------------------------------------------------------ resolve


def _resolve(p: Pin, cache: gitcache.Cache, refresh: list[str] | None, rep: ImageReport) -> None:
    m = cache.mirror(p.repo)
    patterns = []
    refreshing = refresh is not None and (not refresh or p.name in refresh)
    ref_is_name = not SHA_RE.match(p.ref)
    # the branch or tag to look up: an unpinned name, or (with --refresh) the name a pin follows
    name = p.ref if ref_is_name else (p.follows if refreshing else None)
    if name:
        patterns += [f"refs/heads/{name}", f"refs/tags/{name}", f"refs/tags/{name}^{{}}"]
    # a pin that says which branch it follows (NAME_REF=<branch>@<sha>) is checked to be on it
    on_branch = p.follows if (not ref_is_name and p.follows and not refreshing) else None
    if on_branch:
        patterns += [f"refs/heads/{on_branch}", f"refs/tags/{on_branch}"]
    want_prs = [n for n, s in p.prs if s is None or refreshing]
    patterns += [f"refs/pull/{n}/head" for n in want_prs]
    if not patterns:
        return
    log.info("  %s: resolving %s on %s", p.name,
             ", ".join(([name] if name else []) + [f"PR {n}" for n in want_prs]), gitcache.redact(p.repo))
    if cache.offline:
        raise gitcache.OfflineMissing(
            f"{p.name}: --offline, but {p.ref_key if ref_is_name else p.prs_key} is not pinned to a commit "
            f"({p.ref if ref_is_name else ', '.join(str(n) for n in want_prs)})",
            hint="run prefetch once with the network to pin it")
    refs = m.ls_remote(patterns, p.name)
    if name:
        sha = (refs.get(f"refs/tags/{name}^{{}}") or refs.get(f"refs/tags/{name}")
               or refs.get(f"refs/heads/{name}"))
        if not sha and ref_is_name:
            raise gitcache.RemoteMissing(f"{p.name}: {p.ref_key}={p.ref}: no branch or tag of that name on "
                                         f"{gitcache.redact(p.repo)}",
                                         hint=f"set {p.ref_key} to a full 40-hex commit sha")
        if not sha:
            msg = f"{p.name}: {name} is gone upstream; keeping the pinned {p.ref[:12]}"
            rep.notices.append(msg)
            log.warning("  warning: %s", msg)
        else:
            if not ref_is_name and sha != p.ref:
                rep.moved.append({"source": p.name, "ref": name, "from": p.ref, "to": sha})
                log.info("  %s: %s moved %s -> %s", p.name, name, p.ref[:12], sha[:12])
            p.ref, p.follows = sha, name
    if on_branch and f"refs/tags/{on_branch}" not in refs:  # a tag pin is compared by --refresh
        _check_on_branch(p, m, on_branch, refs.get(f"refs/heads/{on_branch}"), rep)
    states = _github_states(p.repo, want_prs)
    missing_prs: list[int] = []
    for item in p.prs:
        n, old = item
        if n not in want_prs:
            continue
        head = refs.get(f"refs/pull/{n}/head")
        st = states.get(n)
        api_head = st.pop("head", None) if st else None
        if st:
            rep.pr_states.append({"source": p.name, "number": n, **st})
            if st.get("state") == "closed" and not st.get("merged"):
                msg = f"{p.name}: PR {n} is closed and unmerged"
                rep.notices.append(msg)
                log.warning("  warning: %s", msg)
        if head is None:
            if old is None and api_head:
                # a closed PR whose ref was deleted: the API still names its head, fetched by SHA below
                msg = (f"{p.name}: PR {n}: refs/pull/{n}/head is gone upstream; pinned {n}@{api_head} from the "
                       f"pull-request API ({(st or {}).get('state') or 'state unknown'})")
                rep.notices.append(msg)
                log.warning("  warning: %s", msg)
                item[1] = api_head
                continue
            if old is None:
                missing_prs.append(n)
                continue
            msg = f"{p.name}: PR {n}: refs/pull/{n}/head is gone upstream; keeping the pinned {old[:12]}"
            rep.notices.append(msg)
            log.warning("  warning: %s", msg)
            continue
        if old is not None and old != head:
            rep.moved.append({"source": p.name, "number": n, "from": old, "to": head})
            log.info("  %s: PR %d moved %s -> %s", p.name, n, old[:12], head[:12])
        item[1] = head
    if missing_prs:  # every number that is no pull request with a head, at once
        one = len(missing_prs) == 1
        nums = ", ".join(str(n) for n in missing_prs)
        refs_txt = f"refs/pull/{nums}/head" if one else "refs/pull/N/head for any of them"
        asked = (f"the pull-request API did not name {'its head' if one else 'their heads'} either"
                 if _github_repo(p.repo) else "and it is no GitHub repository, whose API could name the head")
        raise gitcache.RemoteMissing(
            f"{p.name}: pull request{'' if one else 's'} {nums} not found: {gitcache.redact(p.repo)} has no "
            f"{refs_txt}, {asked}",
            hint=f"check the numbers in {p.prs_key}; a closed PR whose ref is gone can still be used "
            f"pinned as {missing_prs[0] if one else 'N'}@<sha> (GITHUB_TOKEN raises the API's rate limit)")


def _check_on_branch(p: Pin, m, branch: str, tip: str | None, rep: ImageReport) -> None:
    """``NAME_REF=<branch>@<sha>``: the pinned commit must be in the branch's history (the log's
    "b12x master 139e0405" is only true if it is). A branch gone upstream is a warning."""
    if tip is None:
        msg = f"{p.name}: {p.ref_key} follows {branch}, which is gone upstream; the pin {p.ref[:12]} is kept"
        rep.notices.append(msg)
        log.warning("  warning: %s", msg)
        return
    if tip != p.ref:
        m.fetch([tip, p.ref], p.name)
        r = m.git("merge-base", "--is-ancestor", p.ref, tip, check=False)
        if r.returncode == 1:
            raise DefinitionError([Problem(
                p.env_display, f"{p.ref_key}={branch}@{p.ref}: that commit is not on {branch} of "
                f"{gitcache.redact(p.repo)} (its tip is {tip[:12]})", key=p.ref_key, line=p.ref_line,
                hint=f"pin a commit of {branch}, or write the branch the commit is on before the @")])
        if r.returncode != 0:
            raise OperationFailed(f"{p.name}: cannot tell whether {p.ref[:12]} is on {branch}: "
                                  + r.stdout.decode("utf-8", "replace").strip()[-200:])
    log.info("  %s: %s is on %s", p.name, p.ref[:12], branch)


def _github_repo(url: str):
    """(owner, repository) of a github.com URL, else None."""
    m = re.match(r"(?:https?://(?:[^@/]+@)?github\.com/|git@github\.com:|ssh://git@github\.com/)"
                 r"([^/]+)/([^/]+?)(?:\.git)?/?\Z", url)
    return (m.group(1), m.group(2)) if m else None


def _github_states(url: str, numbers: list[int]) -> dict[int, dict]:
    """PR state from the GitHub API (only for github.com URLs, only when reachable): ``state``,
    ``merged``, and ``head`` (the head commit's SHA, which the API keeps after a closed PR's ref
    is deleted; None when it gives none)."""
    m = _github_repo(url)
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
                r = requests.get(f"{api}/repos/{m[0]}/{m[1]}/pulls/{n}", headers=headers, timeout=5)
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
            head = (data.get("head") or {}).get("sha") if isinstance(data.get("head"), dict) else None
            out[n] = {"state": data.get("state"), "merged": bool(data.get("merged")),
                      "head": head if isinstance(head, str) and SHA_RE.match(head) else None}
            break
    return out


# ------------------------------------------------------------------------------------------------ fetch


def _fetch(cache: gitcache.Cache, url: str, pins: list[Pin]) -> None:
    m = cache.mirror(url)
    shas = [s for p in pins for s in p.shas()]
    # history: to merge PR heads, and for every source that is no FetchContent dependency, whose version
    # (0.1.dev<commits>+g<sha>, compose.scm_version) counts it, PRs or not; a dependency without PRs is
    # fetched at depth 1 (its build reads no version)
    shallow = all(not p.prs and p.opts.dependency_of for p in pins)
    name = "/".join(p.name for p in pins)
    missing = m.missing(shas)
    if cache.offline:
        if missing:
            p = next(p for p in pins if missing[0] in p.shas())
            raise gitcache.OfflineMissing(
                f"{p.name}: --offline: commit {missing[0]} ({p.what(missing[0])}) is not in the cache "
                f"{m.path}", hint="run prefetch once without --offline")
        if not shallow and m.is_shallow():
            why = ("merging the PRs needs history" if any(p.prs for p in pins) else
                   "deriving its version (0.1.dev<commits>+g<sha>) needs its history")
            raise gitcache.OfflineMissing(f"{name}: --offline: the cached mirror {m.path} is shallow and {why}",
                                          hint="run once without --offline")
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


def _check_fetchcontent(defn, pins: dict[str, Pin], composed, cache, rep: ImageReport):
    """(scans, depcheck result); raises DefinitionError (exit 2) for a declaration nothing pins or
    excludes, and for an override the tree does not read."""
    scans: dict[str, fetchcontent.Scan] = {}
    for p in pins.values():
        if p.opts.scan_fetchcontent:
            m = cache.mirror(p.repo)
            scans[p.name] = _local(lambda m=m, p=p: fetchcontent.scan(m, composed[p.name].commit))
    res = depcheck.check(pins, scans, {n: composed[n].commit for n in scans}, env_file=defn.env.display,
                         yaml_file=defn.rel(defn.dir / d.IMAGE_FILE), env_keys=set(defn.env.entries))
    if res.problems:
        raise DefinitionError(res.problems, image=defn.name)
    for msg in res.notices:
        rep.notices.append(msg)
        log.warning("  note: %s", msg)
    return scans, res


def _compare_tag(parent: Pin, dep: Pin, decl: fetchcontent.Declaration, cache,
                 rep: ImageReport) -> tuple[dict, Problem | None]:
    """The dependency's ``declared_as`` record: the declaration, the tag it gives (resolved through
    variables), the commit that names, and whether the pin matches it (None: cannot tell); and the
    problem when the pin differs without a reason on its line (the caller reports them all at once)."""
    rec = {"name": decl.name, "file": decl.file, "line": decl.line, "repository": decl.repository_value,
           "tag": decl.tag, "tag_value": decl.tag_value,
           "tag_from": decl.tag_resolved.origin if decl.tag_resolved else None,
           "submodule_paths": decl.submodule_paths, "commit": None, "matches": None}
    tag = decl.tag_value
    if not tag:
        return rec, None
    if re.fullmatch(r"[0-9a-f]{7,40}", tag):
        rec["commit"] = tag if len(tag) == 40 else None
        rec["matches"] = dep.ref.startswith(tag)
    elif dep.follows == tag:
        rec["matches"] = True  # pinned from this very tag name
        rec["commit"] = dep.ref
    else:
        sha = _tag_commit(cache.mirror(dep.repo), tag, dep.name, cache.offline)
        rec["commit"] = sha
        rec["matches"] = None if sha is None else sha == dep.ref
    if rec["matches"] is False:
        declared = tag if rec["commit"] in (None, tag) else f"{tag} ({rec['commit'][:12]})"
        via = f" (GIT_TAG {decl.tag}, set at {', '.join(decl.tag_resolved.origin)})" if decl.tag_resolved else ""
        pinned = f"{dep.follows} ({dep.ref[:12]})" if dep.follows else dep.ref[:12]
        alt = next((a for a in decl.alternatives if a.tag_value and (dep.ref.startswith(a.tag_value)
                                                                     or a.tag_value == dep.follows)), None)
        msg = (f"{dep.name}: pinned {pinned} differs from {declared} that {parent.name} declares for "
               f"{decl.name!r} at {decl.where}{via}")
        why = _override_reason(dep.ref_comment)
        if alt:
            msg += f"; it matches the other declaration at {alt.where}"
        elif why:
            msg += f"; kept on purpose: {why}"
        else:  # an override nobody justified: the tree's own pin may be the fix
            return rec, Problem(
                dep.env_display, msg, key=dep.ref_key, line=dep.ref_line,
                hint=f"pin what {parent.name} declares ({declared}), or keep this pin and say why on its line: "
                f"{dep.ref_key}=...  # override: <the reason>")
        rec["override_reason"] = why
        rep.notices.append(msg)
        log.warning("  note: %s", msg)
    return rec, None


def tree_problems(pins: Iterable[Pin], composed: dict[str, compose_mod.Composed]) -> list[Problem]:
    """A problem for each composed source whose tree is not its ``NAME_TREE`` pin, naming both trees
    and the heads the composition used (base and every PR head, as pinned or as just resolved)."""
    out = []
    for p in pins:
        c = composed.get(p.name)
        if not p.tree or c is None or c.tree == p.tree:
            continue
        heads = f"{p.ref_key}={p.ref}" + (f" + {p.prs_key}=\"{' '.join(f'{n}@{s}' for n, s in p.prs)}\""
                                          if p.prs else "")
        what = "the composition of" if p.prs else "the tree of"
        out.append(Problem(
            p.env_display, f"{p.name}: {what} {heads} is tree {c.tree} (commit {c.commit}), not the pinned "
            f"tree {p.tree}: these are not the sources the pin names", key=f"{p.name}_TREE", line=p.tree_line,
            hint=f"a moved PR head or base gives another tree: pin the heads that give {p.tree[:12]} "
            f"({p.prs_key}=\"N@<sha> ...\"), or, if {c.tree[:12]} is what you want, write {p.name}_TREE={c.tree}"))
    return out


def _override_reason(comment: str | None) -> str | None:
    """The reason after ``override:`` in a versions.env line's comment, if any."""
    m = re.search(r"\boverride:\s*(\S.*)", comment or "", re.IGNORECASE)
    return m.group(1).strip() if m else None


_TAGS_FILE = "imagebuild-tags.json"
_tags_lock = threading.Lock()


def _tag_commit(m: gitcache.Mirror, tag: str, source: str, offline: bool) -> str | None:
    """The commit a tag names upstream, remembered in the mirror (no network the second time)."""
    f = m.path / _TAGS_FILE
    with _tags_lock:
        known = json.loads(fsutil.read_text(f)) if f.is_file() else {}
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
            known = json.loads(fsutil.read_text(f)) if f.is_file() else {}
            known[tag] = sha
            atomic_write_text(f, json.dumps(known, indent=1, sort_keys=True) + "\n")
    return sha


def _decl_entry(decl: fetchcontent.Declaration, pins: dict[str, Pin], parent: Pin) -> dict:
    by = [q.name for q in pins.values()
          if q.opts.dependency_of == parent.name and q.opts.declares.lower() == decl.name.lower()]
    return {**decl.as_dict(), "pinned_by": by[0] if by else None,
            "excluded": parent.opts.excluded(decl.name) if not by else None}


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


def _entries(cache, p: Pin, m: gitcache.Mirror, commit: str, subdir: str | None, subs: depcheck.Submodules,
             url: str, prefix: str, depth: int = 0) -> tuple[list[tarball.Entry], list[dict]]:
    """Archive entries of ``commit`` (under ``subdir``) plus the submodules ``subs`` asks for, and
    the list of submodules packed ({path, url, commit}, recursively, paths as in the archive)."""
    listing = _local(lambda: tarball.list_tree(m, commit))
    out: list[tarball.Entry] = []
    links: dict[str, str] = {}
    sub_prefix = (subdir.rstrip("/") + "/") if subdir else ""
    for mode, sha, path in listing:
        if sub_prefix and not path.startswith(sub_prefix):
            continue
        rel = path[len(sub_prefix):]
        if mode == "160000":
            links[path] = sha
            continue
        out.append(tarball.Entry(prefix + rel, mode, sha, m))
    label = p.name + (f" ({prefix.rstrip('/')})" if prefix else "")
    if subs.paths is not None:
        missing = [w for w in subs.paths if w not in links]
        if missing:
            raise OperationFailed(
                f"{label}: {', '.join(repr(w) for w in missing)} (from {subs.origin}) "
                f"{'is not a submodule' if len(missing) == 1 else 'are not submodules'} of commit {commit[:12]}; "
                f"its submodules: {', '.join(sorted(links)) or 'none'}",
                hint=f"fix sources.{p.name}.submodules in image.yaml")
        chosen = [(path, links[path]) for path in sorted(links) if path in subs.paths]
    else:
        chosen = sorted(links.items())
    if not chosen:
        return out, []
    if depth > 8:
        raise OperationFailed(f"{p.name}: submodules nested deeper than 8 levels")
    urls = _gitmodules(m, commit)
    jobs = []
    for path, sha in chosen:
        sub_url = urls.get(path)
        if sub_url is None:
            raise OperationFailed(f"{label}: submodule at {path!r} (commit {sha[:12]}) has no URL in .gitmodules "
                                  f"of {commit[:12]}")
        jobs.append((path, sha, resolve_submodule_url(url, sub_url)))
    packed: list[dict] = []
    nested = depcheck.Submodules(None if subs.recurse else [], subs.recurse, subs.origin)
    for path, sha, sub_url in jobs:
        sm = cache.mirror(sub_url)
        missing = sm.missing([sha])
        what = f"{p.name}:{prefix}{path}"
        if missing:
            if cache.offline:
                raise gitcache.OfflineMissing(f"{what}: --offline: submodule commit {sha} is not in the cache {sm.path}",
                                              hint="run prefetch once without --offline")
            try:
                sm.fetch([sha], what, shallow=True)
            except gitcache.RemoteMissing as exc:
                raise gitcache.RemoteMissing(
                    f"{what}: submodule commit {sha} could not be fetched from {gitcache.redact(sub_url)}: "
                    f"{exc.message.split(': ', 1)[-1]}",
                    hint=f"if the build does not need {path}, list only the submodules it needs in "
                    f"sources.{p.name}.submodules") from None
        rel = path[len(sub_prefix):]
        packed.append({"path": prefix + rel, "url": gitcache.redact(sub_url), "commit": sha})
        sub_entries, sub_packed = _entries(cache, p, sm, sha, None, nested, sub_url, prefix + rel + "/", depth + 1)
        out += sub_entries
        packed += sub_packed
    return out, packed


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
    """Remove the tarballs the lock no longer names: ``.tar`` (FORMAT 2) and ``.tar.gz`` (FORMAT 1
    sources, replaced when repacked; Rust release archives no source pins any more)."""
    for f in sorted(set(srcdir.glob("*.tar")) | set(srcdir.glob("*.tar.gz"))):
        if f.name not in keep:
            try:
                f.unlink()
            except OSError:
                pass


# ------------------------------------------------------------------------------------------------ output


def render(report: Report) -> str:
    lines = []
    for ir in report.images:
        if ir.error:  # one line: the error in full is on stderr
            lines.append(f"{ir.image}: failed (exit {ir.error['exit_code']})  {ir.error['message'].splitlines()[0]}")
            continue
        lines.append(f"{ir.image}: {ir.status}  lock {ir.lock or '-'}  build id {ir.build_id or '-'}")
        for name, e in sorted(ir.sources.items()):
            prs = " ".join(f"#{x['number']}@{x['sha'][:12]}" for x in e.get("prs", []))
            follows = f" ({e['follows']})" if e.get("follows") else ""
            extra = f" (dependency of {e['dependency_of']})" if e.get("dependency_of") else ""
            subs = e.get("submodules") or []
            lines.append(f"  {name:<16} {e['ref'][:12]}{follows}{' + ' + prs if prs else ''}  tree {e['tree'][:12]}"
                         f"{f' + {len(subs)} submodules' if isinstance(subs, list) and subs else ''}  "
                         f"{e['tarball']}{extra}")
            ov = e.get("override")
            if isinstance(ov, dict):
                lines.append(f"  {'':<16} override {ov['name']} ({'environment' if ov['via'] == 'env' else '-D'})")
            for x in e.get("excluded") or []:
                lines.append(f"  {'':<16} excluded {x['name']} ({x['file']}:{x['line']}): {x['reason']}")
        verb = "would pin" if ir.would_write is not None else "pinned"
        for u in ir.pinned:
            lines.append(f"  {verb} {u['key']}: {u['from'] or '-'} -> {u['to']}")
        if ir.would_write is not None:
            w = ir.would_write
            lines.append(f"  would write {w['versions_env']['file']}: "
                         + (", ".join(f"{k}={v}" for k, v in w["versions_env"]["set"].items()) or "nothing"))
            changed = [x["source"] for x in w["lock"]["sources"] if x["changed"]]
            lines.append(f"  would write {w['lock']['file']}: sources "
                         + (", ".join(changed) + " re-composed and packed" if changed else "as they are"))
            if w["packages"]:
                lines.append(f"  packages: {w['packages']}")
            lines.append("  dry run: nothing written")
        for mv in ir.moved:
            what = f"PR {mv['number']}" if "number" in mv else mv["ref"]
            lines.append(f"  moved  {mv['source']} {what}: {mv['from'][:12]} -> {mv['to'][:12]}")
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
