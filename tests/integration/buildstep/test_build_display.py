"""What a build shows (issue 23, section 1): BuildKit's structured progress read from the real
engine, a heartbeat naming the running step off a terminal, ANSI-free stage logs with no lint
warning about the project's own ``ARG PARENT``, named history records, and the live view on a
terminal (a real tmux pane)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.buildfixtures import remove_images

pytestmark = pytest.mark.engine

IMAGE = "display"
REPO = Path(__file__).resolve().parents[3]
NAPPER = ("ARG PARENT\nFROM ${PARENT}\nARG SLEEP\n"
          "RUN echo start-napping-$SLEEP && sleep $SLEEP && echo woke > /napped\n")


def display_project(root: Path, sleep: int) -> Path:
    d = root / "docker-images" / IMAGE
    d.mkdir(parents=True)
    (d / "versions.env").write_text(f"BASE_IMAGE=imagebuild-test/busybox:1\nSLEEP={sleep}\n")
    (d / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: first\n    from: BASE_IMAGE\n"
                                  "  - name: napper\n    from: first\n")
    # coloured output, as compilers and pip print it on a terminal
    (d / "Dockerfile.first").write_text("ARG PARENT\nFROM ${PARENT}\n"
                                        "RUN printf '\\033[31mcolour\\033[0m text\\n' && echo first > /first\n")
    (d / "Dockerfile.napper").write_text(NAPPER)
    return root


@pytest.fixture
def proj(tmp_path, engine_info):
    yield tmp_path / "p"
    remove_images(f"imagebuild/{IMAGE}", IMAGE)


def _cli(root: Path, *args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    # --force: a serving container another test runs on this shared engine does not stop these builds
    return subprocess.run([sys.executable, "-m", "imagebuild", "--root", str(root), "build", IMAGE, "--no-gate",
                           "--no-cache", "--force", *args], capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _run_dir(root: Path) -> Path:
    return max((root / ".imagebuild" / "builds" / IMAGE).iterdir())


def test_plain_beats_with_the_running_step_and_its_last_line_and_logs_are_clean(proj):
    display_project(proj, sleep=6)
    r = _cli(proj, "--progress", "plain", env={"IMAGEBUILD_HEARTBEAT_S": "1", "NO_COLOR": ""})
    assert r.returncode == 0, r.stderr
    err = r.stderr.splitlines()
    assert "\x1b" not in r.stderr
    beats = [ln for ln in err if ln.startswith("... napper: still building")]
    assert len(beats) >= 3, r.stderr
    # the running step by its number and name, its own time, its last output line, the stage's log
    step = re.compile(r"step #\d+ \[1/2\] RUN echo start-napping-6 .*\((0:00:0\d)\), last output \d+\.\ds ago: "
                      r"start-napping-6, log: .*/logs/napper\.log$")
    matched = [m for m in map(step.search, beats) if m]
    assert len(matched) >= 3, beats
    assert matched[0].group(1) < matched[-1].group(1)  # the step's timer moved
    # a line per step, not the steps' output
    assert any(re.fullmatch(r"napper \| #\d+ \[1/2\] RUN echo start-napping-6 .*", ln) for ln in err), r.stderr
    assert any(re.fullmatch(r"first \| #\d+ DONE \d+\.\ds", ln) for ln in err), r.stderr
    assert not any(re.match(r"\w+ \| #\d+ \d+\.\d+ ", ln) for ln in err), r.stderr
    # the log files: the full output, decoded, without escapes, and no lint warning about ARG PARENT
    logs = _run_dir(proj) / "logs"
    first = (logs / "first.log").read_text()
    napper = (logs / "napper.log").read_text()
    for text in (first, napper, (logs / "release.log").read_text()):
        assert "\x1b" not in text
        assert "InvalidDefaultArgInFrom" not in text and "WARN" not in text
    assert re.search(r"^#\d+ \d+\.\d+ colour text$", first, re.M), first
    assert re.search(r"^#\d+ \d+\.\d+ start-napping-6$", napper, re.M), napper
    assert re.search(r"^#\d+ DONE [6-9]\.\ds$", napper, re.M), napper


def test_history_records_are_named_image_slash_stage(proj):
    display_project(proj, sleep=0)
    r = _cli(proj, "--progress", "quiet")
    assert r.returncode == 0, r.stderr
    names = subprocess.run(["docker", "buildx", "history", "ls", "--no-trunc", "--format", "{{.Name}}"],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert {f"{IMAGE}/first", f"{IMAGE}/napper", f"{IMAGE}/release"} <= set(names), names[:20]


def test_a_failing_step_is_in_the_log_with_its_exit_code(proj):
    display_project(proj, sleep=0)
    (proj / "docker-images" / IMAGE / "Dockerfile.napper").write_text(
        "ARG PARENT\nFROM ${PARENT}\nRUN echo about-to-fail && exit 7\n")
    r = _cli(proj, "--progress", "plain")
    assert r.returncode == 1, r.stderr
    log = (_run_dir(proj) / "logs" / "napper.log").read_text()
    assert "\x1b" not in log
    assert re.search(r"^#\d+ \d+\.\d+ about-to-fail$", log, re.M), log
    assert re.search(r"^#\d+ ERROR: process .* did not complete successfully: exit code: 7$", log, re.M), log
    # issue 35: the CLI says it once and plainly: the stage, the place, the RUN's own exit code (never a
    # bare "exit 7", nor buildx's 1 first), the step's own output lines, then the log; not BuildKit's
    # load/metadata boilerplate, and not the whole failure twice (plain printed buildx's summary too)
    err = r.stderr
    # the place in the stage's own Dockerfile (not in the one BuildKit got, with ARG SOURCE_DATE_EPOCH added)
    assert re.search(r"^error: stage 'napper' of display failed at docker-images/display/Dockerfile\.napper:3: "
                     r"RUN exit 7$", err, re.M), err
    assert re.search(r"^  step: \[1/2\] RUN echo about-to-fail && exit 7$", err, re.M), err
    assert re.findall(r"^  \| .*$", err, re.M) == ["  | about-to-fail"], err
    assert re.search(r"^  hint: full log: \S+/logs/napper\.log; the release was not reached", err, re.M), err
    assert "exit code: 7" not in err and "buildx build exit" not in err and "load build definition" not in err
    assert "------" not in err and not re.search(r"^  \| #\d+ ", err, re.M), err


def _pane(sock: Path) -> str:
    return subprocess.run(["tmux", "-S", str(sock), "capture-pane", "-p", "-t", "build"], capture_output=True,
                          text=True).stdout


def _wait_pane(sock: Path, pred, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = _pane(sock)
        if pred(text):
            return text
        time.sleep(0.3)
    raise AssertionError(f"the pane never showed it; last capture:\n{text}")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_on_a_terminal_the_live_view_shows_the_running_step_with_a_moving_timer(proj, tmp_path):
    display_project(proj, sleep=8)
    sock = tmp_path / "tmux.sock"  # a private server: it inherits this test's environment
    script = tmp_path / "run.sh"
    script.write_text(f"#!/bin/sh\ncd {REPO}\n{sys.executable} -m imagebuild --root {proj} build {IMAGE} "
                      "--no-gate --no-cache --force\necho \"EXIT $?\"\nsleep 300\n")
    script.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("IMAGEBUILD_PROGRESS", "BUILDKIT_PROGRESS", "NO_COLOR")}
    env["TERM"] = "xterm-256color"
    subprocess.run(["tmux", "-S", str(sock), "new-session", "-d", "-s", "build", "-x", "160", "-y", "40",
                    str(script)], check=True, env=env)
    try:
        running = re.compile(r"#\d+ \[1/2\] RUN echo start-napping-8 .*?\s(\d+\.\ds)\s*$", re.M)
        a = _wait_pane(sock, lambda t: running.search(t) and re.search(r"^\s+start-napping-8$", t, re.M), 120)
        time.sleep(2.5)
        b = _pane(sock)
        for cap in (a, b):
            assert re.search(r"^Building \S+, stage 2/2$", cap, re.M), cap
            assert re.search(r"^ ✔ first\s+built\s+\S+s$", cap, re.M), cap
            assert re.search(r"^\s+start-napping-8$", cap, re.M), cap  # the step's last output line
            assert not re.search(r"\| #\d+ ", cap), cap  # not BuildKit's plain lines
        ta, tb = (float(running.search(c).group(1).rstrip("s")) for c in (a, b))
        assert tb - ta >= 1.5, (a, b)  # the timer moves while the step prints nothing
        end = _wait_pane(sock, lambda t: "EXIT " in t, 120)
        assert "EXIT 0" in end, end
        assert re.search(r"^Built in \S+, 2/2 stages$", end, re.M), end
        assert re.search(r"^ ✔ napper\s+built\s+\S+s$", end, re.M), end
        assert "RUN echo start-napping" not in end  # collapsed when done
    finally:
        subprocess.run(["tmux", "-S", str(sock), "kill-server"], capture_output=True)


def test_rawjson_stderr_is_json_lines_only_buildkits_and_imagebuilds_own(proj):
    """--progress rawjson, a real build that fails in its second stage: every stderr line is one JSON
    object: BuildKit's (vertexes, statuses, logs), buildx's own error summary wrapped as {"buildx":
    {message}}, and imagebuild's wrapped as {"imagebuild": {level, message}}: its notes and the final
    error, which names the failing stage."""
    display_project(proj, sleep=0)
    (proj / "docker-images" / IMAGE / "Dockerfile.napper").write_text(
        "ARG PARENT\nFROM ${PARENT}\nRUN echo about-to-fail && exit 7\n")
    r = _cli(proj, "--progress", "rawjson")
    assert r.returncode == 1, r.stderr
    docs = []
    for ln in r.stderr.splitlines():
        try:
            docs.append(json.loads(ln))
        except ValueError:
            pytest.fail(f"not a JSON line: {ln!r}\n{r.stderr[-2000:]}")
    buildkit = [d for d in docs if "imagebuild" not in d and "buildx" not in d]
    ours = [d["imagebuild"] for d in docs if "imagebuild" in d]
    assert any(d.get("vertexes") for d in buildkit) and any(d.get("logs") for d in buildkit)
    # buildx's own error summary, as text lines, wrapped
    assert any("exit code: 7" in d["buildx"]["message"] for d in docs if "buildx" in d)
    said = [d for d in ours if "event" not in d]
    assert said and all(set(d) == {"level", "message"} for d in said)
    errors = [d["message"] for d in said if d["level"] == "error"]
    assert len(errors) == 1 and "napper" in errors[0] and "RUN exit 7" in errors[0], ours
    # issue 35: imagebuild's own stage events: each stage's start and end, around its BuildKit lines
    events = [(d["event"], d["stage"]) for d in ours if "event" in d]
    assert events == [("start", "first"), ("done", "first"), ("start", "napper"), ("failed", "napper")], events
    at = [i for i, d in enumerate(docs) if d.get("imagebuild", {}).get("event")]
    for a, z in (at[0:2], at[2:4]):  # each stage's BuildKit lines lie between its start and its end
        assert z - a > 3 and all("imagebuild" not in d for d in docs[a + 1:z]), docs[a:z + 1]
