"""The history page for people (issue 35, section 3): per-run x labels, a failed night marked in
the stage-time chart, an image-size axis that spans the sizes (labelled), relative links to each
night's report and failed log, build and sync times apart, what changed in the image, a failed
gate check's found value beside its expected one, a 0 % hit rate drawn apart from "no data", and
each chart and table in its own scroll box. The page in a browser (1400 and 400 px):
tests/integration/ops/test_history_page.py."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

from imagebuild.ops import history, htmlpage, nightly, report
from tests.unit.ops.test_nightly_report import full_doc


def night(run_id: str, *, status="ok", size=2_000_000_000, hits=1, misses=1, **extra) -> dict:
    doc = full_doc(run_id)
    im = doc["images"][0]
    im.update(status=status, size=size, cache={"hits": hits, "misses": misses}, **extra)
    doc["status"] = status
    return doc


def rows_of(*docs) -> list[dict]:
    return [r for d in docs for r in history.rows_of(d)]


class Page(HTMLParser):
    """Each chart's elements (tag, attributes, text) and each table's cells, in order."""

    def __init__(self, text: str):
        super().__init__()
        self.charts: dict[str, list] = {}
        self.chart = None
        self.open: list[list] = []  # the chart's elements open now: text goes to each (a tspan's to its text)
        self.stack: list[tuple[str, dict]] = []
        self.cells: list[str] = []
        self.cell: list[str] | None = None
        self.parents: list[tuple[str, str]] = []  # (the element holding each svg.chart or table, its class)
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in ("svg", "table") and self.stack:
            self.parents.append((tag, self.stack[-1][1].get("class") or ""))
        if tag == "svg":
            self.chart = self.charts.setdefault(a.get("data-chart"), [])
        elif self.chart is not None:
            self.chart.append([tag, a, ""])
            self.open.append(self.chart[-1])
        if tag in ("td", "th"):
            self.cell = []
        self.stack.append((tag, a))

    def handle_endtag(self, tag):
        if tag == "svg":
            self.chart = None
            self.open = []
        elif self.open and self.open[-1][0] == tag:
            self.open.pop()
        if tag in ("td", "th") and self.cell is not None:
            self.cells.append("".join(self.cell).strip())
            self.cell = None
        while self.stack and self.stack.pop()[0] != tag:
            pass

    def handle_data(self, data):
        for e in self.open:
            e[2] += data
        if self.cell is not None:
            self.cell.append(data)

    def of(self, chart: str, cls: str) -> list:
        return [e for e in self.charts[chart] if (e[1].get("class") or "") == cls]


def test_every_x_label_tells_two_runs_of_one_day_apart():
    a, b, c = (night(f"20261120T{t}.000001Z-{k}") for t, k in (("021700", "aaaaaa"), ("141500", "bbbbbb"),
                                                                ("141500", "cccccc")))
    page = Page(htmlpage.render(rows_of(a, b, c)))
    for chart in ("stage-times", "size", "hit-rate"):
        labels = [e[2] for e in page.of(chart, "xlab")]
        assert len(labels) == 3 and len(set(labels)) == 3, (chart, labels)
        assert labels[0] == "11-2002:17" and labels[1].startswith("11-2014:15:00"), labels  # date, then time
    # the nights table says the same
    nights = [c for c in page.cells if c.startswith("11-20 ")]
    assert nights == ["11-20 14:15:00 cccccc" + "build 0123456789abcdef", "11-20 14:15:00 bbbbbb" + "build 0123456789abcdef",
                      "11-20 02:17" + "build 0123456789abcdef"], nights  # newest first


def test_a_failed_night_is_marked_in_the_stage_time_chart():
    ok, bad, gate_bad = (night("20261120T020000.000001Z-aaaaaa"), night("20261121T020000.000001Z-bbbbbb",
                                                                       status="failed"),
                         night("20261122T020000.000001Z-cccccc", status="gate-failed"))
    page = Page(htmlpage.render(rows_of(ok, bad, gate_bad)))
    bands = page.of("stage-times", "failed-night")
    marks = page.of("stage-times", "failed-mark")
    assert len(bands) == 2 and len(marks) == 2, page.charts["stage-times"]
    assert "failed" in bands[0][2] and "gate-failed" in bands[1][2]  # its tooltip says how
    # the band covers night 2's slot (x) and the plot's height
    x = float(bands[0][1]["x"])
    pw = htmlpage.W - htmlpage.ML - htmlpage.MR
    assert abs(x - (htmlpage.ML + pw * 1.05 / 3)) < 1 and float(bands[0][1]["height"]) >= htmlpage.H - htmlpage.MT - htmlpage.MB


def test_the_size_axis_spans_the_sizes_so_two_percent_shows():
    a = night("20261120T020000.000001Z-aaaaaa", size=2_000_000_000)
    b = night("20261121T020000.000001Z-bbbbbb", size=2_040_000_000)  # +2 %
    page = Page(htmlpage.render(rows_of(a, b)))
    ys = [float(e[1]["cy"]) for e in page.of("size", "point")]
    ph = htmlpage.H - htmlpage.MT - htmlpage.MB
    assert ys[0] - ys[1] > ph / 3, ys  # at least a third of the plot's height, not a few pixels
    ticks = [e[2] for e in page.of("size", "ytick")]
    assert ticks and "0" not in ticks and all(re.fullmatch(r"\d+\.\d+", t) for t in ticks), ticks
    assert len(set(ticks)) == len(ticks) // 2  # each tick once on each side, none alike
    titles = [e[2] for e in page.of("size", "axis-title")]
    assert "image size (GiB)" in titles and "night (start, UTC)" in titles
    assert htmlpage.nice_ticks(1.86, 1.90, zero=False)[0] > 1.8
    assert htmlpage.nice_ticks(0, 0)[-1] == 1.0 and htmlpage.nice_ticks(5, 5, zero=False)[0] < 5


def test_links_to_each_nights_report_and_failed_log_are_relative_and_work(tmp_path, monkeypatch):
    root = tmp_path / "project"
    rdir = root / ".imagebuild" / "nightly"
    log = root / ".imagebuild" / "builds" / "img" / "r" / "logs" / "app.log"
    log.parent.mkdir(parents=True)
    log.write_text("#5 ERROR: exit code: 7\n")
    old = night("20261120T020000.000001Z-aaaaaa")
    bad = night("20261121T020000.000001Z-bbbbbb", status="failed",
                failure={"step": "build", "stage": "app", "exit_code": 7, "command": "make", "tool_exit_code": 1,
                         "log": ".imagebuild/builds/img/r/logs/app.log", "tail": [], "problems": [], "reason": None})
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(root / ".imagebuild"))
    report.write(rdir, old, keep=1)
    history.append(root / ".imagebuild" / history.FILE, old)
    stored = report.write(rdir, bad, keep=1)  # keeps one report: the old night's is pruned
    nightly._history(root, rdir, stored)  # what the nightly does: <run id>.html beside the report
    page_path = stored.json_path.with_suffix(".html")
    text = page_path.read_text()
    hrefs = [h for h in re.findall(r'href="([^"]+)"', text) if not h.startswith(("#", "http"))]
    assert {"20261121T020000.000001Z-bbbbbb.md", "20261121T020000.000001Z-bbbbbb.json",
            "../builds/img/r/logs/app.log"} <= set(hrefs), hrefs
    for h in hrefs:
        assert not h.startswith("/") and (page_path.parent / h).is_file(), h
    assert "pruned" in text  # the old night's report is gone: no dead link
    # report --html prints the page: its links are relative to the current folder
    links = htmlpage.night_links(history.load(root / ".imagebuild" / history.FILE, [bad]).rows,
                                 [(stored.json_path, bad)], root, tmp_path)
    assert links["20261121T020000.000001Z-bbbbbb"]["logs"]["img"] == \
        "project/.imagebuild/builds/img/r/logs/app.log"


def gate_failed_night() -> dict:
    doc = night("20261121T020000.000001Z-bbbbbb", status="gate-failed")
    im = doc["images"][0]
    im["steps"]["build"]["seconds"] = 300.0
    im["steps"]["sync"]["seconds"] = 42.0
    im["gate"]["result"] = "failed"
    im["gate"]["checks"] += [
        {"id": "vllm-version", "kind": "python_dist", "outcome": "failed", "severity": "error", "requires_gpu": False,
         "detail": "vllm 0.10.0 does not satisfy >=0.11"},
        {"id": "arch", "kind": "image_config", "outcome": "failed", "severity": "error", "requires_gpu": False,
         "detail": "architecture is 'amd64', expected 'arm64'"}]
    return doc


def first_night_cells(doc: dict) -> tuple[Page, list[str], list[str]]:
    page = Page(htmlpage.render(history.rows_of(doc), doc))
    return page, page.cells[:12], page.cells[12:24]


def test_the_nights_table_shows_build_and_sync_times_apart():
    page, head, first = first_night_cells(gate_failed_night())
    assert head[3:6] == ["time", "build", "sync"], head
    assert first[3:6] == ["12.5s", "5m00s", "42.0s"], first


def test_the_nights_table_shows_what_changed_in_the_image():
    doc = gate_failed_night()
    row = history.rows_of(doc)[0]
    assert row["changed"]["pip"] == {"n": 3, "items": ["greet 1.0->1.1", "+new 3", "-old 2"]}
    assert row["changed"]["pins"]["n"] == 2 and row["changed"]["dpkg"] == {"n": 0, "items": []}
    page, head, first = first_night_cells(doc)
    assert head[10] == "changed in the image" and head[9] == "moved upstream", head
    assert "pip (3): greet 1.0->1.1, +new 3, -old 2" in first[10] and "pins (2)" in first[10], first[10]
    assert "dpkg" not in first[10]  # nothing changed there: not listed


def test_a_failed_gate_checks_found_value_stands_beside_its_expected_one():
    doc = gate_failed_night()
    row = history.rows_of(doc)[0]
    assert [c["id"] for c in row["gate"]["failed_checks"]] == ["vllm-version", "arch"]  # kept in the history
    page, head, first = first_night_cells(doc)
    gate = first[8]
    assert "vllm-version: found vllm 0.10.0, expected >=0.11" in gate, gate
    assert "arch: found architecture is 'amd64', expected 'arm64'" in gate, gate
    # tonight's gate table: found and expected side by side
    i = page.cells.index("vllm-version")
    assert page.cells[i:i + 4] == ["vllm-version", "FAILED", "vllm 0.10.0", ">=0.11"], page.cells[i:i + 4]
    assert htmlpage.found_expected("found 0 file(s) under /x, expected at least 1") == [
        ("found 0 file(s) under /x", "at least 1")]
    assert htmlpage.found_expected("not a version") == [("not a version", "")]
    # a check with several problems (image_config joins them with '; '): each found beside its expected
    assert htmlpage.found_expected("architecture is 'amd64', expected 'arm64'; user is 'root', expected 'app'") == [
        ("architecture is 'amd64'", "'arm64'"), ("user is 'root'", "'app'")]


def test_a_zero_hit_rate_is_drawn_and_no_data_is_said():
    zero = night("20261120T020000.000001Z-aaaaaa", hits=0, misses=3)
    none = night("20261121T020000.000001Z-bbbbbb", hits=0, misses=0)
    half = night("20261122T020000.000001Z-cccccc", hits=1, misses=1)
    page = Page(htmlpage.render(rows_of(zero, none, half)))
    assert len(page.of("hit-rate", "zero")) == 1 and [e[2] for e in page.of("hit-rate", "zero-label")] == ["0%"]
    assert [e[2] for e in page.of("hit-rate", "nodata")] == ["n/a" + "11-21 02:00: no data"]
    assert len(page.of("hit-rate", "bar")) == 1
    zx = float(page.of("hit-rate", "zero")[0][1]["x"])
    nd = float(page.of("hit-rate", "nodata")[0][1]["x"])
    assert zx < nd  # night 1 drawn, night 2 said: in their own slots
    assert "n/a" in page.cells and "0%" in page.cells


def test_each_chart_and_table_scrolls_in_its_own_box():
    page = Page(htmlpage.render(rows_of(night("20261120T020000.000001Z-aaaaaa")), full_doc()))
    assert page.parents and all((tag == "svg" and cls == "scroll") or (tag == "table" and cls == "table-scroll")
                                for tag, cls in page.parents), page.parents
    assert ".scroll{overflow-x:auto" in htmlpage.CSS and "direction:rtl" in htmlpage.CSS  # opens at the newest


def test_the_new_cells_are_escaped():
    doc = night("20261121T020000.000001Z-bbbbbb", status="gate-failed")
    im = doc["images"][0]
    im["gate"]["checks"].append({"id": "<b>x</b>", "kind": "k", "outcome": "failed", "severity": "error",
                                 "requires_gpu": False, "detail": "<img src=x onerror=alert(1)>, expected <script>"})
    im["changes"]["pip"]["changed"].append({"name": "<script>alert(1)</script>", "from": "1", "to": '2"><x'})
    text = htmlpage.render(history.rows_of(doc), doc)
    assert "<script>" not in text and "<img" not in text and "<b>x</b>" not in text and '"><x' not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text and "&lt;img src=x onerror=alert(1)&gt;" in text


def test_the_hit_rate_chart_is_one_figure_helper_call_away():
    """A further chart (issue 33's compiler-cache rate) is one ``figure(...)`` of a ``rate_bars``."""
    svg = htmlpage.rate_bars("ccache", "t", [("11-20", "02:17")], [0.5])
    out = htmlpage.figure("Compiler cache", svg)
    assert out[1].startswith('<div class="scroll"><svg class="chart" data-chart="ccache"')
    assert Path(htmlpage.__file__).name == "htmlpage.py"


def test_a_links_odd_file_name_stays_a_relative_path(tmp_path):
    """A report file named like a URL scheme, or holding '#' or a space, still links to itself."""
    rows, reports = [], []
    for run in ("javascript:alert(1)", "a #b?c"):
        jp = tmp_path / f"{run}.json"
        jp.write_text("{}")
        jp.with_suffix(".md").write_text("")
        rows.append({"run_id": run, "image": "img"})
        reports.append((jp, {"run_id": run, "images": []}))
    links = htmlpage.night_links(rows, reports, tmp_path, tmp_path)
    assert links["javascript:alert(1)"]["report"]["md"] == "./javascript:alert(1).md"
    assert links["a #b?c"]["report"]["json"] == "a%20%23b%3Fc.json"
