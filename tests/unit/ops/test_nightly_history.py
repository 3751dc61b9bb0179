"""The pieces of issue 23's failure reports and history that need no engine: reading a BuildKit log
(the RUN's own exit code, its output's last lines, redacted), the summary's stage counts, the
history file (added once, atomically, read past a bad line), the Actions commands."""

from __future__ import annotations

from imagebuild.buildstep import buildlog
from imagebuild.cli import actions
from imagebuild.ops import history, htmlpage, nightly, report
from tests.unit.ops.test_nightly_report import full_doc, validate

TOKEN = "ghp_unitHistoryToken0123456789abcdef"

# BuildKit's plain progress for a RUN that exits 7 (the shape docker buildx --progress plain writes)
LOG = """#0 building with "default" instance using docker driver

#4 [1/2] FROM docker.io/library/busybox:1@sha256:0123
#4 CACHED

#5 [2/2] RUN for i in 1 2 3; do echo line $i; done; exit 7
""" + "".join(f"#5 0.{i:03d} output {i}\n" for i in range(30)) + f"""#5 0.200 \x1b[31mcoloured\x1b[0m https://user:pw@example.invalid/x {TOKEN}
#5 ERROR: process "/bin/sh -c for i in 1 2 3; do echo \\"line\\" $i; done; exit 7" did not complete successfully: exit code: 7
------
 > [2/2] RUN for i in 1 2 3; do echo line $i; done; exit 7:
------
ERROR: failed to build: failed to solve: process "/bin/sh -c for i in 1 2 3; do echo \\"line\\" $i; done; exit 7" did not complete successfully: exit code: 7

imagebuild: docker buildx build exited 1
"""


def test_buildlog_reads_the_run_exit_code_and_the_failing_steps_tail(monkeypatch):
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    info = buildlog.explain(LOG)
    assert info["exit_code"] == 7 and info["tool_exit_code"] == 1
    assert info["command"] == '/bin/sh -c for i in 1 2 3; do echo "line" $i; done; exit 7'
    tail = info["tail"]
    assert len(tail) == buildlog.TAIL_LINES == 20
    assert tail[0].startswith("#5 [2/2] RUN") and tail[-1].startswith("#5 ERROR: process")
    assert "#5 0.029 output 29" in tail and "#5 0.010 output 10" not in tail
    coloured = next(t for t in tail if "coloured" in t)
    assert "\x1b" not in coloured and "user:pw@" not in coloured and TOKEN not in coloured and "[redacted]" in coloured


def test_buildlog_names_the_place_the_step_and_its_own_output_for_builds_error():
    """Issue 35: ``build`` says what the nightly says, from the same reading: the place buildx's summary
    names, the step, and the step's own output lines without BuildKit's ``#N <seconds>`` prefixes."""
    text = LOG.replace("------\n > [2/2]", "Dockerfile.app:4\n--------------------\n   4 | >>> RUN x\n"
                       "--------------------\n > [2/2]")
    info = buildlog.explain(text, n=5)
    assert info["where"] == "Dockerfile.app:4"
    assert info["step"] == "[2/2] RUN for i in 1 2 3; do echo line $i; done; exit 7"
    assert info["output"][:4] == ["output 26", "output 27", "output 28", "output 29"] and len(info["output"]) == 5
    assert buildlog.run_exit(info["exit_code"]) == "RUN exit 7"
    none = buildlog.explain("#1 [internal] load build definition\nERROR: failed to solve: no such image\n")
    assert none["where"] is None and none["step"] is None and none["output"] == []


def test_buildlog_without_a_failing_step_keeps_the_logs_end():
    info = buildlog.explain("#1 [internal] load build definition\nERROR: failed to solve: base image not found\n"
                            "\nimagebuild: docker buildx build exited 1\n")
    assert info["exit_code"] is None and info["command"] is None and info["tool_exit_code"] == 1
    assert info["tail"][-2:] == ["ERROR: failed to solve: base image not found", "imagebuild: docker buildx build exited 1"]


def test_a_failed_stage_is_not_counted_as_built():
    stages = [{"name": "base", "cache": "hit", "status": "skipped"}, {"name": "app", "cache": "miss", "status": "built"},
              {"name": "tests", "cache": "miss", "status": "failed"},
              {"name": "runner", "cache": "not-reached", "status": "pending"}]
    assert report.stage_counts(stages) == "1 cached, 1 built (app), 1 failed (tests), 1 not reached"


def failed_doc() -> dict:
    doc = full_doc()
    im = doc["images"][0]
    im.update(status="failed", exit_code=1, reason="stage 'app' of img failed: its step exited 7",
              failure={"step": "build", "stage": "app", "exit_code": 7, "command": "/bin/sh -c make",
                       "tool_exit_code": 1, "log": ".imagebuild/builds/img/r/logs/app.log",
                       "tail": ["#5 0.1 compiling", "#5 0.2 ```not a fence```", "#5 ERROR: exit code: 7"],
                       "problems": [], "reason": None})
    im["stages"][1]["status"] = "failed"
    doc.update(status="failed", exit_code=1)
    return doc


def test_the_failure_in_markdown_summary_and_schema(tmp_path):
    doc = failed_doc()
    validate(doc)
    md = report.render_markdown(doc)
    assert "### Failure" in md and "**RUN exit 7**" in md and "(docker buildx itself exited 1)" in md
    fence = "````"  # longer than the tail's own backtick run
    assert f"{fence}text\n#5 0.1 compiling\n#5 0.2 ```not a fence```\n#5 ERROR: exit code: 7\n{fence}\n" in md
    lines = report.summary_lines(doc)
    assert "    failed stage app: RUN exit 7 (`/bin/sh -c make`); docker buildx exited 1; log " \
           ".imagebuild/builds/img/r/logs/app.log" in lines
    assert "      | #5 ERROR: exit code: 7" in lines
    assert any("1 cached, 0 built (none), 1 failed (app)" in ln for ln in lines)


