"""A registry as the stage cache shared by the build nodes (docs/fleet.md, "How the cache decides").

A stage's key names every input the build hands it (plan.py), so the stage built for a key on one
node is the stage for that key on every node. With a registry (``--cache-registry``, or
``registry:`` in imagebuild.yaml), a build:

1. **looks up** every stage of the requested range that its own stage store lacks, at once, under
   ``<registry>/<image>:stage-<key hex>`` (one ``skopeo inspect --raw`` each, in parallel); a stage
   found there is *pulled* instead of built;
2. **pulls** it by the digest the tag named (``repo@sha256:...``, so a tag moved meanwhile cannot mix
   two stages): into a private OCI layout beside the stage store, seeded with hard links of the
   blobs the store already has (only the missing layers cross the link), with
   ``skopeo copy --preserve-digests``;
3. **verifies** before anything enters the store: the manifest's bytes hash to the digest the tag
   named; every blob hashes to its digest and has its size; the config carries the stage's own key
   and name (``io.imagebuild.stage-key`` / ``io.imagebuild.stage``: labels every stage gets when it is
   built) and the definition's platform. Anything else is **refused**: a warning names the registry,
   the key, what was expected and what was found, and the stage is built here. Only then are the
   blobs linked into the stage store, and the stage's ref (the store's commit marker) is written by
   the build;
4. **pushes** each stage it built (and each stage the store has that the registry lacks) under its
   key, in the background while the next stage builds, with ``skopeo copy --preserve-digests`` from
   an OCI layout of exactly that stage (blobs the registry has are not sent again).

A registry that cannot be reached, refuses the credentials or fails mid-build is dropped for the rest
of the build with one warning: every stage still to come is built here, nothing more is pushed, the
build goes on. The record (``registry`` in the build record) lists what was hit, pulled, refused
and pushed, with the digests.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import secrets
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from imagebuild.buildstep.stagestore import MANIFEST_TYPES, StageStore
from imagebuild.core import fsutil
from imagebuild.core import registry as reg_mod

log = logging.getLogger("imagebuild")

TAG_PREFIX = "stage-"
LOOKUP_JOBS = 8
HOLD_ENV = "IMAGEBUILD_REGISTRY_HOLD"  # test hook: "before-pull:STAGE:FILE" waits while FILE exists


def stage_tag(key: str) -> str:
    return TAG_PREFIX + key.split(":", 1)[1]


@dataclass(frozen=True)
class Found:
    stage: str
    key: str
    digest: str  # sha256 of the manifest bytes the tag named
    manifest: bytes


class Refused(Exception):
    """What the registry holds for a key is not that key's stage."""


def verify_pulled(blobs: Path, manifest: bytes, digest: str, descs: list[dict], platform: str, *,
                  trusted: set[str] | frozenset[str] = frozenset()) -> dict:
    """Check what a pull left in ``blobs`` (an OCI layout's ``blobs/sha256``) against the manifest the
    tag named: its bytes, every blob's size and digest (but those in ``trusted``, already checked),
    a config that is a JSON object of the definition's ``platform``; return the config's labels. A
    stage and the compiler cache (compilecache_share.py) are both checked this way. Raises Refused."""
    mpath = blobs / digest.split(":", 1)[1]
    if not mpath.is_file() or mpath.read_bytes() != manifest:
        raise Refused(f"the manifest pulled is not the {len(manifest)} bytes the tag named ({digest})")
    for d in descs:
        p = blobs / d["digest"].split(":", 1)[1]
        if not p.is_file():
            raise Refused(f"blob {d['digest']} is missing after the pull")
        if p.stat().st_size != d["size"]:
            raise Refused(f"blob {d['digest']} has {p.stat().st_size} bytes, the manifest says {d['size']}")
        if d["digest"] not in trusted:
            got = _sha256_file(p)
            if got != d["digest"]:
                raise Refused(f"blob {d['digest']} hashes to {got}: its content was changed")
    try:
        cfg = json.loads(fsutil.read_bytes(blobs / descs[0]["digest"].split(":", 1)[1]))
    except (ValueError, OSError):
        raise Refused("its config is not JSON") from None
    if not isinstance(cfg, dict):
        raise Refused("its config is not a JSON object")
    want = platform.split("/")
    have = [cfg.get("os"), cfg.get("architecture")] + ([cfg.get("variant")] if len(want) > 2 else [])
    if have != want:
        raise Refused(f"its platform is {'/'.join(str(x) for x in have)}, the definition's is {platform}")
    inner = cfg.get("config")
    labels = inner.get("Labels") if isinstance(inner, dict) else None
    return labels if isinstance(labels, dict) else {}


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _descriptors(manifest: dict) -> list[dict]:
    cfg = manifest.get("config")
    layers = manifest.get("layers")
    if not isinstance(cfg, dict) or not isinstance(layers, list):
        raise Refused("the manifest names no config and layers")
    out = [cfg, *layers]
    for d in out:
        if not isinstance(d, dict) or not isinstance(d.get("digest"), str) or not isinstance(d.get("size"), int):
            raise Refused("the manifest has a descriptor without digest and size")
        algo, _, hexpart = d["digest"].partition(":")
        if algo != "sha256" or len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
            raise Refused(f"the manifest names {d['digest']!r}, not a sha256 digest")
    return out


