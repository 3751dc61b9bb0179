"""Prefetch resolves each stage's requirement set as a whole, for the target, before it downloads
(issue 20, section 1.2): against a small local index of tiny wheels built here (no network).

The index (a PEP 503 folder served as file://) holds:
  alpha 1.0: requires gamma>=2.0, and armonly on aarch64 only (an environment marker)
  gamma 1.0, 2.0
  delta 1.0: requires gamma<2.0
  delta 2.0: requires gamma>=2.0
  armonly 1.0
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from imagebuild.core import lock as lock_mod
from imagebuild.core.errors import EXIT_BAD_INPUT, DefinitionError
from imagebuild.definition import reader as d
from imagebuild.fetch import packages

IMG = "ib-resolve"

WHEELS = {
    ("alpha", "1.0"): ["gamma>=2.0", 'armonly; platform_machine == "aarch64"'],
    ("gamma", "1.0"): [],
    ("gamma", "2.0"): [],
    ("delta", "1.0"): ["gamma<2.0"],
    ("delta", "2.0"): ["gamma>=2.0"],
    ("armonly", "1.0"): [],
}


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "",
        f"{info}/METADATA": "Metadata-Version: 2.1\n"
                            f"Name: {name}\nVersion: {version}\n"
                            + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: imagebuild-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{n},sha256={hashlib.sha256(t.encode()).hexdigest()},{len(t.encode())}\n"
                     for n, t in files.items()) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, t in {**files, f"{info}/RECORD": record}.items():
            z.writestr(zipfile.ZipInfo(n, date_time=(2020, 1, 1, 0, 0, 0)), t)
    return path


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> str:
    """A PEP 503 simple index on disk: simple/<name>/index.html links the wheels (with sha256)."""
    root = tmp_path_factory.mktemp("index")
    files = root / "files"
    files.mkdir()
    by_name: dict[str, list[Path]] = {}
    for (name, version), requires in WHEELS.items():
        by_name.setdefault(name, []).append(_wheel(files, name, version, requires))
    for name, wheels in by_name.items():
        page = root / "simple" / name
        page.mkdir(parents=True)
        links = "".join(f'<a href="../../files/{w.name}#sha256={hashlib.sha256(w.read_bytes()).hexdigest()}">'
                        f"{w.name}</a>\n" for w in wheels)
        (page / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
    return (root / "simple").as_uri()


@pytest.fixture(autouse=True)
def _state(tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state"))


def _project(tmp_path: Path, index: str, torch: str, runner: str | None = None,
             platform: str = "linux/arm64") -> d.Definition:
    img = tmp_path / "project" / "docker-images" / IMG
    img.mkdir(parents=True)
    (img / "versions.env").write_text(f"BASE_IMAGE=imagebuild-test/debian:bookworm\nLOCAL_INDEX={index}\n")
    stages = "  - name: torch\n    from: BASE_IMAGE\n    requirements: requirements-torch.txt\n"
    if runner is not None:
        stages += "  - name: runner\n    from: torch\n    requirements: requirements-runner.txt\n"
        (img / "requirements-runner.txt").write_text(runner)
        (img / "Dockerfile.runner").write_text("ARG PARENT\nFROM ${PARENT}\n")
    (img / "requirements-torch.txt").write_text(torch)
    (img / "Dockerfile.torch").write_text("ARG PARENT\nFROM ${PARENT}\n")
    (img / "image.yaml").write_text(f"platform: {platform}\npython:\n  version: \"3.12\"\n  glibc: \"2.39\"\n"
                                    f"  index_url: LOCAL_INDEX\nstages:\n{stages}")
    return d.load(tmp_path / "project", IMG)


def _untouched(defn: d.Definition) -> None:
    """Nothing half-written: no lock, no wheels folder."""
    assert lock_mod.read(defn.dir) is None
    assert not (defn.root / "deps-src" / IMG / "wheels").exists()


def _versions(section: dict, stage: str) -> dict[str, str]:
    return {w["name"]: w["version"] for w in section[stage]["files"]}


def test_a_set_that_resolves_is_locked_whole_for_the_target(tmp_path, index):
    defn = _project(tmp_path, index, "alpha==1.0\n", "delta==2.0\n")
    section = packages.prefetch_wheels(defn)
    # gamma comes from alpha's requirement, armonly from its aarch64 marker: the markers are the
    # target's, not this host's
    assert _versions(section, "torch") == {"alpha": "1.0", "gamma": "2.0", "armonly": "1.0"}
    assert _versions(section, "runner") == {"delta": "2.0", "gamma": "2.0"}
    assert section["torch"]["constraints"] is None
    assert section["runner"]["constraints"]["stages"] == ["torch"]
    assert section["runner"]["resolver"].startswith("uv ")
    assert packages.stage_contexts(defn, "runner")


def test_markers_are_evaluated_for_the_target_platform(tmp_path, index):
    defn = _project(tmp_path, index, "alpha==1.0\n", platform="linux/amd64")
    assert _versions(packages.prefetch_wheels(defn), "torch") == {"alpha": "1.0", "gamma": "2.0"}


def test_a_set_that_does_not_resolve_is_refused_naming_the_conflict(tmp_path, index):
    defn = _project(tmp_path, index, "alpha==1.0\ngamma==1.0\n")
    with pytest.raises(DefinitionError) as ei:
        packages.prefetch_wheels(defn)
    err = ei.value
    assert err.exit_code == EXIT_BAD_INPUT
    text = err.render()
    f = f"docker-images/{IMG}/requirements-torch.txt"
    assert f"{f}: the pins do not resolve as one set" in text
    assert "alpha==1.0 requires gamma>=2.0" in text
    assert f"{f}:2 pins gamma==1.0" in text
    assert "Traceback" not in text and "hint:" in text
    _untouched(defn)


def test_a_runner_set_that_would_downgrade_the_parent_is_refused(tmp_path, index):
    # delta 1.0 needs gamma<2.0; the torch stage installs gamma 2.0 (a dependency of alpha)
    defn = _project(tmp_path, index, "alpha==1.0\n", "delta==1.0\n")
    with pytest.raises(DefinitionError) as ei:
        packages.prefetch_wheels(defn)
    text = ei.value.render()
    assert f"docker-images/{IMG}/requirements-runner.txt: the pins do not resolve as one set" in text
    assert "delta==1.0 requires gamma<2.0" in text
    assert "stage 'torch' installs gamma==2.0" in text
    assert "a parent stage installs" in text
    _untouched(defn)


def test_a_runner_pin_that_differs_from_the_parent_is_refused_naming_both(tmp_path, index):
    defn = _project(tmp_path, index, "alpha==1.0\n", "gamma==1.0\n")
    with pytest.raises(DefinitionError) as ei:
        packages.prefetch_wheels(defn)
    text = ei.value.render()
    assert (f"docker-images/{IMG}/requirements-runner.txt:1: gamma==1.0, but stage 'torch' installs gamma==2.0 "
            "(its lock)") in text
    _untouched(defn)
