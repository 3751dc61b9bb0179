"""The nightly history: one compact line per image per night, kept for good (docs/nightly.md,
"History").

    <state>/nightly-history.jsonl      schema imagebuild.nightly-history, version 1, one JSON per line

Each night's report (report.py) is kept only ``--keep-reports`` nights; its history lines stay:
neither the reports' retention nor ``imagebuild gc`` removes this file. A line holds what the
history table and the HTML page chart: each stage's time and cache result, the image size, the
cache hit rate, the gate's result, what moved upstream, and the failing stage's exit code.

The file is rewritten whole for each night (a temporary file and a rename, core/fsutil.py): a
reader sees the lines before the night or after it, never half a line; a night's lines are added
once (by run id). Lines that cannot be read (a foreign edit) are skipped and counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from imagebuild.core import context as context_mod
from imagebuild.core import fsutil
from imagebuild.core.errors import excerpt
from imagebuild.core.fsutil import atomic_write_bytes
from imagebuild.ops.imagediff import human

SCHEMA = "imagebuild.nightly-history"
VERSION = 1
HISTORY_MAX = 64 << 20  # a nightly adds a few hundred bytes; a bigger file is not read (docs/security.md)
FILE = "nightly-history.jsonl"
DEFAULT_NIGHTS = 30


def path(ctx: context_mod.Context | Path) -> Path:
    return context_mod.of(ctx).state / FILE


def hit_rate(hits: int, misses: int) -> float | None:
    return round(hits / (hits + misses), 4) if hits + misses else None


MAX_ITEMS = 8  # names kept per list in a line (the counts say how many there were)


def _short(v) -> str:
    v = "-" if v is None else str(v)
    return v[:12] if len(v) == 40 or v.startswith("sha256:") and len(v) > 19 else v[:60]


def changed_of(ch: dict | None) -> dict | None:
    """What changed in the image against the previous ``:local`` (the report's ``changes``), kept
    short: per list (pins, patches, pip, dpkg) how many entries changed and the first few, as
    ``NAME FROM->TO`` (``+NAME TO`` added, ``-NAME FROM`` removed); None when nothing was compared."""
    if not ch:
        return None
    out: dict = {"same_image": bool(ch.get("same_image"))}
    for part in ("pins", "patches", "pip", "dpkg"):
        c = ch.get(part)
        if not c:
            out[part] = None
            continue
        items = ([f"{x['name']} {_short(x.get('from'))}->{_short(x.get('to'))}" for x in c.get("changed") or []]
                 + [f"+{x['name']} {_short(x.get('to'))}" for x in c.get("added") or []]
                 + [f"-{x['name']} {_short(x.get('from'))}" for x in c.get("removed") or []])
        out[part] = {"n": len(items), "items": items[:MAX_ITEMS]}
    return out


def compiler_cache_of(stages: list[dict]) -> dict | None:
    """The night's compiler-cache figures, over its compile stages (buildstep/compilecache.py); None: no
    stage compiled through it."""
    ccs = [st["compiler_cache"] for st in stages if st.get("compiler_cache")]
    if not ccs:
        return None
    hits, misses = sum(c.get("hits", 0) for c in ccs), sum(c.get("misses", 0) for c in ccs)
    return {"hits": hits, "misses": misses, "uncacheable": sum(c.get("uncacheable", 0) for c in ccs),
            "rate": hit_rate(hits, misses)}


def rows_of(doc: dict) -> list[dict]:
    """The history lines of one nightly report: one per image."""
    out = []
    for im in doc.get("images") or []:
        c = im.get("cache") or {}
        g = im.get("gate")
        s = (g or {}).get("summary") or {}
        up = im.get("upstream") or {}
        f = im.get("failure")
        out.append({
            "schema": SCHEMA, "version": VERSION, "run_id": doc["run_id"], "started": doc.get("started"),
            "image": im["image"], "status": im.get("status"), "exit_code": im.get("exit_code"),
            "seconds": im.get("seconds"), "build_id": im.get("build_id"), "identity": im.get("identity"),
            "size": im.get("size") if im.get("size") is not None else ((im.get("changes") or {}).get("to") or {}).get("size"),
            "steps": {k: (v or {}).get("seconds") for k, v in (im.get("steps") or {}).items()},
            "stages": [{"name": st.get("name"), "cache": st.get("cache"), "status": st.get("status"),
                        "seconds": st.get("seconds")} for st in im.get("stages") or []],
            "cache": {"hits": c.get("hits", 0), "misses": c.get("misses", 0),
                      "rate": hit_rate(c.get("hits", 0), c.get("misses", 0))},
            "compiler_cache": compiler_cache_of(im.get("stages") or []),
            "gate": None if not g else {"result": g.get("result"), "ran": bool(g.get("ran")),
                                        "passed": s.get("passed", 0), "failed": s.get("failed", 0),
                                        "skipped": s.get("skipped", 0),
                                        "gpu_checks_skipped": bool(g.get("gpu_checks_skipped")),
                                        "failed_checks": [{"id": c.get("id"), "detail": str(c.get("detail") or "")[:300]}
                                                          for c in g.get("checks") or []
                                                          if c.get("outcome") == "failed"][:MAX_ITEMS]},
            "promotion": (im.get("promotion") or {}).get("status"),
            "sync": (im.get("sync") or {}).get("status"),
            "moved": [{k: m.get(k) for k in ("source", "what", "from", "to", "repo")} for m in up.get("moved") or []],
            "pull_requests": [{k: p.get(k) for k in ("source", "number", "head", "state", "merged", "repo")}
                              for p in up.get("pull_requests") or []],
            "failure": None if not f else {"step": f.get("step"), "stage": f.get("stage"),
                                           "exit_code": f.get("exit_code"), "command": f.get("command"),
                                           "log": f.get("log")},
            "changed": changed_of(im.get("changes")),
        })
    return out


# What a history line holds, checked key by key before any line is used (a hand-edited or corrupted
# line is skipped and named, never an internal error): a tuple of the types a value may have (NUM: a
# number, not a bool), or ("list", spec), ("map", spec: the values of a dict with string keys),
# ("dict", {key: spec}, required keys). A key that is missing is None (older lines lack newer keys).
NUM = "num"
SCALAR = (str, int, float, bool, type(None))
OPT_STR, OPT_INT, OPT_NUM = (str, type(None)), (int, type(None)), (NUM, type(None))
ROW_SPEC = ("dict", {
    "schema": (str,), "version": (int, type(None)), "run_id": (str,), "started": OPT_STR, "image": (str,),
    "status": OPT_STR, "exit_code": OPT_INT, "seconds": OPT_NUM, "build_id": OPT_STR, "identity": OPT_STR,
    "size": OPT_NUM, "steps": ("map", OPT_NUM),
    "stages": ("list", ("dict", {"name": (str,), "cache": OPT_STR, "status": OPT_STR, "seconds": OPT_NUM}, {"name"})),
    "cache": ("dict", {"hits": OPT_INT, "misses": OPT_INT, "rate": OPT_NUM}, set(), "or-none"),
    "gate": ("dict", {"result": OPT_STR, "ran": (bool, type(None)), "passed": OPT_INT, "failed": OPT_INT,
                      "skipped": OPT_INT, "gpu_checks_skipped": (bool, type(None)),
                      "failed_checks": ("list", ("dict", {"id": SCALAR, "detail": OPT_STR}, set()))},
             set(), "or-none"),
    "promotion": OPT_STR, "sync": OPT_STR,
    "moved": ("list", ("dict", {"source": SCALAR, "what": SCALAR, "from": SCALAR, "to": SCALAR, "repo": OPT_STR},
                       {"source", "what", "from", "to"})),
    "pull_requests": ("list", ("dict", {"source": SCALAR, "number": SCALAR, "head": SCALAR, "state": SCALAR,
                                        "merged": SCALAR, "repo": OPT_STR}, {"source", "number"})),
    "failure": ("dict", {"step": OPT_STR, "stage": OPT_STR, "exit_code": OPT_INT, "command": SCALAR,
                         "log": OPT_STR}, set(), "or-none"),
    "changed": ("dict", {"same_image": (bool, type(None)),
                         **{part: ("dict", {"n": (int,), "items": ("list", (str,))}, {"n"}, "or-none")
                            for part in ("pins", "patches", "pip", "dpkg")}}, set(), "or-none"),
}, {"schema", "run_id", "image"})


def _wrong(value, spec, where: str) -> str | None:
    """Why ``value`` is not what ``spec`` says (naming its key), or None."""
    if isinstance(spec, tuple) and spec and spec[0] in ("list", "map", "dict"):
        kind = spec[0]
        if kind == "dict" and len(spec) > 3 and value is None:
            return None
        if kind == "list":
            if value is None:
                return None
            if not isinstance(value, list):
                return f"{where}: expected a list"
            for i, v in enumerate(value):
                why = _wrong(v, spec[1], f"{where}[{i}]")
                if why:
                    return why
            return None
        if value is None and kind == "map":
            return None
        if not isinstance(value, dict):
            return f"{where}: expected an object"
        if kind == "map":
            for k, v in value.items():
                why = _wrong(v, spec[1], f"{where}.{k}")
                if why:
                    return why
            return None
        for k in spec[2]:
            if k not in value:
                return f"{where + '.' if where else ''}{k}: missing"
        for k, sub in spec[1].items():
            if k in value:
                why = _wrong(value[k], sub, f"{where + '.' if where else ''}{k}")
                if why:
                    return why
        return None
    for t in spec:
        if t == NUM:  # finite, and not beyond any real size or time (a chart scales by it)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 1e18:
                return None
        elif t is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return None
        elif isinstance(value, t):
            return None
    return f"{where}: unexpected {type(value).__name__} {excerpt(json.dumps(value, default=str))}"


def check_row(row) -> str | None:
    """Why ``row`` is not a history line this version can show, or None."""
    if not isinstance(row, dict):
        return "not a JSON object"
    if row.get("schema") != SCHEMA:
        return f"schema: expected {SCHEMA!r}"
    return _wrong(row, ROW_SPEC, "")


@dataclass
class History:
    rows: list[dict] = field(default_factory=list)  # oldest first
    skipped: int = 0  # lines that could not be read
    bad: list[str] = field(default_factory=list)  # which, and why ("line 12: gate.passed: unexpected str ...")

    def images(self) -> list[str]:
        seen: dict[str, None] = {}
        for r in self.rows:
            seen.setdefault(r["image"], None)
        return list(seen)

    def of(self, image: str, last: int | None = None) -> list[dict]:
        rows = [r for r in self.rows if r["image"] == image]
        return rows[-last:] if last else rows


def read(file: Path) -> History:
    from imagebuild.ops.report import redact, secrets_in_env

    h = History()
    secrets = secrets_in_env()
    try:
        data = fsutil.read_text(file, HISTORY_MAX, errors="replace")
    except FileNotFoundError:
        return h
    except OSError as exc:
        h.skipped += 1
        h.bad.append(f"cannot read it: {exc.strerror or exc}")
        return h
    for n, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            why = "not JSON"
        else:
            why = check_row(row)
        if why:
            h.skipped += 1
            h.bad.append(f"line {n}: {why}")
        else:
            h.rows.append(redact(row, secrets))  # a line written before a URL's userinfo was removed: not shown
    h.rows.sort(key=lambda r: r["run_id"])
    return h


def append(file: Path, doc: dict) -> int:
    """Add ``doc``'s lines (once per run id and image); returns how many were added."""
    file = Path(file)
    try:
        old = fsutil.read_bytes(file, HISTORY_MAX)
    except FileNotFoundError:
        old = b""
    have = {(r["run_id"], r["image"]) for r in read(file).rows} if old else set()
    new = [r for r in rows_of(doc) if (r["run_id"], r["image"]) not in have]
    if not new:
        return 0
    if old and not old.endswith(b"\n"):
        old += b"\n"
    text = "".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in new)
    atomic_write_bytes(file, old + text.encode("utf-8"))
    return len(new)


