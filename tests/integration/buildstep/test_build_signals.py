"""Runs that end badly leave nothing behind, two builds of one image never run at once, and long
runs show life (issue 9, item 7). Real processes, real signals, the real engine."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.buildfixtures import remove_images
from tests.conftest import run_cli

pytestmark = pytest.mark.engine

IMAGE = "slow"
REPO = Path(__file__).resolve().parents[3]


def slow_project(root: Path, sleep: int = 60, bulk: int = 0) -> Path:
    """``bulk``: that many small files in the napper stage's context (a temp folder that takes a
    while to remove)."""
    d = root / "docker-images" / IMAGE
    d.mkdir(parents=True)
    (d / "versions.env").write_text(f"BASE_IMAGE=imagebuild-test/busybox:1\nSLEEP={sleep}\n")
    (d / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: first\n    from: BASE_IMAGE\n"
                                  "  - name: napper\n    from: first\n" + ("    files: [bulk]\n" if bulk else ""))
    for i in range(bulk):
        (d / "bulk" / f"{i // 100}").mkdir(parents=True, exist_ok=True)
        (d / "bulk" / f"{i // 100}" / f"f{i}").write_text(f"{i}\n")
    (d / "Dockerfile.first").write_text("ARG PARENT\nFROM ${PARENT}\nRUN echo first > /first\n")
    (d / "Dockerfile.napper").write_text("ARG PARENT\nFROM ${PARENT}\nARG SLEEP\n"
                                         "RUN echo start-napping-$SLEEP && sleep $SLEEP && echo done > /napped\n")
    return root


def _start(root: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "imagebuild", "--root", str(root), "build", IMAGE, "--no-gate",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, **(env or {})}, start_new_session=True,
                            preexec_fn=_sigint_default)


def _sigint_default() -> None:
    """SIGINT back to its default in the child: a suite started with it ignored (``nohup make test &``,
    a background job) hands SIG_IGN on, and imagebuild, rightly, keeps an ignored SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for(proc: subprocess.Popen, text: str, timeout: float = 90) -> list[str]:
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if text in line:
            return seen
    raise AssertionError(f"{text!r} never appeared; stderr so far:\n{''.join(seen)}")


def _children(pid: int) -> list[tuple[int, str]]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    procs = [(int(p), int(pp), a) for p, pp, a in (ln.split(None, 2) for ln in out.splitlines() if ln.strip())]
    found, todo = [], [pid]
    while todo:
        cur = todo.pop()
        for p, pp, a in procs:
            if pp == cur:
                found.append((p, a))
                todo.append(p)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    st = Path(f"/proc/{pid}/stat")
    return st.exists() and st.read_text().split()[2] != "Z"


@pytest.fixture
def slow(tmp_path, engine_info):
    root = slow_project(tmp_path / "p")
    yield root
    remove_images(f"imagebuild/{IMAGE}", IMAGE)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_stops_buildx_and_removes_the_run_temp(slow, sig):
    proc = _start(slow, "--no-cache", "--progress", "plain")
    try:
        _wait_for(proc, "start-napping")
        kids = [(p, a) for p, a in _children(proc.pid) if "buildx" in a]
        assert kids, _children(proc.pid)
        assert list((slow / ".imagebuild" / "tmp").glob("build-slow-*"))
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
        assert rc == 130, proc.stderr.read()
        assert time.monotonic() - t0 < 20
        assert not any(_alive(p) for p, _ in kids), "docker buildx build survived the signal"
        assert not list((slow / ".imagebuild" / "tmp").glob("build-slow-*"))
        rec = json.loads(next((slow / ".imagebuild" / "builds" / IMAGE).glob("*/record.json")).read_text())
        assert rec["status"] == "interrupted"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _leftovers(root: Path) -> list[Path]:
    """What a run may leave only when its cleanup was cut short: its temp folder, a half-written
    record's temp file."""
    state = root / ".imagebuild"
    return sorted([*(state / "tmp").glob("*"), *state.rglob("*.tmp"), *state.rglob(".*.tmp")])


BURSTS = {
    "SIGINT,SIGINT,SIGTERM/50ms": ([signal.SIGINT, signal.SIGINT, signal.SIGTERM], 0.05),
    "20xSIGINT/10ms": ([signal.SIGINT] * 20, 0.01),
}


