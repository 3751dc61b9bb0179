"""The nightly run report: one JSON document (schema ``imagebuild.nightly-report``, version 1,
docs/nightly-report.schema.json) and its Markdown rendering, written atomically side by side.

    <report dir>/<run id>.json     the report (the data; `imagebuild report --json` prints it)
    <report dir>/<run id>.md       the same, for people (what a notify hook posts)

The report dir is ``--report-dir`` (default ``<state>/nightly``, i.e. ``.imagebuild/nightly``).
The last N reports are kept (``--keep-reports``); older pairs are removed after a new one is
written. ``find`` resolves ``latest``, a run id or a unique prefix of one, optionally only among
the reports that cover an image.

Secrets: every string in a report passes through ``redact`` before it is written, so the value of
``GITHUB_TOKEN`` (or any variable named in ``SECRET_ENV``) can never appear in a report, even if
an error message from a child process carried it; nor can the `user:password@` of a URL.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from imagebuild.core import context as context_mod
from imagebuild.core import fsutil
from imagebuild.core.errors import UsageError
from imagebuild.core.fsutil import atomic_write_text
from imagebuild.core.secrets import REDACTED, SECRET_ENV, redact_text, secrets_in_env  # noqa: F401 (names of this module)
from imagebuild.ops.imagediff import human
from imagebuild.ops.imagediff import render as render_diff

SCHEMA = "imagebuild.nightly-report"
VERSION = 1
DEFAULT_KEEP_REPORTS = 14


def default_dir(ctx: context_mod.Context | Path) -> Path:
    """Where the nightly keeps its reports: ``<state>/nightly``."""
    return context_mod.of(ctx).state / "nightly"


# --------------------------------------------------------------------------------------------- secrets


def redact(obj, secrets: list[str] | None = None):
    """``obj`` with every secret value replaced and every URL's userinfo removed (strings anywhere
    inside dicts and lists)."""
    secrets = secrets_in_env() if secrets is None else secrets
    if isinstance(obj, str):
        return redact_text(obj, secrets)
    if isinstance(obj, dict):
        return {redact(k, secrets): redact(v, secrets) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [redact(v, secrets) for v in obj]
    return obj


# --------------------------------------------------------------------------------------------- files


@dataclass(frozen=True)
class Stored:
    run_id: str
    json_path: Path
    md_path: Path

    def load(self) -> dict:
        try:
            doc = json.loads(fsutil.read_text(self.json_path))
        except (OSError, ValueError) as exc:
            raise UsageError(f"{self.json_path}: not a readable report ({exc})") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise UsageError(f"{self.json_path}: not a nightly report (schema {SCHEMA!r} expected)")
        return doc


def write(report_dir: Path, doc: dict, *, keep: int = DEFAULT_KEEP_REPORTS) -> Stored:
    """Write the report (JSON, then Markdown; each atomically) and prune to the last ``keep``."""
    doc = redact(doc)
    report_dir = Path(report_dir)
    jp = report_dir / f"{doc['run_id']}.json"
    mp = report_dir / f"{doc['run_id']}.md"
    atomic_write_text(mp, render_markdown(doc))
    atomic_write_text(jp, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    prune(report_dir, keep)
    return Stored(doc["run_id"], jp, mp)


def stored(report_dir: Path) -> list[Stored]:
    """The reports in ``report_dir``, newest first (run ids sort by start time)."""
    d = Path(report_dir)
    if not d.is_dir():
        return []
    out = [Stored(p.stem, p, p.with_suffix(".md")) for p in d.glob("*.json") if not p.name.startswith(".")]
    return sorted(out, key=lambda s: s.run_id, reverse=True)


def prune(report_dir: Path, keep: int) -> list[str]:
    """Remove all but the newest ``keep`` reports; returns the removed run ids."""
    removed = []
    for s in stored(report_dir)[max(keep, 1):]:
        for p in (s.json_path, s.md_path, s.json_path.with_suffix(".html")):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        removed.append(s.run_id)
    return removed


def find(report_dir: Path, which: str | None = None, image: str | None = None) -> Stored:
    """``latest`` (default), a run id or a unique prefix; with ``image``, only reports covering it."""
    reports = stored(report_dir)
    if image is not None:
        reports = [s for s in reports if image in _images_of(s)]
    if not reports:
        raise UsageError(f"no nightly reports{' of ' + image if image else ''} in {report_dir}",
                         hint="imagebuild nightly IMAGE... writes one (or pass --report-dir DIR)")
    if which in (None, "latest"):
        return reports[0]
    hits = [s for s in reports if s.run_id == which] or [s for s in reports if s.run_id.startswith(which)]
    if len(hits) != 1:
        shown = ", ".join(s.run_id for s in reports[:5])
        raise UsageError(f"report {which!r}{' of ' + image if image else ''}: "
                         + ("ambiguous" if hits else "not found") + f" in {report_dir}",
                         hint=f"recent reports: {shown}")
    return hits[0]


def _images_of(s: Stored) -> list[str]:
    try:
        doc = json.loads(fsutil.read_text(s.json_path))
        return [i.get("image") for i in doc.get("images") or []]
    except (OSError, ValueError):
        return []


# --------------------------------------------------------------------------------------------- rendering


def _secs(v) -> str:
    if v is None:
        return "-"
    v = float(v)
    return f"{v:.1f} s" if v < 120 else f"{int(v) // 60} min {int(v) % 60:02d} s"


def summary_lines(doc: dict) -> list[str]:
    """A few lines per image: what a terminal shows at the end of a run."""
    lines = [f"nightly {doc['run_id']}: {doc['status'].upper()} (exit {doc['exit_code']}) in {_secs(doc['seconds'])}"]
    if doc.get("refused"):
        lines.append(f"  refused: {doc['refused']['reason']}")
    for im in doc["images"]:
        head = f"  {im['image']}: {im['status']}"
        if im.get("reason"):
            head += f" ({im['reason']})"
        lines.append(head)
        up = im.get("upstream") or {}
        if up.get("moved"):
            lines.append("    upstream moved: " + ", ".join(f"{m['source']} {m['what']} {m['from'][:12]}->{m['to'][:12]}"
                                                           for m in up["moved"]))
        st = im.get("stages") or []
        if st:
            lines.append("    stages: " + stage_counts(st))
        for s in st:
            if s.get("compiler_cache"):
                lines.append(f"    {s['name']}: {compilecache_line(s['compiler_cache'])}")
        lines += ["    " + ln for ln in failure_lines(im.get("failure"))]
        g = im.get("gate")
        if g:
            s = g.get("summary") or {}
            lines.append(f"    gate: {g['result']}{' (receipt reused)' if not g.get('ran') else ''}: "
                         f"{s.get('passed', 0)} passed, {s.get('failed', 0)} failed, {s.get('skipped', 0)} skipped"
                         + (" - GPU checks skipped" if g.get("gpu_checks_skipped") else ""))
        sy = im.get("sync") or {}
        if sy.get("peers"):
            lines.append("    sync: " + ", ".join(f"{p['peer']} {p['status']} ({human(p.get('bytes_sent'))})"
                                                  for p in sy["peers"]))
        elif sy.get("status") and sy["status"] != "not-requested":
            lines.append(f"    sync: {sy['status']}" + (f" ({sy['reason']})" if sy.get("reason") else ""))
        tags = im.get("tags") or {}
        if tags.get("local"):
            lines.append(f"    {im['image']}:local = build {tags['local'].get('build_id') or '-'}"
                         f" ({str(tags['local'].get('identity'))[:19]})")
    d = doc.get("disk") or {}
    if d.get("gc"):
        lines.append(f"  gc (keep {d['gc']['keep']}): freed {human(d['gc']['freed_bytes'])}")
    return lines


def compilecache_line(cc: dict | None) -> str:
    """A compile stage's compiler-cache figures (buildstep/compilecache.py), in one line."""
    from imagebuild.buildstep import compilecache

    return compilecache.line(cc)


