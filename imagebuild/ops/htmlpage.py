"""The nightly history as one static HTML page (``imagebuild report --html``; the nightly writes
``<run id>.html`` beside the Markdown; docs/nightly.md, "History").

Self-contained: the charts are inline SVG drawn here (no script at all, no font, style sheet or
image fetched), so the page reads the same from an artifact, a mail or a disk with no network.
Per image: the stages' times per night (stacked; a night that was not good is marked), the image
size (its axis spans the sizes), the cache hit rate (0 % drawn, no data said), the gate's results
and streak, a table of the nights (newest first: links to each night's report and failed log,
build and sync times, what moved upstream and what changed in the image, a failed gate check's
found and expected values, links from PR numbers and SHAs to their pages on the forge when the
source is an http(s) URL), and tonight's details (steps, stages, the failing step's exit code and
log tail). Every x label is the night's date and start time (UTC). At phone width each chart and
table scrolls in its own box, a chart's box opening at its right end (the newest nights).
"""

from __future__ import annotations

import html
import math
import os
import re
import urllib.parse
from pathlib import Path

from imagebuild.core.errors import excerpt
from imagebuild.ops import history as hist
from imagebuild.ops.imagediff import human

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac")
W, H = 720, 260  # one chart's size in CSS pixels
ML, MR, MT, MB = 72, 56, 26, 60  # margins: left (the y axis and its title), right (its ticks again), top, bottom
GATE_COLOUR = {"passed": "#59a14f", "failed": "#e15759"}
FAILED_BAND = "#fbdfe0"  # behind a failed night's bar
FAILED_MARK = "#c62828"  # its cross; a 0 % rate's line

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:1.5em}h2{font-size:1.25em;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:2em}
h3{font-size:1.05em;margin-top:1.5em}
figure{margin:12px 16px 12px 0;display:inline-block;vertical-align:top;max-width:100%}
figcaption{font-weight:600;margin-bottom:4px}
.scroll{overflow-x:auto;max-width:100%;direction:rtl}.scroll>*{direction:ltr}svg.chart{display:block}
.table-scroll{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;margin:8px 0;font-size:.9em}th,td{border:1px solid #ddd;padding:3px 8px;text-align:left}
th{background:#f4f4f4}td.num{text-align:right}pre{background:#f6f6f6;padding:8px;overflow-x:auto;font-size:.85em}
.ok{color:#2e7d32}.bad{color:#c62828}.muted{color:#777}.legend span{display:inline-block;margin-right:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px}
svg text{font-size:11px;fill:#444}svg text.failed-mark{fill:#c62828;font-size:13px}svg text.axis-title{fill:#222}
svg text.zero-label{fill:#c62828}svg text.nodata{fill:#999}
@media (max-width:600px){body{margin:8px}}
"""


def esc(x) -> str:
    return html.escape("" if x is None else str(x), quote=True)


# --------------------------------------------------------------------------------------------- links


def web_base(repo: str | None) -> str | None:
    """A source's web page from its git URL (http(s) only; ``.git`` and credentials dropped)."""
    if not repo or not re.match(r"^https?://[^\s\"'<>]+$", repo):
        return None
    base = re.sub(r"(?<=://)[^/@]+@", "", repo).rstrip("/")
    return base[:-4] if base.endswith(".git") else base


def pr_url(repo: str | None, number) -> str | None:
    base = web_base(repo)
    if base is None:
        return None
    # GitHub: /pull/N; the Gitea family (Gitea, Forgejo): /pulls/N
    return f"{base}/pull/{number}" if "://github.com/" in base + "/" else f"{base}/pulls/{number}"


def compare_url(repo: str | None, a: str, b: str) -> str | None:
    base = web_base(repo)
    return f"{base}/compare/{a}...{b}" if base else None


def commit_url(repo: str | None, sha: str | None) -> str | None:
    base = web_base(repo)
    return f"{base}/commit/{sha}" if base and sha else None


def link(url: str | None, text: str) -> str:
    return f'<a href="{esc(url)}">{esc(text)}</a>' if url else esc(text)


# --------------------------------------------------------------------------------------------- charts
#
# Each chart is one fixed-size SVG (``W`` x ``H`` CSS pixels, a viewBox) drawn by ``_frame``: the
# plot, the y axis with its ticks and title, one x label per night (date and time, UTC) and the
# x axis title. A chart is put on the page by ``figure`` (a caption and a horizontal scroll box
# that opens at its right end, the newest nights, on a narrow screen). A new chart: a function that
# returns ``_frame(...)``, and one ``figure(...)`` call in ``_image_section``.


def nice_ticks(lo: float, hi: float, *, zero: bool = True, n: int = 4) -> list[float]:
    """Round tick values covering [lo, hi] (about ``n`` steps of 1, 2, 2.5 or 5 x 10^k): from 0 when
    ``zero``, else from just under ``lo``, so a small change fills the plot instead of a few pixels."""
    if zero:
        lo = min(lo, 0.0)
    if hi <= lo:  # one value (or none): a little room on each side
        pad = abs(lo) * 0.01 or 1.0
        lo, hi = (lo, lo + pad) if zero else (lo - pad, lo + pad)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    first = math.floor(lo / step + 1e-9) * step
    ticks = [first]
    while ticks[-1] < hi - step * 1e-9:
        ticks.append(first + step * len(ticks))
    return [round(t, 10) for t in ticks] if len(ticks) > 1 else [first, first + step]


def _nice(v: float) -> float:
    """A round upper bound for an axis from 0."""
    return nice_ticks(0.0, v)[-1]


def night_labels(rows: list[dict]) -> list[tuple[str, str]]:
    """Each night's x label, two lines: the date (``11-20``) and the start time (``02:17`` UTC),
    from the run id; seconds added, then the run id's tail, where two runs would still look alike."""
    def parts(run_id: str, fine: int) -> tuple[str, str]:
        if len(run_id) < 15 or run_id[8] != "T":
            return run_id[:10], run_id[10:20]
        t = f"{run_id[9:11]}:{run_id[11:13]}" + (f":{run_id[13:15]}" if fine else "")
        return f"{run_id[4:6]}-{run_id[6:8]}", t + (f" {run_id.rsplit('-', 1)[-1][:6]}" if fine > 1 else "")

    labels = [parts(r["run_id"], 0) for r in rows]
    for fine in (1, 2):
        dup = {lab for lab in labels if labels.count(lab) > 1}
        labels = [parts(r["run_id"], fine) if lab in dup else lab for r, lab in zip(rows, labels, strict=True)]
    return labels


def _lab(label) -> str:
    return " ".join(label) if isinstance(label, tuple) else str(label)


def _x(i: int, n: int) -> float:
    return ML + (W - ML - MR) * (i + 0.5) / max(n, 1)


def _frame(kind: str, title: str, labels: list, ticks: list[float], yfmt, body: list[str], *,
           ytitle: str = "", under: list[str] = ()) -> str:
    """The SVG around ``body``: ``under`` is drawn first (behind the grid, e.g. a failed night's band)."""
    pw, ph = W - ML - MR, H - MT - MB
    out = [f'<svg class="chart" data-chart="{esc(kind)}" data-nights="{len(labels)}" xmlns="http://www.w3.org/2000/svg" '
           f'width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img" aria-label="{esc(title)}">',
           f"<title>{esc(title)}</title>",
           f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="#fff" stroke="#ccc"/>', *under]
    lo, hi = ticks[0], ticks[-1]
    for v in ticks:
        y = MT + ph - ph * (v - lo) / (hi - lo)
        out.append(f'<line x1="{ML}" y1="{y:.1f}" x2="{ML + pw}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text class="ytick" x="{ML - 6}" y="{y + 4:.1f}" text-anchor="end">{esc(yfmt(v))}</text>')
        # again on the right: on a narrow screen the box opens at the newest nights, the left axis out of sight
        out.append(f'<text class="ytick" x="{ML + pw + 6}" y="{y + 4:.1f}">{esc(yfmt(v))}</text>')
    if ytitle:
        out.append(f'<text class="axis-title" transform="translate(12 {MT + ph / 2:.1f}) rotate(-90)" '
                   f'text-anchor="middle">{esc(ytitle)}</text>')
    step = max(1, math.ceil(len(labels) / 14))
    for i, lab in enumerate(labels):
        if (len(labels) - 1 - i) % step == 0:  # the newest night always has its label
            x = _x(i, len(labels))
            day, time = lab if isinstance(lab, tuple) else (lab, "")
            out.append(f'<text class="xlab" x="{x:.1f}" y="{H - MB + 15}" text-anchor="middle">{esc(day)}'
                       f'<tspan x="{x:.1f}" dy="12">{esc(time)}</tspan></text>')
    out.append(f'<text class="axis-title" x="{ML + pw}" y="{H - 6}" text-anchor="end">'
               "night (start, UTC)</text>")
    return "\n".join(out + body + ["</svg>"])


def _y(v: float, ticks: list[float]) -> float:
    ph = H - MT - MB
    return MT + ph - ph * (v - ticks[0]) / (ticks[-1] - ticks[0])


def failed_marks(labels: list, failed: list[str | None] | None) -> tuple[list[str], list[str]]:
    """A night that was not good (``failed[i]``, its status): a red band behind its slot (drawn
    under the grid) and a red cross above the plot (drawn on top); with the status in their tooltips."""
    pw, ph, n = W - ML - MR, H - MT - MB, max(len(labels), 1)
    under, over = [], []
    for i, status in enumerate(failed or []):
        if not status:
            continue
        tip = f"<title>{esc(_lab(labels[i]))}: {esc(status)}</title>"
        under.append(f'<rect class="failed-night" x="{ML + pw * (i + 0.05) / n:.1f}" y="{MT - 20}" '
                     f'width="{pw * 0.9 / n:.1f}" height="{ph + 20}" fill="{FAILED_BAND}">{tip}</rect>')
        over.append(f'<text class="failed-mark" x="{_x(i, n):.1f}" y="{MT - 8}" text-anchor="middle" '
                    f'fill="{FAILED_MARK}" font-weight="bold">\u2715{tip}</text>')
    return under, over


def stacked_bars(kind: str, title: str, labels: list, series: list[str], values: list[dict[str, float]],
                 yfmt, tips: list[str] | None = None, *, ytitle: str = "",
                 failed: list[str | None] | None = None) -> str:
    """Stacked bars, one per night; ``failed[i]`` (a status) marks night i as not good: a red band
    behind its bar and a red cross above it, so a failed night never reads as a fast good one."""
    pw, ph = W - ML - MR, H - MT - MB
    top = max((sum(v.values()) for v in values), default=0.0)
    # seconds: ticks at round minutes (or hours) past two minutes
    unit = 3600 if top >= 3 * 3600 else 60 if top >= 120 else 1
    ticks = [t * unit for t in nice_ticks(0.0, top / unit)]
    n = max(len(labels), 1)
    bw = pw / n * 0.7
    under, body = failed_marks(labels, failed)
    for i, v in enumerate(values):
        x = ML + pw * i / n + (pw / n - bw) / 2
        y = MT + ph
        for j, name in enumerate(series):
            val = v.get(name) or 0.0
            if val <= 0:
                continue
            h = ph * val / ticks[-1]
            y -= h
            body.append(f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{bw:.1f}" height="{max(h, 0.5):.1f}" '
                        f'fill="{PALETTE[j % len(PALETTE)]}"><title>{esc(_lab(labels[i]))} {esc(name)}: '
                        f'{esc(yfmt(val))}{esc(tips[i]) if tips else ""}</title></rect>')
    return _frame(kind, title, labels, ticks, yfmt, body, ytitle=ytitle, under=under)


def rate_bars(kind: str, title: str, labels: list, rates: list[float | None], *, ytitle: str = "hit rate") -> str:
    """One bar per night for a rate in [0, 1]. A 0 % night is drawn (a red line on the axis and
    ``0%``); a night with no data (nothing looked up) shows a grey ``n/a``: the two never look alike."""
    pw = W - ML - MR
    ticks = [0.0, 0.25, 0.5, 0.75, 1.0]
    n = max(len(labels), 1)
    bw = pw / n * 0.7
    base = _y(0.0, ticks)
    body = []
    for i, v in enumerate(rates):
        x, cx = ML + pw * i / n + (pw / n - bw) / 2, _x(i, n)
        tip = f"{esc(_lab(labels[i]))}: " + ("no data" if v is None else f"{round(v * 100)}%")
        if v is None:
            body.append(f'<text class="nodata" x="{cx:.1f}" y="{base - 4:.1f}" text-anchor="middle" fill="#999">'
                        f"n/a<title>{tip}</title></text>")
        elif v <= 0:
            body.append(f'<rect class="zero" x="{x:.1f}" y="{base - 3:.1f}" width="{bw:.1f}" height="3" '
                        f'fill="{FAILED_MARK}"><title>{tip}</title></rect>')
            body.append(f'<text class="zero-label" x="{cx:.1f}" y="{base - 6:.1f}" text-anchor="middle">0%</text>')
        else:
            y = _y(min(v, 1.0), ticks)
            body.append(f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{bw:.1f}" height="{base - y:.1f}" '
                        f'fill="{PALETTE[0]}"><title>{tip}</title></rect>')
    return _frame(kind, title, labels, ticks, lambda r: f"{round(r * 100)}%", body, ytitle=ytitle)


def line(kind: str, title: str, labels: list, values: list[float | None], yfmt, *, zero: bool = True,
         ytitle: str = "", tipfmt=None, failed: list[str | None] | None = None) -> str:
    """A line through the nights' values; ``zero=False``: the axis spans the values, not from 0."""
    tipfmt = tipfmt or yfmt
    have = [v for v in values if v is not None]
    ticks = nice_ticks(min(have, default=0.0), max(have, default=0.0), zero=zero)
    n = max(len(labels), 1)
    pts = [(_x(i, n), _y(v, ticks), v, labels[i]) for i, v in enumerate(values) if v is not None]
    under, body = failed_marks(labels, failed)
    if len(pts) > 1:
        body.append('<polyline fill="none" stroke="#4e79a7" stroke-width="2" points="'
                    + " ".join(f"{x:.1f},{y:.1f}" for x, y, _, _ in pts) + '"/>')
    for x, y, v, lab in pts:
        body.append(f'<circle class="point" cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="#4e79a7">'
                    f"<title>{esc(_lab(lab))}: {esc(tipfmt(v))}</title></circle>")
    return _frame(kind, title, labels, ticks, yfmt, body, ytitle=ytitle, under=under)


def size_axis(values: list[float | None]) -> tuple[str, float, object]:
    """The size axis: its unit (GiB, MiB or KiB, as the tables' sizes), the unit's bytes and a tick
    format (of values in that unit) with enough decimals that neighbouring ticks differ."""
    have = [v for v in values if v]
    top = max(have, default=1.0)
    unit, div = next(((u, d) for u, d in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)) if top >= d),
                     ("B", 1))
    t = nice_ticks(min(have, default=0.0) / div, top / div, zero=False)
    dec = max(0, min(4, -math.floor(math.log10(t[1] - t[0]))))
    return unit, div, (lambda v: f"{v:.{dec}f}")


def figure(caption: str, svg: str, extra: str = "") -> list[str]:
    """A chart on the page: its caption, the SVG in a scroll box, then ``extra`` (a legend)."""
    return [f"<figure><figcaption>{caption}</figcaption>", f'<div class="scroll">{svg}</div>', extra, "</figure>"]


def gate_strip(labels: list[str], results: list[str | None]) -> str:
    """One square per night: green passed, red failed, grey not gated (or no image)."""
    size, gap = 18, 4
    width = max(ML + len(labels) * (size + gap) + MR, 200)
    out = [f'<svg class="chart" data-chart="gate" data-nights="{len(labels)}" xmlns="http://www.w3.org/2000/svg" '
           f'width="{width}" height="{size + 30}" viewBox="0 0 {width} {size + 30}" role="img" '
           f'aria-label="gate results per night">', "<title>gate results per night</title>"]
    for i, (lab, r) in enumerate(zip(labels, results, strict=True)):
        x = ML + i * (size + gap)
        out.append(f'<rect class="gate-{esc(r or "none")}" x="{x}" y="4" width="{size}" height="{size}" rx="3" '
                   f'fill="{GATE_COLOUR.get(r or "", "#bbb")}"><title>{esc(_lab(lab))}: {esc(r or "not gated")}</title></rect>')
    out.append(f'<text x="0" y="{size}">gate</text>')
    return "\n".join(out + ["</svg>"])


def streak(results: list[str | None]) -> str:
    """How the latest nights went: ``3 passed in a row`` (or failed)."""
    gated = [r for r in results if r in ("passed", "failed")]
    if not gated:
        return "no night was gated"
    last = gated[-1]
    n = 0
    for r in reversed(gated):
        if r != last:
            break
        n += 1
    return f"{n} {last} in a row"


# --------------------------------------------------------------------------------------------- links to files


def night_links(rows: list[dict], reports: list[tuple[Path, dict]], root: Path, page_dir: Path) -> dict[str, dict]:
    """Per run id, relative links (from ``page_dir``, where the page is written) to that night's
    report (``.md``, ``.json``, its own ``.html``) while the reports' retention keeps it, and to its
    failed stages' logs (paths in the report are relative to the project ``root``) while they exist.
    ``reports``: (the report's JSON path, its document)."""
    def rel(p: Path) -> str:
        r = Path(os.path.relpath(Path(p).resolve(), Path(page_dir).resolve())).as_posix()
        # a URL path: '#', '?', '%' and spaces encoded; a first segment with ':' never read as a scheme
        return ("./" if ":" in r.split("/")[0] else "") + urllib.parse.quote(r, safe="/:@-._~!$&'()*+,;=")

    out: dict[str, dict] = {}
    # a kept report is read as it is (a hand-edited one too): only the values of the right type count
    docs = {doc.get("run_id"): (Path(jp), doc) for jp, doc in reports
            if isinstance(doc, dict) and isinstance(doc.get("run_id"), str)}
    for r in rows:
        run = r["run_id"]
        d = out.setdefault(run, {"report": {}, "logs": {}})
        jp, doc = docs.get(run, (None, None))
        if jp is not None:
            for ext in ("md", "json", "html"):
                if jp.with_suffix("." + ext).is_file():
                    d["report"][ext] = rel(jp.with_suffix("." + ext))
        logs = [(r.get("failure") or {}).get("log")]
        images = (doc or {}).get("images")
        logs += [(i.get("failure") or {}).get("log") for i in (images if isinstance(images, list) else [])
                 if isinstance(i, dict) and i.get("image") == r["image"] and isinstance(i.get("failure"), dict)]
        for log in logs:
            if isinstance(log, str) and log and _is_file(Path(root) / log):
                d["logs"].setdefault(r["image"], rel(Path(root) / log))
    return out


def _is_file(p: Path) -> bool:
    try:  # a hand-edited path may be too long, or hold a NUL
        return p.is_file()
    except (OSError, ValueError):
        return False


def found_expected(detail: str | None) -> list[tuple[str, str]]:
    """A gate check's detail split into what was found and what was expected, per problem (a check
    joins several with ``; ``), where its wording says (``X is 'a', expected 'b'``, ``..., expected
    at least 3``, ``vllm 0.1 does not satisfy >=0.2``); otherwise the problem is what was found."""
    out = []
    for part in str(detail or "").split("; "):
        m = re.match(r"(?s)^(.*?),? expected (.+)$", part)
        if m and m.group(1):
            out.append((m.group(1), m.group(2)))
            continue
        m = re.match(r"(?s)^(.*) does not satisfy (.+)$", part)
        out.append((m.group(1), m.group(2)) if m else (part, ""))
    return out


# --------------------------------------------------------------------------------------------- the page


def _changed_cell(ch: dict | None) -> str:
    if not ch:
        return "-"
    if ch.get("same_image"):
        return "same image"
    parts = []
    for name in ("pins", "patches", "pip", "dpkg"):
        c = ch.get(name)
        if c and c.get("n"):
            more = c["n"] - len(c.get("items") or [])
            parts.append(f"<b>{name}</b> ({c['n']}): " + esc(", ".join(c.get("items") or []))
                         + (f" (+{more} more)" if more > 0 else ""))
    return "<br>".join(parts) or "nothing listed"


def _gate_cell(g: dict | None) -> str:
    text = esc(hist.gate_cell(g))
    for c in (g or {}).get("failed_checks") or []:
        text += f'<br><span class="bad">{esc(c.get("id"))}</span>: ' + "; ".join(
            f"found <code>{esc(found)}</code>" + (f", expected <code>{esc(want)}</code>" if want else "")
            for found, want in found_expected(c.get("detail")))
    return text


def _links_cell(d: dict | None, image: str) -> str:
    d = d or {}
    parts = [f'<a href="{esc(u)}">{esc(ext)}</a>' for ext, u in (d.get("report") or {}).items()]
    log = (d.get("logs") or {}).get(image)
    if log:
        parts.append(f'<a class="log" href="{esc(log)}">failed log</a>')
    return " · ".join(parts) or '<span class="muted">pruned</span>'


def _image_section(image: str, rows: list[dict], tonight: dict | None, links: dict[str, dict] | None) -> list[str]:
    labels = night_labels(rows)
    names = hist.stage_names(rows)
    times = [{st["name"]: float(st["seconds"]) for st in r.get("stages") or []
              if st.get("seconds") is not None and st.get("cache") != "hit"} for r in rows]
    sizes = [float(r["size"]) if r.get("size") else None for r in rows]
    rates = [(r.get("cache") or {}).get("rate") for r in rows]
    ccrates = [(r.get("compiler_cache") or {}).get("rate") for r in rows]
    gates = [(r.get("gate") or {}).get("result") for r in rows]
    bad = [None if r.get("status") == "ok" else str(r.get("status")) for r in rows]
    unit, div, sfmt = size_axis(sizes)
    L = [f'<section class="image" id="{esc(image)}">', f"<h2>{esc(image)}</h2>",
         f'<p>{len(rows)} night(s), {esc(_lab(labels[0]))} to {esc(_lab(labels[-1]))} (UTC); the gate\'s '
         f'streak: {esc(streak(gates))} (of the nights gated).</p>']
    legend = "".join(f'<span><i style="background:{PALETTE[j % len(PALETTE)]}"></i>{esc(n)}</span>'
                     for j, n in enumerate(names)) + \
        f'<span><i style="background:{FAILED_BAND};border:1px solid {FAILED_MARK}"></i>not a good night (\u2715)</span>'
    L += figure("Stage times per night (built stages; a cached stage takes no time)",
                stacked_bars("stage-times", f"{image}: stage times per night", labels, names, times, hist.secs,
                             ytitle="build time", failed=bad), f'<div class="legend">{legend}</div>')
    L += figure(f"Image size ({unit}; the axis spans the sizes, it does not start at 0)",
                line("size", f"{image}: image size per night", labels,
                     [None if v is None else v / div for v in sizes], sfmt, zero=False,
                     ytitle=f"image size ({unit})", tipfmt=lambda v: human(int(v * div)), failed=bad))
    L += figure("Cache hit rate (stages from the stage store; n/a: nothing looked up)",
                rate_bars("hit-rate", f"{image}: cache hit rate per night", labels, rates))
    if any(v is not None for v in ccrates):  # a stage compiled through imagebuild's compiler cache
        L += figure("Compiler-cache hit rate (objects from imagebuild's compiler cache, stages that compiled)",
                    rate_bars("compiler-hit-rate", f"{image}: compiler-cache hit rate per night", labels, ccrates))
    L += figure(f"Gate results: {esc(streak(gates))}", gate_strip(labels, gates))
    L += ["<h3>Nights (newest first)</h3>", '<div class="table-scroll"><table class="nights"><tr><th>night (UTC)</th>'
          "<th>status</th><th>report</th><th>time</th><th>build</th><th>sync</th><th>size</th><th>hits</th>"
          "<th>gate</th><th>moved upstream</th><th>changed in the image</th><th>pull requests</th></tr>"]
    for r, lab in reversed(list(zip(rows, labels, strict=True))):
        rate = (r.get("cache") or {}).get("rate")
        f = r.get("failure") or {}
        status = esc(r.get("status")) + (f" (stage {esc(f.get('stage'))}, RUN exit {esc(f['exit_code'])})"
                                         if f.get("exit_code") is not None else "")
        moved = "<br>".join(f"{esc(m['source'])} {esc(m['what'])}: "
                            + link(compare_url(m.get("repo"), m["from"], m["to"]),
                                   f"{str(m['from'])[:7]}...{str(m['to'])[:7]}") for m in r.get("moved") or [])
        prs = "<br>".join(link(pr_url(p.get("repo"), p["number"]), f"{p['source']} #{p['number']}") + " "
                          + link(commit_url(p.get("repo"), p.get("head")), str(p.get("head") or "-")[:7])
                          + (f" ({esc(p['state'])})" if p.get("state") else "") for p in r.get("pull_requests") or [])
        steps = r.get("steps") or {}
        cls = "ok" if r.get("status") == "ok" else "bad"
        L.append(f'<tr><td title="{esc(r["run_id"])}">{esc(_lab(lab))}<br><span class="muted">build '
                 f'{esc(r.get("build_id") or "-")}</span></td><td class="{cls}">{status}</td>'
                 f'<td>{_links_cell((links or {}).get(r["run_id"]), r["image"])}</td>'
                 f'<td class="num">{esc(hist.secs(r.get("seconds")))}</td>'
                 f'<td class="num">{esc(hist.secs(steps.get("build")))}</td>'
                 f'<td class="num">{esc(hist.secs(steps.get("sync")))}</td>'
                 f'<td class="num">{esc(human(r["size"]) if r.get("size") else "-")}</td>'
                 f'<td class="num">{"n/a" if rate is None else f"{round(rate * 100)}%"}</td>'
                 f'<td>{_gate_cell(r.get("gate"))}</td><td>{moved or "-"}</td>'
                 f'<td>{_changed_cell(r.get("changed"))}</td><td>{prs or "-"}</td></tr>')
    L.append("</table></div>")
    if tonight is not None:
        try:
            logs = (((links or {}).get(tonight.get("run_id") or "") or {}).get("logs") or {}).get(image)
            L += _tonight(tonight, logs)
        except (KeyError, TypeError, AttributeError, ValueError, IndexError, ArithmeticError) as exc:  # hand-edited
            L.append(f'<p class="bad">Tonight\'s details of {esc(image)} are not shown: the report is not one this '
                     f"version can read ({esc(type(exc).__name__)}: {esc(excerpt(str(exc)))}).</p>")
    return L + ["</section>"]


def _table(head: list[str], rows: list[str]) -> list[str]:
    return ['<div class="table-scroll"><table><tr>' + "".join(f"<th>{h}</th>" for h in head) + "</tr>",
            *rows, "</table></div>"]


def _tonight(im: dict, log_link: str | None = None) -> list[str]:
    L = [f"<h3>Tonight: {esc(im.get('status'))}</h3>"]
    if im.get("reason"):
        L.append(f"<p><b>Why:</b> {esc(im['reason'])}</p>")
    f = im.get("failure")
    if f:
        if f.get("stage"):
            log = ""
            if f.get("log"):
                log = f"; full log <code>{esc(f['log'])}</code>" + (
                    f' (<a class="log" href="{esc(log_link)}">open</a>)' if log_link else "")
            L.append(f"<p>Failed stage <code>{esc(f['stage'])}</code>"
                     + (f": <code>{esc(f.get('command'))}</code> exited with <b>RUN exit {esc(f['exit_code'])}</b>"
                        f" (exit code {esc(f['exit_code'])})" if f.get("exit_code") is not None else "")
                     + log + ".</p>")
        for p in f.get("problems") or []:
            L.append(f"<p><code>{esc(p['file'])}:{esc(p.get('line') or '')}</code> {esc(p['message'])}</p>")
        if f.get("tail"):
            L.append('<pre class="log-tail">' + esc("\n".join(f["tail"])) + "</pre>")
    steps = im.get("steps") or {}
    if steps:
        L += _table(["step", "result", "time", "detail"],
                    [f"<tr><td>{name}</td><td>{esc(s.get('status'))}</td><td class=\"num\">"
                     f"{esc(hist.secs(s.get('seconds')))}</td><td>{esc(s.get('detail'))}</td></tr>"
                     for name in ("prefetch", "build", "gate", "promote", "sync") if (s := steps.get(name))])
    if im.get("stages"):
        L += _table(["stage", "cache", "status", "time"],
                    [f"<tr><td>{esc(s['name'])}</td><td>{esc(s.get('cache'))}</td><td>{esc(s.get('status'))}</td>"
                     f"<td class=\"num\">{esc(hist.secs(s.get('seconds')))}</td></tr>" for s in im["stages"]])
    g = im.get("gate")
    if g and g.get("checks"):
        rows = []
        for c in g["checks"]:
            res = str(c.get("outcome")).upper() + (" (GPU)" if c.get("requires_gpu") else "")
            pairs = found_expected(c.get("detail")) if c.get("outcome") == "failed" else [(c.get("detail"), "")]
            rows.append(f"<tr><td>{esc(c.get('id'))}</td><td class=\"{'bad' if c.get('outcome') == 'failed' else ''}\">"
                        f"{esc(res)}</td><td>{'<br>'.join(esc(f) for f, _ in pairs)}</td>"
                        f"<td>{'<br>'.join(esc(w) for _, w in pairs)}</td></tr>")
        L += _table(["check", "result", "found", "expected"], rows)
    return L


def render(rows: list[dict], tonight: dict | None = None, *, title: str = "imagebuild nightly history",
           links: dict[str, dict] | None = None) -> str:
    """The page for ``rows`` (history lines, oldest first) and, when given, a report's details;
    ``links``: per run id, relative links to its report and failed logs (``night_links``)."""
    images = list(dict.fromkeys(r["image"] for r in rows))
    if not isinstance(tonight, dict):
        tonight = None
    listed = (tonight or {}).get("images")
    by_image = {i.get("image"): i for i in (listed if isinstance(listed, list) else [])
                if isinstance(i, dict) and isinstance(i.get("image"), str)}
    L = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
         '<meta name="viewport" content="width=device-width, initial-scale=1">',
         # nothing is loaded from anywhere: no script, no remote style, font or image
         "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
         "img-src data:\">",
         f"<title>{esc(title)}</title>", f"<style>{CSS}</style></head><body>", f"<h1>{esc(title)}</h1>"]
    if tonight is not None:
        L.append(f"<p>Tonight: run <code>{esc(tonight.get('run_id'))}</code> on {esc(tonight.get('host'))}: "
                 f"<b class=\"{'ok' if tonight.get('status') == 'ok' else 'bad'}\">{esc(tonight.get('status'))}</b> "
                 f"(exit {esc(tonight.get('exit_code'))}), {esc(tonight.get('started'))} to "
                 f"{esc(tonight.get('finished'))}.</p>")
    if not images:
        L.append("<p>No nights in the history yet.</p>")
    else:
        L.append("<p>" + " · ".join(f'<a href="#{esc(i)}">{esc(i)}</a>' for i in images) + "</p>")
    for image in images:
        L += _image_section(image, [r for r in rows if r["image"] == image], by_image.get(image), links)
    L.append("</body></html>")
    return "\n".join(L) + "\n"