@pytest.mark.parametrize("burst", list(BURSTS), ids=list(BURSTS))
def test_signals_after_the_first_do_not_cut_its_cleanup_short(tmp_path, engine_info, burst):
    """Issue 22: the second (and twentieth) signal arrives while the first one's cleanup runs. It
    must not break that cleanup (buildx stopped, temp folder gone, record ``interrupted``) nor
    turn the exit into a death by signal (143, -2): the first signal's 130 stands."""
    sigs, gap = BURSTS[burst]
    # a context of 6000 files: the temp folder takes longer to remove than the burst takes to arrive
    slow = slow_project(tmp_path / "p", bulk=6000)
    # its own lock folder: another checkout's suite may be building an image named "slow" on this engine
    proc = _start(slow, "--no-cache", "--progress", "plain", env={"IMAGEBUILD_LOCK_DIR": str(tmp_path / "locks")})
    try:
        _wait_for(proc, "start-napping")
        kids = [(p, a) for p, a in _children(proc.pid) if "buildx" in a]
        assert kids and list((slow / ".imagebuild" / "tmp").glob("build-slow-*"))
        for sig in sigs:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:  # already gone: the rest of the burst reaches nobody
                break
            time.sleep(gap)
        rc = proc.wait(timeout=30)
        err = proc.stderr.read()
        assert rc == 130, (rc, err)
        assert err.rstrip().endswith("interrupted"), err
        assert "Traceback" not in err and "internal error" not in err, err
        assert not any(_alive(p) for p, _ in kids), "docker buildx build survived the signals"
        assert _leftovers(slow) == []
        rec = json.loads(next((slow / ".imagebuild" / "builds" / IMAGE).glob("*/record.json")).read_text())
        assert rec["status"] == "interrupted"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        remove_images(f"imagebuild/{IMAGE}", IMAGE)


