"""``imagebuild sync PEER...``: put the gated image on peer nodes, sending only what they lack, verified.

Per peer (several in parallel, ``jobs``), in this order; nothing on the peer changes before step 4:

1. **Preflight** (one read-only probe over ssh): the peer is reachable, has docker and an engine,
   rsync, flock; which layers its engine already holds (by chain id) and, on a containerd-store
   peer, which blobs its content store holds (the images this tool loaded there and that still
   exist); running containers on the tag that would move; free disk for the transfer and the load.
   A peer whose tag already holds the identity is skipped ("unchanged").
2. **Transfer** of only the missing layer blobs, by digest, with rsync into the peer's cache
   (the image's own ``$CACHE/partial/<lock>/<hex>``, then hashed and moved to ``incoming/<hex>``):
   ``--partial --append-verify``, so an interrupted transfer resumes where it stopped and the resumed
   file is checked whole; syncs of other images never write the same file. The blobs are read where they already
   are on this host (localblobs.py), never exported first.
3. **Load** on the peer: an OCI layout (index.json, manifest.json for the classic store) holding
   the image's manifest and config and only the missing layers, hard-linked from the cache, piped
   into the peer's own ``docker load`` under a staging name (``imagebuild-incoming:<identity>``).
4. **Verify**: the staging image's store-independent identity (identity.py, computed from the
   peer's own ``docker image inspect``) must equal the source's; it must be listed by
   ``docker image ls`` and run (``docker run --rm --pull never ... /bin/sh -c true``).
5. **Promote** on the peer: the old tag becomes ``:previous`` (for ``:local``), the tag moves to the
   verified image id, the gate receipt is carried into the peer's cache (``receipts/``), a record
   is written; the cached blobs of this run are removed (the engine holds them now).

Refusals (exit 3) happen before any byte moves: no passing gate receipt of the definition's
current spec (unless ``force``), a running container on the tag (unless ``force``), too little
disk. Docs: docs/sync.md.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from imagebuild.core import config as config_mod
from imagebuild.core import context as context_mod
from imagebuild.core import identity as identity_mod
from imagebuild.core import remote as remote_mod
from imagebuild.core import run as run_mod
from imagebuild.core.errors import DefinitionError, GuardRefused, OperationFailed, UsageError
from imagebuild.definition import reader as defn_mod
from imagebuild.ship import localblobs, peer_agent
from imagebuild.ship import peer as peer_mod

log = logging.getLogger("imagebuild")

SCHEMA = "imagebuild.sync"
VERSION = 1
RECORD_SCHEMA = "imagebuild.peer-record"
STATUSES = ("synced", "unchanged", "failed", "refused", "dry-run")
DEFAULT_MIN_FREE_GIB = 1.0
PROGRESS_EVERY_S = 2.0
FULL_DISK_BYTES = 4 << 20  # after rsync's "error in file IO", a peer cache with less free than this is full
INLINE_LAYERS_MAX = 4 << 20  # missing layers up to this much travel inside the load call (no rsync)
# every remote step is bounded (a frozen peer engine must not hang a sync): the quick steps by
# STEP_TIMEOUT_S, the load (and a pull) by LOAD_BASE_S plus what it moves at LOAD_MIN_RATE;
# IMAGEBUILD_SYNC_TIMEOUT=SECONDS bounds every remote step instead
STEP_TIMEOUT_S = 300
LOAD_BASE_S = 600
LOAD_MIN_RATE = 10_000_000  # bytes/s: a docker load slower than this is stuck
HEARTBEAT_S = 30  # a line per peer while its load (or pull) runs; IMAGEBUILD_SYNC_HEARTBEAT=SECONDS, 0: none
LOCK_WAIT_S = 1800  # how long a sync waits for another sync of the same image to the same peer


def _seconds_env(name: str, default: float, *, zero_ok: bool = False) -> float:
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    try:
        n = float(v)
    except ValueError:
        n = -1.0
    if n < 0 or (n == 0 and not zero_ok) or n > 30 * 86400:
        raise UsageError(f"{name}={v!r}: expected a number of seconds" + (" (0: off)" if zero_ok else " above 0"))
    return n


def step_timeout(default: float = STEP_TIMEOUT_S) -> float:
    """The bound of a remote step: ``IMAGEBUILD_SYNC_TIMEOUT`` when set, else ``default``."""
    return _seconds_env("IMAGEBUILD_SYNC_TIMEOUT", default)


def stream_stall_s() -> int:
    """How long the streamed load waits on a layer blob that stopped growing before it gives up (a
    frozen link): the step bound, at least 5 s and at most 60 s."""
    return max(5, int(min(60, step_timeout())))


def load_timeout(nbytes: int) -> float:
    """The bound of a load or pull that moves ``nbytes``: 600 s plus 1 s per 10 MB."""
    return step_timeout(LOAD_BASE_S + nbytes / LOAD_MIN_RATE)


def heartbeat_every() -> float:
    return _seconds_env("IMAGEBUILD_SYNC_HEARTBEAT", HEARTBEAT_S, zero_ok=True)


# ------------------------------------------------------------------------------------------------ results


@dataclass
class PeerResult:
    peer: str
    status: str  # "synced" | "unchanged" | "failed" | "refused" | "dry-run"
    bytes_sent: int
    seconds: float
    message: str
    identity: str | None  # the identity verified on the peer
    store: str | None = None  # the peer's image store: classic | containerd
    layers_sent: int = 0
    layers_total: int = 0
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"peer": self.peer, "status": self.status, "bytes_sent": self.bytes_sent,
                "seconds": round(self.seconds, 3), "message": self.message, "identity": self.identity,
                "store": self.store, "layers_sent": self.layers_sent, "layers_total": self.layers_total,
                "details": self.details}


@dataclass
class SyncReport:
    image: str | None
    ref: str
    identity: str
    peers: list[PeerResult]
    receipt: dict | None = None  # {"spec", "authority", "result"} of the receipt that authorized it
    forced: bool = False
    source: str | None = None  # where the blobs were read: content-store | docker-save
    via: str = "ssh"  # ssh | registry (registry_sync.py)
    registry: dict | None = None  # with --via registry: what was pushed where (registry_sync.Delivery)

    @property
    def ok(self) -> bool:
        return all(p.status in ("synced", "unchanged", "dry-run") for p in self.peers)

    @property
    def exit_code(self) -> int:
        from imagebuild.core.errors import EXIT_FAILED, EXIT_OK, EXIT_REFUSED

        if self.ok:
            return EXIT_OK
        bad = [p for p in self.peers if p.status not in ("synced", "unchanged", "dry-run")]
        return EXIT_REFUSED if all(p.status == "refused" for p in bad) else EXIT_FAILED

    def have_image(self) -> list[str]:
        return [p.peer for p in self.peers if p.status in ("synced", "unchanged")]

    def as_dict(self) -> dict:
        return {"schema": SCHEMA, "version": VERSION, "image": self.image, "ref": self.ref,
                "identity": self.identity, "ok": self.ok, "forced": self.forced, "source": self.source,
                "receipt": self.receipt, "peers": [p.as_dict() for p in self.peers],
                "have_image": self.have_image(), "via": self.via, "registry": self.registry}


# ------------------------------------------------------------------------------------------------ inputs


def resolve_peers(ctx: context_mod.Context | Path | None, peers: list[str]) -> list[str]:
    """Peer names: SSH destinations, or ``@NAME`` for a named list of the project config
    (``peer_lists:``); none given: the config's ``peers:``. No project (``ctx`` None): no config."""
    ctx = context_mod.maybe(ctx)
    cfg = ctx.config if ctx is not None else config_mod.load(None)
    out: list[str] = []
    for p in peers or []:
        if p.startswith("@"):
            lists = getattr(cfg, "peer_lists", {}) or {}
            if p[1:] not in lists:
                known = ", ".join("@" + k for k in sorted(lists)) or "none"
                raise UsageError(f"no peer list {p!r} in {config_mod.CONFIG_FILE}",
                                 hint=f"named lists: {known} (peer_lists: {{{p[1:]}: [dgx4, dgx5]}})")
            out += lists[p[1:]]
        else:
            out.append(p)
    if not peers:
        out = list(cfg.peers)
    if not out:
        raise UsageError("no peer to sync to",
                         hint="name one (imagebuild sync dgx4) or list them in imagebuild.yaml (peers: [dgx4])")
    for p in out:
        remote_mod.check_destination(p)
    remote_mod.ssh_command()  # $IMAGEBUILD_SSH splits (exit 2 naming it), before any peer's step
    return list(dict.fromkeys(out))


