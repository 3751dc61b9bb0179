"""The history page in a real browser (issue 23, section 3): five nights of one image (one failed
at a RUN's exit 7, one gate failed), ``imagebuild report --html``, loaded from disk by headless
Chromium (Debian's ``chromium``). The page must load with no console message (an error, a blocked
load, an uncaught exception), fetch nothing, and show its charts: the SVG elements in the dumped DOM
(count, size, one mark per night) and their colours in a screenshot.

Chromium absent: skipped with the reason, except under CI=true, where it fails (scripts/testbed.sh
installs it). A page with a console error and an uncaught exception is loaded first, so the check
that finds none on ours is known to find them."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from imagebuild.ops import history, htmlpage, nightly, report
from tests.conftest import run_cli

NIGHTS = 5
IMAGE = "pagetest"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--enable-logging=stderr",
                  "--v=0", "--hide-scrollbars"]


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        msg = "no chromium on PATH (Debian: apt-get install chromium; scripts/testbed.sh installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg + " -- required under CI=true")
        pytest.skip(msg)
    return exe


def browse(page: Path, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    """One headless Chromium run on ``page`` with a fresh profile."""
    prof = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    return subprocess.run([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={prof}", *extra, page.as_uri()],
                          capture_output=True, text=True, timeout=120)


def console_messages(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ":CONSOLE" in ln or "Uncaught" in ln]


def night(i: int) -> dict:
    """Night ``i`` of five: stage times grow, the image grows, night 3's gate fails, night 4 fails at a RUN
    (a rerun the same day as night 3, at 14:30)."""
    day, at = (20 + i, "021700") if i < 4 else (23, "143000")
    run_id = f"202611{day:02d}T{at}.000000Z-{i:06x}"
    res = nightly._blank(IMAGE)
    stages = [("base", "hit" if i else "miss", 30.0), ("vllm-wheel", "miss", 600.0 + 60 * i),
              ("runner", "miss", 20.0 + i)]
    failed = i == 4
    res.update(
        status="failed" if failed else ("gate-failed" if i == 3 else "ok"), exit_code=1 if failed else (4 if i == 3 else 0),
        seconds=700.0 + 60 * i, build_id=f"{i:016x}",
        steps={"build": {"status": "failed" if failed else "built", "seconds": 650.0 + 60 * i, "detail": None},
               "sync": {"status": "ok", "seconds": 30.0 + i, "detail": None}}, identity="sha256:" + f"{i:02x}" * 32, run_id=run_id,
        size=None if failed else 2_000_000_000 + i * 50_000_000,
        stages=[{"name": n, "action": "skip" if c == "hit" else "build", "cache": c,
                 "status": ("failed" if failed and n == "vllm-wheel" else "skipped" if c == "hit" else "built"),
                 "seconds": None if c == "hit" else s, "key": None, "log": None} for n, c, s in stages],
        upstream={"checked": True, "reason": None, "notices": [],
                  "moved": [] if i == 0 else [{"source": "VLLM", "what": "PR 552", "from": f"{i - 1:x}" * 40,
                                                "to": f"{i:x}" * 40, "repo": "https://github.com/example/vllm.git"}],
                  "pull_requests": [{"source": "VLLM", "number": 552, "head": f"{i:x}" * 40, "moved": i > 0,
                                     "head_ref": "present", "merge_ref": "present", "state": "open", "merged": False,
                                     "via": ["git ls-remote"], "repo": "https://github.com/example/vllm.git"}]},
    )
    res["cache"] = {"hits": sum(1 for _, c, _ in stages if c == "hit"), "misses": sum(1 for _, c, _ in stages if c == "miss")}
    if failed:
        res["failure"] = {"step": "build", "stage": "vllm-wheel", "exit_code": 7, "command": "/bin/sh -c make wheel",
                          "tool_exit_code": 1, "log": ".imagebuild/builds/x/logs/vllm-wheel.log",
                          "tail": [f"#9 12.{k} compiling unit {k} <of> & 'quoted'" for k in range(19)]
                          + ['#9 ERROR: process "/bin/sh -c make wheel" did not complete successfully: exit code: 7'],
                          "problems": [], "reason": None}
        res["reason"] = "stage 'vllm-wheel' failed: its step exited 7"
    else:
        res["gate"] = {"result": "failed" if i == 3 else "passed", "ran": True, "seconds": 3.0, "reason": None,
                       "spec": "gate.yaml", "identity": res["identity"], "gpu_checks_skipped": True,
                       "summary": {"passed": 4, "failed": int(i == 3), "skipped": 1, "total": 5},
                       "checks": [{"id": "vllm-version", "kind": "python_dist", "outcome": "failed", "severity": "error",
                                   "requires_gpu": False, "detail": "vllm 0.10.0 does not satisfy >=0.11"}]
                       if i == 3 else [],
                       "receipt": None}
    return {"schema": report.SCHEMA, "version": report.VERSION, "run_id": run_id,
            "started": f"2026-11-{day:02d}T{at[:2]}:{at[2:4]}:00Z", "finished": f"2026-11-{day:02d}T23:00:00Z",
            "seconds": res["seconds"], "host": "dgx3", "imagebuild_version": "test", "status": res["status"],
            "exit_code": res["exit_code"], "refused": None, "disk": None, "images": [res],
            "command": {"images": [IMAGE], "peers": [], "refresh": True, "keep_builds": 3, "keep_reports": 2,
                        "gc": True}}


class Svgs(HTMLParser):
    def __init__(self):
        super().__init__()
        self.charts: list[dict] = []
        self.inside: dict | None = None
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if tag == "svg":
            self.inside = {"attrs": a, "rect": 0, "circle": 0, "polyline": 0, "bar": 0, "point": 0}
            self.charts.append(self.inside)
        elif self.inside is not None and tag in ("rect", "circle", "polyline"):
            self.inside[tag] += 1
            self.inside["bar"] += a.get("class") == "bar"
            self.inside["point"] += a.get("class") == "point"

    def handle_endtag(self, tag):
        if tag == "svg":
            self.inside = None


def png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """A PNG's width, height and rows of RGB(A) bytes (8-bit truecolour, as Chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w, h, bpp = 8, b"", 0, 0, 3
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and ctype in (2, 6), (depth, ctype)
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw, rows, prev, stride = zlib.decompress(idat), [], bytearray(w * bpp), w * bpp
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for x in range(stride):
            left = line[x - bpp] if x >= bpp else 0
            up, ul = prev[x], prev[x - bpp] if x >= bpp else 0
            if f == 1:
                line[x] = (line[x] + left) & 255
            elif f == 2:
                line[x] = (line[x] + up) & 255
            elif f == 3:
                line[x] = (line[x] + (left + up) // 2) & 255
            elif f == 4:
                p = left + up - ul
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - ul)
                line[x] = (line[x] + (left if pa <= pb and pa <= pc else up if pb <= pc else ul)) & 255
        rows.append(bytes(line))
        prev = line
    return w, bpp, rows


