"""A credential written in a versions.env URL never reaches a stage (issue 22, security 3): a stage
that declares the value as an ARG gets the URL without ``user:token@``, so the token is in neither
the plan, nor the build record, nor the image (its history, its config, its files). The real engine,
a real build."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.buildfixtures import remove_images
from tests.conftest import run_cli

pytestmark = pytest.mark.engine

TOKEN = "tok3n-in-a-url-9137"
IMAGE = "credarg"


def _project(root):
    d = root / "docker-images" / IMAGE
    d.mkdir(parents=True)
    (d / "versions.env").write_text("BASE_IMAGE=imagebuild-test/busybox:1\n"
                                    f"MIRROR_URL=https://ci-bot:{TOKEN}@mirror.example.invalid/pkgs\n"
                                    f"PLAIN_URL=https://{TOKEN}@mirror.example.invalid/plain\n")
    (d / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: only\n    from: BASE_IMAGE\n")
    (d / "Dockerfile.only").write_text("ARG PARENT\nFROM ${PARENT}\nARG MIRROR_URL\nARG PLAIN_URL\n"
                                       "LABEL mirror=${MIRROR_URL}\n"
                                       "RUN echo \"$MIRROR_URL $PLAIN_URL\" > /urls\n")
    return root


def test_a_url_credential_never_reaches_a_stage(engine_info, tmp_path, monkeypatch):
    root = _project(tmp_path / "p")
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state"))
    r = run_cli("--root", str(root), "plan", IMAGE, "--no-engine", "--json")
    assert r.code == 0, r.err
    args = {a["name"]: a["value"] for a in json.loads(r.out)["stages"][0]["args"]}
    assert args["MIRROR_URL"] == "https://mirror.example.invalid/pkgs"
    assert args["PLAIN_URL"] == "https://mirror.example.invalid/plain"
    try:
        r = run_cli("--root", str(root), "build", IMAGE, "--no-gate", "--no-cache")
        assert r.code == 0, r.err
        assert TOKEN not in r.out + r.err
        ref = f"{IMAGE}:candidate"
        seen = [subprocess.run(["docker", "history", "--no-trunc", ref], capture_output=True, text=True,
                               check=True).stdout,
                subprocess.run(["docker", "image", "inspect", ref], capture_output=True, text=True, check=True).stdout,
                subprocess.run(["docker", "run", "--rm", "--network", "none", ref, "cat", "/urls"],
                               capture_output=True, text=True, check=True).stdout]
        assert "mirror.example.invalid/pkgs" in seen[2]  # the stage got the URL, without the credential
        for text in seen:
            assert TOKEN not in text
        for f in (tmp_path / "state").rglob("*"):
            if f.is_file():
                assert TOKEN.encode() not in f.read_bytes(), f
    finally:
        remove_images(f"imagebuild/{IMAGE}", IMAGE)
