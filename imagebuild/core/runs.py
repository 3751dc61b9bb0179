"""The records of past build runs: ``<state>/builds/<image>/<run id>/`` (record.json, logs/).

Every ``imagebuild build`` run gets its own folder (run ids sort by start time), so no run ever
overwrites another's record or logs. ``imagebuild log`` reads them; ``imagebuild gc`` prunes
them.

A record names its owner (``owner``: ``host:pid``). A run killed with ``kill -9`` (or by a power
cut) never writes its end, so its record says ``running`` forever; a ``running`` record whose owner
is a process of this host that is gone reads as ``abandoned``, and the next build of that image
writes that down (``mark_abandoned``, the only write here).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from imagebuild.core import fsutil
from imagebuild.core.context import Context, of
from imagebuild.core.errors import UsageError
from imagebuild.core.fsutil import atomic_write_json

ABANDONED = "abandoned"  # a record left ``running`` by an owner that is gone


def owner() -> str:
    """``host:pid`` of this process: what a run record and a gate container name as their owner."""
    return f"{socket.gethostname()}:{os.getpid()}"


def owner_gone(text: object) -> bool:
    """Whether ``text`` (``host:pid``) names a process of this host that no longer runs. Another
    host's process, or a text that is not ``host:pid``, is never called gone (it cannot be told)."""
    if not isinstance(text, str) or ":" not in text:
        return False
    host, _, pid = text.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) <= 0:
        return False
    if int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    try:  # a zombie has ended: only its parent has not read its status yet
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def builds_dir(ctx: Context | Path) -> Path:
    return of(ctx).state / "builds"


@dataclass(frozen=True)
class Run:
    image: str
    run_id: str
    dir: Path
    record: dict  # {} when record.json is missing or unreadable (a run killed before it wrote one)

    @property
    def status(self) -> str:
        status = _typed(self.record.get("status"), str) or "unknown"
        if status == "running" and owner_gone(self.record.get("owner")):
            return ABANDONED
        return status

    def logs(self) -> list[Path]:
        d = self.dir / "logs"
        return sorted(p for p in d.glob("*.log") if not p.is_symlink()) if d.is_dir() and not d.is_symlink() else []

    def summary(self) -> dict:
        r = self.record
        text = lambda k: _typed(r.get(k), str)  # noqa: E731
        return {"image": self.image, "run_id": self.run_id, "status": self.status, "build_id": text("build_id"),
                "started": text("started"), "finished": text("finished"),
                "failed_stage": text("failed_stage"),
                "identity": _typed((_typed(r.get("release"), dict) or {}).get("identity"), str),
                "promotion": _typed((_typed(r.get("promotion"), dict) or {}).get("status"), str)}

    def stages(self) -> list[dict]:
        """The record's stages as ``{name, status, seconds, log}``, a field of the wrong type as None."""
        out = []
        for st in _typed(self.record.get("stages"), list) or []:
            st = st if isinstance(st, dict) else {}
            secs = st.get("seconds")
            out.append({"name": _typed(st.get("name"), str), "status": _typed(st.get("status"), str),
                        "seconds": secs if isinstance(secs, (int, float)) and not isinstance(secs, bool) else None,
                        "log": _typed(st.get("log"), str)})
        return out

    def problems(self) -> list[str]:
        """What in record.json is not of the type a build writes (``imagebuild log`` says so and
        shows the rest)."""
        r, out = self.record, []
        for key, want in _FIELDS.items():
            if r.get(key) is not None and not isinstance(r[key], want):
                out.append(f"{key}: expected {_NAMES[want]}, got {type(r[key]).__name__}")
        for i, st in enumerate(_typed(r.get("stages"), list) or []):
            if not isinstance(st, dict):
                out.append(f"stages[{i}]: expected an object, got {type(st).__name__}")
                continue
            for key, want in (("name", str), ("status", str), ("seconds", (int, float)), ("log", str)):
                v = st.get(key)
                if v is not None and (not isinstance(v, want) or isinstance(v, bool)):
                    out.append(f"stages[{i}].{key}: expected {_NAMES[want]}, got {type(v).__name__}")
        return out


_FIELDS = {"status": str, "build_id": str, "started": str, "finished": str, "failed_stage": str,
           "release": dict, "promotion": dict, "stages": list}
_NAMES = {str: "a string", dict: "an object", list: "a list", (int, float): "a number"}


def _typed(value, kind):
    return value if isinstance(value, kind) and not isinstance(value, bool) else None


RECORD_MAX_BYTES = 16 << 20  # a build writes well under 1 MiB; a larger record.json is not one of ours


def _read(d: Path) -> dict:
    path = d / "record.json"
    try:
        if path.is_symlink():  # a link (out of the state folder) is not followed
            return {}
        # never read whole past the bound (a 300 MB one took 615 MB in log), nor a FIFO or device
        data = json.loads(fsutil.read_text(path, RECORD_MAX_BYTES))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def list_runs(ctx: Context | Path, image: str | None = None) -> list[Run]:
    """Runs, newest first (of one image, or of every image)."""
    top = builds_dir(ctx)
    # a folder that is a symbolic link (to somewhere out of the state folder) is no run of ours: never
    # followed, so nothing is read through it, nor written (mark_abandoned), nor removed
    images = [image] if image else sorted(p.name for p in top.iterdir() if p.is_dir() and not p.is_symlink()) \
        if top.is_dir() and not top.is_symlink() else []
    out = []
    for img in images:
        d = top / img
        if not d.is_dir() or d.is_symlink():
            continue
        for rd in d.iterdir():
            if rd.is_dir() and not rd.is_symlink() and not rd.name.startswith("."):
                out.append(Run(img, rd.name, rd, _read(rd)))
    return sorted(out, key=lambda r: r.run_id, reverse=True)


def find_run(ctx: Context | Path, image: str, run_id: str | None) -> Run:
    runs = list_runs(ctx, image)
    if not runs:
        raise UsageError(f"no build runs of {image!r} recorded in {builds_dir(ctx) / image}",
                         hint=f"imagebuild build {image}")
    if run_id in (None, "latest"):
        return runs[0]
    hits = [r for r in runs if r.run_id == run_id] or [r for r in runs if r.run_id.startswith(run_id)]
    if len(hits) != 1:
        shown = ", ".join(r.run_id for r in runs[:5])
        raise UsageError(f"run {run_id!r} of {image}: " + ("ambiguous" if hits else "not found"),
                         hint=f"recent runs: {shown} (imagebuild log {image})")
    return hits[0]


def mark_abandoned(ctx: Context | Path, image: str) -> list[Run]:
    """Write ``abandoned`` into every record of ``image`` left ``running`` by an owner of this host
    that is gone (a kill -9); returns those runs. The build calls it holding the image's lock."""
    out = []
    for r in list_runs(ctx, image):
        if r.record.get("status") == "running" and r.status == ABANDONED:
            rec = {**r.record, "status": ABANDONED,
                   "abandoned": f"its owner {r.record.get('owner')} ended without finishing the record"}
            atomic_write_json(r.dir / "record.json", rec)
            out.append(r)
    return out
