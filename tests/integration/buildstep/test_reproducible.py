"""The same pins give the same image, for every kind of stage the real images are made of (issue 30).

tests/fixtures/repro/docker-images/ib-repro: one stage of each kind, on the Debian test base,
every stage under --network none from what prefetch fetched (about 5 MB: jq and python3-pip with
their dependencies, markupsafe and pyyaml wheels):

  apt    prefetched debs (jq, python3-pip)          dpkg/apt logs, ldconfig's aux-cache, Debian's pycs
  pip    two native wheels, --require-hashes          pip's byte-compiled .pyc files
  wheel  `pip wheel` of a source tree, installed      the wheel's zip entry times, its pycs
  compileall  a tree copied in the RUN, compiled    .pyc files of sources with fresh mtimes
  cc     a C and a C++ program                        (deterministic already; proven)

Two clones of the project build it with --no-cache (every RUN step runs again) and must give the
same stage manifests and the same identity; a difference fails naming the files that differ.
`imagebuild build --check-repro` is tested on a tiny busybox definition with one stage that
writes a random value: it names exactly that file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from imagebuild.buildstep.stagestore import StageStore
from tests import reprocheck
from tests.conftest import BUSYBOX, DEBIAN, FIXTURES, run_cli

IMG = "ib-repro"
STAGES = ["apt", "pip", "wheel", "compileall", "cc"]


def _remove_images(image: str) -> None:
    refs = set()
    for repo in (f"imagebuild/{image}", image):
        refs.update(subprocess.run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", repo],
                                   capture_output=True, text=True).stdout.split())
    if refs:
        subprocess.run(["docker", "image", "rm", "-f", *sorted(refs)], capture_output=True)


@pytest.fixture(scope="module")
def prefetched(tmp_path_factory, engine_info):
    """Clone A of the project after `imagebuild prefetch ib-repro` (network: PyPI, Debian)."""
    if subprocess.run(["docker", "image", "inspect", DEBIAN], capture_output=True).returncode != 0:
        pytest.fail(f"{DEBIAN} missing (scripts/testbed.sh imports it)")
    top = tmp_path_factory.mktemp("repro")
    root = top / "a" / "project"
    shutil.copytree(FIXTURES / "repro", root)
    old = os.environ.get("IMAGEBUILD_STATE_DIR")
    os.environ["IMAGEBUILD_STATE_DIR"] = str(top / "a" / "state")
    try:
        r = run_cli("--root", str(root), "prefetch", IMG, "--json")
    finally:
        if old is None:
            os.environ.pop("IMAGEBUILD_STATE_DIR", None)
        else:
            os.environ["IMAGEBUILD_STATE_DIR"] = old
    assert r.code == 0, r.err
    yield root
    _remove_images(IMG)


def _build(root: Path, state: Path, monkeypatch, *args: str):
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(state))
    r = run_cli("--root", str(root), "build", IMG, "--no-gate", "--force", "--json", "--progress", "quiet", *args)
    return r, (json.loads(r.out) if r.out.strip() else None)


def test_each_kind_gives_one_identity_over_two_no_cache_builds_in_two_clones(prefetched, tmp_path, monkeypatch):
    root_a = prefetched
    root_b = tmp_path / "b" / "project"  # a second clone: the lock and prefetched files copied, nothing built
    shutil.copytree(root_a, root_b, ignore=shutil.ignore_patterns(".imagebuild"))
    recs = []
    for root in (root_a, root_b):
        r, rec = _build(root, root.parent / "state", monkeypatch, "--no-cache")
        assert r.code == 0, r.err[-3000:]
        assert [(s["name"], s["status"], s["network"]) for s in rec["stages"]] == [
            (n, "built", "none") for n in STAGES]
        recs.append(rec)
    a, b = recs
    # both clones share the host's stage store (IMAGEBUILD_STAGES): both builds' blobs are there
    diff = reprocheck.differences(a, b, root=root_a, image=IMG)
    assert not diff, "two --no-cache builds differ:\n" + diff
    assert a["release"]["identity"] == b["release"]["identity"]
    assert a["build_id"] == b["build_id"]

    # by construction, not by luck: what the tools wrote with SOURCE_DATE_EPOCH in the environment
    epoch = int(a["source_date_epoch"])
    script = r"""
import glob, json, zipfile, importlib.util
def flags(p):
    with open(p, "rb") as f:
        return int.from_bytes(f.read(8)[4:8], "little")
pyc = {k: sorted({flags(p) for p in glob.glob(g, recursive=True)}) for k, g in (
    ("pip", "/usr/local/lib/python3.11/dist-packages/yaml/__pycache__/*.pyc"),
    ("wheel", "/usr/local/lib/python3.11/dist-packages/greet/__pycache__/*.pyc"),
    ("pyc", "/opt/app-copy/__pycache__/*.pyc"),
    ("apt", "/usr/lib/python3/dist-packages/pip/__pycache__/*.pyc"))}
