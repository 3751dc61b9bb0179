"""Disk: what each image holds (``imagebuild df``) and the retention that keeps a build node from
filling up (``imagebuild gc``).

Retention (docs/build.md, "Disk"), per image:

- **kept builds**: the builds that ``IMAGE:local``, ``:previous`` and ``:candidate`` point at, the
  last N builds that ran (``--keep N``, default 3, newest first by run), and every build whose
  release image a container (running or stopped) uses;
- for each kept build: its release image and tags, its stage images in the stage store (every
  stage key of the build, from the release's ``io.imagebuild.stage-keys`` label or the run
  record) and the blobs they need, the prefetched files its lock names, its run records;
- the current lock's prefetched files are always kept (the next build needs them).

Everything else of the image goes: other release images and ``b-<id>`` tags, stage images
from before the stage store (``imagebuild/IMAGE:<stage>-<key>`` tags), stage-store refs and
blobs no kept build needs, BuildKit's half-written exports (``ingest/``), tarballs in
``deps-src/IMAGE/src/`` that no kept lock names, package folders of stages that no longer
exist, old run records, temporary folders of runs that died (``kill -9``), and the ``*.tmp``
folders a killed prefetch left in the git mirror cache. Anything whose owner is running (a
build of the image holds its lock, a prefetch holds a mirror's lock) is left alone.

``plan_gc`` only reads; ``apply`` removes what a plan lists. ``--dry-run`` prints the plan with
the bytes each removal would free.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from imagebuild.build import guards
from imagebuild.build import promote as promote_mod
from imagebuild.build.stagestore import StageStore
from imagebuild.core import lock as lock_mod
from imagebuild.core import run as run_mod
from imagebuild.core import runs, state
from imagebuild.core.context import Context, of
from imagebuild.definition import reader as defn_mod

log = logging.getLogger("imagebuild")

DEFAULT_KEEP = 3
SCHEMA = "imagebuild.gc"
LABEL_BUILD_ID = "io.imagebuild.build-id"
LABEL_STAGE_KEYS = "io.imagebuild.stage-keys"
_SIZE_RE = re.compile(r"([0-9.]+)\s*([kKMGT]?B)")
_UNITS = {"B": 1, "kB": 1000, "KB": 1000, "MB": 1000 ** 2, "GB": 1000 ** 3, "TB": 1000 ** 4}


@dataclass
class Item:
    # release | tag | legacy-stage | stage-ref | blob | ingest | tarball | package-dir | run | tmp | mirror-tmp
    # | parse-cache
    kind: str
    what: str  # a reference or a path, as shown
    bytes: int
    why: str
    path: str | None = None  # for files and folders
    ref: str | None = None  # for engine images

    def as_dict(self) -> dict:
        return {"kind": self.kind, "what": self.what, "bytes": self.bytes, "why": self.why}


@dataclass
class ImagePlan:
    image: str
    kept_builds: dict[str, str] = field(default_factory=dict)  # build id -> why
    keep: list[Item] = field(default_factory=list)
    remove: list[Item] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # what was left alone and why
    store_index: list[str] | None = None  # manifests BuildKit's index.json keeps (None: unchanged)

    @property
    def freed(self) -> int:
        return sum(i.bytes for i in self.remove)

    def as_dict(self) -> dict:
        return {"image": self.image, "kept_builds": self.kept_builds, "freed_bytes": self.freed,
                "keep": [i.as_dict() for i in self.keep], "remove": [i.as_dict() for i in self.remove],
                "skipped": self.skipped}


@dataclass
class GcPlan:
    keep_n: int
    images: list[ImagePlan]
    shared: list[Item] = field(default_factory=list)  # not per image: the git mirror cache, the parse cache

    @property
    def freed(self) -> int:
        return sum(p.freed for p in self.images) + sum(i.bytes for i in self.shared)

    def as_dict(self, dry_run: bool) -> dict:
        return {"schema": SCHEMA, "version": 1, "dry_run": dry_run, "keep": self.keep_n,
                "freed_bytes": self.freed, "images": [p.as_dict() for p in self.images],
                "shared": [i.as_dict() for i in self.shared]}


# --------------------------------------------------------------------------------------------- sizes


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _parse_size(text: str) -> int:
    m = _SIZE_RE.search(text or "")
    if not m:
        return 0
    return int(float(m.group(1)) * _UNITS.get(m.group(2), 1))


def tree_bytes(path: Path) -> int:
    p = Path(path)
    if p.is_symlink() or p.is_file():
        try:
            return p.lstat().st_size
        except OSError:
            return 0
    total = 0
    for dirpath, _dirs, files in os.walk(p):
        for f in files:
            try:
                total += (Path(dirpath) / f).lstat().st_size
            except OSError:
                pass
    return total


# --------------------------------------------------------------------------------------------- engine


@dataclass(frozen=True)
class EngineImage:
    ref: str  # repo:tag
    id: str
    unique: int  # bytes only this image holds (docker system df -v)
    labels: dict


def engine_images(image: str) -> list[EngineImage]:
    """Every tag of ``image`` and ``imagebuild/image`` in the engine, with its labels and unique size."""
    ls = ["docker", "image", "ls", "--no-trunc", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}"]
    out = run_mod.output([*ls, f"imagebuild/{image}"], timeout=60) + "\n" + run_mod.output([*ls, image], timeout=60)
    rows = [ln.split() for ln in out.splitlines() if len(ln.split()) == 2 and not ln.endswith("<none>")]
    rows = [(r, i) for r, i in rows if not r.endswith(":<none>")]
    if not rows:
        return []
    sizes = _unique_sizes()
    text = run_mod.output(["docker", "image", "inspect", "--format", "{{json .Config.Labels}}",
                           *[r for r, _ in rows]], timeout=120, check=False)
    labels = [json.loads(ln) or {} for ln in text.splitlines() if ln.startswith(("{", "null"))]
    if len(labels) != len(rows):
        labels = [{} for _ in rows]
    return [EngineImage(r, i, sizes.get(i.removeprefix("sha256:")[:12], 0), lab)
            for (r, i), lab in zip(rows, labels, strict=True)]


def _unique_sizes() -> dict[str, int]:
    proc = run_mod.run(["docker", "system", "df", "-v", "--format", "{{json .}}"], check=False, timeout=120)
    try:
        data = json.loads(proc.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {}
    out = {}
    for im in data.get("Images") or []:
        iid = (im.get("ID") or "").removeprefix("sha256:")
        out[iid[:12]] = _parse_size(im.get("UniqueSize") or im.get("Size") or "")
    return out


def container_image_ids() -> set[str]:
    text = run_mod.output(["docker", "ps", "-a", "--no-trunc", "--format", "{{.Image}}"], timeout=60, check=False)
    names = {ln.strip() for ln in text.splitlines() if ln.strip()}
    if not names:
        return set()
    ids = run_mod.output(["docker", "image", "inspect", "--format", "{{.Id}}", *sorted(names)], timeout=60,
                         check=False)
    return {ln.strip() for ln in ids.splitlines() if ln.startswith("sha256:")} | names


# --------------------------------------------------------------------------------------------- planning


def _lock_free(path: Path) -> bool:
    """Whether nobody holds the flock on ``path`` (a build or a prefetch that is running)."""
    if not path.exists():
        return True
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _stage_keys(labels: dict) -> list[str]:
    try:
        return list(json.loads(labels.get(LABEL_STAGE_KEYS) or "{}").values())
    except ValueError:
        return []


def _lock_files(root: Path, lock: dict | None) -> set[Path]:
    out = set()
    for entry in ((lock or {}).get("sources") or {}).values():
        if isinstance(entry, dict) and entry.get("tarball"):
            out.add((root / entry["tarball"]).resolve())
    return out


def plan_image(ctx: Context, image: str, keep_n: int, engine_id: str | None, in_use: set[str]) -> ImagePlan:
    root = ctx.root
    p = ImagePlan(image)
    imgs = engine_images(image)
    by_ref = {i.ref: i for i in imgs}
    # -- which builds are kept
    for tag in (promote_mod.LOCAL, promote_mod.PREVIOUS, promote_mod.CANDIDATE):
        im = by_ref.get(f"{image}:{tag}")
        if im and im.labels.get(LABEL_BUILD_ID):
            p.kept_builds.setdefault(im.labels[LABEL_BUILD_ID], f":{tag}")
    for im in imgs:
        if im.id in in_use and im.labels.get(LABEL_BUILD_ID):
            p.kept_builds.setdefault(im.labels[LABEL_BUILD_ID], "used by a container")
    all_runs = runs.list_runs(ctx, image)
    recent: list[str] = []
    for r in all_runs:
        bid = r.record.get("build_id")
        if bid and bid not in recent:
            recent.append(bid)
    for bid in recent[:keep_n]:
        p.kept_builds.setdefault(bid, f"one of the last {keep_n} builds")

    # -- engine images
    kept_keys: set[str] = set()
    for im in imgs:
        bid = im.labels.get(LABEL_BUILD_ID)
        repo, _, tag = im.ref.rpartition(":")
        legacy = repo == f"imagebuild/{image}" and not tag.startswith("release-")
        if im.id in in_use:
            p.keep.append(Item("release", im.ref, im.unique, "used by a container", ref=im.ref))
            kept_keys.update(_stage_keys(im.labels))
        elif legacy:
            p.remove.append(Item("legacy-stage", im.ref, im.unique, "stage image from before the stage store",
                                 ref=im.ref))
        elif bid in p.kept_builds:
            p.keep.append(Item("release" if tag.startswith("release-") else "tag", im.ref, im.unique,
                               p.kept_builds[bid], ref=im.ref))
            kept_keys.update(_stage_keys(im.labels))
        elif tag in (promote_mod.LOCAL, promote_mod.PREVIOUS, promote_mod.CANDIDATE):
            p.keep.append(Item("tag", im.ref, im.unique, f":{tag} (not an imagebuild release)", ref=im.ref))
        elif bid:
            p.remove.append(Item("release" if tag.startswith("release-") else "tag", im.ref, im.unique,
                                 f"build {bid} is not kept", ref=im.ref))
    # only the last tag of an image frees its bytes: count them once
    removed_ids = {}
    kept_ids = {im.id for im in imgs if any(k.ref == im.ref for k in p.keep)}
    for it in p.remove:
        im = by_ref[it.ref]
        if im.id in kept_ids or im.id in removed_ids:
            it.bytes = 0
        removed_ids[im.id] = True

    # -- run records
    kept_runs = set()
    for i, r in enumerate(all_runs):
        if r.record.get("build_id") in p.kept_builds or i < keep_n:
            kept_runs.add(r.run_id)
            kept_keys.update(s.get("key") for s in r.record.get("stages") or [] if s.get("key"))
    for r in all_runs:
        if r.run_id not in kept_runs:
            p.remove.append(Item("run", ctx.show(r.dir), tree_bytes(r.dir),
                                 f"run of build {r.record.get('build_id') or '?'} (not kept)", path=str(r.dir)))

    # -- the current definition (its plan's keys are what the next build skips to)
    lock = None
    try:
        defn = defn_mod.load(root, image)
        lock = lock_mod.read(defn.dir)
        stage_names = {s.name for s in defn.stages}
    except Exception:  # noqa: BLE001 - an invalid or absent definition keeps nothing extra
        defn, stage_names = None, None

    # -- stage store
    store = StageStore.for_image(root, image)
    image_lock = guards.build_lock_path(engine_id, image)
    if store.dir.is_dir():
        if not _lock_free(image_lock):
            p.skipped.append(f"stage store of {image}: a build of {image} is running")
        else:
            _plan_store(p, store, kept_keys)

    # -- prefetched files
    deps = state.deps_dir(root, image)
    keep_files = _lock_files(root, lock)
    for r in all_runs:
        if r.run_id in kept_runs:
            for t in (r.record.get("inputs") or {}).get("tarballs") or []:
                keep_files.add((root / t).resolve())
    src = deps / "src"
    if src.is_dir() and lock is not None:
        for f in sorted(src.glob("*.tar.gz")):
            if f.resolve() not in keep_files:
                p.remove.append(Item("tarball", ctx.show(f), tree_bytes(f),
                                     "no kept lock names it", path=str(f)))
    if stage_names is not None:
        for kind in ("wheels", "apt"):
            kd = deps / kind
            for d in sorted(kd.iterdir()) if kd.is_dir() else ():
                if d.is_dir() and d.name not in stage_names:
                    p.remove.append(Item("package-dir", ctx.show(d), tree_bytes(d),
                                         f"stage {d.name!r} is not in the definition", path=str(d)))

    # -- temporary folders of dead runs
    tmp = ctx.state / "tmp"
    for d in sorted(tmp.glob(f"build-{image}-*")) if tmp.is_dir() else ():
        if _lock_free(image_lock):
            p.remove.append(Item("tmp", ctx.show(d), tree_bytes(d),
                                 "left by a run that did not end cleanly", path=str(d)))
        else:
            p.skipped.append(f"{d}: a build of {image} is running")
    return p


def _plan_store(p: ImagePlan, store: StageStore, kept_keys: set[str]) -> None:
    needed: set[str] = set()
    for ref in store.refs():
        if ref.key in kept_keys and store.complete(ref.manifest):
            needed.add(ref.manifest)
            needed.update(store.manifest_blobs(ref.manifest) or [])
            p.keep.append(Item("stage-ref", f"{ref.stage} {ref.key[:19]}", 0, "a kept build's stage"))
        else:
            p.remove.append(Item("stage-ref", f"{ref.stage} {ref.key[:19]}", 0, "no kept build uses this stage",
                                 path=str(store.ref_path(ref.key))))
    bdir = store.dir / "blobs" / "sha256"
    for b in sorted(bdir.iterdir()) if bdir.is_dir() else ():
        digest = "sha256:" + b.name
        if digest in needed:
            continue
        p.remove.append(Item("blob", digest[:19], tree_bytes(b), "no kept stage needs it", path=str(b)))
    ingest = store.dir / "ingest"
    if ingest.is_dir() and any(ingest.iterdir()):
        p.remove.append(Item("ingest", str(ingest), tree_bytes(ingest), "half-written export of a run that died",
                             path=str(ingest)))
    p.store_index = sorted(m for m in needed if (store.read_json_blob(m) or {}).get("layers") is not None)


def plan_mirror_cache() -> list[Item]:
    """``*.tmp`` folders a killed prefetch left in the git mirror cache (whose mirror lock is free)."""
    from imagebuild.fetch.gitcache import default_cache_dir

    root = default_cache_dir()
    out = []
    for d in sorted(root.glob(".*.tmp")) if root.is_dir() else ():
        name = d.name[1:].split(".", 1)[0] if d.name.count(".") >= 2 else ""
        mirror = next((m for m in root.glob(f"{name}*") if m.is_dir() and not m.name.startswith(".")), None)
        lockfile = mirror.with_name(mirror.name + ".lock") if mirror else None
        if lockfile is None or _lock_free(lockfile):
            out.append(Item("mirror-tmp", str(d), tree_bytes(d), "left by a prefetch that was killed", path=str(d)))
    return out


def plan_parse_cache() -> list[Item]:
    """The parse cache of earlier versions (``$XDG_CACHE_HOME/imagebuild/parse``): nothing reads it now."""
    d = state.cache_home() / "imagebuild" / "parse"
    if not d.is_dir() or d.is_symlink():
        return []
    return [Item("parse-cache", str(d), tree_bytes(d), "left by an earlier imagebuild (the parse cache is gone)",
                 path=str(d))]


def images_of(ctx: Context, image: str | None) -> list[str]:
    if image:
        defn_mod.check_image_name(image)
        return [image]
    names = set(defn_mod.list_images(ctx.root))
    sd = state.stages_dir()
    if sd.is_dir():
        names.update(p.name for p in sd.iterdir() if p.is_dir() and defn_mod.NAME_RE.match(p.name))
    bd = runs.builds_dir(ctx)
    if bd.is_dir():
        names.update(p.name for p in bd.iterdir() if p.is_dir())
    return sorted(names)


def plan_gc(ctx: Context | Path, image: str | None = None, keep_n: int = DEFAULT_KEEP) -> GcPlan:
    ctx = of(ctx)
    info = ctx.engine
    if not info.reachable:
        from imagebuild.core.errors import OperationFailed

        raise OperationFailed(f"no Docker engine reachable: {info.detail}",
                              hint="gc needs the engine to know which builds :local, :previous and :candidate hold")
    in_use = container_image_ids()
    plans = [plan_image(ctx, name, keep_n, info.id, in_use) for name in images_of(ctx, image)]
    return GcPlan(keep_n, plans, plan_mirror_cache() + plan_parse_cache())


# --------------------------------------------------------------------------------------------- removing


def apply(plan: GcPlan, ctx: Context | Path) -> None:
    for ip in plan.images:
        refs = [i.ref for i in ip.remove if i.ref]
        if refs:
            run_mod.run(["docker", "image", "rm", *refs], check=False, timeout=600)
        for it in ip.remove:
            if it.path:
                _remove(Path(it.path))
        if ip.store_index is not None:
            _rewrite_index(StageStore.for_image(of(ctx).root, ip.image), set(ip.store_index))
    for it in plan.shared:
        if it.path:
            _remove(Path(it.path))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def _rewrite_index(store: StageStore, keep: set[str]) -> None:
    """BuildKit's index.json of the stage store lists only manifests that are still there."""
    from imagebuild.core.fsutil import atomic_write_text

    p = store.dir / "index.json"
    try:
        idx = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    idx["manifests"] = [m for m in idx.get("manifests") or [] if m.get("digest") in keep]
    atomic_write_text(p, json.dumps(idx, separators=(",", ":")))