def colour_count(path: Path, rgb: tuple[int, int, int]) -> int:
    w, bpp, rows = png_pixels(path)
    want = bytes(rgb)
    return sum(1 for row in rows for x in range(0, w * bpp, bpp) if row[x:x + 3] == want)


def column_runs(path: Path, rgb: tuple[int, int, int], min_px: int) -> list[tuple[int, int]]:
    """The separate vertical bands of ``rgb`` (columns with at least ``min_px`` such pixels) a
    screenshot shows, as (first, last) columns: one per bar of a chart in view."""
    w, bpp, rows = png_pixels(path)
    want = bytes(rgb)
    counts = [0] * w
    for row in rows:
        for x in range(w):
            if row[x * bpp:x * bpp + 3] == want:
                counts[x] += 1
    runs: list[tuple[int, int]] = []
    for x, c in enumerate(counts):
        if c >= min_px:
            runs[-1:] = [(runs[-1][0], x)] if runs and runs[-1][1] == x - 1 else [*runs[-1:], (x, x)]
    return runs


def test_the_history_page_in_headless_chromium(project, tmp_path, monkeypatch):
    exe = chromium()
    # the check is known to see errors: a page with a console error and an uncaught exception
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><p>x</p><script>console.error("seen-error"); throw new Error("seen-throw")</script>')
    msgs = console_messages(browse(bad, tmp_path, "--dump-dom").stderr)
    assert any("seen-error" in m for m in msgs) and any("Uncaught" in m for m in msgs), msgs

    # five nights: the history file holds them all; the report folder keeps only the last two
    state = tmp_path / "state"
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(state))
    rdir = tmp_path / "reports"
    for i in range(NIGHTS):
        doc = night(i)
        report.write(rdir, doc, keep=2)
        history.append(state / history.FILE, doc)
    assert len(list(rdir.glob("*.json"))) == 2
    log = project / ".imagebuild" / "builds" / "x" / "logs" / "vllm-wheel.log"  # night 4's failed stage
    log.parent.mkdir(parents=True)
    log.write_text("#9 ERROR: exit code: 7\n")
    monkeypatch.chdir(tmp_path)  # the page is printed: its links are relative to the current folder
    r = run_cli("--root", str(project), "report", "--report-dir", str(rdir), "--html")
    assert r.code == 0, r.err
    page = tmp_path / "page.html"
    page.write_text(r.out)
    # the links to the kept nights' reports and the failed log work from where the page is
    hrefs = [h for h in re.findall(r'href="([^"#][^"]*)"', r.out) if not h.startswith("https://")]
    assert sorted(hrefs) == sorted([f"reports/{night(i)['run_id']}.{ext}" for i in (3, 4) for ext in ("md", "json")]
                                   + ["project/.imagebuild/builds/x/logs/vllm-wheel.log"] * 2), hrefs
    assert all((tmp_path / h).is_file() for h in hrefs)
    assert "<script" not in r.out and "<link" not in r.out and ' src="' not in r.out  # nothing to fetch

    got = browse(page, tmp_path, "--dump-dom")
    assert got.returncode == 0, got.stderr[-2000:]
    assert console_messages(got.stderr) == [], console_messages(got.stderr)
    dom = Svgs()
    dom.feed(got.stdout)
    charts = {c["attrs"].get("data-chart"): c for c in dom.charts}
    assert set(charts) == {"stage-times", "size", "hit-rate", "gate"}, list(charts)
    for c in charts.values():
        assert c["attrs"]["data-nights"] == str(NIGHTS)
        assert int(c["attrs"]["width"]) >= 200 and int(c["attrs"]["height"]) >= 40, c["attrs"]
    # stage times: the built stages of each night stacked (night 0 three, the others two)
    assert charts["stage-times"]["bar"] == 3 + 2 * (NIGHTS - 1)
    assert charts["size"]["point"] == NIGHTS - 1 and charts["size"]["polyline"] == 1  # night 4 has no image
    assert charts["hit-rate"]["bar"] == NIGHTS - 1  # night 0 built everything: 0 %, a red line, not a bar
    assert charts["gate"]["rect"] == NIGHTS
    text = got.stdout
    assert "RUN exit 7" in text and "&lt;of&gt; &amp; 'quoted'" in text  # tonight's log tail, escaped
    assert "https://github.com/example/vllm/compare/" + "3" * 40 + "..." + "4" * 40 in text
    assert "https://github.com/example/vllm/pull/552" in text
    assert "1 failed in a row" in text
    assert "11-23 02:17" in text and "11-23 14:30" in text  # two runs of one day, told apart
    assert "found <code>vllm 0.10.0</code>, expected <code>&gt;=0.11</code>" in text

    first, green, red, band = (tuple(int(c[k:k + 2], 16) for k in (1, 3, 5)) for c in
                               (htmlpage.PALETTE[0], htmlpage.GATE_COLOUR["passed"], htmlpage.GATE_COLOUR["failed"],
                                htmlpage.FAILED_BAND))
    wheel = tuple(int(htmlpage.PALETTE[1][k:k + 2], 16) for k in (1, 3, 5))  # vllm-wheel: every night's bar
    seen = {}
    for width in (1400, 400):
        shot = tmp_path / f"shot-{width}.png"
        got = browse(page, tmp_path, f"--screenshot={shot}", f"--window-size={width},1400")
        assert shot.is_file(), got.stderr[-2000:]
        assert console_messages(got.stderr) == []
        seen[width] = {"bars": column_runs(shot, wheel, 40), "failed bands": column_runs(shot, band, 12),
                       "green": colour_count(shot, green), "red": colour_count(shot, red),
                       "first": colour_count(shot, first)}
    # desktop: every night's bar, both not-good nights (3: gate failed, 4: failed) marked, the gate strip
    assert len(seen[1400]["bars"]) == NIGHTS and len(seen[1400]["failed bands"]) == 2, seen
    assert seen[1400]["first"] > 500 and seen[1400]["green"] > 250 * 3 and seen[1400]["red"] > 250, seen
    # phone: the chart's box opens at its right end: the newest nights' bars and marks are in sight
    # (before issue 35 the chart was cut at the right: nights 0 and 1 only, the newest out of reach)
    assert len(seen[400]["failed bands"]) == 2, seen
    for a, b in seen[400]["failed bands"]:  # each newest night's band holds its bar, whole, in sight
        assert b < 400 and any(a < x0 and x1 < b for x0, x1 in seen[400]["bars"]), seen
    assert seen[400]["green"] > 250 * 3 and seen[400]["red"] > 250, seen
    print(f"\nchromium {subprocess.run([exe, '--version'], capture_output=True, text=True).stdout.strip()}: "
          f"{len(dom.charts)} charts, page {len(r.out)} bytes; screenshots {seen}")


def test_history_json_reaches_past_the_kept_reports(project, tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state"))
    rdir = tmp_path / "reports"
    for i in range(NIGHTS):
        doc = night(i)
        report.write(rdir, doc, keep=2)
        history.append(tmp_path / "state" / history.FILE, doc)
        history.append(tmp_path / "state" / history.FILE, doc)  # twice: added once
    r = run_cli("--root", str(project), "report", "--report-dir", str(rdir), "--history", "--json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    assert data["nights"] == NIGHTS and [x["status"] for x in data["rows"]] == [
        "ok", "ok", "ok", "gate-failed", "failed"]
    r = run_cli("--root", str(project), "report", "--report-dir", str(rdir), "--history", "3")
    assert r.code == 0 and "3 night(s)" in r.out and "failed (exit 7)" in r.out and "FAIL*" in r.out, r.out
