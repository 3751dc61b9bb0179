"""BuildKit's rawjson progress -> the stage log, the plain lines, the heartbeat and the live view
(buildstep/progress.py, buildstep/live.py), read from output recorded from the real engine
(tests/fixtures/rawjson/record.sh: `docker buildx build --progress=rawjson` of two small Dockerfiles)."""

from __future__ import annotations

import base64
import io
import json
import re
import time

import pytest

from imagebuild.buildstep import progress as progress_mod
from imagebuild.core.errors import UsageError
from tests.conftest import FIXTURES

RAW = FIXTURES / "rawjson"


def lines(name: str) -> list[str]:
    return (RAW / f"{name}.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)


def decode(name: str, upto: int | None = None) -> tuple[progress_mod.Decoder, str]:
    dec = progress_mod.Decoder()
    text = "".join(dec.feed(ln) for ln in lines(name)[:upto])
    return dec, text


def _step(dec, prefix):
    return next(s for s in dec.order if s.name.startswith(prefix))


def test_the_fixtures_are_real_rawjson():
    for name in ("ok", "cached", "fail"):
        docs = [json.loads(ln) for ln in lines(name) if ln.startswith("{")]
        assert docs and all(set(d) <= {"vertexes", "statuses", "logs", "warnings"} for d in docs), name


def test_a_build_decodes_to_buildx_plain_layout_without_escapes():
    dec, text = decode("ok")
    assert "\x1b" not in text and "\r" not in text
    hello = _step(dec, "[2/3] RUN echo hello")
    second = _step(dec, "[3/3] RUN echo second step")
    n, m = hello.number, second.number
    # the header when the step starts, each output line with its time in the step, the result
    assert f"\n#{n} [2/3] RUN echo hello; printf 'partial\\033[31mred\\033[0m\\n'; sleep 2; echo done\n" in text
    out = [ln for ln in text.splitlines() if ln.startswith(f"#{n} ")][1:]  # less the header
    assert [ln.split(" ", 2)[2] for ln in out[:3]] == ["hello", "partialred", "done"], out
    assert float(out[2].split()[1]) >= 1.9  # `done` came after the two-second sleep
    assert out[-1].startswith(f"#{n} DONE ") and out[-1].endswith("s")
    # stderr is output too; a last line without a newline is kept when the step ends
    second_out = [ln.split(" ", 2)[-1] for ln in text.splitlines() if ln.startswith(f"#{m} ")]
    assert "second step" in second_out and "no newline" in second_out
    assert text.index(f"\n#{n} [2/3]") < text.index(f"\n#{m} [3/3]")  # in the order they ran
    # the lint warning BuildKit sends about `ARG PARENT` (the build silences it: test_build_display)
    assert any("InvalidDefaultArgInFrom" in w for w in dec.warnings)
    assert "WARN: InvalidDefaultArgInFrom" in text
    assert hello.seconds() >= 1.9 and hello.done and not hello.running
    assert list(hello.lines) == ["hello", "partialred", "done"] and hello.count == 3
    assert dec.running() == [] and dec.current() is None


def test_cached_steps_say_cached():
    dec, text = decode("cached")
    for prefix in ("[2/3] RUN", "[3/3] RUN"):
        st = _step(dec, prefix)
        assert st.cached and f"#{st.number} CACHED" in text
    assert "hello" not in [ln.split(" ", 2)[-1] for ln in text.splitlines()]


def test_a_failed_step_keeps_its_error_and_buildx_summary():
    dec, text = decode("fail")
    bad = dec.error()
    assert bad is not None and bad.name == "[2/2] RUN echo before; sleep 1; exit 3"
    assert "exit code: 3" in bad.error
    assert f"#{bad.number} ERROR: process \"/bin/sh -c echo before; sleep 1; exit 3\" did not complete " \
           "successfully: exit code: 3" in text
    assert list(bad.lines) == ["before"]
    # buildx's own summary (not JSON) is kept as text
    assert ">>> RUN echo before; sleep 1; exit 3" in text
    assert text.rstrip().endswith("exit code: 3")
    assert not dec.warnings  # the fixture was recorded with BUILDKIT_DOCKERFILE_CHECK=skip=...


def test_output_split_across_messages_and_escapes():
    dec = progress_mod.Decoder()
    v = "sha256:" + "ab" * 32

    def log(data: bytes) -> str:
        return json.dumps({"logs": [{"vertex": v, "stream": 1, "data": base64.b64encode(data).decode(),
                                     "timestamp": "2026-12-01T15:27:55.5Z"}]}) + "\n"

    dec.feed(json.dumps({"vertexes": [{"digest": v, "name": "[1/1] RUN x",
                                       "started": "2026-12-01T15:27:55.000000001Z"}]}) + "\n")
    assert dec.feed(log(b"par")) == ""
    assert dec.feed(log(b"t\x1b[1mone\x1b[0m\r\ntwo\n")) == "#1 0.500 partone\n#1 0.500 two\n"
    dec.feed(log(b"\x1b]0;title\x07meter 50%"))
    st = dec.order[0]
    assert st.running and st.last_line() == "meter 50%" and dec.current() is st
    assert progress_mod.strip_ansi("\x1b[31mred\x1b[0m \x1b[2K\x1b[1Gok\r") == "red ok"
    assert dec.feed("not json at all\n") == "not json at all\n"
    assert dec.feed("{broken\n") == "{broken\n"


@pytest.mark.parametrize("env,requested,tty,want", [
    ({}, None, True, "tty"),
    ({}, None, False, "plain"),
    ({"BUILDKIT_PROGRESS": "quiet"}, None, True, "quiet"),
    ({"BUILDKIT_PROGRESS": "quiet", "IMAGEBUILD_PROGRESS": "rawjson"}, None, True, "rawjson"),
    ({"IMAGEBUILD_PROGRESS": "auto"}, None, False, "plain"),
    ({"IMAGEBUILD_PROGRESS": "quiet"}, "tty", False, "tty"),  # the flag wins
    ({"BUILDKIT_PROGRESS": "PLAIN"}, None, True, "plain"),
])
def test_the_mode_comes_from_the_flag_then_the_environment(monkeypatch, env, requested, tty, want):
    for k in progress_mod.PROGRESS_ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert progress_mod.resolve_mode(requested, isatty=tty) == want


def test_a_bad_mode_names_where_it_came_from(monkeypatch):
    monkeypatch.delenv("IMAGEBUILD_PROGRESS", raising=False)
    monkeypatch.setenv("BUILDKIT_PROGRESS", "fancy")
    with pytest.raises(UsageError, match="BUILDKIT_PROGRESS='fancy'"):
        progress_mod.resolve_mode(None)
    with pytest.raises(UsageError, match="--progress 'x'"):
        progress_mod.resolve_mode("x")


def _run_through(mode: str, name: str, upto: int | None = None, capsys=None, **kw) -> progress_mod.Progress:
    p = progress_mod.Progress(mode, **kw)
    p.every = 0
    p.begin(["first", "napper"])
    p.stage("napper")
    dec = progress_mod.Decoder()
    p.start("napper", "/logs/napper.log", decoder=dec)
    for ln in lines(name)[:upto]:
        p.feed(ln, dec, dec.feed(ln))
    return p


def test_plain_shows_each_step_once_started_and_once_done_not_its_output(capsys):
    p = _run_through("plain", "ok")
    p.stop()
    err = capsys.readouterr().err.splitlines()
    assert all(ln.startswith("napper | #") for ln in err), err
    body = [ln.split(" ", 3)[-1] for ln in err]
    assert any(b.startswith("[2/3] RUN echo hello") for b in body)
    assert any(b.startswith("[3/3] RUN echo second") for b in body)
    assert sum(1 for b in body if b.startswith("DONE") or b == "CACHED") >= 3
    assert "hello" not in body and "partialred" not in body and not any("[internal]" in b for b in body)
    assert any("WARN: InvalidDefaultArgInFrom" in ln for ln in err)


def test_the_heartbeat_names_the_running_step_its_time_and_its_last_output():
    # up to the log line of the first RUN step, before it completes
    cut = next(i for i, ln in enumerate(lines("ok")) if '"logs"' in ln) + 1
    p = _run_through("quiet", "ok", upto=cut)
    p._t0 -= 125  # the stage has run two minutes
    beat = p.heartbeat()
    assert beat.startswith("... napper: still building (0:02:0"), beat
    assert "step #" in beat and "[2/3] RUN echo hello" in beat
    assert re.search(r"last output \d+\.\ds ago: partialred", beat), beat
    assert beat.endswith("log: /logs/napper.log")


def test_a_silent_step_says_how_long_ago_it_printed_in_the_heartbeat_and_the_live_view():
    """Issue 35: a link step prints nothing for minutes; the heartbeat and the live view say when its
    last output line was written, not only what it was."""
    cut = next(i for i, ln in enumerate(lines("ok")) if '"logs"' in ln) + 1
    p = _run_through("quiet", "ok", upto=cut)
    st = p.row("napper").decoder.current()
    st.heard -= 100
    # (a loaded machine may take a few seconds between the lines: the figures are read as ranges)
    assert re.search(r", last output 1m4\ds ago: partialred, log: ", p.heartbeat()), p.heartbeat()
    st.heard -= 620
    assert re.search(r"last output 12m0\ds ago: partialred", p.heartbeat()), p.heartbeat()
    t = _run_through("tty", "ok", upto=cut, isatty=True)
    tst = t.row("napper").decoder.current()
    assert "ago" not in _render(t)  # a step that just printed: no such line
    tst.heard -= 100
    text = _render(t)
    assert re.search(r"^\s+partialred\n\s+\(last output 1m4\ds ago\)$", text, re.M), text


def test_a_step_with_no_output_yet_says_so():
    p = _run_through("quiet", "ok", upto=1)
    dec = p.row("napper").decoder
    st = progress_mod.Step("sha256:x", 99, "[2/2] RUN make", seen=time.monotonic() - 30)
    dec.order.append(st)
    dec.steps[st.digest] = st
    assert re.search(r"step #99 \[2/2\] RUN make \(0:00:3\d\), no output yet, log:", p.heartbeat()), p.heartbeat()


def _ours(err: str) -> tuple[list[dict], str]:
    """imagebuild's stage events, and the rest of a rawjson stream."""
    events, rest = [], []
    for ln in err.splitlines(keepends=True):
        doc = json.loads(ln)
        (events.append(doc["imagebuild"]) if "imagebuild" in doc else rest.append(ln))
    return events, "".join(rest)


def test_rawjson_passes_buildkits_lines_through(capsys):
    _run_through("rawjson", "ok")
    events, err = _ours(capsys.readouterr().err)
    assert err == "".join(lines("ok"))
    assert events == [{"event": "start", "stage": "napper", "index": 2, "of": 2, "state": "running"}]


def test_rawjson_carries_imagebuilds_stage_events_start_skip_done_failed(capsys):
    """Issue 35: a consumer of the stream can tell which stage a BuildKit line belongs to (the lines
    between a stage's start and its end), and a skipped stage leaves a trace."""
    p = progress_mod.Progress("rawjson")
    p.begin(["base", "app", "tests"], extra=("release",))
    p.stage("base")
    p.finish("base", "skipped", 0, note="stage with this key is built")
    p.stage("app")
    p.start("app", "/logs/app.log", decoder=progress_mod.Decoder())
    for ln in lines("ok"):
        p.feed(ln, p.row("app").decoder, "")
    p.stop()
    p.finish("app", "built", 2.5)
    p.stage("tests")
    p.finish("tests", "failed", 1.25)
    p.end("failed")
    events, rest = _ours(capsys.readouterr().err)
    assert rest == "".join(lines("ok"))
    assert [(e["event"], e["stage"], e["index"], e["of"]) for e in events] == [
        ("start", "base", 1, 3), ("skip", "base", 1, 3), ("start", "app", 2, 3), ("done", "app", 2, 3),
        ("start", "tests", 3, 3), ("failed", "tests", 3, 3)]
    assert events[1]["note"] == "stage with this key is built" and events[3]["seconds"] == 2.5
    assert events[3]["state"] == "built" and events[5]["state"] == "failed"


def test_rawjson_wraps_buildxs_own_text_lines_so_every_line_is_json(capsys):
    """A failed build: buildx ends with its error summary as text (the fixture's last lines); under
    rawjson each of them is one ``{"buildx": {"message": LINE}}``, BuildKit's lines pass unchanged."""
    _run_through("rawjson", "fail")
    out = capsys.readouterr().err.splitlines()[1:]  # after the stage's start event
    src = [ln.rstrip("\n") for ln in lines("fail")]
    assert len(out) == len(src)
    texts = [ln for ln in src if not ln.startswith("{")]
    assert len(texts) == 8
    for got, raw in zip(out, src, strict=True):
        doc = json.loads(got)
        assert doc == ({"buildx": {"message": raw}} if raw in texts else json.loads(raw))


def _render(p, width=120) -> str:
    from rich.console import Console

    from imagebuild.buildstep import live

    view = live.LiveView(p, clock=progress_mod.clock)
    view.console = Console(file=io.StringIO(), width=width, force_terminal=False, color_system=None)
    out = Console(file=io.StringIO(), width=width, color_system=None)
    out.print(view.render())
    return out.file.getvalue()


def test_the_live_view_shows_stages_the_running_step_its_timer_and_output():
    cut = next(i for i, ln in enumerate(lines("ok")) if '"logs"' in ln) + 1
    p = _run_through("tty", "ok", upto=cut, isatty=True)
    p.finish("first", "built", 3.1)
    p.stage("napper")
    st = p.row("napper").decoder.current()
    st.seen = time.monotonic() - 5
    first = _render(p)
    assert first.startswith("Building ") and ", stage 2/2" in first.splitlines()[0]
    assert "first" in first and "built" in first and "3.1s" in first
    assert "[2/3] RUN echo hello" in first and "partialred" in first
    assert " 5.0s" in first
    st.seen -= 60  # the timer moves while the step prints nothing
    later = _render(p)
    assert " 1m05s" in later and " 5.0s" not in later
    # done: the stage collapses to its line, the total says so
    for ln in lines("ok")[cut:]:
        p.row("napper").decoder.feed(ln)
    p.finish("napper", "built", 7.5)
    p.end("done")
    done = _render(p)
    assert done.startswith("Built in ") and "2/2 stages" in done
    assert "RUN echo hello" not in done and "7.5s" in done


def test_a_failed_stage_shows_its_failing_step_and_last_lines():
    p = _run_through("tty", "fail", isatty=True)
    p.finish("napper", "failed", 2.0)
    p.end("failed")
    text = _render(p, width=160)
    # which stage failed, and that the release was not reached (not "2/2 stages", read as all done)
    assert re.match(r"Failed in \S+ at stage napper \(2/2\); the release was not reached\n", text), text
    assert "stages" not in text.splitlines()[0]
    # the failing step and its RUN's exit code, once; its output is in the run's error below the view
    assert re.search(r"^\s+RUN exit 3 at #\d+ \[2/2\] RUN echo before; sleep 1; exit 3$", text, re.M), text
    assert "exit code: 3" not in text
    assert re.search(r"^\s+first\s+not reached$", text, re.M), text  # never started: not "waiting"


def test_plain_leaves_the_failure_to_the_runs_error_said_once(capsys):
    """Issue 35: plain printed the failing step's ERROR line and buildx's whole summary, and then the
    run's error said it all again; now only the run's error says it."""
    _run_through("plain", "fail")
    err = capsys.readouterr().err
    assert "RUN echo before; sleep 1; exit 3" in err  # the step's start line still
    assert "ERROR" not in err and "exit code: 3" not in err and "------" not in err, err


def test_the_timer_reads_at_a_glance():
    assert [progress_mod.clock(s) for s in (3.14, 42, 187, 7507)] == ["3.1s", "42s", "3m07s", "2h05m07s"]


def test_a_token_a_run_prints_reaches_neither_the_log_nor_the_display(monkeypatch):
    """A secret of the environment (GITHUB_TOKEN, ...) that a step prints, names or warns about is
    replaced in the log text, the step's last lines (live view, heartbeat) and its name."""
    token = "ghp_" + "Z" * 36
    monkeypatch.setenv("GITHUB_TOKEN", token)
    dec = progress_mod.Decoder()
    v = "sha256:" + "cd" * 32
    dec.feed(json.dumps({"vertexes": [{"digest": v, "name": f"[1/1] RUN echo {token}",
                                       "started": "2026-12-01T15:27:55.000000001Z"}]}) + "\n")
    text = dec.feed(json.dumps({"logs": [{"vertex": v, "stream": 1, "timestamp": "2026-12-01T15:27:55.5Z",
                                          "data": base64.b64encode(f"the token is {token}\n".encode()).decode()}]}) + "\n")
    text += dec.feed(json.dumps({"warnings": [{"vertex": v, "short": base64.b64encode(f"w {token}".encode()).decode()}]}) + "\n")
    text += dec.feed(f"ERROR: failed to solve: {token}\n")
    st = dec.order[0]
    seen = text + st.name + st.last_line() + " ".join(dec.warnings)
    assert token not in seen, seen
    assert "the token is [redacted]" in text and "[redacted]" in st.name and "w [redacted]" in dec.warnings