def stage_counts(stages: list[dict]) -> str:
    """``2 cached, 1 built (app), 1 failed (tests), 1 not reached``: a failed stage is never counted as built."""
    def names(pick) -> list[str]:
        return [s["name"] for s in stages if pick(s)]

    built = names(lambda s: s.get("status") == "built")
    failed = names(lambda s: s.get("status") == "failed")
    cached = names(lambda s: s.get("cache") == "hit")
    reached = names(lambda s: s.get("cache") == "not-reached")
    text = f"{len(cached)} cached, {len(built)} built ({', '.join(built) or 'none'})"
    if failed:
        text += f", {len(failed)} failed ({', '.join(failed)})"
    if reached:
        text += f", {len(reached)} not reached"
    return text


def failure_lines(f: dict | None) -> list[str]:
    """What failed, the failing step's own exit code and the last lines of its log (for the summary)."""
    if not f:
        return []
    out = []
    if f.get("stage"):
        head = f"failed stage {f['stage']}"
        if f.get("exit_code") is not None:
            head += f": RUN exit {f['exit_code']}" + (f" (`{f['command']}`)" if f.get("command") else "")
        if f.get("tool_exit_code") is not None:
            head += f"; docker buildx exited {f['tool_exit_code']}"
        out.append(head + (f"; log {f['log']}" if f.get("log") else ""))
    for p in f.get("problems") or []:
        loc = p["file"] + (f":{p['line']}" if p.get("line") else "") + (f": {p['key']}" if p.get("key") else "")
        out.append(f"problem: {loc}: {p['message']}")
    if f.get("tail"):
        out.append("last lines of its log:" if f.get("log") else "its output:")
        out += ["  | " + ln for ln in f["tail"]]
    return out


