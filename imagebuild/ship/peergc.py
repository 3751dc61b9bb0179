"""``imagebuild gc --peer PEER``: keep a peer's sync cache bounded (docs/sync.md, "The peer's cache").

What the cache holds and what gc does with it:

- ``incoming/<hex>`` (verified blobs), ``partial/<lock>/<hex>`` (blobs rsync writes, whole or partial)
  and rsync's temporary ``.<hex>.*`` files: kept
  while a pending sync names them and is younger than a day (a rerun resumes it); removed otherwise
  (a finished sync removes its own at once);
- ``pending/<run>.json|.blobs``: the sync that started them; removed after a day;
- ``stage/*``, ``tmp/*``, ``*.tmp.*``: work folders of a run that died: removed;
- ``records/<identity>.json`` and ``receipts/<identity>/``: kept for the last N synced images
  (``--keep``, default 5), the rest removed;
- staging images ``imagebuild-incoming:*`` no pending sync needs: untagged;
- on a containerd-store peer, **leases** left by a ``docker load`` that was interrupted on the peer:
  a lease with only the engine's ``containerd.io/gc.expire`` label, created during one of this
  tool's load attempts (``attempts/``), is deleted with ``ctr leases rm --sync`` (its partial
  writes go with it); needs ``ctr`` on the peer and access to the engine's containerd socket.

The listing only reads; the removals run under the cache lock, and an incoming blob that a sync
started meanwhile names is kept.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime

from imagebuild.core.errors import OperationFailed
from imagebuild.ship import peer as peer_mod
from imagebuild.ship import peer_agent

DEFAULT_KEEP = 5
PENDING_MAX_AGE_S = 24 * 3600
LOAD_LEASE_LABELS = {"containerd.io/gc.expire"}


@dataclass
class Action:
    kind: str  # incoming | pending | stage | tmp | record | receipt | staging-image | lease
    what: str
    bytes: int
    why: str
    op: str = ""  # the agent action line

    def as_dict(self) -> dict:
        return {"kind": self.kind, "what": self.what, "bytes": self.bytes, "why": self.why}


@dataclass
class PeerGc:
    peer: str
    ok: bool = True
    message: str = ""
    cache: str = ""
    remove: list[Action] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    done: list[str] = field(default_factory=list)

    @property
    def freed(self) -> int:
        return sum(a.bytes for a in self.remove)

    def as_dict(self) -> dict:
        return {"peer": self.peer, "ok": self.ok, "message": self.message, "cache": self.cache,
                "freed_bytes": self.freed, "remove": [a.as_dict() for a in self.remove], "kept": self.kept,
                "notes": self.notes}


def _json_lines(res: peer_mod.AgentResult, name: str) -> list[tuple[int, dict]]:
    out = []
    for ln in res.lines(name):
        mtime, _, rest = ln.partition(" ")
        try:
            data = json.loads(rest)
        except ValueError:
            continue
        if isinstance(data, dict) and mtime.isdigit():
            out.append((int(mtime), data))
    return out


def _files(res: peer_mod.AgentResult, name: str) -> list[tuple[int, int, str]]:
    out = []
    for ln in res.lines(name):
        parts = ln.split(" ", 2)
        if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit():
            out.append((int(parts[0]), int(parts[1]), parts[2]))
    return out


def _parse_ts(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def plan(host: str, res: peer_mod.AgentResult, keep: int) -> PeerGc:
    g = PeerGc(host)
    meta = dict(ln.split(" ", 1) for ln in res.lines("meta") if " " in ln)
    g.cache = meta.get("cache", "")
    now = int(meta.get("now", str(int(time.time()))).strip() or time.time())
    if meta.get("lock", "").startswith("held"):
        g.notes.append(f"the cache lock is {meta['lock']}: removals wait for it")
    cache = g.cache
    # pending syncs
    live_blobs: set[str] = set()
    live_idents: set[str] = set()
    for mtime, p in _json_lines(res, "pending"):
        run = str(p.get("run"))
        age = now - mtime
        blobs = [b.split(":", 1)[-1] for b in p.get("blobs") or []]
        if age < PENDING_MAX_AGE_S:
            live_blobs.update(blobs)
            live_idents.add(str(p.get("identity")))
            g.kept.append(f"pending sync {run} of {p.get('ref')} ({age // 60} min old, {len(blobs)} blob(s)): a rerun "
                          "of imagebuild sync resumes it")
        else:
            for ext in ("json", "blobs"):
                g.remove.append(Action("pending", f"{cache}/pending/{run}.{ext}", 0,
                                       f"a sync started {age // 3600} h ago that never finished",
                                       f"rm {cache}/pending/{run}.{ext}"))
    sizes = {}
    for size, _mtime, path in _files(res, "incoming"):
        name = path.rsplit("/", 1)[-1]
        hexname = name.lstrip(".").split(".", 1)[0]
        sizes[hexname] = sizes.get(hexname, 0) + size
        if hexname in live_blobs:
            continue
        partial = name.startswith(".") or "." in name
        g.remove.append(Action("incoming", path, size, "a partial write no pending sync resumes" if partial else
                               "a blob no pending sync needs", f"rmblob {path} {hexname}"))
    for ln in res.lines("stage"):
        kb, _, path = ln.partition(" ")
        g.remove.append(Action("stage", path, int(kb) * 1024 if kb.isdigit() else 0,
                               "the work folder of a load that did not finish", f"rm {path}"))
    for size, _mtime, path in _files(res, "tmp"):
        if path.endswith(("/lock", "/lock.holder")):
            continue
        g.remove.append(Action("tmp", path, size, "a temporary file of a run that died", f"rm {path}"))
    # records and receipts: the last N synced images
    records = sorted(_json_lines(res, "records"), key=lambda x: (x[1].get("synced") or "", x[0]), reverse=True)
    kept_idents = {str(r.get("identity")) for _, r in records[:keep]} | live_idents
    for _, r in records[keep:]:
        ident = str(r.get("identity"))
        if ident in kept_idents:
            continue
        h = ident.split(":", 1)[-1]
        g.remove.append(Action("record", f"{cache}/records/{h}.json", 0,
                               f"older than the last {keep} synced images", f"rm {cache}/records/{h}.json"))
    kept_hex = {i.split(":", 1)[-1] for i in kept_idents}
    for size, _mtime, path in _files(res, "receipts"):
        h = path.rstrip("/").split("/")[-2]
        if h not in kept_hex:
            g.remove.append(Action("receipt", path, size, f"its image is not among the last {keep} synced",
                                   f"rm {path}"))
    # staging images
    live_tags = {f"{peer_mod.STAGING_REPO}:{i.split(':', 1)[-1][:24]}" for i in live_idents}
    for ln in res.lines("images"):
        parts = ln.split("\t")
        if len(parts) != 3:
            continue
        try:
            tags = json.loads(parts[1]) or []
        except ValueError:
            continue
        for t in tags:
            t = t.removeprefix("docker.io/library/")
            if t.startswith(peer_mod.STAGING_REPO + ":") and t not in live_tags:
                g.remove.append(Action("staging-image", t, 0, "a staging name no pending sync needs", f"untag {t}"))
    # leases of interrupted loads
    attempts = _json_lines(res, "attempts")
    lease_lines = res.lines("leases")
    address = lease_lines[0].split(" ", 1)[1] if lease_lines and lease_lines[0].startswith("address ") else "-"
    unavailable = [ln for ln in lease_lines if ln.startswith("unavailable ")]
    containerd = res.section("containerd").startswith("overlayfs") or "snapshotter" in res.section("containerd")
    if attempts or containerd:
        if unavailable:
            g.notes.append(f"leases not checked: {unavailable[0].split(' ', 1)[1]}")
        else:
            windows = [(float(a.get("started") or 0) - 2, float(a.get("finished") or now) + 2, a.get("run"))
                       for _, a in attempts]
            for ln in lease_lines[1:]:
                parts = ln.split()
                if len(parts) < 2 or parts[0] == "ID":
                    continue
                lid, created = parts[0], _parse_ts(parts[1])
                labels = {kv.split("=", 1)[0] for kv in (parts[2].split(",") if len(parts) > 2 else [])}
                if created is None or labels != LOAD_LEASE_LABELS:
                    continue
                for lo, hi, run in windows:
                    if lo <= created <= hi:
                        g.remove.append(Action("lease", lid, 0, f"left by the load of sync {run}, interrupted "
                                               "on the peer (its partial writes go with it)",
                                               f"lease {address} {lid}"))
                        break
    for _, a in attempts:
        run = a.get("run")
        g.remove.append(Action("attempt", f"{cache}/attempts/{run}.json", 0, "a finished load attempt's record",
                               f"rm {cache}/attempts/{run}.json"))
    # stage and tmp removals first, leases before the attempts that found them, blobs after pending
    order = {"pending": 0, "stage": 1, "tmp": 1, "lease": 2, "attempt": 3, "staging-image": 3, "incoming": 4,
             "record": 5, "receipt": 5}
    g.remove.sort(key=lambda a: order.get(a.kind, 9))
    return g


def gc_peer(host: str, *, keep: int = DEFAULT_KEEP, dry_run: bool = False) -> PeerGc:
    conn = peer_mod.Connection(host)
    try:
        conn.open()
        res = conn.agent("ib_gc_list\n", timeout=300, what="the cache listing")
        g = plan(host, res, keep)
        if dry_run or not g.remove:
            return g
        actions = "".join(a.op + "\n" for a in g.remove)
        out = conn.agent("ib_lock\n", peer_agent.heredoc("tmp/gc.actions", actions), "ib_gc_apply\n", timeout=600,
                         what="the removals")
        g.done = [ln for ln in out.lines("_") if ln.strip()]
        failed = [ln for ln in g.done if ln.startswith(("lease-failed", "refused"))]
        if failed:
            g.ok = False
            g.message = "; ".join(failed)
        return g
    except OperationFailed as exc:
        return PeerGc(host, ok=False, message=exc.message)
    finally:
        conn.close()


def render(g: PeerGc, dry_run: bool) -> str:
    from imagebuild.ship.sync import human

    if not g.ok and not g.cache:
        return f"{g.peer}: {g.message}"
    verb = "would remove" if dry_run else "removed"
    out = [f"{g.peer}: sync cache {g.cache or '?'}"]
    for a in g.remove:
        out.append(f"  {verb:<12} {a.kind:<13} {a.what}  {human(a.bytes) if a.bytes else ''}  ({a.why})")
    for k in g.kept:
        out.append(f"  kept         {k}")
    for n in g.notes:
        out.append(f"  note         {n}")
    if not g.ok:
        out.append(f"  FAILED       {g.message}")
    out.append(f"  {g.peer}: {human(g.freed)} {'to free' if dry_run else 'freed'}")
    return "\n".join(out)
