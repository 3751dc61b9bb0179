"""plan's engine question (engine.EngineQuery): the engine's API on its Unix socket, asked while the
definition is read, answers what `docker info` answers; other endpoints go through the CLI."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from imagebuild import engine

pytestmark = pytest.mark.engine


def test_socket_query_matches_the_cli(engine_info):
    q = engine.EngineQuery()
    assert q.path is not None, "the test engine is expected on a local Unix socket"
    info = q.result()
    assert info.reachable
    assert info.server_version == engine_info.server_version
    assert info.architecture == engine_info.architecture


def test_a_docker_context_goes_through_the_cli(engine_info, tmp_path, monkeypatch):
    sock = engine.local_socket()
    cfg = tmp_path / "docker-config"
    env = {**os.environ, "DOCKER_CONFIG": str(cfg)}
    subprocess.run(["docker", "context", "create", "ib-query", "--docker", f"host=unix://{sock}"], env=env,
                   check=True, capture_output=True)
    monkeypatch.setenv("DOCKER_CONFIG", str(cfg))
    monkeypatch.setenv("DOCKER_CONTEXT", "ib-query")
    q = engine.EngineQuery()
    assert q.path is None
    info = q.result()
    assert info.reachable and info.server_version == engine_info.server_version
    assert info.storage_driver  # docker info's answer, which only the CLI path has
    # the same through config.json's currentContext
    monkeypatch.delenv("DOCKER_CONTEXT")
    (cfg / "config.json").write_text(json.dumps({"currentContext": "ib-query"}))
    assert engine.local_socket() is None


def test_unreachable_socket_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/none.sock")
    info = engine.EngineQuery().result()
    assert not info.reachable
    assert "Cannot connect to the Docker daemon" in info.detail and str(tmp_path) in info.detail