def load(file: Path, reports: list[dict] = ()) -> History:
    """The history file, plus the nights of kept ``reports`` it lacks (reports written before it existed)."""
    h = read(file)
    have = {(r["run_id"], r["image"]) for r in h.rows}
    for doc in reports:
        name = doc.get("run_id") if isinstance(doc, dict) else None
        name = f"kept report {excerpt(name)}" if isinstance(name, str) else "a kept report"
        try:
            rows = rows_of(doc)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:  # a hand-edited report
            h.skipped += 1
            h.bad.append(f"{name}: not a nightly report this version can read ({type(exc).__name__}: "
                         f"{excerpt(str(exc))})")
            continue
        for r in rows:
            why = check_row(r)
            if why:
                h.skipped += 1
                h.bad.append(f"{name}: {why}")
            elif (r["run_id"], r["image"]) not in have:
                h.rows.append(r)
    h.rows.sort(key=lambda r: r["run_id"])
    return h


def last_nights(h: History, n: int | None, image: str | None = None) -> list[dict]:
    """The rows of the last ``n`` nights (by run id), of ``image`` or of every image."""
    rows = [r for r in h.rows if image is None or r["image"] == image]
    if n:
        runs = sorted({r["run_id"] for r in rows})[-n:]
        rows = [r for r in rows if r["run_id"] in set(runs)]
    return rows


