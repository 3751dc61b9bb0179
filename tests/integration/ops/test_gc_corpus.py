"""The fault corpus of issue 34 (round three) that gc answers: a gate killed with kill -9 left its
temporary folder ($TMPDIR/imagebuild-gate-*) for ever. gc removes it now, and leaves a running gate's
folder alone (real gates against the real engine)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest

from tests.conftest import run_cli
from tests.integration.gate.test_gate import _gate_containers, _write, gate_image, state  # noqa: F401 - fixtures

pytestmark = [pytest.mark.engine]


def test_gc_removes_the_temporary_folder_of_a_gate_killed_with_9(gate_image, project, state, tmp_path,  # noqa: F811
                                                                 monkeypatch):
    spec = _write(tmp_path, "gate.yaml", "checks:\n  - {id: slow, kind: command, run: 'sleep 600'}\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, IMAGEBUILD_STATE_DIR=str(state), TMPDIR=str(tmp))
    argv = [sys.executable, "-m", "imagebuild", "gate", gate_image, "--spec", str(spec)]
    dead = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and not (_gate_containers(dead.pid) and list(tmp.glob("imagebuild-gate-*"))):
            time.sleep(0.2)
        left = list(tmp.glob("imagebuild-gate-*"))
        assert len(left) == 1, "the gate never made its folder"
        time.sleep(1.0)
        dead.kill()  # SIGKILL: its TemporaryDirectory is never removed
        dead.wait()
        live = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while time.monotonic() < deadline + 60 and len(list(tmp.glob("imagebuild-gate-*"))) < 2:
                time.sleep(0.2)
            running = [d for d in tmp.glob("imagebuild-gate-*") if d != left[0]]
            assert running, "the second gate never made its folder"
            time.sleep(1.0)
            monkeypatch.setattr(tempfile, "tempdir", str(tmp))
            r = run_cli("--root", str(project), "gc")
            assert r.code == 0, r.err
            assert not left[0].exists(), r.err  # the killed gate's folder
            assert running[0].exists()  # the running gate's, whose lock it holds
        finally:
            live.kill()
            live.wait()
            for c in _gate_containers(live.pid):
                subprocess.run(["docker", "rm", "-f", c], capture_output=True)
    finally:
        if dead.poll() is None:
            dead.kill()
            dead.wait()
        for c in _gate_containers(dead.pid):
            subprocess.run(["docker", "rm", "-f", c], capture_output=True)