def test_after_kill_9_the_next_build_removes_what_the_dead_run_left(slow):
    proc = _start(slow, "--no-cache", "--progress", "plain")
    _wait_for(proc, "start-napping")
    kids = [p for p, a in _children(proc.pid) if "buildx" in a]
    proc.kill()  # kill -9: no chance to clean up
    proc.wait()
    for p in kids:  # the orphaned client too (its build is cancelled with its session)
        try:
            os.killpg(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    left = list((slow / ".imagebuild" / "tmp").glob("build-slow-*"))
    assert left
    env = (slow / "docker-images" / IMAGE / "versions.env")
    env.write_text(env.read_text().replace("SLEEP=60", "SLEEP=1"))
    res = run_cli("--root", str(slow), "build", IMAGE, "--no-gate")
    assert res.code == 0, res.err
    assert "left by an earlier run that did not end cleanly" in res.err
    assert not any(p.exists() for p in left)


def test_two_clones_sharing_one_engine_cannot_build_the_same_image_at_once(slow, tmp_path):
    other = slow_project(tmp_path / "clone2", sleep=2)
    proc = _start(slow, "--no-cache", "--progress", "plain")
    try:
        _wait_for(proc, "start-napping")
        res = run_cli("--root", str(other), "build", IMAGE, "--no-gate")  # its own state folder
        assert res.code == 3, res.err
        assert "another build of 'slow' is running" in res.err and f"pid {proc.pid}" in res.err
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert run_cli("--root", str(other), "build", IMAGE, "--no-gate").code == 0


def test_progress_plain_prefixes_every_line_and_auto_beats(slow):
    env = slow / "docker-images" / IMAGE / "versions.env"
    env.write_text(env.read_text().replace("SLEEP=60", "SLEEP=4"))
    proc = _start(slow, "--no-cache", "--progress", "plain")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert any(ln.startswith("first | #") for ln in err.splitlines())
    assert any(ln.startswith("napper | ") and "start-napping-4" in ln for ln in err.splitlines())
    # auto, stderr not a terminal: plain, a line per step but not the steps' output, and a heartbeat
    # naming the stage, the time and the log
    proc = _start(slow, "--no-cache", env={"IMAGEBUILD_HEARTBEAT_S": "1"})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert not any(re.match(r"\w+ \| #\d+ \d+\.\d+ ", ln) for ln in err.splitlines()), err
    beats = [ln for ln in err.splitlines() if "still building" in ln]
    assert beats and any("napper: still building" in b for b in beats), beats
    # each beat names its own stage's log (a loaded machine may beat during `first` too)
    for b in beats:
        stage = b.split(": still building")[0].split()[-1]
        assert ".imagebuild/builds/slow/" in b and b.endswith(f"/logs/{stage}.log"), b
    # -v adds every command run (and streams the logs, as plain does)
    r = subprocess.run([sys.executable, "-m", "imagebuild", "-v", "--root", str(slow), "build", IMAGE, "--no-gate",
                        "--no-cache"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "+ docker buildx build" in r.stderr and "napper | " in r.stderr


CC_DOCKERFILE = """\
ARG PARENT
FROM ${PARENT}
COPY src/ /src/
RUN --mount=type=cache,id=CACHE_ID,target=/ccache \\
    export CCACHE_DIR=/ccache CCACHE_SLOPPINESS=include_file_ctime,include_file_mtime,time_macros \\
    && ccache --zero-stats >/dev/null \\
    && for f in /src/*.cpp; do ccache g++ -O1 -c "$f" -o "/tmp/$(basename "$f" .cpp).o"; done \\
    && ccache --print-stats > /ccache-stats.txt
"""


def test_ccache_survives_no_cache(engine_info, tmp_path):
    """--no-cache drops BuildKit's instruction cache, not a cache mount: the second, --no-cache build
    of a C++ stage compiles every file from ccache."""
    import uuid

    root = tmp_path / "p"
    d = root / "docker-images" / "ccdemo"
    (d / "src").mkdir(parents=True)
    (d / "versions.env").write_text("BASE_IMAGE=imagebuild-test/debian:bookworm\n")
    (d / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: compile\n    from: BASE_IMAGE\n"
                                  "    files: [src]\n")
    (d / "Dockerfile.compile").write_text(CC_DOCKERFILE.replace("CACHE_ID", f"imagebuild-test-{uuid.uuid4().hex}"))
    for i in range(4):
        (d / "src" / f"f{i}.cpp").write_text(f"#include <vector>\nint f{i}() {{ std::vector<int> v({i}); "
                                             "return (int)v.size(); }\n")

    def stats(*args):
        res = run_cli("--root", str(root), "build", "ccdemo", "--no-gate", *args)
        assert res.code == 0, res.err
        out = subprocess.run(["docker", "run", "--rm", "--network", "none", "ccdemo:candidate", "cat",
                              "/ccache-stats.txt"], capture_output=True, text=True, check=True).stdout
        vals = dict(ln.split("\t", 1) for ln in out.splitlines() if "\t" in ln)
        hits = int(vals.get("direct_cache_hit", 0)) + int(vals.get("preprocessed_cache_hit", 0))
        return hits, int(vals.get("cache_miss", 0))

    try:
        # both with --no-cache, so that both really compile: BuildKit's own cache key of a RUN step does not
        # include a cache mount's id, and an earlier run of this test would otherwise answer the first one
        hits, misses = stats("--no-cache")
        assert (hits, misses) == (0, 4)
        hits, misses = stats("--no-cache")
        assert (hits, misses) == (4, 0)  # a 100 % hit rate: the compiler cache survived --no-cache
    finally:
        remove_images("imagebuild/ccdemo", "ccdemo")


def _gate_containers_of(pid: int) -> list[str]:
    import socket

    out = subprocess.run(["docker", "ps", "-a", "--filter", f"label=imagebuild.gate.owner={socket.gethostname()}:{pid}",
                          "--format", "{{.Names}}"], capture_output=True, text=True, check=True).stdout
    return out.split()


def test_after_kill_9_in_its_gate_the_next_build_reaps_the_container_and_the_record(tmp_path, engine_info,
                                                                                    monkeypatch):
    """Issue 21: a build killed with -9 while its gate ran left the gate's keep-alive container sleeping
    forever (gc then kept the build "used by a container") and its record ``running`` forever. The
    next build of the image removes the container (its owner pid is gone) and records the run
    ``abandoned``; ``log`` reads it so even before."""
    from tests.fleetfixtures import fleet_project, remove_fleet_images, unique_name

    name = unique_name("reap")
    root = fleet_project(tmp_path / "p", name)
    gate_yaml = root / "docker-images" / name / "gate.yaml"
    gate_yaml.write_text("checks:\n  - {id: nap, kind: command, run: 'sleep 600'}\n")
    env = {"IMAGEBUILD_STAGES": str(tmp_path / "stages"), "IMAGEBUILD_NO_GPU": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with open(tmp_path / "first.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "imagebuild", "--root", str(root), "build", name,
                                 "--progress", "plain"], stdout=subprocess.DEVNULL, stderr=err, cwd=REPO,
                                env={**os.environ, **env}, start_new_session=True)
    left: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not left:
            time.sleep(0.5)
            left = _gate_containers_of(proc.pid)
        assert left, (tmp_path / "first.err").read_text()
        time.sleep(1.0)  # the check runs inside it
        proc.kill()  # kill -9: no cleanup runs
        proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its docker exec clients too
        time.sleep(1.0)
        assert _gate_containers_of(proc.pid) == left  # nothing removed it
        rec_path = next((root / ".imagebuild" / "builds" / name).glob("*/record.json"))
        assert json.loads(rec_path.read_text())["status"] == "running"
        res = run_cli("--root", str(root), "log", name, "--json")
        assert res.code == 0 and [r["status"] for r in json.loads(res.out)["runs"]] == ["abandoned"]

        gate_yaml.write_text("checks:\n  - {id: quick, kind: command, run: 'true'}\n")
        res = run_cli("--root", str(root), "build", name, "--json")
        assert res.code == 0, res.err
        assert _gate_containers_of(proc.pid) == []
        assert "is gone, killed before it could" in res.err
        rec = json.loads(rec_path.read_text())
        assert rec["status"] == "abandoned" and str(proc.pid) in rec["abandoned"]
        assert f"recorded as abandoned (its process {rec['owner']} is gone" in res.err
        assert json.loads(res.out)["owner"].endswith(f":{os.getpid()}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for c in left:
            subprocess.run(["docker", "rm", "-f", c], capture_output=True)
        remove_fleet_images(name)