# --------------------------------------------------------------------------------------------- rendering


def secs(v) -> str:
    if v is None:
        return "-"
    try:
        v = float(v)
    except (TypeError, ValueError):
        return "?"
    if not abs(v) < 1e18:  # inf, nan
        return "?"
    if v < 60:
        return f"{v:.1f}s"
    if v < 3600:
        return f"{int(v) // 60}m{int(v) % 60:02d}s"
    return f"{int(v) // 3600}h{int(v) % 3600 // 60:02d}m"


def stage_cell(st: dict | None) -> str:
    if not st:
        return ""
    if st.get("status") == "failed":
        return "FAILED"
    if st.get("cache") == "hit":
        return "hit"
    if st.get("cache") == "not-reached":
        return "-"
    return secs(st.get("seconds"))


def gate_cell(g: dict | None) -> str:
    if not g:
        return "-"
    text = {"passed": "PASS", "failed": "FAIL"}.get(g.get("result"), str(g.get("result") or "?"))
    return text + ("*" if g.get("gpu_checks_skipped") else "")


def moved_cell(r: dict) -> str:
    return ", ".join(f"{m['source']} {m['what']} {str(m['from'])[:7]}->{str(m['to'])[:7]}" for m in r.get("moved") or [])


def stage_names(rows: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        for st in r.get("stages") or []:
            seen.setdefault(st["name"], None)
    return list(seen)


def render_table(rows: list[dict]) -> str:
    """One table per image, one line per night, oldest first."""
    from imagebuild.core.printable import one_line

    out = []
    for image in dict.fromkeys(r["image"] for r in rows):
        mine = [r for r in rows if r["image"] == image]
        names = stage_names(mine)
        head = ["NIGHT", "STATUS", "TIME", *names, "SIZE", "HITS", "GATE", "MOVED UPSTREAM"]
        body = []
        for r in mine:
            by = {st["name"]: st for st in r.get("stages") or []}
            rate = (r.get("cache") or {}).get("rate")
            status = str(r.get("status"))
            f = r.get("failure") or {}
            if f.get("exit_code") is not None:
                status += f" (exit {f['exit_code']})"
            body.append([r["run_id"][:15].replace("T", " "), status, secs(r.get("seconds")),
                         *[stage_cell(by.get(n)) for n in names], human(r.get("size")) if r.get("size") else "-",
                         "-" if rate is None else f"{round(rate * 100)}%", gate_cell(r.get("gate")),
                         moved_cell(r) or "-"])
        body = [[one_line(str(x)) for x in line] for line in body]  # a hand-edited line's escapes: not shown
        widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
        out.append(f"{one_line(image)}: {len(mine)} night(s)")
        for line in [head, *body]:
            out.append("  " + "  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)).rstrip())
        if any((r.get("gate") or {}).get("gpu_checks_skipped") for r in mine):
            out.append("  * GPU checks skipped (they did not run)")
        out.append("")
    return "\n".join(out).rstrip() + "\n" if out else "no nights in the history\n"
