"""The nightly history as one static HTML page (``imagebuild report --html``; the nightly writes
``<run id>.html`` beside the Markdown; docs/nightly.md, "History").

Self-contained: the charts are inline SVG drawn here (no script at all, no font, style sheet or
image fetched), so the page reads the same from an artifact, a mail or a disk with no network.
Per image: the stages' times per night (stacked), the image size, the cache hit rate, the gate's
results and streak, a table of the nights with links from PR numbers and SHAs to their pages on
the forge (when the source is an http(s) URL), and tonight's details (steps, stages, the failing
step's exit code and log tail).
"""

from __future__ import annotations

import html
import re

from imagebuild.ops import history as hist
from imagebuild.ops.imagediff import human

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac")
W, H = 720, 240  # one chart's size in CSS pixels
ML, MR, MT, MB = 64, 16, 16, 44  # margins: left (the y axis), right, top, bottom (the nights)
GATE_COLOUR = {"passed": "#59a14f", "failed": "#e15759"}

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:1.5em}h2{font-size:1.25em;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:2em}
h3{font-size:1.05em;margin-top:1.5em}
figure{margin:12px 0;display:inline-block;vertical-align:top}figcaption{font-weight:600;margin-bottom:4px}
table{border-collapse:collapse;margin:8px 0;font-size:.9em}th,td{border:1px solid #ddd;padding:3px 8px;text-align:left}
th{background:#f4f4f4}td.num{text-align:right}pre{background:#f6f6f6;padding:8px;overflow-x:auto;font-size:.85em}
.ok{color:#2e7d32}.bad{color:#c62828}.muted{color:#777}.legend span{display:inline-block;margin-right:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px}
svg text{font-size:11px;fill:#444}
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


def _nice(v: float) -> float:
    """A round upper bound for an axis."""
    if v <= 0:
        return 1.0
    mag = 10 ** len(str(int(v))) / 10 if v >= 1 else 1.0
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * mag:
            return m * mag
    return 10 * mag


def _frame(kind: str, title: str, labels: list[str], ymax: float, yfmt, body: list[str]) -> str:
    pw, ph = W - ML - MR, H - MT - MB
    out = [f'<svg class="chart" data-chart="{esc(kind)}" data-nights="{len(labels)}" xmlns="http://www.w3.org/2000/svg" '
           f'width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img" aria-label="{esc(title)}">',
           f"<title>{esc(title)}</title>",
           f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="#fff" stroke="#ccc"/>']
    for i in range(5):
        v = ymax * i / 4
        y = MT + ph - ph * i / 4
        out.append(f'<line x1="{ML}" y1="{y:.1f}" x2="{ML + pw}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{ML - 6}" y="{y + 4:.1f}" text-anchor="end">{esc(yfmt(v))}</text>')
    step = max(1, len(labels) // 12)
    for i, lab in enumerate(labels):
        if i % step == 0 or i == len(labels) - 1:
            x = ML + pw * (i + 0.5) / max(len(labels), 1)
            out.append(f'<text x="{x:.1f}" y="{H - MB + 16}" text-anchor="middle">{esc(lab)}</text>')
    return "\n".join(out + body + ["</svg>"])


def stacked_bars(kind: str, title: str, labels: list[str], series: list[str], values: list[dict[str, float]],
                 yfmt, tips: list[str] | None = None) -> str:
    pw, ph = W - ML - MR, H - MT - MB
    ymax = _nice(max((sum(v.values()) for v in values), default=0.0))
    n = max(len(labels), 1)
    bw = pw / n * 0.7
    body = []
    for i, v in enumerate(values):
        x = ML + pw * i / n + (pw / n - bw) / 2
        y = MT + ph
        for j, name in enumerate(series):
            val = v.get(name) or 0.0
            if val <= 0:
                continue
            h = ph * val / ymax
            y -= h
            body.append(f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{bw:.1f}" height="{max(h, 0.5):.1f}" '
                        f'fill="{PALETTE[j % len(PALETTE)]}"><title>{esc(labels[i])} {esc(name)}: '
                        f'{esc(yfmt(val))}{esc(tips[i]) if tips else ""}</title></rect>')
    return _frame(kind, title, labels, ymax, yfmt, body)


def line(kind: str, title: str, labels: list[str], values: list[float | None], yfmt) -> str:
    pw, ph = W - ML - MR, H - MT - MB
    ymax = _nice(max((v for v in values if v is not None), default=0.0))
    n = max(len(labels), 1)
    pts = [(ML + pw * (i + 0.5) / n, MT + ph - ph * v / ymax, v, labels[i]) for i, v in enumerate(values)
           if v is not None]
    body = []
    if len(pts) > 1:
        body.append('<polyline fill="none" stroke="#4e79a7" stroke-width="2" points="'
                    + " ".join(f"{x:.1f},{y:.1f}" for x, y, _, _ in pts) + '"/>')
    for x, y, v, lab in pts:
        body.append(f'<circle class="point" cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="#4e79a7">'
                    f"<title>{esc(lab)}: {esc(yfmt(v))}</title></circle>")
    return _frame(kind, title, labels, ymax, yfmt, body)


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
                   f'fill="{GATE_COLOUR.get(r or "", "#bbb")}"><title>{esc(lab)}: {esc(r or "not gated")}</title></rect>')
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


# --------------------------------------------------------------------------------------------- the page


def _label(run_id: str) -> str:
    return f"{run_id[4:6]}-{run_id[6:8]}" if len(run_id) >= 8 else run_id


def _image_section(image: str, rows: list[dict], tonight: dict | None) -> list[str]:
    labels = [_label(r["run_id"]) for r in rows]
    names = hist.stage_names(rows)
    times = [{st["name"]: float(st["seconds"]) for st in r.get("stages") or []
              if st.get("seconds") is not None and st.get("cache") != "hit"} for r in rows]
    sizes = [float(r["size"]) if r.get("size") else None for r in rows]
    rates = [{"hit rate": float(r["cache"]["rate"])} if (r.get("cache") or {}).get("rate") is not None else {}
             for r in rows]
    gates = [(r.get("gate") or {}).get("result") for r in rows]
    L = [f'<section class="image" id="{esc(image)}">', f"<h2>{esc(image)}</h2>",
         f'<p>{len(rows)} night(s), {esc(rows[0]["run_id"][:8])} to {esc(rows[-1]["run_id"][:8])}; the gate\'s '
         f'streak: {esc(streak(gates))} (of the nights gated).</p>']
    legend = "".join(f'<span><i style="background:{PALETTE[j % len(PALETTE)]}"></i>{esc(n)}</span>'
                     for j, n in enumerate(names))
    L += ["<figure><figcaption>Stage times per night (built stages; a cached stage takes no time)</figcaption>",
          stacked_bars("stage-times", f"{image}: stage times per night", labels, names, times, hist.secs),
          f'<div class="legend">{legend}</div></figure>',
          "<figure><figcaption>Image size</figcaption>",
          line("size", f"{image}: image size per night", labels, sizes, lambda v: human(int(v)) if v else "0"),
          "</figure>",
          "<figure><figcaption>Cache hit rate (stages from the stage store)</figcaption>",
          stacked_bars("hit-rate", f"{image}: cache hit rate per night", labels, ["hit rate"],
                       rates, lambda v: f"{round(v * 100)}%"),
          "</figure>",
          f"<figure><figcaption>Gate results: {esc(streak(gates))}</figcaption>", gate_strip(labels, gates),
          "</figure>"]
    L += ["<h3>Nights</h3>", "<table><tr><th>night</th><th>status</th><th>time</th><th>size</th><th>hits</th>"
          "<th>gate</th><th>moved upstream</th><th>pull requests</th></tr>"]
    for r in reversed(rows):
        rate = (r.get("cache") or {}).get("rate")
        f = r.get("failure") or {}
        status = esc(r.get("status")) + (f" (stage {esc(f.get('stage'))}, exit {esc(f['exit_code'])})"
                                         if f.get("exit_code") is not None else "")
        moved = "<br>".join(f"{esc(m['source'])} {esc(m['what'])}: "
                            + link(compare_url(m.get("repo"), m["from"], m["to"]),
                                   f"{str(m['from'])[:7]}...{str(m['to'])[:7]}") for m in r.get("moved") or [])
        prs = "<br>".join(link(pr_url(p.get("repo"), p["number"]), f"{p['source']} #{p['number']}") + " "
                          + link(commit_url(p.get("repo"), p.get("head")), str(p.get("head") or "-")[:7])
                          + (f" ({esc(p['state'])})" if p.get("state") else "") for p in r.get("pull_requests") or [])
        cls = "ok" if r.get("status") == "ok" else "bad"
        L.append(f'<tr><td>{esc(r["run_id"])}</td><td class="{cls}">{status}</td><td class="num">'
                 f'{esc(hist.secs(r.get("seconds")))}</td><td class="num">{esc(human(r["size"]) if r.get("size") else "-")}'
                 f'</td><td class="num">{"-" if rate is None else f"{round(rate * 100)}%"}</td>'
                 f'<td>{esc(hist.gate_cell(r.get("gate")))}</td><td>{moved or "-"}</td><td>{prs or "-"}</td></tr>')
    L.append("</table>")
    if tonight is not None:
        L += _tonight(tonight)
    return L + ["</section>"]


def _tonight(im: dict) -> list[str]:
    L = [f"<h3>Tonight: {esc(im.get('status'))}</h3>"]
    if im.get("reason"):
        L.append(f"<p><b>Why:</b> {esc(im['reason'])}</p>")
    f = im.get("failure")
    if f:
        if f.get("stage"):
            L.append(f"<p>Failed stage <code>{esc(f['stage'])}</code>"
                     + (f": <code>{esc(f.get('command'))}</code> exited with <b>exit code {esc(f['exit_code'])}</b>"
                        if f.get("exit_code") is not None else "")
                     + (f"; full log <code>{esc(f['log'])}</code>" if f.get("log") else "") + ".</p>")
        for p in f.get("problems") or []:
            L.append(f"<p><code>{esc(p['file'])}:{esc(p.get('line') or '')}</code> {esc(p['message'])}</p>")
        if f.get("tail"):
            L.append('<pre class="log-tail">' + esc("\n".join(f["tail"])) + "</pre>")
    steps = im.get("steps") or {}
    if steps:
        L.append("<table><tr><th>step</th><th>result</th><th>time</th><th>detail</th></tr>")
        for name in ("prefetch", "build", "gate", "promote", "sync"):
            s = steps.get(name)
            if s:
                L.append(f"<tr><td>{name}</td><td>{esc(s.get('status'))}</td><td class=\"num\">"
                         f"{esc(hist.secs(s.get('seconds')))}</td><td>{esc(s.get('detail'))}</td></tr>")
        L.append("</table>")
    if im.get("stages"):
        L.append("<table><tr><th>stage</th><th>cache</th><th>status</th><th>time</th></tr>")
        for s in im["stages"]:
            L.append(f"<tr><td>{esc(s['name'])}</td><td>{esc(s.get('cache'))}</td><td>{esc(s.get('status'))}</td>"
                     f"<td class=\"num\">{esc(hist.secs(s.get('seconds')))}</td></tr>")
        L.append("</table>")
    g = im.get("gate")
    if g and g.get("checks"):
        L.append("<table><tr><th>check</th><th>result</th><th>detail</th></tr>")
        for c in g["checks"]:
            res = str(c.get("outcome")).upper() + (" (GPU)" if c.get("requires_gpu") else "")
            L.append(f"<tr><td>{esc(c.get('id'))}</td><td>{esc(res)}</td><td>{esc(c.get('detail'))}</td></tr>")
        L.append("</table>")
    return L


def render(rows: list[dict], tonight: dict | None = None, *, title: str = "imagebuild nightly history") -> str:
    """The page for ``rows`` (history lines, oldest first) and, when given, a report's details."""
    images = list(dict.fromkeys(r["image"] for r in rows))
    by_image = {i.get("image"): i for i in (tonight or {}).get("images") or []}
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
        L += _image_section(image, [r for r in rows if r["image"] == image], by_image.get(image))
    L.append("</body></html>")
    return "\n".join(L) + "\n"
