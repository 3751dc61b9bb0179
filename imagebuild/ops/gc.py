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
folders a killed prefetch left in the git mirror cache. A prefetch's mirror ``*.tmp`` folder is
left alone while the prefetch holds the mirror's lock.

**One project's builds only.** The stage store and the engine are shared by every clone on the
node; each build claims its build id and stage keys for its checkout (``buildstep/owners.py``). gc
never removes a build, release or stage another live checkout claims, and while another checkout
claims builds of the image it leaves alone what no checkout claims (made before claims were
recorded). An image this project has neither a definition nor run records of is refused (exit 2).

**Under the image's build lock.** ``collect`` takes each image's build lock (the one ``build``
holds, ``guards.BuildLock``) before it plans and keeps it until the last removal; while a build,
a rollback or another gc of the image holds it, gc refuses (exit 3) and removes nothing.

**Bytes** are what the removal really frees: for engine images, the layers (by chain id) that no
image left in the engine shares, counted once, at the size ``docker history`` gives them (a tag
whose image another tag still holds frees nothing); for files, their size on disk. Planning reads
only manifests and configs, never a layer.

``collect`` plans and (unless ``dry_run``) removes; ``plan_image`` only reads; ``apply`` removes
what a plan lists. ``--dry-run`` prints the plan with the bytes each removal would free.
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