def resolve_image(ctx: context_mod.Context | Path | None, image: str | None, ref: str | None) -> tuple[str | None, str]:
    """(definition name or None, image reference). IMAGE means IMAGE:local."""
    ctx = context_mod.maybe(ctx)
    root = ctx.root if ctx is not None else None
    if image and ref:
        raise UsageError("give the image or a reference, not both")
    if image and any(c in image for c in ":/@"):
        image, ref = None, image
    if image:
        defn_mod.check_image_name(image)
        if root is None or not (Path(root) / defn_mod.IMAGES_DIR / image).is_dir():
            raise defn_mod.unknown_image(root, image, note="a full reference works too: --image NAME:TAG")
        return image, f"{image}:local"
    if ref:
        repo = _repo(ref)
        known = root is not None and "/" not in repo and (Path(root) / defn_mod.IMAGES_DIR / repo).is_dir()
        return (repo if known else None), ref
    names = defn_mod.list_images(root) if root is not None else []
    if len(names) == 1:
        return names[0], f"{names[0]}:local"
    raise UsageError("which image? (--image IMAGE or --image REF)",
                     hint=f"definitions here: {', '.join(names) or 'none'}")


def promoted(ctx: context_mod.Context | Path) -> list[tuple[str, str | None]]:
    """Every definition of the project, in name order, with None when its ``:local`` is a promoted image
    (it holds a trusted passing receipt of the definition's current gate spec here, as promotion asked),
    else why it is not sent: what ``imagebuild sync PEER`` alone does (docs/cli.md)."""
    from imagebuild.buildstep import promote as promote_mod
    from imagebuild.gate import receipts as receipts_mod

    ctx = context_mod.of(ctx)
    out: list[tuple[str, str | None]] = []
    for name in defn_mod.list_images(ctx.root):
        try:
            spec_path = promote_mod.current_spec(ctx, name)
        except DefinitionError as exc:
            out.append((name, f"{exc.message} (imagebuild validate {name})"))
            continue
        if spec_path is None:
            out.append((name, "no gate spec: nothing authorizes a sync"))
            continue
        try:
            ident = identity_mod.inspect(f"{name}:local")
        except OperationFailed:
            out.append((name, f"no {name}:local in the engine (never promoted here)"))
            continue
        verdict = receipts_mod.check(ctx, ident.digest, promote_mod.current_spec_digest(ctx, name), spec=spec_path)
        if not verdict.trusted:
            out.append((name, f"{name}:local has no trusted passing receipt of the current gate spec here "
                        f"(imagebuild sync --image {name} --force PEER sends it anyway)"))
            continue
        out.append((name, None))
    return out


def image_named_as_peer(ctx: context_mod.Context | Path | None, peers: list[str]) -> None:
    """Exit 2 when a PEER word is the name of one of the project's definitions and not a peer of
    imagebuild.yaml (``peers:``, ``peer_lists:``): ``imagebuild sync IMAGE`` meant ``--image IMAGE``."""
    ctx = context_mod.maybe(ctx)
    if ctx is None:
        return
    cfg = ctx.config
    configured = set(cfg.peers) | {h for hosts in (getattr(cfg, "peer_lists", {}) or {}).values() for h in hosts}
    for p in peers:
        if p in configured or not defn_mod.NAME_RE.match(p) or \
                not (ctx.root / defn_mod.IMAGES_DIR / p / defn_mod.IMAGE_FILE).is_file():
            continue
        others = [q for q in peers if q != p]
        to = " ".join(others) if others else ("(the peers of imagebuild.yaml)" if cfg.peers else "PEER")
        raise UsageError(f"{p!r} is an image of this project (docker-images/{p}/), not a peer",
                         hint=f"imagebuild sync --image {p} {to}".rstrip())


def _repo(ref: str) -> str:
    if "@" in ref:
        return ref.split("@", 1)[0]
    last = ref.rsplit("/", 1)[-1]
    return ref.rsplit(":", 1)[0] if ":" in last else ref


def _tag(ref: str) -> str | None:
    last = ref.rsplit("/", 1)[-1]
    return last.rsplit(":", 1)[1] if ":" in last and "@" not in ref else None


def previous_ref(ref: str) -> str | None:
    """What the replaced image is kept as: ``NAME:previous`` when ``ref`` is ``NAME:local``."""
    return f"{_repo(ref)}:previous" if _tag(ref) == "local" else None


def staging_ref(identity: str) -> str:
    return f"{peer_mod.STAGING_REPO}:{identity.split(':', 1)[1][:24]}"


def _hexof(digest: str | None) -> str:
    return digest.split(":", 1)[1] if digest else "-"


def human(n: float) -> str:
    from imagebuild.core.units import human_bytes  # one unit system for every command (MiB, GiB)

    return human_bytes(n)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _gib_env(name: str, default: float) -> float:
    v = os.environ.get(name)
    try:
        return float(v) if v else default
    except ValueError:
        raise UsageError(f"{name}={v!r}: expected a number of GiB") from None


def build_time(ctx, image: str | None, img: localblobs.LocalImage) -> str | None:
    """When this build was made by this project: the latest finished run of ``image`` whose release is
    this identity (``<state>/builds/``), or None (no record here: built elsewhere, or not by imagebuild)."""
    if ctx is None or not image:
        return None
    from imagebuild.core import runs as runs_mod

    try:
        times = [r.summary().get("finished") for r in runs_mod.list_runs(ctx, image)
                 if r.summary().get("identity") == img.identity.digest]
    except (OSError, ValueError):
        times = []
    times = [t for t in times if isinstance(t, str) and _when(t) is not None]
    return max(times, key=_when) if times else None


def _when(text: object) -> float | None:
    """Seconds since the epoch of an RFC 3339 time (nanoseconds allowed), or None."""
    if not isinstance(text, str) or len(text) < 19:
        return None
    m = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)?$", text.strip())
    if not m:
        return None
    frac = (m.group(2) or ".0")[:7]
    try:
        t = datetime.fromisoformat(m.group(1) + frac + (m.group(3) or "Z").replace("Z", "+00:00"))
    except ValueError:
        return None
    return t.timestamp()


# ------------------------------------------------------------------------------------------------ compression


@dataclass(frozen=True)
class Compression:
    args: tuple[str, ...]
    why: str


_LINK_RATES: dict[str, float] = {}


def _measure_link(conn: peer_mod.Connection, nbytes: int = 32 << 20) -> float:
    """Bytes per second through ``conn`` (incompressible data into the peer's /dev/null)."""
    if conn.host in _LINK_RATES:
        return _LINK_RATES[conn.host]
    # timed on the peer, after a first MiB: the connection's set-up is not part of the rate
    warm = 1 << 20
    cmd = (f"sh -c 'head -c {warm} >/dev/null; a=$(date +%s.%N); head -c {nbytes} >/dev/null; "
           "b=$(date +%s.%N); echo \"$a $b\"'")
    t0 = time.monotonic()
    out = run_mod.output(conn.ssh_argv(cmd), input=os.urandom(warm + nbytes), timeout=120)
    try:
        a, b = (float(x) for x in out.split()[-2:])
        took = b - a
    except ValueError:
        took = time.monotonic() - t0
    rate = nbytes / max(took, 1e-3)
    conn.bytes_sent += warm + nbytes
    _LINK_RATES[conn.host] = rate
    return rate


def _zstd_rate(sample: bytes) -> tuple[float, float] | None:
    """(bytes/s, ratio) of ``zstd -1`` on ``sample`` (None without zstd)."""
    if not run_mod.which("zstd"):
        return None
    t0 = time.monotonic()
    out = run_mod.run(["zstd", "-1", "-c", "-q"], input=sample, timeout=60).stdout
    return len(sample) / max(time.monotonic() - t0, 1e-3), len(out) / max(len(sample), 1)


