"""What a build shows while BuildKit works, read from BuildKit's structured progress.

Every ``docker buildx build`` runs with ``--progress=rawjson``: one JSON object a line, with
``vertexes`` (the steps: digest, name, started, completed, cached, error), ``statuses`` (a step's
sub-tasks: transfers, pulls), ``logs`` (a step's output, base64) and ``warnings`` (base64).
``Decoder`` turns that stream into a model of the steps and into the plain text of the stage's log
file (buildx's plain layout, ``#N`` per step, decoded, ANSI-free). ``Progress`` shows it on
stderr, in one of the modes of ``--progress`` (docs/build.md, "Progress"):

- ``tty``: one live line per stage and per running step, with timers and the step's last output
  lines, collapsing when done, under a total (``Building 12m03s, stage 3/5``); drawn by
  ``live.py`` (rich), imported only in this mode;
- ``plain``: the run's compact lines, one line when a step starts and one when it ends, and a
  heartbeat (every ``$IMAGEBUILD_HEARTBEAT_S`` s, default 30) naming the stage, the running step,
  its time, how long ago it printed last (``last output 12m03s ago``) and that line; with ``-v``
  also every output line; a failing step's error is said once, by the run's final error;
- ``quiet``: only the heartbeat;
- ``rawjson``: BuildKit's own lines, as they come (for a tool that reads them); buildx's own text lines
  as ``{"buildx": {"message": ...}}`` and imagebuild's as JSON lines too (cli/main.py ``_json_lines``),
  with a stage event (``{"imagebuild": {"event": "start"|"skip"|"done"|"failed", "stage": ...}}``)
  when each stage starts and ends;
- ``auto`` (the default): ``tty`` when stderr is a terminal, otherwise ``plain``.

The default comes from ``$IMAGEBUILD_PROGRESS``, then ``$BUILDKIT_PROGRESS`` (as buildx reads it).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from imagebuild.core import lazy, units
from imagebuild.core.errors import UsageError
from imagebuild.core.printable import one_line, printable
from imagebuild.core.secrets import redact_text, secrets_in_env

log = logging.getLogger("imagebuild")

MODES = ("auto", "tty", "plain", "quiet", "rawjson")
PROGRESS_ENV = ("IMAGEBUILD_PROGRESS", "BUILDKIT_PROGRESS")  # the default of --progress, first set wins
HEARTBEAT_ENV = "IMAGEBUILD_HEARTBEAT_S"
DEFAULT_HEARTBEAT_S = 30.0
TAIL_LINES = 3  # output lines shown under a running step (tty)



_INSTRUCTION = lazy.compile(r"\[(?:[^\]]+ )?\d+/\d+\] ")


def strip_ansi(text: str) -> str:
    """``text`` as printable text (core/printable.py: escape sequences out, then an allow-list; the
    carriage returns of a meter go too), newlines and tabs kept."""
    return printable(text)


def resolve_mode(requested: str | None, *, isatty: bool | None = None) -> str:
    """The mode a run uses: ``requested`` (``--progress``), else ``$IMAGEBUILD_PROGRESS``, else
    ``$BUILDKIT_PROGRESS``, else ``auto``; ``auto`` is ``tty`` on a terminal, ``plain`` otherwise."""
    mode, origin = requested, "--progress"
    if not mode:
        for env in PROGRESS_ENV:
            if os.environ.get(env):
                mode, origin = os.environ[env].strip().lower(), env
                break
    mode = mode or "auto"
    if mode not in MODES:
        what = f"--progress {mode!r}" if origin == "--progress" else f"{origin}={mode!r}"
        raise UsageError(f"{what}: expected one of {', '.join(MODES)}")
    if mode == "auto":
        if isatty is None:
            isatty = sys.stderr.isatty() and os.environ.get("TERM") != "dumb"
        mode = "tty" if isatty else "plain"
    return mode


def heartbeat_every() -> float:
    try:
        return float(os.environ.get(HEARTBEAT_ENV) or DEFAULT_HEARTBEAT_S)
    except ValueError:
        raise UsageError(f"{HEARTBEAT_ENV}={os.environ.get(HEARTBEAT_ENV)!r} is not a number",
                         hint="seconds between heartbeat lines, e.g. 30 (0: none)") from None


def clock(seconds: float) -> str:
    """``42s``, ``3m07s``, ``2h05m07s``: a timer that reads at a glance."""
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s // 60 % 60:02d}m{s % 60:02d}s"


def hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _b64(text) -> str:
    if not isinstance(text, str):
        return ""
    try:
        return base64.b64decode(text).decode("utf-8", "replace")
    except (binascii.Error, ValueError):
        return ""


def _ts(text) -> float | None:
    """Seconds since the epoch of BuildKit's RFC 3339 timestamps (nanoseconds, ``Z``)."""
    if not isinstance(text, str) or len(text) < 20:
        return None
    import datetime as _dt

    head, _, frac = text.rstrip("Z").partition(".")
    try:
        t = _dt.datetime.strptime(head[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=_dt.UTC).timestamp()
    except ValueError:
        return None
    digits = "".join(c for c in frac if c.isdigit())[:9]
    return t + (int(digits) / 10 ** len(digits) if digits else 0.0)


def _size(n: int) -> str:
    return units.human_bytes(n)


@dataclass
class Step:
    """One BuildKit vertex: a Dockerfile instruction or an internal task (load, export)."""
    digest: str
    number: int  # buildx's #N: the order in which the steps appeared
    name: str
    seen: float | None = None  # local monotonic time when it was first seen running
    started: float | None = None  # BuildKit's clock (epoch seconds)
    completed: float | None = None
    cached: bool = False
    error: str | None = None
    lines: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    count: int = 0  # output lines so far
    partial: str = ""  # output after the last newline
    status: str | None = None  # the running sub-task (a transfer, a pull)
    heard: float | None = None  # local monotonic time of its last output

    @property
    def internal(self) -> bool:
        return self.name.startswith("[internal]")

    @property
    def shown(self) -> bool:
        """A Dockerfile instruction (``[2/3] RUN ...``, ``[builder 1/4] FROM ...``) or the export:
        the steps ``plain`` names (not BuildKit's internal loads)."""
        return bool(_INSTRUCTION.match(self.name)) or self.name.startswith("exporting")

    @property
    def running(self) -> bool:
        return self.seen is not None and self.completed is None

    @property
    def done(self) -> bool:
        return self.completed is not None

    def seconds(self, now: float | None = None) -> float:
        if self.completed is not None and self.started is not None:
            return max(0.0, self.completed - self.started)
        if self.seen is None:
            return 0.0
        return max(0.0, (now if now is not None else time.monotonic()) - self.seen)

    def last_line(self) -> str:
        return self.partial.strip() or (self.lines[-1] if self.lines else "")

    def silent(self, now: float | None = None) -> float:
        """Seconds since its last output line (since it started, when it printed nothing yet)."""
        since = self.heard if self.heard is not None else self.seen
        return 0.0 if since is None else max(0.0, (now if now is not None else time.monotonic()) - since)

    def quiet_words(self, now: float | None = None) -> str:
        """``last output 12m03s ago`` (``no output yet`` for a step that printed nothing)."""
        if self.heard is None:
            return "no output yet"
        return f"last output {clock(self.silent(now))} ago"


class Decoder:
    """BuildKit's rawjson lines -> the steps (``steps``, ``warnings``) and the plain log text.

    ``feed(line)`` takes one line of the build's output and returns the log text it makes (possibly
    empty): buildx's plain layout, decoded, ANSI-free. A line that is not rawjson (buildx's own
    error summary at the end) is kept as it is, less its escapes."""

    def __init__(self) -> None:
        self.steps: dict[str, Step] = {}
        self.order: list[Step] = []
        self.warnings: list[str] = []
        self.lines = 0  # output lines of all steps
        self.last: Step | None = None  # the step that printed last
        self._logged_done: set[str] = set()
        self._headed: set[str] = set()
        self._statuses_done: set[tuple[str, str]] = set()
        self._secrets = secrets_in_env()  # a RUN that prints a token: not in the log, nor on screen

    def feed(self, line: str) -> str:
        text = line.strip()
        if not text.startswith("{"):
            line = redact_text(line, self._secrets)
            return strip_ansi(line) if line.endswith("\n") else strip_ansi(line) + ("\n" if line else "")
        try:
            doc = json.loads(text)
        except ValueError:
            return strip_ansi(line.rstrip("\n")) + "\n"
        if not isinstance(doc, dict):
            return ""
        out: list[str] = []
        for v in doc.get("vertexes") or ():
            if isinstance(v, dict):
                self._vertex(v, out)
        for s in doc.get("statuses") or ():
            if isinstance(s, dict):
                self._status(s, out)
        for lg in doc.get("logs") or ():
            if isinstance(lg, dict):
                self._log(lg, out)
        for w in doc.get("warnings") or ():
            if isinstance(w, dict):
                self._warning(w, out)
        return "".join(out)

    # the parts of one message

    def _step(self, digest: str, name: str | None = None) -> Step:
        st = self.steps.get(digest)
        if st is None:
            st = Step(digest, len(self.order) + 1, name or digest[:19])
            self.steps[digest] = st
            self.order.append(st)
        elif name:
            st.name = name
        return st

    def _vertex(self, v: dict, out: list[str]) -> None:
        digest = v.get("digest")
        if not isinstance(digest, str):
            return
        name = v.get("name")
        st = self._step(digest, one_line(redact_text(name, self._secrets)) if isinstance(name, str) else None)
        if digest not in self._headed and (v.get("started") or v.get("completed") or v.get("cached")):
            self._headed.add(digest)  # as buildx's plain: a step's header when it starts
            out.append(f"\n#{st.number} {st.name}\n")
        if v.get("cached"):
            st.cached = True
        started = _ts(v.get("started"))
        completed = _ts(v.get("completed"))
        if started is not None:
            if st.seen is None or (st.completed is not None and completed is None):
                st.seen = time.monotonic()
            st.started = started
            st.completed = completed
        elif completed is not None:
            st.completed = completed
        if isinstance(v.get("error"), str) and v["error"]:
            st.error = v["error"]
            st.completed = st.completed or st.started or 0.0
        if st.completed is not None and digest not in self._logged_done:
            if st.partial:
                self._emit(st, st.partial, out, v.get("completed"))
                st.partial = ""
            if st.error:
                out.append(f"#{st.number} ERROR: {strip_ansi(st.error)}\n")
            elif st.cached:
                out.append(f"#{st.number} CACHED\n")
            else:
                out.append(f"#{st.number} DONE {st.seconds():.1f}s\n")
            self._logged_done.add(digest)

    def _status(self, s: dict, out: list[str]) -> None:
        digest, sid = s.get("vertex"), s.get("id")
        if not isinstance(digest, str) or not isinstance(sid, str):
            return
        st = self._step(digest)
        cur, total = s.get("current"), s.get("total")
        what = strip_ansi(sid)
        if isinstance(cur, int) and cur and isinstance(total, int) and total:
            st.status = f"{what} {_size(cur)} / {_size(total)}"
        elif isinstance(cur, int) and cur:
            st.status = f"{what} {_size(cur)}"
        else:
            st.status = what
        if s.get("completed") and (digest, sid) not in self._statuses_done:
            self._statuses_done.add((digest, sid))
            t0, t1 = _ts(s.get("started")), _ts(s.get("completed"))
            took = f" {t1 - t0:.1f}s" if t0 is not None and t1 is not None else ""
            size = f" {_size(cur)}" if isinstance(cur, int) and cur else ""
            out.append(f"#{st.number} {what}{size}{took} done\n")
            st.status = None

    def _log(self, lg: dict, out: list[str]) -> None:
        digest = lg.get("vertex")
        if not isinstance(digest, str):
            return
        st = self._step(digest)
        data = redact_text(strip_ansi(st.partial + _b64(lg.get("data"))), self._secrets)
        *full, st.partial = data.split("\n")
        if data:
            st.heard = time.monotonic()
        for ln in full:
            self._emit(st, ln, out, lg.get("timestamp"))
        if st.partial and len(st.partial) > 4096:  # a meter with no newline: never hold it all
            self._emit(st, st.partial, out, lg.get("timestamp"))
            st.partial = ""
        self.last = st

    def _emit(self, st: Step, text: str, out: list[str], stamp) -> None:
        t = _ts(stamp)
        rel = f"{max(0.0, t - st.started):.3f} " if t is not None and st.started is not None else ""
        out.append(f"#{st.number} {rel}{text}\n")
        if text.strip():
            st.lines.append(text.rstrip())
        st.count += 1
        self.lines += 1

    def _warning(self, w: dict, out: list[str]) -> None:
        short = redact_text(strip_ansi(_b64(w.get("short"))), self._secrets).strip()
        if not short:
            return
        self.warnings.append(short)
        digest = w.get("vertex")
        st = self.steps.get(digest) if isinstance(digest, str) else None
        out.append(f"#{st.number} WARN: {short}\n" if st else f"WARN: {short}\n")

    # what the display asks

    def running(self) -> list[Step]:
        return [s for s in self.order if s.running]

    def current(self) -> Step | None:
        """The step to name in a heartbeat: the running step that printed last, or the latest one."""
        run = self.running()
        if not run:
            return None
        if self.last is not None and self.last in run:
            return self.last
        named = [s for s in run if not s.internal] or run
        return max(named, key=lambda s: s.seen or 0.0)

    def error(self) -> Step | None:
        return next((s for s in self.order if s.error), None)


# a stage's end state -> its rawjson event
EVENT_OF = {"built": "done", "pulled": "done", "skipped": "skip", "reused": "skip", "failed": "failed",
            "interrupted": "interrupted"}


@dataclass
class StageRow:
    name: str
    state: str = "waiting"  # waiting | running | built | pulled | skipped | reused | failed
    note: str = ""
    seconds: float | None = None
    t0: float | None = None
    decoder: Decoder | None = None
    label: str = ""  # what runs now, when it is not BuildKit (clamping file times)
    extra: bool = False  # not a stage of the definition (the release step): not counted in "stage i/n"


class Progress:
    """What a run shows on stderr while BuildKit works (``--progress``; see this module's doc).

    The builder calls ``begin(stage names)``, then per stage ``stage(name)``, ``start(label, log)``,
    ``feed(raw line, decoder, plain text)`` for each line of ``docker buildx build``, ``stop()``,
    ``finish(name, state, seconds)``; ``info`` for its own lines, and ``end()`` at the end."""

    def __init__(self, mode: str | None = "auto", *, isatty: bool | None = None):
        self.requested = mode
        self.mode = resolve_mode(mode, isatty=isatty)
        self.every = heartbeat_every()
        self.verbose = log.isEnabledFor(logging.DEBUG)
        self.rows: list[StageRow] = []
        self.t0 = time.monotonic()
        self.lock = threading.RLock()
        self._row: StageRow | None = None
        self._log: str | None = None
        self._t0 = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._live = None  # live.LiveView in tty mode, between begin and end
        self.outcome: str | None = None

    # the run

    def begin(self, stages: list[str], extra: tuple[str, ...] = ()) -> None:
        self.t0 = time.monotonic()
        self.rows = [StageRow(n) for n in stages] + [StageRow(n, extra=True) for n in extra]
        if self.mode == "tty" and self._live is None:
            from imagebuild.buildstep import live  # rich: only when a live view is drawn

            self._live = live.LiveView(self, clock=clock, tail=TAIL_LINES)
            self._live.start()

    def end(self, outcome: str = "done") -> None:
        self.stop()
        with self.lock:
            self.outcome = outcome
            for r in self.rows:
                if r.state == "running" and outcome != "done":
                    r.state = "interrupted" if outcome == "interrupted" else "failed"
                    r.seconds = time.monotonic() - r.t0 if r.t0 else None
                    self._event(r.state, r)
        if self._live is not None:
            live, self._live = self._live, None
            live.stop()

    def row(self, name: str) -> StageRow:
        with self.lock:
            for r in self.rows:
                if r.name == name:
                    return r
            r = StageRow(name)
            self.rows.append(r)
            return r

    def stage(self, name: str) -> None:
        """A stage begins (built, pulled or skipped)."""
        with self.lock:
            r = self.row(name)
            r.state, r.t0 = "running", time.monotonic()
            self._row = r
            self._event("start", r)

    def finish(self, name: str, state: str, seconds: float | None = None, note: str = "") -> None:
        with self.lock:
            r = self.row(name)
            r.state, r.note, r.label = state, note, ""
            r.seconds = seconds if seconds is not None else (time.monotonic() - r.t0 if r.t0 else None)
            self._event(EVENT_OF.get(state, state), r)

    def _event(self, event: str, r: StageRow) -> None:
        """rawjson: imagebuild's own stage events among BuildKit's lines, ``{"imagebuild": {"event":
        start|skip|done|failed|interrupted, "stage", "index", "of", "state", "seconds", "note"}}``:
        the BuildKit lines between a stage's ``start`` and its end are that stage's, and a skipped
        stage leaves its trace."""
        if self.mode != "rawjson":
            return
        stages = [x for x in self.rows if not x.extra]
        doc = {"event": event, "stage": r.name, "index": stages.index(r) + 1 if r in stages else None,
               "of": len(stages), "state": r.state}
        if event != "start":
            doc["seconds"] = round(r.seconds, 3) if r.seconds is not None else None
            if r.note:
                doc["note"] = r.note
        sys.stderr.write(json.dumps({"imagebuild": doc}, ensure_ascii=False) + "\n")
        sys.stderr.flush()

    def info(self, msg: str, *args) -> None:
        if self.mode not in ("quiet", "rawjson"):
            log.info(msg, *args)

    # one docker buildx build (or another long task of a stage)

    def start(self, stage: str, log_path: str, *, label: str = "", decoder: Decoder | None = None) -> None:
        with self.lock:
            r = self.row(stage)
            if r.state == "waiting":
                r.state, r.t0 = "running", time.monotonic()
            r.decoder, r.label = decoder, label
            self._row, self._log, self._t0 = r, log_path, time.monotonic()
        if self.mode in ("plain", "quiet") and self.every > 0:
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat, daemon=True)
            self._thread.start()

    def feed(self, raw: str, dec: Decoder, plain: str) -> None:
        """One line of ``docker buildx build``: ``raw`` as it came, ``plain`` the log text it made."""
        if self.mode == "rawjson":
            line = raw.rstrip("\n")
            if not line.lstrip().startswith("{"):  # buildx's own text (its error summary): a JSON line too
                line = json.dumps({"buildx": {"message": line}}, ensure_ascii=False)
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            return
        if self.mode != "plain" or not plain:
            return
        name = self._row.name if self._row else "?"
        out = []
        for ln in plain.splitlines():
            if not ln:
                continue
            if self.verbose or (_compact(ln, dec) and not _said_at_the_end(ln, dec)):
                out.append(f"{name} | {ln}\n")
        if out:
            sys.stderr.write("".join(out))
            sys.stderr.flush()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # what is shown

    def heartbeat(self) -> str:
        """The heartbeat line: the stage, its time, the running step, its time, its last output."""
        with self.lock:
            r = self._row
            name = (r.name + (f" ({r.label})" if r and r.label else "")) if r else "?"
            el = time.monotonic() - self._t0
            parts = [f"... {name}: still building ({hms(el)}"]
            dec = r.decoder if r else None
            if dec is not None:
                parts[0] += f", {dec.lines} log lines)"
                st = dec.current()
                if st is not None:
                    parts.append(f"step #{st.number} {_short(st.name, 60)} ({hms(st.seconds())})")
                    said, last = st.quiet_words(), st.last_line()
                    if last and st.heard is not None:
                        said += f": {_short(last, 100)}"
                    elif st.status:
                        said += f", {_short(st.status, 100)}"
                    parts.append(said)
            else:
                parts[0] += ")"
            parts.append(f"log: {self._log}")
            return ", ".join(parts)

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            sys.stderr.write(self.heartbeat() + "\n")
            sys.stderr.flush()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def _compact(line: str, dec: Decoder) -> bool:
    """The plain log lines that ``--progress plain`` shows: a Dockerfile step's start and end, any
    step's error or warning, and what is not a step's output (buildx's own error summary)."""
    if not line.startswith("#"):
        return True
    head, _, rest = line.partition(" ")
    if not head[1:].isdigit():
        return True
    n = int(head[1:])
    st = dec.order[n - 1] if 0 < n <= len(dec.order) else None
    first = rest.split(" ", 1)[0]
    if first in ("ERROR:", "WARN:"):
        return True
    if st is None or not st.shown:
        return False
    return first in ("DONE", "CACHED") or rest == st.name


def _said_at_the_end(line: str, dec: Decoder) -> bool:
    """A failing step's ERROR line and buildx's error summary after it: the run's final error says
    them once (the place, the RUN's exit code, the step's output), so ``plain`` does not print them
    first."""
    if line.startswith("#"):
        head, _, rest = line.partition(" ")
        return head[1:].isdigit() and rest.startswith("ERROR:")
    return dec.error() is not None or line.startswith("ERROR")


def _short(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"
