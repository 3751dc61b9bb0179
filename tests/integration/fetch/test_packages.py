"""Package prefetch for real: PyPI wheels (for the host and for aarch64), Debian packages with
their dependencies resolved in the real bookworm test base, a local base image pinned by digest,
then the stages built by `imagebuild build` under --network none from what was prefetched.

Downloads are small (about 5 MB: jq, python3-pip and their dependencies; jinja2 and markupsafe)
and happen once per module; the error tests reuse the pip cache of the first run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from imagebuild.core import lock as lock_mod
from imagebuild.core.errors import OperationFailed
from imagebuild.core.fsutil import sha256_file
from imagebuild.definition import reader as d
from imagebuild.fetch import packages
from imagebuild.plan import planner as plan
from tests.conftest import DEBIAN, FIXTURES, run_cli

IMG = "ib-pkgs"
ARM = "ib-pkgs-arm"


def _copy(dst: Path) -> Path:
    shutil.copytree(FIXTURES / "packages", dst)
    return dst


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    """One state folder (and so one pip cache) for every project in this module."""
    return tmp_path_factory.mktemp("pkg-state")


@pytest.fixture(autouse=True)
def _shared_state(state_dir, monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(state_dir))


@pytest.fixture(scope="module")
def debian(engine_info):
    if subprocess.run(["docker", "image", "inspect", DEBIAN], capture_output=True).returncode != 0:
        pytest.fail(f"{DEBIAN} missing (scripts/testbed.sh imports it)")
    return DEBIAN


@pytest.fixture(scope="module")
def fetched(tmp_path_factory, state_dir, debian):
    """The test project after one `imagebuild prefetch ib-pkgs` (network: PyPI, Debian)."""
    root = _copy(tmp_path_factory.mktemp("pkgs") / "project")
    env = {"IMAGEBUILD_STATE_DIR": str(state_dir)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        r = run_cli("--root", str(root), "prefetch", IMG, "--json")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert r.code == 0, r.err
    return root, json.loads(r.out)


def _lock(root: Path) -> dict:
    return lock_mod.read(root / "docker-images" / IMG)


def test_prefetch_pins_base_and_locks_every_wheel_and_deb(fetched):
    root, rep = fetched
    (img,) = rep["images"]
    assert img["packages"]["downloaded"] == 13 and img["packages"]["reused"] == 0
    env = (root / "docker-images" / IMG / "versions.env").read_text()
    local = json.loads(subprocess.run(["docker", "image", "inspect", DEBIAN], capture_output=True,
                                      check=True).stdout)[0]
    digest = local["RepoDigests"][0].split("@")[1]
    # pinned in place: the comment above it and the order are kept
    assert env.startswith("# Package prefetch test definition")
    assert f"\nBASE_IMAGE={DEBIAN}@{digest}\nPYPI_INDEX_URL=" in env
    lk = _lock(root)
    assert lk["images"]["BASE_IMAGE"]["digest"] == digest
    assert lk["images"]["BASE_IMAGE"]["platform"] == "linux/amd64"
    assert lk["images"]["BASE_IMAGE"]["identity"].startswith("sha256:")

    wheels = lk["wheels"]["pydeps"]
    assert {(w["name"], w["version"], w["requested"]) for w in wheels["files"]} == {
        ("jinja2", "3.1.4", True), ("markupsafe", "2.1.5", True)}
    wdir = root / wheels["dir"]
    assert wheels["dir"] == f"deps-src/{IMG}/wheels/pydeps"
    for w in wheels["files"]:
        assert sha256_file(wdir / w["filename"]) == w["sha256"]
    ms = next(w for w in wheels["files"] if w["name"] == "markupsafe")
    assert "x86_64" in ms["filename"] and "cp311" in ms["filename"]
    req = (wdir / "requirements.txt").read_text()
    assert f"markupsafe==2.1.5 --hash=sha256:{ms['sha256']}" in req
    assert sha256_file(wdir / "requirements.txt") == wheels["install_requirements"]["sha256"]

    apt = lk["apt"]["base"]
    names = {p["name"]: p for p in apt["files"]}
    # the two requested packages at their exact versions, and their dependencies
    assert names["jq"]["version"] == "1.6-2.1+deb12u2" and names["jq"]["requested"]
    assert names["python3-pip"]["version"] == "23.0.1+dfsg-1" and names["python3-pip"]["requested"]
    assert {"libjq1", "libonig5", "python3-setuptools", "python3-wheel"} <= set(names)
    assert not names["libjq1"]["requested"]
    adir = root / apt["dir"]
    for p in apt["files"]:
        assert sha256_file(adir / p["filename"]) == p["sha256"]
    assert apt["base"] == f"{DEBIAN}@{digest}" and apt["architecture"] == "amd64"
    index = (adir / "Packages").read_text()
    assert f"Filename: ./{names['jq']['filename']}\n" in index and f"SHA256: {names['jq']['sha256']}" in index
    # no host paths, no timestamps in the lock
    text = (root / "docker-images" / IMG / "lock.json").read_text()
    assert str(root) not in text and "/tmp/" not in text
    # the networked step was logged
    assert "apt-get update" in (Path(os.environ["IMAGEBUILD_STATE_DIR"]) / "prefetch" / IMG / "apt-base.log").read_text()


def _snapshot(root: Path) -> dict[str, tuple[int, str]]:
    out = {}
    for p in sorted((root / "deps-src").rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_ino, st.st_mtime_ns)
    out["lock"] = (0, sha256_file(root / "docker-images" / IMG / "lock.json"))
    return out


def test_second_prefetch_downloads_nothing(fetched):
    root, _ = fetched
    before = _snapshot(root)
    log = Path(os.environ["IMAGEBUILD_STATE_DIR"]) / "prefetch" / IMG / "apt-base.log"
    log_mtime = log.stat().st_mtime_ns
    r = run_cli("--root", str(root), "prefetch", IMG, "--json")
    assert r.code == 0, r.err
    pk = json.loads(r.out)["images"][0]["packages"]
    assert pk["downloaded"] == 0 and pk["reused"] == 13 and pk["pinned"] == [] and pk["pulled"] == []
    assert _snapshot(root) == before  # not one file rewritten, lock byte-identical
    assert log.stat().st_mtime_ns == log_mtime  # the base image did not even run
    # and --offline verifies the same without any network
    r = run_cli("--root", str(root), "prefetch", IMG, "--offline")
    assert r.code == 0, r.err


def test_plan_keys_follow_the_lock(fetched):
    root, _ = fetched
    p = plan.make_plan(d.load(root, IMG))
    assert p.stage("pydeps").packages["wheels"]["locked"] and p.stage("base").packages["apt"]["locked"]


def test_stages_build_offline_from_prefetched_packages(fetched):
    root, _ = fetched
    r = run_cli("--root", str(root), "build", IMG, "--no-gate", "--force", "--json")
    try:
        assert r.code == 0, r.err
        rep = json.loads(r.out)
        assert [s["network"] for s in rep["stages"]] == ["none", "none", "none"]
        out = subprocess.run(["docker", "run", "--rm", "--network", "none", f"{IMG}:candidate", "sh", "-c",
                              "jq --version && cat /app-versions && python3 -m pip --version"],
                             capture_output=True, text=True, check=True).stdout
        assert out.startswith("jq-1.6\n3.1.4 2.1.5\npip 23.0.1")
    finally:
        _remove_images(IMG)


def _remove_images(image: str) -> None:
    refs = set()
    for repo in (f"imagebuild/{image}", image):
        ls = subprocess.run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", repo],
                            capture_output=True, text=True).stdout.split()
        refs.update(ls)
    if refs:
        subprocess.run(["docker", "image", "rm", "-f", *sorted(refs)], capture_output=True)


def test_wheels_for_another_platform(tmp_path, debian):
    root = _copy(tmp_path / "project")
    defn = d.load(root, ARM)
    assert defn.platform == "linux/arm64"
    rep = packages.Report()
    section = packages.prefetch_wheels(defn, rep)
    files = {w["name"]: w["filename"] for w in section["pydeps"]["files"]}
    assert "aarch64" in files["markupsafe"] and "cp311" in files["markupsafe"]
    assert files["jinja2"].endswith("-py3-none-any.whl")
    assert "x86_64" not in " ".join(files.values())
    # the locked contexts check out for the build
    ctx = packages.stage_contexts(defn, "pydeps")
    assert ctx == {"imagebuild-wheels": root / f"deps-src/{ARM}/wheels/pydeps"}


def _arm(tmp_path, requirements: str):
    root = _copy(tmp_path / "project")
    (root / "docker-images" / ARM / "requirements-py.txt").write_text(requirements)
    return root, d.load(root, ARM)


def test_no_wheel_for_the_target_names_the_requirement(tmp_path, debian):
    root, defn = _arm(tmp_path, "termcolor==1.1.0\n")  # published as an sdist only
    with pytest.raises(OperationFailed) as ei:
        packages.prefetch_wheels(defn)
    msg = ei.value.message
    assert f"docker-images/{ARM}/requirements-py.txt:1: termcolor==1.1.0" in msg
    assert "no binary wheel" in msg and "linux/arm64, CPython 3.11" in msg
    assert not (root / "deps-src" / ARM / "wheels" / "pydeps").exists()  # nothing half-written
    assert lock_mod.read(root / "docker-images" / ARM) is None


def test_nonexistent_wheel_version_lists_what_exists(tmp_path, debian):
    _, defn = _arm(tmp_path, "markupsafe==99.0.0\n")
    with pytest.raises(OperationFailed) as ei:
        packages.prefetch_wheels(defn)
    msg = ei.value.message
    assert "requirements-py.txt:1: markupsafe==99.0.0" in msg and "2.1.5" in msg


def test_wrong_hash_in_requirements_is_refused(tmp_path, debian):
    _, defn = _arm(tmp_path, "markupsafe==2.1.5 --hash=sha256:" + "0" * 64 + "\n")
    with pytest.raises(OperationFailed) as ei:
        packages.prefetch_wheels(defn)
    assert "requirements-py.txt:1: markupsafe==2.1.5: the index served" in ei.value.message
    assert "not a hash the file lists" in ei.value.message


def test_locked_hash_mismatch_on_refetch_is_refused(tmp_path, debian):
    root, defn = _arm(tmp_path, "markupsafe==2.1.5\n")
    section = packages.prefetch_wheels(defn)
    w = section["pydeps"]["files"][0]
    wdir = root / section["pydeps"]["dir"]
    # a damaged file is fetched again and must match the lock ...
    (wdir / w["filename"]).write_bytes(b"damaged")
    with pytest.raises(OperationFailed, match="sha256 mismatch"):
        packages.stage_contexts(defn, "pydeps")
    rep = packages.Report()
    packages.prefetch_wheels(defn, rep)
    assert rep.downloaded == [w["filename"]] and sha256_file(wdir / w["filename"]) == w["sha256"]
    # ... and when the lock says otherwise than the index serves, that is an error naming both
    lk = lock_mod.read(root / "docker-images" / ARM)
    lk["wheels"]["pydeps"]["files"][0]["sha256"] = "f" * 64
    (root / "docker-images" / ARM / "lock.json").write_text(lock_mod.serialise(lk))
    (wdir / w["filename"]).unlink()
    with pytest.raises(OperationFailed) as ei:
        packages.prefetch_wheels(defn)
    assert f"sha256 mismatch for {w['filename']}: the lock" in ei.value.message and "f" * 64 in ei.value.message


def test_nonexistent_apt_version_is_a_clear_error(tmp_path, debian, state_dir):
    root = _copy(tmp_path / "project")
    (root / "docker-images" / IMG / "apt-base.txt").write_text("# one bad pin\njq=9.9-9\n")
    defn = d.load(root, IMG)
    packages.prefetch_images(defn)
    defn = d.load(root, IMG)
    with pytest.raises(OperationFailed) as ei:
        packages.prefetch_apt(defn)
    msg = ei.value.message
    assert f"docker-images/{IMG}/apt-base.txt:2: jq=9.9-9: no such version" in msg
    assert not any((root / "deps-src" / IMG / "apt").glob("base*"))


def test_offline_prefetch_with_nothing_locked_fails(tmp_path, debian):
    root = _copy(tmp_path / "project")
    r = run_cli("--root", str(root), "prefetch", IMG, "--offline")
    assert r.code == 1 and "--offline was given" in r.err


@pytest.fixture
def registry(tmp_path):
    """A real registry (distribution's docker-registry) on 127.0.0.1, stopped by its pid."""
    exe = shutil.which("docker-registry")
    if exe is None:
        pytest.skip("docker-registry not installed (apt-get install docker-registry)")
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "registry.yml"
    cfg.write_text(f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {tmp_path / 'data'}\n"
                   f"http:\n  addr: 127.0.0.1:{port}\n")
    proc = subprocess.Popen([exe, "serve", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_base_tag_resolved_from_a_registry_and_pulled_by_digest(tmp_path, registry, engine_info):
    from tests.conftest import BUSYBOX

    name = f"{registry}/ib-pkgtest/busybox"
    subprocess.run(["docker", "tag", BUSYBOX, f"{name}:1"], check=True, capture_output=True)
    subprocess.run(["docker", "push", "-q", f"{name}:1"], check=True, capture_output=True)
    raw = subprocess.run(["docker", "buildx", "imagetools", "inspect", "--raw", f"{name}:1"], check=True,
                         capture_output=True).stdout
    pushed = "sha256:" + __import__("hashlib").sha256(raw).hexdigest()
    subprocess.run(["docker", "image", "rm", f"{name}:1"], check=True, capture_output=True)  # not local any more
    root = tmp_path / "project"
    img = root / "docker-images" / "reg"
    img.mkdir(parents=True)
    (img / "versions.env").write_text(f"# a base only the registry has\nBASE_IMAGE={name}:1  # by tag\n")
    (img / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: s\n    from: BASE_IMAGE\n")
    (img / "Dockerfile.s").write_text("ARG PARENT\nFROM ${PARENT}\n")
    try:
        defn, rep = packages.prefetch_packages(root, "reg")
        assert rep.pinned == [f"BASE_IMAGE={name}:1@{pushed}"]
        assert rep.pulled == [f"{name}@{pushed}"]
        assert (img / "versions.env").read_text() == \
            f"# a base only the registry has\nBASE_IMAGE={name}:1@{pushed}  # by tag\n"
        assert lock_mod.read(img)["images"]["BASE_IMAGE"]["digest"] == pushed
        # pinned and present: a second run asks neither the registry nor pulls
        _, rep2 = packages.prefetch_packages(root, "reg", offline=True)
        assert rep2.pinned == [] and rep2.pulled == []
    finally:
        refs = subprocess.run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", name],
                              capture_output=True, text=True).stdout.split()
        digests = [f"{name}@{pushed}"]
        subprocess.run(["docker", "image", "rm", "-f", *refs, *digests], capture_output=True)


def test_a_verified_base_is_pinned_from_the_engine_never_from_its_registry(tmp_path, registry, engine_info):
    """image.yaml `verified_bases`: the base the lane was verified on (dsv4's eugr/spark-vllm-b12x) is
    pinned from the image the engine holds; a tag that only the registry can answer is refused,
    since it names whatever the tag points at today."""
    from imagebuild.core.errors import OperationFailed
    from tests.conftest import BUSYBOX

    name = f"{registry}/ib-pkgtest/verified"
    subprocess.run(["docker", "tag", BUSYBOX, f"{name}:1"], check=True, capture_output=True)
    subprocess.run(["docker", "push", "-q", f"{name}:1"], check=True, capture_output=True)
    root = tmp_path / "project"
    img = root / "docker-images" / "ver"
    img.mkdir(parents=True)
    (img / "versions.env").write_text(f"BASE_IMAGE={name}:1\n")
    (img / "image.yaml").write_text("platform: linux/amd64\nverified_bases: [BASE_IMAGE]\n"
                                    "stages:\n  - name: s\n    from: BASE_IMAGE\n")
    (img / "Dockerfile.s").write_text("ARG PARENT\nFROM ${PARENT}\n")
    try:
        # in the engine (with its repository digest): pinned from there
        local = json.loads(subprocess.run(["docker", "image", "inspect", f"{name}:1"], check=True,
                                          capture_output=True).stdout)[0]["RepoDigests"][0].split("@")[1]
        defn, rep = packages.prefetch_packages(root, "ver")
        assert rep.pinned == [f"BASE_IMAGE={name}:1@{local}"] and rep.pulled == []
        # not in the engine: refused, the registry is not asked
        (img / "versions.env").write_text(f"BASE_IMAGE={name}:2\n")
        subprocess.run(["docker", "tag", BUSYBOX, f"{name}:2"], check=True, capture_output=True)
        subprocess.run(["docker", "push", "-q", f"{name}:2"], check=True, capture_output=True)
        subprocess.run(["docker", "image", "rm", f"{name}:2"], check=True, capture_output=True)
        with pytest.raises(OperationFailed, match=r"BASE_IMAGE: .*:2 is not in the engine, and the definition "
                                                   r"marks this base as verified"):
            packages.prefetch_packages(root, "ver")
        assert (img / "versions.env").read_text() == f"BASE_IMAGE={name}:2\n"  # nothing written
        # the key must exist
        (img / "image.yaml").write_text((img / "image.yaml").read_text().replace("[BASE_IMAGE]", "[NOPE]"))
        res = run_cli("--root", str(root), "validate", "ver")
        assert res.code == 2 and "verified_bases" in res.err and "'NOPE' is not a versions.env key" in res.err
    finally:
        refs = subprocess.run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", name],
                              capture_output=True, text=True).stdout.split()
        subprocess.run(["docker", "image", "rm", "-f", *refs], capture_output=True)


def test_a_bare_apt_name_is_pinned_from_the_archive_and_written_back(tmp_path, debian):
    """`apt-packages.txt` may name a package without a version (visibly unpinned: plan lists it):
    prefetch resolves it in the pinned base against the archive, writes name=version back in place
    (comments kept) and locks the pinned file; a second prefetch changes nothing."""
    root = _copy(tmp_path / "project")
    img = root / "docker-images" / IMG
    (img / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: base\n    from: BASE_IMAGE\n"
                                    "    apt: apt-base.txt\n")
    for f in ("Dockerfile.pydeps", "Dockerfile.app", "requirements-py.txt"):
        (img / f).unlink()
    (img / "apt-base.txt").write_text("# exact versions\njq=1.6-2.1+deb12u2\ntree  # no version yet\n")
    plan_out = run_cli("--root", str(root), "plan", IMG, "--no-engine", "--json")
    assert any(u.get("key") == "tree" for u in json.loads(plan_out.out)["unpinned"]), plan_out.out
    defn, rep = packages.prefetch_packages(root, IMG)
    text = (img / "apt-base.txt").read_text()
    [line] = [ln for ln in text.splitlines() if ln.startswith("tree=")]
    version = line.split("=", 1)[1].split()[0]
    assert line == f"tree={version}  # no version yet" and text.startswith("# exact versions\njq=1.6-2.1+deb12u2\n")
    assert any(p.endswith(f"tree={version}") for p in rep.pinned)
    entry = _lock(root)["apt"]["base"]
    assert entry["list_sha256"] == sha256_file(img / "apt-base.txt")
    assert [f["version"] for f in entry["files"] if f["name"] == "tree"] == [version]
    install = (root / entry["dir"] / "install.sh").read_text()
    assert f"tree={version}" in install  # generated from the pinned list
    _, rep2 = packages.prefetch_packages(root, IMG, offline=True)
    assert rep2.pinned == [] and (img / "apt-base.txt").read_text() == text
