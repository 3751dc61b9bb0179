"""plan's engine question (engine.EngineQuery): the engine's API on its Unix socket, asked while the
definition is read, answers what `docker info` answers; other endpoints go through the CLI."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from imagebuild.core import engine

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


def test_behind_anything_but_dockerd_the_version_endpoint_is_asked(tmp_path, monkeypatch):
    """A socket served by another process (a proxy, a forwarded socket, another engine): its
    /_ping is not taken as dockerd's, and the architecture comes from /version, not this kernel."""
    import socket
    import threading

    path = str(tmp_path / "proxy.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(4)
    asked = []

    def serve():
        for _ in range(2):
            conn, _ = server.accept()
            request = conn.recv(4096).decode()
            asked.append(request.split()[1])
            if request.startswith("GET /_ping"):
                conn.sendall(b"HTTP/1.0 200 OK\r\nServer: Docker/1.0.0 (linux)\r\n\r\nOK")
            else:
                conn.sendall(b'HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n'
                             b'{"Version": "9.9.9", "Arch": "arm64"}')
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
    info = engine.EngineQuery().result()
    t.join(10)
    server.close()
    assert asked == ["/_ping", "/version"]
    assert info.reachable and info.server_version == "9.9.9" and info.architecture == "aarch64"