def choose_compression(conn: peer_mod.Connection, st: peer_mod.PeerState, layers: list[localblobs.Layer],
                       files: dict[str, Path]) -> Compression:
    """Compression on the wire: ``IMAGEBUILD_SYNC_COMPRESS`` = auto (default) | none | zstd[:LEVEL].

    auto: layers that are already compressed (gzip, zstd: what the containerd store holds) are sent
    as they are; for uncompressed layers (the classic store's docker save) the link is measured
    (32 MiB through the same ssh) and zstd -1 on a sample of the data, and rsync compresses with
    zstd only when that is clearly faster than sending plain (compression must never be the
    bottleneck: on a 200 Gb/s link it is not used)."""
    mode = os.environ.get("IMAGEBUILD_SYNC_COMPRESS", "auto").strip().lower()
    if mode in ("none", "off", "0", ""):
        return Compression((), "off (IMAGEBUILD_SYNC_COMPRESS=none)")
    if mode.startswith("zstd"):
        level = mode.partition(":")[2] or "1"
        if not st.rsync_zstd:
            return Compression((), f"off: the peer's rsync has no zstd ({st.rsync_version})")
        return Compression(("--compress", "--compress-choice=zstd", f"--compress-level={level}"),
                           f"zstd -{level} (IMAGEBUILD_SYNC_COMPRESS)")
    if mode != "auto":
        raise UsageError(f"IMAGEBUILD_SYNC_COMPRESS={mode!r}: expected auto, none or zstd[:LEVEL]")
    plain = [la for la in layers if not la.compressed]
    plain_bytes = sum(la.size for la in plain)
    if plain_bytes < (64 << 20):
        return Compression((), "off: the layers are compressed already" if layers else "off: nothing to send")
    if not st.rsync_zstd:
        return Compression((), "off: the peer's rsync has no zstd")
    biggest = max(plain, key=lambda la: la.size)
    try:
        with open(files[biggest.digest], "rb") as f:
            f.seek(min(biggest.size // 3, max(0, biggest.size - (16 << 20))))
            sample = f.read(16 << 20)
    except OSError:
        return Compression((), "off: cannot sample the data")
    z = _zstd_rate(sample)
    if z is None:
        return Compression((), "off: no zstd here to measure it")
    zrate, ratio = z
    link = _measure_link(conn)
    t_plain = plain_bytes / link
    t_zstd = max(plain_bytes / zrate, plain_bytes * ratio / link)
    facts = f"link {human(link)}/s, zstd -1 {human(zrate)}/s at ratio {ratio:.2f}"
    if t_zstd < 0.8 * t_plain:
        return Compression(("--compress", "--compress-choice=zstd", "--compress-level=1"), f"zstd -1 ({facts})")
    return Compression((), f"off ({facts}: sending plain is as fast)")


def _rate_and_eta(done: int, total: int, seconds: float) -> tuple[str, str]:
    """The transfer's mean rate so far in binary units (``312.4 MiB/s``: rsync's own figure is in other
    units) and the time left at that rate (``0:00:03``)."""
    rate = done / seconds if seconds > 0 else 0.0
    left = int(max(0, total - done) / rate + 0.5) if rate > 0 else 0
    return f"{human(rate)}/s", f"{left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}"


def blob_tar_header(hexname: str, size: int) -> bytes:
    """The tar header of ``blobs/sha256/HEX`` (SIZE bytes) in the image tar the peer's streamed load reads
    (``ib_stream_tar``): ustar, or pax for a blob of 8 GiB or more; no owner, mode 0644, time 0."""
    import tarfile

    ti = tarfile.TarInfo(f"blobs/sha256/{hexname}")
    ti.size, ti.mode, ti.mtime, ti.uname, ti.gname = size, 0o644, 0, "", ""
    return ti.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


# ------------------------------------------------------------------------------------------------ the run


class _Shared:
    """What every peer's worker shares: the source image, the verifier, the options."""

    def __init__(self, ctx, image, ref, img: localblobs.LocalImage, receipt: dict | None, spec: str | None,
                 force: bool, dry_run: bool):
        self.ctx, self.image, self.ref, self.img = ctx, image, ref, img
        self.receipt, self.spec, self.force, self.dry_run = receipt, spec, force, dry_run
        self.verifier = localblobs.Verifier()
        self.lock = threading.Lock()
        self.verified: set[str] = set()
        self.sessions: dict[str, _Session] = {}
        self.identity = img.identity.digest
        self.staging = staging_ref(self.identity)
        self.previous = previous_ref(ref)
        self.quick_ids = list(dict.fromkeys([img.target.digest, *img.inline]))
        self.pauses = {p.strip() for p in os.environ.get("IMAGEBUILD_SYNC_PAUSE", "").split(",") if p.strip()}
        self.built = build_time(ctx, image, img)  # this project's build record time, or None (older-build guard)
        self.worker = _PeerSync  # per peer; the delivery's worker with --via registry
        self.delivery = None  # registry_sync.Delivery with --via registry (sync's delivery=)
        self.receipt_raw: bytes | None = None  # the receipt file's bytes and its signature (.json.sig)
        self.receipt_sig: str | None = None

    def verify_files(self, layers) -> None:
        """Every blob file we send is first checked against its digest (once per file)."""
        for la in layers:
            with self.lock:
                if la.digest in self.verified:
                    continue
                path = self.img.files[la.digest]
                if not self.verifier.check(path, la.digest):
                    raise OperationFailed(f"the local blob {path} does not match its digest {la.digest}",
                                          hint="IMAGEBUILD_SYNC_SOURCE=save reads the image with docker save instead")
                self.verified.add(la.digest)

    def pause(self, phase: str, host: str) -> None:
        """Test and debug hook: IMAGEBUILD_SYNC_PAUSE=PHASE[,PHASE] stops before that phase (transfer,
        load, promote) for up to an hour, so a test can kill the sender at a known point."""
        if phase in self.pauses:
            log.info("%s: paused before %s (IMAGEBUILD_SYNC_PAUSE)", host, phase)
            time.sleep(3600)


def sync(ctx: context_mod.Context | Path | None, peers: list[str], *, image: str | None = None, ref: str | None = None, jobs: int = 4,
         force: bool = False, dry_run: bool = False, delivery=None) -> SyncReport:
    """Put ``ref`` (default ``image:local``) on every peer; returns the report (see the module doc).
    ``delivery``: how the peers get it other than over ssh, made once the image is known:
    ``registry_sync.delivery(registry, tunnel)`` has the peers pull it from a registry (``--via
    registry``; the tunnel: None means when the registry is this host's loopback)."""
    from imagebuild.buildstep import promote as promote_mod
    from imagebuild.gate import receipts as receipts_mod

    if jobs < 1:
        raise UsageError(f"--jobs {jobs}: expected 1 or more")
    # the environment's bounds are checked here, before any peer's worker reads them (exit 2)
    step_timeout()
    heartbeat_every()
    _seconds_env("IMAGEBUILD_SYNC_LOCK_WAIT", LOCK_WAIT_S, zero_ok=True)
    ctx = context_mod.maybe(ctx)
    peers = resolve_peers(ctx, peers)
    image, ref = resolve_image(ctx, image, ref)
    # the ssh sessions start now, while the image is read here (a session start costs 0.2-0.7 s)
    sessions = {p: _Session(p, start=i < jobs) for i, p in enumerate(peers)}
    try:
        img = localblobs.load(ref)
    except BaseException:
        for sess in sessions.values():
            sess.close()
        raise
    ident = img.identity.digest  # computed from the image here: the receipt must re-hash to it
    spec_path = promote_mod.current_spec(ctx, image) if (image and ctx is not None) else None
    spec = promote_mod.current_spec_digest(ctx, image) if (image and ctx is not None) else None
    verdict = receipts_mod.check(ctx, ident, spec, spec=spec_path) if spec else None
    receipt = verdict.data if verdict else None
    rinfo = None
    if receipt:
        rinfo = {"spec": spec, "authority": receipt.get("authority"), "result": receipt.get("result"),
                 "gpu_checks_skipped": bool(receipt.get("gpu_checks_skipped")), "signed": verdict.signed,
                 "signer": verdict.signer}
    if receipt is None:
        if spec is None and image is None:
            why = (f"{ref} is not an image of this project (no docker-images/{_repo(ref)}/): no gate spec can "
                   "authorize it")
        elif spec is None:
            why = f"{image} has no gate spec: nothing can authorize syncing {ref}"
        else:
            why = (f"{ref} ({ident}) has no passing receipt of {image}'s current gate spec ({spec[:19]})"
                   + promote_mod.untrusted_note(verdict))
        if not force:
            for sess in sessions.values():
                sess.close()
            hint = f"imagebuild gate {image} --ref {ref}" if image else "gate it, or --force"
            log.warning("refused: %s (%s; --force syncs it anyway)", why, hint)
            return SyncReport(image, ref, ident, [PeerResult(p, "refused", 0, 0.0, f"{why}; {hint}, or --force", None)
                                                  for p in peers], None, False, img.source)
        log.warning("warning: %s; syncing anyway (--force)", why)
    where = "the engine's content store" if img.source == "content-store" else "docker save (spooled)"
    log.info("sync %s (identity %s, %d layers, %s; blobs read from %s) to %s", ref, ident, len(img.layers),
             human(img.compressed_size()), where, ", ".join(peers))
    shared = _Shared(ctx, image, ref, img, receipt, spec, force, dry_run)
    if receipt:  # the file's exact bytes travel (its signature is over them), with the signature
        shared.receipt_raw, shared.receipt_sig = verdict.raw, verdict.signature
    shared.sessions = sessions
    via = "ssh"
    if delivery is not None:
        via = "registry"
        shared.delivery = delivery(image, ref, ident)
        shared.worker = shared.delivery.worker
        if not dry_run:
            try:
                shared.delivery.publish()
            except BaseException:
                for sess in sessions.values():
                    sess.close()
                raise
    results: dict[str, PeerResult] = {}
    try:
        _run_parallel(shared, peers, jobs, results)
    finally:
        shared.verifier.save()
        for sess in sessions.values():
            sess.close()
    report = SyncReport(image, ref, ident, [results[p] for p in peers], rinfo, bool(force and receipt is None),
                        img.source, via, shared.delivery.as_dict() if shared.delivery is not None else None)
    return report


class _Session:
    """A peer's ssh session, opened in the background as soon as the peers are known (the first
    ``jobs`` of them; the others when their turn comes)."""

    def __init__(self, host: str, start: bool = True):
        self.conn = peer_mod.Connection(host)
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        if start:
            self.start()

    def start(self) -> None:
        with self._lock:
            if self.thread is None and not self._closed:
                self.thread = threading.Thread(target=self._open, daemon=True, name=f"open-{self.conn.host}")
                self.thread.start()

    def _open(self) -> None:
        try:
            self.conn.open()
        except BaseException as exc:  # noqa: BLE001 - reported by the peer's worker
            self.error = exc
        with self._lock:
            if self._closed:  # closed while it was opening: end it now
                self.conn.close()

    def get(self) -> peer_mod.Connection:
        self.start()
        while self.thread is not None and self.thread.is_alive():
            self.thread.join(0.2)
        if self.error is not None:
            raise self.error
        return self.conn

    def close(self, wait: float = 10) -> None:
        with self._lock:
            self._closed = True
            opening = self.thread is not None and self.thread.is_alive()
        if not opening:
            try:
                self.conn.close(wait)
            except Exception:  # noqa: BLE001
                pass


def _run_parallel(shared: _Shared, peers: list[str], jobs: int, results: dict[str, PeerResult]) -> None:
    """Daemon threads (a Ctrl-C or kill ends the process, and with it every child: rsync has
    ``die_with_parent``), at most ``jobs`` at a time."""
    sem = threading.Semaphore(jobs)
    threads = []

    def work(host: str) -> None:
        with sem:
            results[host] = _sync_peer(shared, host)

    for host in peers:
        t = threading.Thread(target=work, args=(host,), name=f"sync-{host}", daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        while t.is_alive():
            t.join(0.2)


def _sync_peer(shared: _Shared, host: str) -> PeerResult:
    t0 = time.monotonic()
    res = PeerResult(host, "failed", 0, 0.0, "", None)
    sess = shared.sessions[host]
    conn = sess.conn
    try:
        conn = sess.get()
        shared.worker(shared, conn, res).run()
    except peer_mod.AgentRefused as exc:
        res.status, res.message = "refused", exc.message.removeprefix(f"{host}: ")
    except GuardRefused as exc:
        res.status, res.message = "refused", exc.message
    except OperationFailed as exc:
        res.status, res.message = "failed", exc.message.removeprefix(f"{host}: ")
        if exc.hint:
            res.message += f" ({exc.hint})"
    except Exception as exc:  # a bug must not take the other peers down
        log.debug("sync to %s", host, exc_info=True)
        res.status, res.message = "failed", f"internal error: {type(exc).__name__}: {exc}"
    finally:
        # a failed sync does not wait for its session's end: over a cut link it never comes, and the
        # sync must end within its bound (IMAGEBUILD_SYNC_TIMEOUT)
        sess.close(1 if res.status == "failed" else 10)
        res.bytes_sent += conn.bytes_sent
        if res.status != "refused" or conn.timings:
            res.details["timings"] = conn.timings
        res.seconds = time.monotonic() - t0
    # each peer's result as it ends (the table comes when every peer is done)
    level = logging.INFO if res.status in ("synced", "unchanged", "dry-run") else logging.WARNING
    log.log(level, "%s: %s after %.1f s: %s", host, res.status, res.seconds, res.message)
    return res


_PROGRESS = re.compile(r"^\s*([\d,.]+)\s+(\d+)%\s+(\S+/s)\s+(\d+:\d\d:\d\d)")


class _PeerSync:
    def __init__(self, shared: _Shared, conn: peer_mod.Connection, res: PeerResult):
        self.s, self.conn, self.res = shared, conn, res
        self.host = conn.host
        self.run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]

    def say(self, msg: str, *args) -> None:
        log.info(f"{self.host}: " + msg, *args)

    def heartbeat(self, step: str):
        """For Connection.agent: a line every IMAGEBUILD_SYNC_HEARTBEAT seconds while ``step`` runs on the
        peer (peer, step, time so far, bytes sent to it)."""
        every = heartbeat_every()
        if not every:
            return None
        return every, lambda elapsed: self.say("still %s on the peer: %s so far, %s sent to it", step,
                                               peer_mod.wait_text(elapsed), human(self.conn.bytes_sent +
                                                                                  self.res.bytes_sent))

    @property
    def lock_name(self) -> str:
        import hashlib

        return hashlib.sha256(self.s.ref.encode()).hexdigest()[:24]

    def _hold(self, st: peer_mod.PeerState) -> bool:
        """One sync of this image (its target tag) to this peer at a time: the later one waits for the
        earlier one (IMAGEBUILD_SYNC_LOCK_WAIT seconds, default 1800), then is refused (exit 3). Taken
        once the plan is made (a refusal writes nothing, not even the lock file); True when another
        sync held it since the probe (then the plan is made again)."""
        wait = int(_seconds_env("IMAGEBUILD_SYNC_LOCK_WAIT", LOCK_WAIT_S, zero_ok=True))

        def waiting(holder: str) -> None:
            self.say("another sync of %s to this peer runs (%s): waiting for it (up to %d s)", self.s.ref,
                     holder or "holder unknown", wait)
        try:
            # a holder whose sender ran here and is gone (a cut link ended it; the peer's sshd may not
            # notice for minutes): the peer ends its session instead of waiting for it
            dead = peer_mod.dead_sender(st.synclock[1]) if st.synclock[0] == "held" else ""
            waited, previous = self.conn.hold(self.lock_name, wait, self.run_id, waiting, dead=dead)
        except peer_mod.AgentFailed as exc:
            if exc.code == "busy":
                raise GuardRefused(f"busy: {exc.detail}",
                                   hint="rerun when it is done, or raise IMAGEBUILD_SYNC_LOCK_WAIT (seconds)") from None
            raise
        state, holder = st.synclock
        return waited or state == "held" or previous != holder

    def _check_not_older(self, st: peer_mod.PeerState) -> None:
        """The peer's tag never moves to a build older than the one it holds (unless --force). Like is
        compared with like: the build records' times when both builds have one (this project's record of
        this identity; the ``built`` the sync that put the peer's image there wrote), else both images'
        creation times (``Created``: equal for reproducible builds, which then never refuse)."""
        if st.target is None:
            return
        tid = st.target.get("Id")
        rec = next((r for r in st.records if r.get("image_id") == tid), None) or {}
        ours, theirs = self.s.built, rec.get("built")
        if not (_when(ours) and _when(theirs)):
            ours, theirs = self.s.img.data.get("Created"), st.target.get("Created")
        t_ours, t_theirs = _when(ours), _when(theirs)
        if t_ours is None or t_theirs is None or t_ours >= t_theirs:
            return
        have = identity_mod.from_inspect(st.target).digest
        msg = (f"{self.s.ref} on the peer is a newer build (identity {have}, built {theirs}) than this one "
               f"(built {ours}): the tag never moves to an older build unless --force")
        if self.s.force:
            log.warning("warning: %s: %s; moving it anyway (--force)", self.host, msg)
            self.res.details["older"] = msg
            return
        raise GuardRefused(msg, hint=f"sync the newer build, or --force (imagebuild rollback {self.s.image or 'IMAGE'} "
                           "on the peer swaps :local and :previous)")

    # -- the steps

    def run(self) -> None:
        s = self.s
        planned = self._plan(quick=True)
        if planned is None:
            return
        st, need = planned
        if self._hold(st):  # another sync of this image ran since the probe: plan again from what it left
            planned = self._plan(quick=False)
            if planned is None:
                return
            st, need = planned
        if not s.dry_run and self._wait_for_others(need):  # another image's sync sent shared blobs meanwhile
            planned = self._plan(quick=False)
            if planned is None:
                return
            st, need = planned
        # an earlier run (killed after its load) may have left the verified image under the staging name
        if st.staging is not None and identity_mod.from_inspect(st.staging).digest == s.identity:
            got = self._verify_existing()
            if got is not None:
                self._promote(st, got, need)
                return
        got = self._deliver(st, need)
        s.pause("promote", self.host)
        self._promote(st, got, need)

    def _wait_for_others(self, need) -> bool:
        """When a sync of another image to this peer is sending some of these blobs right now (they share
        layers), wait until it has ended (bounded as a load of those blobs) instead of sending them a second
        time; True when it waited (the plan is then made again: what it loaded is not sent)."""
        if sum(la.size for la in need) <= INLINE_LAYERS_MAX or os.environ.get("IMAGEBUILD_SYNC_WAIT_SHARED", "1") == "0":
            return False
        hexes = [_hexof(la.digest) for la in need]
        r = self.conn.agent(peer_agent.call("ib_others", self.lock_name, *hexes), timeout=step_timeout(),
                            what="looking for other syncs")
        rows = [ln.split() for ln in r.lines("others") if ln.startswith("busy ")]
        busy = {row[1] for row in rows if len(row) == 3}
        locks = sorted({row[2] for row in rows if len(row) == 3})
        if not busy:
            return False
        size = sum(la.size for la in need if _hexof(la.digest) in busy)
        wait = int(load_timeout(size))
        self.say("another sync to this peer is sending %d of these blob(s) (%s): waiting for it (up to %d s), then "
                 "sending only what is still missing", len(busy), human(size), wait)
        t0 = time.monotonic()
        # until that sync has ended (its session: the load done and recorded, or failed), not only its transfer
        self.conn.agent(peer_agent.call("ib_wait_locks", str(wait), *locks), timeout=wait + 60,
                        what="waiting for another sync", heartbeat=self.heartbeat("waiting for another sync"))
        self.res.details["waited_for_other_sync_s"] = round(time.monotonic() - t0, 1)
        return True

    def _plan(self, quick: bool):
        """Probe, and decide: None when the peer is done with (unchanged, dry-run), else (state, the
        layers to send); a refusal raises. Nothing is written on the peer before this returns."""
        s, res = self.s, self.res
        img = s.img
        spec_hex = _hexof(s.spec) if s.spec else None
        st = peer_mod.probe(self.conn, s.ref, s.staging, _hexof(s.identity), spec_hex, s.quick_ids if quick else None,
                            timeout=step_timeout(120), lock=self.lock_name)
        if st.quick and not self._unchanged(st):
            st = peer_mod.probe(self.conn, s.ref, s.staging, _hexof(s.identity), spec_hex, timeout=step_timeout(120),
                                lock=self.lock_name)
        if st.quick and st.target:  # the quick probe asks no `docker info`: the tag's id says the store (a
            # classic store names an image by its config digest, the containerd store by its manifest or index)
            st.containerd_store = st.target.get("Id") != img.config_digest
        res.store = st.store if st.docker_error is None else None
        res.layers_total = len(img.layers)
        if self._unchanged(st):
            res.identity = s.identity
            if s.receipt and (not st.has_receipt or (s.receipt_sig and not st.has_signature)) and not s.dry_run:
                self._carry_receipt_only()
                res.status, res.message = "unchanged", f"{s.ref} already is identity {s.identity} (receipt carried)"
            else:
                res.status, res.message = "unchanged", f"{s.ref} already is identity {s.identity}"
            return None
        self._preflight_tools(st)
        self._check_runs_there(st)
        old_id = (st.target or {}).get("Id")
        self._check_serving(st, old_id)
        self._check_not_older(st)
        need = self._needed_layers(st)
        to_send = sum(max(0, la.size - st.incoming.get(_hexof(la.digest), 0)) for la in need)
        resumed = sum(min(la.size, st.incoming.get(_hexof(la.digest), 0)) for la in need)
        res.layers_sent = len(need)
        res.details = {"layers_needed": [la.digest for la in need], "bytes_needed": sum(la.size for la in need),
                       "bytes_resumed": resumed, "store": st.store, "engine": st.server_version}
        self._check_receipt_there()
        self._check_disk(st, need, to_send)
        plan = (f"{len(need)} of {len(img.layers)} layers missing on the {st.store}-store peer (Docker "
                f"{st.server_version}): {human(to_send)} to send" + (f" ({human(resumed)} already there from an "
                                                                    "interrupted run)" if resumed else ""))
        if s.dry_run:
            res.status, res.message = "dry-run", "would sync: " + plan
            return None
        self.say("%s", plan)
        return st, need

    def _deliver(self, st: peer_mod.PeerState, need) -> str:
        """Put the missing layers on the peer and load them; the verified image id (the registry
        transport, registry_sync.py, pulls instead)."""
        s = self.s
        # small blobs travel inside the load call; large ones with rsync (resumable)
        inline = sum(la.size for la in need) <= INLINE_LAYERS_MAX
        got = None
        if not inline:
            have = self._prepare(need)
            s.pause("transfer", self.host)
            streamed = self._can_stream(st, need, have)
            if streamed:
                s.pause("load", self.host)
                got = self._stream(st, need, have)
                if got is not None:
                    return got
            self._transfer(st, need, have)  # (after a failed streamed load: what arrived, hashed, into incoming/)
        else:
            streamed = False
            s.verify_files(need)
        if not streamed:
            s.pause("load", self.host)
            got = self._load(need, inline)
        if got is None:  # the loaded image is not the source's: find bad blobs, send them again, once
            bad = self._check_incoming()
            if not bad:
                raise OperationFailed(self._mismatch or "the loaded image failed verification")
            s.verify_files([la for la in need if _hexof(la.digest) in bad])  # a bad local file: say so
            self.say("%d blob(s) in the peer's cache did not match their digest (%s): sending them again",
                     len(bad), ", ".join(b[:12] for b in bad))
            self._transfer(st, need, self._prepare(need))
            got = self._load(need, False)
            if got is None:
                raise OperationFailed(self._mismatch or "the loaded image failed verification")
        return got

    def _unchanged(self, st: peer_mod.PeerState) -> bool:
        """The target tag already holds the identity, and docker image ls lists it."""
        if st.target is None:
            return False
        have = identity_mod.from_inspect(st.target)
        return have.digest == self.s.identity and bool(st.listed(have.local_id or ""))

    def _preflight_tools(self, st: peer_mod.PeerState) -> None:
        if st.docker_error:
            raise OperationFailed(st.docker_error, hint=f"install Docker on {self.host} and let the ssh user use it "
                                  "(imagebuild doctor --peer " + self.host + ")")
        missing = [t for t in ("rsync", "flock", "tar", "stat", "df") if t not in st.tools]
        if missing:
            raise OperationFailed(f"missing on the peer: {', '.join(missing)}",
                                  hint=f"install them on {self.host} (Debian/Ubuntu: apt-get install rsync "
                                  "util-linux coreutils tar)")

    def _check_runs_there(self, st: peer_mod.PeerState) -> None:
        """The peer's engine runs the image's architecture natively, or its kernel has a handler that runs
        it in containers (binfmt_misc, the F flag); else nothing is sent (exit 3). Every peer shares no
        kernel with this host, so the peer's own table decides, read by the probe."""
        from imagebuild.core import emulation

        want = emulation.docker_arch(str(self.s.img.identity.document().get("architecture") or ""))
        have = emulation.docker_arch(str(st.engine.get("Architecture") or ""))
        if not want or not have or want == have:
            return
        h = emulation.handler_for(want, st.binfmt)
        if h is not None and h.in_containers:
            self.say("the image is linux/%s, the peer's engine linux/%s: it runs there under emulation (%s)",
                     want, have, h.describe())
            return
        why = (f"its handler {h.describe()} lacks the F flag, so containers cannot use it" if h is not None else
               f"its kernel has no enabled binfmt_misc handler for {emulation.qemu_name(want)} ELF files")
        raise GuardRefused(f"{self.s.ref} is linux/{want} and the peer's engine runs linux/{have}: {why}, so the "
                           "image could not run there; nothing was sent",
                           hint=f"sync it to a linux/{want} node, or register a handler on {self.host}: "
                           + emulation.REGISTER_HINT.format(qemu=emulation.qemu_name(want)).removeprefix(
                               "register a QEMU user-mode handler on the engine's host, as root: "))

    def _check_serving(self, st: peer_mod.PeerState, old_id: str | None) -> None:
        if not old_id:
            return
        users = [c for c in st.containers if c["image"] == old_id]
        if not users:
            return
        names = ", ".join(f"{c['name']} ({c['config_image']})" for c in users)
        if self.s.force:
            log.warning("warning: %s: running containers use %s: %s; moving the tag anyway (--force); they keep "
                        "their image", self.host, self.s.ref, names)
            self.res.details["serving"] = names
            return
        raise GuardRefused(f"running containers use {self.s.ref} ({old_id[:19]}): {names}; the tag would move "
                           "under them", hint="stop them first, or --force (a running container keeps its image)")

    def _needed_layers(self, st: peer_mod.PeerState) -> list[localblobs.Layer]:
        chains = st.chains()
        known = st.known_blobs() if st.containerd_store else set()
        need = []
        for la in self.s.img.layers:
            if la.chain_id in chains and (not st.containerd_store or la.digest in known):
                continue
            need.append(la)
        for b in self.s.img.extra:
            if b.digest not in known:
                need.append(localblobs.Layer(b.digest, b.size, b.media_type, "", ""))
        return need

    def _check_disk(self, st: peer_mod.PeerState, need, to_send: int) -> None:
        margin = int(_gib_env("IMAGEBUILD_PEER_MIN_FREE_GB", DEFAULT_MIN_FREE_GIB) * (1 << 30))
        files = self.s.img.files
        # the engine's own unpacked sizes (the gzip trailer wraps at 4 GiB: CUDA bases have larger layers)
        known = localblobs.unpacked_sizes(self.s.img) if any(la.compressed for la in need if la.diff_id) else {}
        unpacked = sum(localblobs.unpacked_estimate(la, files.get(la.digest), known.get(la.diff_id))
                       for la in need if la.diff_id)
        load_bytes = sum(la.size for la in need) + unpacked
        checks = []
        if st.df_cache and st.df_docker and st.df_cache.mount == st.df_docker.mount:
            checks.append(("its Docker data root and the sync cache", st.df_docker, to_send + load_bytes))
        else:
            if st.df_cache:
                checks.append((f"the sync cache ({st.cache})", st.df_cache, to_send))
            if st.df_docker:
                checks.append(("its Docker data root", st.df_docker, load_bytes))
        for what, df, need_bytes in checks:
            if need_bytes and df.available - need_bytes < margin:
                raise GuardRefused(
                    f"not enough disk on {self.host}: {human(df.available)} free on {df.mount} ({what}); the transfer "
                    f"and load need about {human(need_bytes)} ({human(to_send)} sent, {human(unpacked)} unpacked, "
                    f"estimated) and {human(margin)} must stay free",
                    hint=f"free disk on {self.host} (imagebuild gc --peer {self.host}; docker image prune), or lower "
                    "IMAGEBUILD_PEER_MIN_FREE_GB")

    def _receipt_lines(self, base: str) -> list[str]:
        """The receipt's exact bytes and its signature to ``$CACHE/BASE`` and ``BASE.sig`` (none: removed)."""
        s = self.s
        if not s.receipt:
            return [f"rm -f \"$CACHE\"/{base} \"$CACHE\"/{base}.sig\n"]
        raw = s.receipt_raw if s.receipt_raw is not None else json.dumps(s.receipt, indent=2, sort_keys=True).encode()
        lines = [peer_agent.heredoc_bytes(base, raw)]
        lines.append(peer_agent.heredoc(f"{base}.sig", s.receipt_sig) if s.receipt_sig
                     else f"rm -f \"$CACHE\"/{base}.sig\n")
        return lines

    def _signer(self, r: peer_mod.AgentResult) -> None:
        for ln in r.lines("receipt-check"):
            if ln.startswith("signer "):
                self.res.details["receipt_signer"] = ln.split(" ", 1)[1].strip()
                self.say("the receipt's signature verifies on the peer: signed by %s",
                         self.res.details["receipt_signer"])
            elif ln.strip() == "not-required":
                self.res.details["receipt_signer"] = None

    def _check_receipt_there(self) -> None:
        """Before any byte moves: the peer's own allowed-signers file (if it has one) must accept the
        receipt's signature (peer_agent ``ib_receipt_ok``); a refusal is exit 3."""
        if self.s.dry_run:
            return
        s = self.s
        raw = (s.receipt_raw if s.receipt_raw is not None else
               json.dumps(s.receipt, indent=2, sort_keys=True).encode()) if s.receipt else None
        r = self.conn.agent(peer_agent.shell_var("IB_RECEIPT_B64", raw),
                            peer_agent.shell_var("IB_SIG_B64", s.receipt_sig.encode() if s.receipt_sig else None),
                            peer_agent.call("ib_receipt_check"), timeout=step_timeout(), what="checking the receipt")
        self._signer(r)

    def _carry_receipt_only(self) -> None:
        s = self.s
        base = f"tmp/{self.run_id}.receipt"
        r = self.conn.agent("ib_lock\n", *self._receipt_lines(base),
                            peer_agent.call("ib_receipt_carry", base, _hexof(s.identity), _hexof(s.spec)),
                            timeout=step_timeout(), what="writing the receipt")
        self._signer(r)

    def _prepare(self, need) -> set[str]:
        """The pending record, and this image's partial folder on the peer; the blobs (hex) the peer's
        incoming/ already holds whole (another image's sync put them there): those are not sent."""
        s = self.s
        blobs = "".join(f"{_hexof(la.digest)} {la.size}\n" for la in need)
        pending = {"schema": "imagebuild.peer-pending", "version": 1, "run": self.run_id, "ref": s.ref,
                   "identity": s.identity, "started": _now(), "from": socket.gethostname(),
                   "blobs": [la.digest for la in need]}
        r = self.conn.agent("ib_lock\n", peer_agent.heredoc(f"pending/{self.run_id}.json", json.dumps(pending)),
                            peer_agent.heredoc(f"pending/{self.run_id}.blobs", blobs or "\n"),
                            peer_agent.call("ib_prepare", self.run_id, self.lock_name), timeout=step_timeout(),
                            what="prepare")
        return {ln.split()[1] for ln in r.lines("prepared") if ln.startswith("have ")}

    def _transfer(self, st: peer_mod.PeerState, need, have: set[str] = frozenset()) -> None:
        """rsync the blobs into this image's own folder on the peer (``partial/<lock name>/``, one session
        at a time: the image's sync lock), then have the peer hash each and move it into ``incoming/``
        (``ib_settle``): syncs of different images that share a blob never write the same file."""
        send = [la for la in need if _hexof(la.digest) not in have]
        if not need:
            return
        # the local files are not hashed first: the content store wrote each under its digest only after
        # checking it, the spool too, and the peer checks every blob before it moves into incoming/ (and the
        # load checks it again); a blob the peer finds wrong is traced back (_deliver)
        if send:
            self._rsync(st, send)
        try:
            self.conn.agent(peer_agent.call("ib_settle", self.run_id, self.lock_name),
                            timeout=load_timeout(sum(la.size for la in send)), what="checking the blobs sent")
        except peer_mod.AgentFailed as exc:
            if exc.code != "digest":
                raise
            s = self.s
            s.verify_files([la for la in send if _hexof(la.digest) in exc.detail])  # a bad local file: say so
            raise OperationFailed(f"{exc.detail}; rerun: they are sent again",
                                  hint="the link or the peer's disk changed bytes on the way") from None

    def _can_stream(self, st: peer_mod.PeerState, need, have: set[str]) -> bool:
        """The load starts with the transfer (``_stream``) on a containerd-store peer (its import takes the
        blobs in as they arrive) for a transfer that starts from nothing; a resumed one (a cut link before)
        takes the present path, and so does a peer whose dd cannot read by byte offsets (not GNU dd).
        IMAGEBUILD_SYNC_STREAM=0 turns it off."""
        if os.environ.get("IMAGEBUILD_SYNC_STREAM", "1") == "0" or not st.containerd_store or not st.dd_bytes:
            return False
        send = [la for la in need if _hexof(la.digest) not in have]
        return bool(send) and not any(st.incoming.get(_hexof(la.digest), 0) for la in send)

    def _stream(self, st: peer_mod.PeerState, need, have: set[str]) -> str | None:
        """rsync the blobs while the peer's ``docker load`` already reads them (``ib_load_stream``: one tar
        whose layer entries are the headers made here, ``blob_tar_header``, and each blob's bytes as rsync
        writes them in place); the verified image id, or None (``_mismatch``): then the present path (hash,
        incoming/, load)."""
        s = self.s
        send = sorted((la for la in need if _hexof(la.digest) not in have), key=lambda la: _hexof(la.digest))
        order = [la for la in need if _hexof(la.digest) in have] + send  # rsync sends by name
        stall = stream_stall_s()
        lines = self._load_lines(order, False, call=("ib_load_stream", self.run_id, s.staging, self.lock_name,
                                                     str(stall)))
        headers = [peer_agent.heredoc_bytes(f"stage/{self.run_id}.hdr/{_hexof(la.digest)}",
                                            blob_tar_header(_hexof(la.digest), la.size)) for la in order]
        lines[-1:-1] = headers
        out: dict = {}

        def load() -> None:
            try:
                out["r"] = self.conn.agent(*lines, timeout=load_timeout(sum(la.size for la in need)),
                                           what="the load", heartbeat=self.heartbeat("loading"))
            except Exception as exc:  # noqa: BLE001 - handed to the caller's thread
                out["exc"] = exc
        self.say("sending while the peer loads (docker load started with the transfer: %d layer blob(s))", len(need))
        t = threading.Thread(target=load, daemon=True, name=f"load-{self.host}")
        t.start()
        try:
            self._rsync(st, send)
        except OperationFailed:
            self.conn._kill()  # the peer's load ends once the blob stops growing; the rerun resumes
            t.join(30)
            raise
        self.say("loading on the peer (the rest of the docker load of %d layer blob(s))", len(need))
        t.join()
        if "exc" in out:
            exc = out["exc"]
            if isinstance(exc, peer_mod.AgentFailed) and exc.code == "load":
                self._mismatch = f"docker load failed on the peer: {_load_log(exc.output)}"
                return None
            raise exc
        self.res.details["load"] = "streamed"
        return self._verified(out["r"])

    def _rsync(self, st: peer_mod.PeerState, need) -> None:
        s = self.s
        files = [str(s.img.files[la.digest]) for la in need]
        comp = choose_compression(self.conn, st, need, s.img.files)
        self.res.details["compression"] = comp.why
        total = sum(la.size for la in need)
        self.say("sending %d blob(s), %s, compression %s", len(need), human(total), comp.why)
        argv = ["rsync", "--partial", "--append-verify", "--info=progress2", "--stats",
                f"--timeout={max(1, int(step_timeout()))}", "-e", self.conn.rsync_shell(),
                *comp.args, "--", *files, f"{self.host}:{st.cache}/partial/{self.lock_name}/"]
        # when the last line was printed (the start: the first says how far it got after PROGRESS_EVERY_S,
        # not rsync's opening "16 B ... 0%"); whether 100% was
        t0 = time.monotonic()
        last: list = [t0, False]
        stats: dict[str, int] = {}
        tail: list[str] = []

        def on_line(text: str) -> None:
            line = text.strip()
            if not line:
                return
            m = _PROGRESS.match(line)
            if m:
                now = time.monotonic()
                done_now = m.group(2) == "100"
                if m.group(2) == "0" and now - t0 < 30:  # rsync's opening line counts its own header bytes
                    return
                if (now - last[0] >= PROGRESS_EVERY_S and not last[1]) or (done_now and not last[1]):
                    last[0], last[1] = now, done_now
                    done = int(m.group(1).replace(",", "").replace(".", ""))
                    self.say("sent %s of %s (%s%%), %s, ETA %s", human(done), human(total), m.group(2),
                             *_rate_and_eta(done, total, now - t0))
                return
            k, _, v = line.partition(":")
            if k in ("Total bytes sent", "Total bytes received"):
                try:
                    stats[k] = int(v.strip().replace(",", "").replace(".", ""))
                except ValueError:
                    pass
            tail.append(line)
            del tail[:-20]

        rc = run_mod.stream(argv, on_line, split_cr=True, die_with_parent=True, hint="install rsync")
        self.conn.timings.append(("rsync", round(time.monotonic() - t0, 3)))
        self.res.bytes_sent += stats.get("Total bytes sent", 0)
        self.res.details["rsync_bytes_sent"] = self.res.details.get("rsync_bytes_sent", 0) + \
            stats.get("Total bytes sent", 0)
        self.res.details["rsync_bytes_received"] = self.res.details.get("rsync_bytes_received", 0) + \
            stats.get("Total bytes received", 0)
        if rc != 0:
            msg = "\n".join(ln for ln in tail if not ln.startswith(("Number of", "Total", "Literal", "Matched",
                                                                    "File list", "sent ", "total size")))[-800:]
            full = next((ln for ln in tail if "No space left on device" in ln or "Disk quota exceeded" in ln), None)
            if full is None and rc == 11:  # "error in file IO": the receiver's own words may not reach us
                free = self._cache_free(st)
                if free is not None and free < FULL_DISK_BYTES:
                    full = f"{human(free)} free there"
            if full is not None:  # rsync says "error in file IO (code 11)": say what it is
                raise OperationFailed(f"the peer's disk is full: rsync could not write into {st.cache}/partial/"
                                      f"{self.lock_name}/ ({full.strip()[-300:]})",
                                      hint=f"free space on {self.host} (imagebuild gc --peer {self.host}; docker "
                                      "image prune there), then rerun: the transfer resumes where it stopped")
            raise OperationFailed(f"rsync to {st.cache}/partial/{self.lock_name}/ failed (exit {rc}): {msg}",
                                  hint="rerun: the transfer resumes where it stopped")

    def _cache_free(self, st: peer_mod.PeerState) -> int | None:
        """The bytes free on the filesystem of the peer's sync cache now (one short ssh command of its
        own: a streamed load may hold the session), or None when it cannot be told within 15 s."""
        try:
            out = run_mod.run(self.conn.ssh_argv(f"df -Pk -- {shlex.quote(st.cache)}"), check=False,
                              timeout=min(15, step_timeout())).stdout.decode("utf-8", "replace")
        except OperationFailed:
            return None
        df = peer_mod._df((out.strip().splitlines() or [""])[-1])
        return df.available if df else None

    def _load_lines(self, need, inline: bool, call: tuple[str, ...] = ()) -> list[str]:
        s, img = self.s, self.s.img
        d = f"stage/{self.run_id}"
        lines = ["ib_lock\n", "ib_docker_ok\n",
                 peer_agent.heredoc(f"{d}/index.json", img.index_json(s.staging).decode()),
                 peer_agent.heredoc(f"{d}/manifest.json", img.manifest_json(s.staging).decode())]
        for digest, data in img.inline.items():
            lines.append(peer_agent.heredoc_bytes(f"{d}/blobs/sha256/{_hexof(digest)}", data))
        if inline:
            for la in need:
                lines.append(peer_agent.heredoc_bytes(f"{d}/blobs/sha256/{_hexof(la.digest)}",
                                                      img.files[la.digest].read_bytes()))
            self.res.bytes_sent += 0  # counted with the call (Connection.bytes_sent)
        listed = [] if inline else need
        lines.append(peer_agent.heredoc(f"{d}.layers", "".join(f"{_hexof(la.digest)} {la.size}\n" for la in listed)
                                        or "\n"))
        lines.append(peer_agent.call(*(call or ("ib_load", self.run_id, s.staging))))
        return lines

    _mismatch: str | None = None

    def _load(self, need, inline: bool) -> str | None:
        """Load on the peer and verify; the verified image id, or None (``_mismatch`` says why)."""
        self.say("loading on the peer (docker load of %d layer blob(s)%s + manifest and config)", len(need),
                 f", {human(sum(la.size for la in need))} sent with it" if inline and need else "")
        try:
            r = self.conn.agent(*self._load_lines(need, inline), timeout=load_timeout(sum(la.size for la in need)),
                                what="the load", heartbeat=self.heartbeat("loading"))
        except peer_mod.AgentFailed as exc:
            if exc.code != "load":
                raise
            self._mismatch = f"docker load failed on the peer: {_load_log(exc.output)}"
            return None
        return self._verified(r)

    def _verify_existing(self) -> str | None:
        self.say("the image from an earlier run is on the peer as %s: verifying it", self.s.staging)
        r = self.conn.agent("ib_lock\n", peer_agent.call("ib_verify_step", self.s.staging), timeout=step_timeout(),
                            what="verification")
        got = self._verified(r)
        if got is None:
            self.say("it did not verify (%s): loading again", self._mismatch)
            self.conn.agent("ib_lock\n", peer_agent.call("ib_abort", self.run_id, self.s.staging),
                            timeout=step_timeout(), what="untagging it")
        return got

    def _verified(self, r: peer_mod.AgentResult) -> str | None:
        s = self.s
        data = peer_mod._first_inspect(r.section("inspect"))
        if data is None:
            self._mismatch = f"{s.staging} is not on the peer after the load"
            return None
        ident = identity_mod.from_inspect(data)
        pid = data.get("Id") or ""
        listed = any(ln.split(" ", 1) == [pid, s.staging] or ln == f"{pid} docker.io/library/{s.staging}"
                     for ln in r.lines("listed"))
        run_rc = _rc(r.section("run"))
        if ident.digest != s.identity:
            self._mismatch = (f"the image loaded on the peer is not the source's: identity {ident.digest} != "
                              f"{s.identity}")
            self._abort()
            return None
        if not listed:
            self._mismatch = (f"the loaded image {pid[:19]} answers docker image inspect but docker image ls does not "
                              "list it (a broken load)")
            self._abort()
            return None
        if run_rc != 0:
            out = "\n".join(ln for ln in r.lines("run") if not ln.startswith("@@"))[-400:]
            self._mismatch = f"the loaded image does not run (docker run --pull never ... /bin/sh -c true): {out}"
            self._abort()
            return None
        self.res.identity = ident.digest
        self.say("verified on the peer: identity %s, listed, runs (--pull never)", ident.digest)
        return pid

    def _abort(self) -> None:
        try:
            self.conn.agent("ib_lock\n", peer_agent.call("ib_abort", self.run_id, self.s.staging),
                            timeout=step_timeout(), what="untagging it")
        except OperationFailed:
            pass

    def _check_incoming(self) -> list[str]:
        r = self.conn.agent("ib_lock\n", peer_agent.call("ib_check", self.run_id),
                            timeout=load_timeout(sum(la.size for la in self.s.img.layers)),
                            what="checking the cached blobs")
        return [ln.split()[1] for ln in r.lines("check") if ln.startswith("bad ")]

    def _promote(self, st: peer_mod.PeerState, image_id: str, need) -> None:
        s = self.s
        record = {"schema": RECORD_SCHEMA, "version": 1, "identity": s.identity, "ref": s.ref, "image_id": image_id,
                  "blobs": s.img.blob_digests(), "layers": [{"digest": la.digest, "diff_id": la.diff_id}
                                                            for la in s.img.layers],
                  "synced": _now(), "built": s.built, "from": socket.gethostname(), "spec": s.spec, "run": self.run_id,
                  "receipt": bool(s.receipt)}
        lines = ["ib_lock\n", peer_agent.heredoc(f"tmp/{self.run_id}.record", json.dumps(record)),
                 *self._receipt_lines(f"tmp/{self.run_id}.receipt")]
        lines.append(peer_agent.call("ib_promote", self.run_id, image_id, s.ref, s.previous or "-", s.staging,
                                     "1" if s.force else "0", _hexof(s.identity), _hexof(s.spec) if s.spec else "-"))
        r = self.conn.agent(*lines, timeout=step_timeout(), what="promotion")
        info = dict(ln.split(" ", 1) for ln in r.lines("promoted") if " " in ln)
        prev = (info.get("previous") or "").strip()
        self.res.status = "synced"
        kept = f"; the former image is {s.previous}" if prev and s.previous and prev != image_id else ""
        self.res.message = f"{s.ref} is identity {s.identity}{kept}"
        self.res.details["previous_id"] = prev or None
        self.res.details["image_id"] = image_id


def _rc(section: str) -> int | None:
    for ln in reversed(section.splitlines()):
        if ln.startswith("@@rc "):
            try:
                return int(ln.split()[1])
            except (IndexError, ValueError):
                return None
    return None


def _load_log(output: str) -> str:
    sections, _ = peer_mod.parse_sections(output)
    text = "\n".join(ln for ln in sections.get("load", "").splitlines() if ln.strip())
    return text[-600:] or "(no output)"


# ------------------------------------------------------------------------------------------------ output


def render(report: SyncReport) -> str:
    rows = [("PEER", "RESULT", "SENT", "TIME", "DETAIL")]
    for p in report.peers:
        rows.append((p.peer, p.status, human(p.bytes_sent), f"{p.seconds:.1f} s", p.message))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    out = [f"{report.ref}  identity {report.identity}"]
    out += [f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:>{w[2]}}  {r[3]:>{w[3]}}  {r[4]}" for r in rows]
    if not report.ok:
        have = report.have_image()
        bad = [p.peer for p in report.peers if p.status not in ("synced", "unchanged", "dry-run")]
        out.append(f"not synced: {', '.join(bad)}; the image is on: {', '.join(have) if have else 'no peer'}")
    return "\n".join(out)