class StageCache:
    """The registry cache of one build (see the module doc)."""

    def __init__(self, reg: reg_mod.Registry, store: StageStore, image: str, platform: str):
        self.reg, self.store, self.image, self.platform = reg, store, image, platform
        self.down: str | None = None
        self.events: list[dict] = []
        self.warnings: list[str] = []
        self.ccache_pushed: dict[str, dict] = {}  # {stage: what its compiler cache's push did} (compilecache_share)
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue()
        self._pusher: threading.Thread | None = None

    # -- state

    def _event(self, **ev) -> None:
        with self._lock:
            self.events.append(ev)

    def _warn(self, msg: str) -> None:
        with self._lock:
            self.warnings.append(msg)
        log.warning("warning: %s", msg)

    def drop(self, why: str) -> None:
        """Stop using the registry for the rest of the build (one warning)."""
        with self._lock:
            if self.down is not None:
                return
            self.down = why
        self._warn(f"{why}; the build goes on without the registry cache: what is left is built here and "
                   "nothing more is pushed")

    def _failed(self, exc: reg_mod.RegistryError, stage: str, key: str) -> None:
        if exc.kind in ("unreachable", "auth", "other"):  # exc.message names the registry and the stage
            self.drop(exc.message + (f" ({exc.hint})" if exc.hint else ""))
        elif exc.kind == "transfer":  # cut part-way: this stage is built here, the registry stays in use
            self._event(stage=stage, key=key, action="error", detail=exc.message)
            self._warn(f"{exc.message}: a transfer failure (the connection was cut part-way), not content that "
                       f"does not verify (stage {stage})")
        else:
            self._event(stage=stage, key=key, action="error", detail=exc.message)

    # -- lookup

    def lookup(self, stages: list[tuple[str, str]]) -> dict[str, Found]:
        """{key: Found} for the (stage, key) pairs the registry holds, asked at once."""
        if self.down or not stages:
            return {}

        def one(item: tuple[str, str]) -> Found | None:
            stage, key = item
            if self.down:
                return None
            try:
                raw = reg_mod.inspect_raw(self.reg, self.reg.ref(self.image, stage_tag(key)),
                                          what=f"looking up stage {stage} ({key[:19]})")
            except reg_mod.RegistryError as exc:
                if exc.kind == "missing":
                    self._event(stage=stage, key=key, action="miss")
                else:
                    self._failed(exc, stage, key)
                return None
            digest = "sha256:" + hashlib.sha256(raw).hexdigest()
            try:
                m = json.loads(raw)
                if not isinstance(m, dict) or m.get("mediaType", MANIFEST_TYPES[0]) not in MANIFEST_TYPES:
                    raise Refused(f"the tag names a {m.get('mediaType') if isinstance(m, dict) else '?'}, not an "
                                  "image manifest")
                _descriptors(m)
            except (ValueError, Refused) as exc:
                self._refuse(stage, key, digest, str(exc) if isinstance(exc, Refused) else "the manifest is not JSON")
                return None
            self._event(stage=stage, key=key, action="hit", digest=digest)
            return Found(stage, key, digest, raw)

        with ThreadPoolExecutor(max_workers=min(LOOKUP_JOBS, len(stages))) as ex:
            found = [f for f in ex.map(one, stages) if f is not None]
        return {} if self.down else {f.key: f for f in found}

    def _refuse(self, stage: str, key: str, digest: str | None, why: str) -> None:
        self._event(stage=stage, key=key, action="refused", digest=digest, detail=why)
        self._warn(f"registry {self.reg}: refused stage {stage} (key {key}, manifest {digest or '?'}): {why}; "
                   "building it here")

    # -- pull

    def pull(self, found: Found) -> str | None:
        """Put the stage ``found`` names into the stage store, verified; its manifest digest, or None
        (refused, or the registry failed: the caller builds the stage)."""
        if self.down:
            return None
        _hold("before-pull", found.stage)
        t0 = time.monotonic()
        tmp = self._tmp("incoming")
        try:
            try:
                m = json.loads(found.manifest)
                descs = _descriptors(m)
            except (ValueError, Refused) as exc:
                self._refuse(found.stage, found.key, found.digest, str(exc))
                return None
            blobs = tmp / "blobs" / "sha256"
            blobs.mkdir(parents=True)
            seeded = set()
            for d in descs:
                src = self.store.blob(d["digest"])
                if src.is_file():
                    _link(src, blobs / d["digest"].split(":", 1)[1])
                    seeded.add(d["digest"])
            try:
                reg_mod.copy(self.reg, f"docker://{self.reg.at(self.image, found.digest)}", f"oci:{tmp}:k",
                             src_remote=True, dest_remote=False,
                             what=f"pulling stage {found.stage} ({found.key[:19]})")
            except reg_mod.RegistryError as exc:
                if exc.kind == "corrupt":
                    self._refuse(found.stage, found.key, found.digest, f"the registry's content does not verify "
                                 f"({exc.message})")
                    return None
                if exc.kind == "missing":
                    self._refuse(found.stage, found.key, found.digest, f"gone from the registry since the lookup "
                                 f"({exc.message})")
                    return None
                self._failed(exc, found.stage, found.key)
                return None
            try:
                self._verify(tmp, found, descs, seeded)
            except Refused as exc:
                self._refuse(found.stage, found.key, found.digest, str(exc))
                return None
            fetched = 0
            for d in [{"digest": found.digest}, *descs]:
                dst = self.store.blob(d["digest"])
                if not dst.is_file():
                    src = blobs / d["digest"].split(":", 1)[1]
                    fetched += src.stat().st_size
                    _link(src, dst)
            self._event(stage=found.stage, key=found.key, action="pulled", digest=found.digest, bytes=fetched,
                        seconds=round(time.monotonic() - t0, 3))
            return found.digest
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _verify(self, tmp: Path, found: Found, descs: list[dict], seeded: set[str]) -> None:
        labels = verify_pulled(tmp / "blobs" / "sha256", found.manifest, found.digest, descs, self.platform,
                               trusted=seeded)
        have_key, have_stage = labels.get("io.imagebuild.stage-key"), labels.get("io.imagebuild.stage")
        if have_key != found.key or have_stage != found.stage:
            raise Refused(f"its config says stage {have_stage!r} with key {have_key!r}, expected stage "
                          f"{found.stage!r} with key {found.key}")

    # -- push

    def push(self, stage: str, key: str, manifest: str) -> None:
        """Push the stage (from the store) under its key, in the background (``finish`` waits)."""
        self.submit(stage, key, lambda: self._push(stage, key, manifest))

    def submit(self, stage: str, key: str, job) -> None:
        """Run ``job()`` on the push thread, after the pushes queued before it (``finish`` waits); the
        compiler cache's push (compilecache_share.py) goes this way too."""
        if self.down:
            return
        if self._pusher is None:
            self._pusher = threading.Thread(target=self._push_loop, daemon=True, name="registry-push")
            self._pusher.start()
        self._q.put((stage, key, job))

    def _push_loop(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                if not self.down:
                    item[2]()
            except Exception as exc:  # noqa: BLE001 - a failed push never fails the build
                log.debug("push", exc_info=True)
                self._event(stage=item[0], key=item[1], action="error", detail=f"{type(exc).__name__}: {exc}")
            finally:
                self._q.task_done()

    def _push(self, stage: str, key: str, manifest: str) -> None:
        t0 = time.monotonic()
        blobs = self.store.manifest_blobs(manifest)
        raw_path = self.store.blob(manifest)
        if blobs is None or not self.store.complete(manifest):
            self._event(stage=stage, key=key, action="error", detail=f"{manifest} is not complete in the store")
            return
        raw = fsutil.read_bytes(raw_path)
        mt = (json.loads(raw).get("mediaType") or MANIFEST_TYPES[0])
        tmp = self._tmp("outgoing")
        try:
            b = tmp / "blobs" / "sha256"
            b.mkdir(parents=True)
            for d in [manifest, *blobs]:
                _link(self.store.blob(d), b / d.split(":", 1)[1])
            (tmp / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
            (tmp / "index.json").write_text(json.dumps({
                "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                "manifests": [{"mediaType": mt, "digest": manifest, "size": len(raw),
                               "annotations": {"org.opencontainers.image.ref.name": "k"}}]}))
            dg = tmp / "digest"
            try:
                reg_mod.copy(self.reg, f"oci:{tmp}:k", f"docker://{self.reg.ref(self.image, stage_tag(key))}",
                             src_remote=False, dest_remote=True, digestfile=dg,
                             what=f"pushing stage {stage} ({key[:19]})")
            except reg_mod.RegistryError as exc:
                self._failed(exc, stage, key)
                return
            got = dg.read_text().strip() if dg.is_file() else None
            if got != manifest:
                self._event(stage=stage, key=key, action="error",
                            detail=f"the registry stored it as {got}, expected {manifest}")
                return
            self._event(stage=stage, key=key, action="pushed", digest=manifest,
                        seconds=round(time.monotonic() - t0, 3))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def finish(self) -> dict:
        """Wait for the pushes; the build record's ``registry`` section."""
        if self._pusher is not None:
            self._q.put(None)
            while self._pusher.is_alive():
                self._pusher.join(0.2)
            self._pusher = None
        return self.as_dict()

    def as_dict(self) -> dict:
        with self._lock:
            events = list(self.events)
        count = {a: sum(1 for e in events if e["action"] == a) for a in ("hit", "pulled", "refused", "pushed")}
        return {"address": str(self.reg), "repository": self.reg.repo(self.image), "down": self.down,
                **count, "events": events}

    def _tmp(self, kind: str) -> Path:
        d = self.store.dir.parent / f".{kind}" / f"{self.image}-{os.getpid()}-{secrets.token_hex(4)}"
        d.mkdir(parents=True)
        return d