def _fence(lines: list[str]) -> str:
    longest = max((len(run) for ln in lines for run in _backtick_runs(ln)), default=0)
    return "`" * max(3, longest + 1)


def _backtick_runs(line: str) -> list[str]:
    runs, cur = [], ""
    for c in line:
        if c == "`":
            cur += c
        elif cur:
            runs.append(cur)
            cur = ""
    return runs + ([cur] if cur else [])


def _failure_md(f: dict) -> list[str]:
    L = ["### Failure", ""]
    if f.get("stage"):
        text = f"Stage `{f['stage']}`"
        if f.get("exit_code") is not None:
            text += (f": the step `{f['command']}`" if f.get("command") else ": its step") + \
                f" failed: **RUN exit {f['exit_code']}**"
        else:
            text += ": no step reported an exit code"
        if f.get("tool_exit_code") is not None:
            text += f" (docker buildx itself exited {f['tool_exit_code']})"
        L += [text + "." + (f" Full log: `{f['log']}`." if f.get("log") else ""), ""]
    elif f.get("step"):
        L += [f"The {f['step']} step failed.", ""]
    for p in f.get("problems") or []:
        loc = p["file"] + (f":{p['line']}" if p.get("line") else "")
        L.append(f"- `{loc}`" + (f" `{p['key']}`" if p.get("key") else "") + f": {p['message']}")
    if f.get("problems"):
        L.append("")
    if f.get("tail"):
        fence = _fence(f["tail"])
        L += ["Last lines of its log:" if f.get("log") else "Its output:", "", fence + "text", *f["tail"], fence, ""]
    return L


def render_markdown(doc: dict) -> str:
    """The whole report for people."""
    L = [f"# Nightly build {doc['run_id']}", "",
         f"**{doc['status'].upper()}** (exit {doc['exit_code']}) on {doc['host']} in {_secs(doc['seconds'])}, "
         f"{doc['started']} - {doc['finished']}; imagebuild {doc['imagebuild_version']}.", ""]
    cmd = doc.get("command") or {}
    L += [f"Images: {', '.join(cmd.get('images') or []) or '-'}; peers: {', '.join(cmd.get('peers') or []) or 'none'};"
          f" refresh: {'yes' if cmd.get('refresh') else 'no'}; gc keeps {cmd.get('keep_builds')} builds.", ""]
    if doc.get("refused"):
        r = doc["refused"]
        L += ["## Refused", "", r["reason"], ""]
        for c in r.get("containers") or []:
            L.append(f"- `{c['name']}` ({c['id']}, {c['image']}): {c['why']}")
        L += ["", "Nothing was prefetched, built, promoted or synced; the serving container was not touched.", ""]
    for im in doc["images"]:
        L += _image_md(im)
    d = doc.get("disk") or {}
    if d:
        L += ["## Disk", "", "| | before | after |", "|---|---:|---:|"]
        b, a = d.get("before") or {}, d.get("after") or {}
        L.append(f"| free in the state folder | {human(b.get('free_bytes'))} | {human(a.get('free_bytes'))} |")
        if b.get("docker_free_bytes") is not None or a.get("docker_free_bytes") is not None:
            L.append(f"| free in Docker's data root | {human(b.get('docker_free_bytes'))} | "
                     f"{human(a.get('docker_free_bytes'))} |")
        for name in sorted(set(b.get("images") or {}) | set(a.get("images") or {})):
            L.append(f"| held by {name} | {human((b.get('images') or {}).get(name))} | "
                     f"{human((a.get('images') or {}).get(name))} |")
        g = d.get("gc")
        if g:
            L += ["", f"gc (retention: the builds of :local, :previous, :candidate and the last {g['keep']}) freed "
                  f"{human(g['freed_bytes'])} in {g['removed']} item(s)."]
        elif d.get("gc_skipped"):
            L += ["", f"gc: {d['gc_skipped']}"]
        L.append("")
    return "\n".join(L).rstrip() + "\n"