def test_history_adds_each_night_once_and_survives_a_bad_line(tmp_path):
    f = tmp_path / "state" / history.FILE
    a, b = full_doc("20261129T020000.000001Z-aaaaaa"), failed_doc()
    b["run_id"] = "20261130T020000.000001Z-bbbbbb"
    assert history.append(f, a) == 1 and history.append(f, a) == 0
    with open(f, "a") as fh:
        fh.write('{"half a line')  # an editor or a full disk: the next night still adds its line
    assert history.append(f, b) == 1
    h = history.read(f)
    assert [r["run_id"] for r in h.rows] == [a["run_id"], b["run_id"]] and h.skipped == 1
    r0, r1 = h.rows
    assert r0["cache"] == {"hits": 1, "misses": 1, "rate": 0.5} and r0["gate"]["result"] == "passed"
    assert r0["moved"] == [{"source": "GREET", "what": "PR 2", "from": "c" * 40, "to": "e" * 40, "repo": None}]
    assert r1["failure"] == {"step": "build", "stage": "app", "exit_code": 7, "command": "/bin/sh -c make",
                             "log": ".imagebuild/builds/img/r/logs/app.log"}
    assert not list(f.parent.glob(".*"))  # no temporary file left
    # the reports' retention does not touch it; a kept report the file lacks is read too
    rows = history.load(f, [a, {**a, "run_id": "20261201T020000.000001Z-cccccc"}]).rows
    assert [r["run_id"][:8] for r in rows] == ["20261129", "20261130", "20261201"]
    table = history.render_table(rows)
    assert "img: 3 night(s)" in table and "failed (exit 7)" in table and "FAILED" in table and "PASS*" in table


def test_html_page_escapes_and_links(tmp_path):
    doc = failed_doc()
    doc["images"][0]["upstream"]["moved"][0]["repo"] = "https://user:pw@github.com/example/greet.git"
    doc["images"][0]["failure"]["tail"] = ["<script>alert(1)</script>"]
    page = htmlpage.render(history.rows_of(doc), doc)
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert f'href="https://github.com/example/greet/compare/{"c" * 40}...{"e" * 40}"' in page
    assert "user:pw" not in page
    assert htmlpage.pr_url("https://forge.example.invalid/o/r.git", 5) == "https://forge.example.invalid/o/r/pulls/5"
    assert htmlpage.web_base("git://127.0.0.1/x.git") is None


def test_actions_commands_and_outputs(tmp_path):
    doc = failed_doc()
    log = tmp_path / ".imagebuild" / "builds" / "img" / "r" / "logs" / "app.log"
    log.parent.mkdir(parents=True)
    log.write_text("#5 [2/2] RUN make\n#5 ERROR: exit code: 7\n")
    doc["images"][0]["stages"][1]["log"] = ".imagebuild/builds/img/r/logs/app.log"
    bad = nightly._blank("bad")
    bad.update(status="failed", exit_code=2, failure={"step": "definition", "problems": [
        {"file": "docker-images/bad/image.yaml", "line": 4, "key": "stages[0].form", "message": "unknown key, 100%"}]})
    doc["images"].append(bad)
    cmds = actions.commands(doc, tmp_path)
    assert cmds[:4] == ["::group::img/app: failed (7.9 s)", "#5 [2/2] RUN make", "#5 ERROR: exit code: 7", "::endgroup::"]
    assert "::error title=img/app failed::stage app of img failed: RUN exit 7 from `/bin/sh -c make`; log " \
           ".imagebuild/builds/img/r/logs/app.log" in cmds
    assert "::error file=docker-images/bad/image.yaml,line=4,title=bad%3A definition error::stages[0].form: " \
           "unknown key, 100%25" in cmds
    out = tmp_path / "gh_output"
    stored = report.write(tmp_path / "reports", doc)
    actions.write_outputs(out, doc, stored, tmp_path)
    text = out.read_text()
    assert f"report_md={stored.md_path.resolve()}\n" in text and "status=failed\n" in text
    assert f"failed_logs={log.resolve()}\n" in text  # one log: one line
    assert actions.under_actions({"GITHUB_ACTIONS": "true"}) and not actions.under_actions({})



def test_history_and_page_carry_the_compiler_cache_hit_rate(tmp_path):
    """A compile stage's compiler-cache figures reach the history line and the page's chart."""
    nights = []
    for i, (hits, misses) in enumerate([(0, 4), (4, 0)]):
        doc = full_doc(f"2026113{i}T020000.000001Z-aaaaa{i}")
        st = doc["images"][0]["stages"][0]
        st["compiler_cache"] = {"hits": hits, "misses": misses, "uncacheable": 1,
                                "hit_rate": hits / (hits + misses), "cache_bytes": 1 << 20}
        nights.append(doc)
    f = tmp_path / history.FILE
    for doc in nights:
        history.append(f, doc)
    rows = history.read(f).rows
    assert [r["compiler_cache"] for r in rows] == [{"hits": 0, "misses": 4, "uncacheable": 1, "rate": 0.0},
                                                   {"hits": 4, "misses": 0, "uncacheable": 1, "rate": 1.0}]
    page = htmlpage.render(rows, nights[-1])
    assert "compiler-cache hit rate per night" in page and "100%" in page
    assert history.rows_of(full_doc())[0]["compiler_cache"] is None  # no compile stage: no chart
    assert "compiler-cache hit rate per night" not in htmlpage.render(history.rows_of(full_doc()), full_doc())