# --------------------------------------------------------------------------------------------- df


def disk_usage(ctx: Context | Path, image: str | None = None) -> dict:
    """What each image holds on disk: engine images, stage store, prefetched files, run records."""
    ctx = of(ctx)
    root = ctx.root
    info = ctx.engine
    rows = []
    ours = set(defn_mod.list_images(root))  # the rest: other checkouts' stages in the shared store
    for name in images_of(ctx, image):
        imgs = engine_images(name) if info.reachable else []
        seen, engine_bytes = set(), 0
        for im in imgs:
            if im.id not in seen:
                seen.add(im.id)
                engine_bytes += im.unique
        store = StageStore.for_image(root, name)
        rs = runs.list_runs(ctx, name)
        rows.append({
            "image": name, "this_project": name in ours or bool(rs),
            "engine": {"tags": len(imgs), "images": len(seen), "bytes": engine_bytes,
                       "releases": sum(1 for im in imgs if ":release-" in im.ref)},
            "stage_store": {"path": str(store.dir), "stages": len(store.refs()), "bytes": tree_bytes(store.dir)},
            "prefetched": {"path": ctx.show(state.deps_dir(root, name)),
                           "bytes": tree_bytes(state.deps_dir(root, name))},
            "runs": {"count": len(rs), "bytes": sum(tree_bytes(r.dir) for r in rs)},
        })
    for r in rows:
        r["total_bytes"] = r["engine"]["bytes"] + r["stage_store"]["bytes"] + r["prefetched"]["bytes"] + \
            r["runs"]["bytes"]
    cache = None
    if info.reachable:
        proc = run_mod.run(["docker", "system", "df", "--format", "{{json .}}"], check=False, timeout=120)
        for ln in proc.stdout.decode("utf-8", "replace").splitlines():
            try:
                d = json.loads(ln)
            except ValueError:
                continue
            if d.get("Type") == "Build Cache":
                cache = {"bytes": _parse_size(d.get("Size", "")), "reclaimable": d.get("Reclaimable")}
    from imagebuild.fetch.gitcache import default_cache_dir

    mirrors = default_cache_dir()
    return {"schema": "imagebuild.df", "version": 1, "images": rows, "buildkit_cache": cache,
            "git_mirrors": {"path": str(mirrors), "bytes": tree_bytes(mirrors) if mirrors.is_dir() else 0}}