def _image_md(im: dict) -> list[str]:
    L = [f"## {im['image']}: {im['status']}", ""]
    if im.get("reason"):
        L += [f"**Why:** {im['reason']}", ""]
    if im.get("failure"):
        L += _failure_md(im["failure"])
    L.append(f"Build id {im.get('build_id') or '-'}; identity {im.get('identity') or '-'}; {_secs(im.get('seconds'))}.")
    L.append("")
    steps = im.get("steps") or {}
    if steps:
        L += ["| step | result | time | detail |", "|---|---|---:|---|"]
        for name in ("prefetch", "build", "gate", "promote", "sync"):
            s = steps.get(name)
            if s:
                L.append(f"| {name} | {s['status']} | {_secs(s.get('seconds'))} | {s.get('detail') or ''} |")
        L.append("")
    up = im.get("upstream")
    if up:
        L += ["### Upstream", ""]
        if not up.get("checked"):
            L.append(f"- not checked ({up.get('reason') or 'no --refresh'})")
        for m in up.get("moved") or []:
            L.append(f"- **moved** {m['source']} {m['what']}: `{m['from'][:12]}` -> `{m['to'][:12]}`")
        for p in up.get("pull_requests") or []:
            state_ = p.get("state") or "unknown"
            via = ", ".join(p.get("via") or [])
            L.append(f"- {p['source']} PR {p['number']}: {state_}{' (merged)' if p.get('merged') else ''}"
                     f"; head `{str(p.get('head') or '-')[:12]}`" + (f" ({via})" if via else ""))
        for n in up.get("notices") or []:
            L.append(f"- note: {n}")
        if up.get("checked") and not (up.get("moved") or up.get("pull_requests") or up.get("notices")):
            L.append("- nothing moved")
        L.append("")
    if im.get("stages"):
        L += ["### Stages", "", "| stage | cache | status | time | compiler cache |", "|---|---|---|---:|---|"]
        for s in im["stages"]:
            cc = compilecache_line(s.get("compiler_cache"))
            L.append(f"| {s['name']} | {s['cache']} | {s['status']} | {_secs(s.get('seconds'))} | {cc or '-'} |")
        L.append("")
    g = im.get("gate")
    if g:
        s = g.get("summary") or {}
        L += ["### Gate", "",
              f"{g['result'].upper()}{' (this identity already passed this spec: receipt reused)' if not g.get('ran') else ''}"
              f": {s.get('passed', 0)} passed, {s.get('failed', 0)} failed, {s.get('warned', 0)} warned, "
              f"{s.get('skipped', 0)} skipped of {s.get('total', 0)}" + (f" ({g['reason']})" if g.get("reason") else ""),
              ""]
        if g.get("gpu_checks_skipped"):
            L += ["**GPU checks were SKIPPED** (no GPU on the build node): they did not pass, they did not run.", ""]
        L += ["| result | check | kind | detail |", "|---|---|---|---|"]
        for c in g.get("checks") or []:
            res = c["outcome"].upper() + (" (GPU)" if c.get("requires_gpu") else "")
            L.append(f"| {res} | {c['id']} | {c['kind']} | {_cell(c.get('detail'))} |")
        L.append("")
    sy = im.get("sync")
    if sy:
        L += ["### Sync", ""]
        if sy.get("peers"):
            L += ["| peer | result | sent | time | detail |", "|---|---|---:|---:|---|"]
            for p in sy["peers"]:
                L.append(f"| {p['peer']} | {p['status']} | {human(p.get('bytes_sent'))} | {_secs(p.get('seconds'))} | "
                         f"{_cell(p.get('message'))} |")
        else:
            L.append(f"{sy['status']}" + (f": {sy['reason']}" if sy.get("reason") else ""))
        L.append("")
    tags = im.get("tags") or {}
    if tags:
        L += ["### Tags", ""]
        for t in ("local", "previous", "candidate"):
            v = tags.get(t)
            L.append(f"- `{im['image']}:{t}`: " + (f"build {v.get('build_id') or '-'}, identity "
                                                   f"{str(v.get('identity'))[:19]}" if v else "none"))
        L.append("")
    ch = im.get("changes")
    L += ["### What changed in the image", ""]
    if ch:
        L += [render_diff(ch), ""]
    else:
        L += [im.get("changes_note") or "no previous :local to compare with", ""]
    return L


def _cell(text) -> str:
    return str(text or "").replace("|", "\\|").replace("\n", " ")[:200]