def _link(src: Path, dst: Path) -> None:
    """``dst`` as a hard link of ``src`` (a copy across file systems), appearing whole or not at all."""
    if dst.exists():
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
        return
    except FileExistsError:
        return
    except OSError:
        pass
    tmp = dst.with_name(f".{dst.name}.{secrets.token_hex(4)}")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _hold(point: str, stage: str) -> None:
    """Test hook (``IMAGEBUILD_REGISTRY_HOLD=before-pull:STAGE:FILE``): wait while FILE exists (at most
    five minutes), so a test can stop the registry at a known point of a build."""
    spec = os.environ.get(HOLD_ENV, "")
    parts = spec.split(":", 2)
    if len(parts) != 3 or parts[0] != point or parts[1] != stage:
        return
    flag = Path(parts[2])
    log.info("holding before %s of %s while %s exists (%s)", point.split("-", 1)[1], stage, flag, HOLD_ENV)
    deadline = time.monotonic() + 300
    while flag.exists() and time.monotonic() < deadline:
        time.sleep(0.1)


# --------------------------------------------------------------------------------------------- build's hooks


def attach(b) -> None:
    """Give the build ``b`` (build.Build) its registry cache, when it has a registry: stages to build
    that the registry holds become ``pull``; stages the store has and the registry lacks are pushed."""
    if not b.opts.registry:
        return
    reg = reg_mod.parse(b.opts.registry)
    cache = b.cache = StageCache(reg, b.store, b.defn.name, b.plan.platform)
    to_build = [r for r in b.stages if r.action == "build"]
    have = [r for r in b.stages if r.action in ("skip", "reuse") and r.manifest]
    wanted = ([] if b.opts.no_cache else to_build) + have
    found = cache.lookup([(r.name, r.key) for r in wanted])
    if not b.opts.no_cache:
        for r in to_build:
            if r.key in found:
                r.action, r.reason = "pull", f"in the registry cache ({reg})"
                b.found[r.name] = found[r.key]
    if cache.down:
        return
    for r in have:
        if r.key not in found:
            cache.push(r.name, r.key, r.manifest)
