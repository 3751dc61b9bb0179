"""plan's engine query (engine.ImageQuery): the engine's API on its Unix socket, asked while the
plan is computed, gives what the docker CLI gives; other endpoints go through the CLI."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from imagebuild import engine
from tests.conftest import BUSYBOX

pytestmark = pytest.mark.engine


@pytest.fixture
def tagged(engine_info):
    repo = f"imagebuild/ibq-{os.getpid()}"
    refs = [f"{repo}:a-0123456789abcdef", f"{repo}:b"]
    for ref in refs:
        subprocess.run(["docker", "tag", BUSYBOX, ref], check=True, capture_output=True)
    yield repo, set(refs)
    subprocess.run(["docker", "image", "rm", *refs], capture_output=True)


def test_socket_query_matches_the_cli(tagged, engine_info):
    repo, refs = tagged
    q = engine.ImageQuery(repo)
    assert q.path is not None, "the test engine is expected on a local Unix socket"
    asked = [*sorted(refs), f"{repo}:not-there", f"{repo}:a-0123456789abcdeX"]
    info, held = q.result(asked)
    assert info.reachable and held == refs == engine.existing_tags(repo)
    assert info.server_version == engine_info.server_version
    assert info.architecture == engine_info.architecture
    # an image id prefix or another repository's tag is not a stage image
    assert engine.ImageQuery(repo).result([f"{repo}x:b", BUSYBOX.split(":")[0]])[1] == set()


def test_a_docker_context_goes_through_the_cli(tagged, engine_info, tmp_path, monkeypatch):
    repo, refs = tagged
    sock = engine.local_socket()
    cfg = tmp_path / "docker-config"
    env = {**os.environ, "DOCKER_CONFIG": str(cfg)}
    subprocess.run(["docker", "context", "create", "ib-query", "--docker", f"host=unix://{sock}"], env=env,
                   check=True, capture_output=True)
    monkeypatch.setenv("DOCKER_CONFIG", str(cfg))
    monkeypatch.setenv("DOCKER_CONTEXT", "ib-query")
    q = engine.ImageQuery(repo)
    assert q.path is None
    info, held = q.result([*refs, f"{repo}:not-there"])
    assert info.reachable and held == refs
    # the same through config.json's currentContext
    monkeypatch.delenv("DOCKER_CONTEXT")
    (cfg / "config.json").write_text(json.dumps({"currentContext": "ib-query"}))
    assert engine.local_socket() is None


def test_unreachable_socket_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/none.sock")
    info, held = engine.ImageQuery("imagebuild/x").result(["imagebuild/x:a"])
    assert not info.reachable and held is None
    assert "Cannot connect to the Docker daemon" in info.detail and str(tmp_path) in info.detail
