"""packages: a second, no-change `imagebuild prefetch` of the package test definition (base
image check, 2 wheels, 11 debs all verified against the lock, nothing downloaded) against plain
`pip download` of the same wheel set with the same target flags into a folder that already
holds the files (pip still asks the index for every requirement).

Needs the network once (setup: the first prefetch from PyPI and Debian) and the test base image
imagebuild-test/debian:bookworm (scripts/testbed.sh)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from harness import Benchmark, sh

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "packages"
IMG = "ib-pkgs"
_tmp: dict[str, Path] = {}


def _setup():
    base = Path(tempfile.mkdtemp(prefix="bench-packages-"))
    shutil.copytree(FIX, base / "project")
    _tmp["base"] = base
    _tmp["root"] = base / "project"
    os.environ["IMAGEBUILD_STATE_DIR"] = str(base / "state")
    sh(sys.executable, "-m", "imagebuild", "--root", str(_tmp["root"]), "prefetch", IMG)


def _teardown():
    os.environ.pop("IMAGEBUILD_STATE_DIR", None)
    shutil.rmtree(_tmp["base"], ignore_errors=True)


def _ours():
    sh(sys.executable, "-m", "imagebuild", "--root", str(_tmp["root"]), "prefetch", IMG)


def _baseline():
    from imagebuild.fetch.packages import wheel_platform_tags

    argv = [sys.executable, "-m", "pip", "download", "--isolated", "--only-binary=:all:", "--implementation", "cp",
            "--python-version", "3.11", "--abi", "cp311",  # pip's default index, as the fixture asks
            "-d", str(_tmp["root"] / "deps-src" / IMG / "wheels" / "pydeps"), "jinja2==3.1.4", "markupsafe==2.1.5"]
    for t in wheel_platform_tags("linux/amd64", "2.36"):
        argv += ["--platform", t]
    sh(*argv, env={**os.environ, "PIP_CONFIG_FILE": os.devnull})


def benchmarks():
    return [Benchmark("prefetch packages, no change (2 wheels + 11 debs + base)", _ours, _baseline, repeat=5,
                      setup=_setup, teardown=_teardown,
                      note="baseline: pip download of the 2 wheels alone (files already there)")]
