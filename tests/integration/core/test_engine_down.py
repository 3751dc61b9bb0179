"""With the engine down, `doctor`, `build` and `plan` say why in words, never with the raw
`docker info` JSON (issue 9, section 8). Uses the real docker CLI against a dead socket."""

from __future__ import annotations

import json
import shutil
import socket

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.skipif(shutil.which("docker") is None, reason="needs the docker CLI")


@pytest.fixture(params=["missing", "refused"])
def dead_engine(request, tmp_path, monkeypatch):
    path = tmp_path / "dead.sock"
    sock = None
    if request.param == "refused":  # a socket file nobody accepts on
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
    monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
    yield f"unix://{path}"
    if sock is not None:
        sock.close()


def _readable(text: str, host: str) -> None:
    assert "{" not in text and "ClientInfo" not in text and "ServerVersion" not in text, text
    assert "Cannot connect to the Docker daemon" in text or "connection refused" in text.lower(), text
    assert host in text


def test_doctor_says_why(dead_engine):
    res = run_cli("doctor")
    assert res.code == 1
    line = next(ln for ln in res.out.splitlines() if ln.startswith("FAIL") and "engine" in ln)
    _readable(line, dead_engine)
    assert f"start dockerd listening at DOCKER_HOST={dead_engine}, or unset DOCKER_HOST" in res.out


def test_doctor_json_says_why(dead_engine):
    import json

    res = run_cli("doctor", "--json")
    check = next(c for c in json.loads(res.out)["checks"] if c["name"] == "engine")
    assert check["status"] == "fail"
    _readable(check["detail"], dead_engine)


def test_build_says_why(project, dead_engine):
    res = run_cli("--root", str(project), "build", "tiny")
    assert res.code == 1, res
    assert "Traceback" not in res.err
    _readable(res.err, dead_engine)


def test_plan_says_why_and_still_plans(project, dead_engine):
    res = run_cli("--root", str(project), "plan", "tiny", "--json")
    assert res.code == 0, res.err
    import json

    engine = json.loads(res.out)["engine"]
    assert engine["reachable"] is False
    _readable(engine["detail"], dead_engine)


def _no_git_image(root) -> str:
    d = root / "docker-images" / "bare"
    d.mkdir(parents=True)
    (d / "versions.env").write_text("BASE_IMAGE=imagebuild-test/busybox:1\n")
    (d / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: one\n    from: BASE_IMAGE\n")
    (d / "Dockerfile.one").write_text("ARG PARENT\nFROM ${PARENT}\nRUN true\n")
    return "bare"


def test_prefetch_says_the_engine_is_unreachable_not_the_registry(project, dead_engine):
    """Issue 35: a base to pin with no engine: the engine is unreachable (as build and doctor say),
    not "its registry does not answer"."""
    name = _no_git_image(project)
    res = run_cli("--root", str(project), "prefetch", name)
    assert res.code == 1, res
    assert "no Docker engine reachable" in res.err and "registry does not answer" not in res.err, res.err
    _readable(res.err, dead_engine)


def test_nightly_says_the_engine_is_unreachable_once(project, dead_engine, tmp_path):
    """Issue 35: the night says it once (and once per image in its summary), never "registry does not
    answer" three times, and runs no step that needs the engine."""
    name = _no_git_image(project)
    res = run_cli("--root", str(project), "nightly", name, "tiny", "--report-dir", str(tmp_path / "r"))
    assert res.code == 1, res
    text = res.out + res.err
    assert "registry does not answer" not in text and "gc failed" not in text, text
    assert "== " not in res.err  # no image's chain started
    said = [ln for ln in text.splitlines() if "no Docker engine reachable" in ln]
    assert len(said) == 3, said  # the run's error, then each image's line in the summary
    assert "sync: not-run (the engine is unreachable: nothing was built)" in text
    doc = json.loads(next((tmp_path / "r").glob("*.json")).read_text())
    assert [i["status"] for i in doc["images"]] == ["failed", "failed"]
    assert doc["disk"]["gc_skipped"] == "the engine is unreachable"