whl = glob.glob("/opt/wheels/greet-*.whl")[0]
times = sorted({z.date_time for z in zipfile.ZipFile(whl).infolist()})
print(json.dumps({"pyc": pyc, "zip": times}))
"""
    out = subprocess.run(["docker", "run", "--rm", "-i", "--network", "none", f"{IMG}:candidate", "sh", "-c",
                          "jq --version && hello-c && hello-cpp && python3 -c \"import yaml, markupsafe, greet;"
                          " print(greet.hello())\" && ! grep -q ' jq' /var/log/dpkg.log && echo no-jq-in-dpkg-log "
                          "&& test ! -e /var/log/apt/history.log && echo no-apt-history && python3 -"],
                         input=script, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:6] == ["jq-1.6", "hello from C", "hello from C++", "hello from greet", "no-jq-in-dpkg-log",
                         "no-apt-history"]
    facts = json.loads(lines[6])
    # flags 3: checked-hash pycs (PEP 552), what py_compile writes when SOURCE_DATE_EPOCH is set
    assert facts["pyc"] == {"pip": [3], "wheel": [3], "pyc": [3], "apt": [3]}, facts["pyc"]
    import datetime

    t = datetime.datetime.fromtimestamp(epoch, datetime.UTC)
    assert facts["zip"] == [[t.year, t.month, t.day, t.hour, t.minute, t.second]]
    # the run's log names what was left out, from the one list (buildstep/reproducible.py)
    log = (root_a.parent / "state" / "builds" / IMG / a["run_id"] / "logs" / "apt.log").read_text()
    assert "left out (records of when a tool ran): " in log and "var/log/dpkg.log" in log
    df = (root_a.parent / "state" / "builds" / IMG / a["run_id"] / "logs" / "apt.Dockerfile").read_text()
    assert df.count("ARG SOURCE_DATE_EPOCH\n") == 1


STAMP_IMAGE = "ib-repro-stamp"


def _stamp_project(root: Path) -> Path:
    d = root / "docker-images" / STAMP_IMAGE
    d.mkdir(parents=True)
    (d / "versions.env").write_text(f"BASE_IMAGE={BUSYBOX}\n")
    (d / "image.yaml").write_text(
        "description: a stage that writes a random value, after one that does not\nplatform: linux/amd64\n"
        "stages:\n  - name: fine\n    from: BASE_IMAGE\n  - name: stamped\n    from: fine\n")
    (d / "Dockerfile.fine").write_text("ARG PARENT\nFROM ${PARENT}\nRUN echo same > /same\n")
    (d / "Dockerfile.stamped").write_text(
        "ARG PARENT\nFROM ${PARENT}\nRUN mkdir -p /out && cat /proc/sys/kernel/random/uuid > /out/stamp"
        " && echo same > /out/also-same\n")
    return root


def test_check_repro_names_the_file_that_differs_and_leaves_the_store_as_it_was(engine_ready, tmp_path,
                                                                                 monkeypatch):
    root = _stamp_project(tmp_path / "project")
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state"))
    try:
        r = run_cli("--root", str(root), "build", STAMP_IMAGE, "--check-repro", "--force", "--json")
        assert r.code == 1, (r.code, r.err[-3000:])
        rec = json.loads(r.out)
        assert rec["status"] == "not-reproducible" and rec["release"] is None and rec["promotion"] is None
        checks = {c["name"]: c for c in rec["repro"]["stages"]}
        assert rec["repro"]["same"] is False
        assert checks["fine"]["same"] is True and checks["fine"]["differences"] == []
        st = checks["stamped"]
        assert st["same"] is False and st["first"] != st["second"]
        assert [(d["path"], d["differs"]) for d in st["differences"]] == [("out/stamp", ["content"])]
        assert "not reproducible: stage(s) stamped" in r.err
        # the store still holds the first build, and only it: its ref, index.json, no blob of the second
        store = StageStore(Path(rec["stage_store"]))
        stamped = next(s for s in rec["stages"] if s["name"] == "stamped")
        assert store.lookup(stamped["key"]).manifest == st["first"] == stamped["manifest"]
        assert not store.blob(st["second"]).exists()
        index = json.loads((store.dir / "index.json").read_text())
        assert st["second"] not in {m["digest"] for m in index["manifests"]}
        assert store.complete(st["first"])

        # without --json: a line per stage and the differing path
        r = run_cli("--root", str(root), "build", STAMP_IMAGE, "--check-repro", "--force", "--until", "fine")
        assert r.code == 0, r.err[-3000:]
        assert "fine             same     built twice: sha256:" in r.out
        r = run_cli("--root", str(root), "build", STAMP_IMAGE, "--check-repro", "--force", "--from", "stamped")
        assert r.code == 1
        assert "stamped          DIFFERS  built twice: sha256:" in r.out and "out/stamp: content (layer" in r.out
        assert "fine " not in r.out.split("stamped          DIFFERS")[1]
        # and --dry-run with it is a usage error
        r = run_cli("--root", str(root), "build", STAMP_IMAGE, "--check-repro", "--dry-run")
        assert r.code == 2 and "--check-repro" in r.err
    finally:
        _remove_images(STAMP_IMAGE)