from imagebuild.buildstep import guards, owners
from imagebuild.buildstep import promote as promote_mod
from imagebuild.buildstep.stagestore import StageStore
from imagebuild.core import fsutil, runs, state
from imagebuild.core import lock as lock_mod
from imagebuild.core import run as run_mod
from imagebuild.core.context import Context, of
from imagebuild.core.errors import OperationFailed
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
    # | parse-cache | compiler-cache-tmp | gate-tmp
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
    others: dict[str, str] = field(default_factory=dict)  # build id -> the other checkout that claims it
    claim: dict[str, list[str]] | None = None  # this project's claim after gc: kept build -> stage keys

    @property
    def freed(self) -> int:
        return sum(i.bytes for i in self.remove)

    def as_dict(self) -> dict:
        return {"image": self.image, "kept_builds": self.kept_builds, "other_checkouts": self.others,
                "freed_bytes": self.freed,
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
    unique: int  # bytes of the layers no other image in the engine shares (EngineView.exclusive)
    labels: dict


@dataclass
class EngineView:
    """Every image in the engine with its layers, as chain ids (bottom first: a layer is shared
    only with its whole stack below), and the size of each layer of the images that were sized."""

    layers: dict[str, tuple[str, ...]] = field(default_factory=dict)  # image id -> chain ids
    sizes: dict[str, int] = field(default_factory=dict)  # chain id -> bytes (docker history)
    tags: dict[str, set[str]] = field(default_factory=dict)  # image id -> every repo:tag it has

    def exclusive(self, ids) -> int:
        """Bytes that removing every image in ``ids`` frees: their layers no other image holds."""
        ids = set(ids)
        held = {c for i, cs in self.layers.items() if i not in ids for c in cs}
        mine = {c for i in ids for c in self.layers.get(i, ())}
        return sum(self.sizes.get(c, 0) for c in mine - held)


def _chain_ids(diff_ids: list[str]) -> tuple[str, ...]:
    import hashlib

    out: list[str] = []
    for d in diff_ids:
        out.append(d if not out else "sha256:" + hashlib.sha256(f"{out[-1]} {d}".encode()).hexdigest())
    return tuple(out)


_NO_LAYER = {"ENV", "ARG", "LABEL", "CMD", "ENTRYPOINT", "EXPOSE", "USER", "VOLUME", "STOPSIGNAL",
             "HEALTHCHECK", "SHELL", "ONBUILD", "MAINTAINER"}


def _makes_layer(created_by: str) -> bool:
    """Whether a history entry made a layer, from its command (only asked when sizes alone do not say)."""
    cb = created_by.strip()
    if not cb:
        return True  # an imported base
    if "#(nop)" in cb:
        return bool(re.search(r"#\(nop\)\s*(ADD|COPY)\b", cb))
    return cb.split(None, 1)[0].upper() not in _NO_LAYER


def layer_sizes(rows: list[tuple[int, str]], n: int) -> list[int]:
    """The size of each of an image's ``n`` layers from its ``docker history`` rows (oldest first:
    size, command). A row of a non-zero size made a layer; when that accounts for fewer than ``n``,
    the commands say which zero-size rows did (an empty COPY); failing both, the sized rows are
    taken as the lowest layers."""
    sized = [i for i, (size, _) in enumerate(rows) if size > 0]
    if len(sized) != n:
        guess = [i for i, (size, cb) in enumerate(rows) if size > 0 or _makes_layer(cb)]
        sized = guess if len(guess) == n else sized[:n]
    out = [rows[i][0] for i in sized]
    return out + [0] * (n - len(out))


def engine_view(sized: set[str] | list[str] = ()) -> EngineView:
    """The layers of every image in the engine (one ``docker image inspect``), and the sizes of
    the layers of the images ``sized`` (one ``docker history`` each). Reads no layer."""
    ids = sorted(set(run_mod.output(["docker", "image", "ls", "-a", "-q", "--no-trunc"], timeout=60).split()))
    view = EngineView()
    if not ids:
        return view
    text = run_mod.output(["docker", "image", "inspect", "--format",
                           "{{.Id}}\t{{json .RootFS.Layers}}\t{{json .RepoTags}}", *ids], timeout=120, check=False)
    for ln in text.splitlines():
        iid, _, rest = ln.partition("\t")
        layers, _, tags = rest.partition("\t")
        try:
            view.layers[iid] = _chain_ids([str(d) for d in json.loads(layers) or []])
            view.tags[iid] = {str(t).removeprefix("docker.io/library/") for t in json.loads(tags or "null") or []}
        except ValueError:
            continue
    for iid in sorted(set(sized) & set(view.layers)):
        proc = run_mod.run(["docker", "history", "--human=false", "--no-trunc", "--format",
                            "{{.Size}}\t{{.CreatedBy}}", iid], check=False, timeout=60)
        rows = []
        for ln in reversed(proc.stdout.decode("utf-8", "replace").splitlines()):  # newest first
            size, _, cb = ln.partition("\t")
            rows.append((int(size) if size.strip().isdigit() else 0, cb))
        chain = view.layers[iid]
        for c, n in zip(chain, layer_sizes(rows, len(chain)), strict=True):
            view.sizes.setdefault(c, n)
    return view


def engine_images(image: str, view: EngineView | None = None) -> list[EngineImage]:
    """Every tag of ``image`` and ``imagebuild/image`` in the engine, with its labels and the
    bytes only it holds (``view``: the engine's layers; made here when not given)."""
    ls = ["docker", "image", "ls", "--no-trunc", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}"]
    out = run_mod.output([*ls, f"imagebuild/{image}"], timeout=60) + "\n" + run_mod.output([*ls, image], timeout=60)
    rows = [ln.split() for ln in out.splitlines() if len(ln.split()) == 2 and not ln.endswith("<none>")]
    rows = [(r, i) for r, i in rows if not r.endswith(":<none>")]
    if not rows:
        return []
    if view is None:
        view = engine_view({i for _, i in rows})
    text = run_mod.output(["docker", "image", "inspect", "--format", "{{json .Config.Labels}}",
                           *[r for r, _ in rows]], timeout=120, check=False)
    labels = [json.loads(ln) or {} for ln in text.splitlines() if ln.startswith(("{", "null"))]
    if len(labels) != len(rows):
        labels = [{} for _ in rows]
    return [EngineImage(r, i, view.exclusive({i}), lab) for (r, i), lab in zip(rows, labels, strict=True)]


def engine_bytes(image: str) -> int:
    """What the engine's images of ``image`` hold that no other image shares (``imagebuild df``)."""
    ids = {im.id for im in engine_images(image, EngineView())}
    return engine_view(ids).exclusive(ids) if ids else 0


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
    """What gc of ``image`` keeps and removes. Only reads (the caller holds the image's build
    lock: ``collect``)."""
    root = ctx.root
    p = ImagePlan(image)
    store = StageStore.for_image(root, image)
    imgs = engine_images(image, EngineView())
    view = engine_view({im.id for im in imgs})
    imgs = [EngineImage(im.ref, im.id, view.exclusive({im.id}), im.labels) for im in imgs]
    by_ref = {i.ref: i for i in imgs}
    # -- whose builds: this project's claim, its run records; other live checkouts' claims
    mine = owners.read(owners.owner_path(store.dir, root))
    others = owners.others(store.dir, root)
    other_builds = {b: c.root for c in others for b in c.builds}
    other_keys = {k: c.root for c in others for k in c.keys}
    all_runs = runs.list_runs(ctx, image)
    my_builds = set(mine.builds) if mine else set()
    my_builds.update(r.record.get("build_id") for r in all_runs if r.record.get("build_id"))
    my_keys = set(mine.keys) if mine else set()
    for r in all_runs:
        my_keys.update(s.get("key") for s in r.record.get("stages") or [] if isinstance(s, dict) and s.get("key"))
    claimed = bool(others)  # while another checkout claims builds, what nobody claims is left alone

    # -- which builds are kept
    for tag in (promote_mod.LOCAL, promote_mod.PREVIOUS, promote_mod.CANDIDATE):
        im = by_ref.get(f"{image}:{tag}")
        if im and im.labels.get(LABEL_BUILD_ID):
            p.kept_builds.setdefault(im.labels[LABEL_BUILD_ID], f":{tag}")
    for im in imgs:
        if im.id in in_use and im.labels.get(LABEL_BUILD_ID):
            p.kept_builds.setdefault(im.labels[LABEL_BUILD_ID], "used by a container")
    recent: list[str] = []
    for r in all_runs:
        bid = r.record.get("build_id")
        if bid and bid not in recent:
            recent.append(bid)
    for bid in recent[:keep_n]:
        p.kept_builds.setdefault(bid, f"one of the last {keep_n} builds")
    for bid, who in other_builds.items():
        if bid not in p.kept_builds:
            p.others[bid] = who

    # -- engine images
    kept_keys: set[str] = set()
    claim: dict[str, set[str]] = {b: set((mine.builds if mine else {}).get(b, [])) for b in p.kept_builds}
    for im in imgs:
        bid = im.labels.get(LABEL_BUILD_ID)
        repo, _, tag = im.ref.rpartition(":")
        legacy = repo == f"imagebuild/{image}" and not tag.startswith("release-")
        kind = "release" if tag.startswith("release-") else "tag"
        if im.id in in_use:
            p.keep.append(Item("release", im.ref, im.unique, "used by a container", ref=im.ref))
            kept_keys.update(_stage_keys(im.labels))
        elif legacy:
            p.remove.append(Item("legacy-stage", im.ref, 0, "stage image from before the stage store",
                                 ref=im.ref))
        elif bid in p.kept_builds:
            p.keep.append(Item(kind, im.ref, im.unique, p.kept_builds[bid], ref=im.ref))
            kept_keys.update(_stage_keys(im.labels))
            claim[bid].update(_stage_keys(im.labels))
        elif tag in (promote_mod.LOCAL, promote_mod.PREVIOUS, promote_mod.CANDIDATE):
            p.keep.append(Item("tag", im.ref, im.unique, f":{tag} (not an imagebuild release)", ref=im.ref))
        elif bid in p.others:
            p.keep.append(Item(kind, im.ref, im.unique, f"a build of another checkout ({p.others[bid]})", ref=im.ref))
            kept_keys.update(_stage_keys(im.labels))
        elif bid and claimed and bid not in my_builds:
            p.keep.append(Item(kind, im.ref, im.unique, "no checkout claims this build (made by an older "
                               "imagebuild); another checkout uses this image: left alone", ref=im.ref))
            kept_keys.update(_stage_keys(im.labels))
        elif bid:
            p.remove.append(Item(kind, im.ref, 0, f"build {bid} is not kept", ref=im.ref))
    # the bytes an image frees, once it loses its last tag: its layers no image left in the engine shares
    gone = {it.ref for it in p.remove}
    tags_of: dict[str, set[str]] = {}
    for im in imgs:  # every tag the image has, in any repository: another one keeps it in the engine
        tags_of.setdefault(im.id, set(view.tags.get(im.id, ()))).add(im.ref)
    removed_ids = [i for i, refs in tags_of.items() if refs <= gone]
    others_held = {c for i, cs in view.layers.items() if i not in removed_ids for c in cs}
    counted: set[str] = set()
    for it in p.remove:
        iid = by_ref[it.ref].id
        if iid in removed_ids and iid not in counted:
            counted.add(iid)
            new = set(view.layers.get(iid, ())) - others_held
            it.bytes = sum(view.sizes.get(c, 0) for c in new)
            others_held |= new  # counted once: the next image that held them frees nothing more

    # -- run records
    kept_runs = set()
    for i, r in enumerate(all_runs):
        if r.record.get("build_id") in p.kept_builds or i < keep_n:
            kept_runs.add(r.run_id)
            keys = {s.get("key") for s in r.record.get("stages") or [] if isinstance(s, dict) and s.get("key")}
            kept_keys.update(keys)
            if r.record.get("build_id") in claim:
                claim[r.record["build_id"]].update(keys)
    for r in all_runs:
        if r.run_id not in kept_runs:
            p.remove.append(Item("run", ctx.show(r.dir), tree_bytes(r.dir),
                                 f"run of build {r.record.get('build_id') or '?'} (not kept)", path=str(r.dir)))
    p.claim = {b: sorted(k) for b, k in claim.items()}

    # -- the current definition (its plan's keys are what the next build skips to)
    lock = None
    try:
        defn = defn_mod.load(root, image)
        lock = lock_mod.read(defn.dir)
        stage_names = {s.name for s in defn.stages}
    except Exception:  # noqa: BLE001 - an invalid or absent definition keeps nothing extra
        defn, stage_names = None, None

    # -- stage store: what this project keeps, what other checkouts claim, and (while another
    # checkout claims builds) what nobody claims
    protect = {k: f"a stage of another checkout ({who})" for k, who in other_keys.items()}
    if store.dir.is_dir():
        _plan_store(p, store, kept_keys, protect, my_keys if claimed else None)

    # -- prefetched files
    deps = state.deps_dir(root, image)
    keep_files = _lock_files(root, lock)
    for r in all_runs:
        if r.run_id in kept_runs:
            for t in (r.record.get("inputs") or {}).get("tarballs") or []:
                keep_files.add((root / t).resolve())
    src = deps / "src"
    if src.is_dir() and lock is not None:
        for f in sorted(set(src.glob("*.tar")) | set(src.glob("*.tar.gz"))):  # FORMAT 2 and 1 (and Rust's)
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

    # -- temporary folders of dead runs (the image's lock is held: no run of it is alive)
    tmp = ctx.state / "tmp"
    for d in sorted(tmp.glob(f"build-{image}-*")) if tmp.is_dir() else ():
        p.remove.append(Item("tmp", ctx.show(d), tree_bytes(d), "left by a run that did not end cleanly",
                             path=str(d)))
    return p


def _plan_store(p: ImagePlan, store: StageStore, kept_keys: set[str], protect: dict[str, str],
                mine: set[str] | None) -> None:
    """Stage refs and blobs: a ref is kept when a kept build uses it, another checkout claims it
    (``protect``) or, with ``mine`` given, this project never made it. Reads only refs and
    manifests (``manifest_blobs``), never a layer blob."""
    needed: set[str] = set()
    manifests: set[str] = set()
    for ref in store.refs():
        what = f"{ref.stage} {ref.key[:19]}"
        why = ("a kept build's stage" if ref.key in kept_keys else protect.get(ref.key) or
               ("no checkout claims this stage (made by an older imagebuild); another checkout uses this "
                "image: left alone" if mine is not None and ref.key not in mine else None))
        if why and store.complete(ref.manifest):
            manifests.add(ref.manifest)
            needed.add(ref.manifest)
            needed.update(store.manifest_blobs(ref.manifest) or [])
            p.keep.append(Item("stage-ref", what, 0, why))
        else:
            p.remove.append(Item("stage-ref", what, 0, "no kept build uses this stage",
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
    p.store_index = sorted(manifests)


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


def plan_compiler_cache() -> list[Item]:
    """Folders a killed take-back of the compiler cache left (buildstep/compilecache.py). The caches
    themselves are bounded by ccache's max_size, which every compile applies before they come back."""
    from imagebuild.buildstep import compilecache

    return [Item("compiler-cache-tmp", str(d), tree_bytes(d), "left by a build killed while taking its compiler "
                 "cache back", path=str(d)) for d in compilecache.leftovers()]


def plan_gate_tmp() -> list[Item]:
    """Temporary folders of gates that were killed (``$TMPDIR/imagebuild-gate-*`` of this user whose lock
    is free; a folder without one, from an older version, once it is a day old)."""
    import tempfile
    import time

    out = []
    for d in sorted(Path(tempfile.gettempdir()).glob(state.GATE_TMP_PREFIX + "*")):
        try:
            st = d.lstat()
        except OSError:
            continue
        if not d.is_dir() or d.is_symlink() or st.st_uid != os.getuid():
            continue
        lock = d / state.GATE_TMP_LOCK
        if lock.is_file() and not lock.is_symlink():
            dead = _lock_free(lock)
        else:
            dead = time.time() - st.st_mtime > 86400
        if dead:
            out.append(Item("gate-tmp", str(d), tree_bytes(d), "left by a gate that was killed", path=str(d)))
    return out


def plan_parse_cache() -> list[Item]:
    """The parse cache of earlier versions (``$XDG_CACHE_HOME/imagebuild/parse``): nothing reads it now."""
    d = state.cache_home() / "imagebuild" / "parse"
    if not d.is_dir() or d.is_symlink():
        return []
    return [Item("parse-cache", str(d), tree_bytes(d), "left by an earlier imagebuild (the parse cache is gone)",
                 path=str(d))]


def check_known(ctx: Context, image: str) -> None:
    """``image`` must be one of this project's: a definition under docker-images/, or one it has run
    records of (a definition removed since). Else exit 2: the shared stage store and engine hold
    other checkouts' images, which this project's gc, log and df do not touch."""
    defn_mod.check_image_name(image)
    if (ctx.root / defn_mod.IMAGES_DIR / image / defn_mod.IMAGE_FILE).is_file():
        return
    if (runs.builds_dir(ctx) / image).is_dir():
        return
    # another checkout is named only where the shared stage store really holds builds of that name
    held = StageStore.for_image(ctx.root, image).refs()
    raise defn_mod.unknown_image(
        ctx.root, image, why="no such image in this project (no definition, no build runs recorded)",
        note=(f"the shared stage store holds {len(held)} stage(s) of {image!r}: they belong to another checkout "
              "(run log, df and gc there)") if held else None)


def images_of(ctx: Context, image: str | None) -> list[str]:
    """``image`` (checked: ``check_known``), or every image of this project: its definitions and the
    images it has run records of."""
    if image:
        check_known(ctx, image)
        return [image]
    names = set(defn_mod.list_images(ctx.root))
    bd = runs.builds_dir(ctx)
    if bd.is_dir():
        names.update(p.name for p in bd.iterdir() if p.is_dir() and defn_mod.NAME_RE.match(p.name))
    return sorted(names)


def collect(ctx: Context | Path, image: str | None = None, keep_n: int = DEFAULT_KEEP, *,
            dry_run: bool = False) -> GcPlan:
    """Plan gc of ``image`` (default: every image of the project) and, unless ``dry_run``, remove
    what the plan lists; each image's build lock is held from before its plan until after its last
    removal. GuardRefused (exit 3) while a build, rollback or gc of one of them holds it: nothing
    is removed then."""
    ctx = of(ctx)
    names = images_of(ctx, image)  # an unknown image: exit 2, before the engine is asked
    info = ctx.engine
    if not info.reachable:
        raise OperationFailed(f"no Docker engine reachable: {info.detail}",
                              hint="gc needs the engine to know which builds :local, :previous and :candidate hold")
    held: list[guards.BuildLock] = []
    try:
        for name in names:
            held.append(guards.BuildLock.held(info.id, name, f"imagebuild gc {name}"))
        in_use = container_image_ids()
        plan = GcPlan(keep_n, [plan_image(ctx, name, keep_n, info.id, in_use) for name in names],
                      plan_mirror_cache() + plan_parse_cache() + plan_compiler_cache() + plan_gate_tmp())
        if not dry_run:
            apply(plan, ctx)
        return plan
    finally:
        for lk in reversed(held):
            lk.release()


def plan_gc(ctx: Context | Path, image: str | None = None, keep_n: int = DEFAULT_KEEP) -> GcPlan:
    """The plan alone (``collect`` with ``dry_run``), under the images' build locks."""
    return collect(ctx, image, keep_n, dry_run=True)


# --------------------------------------------------------------------------------------------- removing


def apply(plan: GcPlan, ctx: Context | Path) -> None:
    for ip in plan.images:
        refs = [i.ref for i in ip.remove if i.ref]
        if refs:
            run_mod.run(["docker", "image", "rm", *refs], check=False, timeout=600)
        for it in ip.remove:
            if it.path:
                _remove(Path(it.path))
        store = StageStore.for_image(of(ctx).root, ip.image)
        if ip.store_index is not None:
            _rewrite_index(store, set(ip.store_index))
        if ip.claim is not None:  # this project now claims only the builds it kept
            owners.write(store.dir, of(ctx).root, ip.claim)
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
        idx = json.loads(fsutil.read_text(p))
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
    names = images_of(ctx, image)
    ours = set(names)  # this project's; without IMAGE, the shared store's others too (marked)
    sd = state.stages_dir()
    if image is None and sd.is_dir():
        names += sorted(p.name for p in sd.iterdir() if p.is_dir() and defn_mod.NAME_RE.match(p.name)
                        and p.name not in ours)
    found = {name: engine_images(name, EngineView()) if info.reachable else [] for name in names}
    view = engine_view({im.id for imgs in found.values() for im in imgs}) if info.reachable else EngineView()
    for name in names:
        imgs = found[name]
        seen = {im.id for im in imgs}
        store = StageStore.for_image(root, name)
        rs = runs.list_runs(ctx, name)
        rows.append({
            "image": name, "this_project": name in ours,
            # what removing every image of it would free: the layers no other image shares, once
            "engine": {"tags": len(imgs), "images": len(seen), "bytes": view.exclusive(seen),
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
    from imagebuild.buildstep import compilecache

    return {"schema": "imagebuild.df", "version": 1, "images": rows, "buildkit_cache": cache,
            "git_mirrors": {"path": str(mirrors), "bytes": tree_bytes(mirrors) if mirrors.is_dir() else 0},
            # imagebuild's own compiler caches (buildstep/compilecache.py), shared by the clones on this host
            "compiler_caches": compilecache.usage()}
