"""plan against a real Docker engine (BuildKit, containerd store) and the real CLI process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from imagebuild.core import engine
from imagebuild.definition import reader as definition
from imagebuild.plan import planner as plan
from tests.conftest import BUSYBOX, run_cli

pytestmark = pytest.mark.engine

IMG = "docker-images/tiny"


def test_engine_is_buildkit_with_containerd_store(engine_ready):
    assert engine_ready.containerd_store, engine_ready
    out = subprocess.run(["docker", "buildx", "version"], capture_output=True, text=True, check=True).stdout
    assert "buildx" in out


def test_plan_reports_built_stages_from_the_stage_store(project, engine_ready):
    p = plan.make_plan(definition.load(project, "tiny"))
    assert p.stage("base").build_args()["PARENT"] == BUSYBOX
    res = run_cli("--root", str(project), "build", "tiny", "--until", "base")
    assert res.code == 0, res.err
    res = run_cli("--root", str(project), "plan", "tiny", "--json")
    assert res.code == 0, res.err
    data = json.loads(res.out)
    assert data["engine"]["reachable"] is True
    assert [s["exists"] for s in data["stages"]] == [True, False, False, False]
    text = run_cli("--root", str(project), "plan", "tiny")
    assert "1. base  [built]" in text.out and "2. tools  [to build]" in text.out


def test_plan_creates_nothing_in_the_engine_or_on_disk(project, engine_ready):
    from imagebuild.core import state
    from tests.conftest import tree_state

    # only this definition's repository: other processes may use the shared engine meanwhile
    ls = ["docker", "image", "ls", "-a", "--no-trunc", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}",
          "imagebuild/tiny"]
    before = subprocess.run(ls, capture_output=True, text=True, check=True).stdout
    files = tree_state(project), tree_state(state.stages_dir())
    assert run_cli("--root", str(project), "plan", "tiny").code == 0
    after = subprocess.run(ls, capture_output=True, text=True, check=True).stdout
    assert before == after
    assert (tree_state(project), tree_state(state.stages_dir())) == files


def test_plan_works_without_an_engine(project, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    res = run_cli("--root", str(project), "plan", "tiny", "--json")
    assert res.code == 0, res.err
    data = json.loads(res.out)
    assert data["engine"]["reachable"] is False
    assert all(isinstance(s["exists"], bool) for s in data["stages"])  # the stage store needs no engine
    assert "no Docker engine reachable" in res.err


def test_real_process_stdout_is_data_stderr_is_logs(project, engine_ready):
    r = subprocess.run([sys.executable, "-m", "imagebuild", "--root", str(project), "plan", "tiny", "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0
    json.loads(r.stdout)
    bad = subprocess.run([sys.executable, "-m", "imagebuild", "--root", str(project), "plan", "../x"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stdout == "" and "invalid image name" in bad.stderr


def test_example_definition_plans(engine_ready):
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    res = run_cli("--root", str(root), "plan", "example", "--json")
    assert res.code == 0, res.err
    assert [s["name"] for s in json.loads(res.out)["stages"]] == ["toolchain", "app", "runner"]


def test_doctor_on_this_host(engine_ready):
    res = run_cli("doctor", "--json")
    data = json.loads(res.out)
    by = {c["name"]: c for c in data["checks"]}
    assert by["engine"]["status"] == "ok"
    assert by["image store"]["status"] == "ok"
    assert by["buildx"]["status"] == "ok"
    assert by["git"]["status"] == "ok"
    assert res.code == (1 if any(c["status"] == "fail" for c in data["checks"]) else 0)


def test_doctor_unreachable_peer_fails_with_advice(engine_ready):
    res = run_cli("doctor", "--peer", "root@127.0.0.1")
    assert res.code == 1
    assert "peer root@127.0.0.1" in res.out and "->" in res.out


def test_doctor_without_engine_says_what_to_do(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    res = run_cli("doctor")
    assert res.code == 1
    assert "FAIL  engine" in res.out and "start dockerd" in res.out
    assert engine.probe().reachable is False


def test_doctor_checks_a_real_peer(engine_ready, peer, monkeypatch, tmp_path):
    monkeypatch.setenv("IMAGEBUILD_SSH", peer.ssh_env)
    root = tmp_path / "proj"
    (root / "docker-images").mkdir(parents=True)
    (root / "imagebuild.yaml").write_text(f"peers: [{peer.addr}]\n")
    res = run_cli("--root", str(root), "doctor", "--json")
    by = {c["name"]: c for c in json.loads(res.out)["checks"]}
    assert by[f"peer {peer.addr}"]["status"] == "ok", by
    assert "Docker 26" in by[f"peer {peer.addr}"]["detail"] or "Docker" in by[f"peer {peer.addr}"]["detail"]
    assert by[f"peer {peer.addr} rsync"]["status"] == "ok"
    # the peer's engine is its own: a tag made on this host is not there (the base image itself may be:
    # the session's peer is shared, and the fleet tests build on its engine)
    import uuid

    only_here = f"imagebuild-test/only-here:{uuid.uuid4().hex[:12]}"
    subprocess.run(["docker", "tag", "imagebuild-test/busybox:1", only_here], check=True)
    try:
        assert peer.docker("image", "inspect", only_here).returncode != 0
    finally:
        subprocess.run(["docker", "image", "rm", only_here], capture_output=True)


def test_project_config_errors_name_the_line(tmp_path):
    root = tmp_path / "proj"
    (root / "docker-images").mkdir(parents=True)
    (root / "imagebuild.yaml").write_text("peers: [dgx4]\npeerz: []\n")
    res = run_cli("--root", str(root), "doctor")
    assert res.code == 2
    assert "imagebuild.yaml:2: peerz: unknown key" in res.err and "did you mean 'peers'" in res.err
