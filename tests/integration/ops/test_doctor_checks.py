"""``imagebuild doctor`` checks skopeo (the registry cache needs it), the NVIDIA container runtime (the
gate's GPU checks; absent is a warning) and which buildx builder is selected (issue 23, section 4)."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from imagebuild.ops import doctor
from tests.conftest import run_cli


@pytest.mark.engine
def test_doctor_reports_skopeo_nvidia_runtime_and_builder(project, engine_info):
    res = run_cli("--root", str(project), "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(res.out)["checks"]}
    insp = subprocess.run(["docker", "buildx", "inspect"], capture_output=True, text=True, check=True).stdout
    name = re.search(r"^Name:\s*(\S+)", insp, re.M).group(1)
    driver = re.search(r"^Driver:\s*(\S+)", insp, re.M).group(1)
    assert checks["buildx builder"]["detail"].startswith(f"{name} (driver {driver}")
    runtimes = json.loads(subprocess.run(["docker", "info", "--format", "{{json .Runtimes}}"], capture_output=True,
                                         text=True, check=True).stdout)
    want = "ok" if "nvidia" in runtimes else "warn"  # absent: a warning (doctor still exits 0 for it)
    assert checks["nvidia runtime"]["status"] == want, checks["nvidia runtime"]
    if want == "warn":
        assert "SKIPPED" in checks["nvidia runtime"]["fix"]
    has_skopeo = any(os.access(os.path.join(d, "skopeo"), os.X_OK) for d in os.environ["PATH"].split(os.pathsep))
    assert checks["skopeo"]["status"] == ("ok" if has_skopeo else "warn")
    human = run_cli("--root", str(project), "doctor")
    assert re.search(r"^(OK|WARN)\s+nvidia runtime\s+", human.out, re.M)
    assert re.search(rf"^(OK|WARN)\s+buildx builder\s+{re.escape(name)} ", human.out, re.M)


def test_skopeo_missing_is_a_warning_or_with_a_registry_a_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no skopeo here
    assert doctor.check_skopeo(None).status == "warn"
    c = doctor.check_skopeo("127.0.0.1:5000/ib")
    assert c.status == "fail" and "127.0.0.1:5000/ib" in c.detail and "apt-get install skopeo" in c.fix


def _fake_docker(tmp_path, runtimes: str):
    (tmp_path / "docker").write_text(f"#!/bin/sh\necho '{runtimes}'\n")
    (tmp_path / "docker").chmod(0o755)


def test_nvidia_runtime_seen_in_the_engines_runtimes(tmp_path, monkeypatch):
    _fake_docker(tmp_path, '{"nvidia": {"path": "nvidia-container-runtime"}, "runc": {"path": "runc"}}')
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert doctor.check_nvidia_runtime().status == "ok"
    _fake_docker(tmp_path, '{"runc": {"path": "runc"}}')
    c = doctor.check_nvidia_runtime()
    assert c.status == "warn" and "runc" in c.detail and "nvidia-ctk runtime configure" in c.fix


def test_builder_driver():
    assert doctor.check_builder("Name:   default\nDriver: docker\n").status == "ok"
    c = doctor.check_builder("Name:          ci\nDriver:        docker-container\n")
    assert c.status == "warn" and c.detail == "ci (driver docker-container)" and "docker buildx use default" in c.fix
