"""The Rust frontend of the fork's newer trees (issue 31), offline and for real.

The fixture has that tree's shape (../shared/FACTS.md, "The Rust frontend of newer fork trees"):
``rust-toolchain.toml`` naming 1.95, ``rust/Cargo.toml`` of edition 2024, a v4 ``rust/Cargo.lock``,
two registry crates and one crate from a git repository; no crate declares a ``rust-version``.

- The registry is a stand-in sparse registry served over loopback (``http.server`` on 127.0.0.1):
  ``config.json`` and ``.crate`` files made from Debian's packaged crate sources
  (``librust-itoa-dev``, ``librust-cfg-if-dev``); the Cargo.lock carries their sha256.
- The git crate's URL in the Cargo.lock is a host that does not exist (``git.invalid``); the machine's
  git mirror map (``url.<base>.insteadOf``, through GIT_CONFIG_* here) sends it to a real loopback
  ``git daemon``.
- The host has no cargo during prefetch (PATH and HOME without one).
- The stage is played by the generated ``imagebuild-src.sh`` plus ``cargo build --offline --locked``
  with a toolchain taken straight from its folder (no rustup), in a network namespace of its own.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from imagebuild.fetch import cargo as cargo_mod
from imagebuild.plan import source_mounts
from tests.conftest import run_cli
from tests.gitfixtures import GitDaemon, UpstreamFactory

IMAGE = "rusty"
DEBIAN_REGISTRY = Path("/usr/share/cargo/registry")
CRATES = {"itoa": "librust-itoa-dev", "cfg-if": "librust-cfg-if-dev"}
GIT_URL = "https://git.invalid/lab/gitdep.git"  # never resolvable: only the mirror map reaches it
CRATES_IO = "registry+https://github.com/rust-lang/crates.io-index"

MAIN_RS = """fn main() {
    cfg_if::cfg_if! {
        if #[cfg(unix)] { let os = "unix"; } else { let os = "other"; }
    }
    let mut buf = itoa::Buffer::new();
    println!("fixture {} {} {}", buf.format(4242u32), os, gitdep::answer());
}
"""
GITDEP = {"Cargo.toml": '[package]\nname = "gitdep"\nversion = "0.1.0"\nedition = "2021"\n',
          "src/lib.rs": "pub fn answer() -> u32 {\n    42\n}\n",
          "README.md": "# gitdep\n"}


def _unavailable(why: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: {why}")
    pytest.skip(why)


def _debian_crate(name: str) -> Path:
    hits = sorted(DEBIAN_REGISTRY.glob(f"{name}-[0-9]*")) if DEBIAN_REGISTRY.is_dir() else []
    if not hits:
        pkg = CRATES[name]
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            _unavailable(f"{pkg} is not installed and apt-get cannot install it here (not root / no apt)")
        r = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", pkg], capture_output=True,
                           text=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if r.returncode != 0:
            _unavailable(f"apt-get install {pkg} failed: {r.stdout[-300:]}{r.stderr[-300:]}")
        hits = sorted(DEBIAN_REGISTRY.glob(f"{name}-[0-9]*"))
        if not hits:
            _unavailable(f"{pkg} installed no {DEBIAN_REGISTRY}/{name}-<version>")
    return hits[-1]


def make_crate(src: Path) -> bytes:
    """A .crate (gzip tar of ``<name>-<version>/``) of a Debian crate source folder."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for p in sorted(src.rglob("*")):
            if p.is_file() and p.name != ".cargo-checksum.json":
                info = tf.gettarinfo(str(p), arcname=f"{src.name}/{p.relative_to(src).as_posix()}")
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                with open(p, "rb") as fh:
                    tf.addfile(info, fh)
    return buf.getvalue()


class Registry:
    """A stand-in sparse registry on 127.0.0.1: ``index/config.json`` and ``crates/<name>/<file>``."""

    def __init__(self, root: Path):
        self.root = root
        self.hits: list[str] = []
        (root / "index").mkdir(parents=True)
        outer = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *a):
                outer.hits.append(self.path)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        (root / "index" / "config.json").write_text(json.dumps({"dl": f"http://127.0.0.1:{self.port}/crates"}))
        self.checksums: dict[str, tuple[str, str]] = {}  # name -> (version, sha256)

    def add(self, src: Path) -> None:
        name, version = src.name.rsplit("-", 1)
        data = make_crate(src)
        # the default dl layout: <dl>/<crate>/<version>/download
        d = self.root / "crates" / name / version
        d.mkdir(parents=True)
        (d / "download").write_bytes(data)
        self.checksums[name] = (version, hashlib.sha256(data).hexdigest())

    @property
    def index(self) -> str:
        return f"sparse+http://127.0.0.1:{self.port}/index/"


def cargo_lock(reg: Registry, git_commit: str, extra: str = "") -> str:
    pk = {n: reg.checksums[n] for n in CRATES}
    return (
        "# This file is automatically @generated by Cargo.\n# It is not intended for manual editing.\nversion = 4\n\n"
        f'[[package]]\nname = "cfg-if"\nversion = "{pk["cfg-if"][0]}"\nsource = "{CRATES_IO}"\n'
        f'checksum = "{pk["cfg-if"][1]}"\n\n'
        '[[package]]\nname = "fixture"\nversion = "0.1.0"\ndependencies = [\n "cfg-if",\n "gitdep",\n "itoa",\n]\n\n'
        f'[[package]]\nname = "gitdep"\nversion = "0.1.0"\nsource = "git+{GIT_URL}?rev={git_commit}#{git_commit}"\n\n'
        f'[[package]]\nname = "itoa"\nversion = "{pk["itoa"][0]}"\nsource = "{CRATES_IO}"\n'
        f'checksum = "{pk["itoa"][1]}"\n' + extra)


def cargo_toml(git_commit: str, edition: str = "2024") -> str:
    return (f'[package]\nname = "fixture"\nversion = "0.1.0"\nedition = "{edition}"\n\n'
            f'[dependencies]\nitoa = "1"\ncfg-if = "1"\ngitdep = {{ git = "{GIT_URL}", rev = "{git_commit}" }}\n')


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("rustworld")
    reg = Registry(base / "registry")
    for name in CRATES:
        reg.add(_debian_crate(name))
    (base / "served").mkdir()
    daemon = GitDaemon(base / "served").start()
    f = UpstreamFactory(base / "served", daemon)
    dep = f.create("gitdep", GITDEP)
    commit = dep.head()
    app = f.create("app", {"README.md": "# app\n", "setup.py": "# no rust here\n"})
    with_rust = app.commit({"rust-toolchain.toml": '[toolchain]\nchannel = "1.95"\nprofile = "minimal"\n',
                            "rust/Cargo.toml": cargo_toml(commit), "rust/Cargo.lock": cargo_lock(reg, commit),
                            "rust/src/main.rs": MAIN_RS,
                            "third_party/other/Cargo.lock": "# not ours\nversion = 4\n",
                            "third_party/other/Cargo.toml": '[package]\nname = "other"\nversion = "0.0.0"\n'},
                           "add the Rust frontend")
    cfg = base / "cargo-config.toml"
    cfg.write_text(f'[source.crates-io]\nreplace-with = "stand-in"\n\n[source.stand-in]\nregistry = "{reg.index}"\n')
    yield {"reg": reg, "daemon": daemon, "app": app, "dep": dep, "commit": commit, "with_rust": with_rust,
           "cfg": cfg, "base": base}
    reg.server.shutdown()
    daemon.stop()


@pytest.fixture
def env(monkeypatch, world, tmp_path):
    """No cargo on the host; the machine's cargo config names the stand-in registry; git's mirror map
    sends the git crate's URL to the loopback daemon."""
    monkeypatch.setenv("IMAGEBUILD_RETRY_DELAY", "0.05")
    monkeypatch.delenv("IMAGEBUILD_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.cargo/bin/cargo
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                               if not (Path(p) / "cargo").exists()))
    monkeypatch.setenv("IMAGEBUILD_CARGO_CONFIG", str(world["cfg"]))
    monkeypatch.setenv("CARGO_NET_RETRY", "0")
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", f"url.{world['daemon'].url('dep')[:-3]}.insteadOf")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", "https://git.invalid/lab/")
    assert shutil.which("cargo") is None
    return world


def make_project(base: Path, repo_url: str, ref: str) -> Path:
    root = base / "project"
    img = root / "docker-images" / IMAGE
    img.mkdir(parents=True)
    (img / "versions.env").write_text(
        f"BASE_IMAGE=imagebuild-test/busybox:1\nAPP_REPO={repo_url}\nAPP_REF={ref}\nAPP_REQUIRE_RUST=0\n")
    (img / "image.yaml").write_text(
        "platform: linux/amd64\nstages:\n  - name: build\n    from: BASE_IMAGE\n    sources: [APP]\n"
        "sources:\n  APP:\n    scan_fetchcontent: false\n    cargo_switch: APP_REQUIRE_RUST\n")
    (img / "Dockerfile.build").write_text("ARG PARENT\nFROM ${PARENT}\nRUN true\n")
    return root


def prefetch(root: Path, cache: Path, *args: str):
    return run_cli("--root", str(root), "prefetch", "--cache", str(cache), *args)


def read_lock(root: Path) -> dict:
    return json.loads((root / "docker-images" / IMAGE / "lock.json").read_text())


def _no_net_works() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None and \
        subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


def _host_toolchain() -> Path:
    """A real toolchain's bin folder, used without rustup (as the stage will): rustup's stable."""
    for cand in sorted((Path("/root/.rustup/toolchains")).glob("stable-*/bin")) + [Path("/usr/bin")]:
        if (cand / "cargo").is_file() and (cand / "rustc").is_file():
            out = subprocess.run([str(cand / "rustc"), "--version"], capture_output=True, text=True).stdout
            m = re.match(r"rustc (\d+)\.(\d+)", out)
            if m and (int(m.group(1)), int(m.group(2))) >= (1, 85):
                return cand
    _unavailable("no Rust toolchain >= 1.85 (edition 2024) on this machine to build the fixture")


def test_prefetch_vendors_from_the_lock_with_no_cargo_and_the_stage_builds_offline(env, tmp_path):
    """R1 (no cargo on the host, a toolchain file it could not honour), R2 (a git crate through the
    mirror map, the registry from the machine's cargo config), and the real build."""
    w = env
    root = make_project(tmp_path / "a", w["app"].url(), w["with_rust"])
    r = prefetch(root, tmp_path / "cache")
    assert r.code == 0, r.err
    assert "cargo cannot run" not in r.err and "install Rust's cargo" not in r.err
    lock = read_lock(root)
    cg = lock["sources"]["APP"]["cargo"]
    assert cg["format"] == cargo_mod.FORMAT and cg["crates"] == 3
    assert (cg["registry_crates"], cg["git_crates"]) == (2, 1)
    assert [x["path"] for x in cg["lockfiles"]] == ["rust/Cargo.lock"]
    # R4: what the tree asks for, in the lock
    assert cg["toolchain"] == {"file": "rust-toolchain.toml", "channel": "1.95"}
    assert cg["rust_needs"][:3] == [["1.95", "rust-toolchain.toml", 'channel = "1.95"'],
                                   ["1.85", "rust/Cargo.toml", 'edition = "2024"'],
                                   ["1.78", "rust/Cargo.lock", "version = 4"]]
    assert cg["rust_version"] == ["1.95", 'rust-toolchain.toml (channel = "1.95")']
    tb = root / cg["tarball"]
    assert hashlib.sha256(tb.read_bytes()).hexdigest() == cg["sha256"]
    with tarfile.open(tb) as tf:
        tops = {n.split("/")[1] for n in tf.getnames() if n.count("/") >= 1}
        assert tops == {f"itoa-{w['reg'].checksums['itoa'][0]}", f"cfg-if-{w['reg'].checksums['cfg-if'][0]}",
                        "gitdep-0.1.0"}
        ck = json.loads(tf.extractfile(f"./itoa-{w['reg'].checksums['itoa'][0]}/.cargo-checksum.json").read())
        assert ck["package"] == w["reg"].checksums["itoa"][1]
        assert all(m.mtime == cargo_mod.VENDOR_MTIME and m.uid == 0 for m in tf.getmembers())
    assert f'[source."git+{GIT_URL}?rev={w["commit"]}"]' in cg["config"]

    # the same Cargo.lock, another project and cache: the same bytes
    root_b = make_project(tmp_path / "b", w["app"].url(), w["with_rust"])
    assert prefetch(root_b, tmp_path / "cache-b").code == 0
    assert (root_b / cg["tarball"]).read_bytes() == tb.read_bytes()

    # the stage: the tarballs alone, a fresh CARGO_HOME, no rustup, no network
    if not _no_net_works():
        _unavailable("unshare -n is not available (root needed) for the offline stage build")
    tc = _host_toolchain()
    ms = source_mounts.source_mounts(lock, "build", ["APP"])
    assert [m.name for m in ms.mounts] == ["APP", "APP.cargo-vendor"]
    fake = tmp_path / "stage"
    mount = fake / "imagebuild/src"
    mount.mkdir(parents=True)
    for m in ms.mounts:
        shutil.copy(root / m.tarball, mount / m.file)
    (mount / source_mounts.SCRIPT).write_text(ms.script().replace("/imagebuild/", f"{fake}/imagebuild/"))
    cmd = (f'set -e; . {mount}/{source_mounts.SCRIPT}; cd "$IMAGEBUILD_SRC_APP/rust"; '
           'cargo build --offline --locked -q; ./target/debug/fixture')
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CARGO", "RUSTUP", "GIT_CONFIG"))}
    clean["PATH"] = f"{tc}:{clean['PATH']}"
    b = subprocess.run(["unshare", "-n", "sh", "-c", cmd], capture_output=True, text=True, env=clean)
    assert b.returncode == 0, b.stdout + b.stderr
    assert "fixture 4242 unix 42" in b.stdout


def test_offline_prefetch_touches_no_network(env, tmp_path):
    """R3: with the crates and the git crate cached, ``prefetch --offline`` of a project whose deps-src
    has no vendor tarball yet runs in a network namespace with no route at all."""
    if not _no_net_works():
        _unavailable("unshare -n is not available (root needed)")
    w = env
    cache = tmp_path / "cache"
    root = make_project(tmp_path / "a", w["app"].url(), w["with_rust"])
    assert prefetch(root, cache).code == 0
    fresh = make_project(tmp_path / "b", w["app"].url(), w["with_rust"])
    hits = len(w["reg"].hits)
    r = subprocess.run(["unshare", "-n", sys.executable, "-m", "imagebuild", "--root", str(fresh), "prefetch",
                        "--cache", str(cache), "--offline"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[3])
    assert r.returncode == 0, r.stderr
    assert len(w["reg"].hits) == hits
    a, b = read_lock(root)["sources"]["APP"]["cargo"], read_lock(fresh)["sources"]["APP"]["cargo"]
    assert a["sha256"] == b["sha256"] and (fresh / b["tarball"]).is_file()
    # and a crate the cache lacks is named, offline, before any lock is written
    for p in (cache / "crates").iterdir():
        p.unlink()
    third = make_project(tmp_path / "c", w["app"].url(), w["with_rust"])
    r = subprocess.run(["unshare", "-n", sys.executable, "-m", "imagebuild", "--root", str(third), "prefetch",
                        "--cache", str(cache), "--offline"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[3])
    assert r.returncode != 0
    assert "APP: rust/Cargo.lock: crate cfg-if" in r.stderr and "--offline" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (third / "docker-images" / IMAGE / "lock.json").exists()


def test_a_crate_whose_bytes_differ_from_the_lock_is_refused(env, tmp_path, monkeypatch):
    w = env
    bad = w["base"] / "registry-bad"
    reg = Registry(bad)
    try:
        for name in CRATES:
            reg.add(_debian_crate(name))
        # the registry serves another itoa than the lock's
        data = (bad / "crates/itoa" / w["reg"].checksums["itoa"][0] / "download").read_bytes()
        (bad / "crates/itoa" / w["reg"].checksums["itoa"][0] / "download").write_bytes(data + b"\0")
        cfg = tmp_path / "bad.toml"
        cfg.write_text(f'[source.crates-io]\nreplace-with = "bad"\n[source.bad]\nregistry = "{reg.index}"\n')
        monkeypatch.setenv("IMAGEBUILD_CARGO_CONFIG", str(cfg))
        root = make_project(tmp_path, w["app"].url(), w["with_rust"])
        r = prefetch(root, tmp_path / "cache")
        assert r.code == 1, r.err
        assert "APP: rust/Cargo.lock: crate itoa" in r.err and "the Cargo.lock says " + w["reg"].checksums["itoa"][1] in r.err
        assert not (root / "docker-images" / IMAGE / "lock.json").exists()
        assert not list((tmp_path / "cache").glob("crates/*.crate")) or all(
            hashlib.sha256(p.read_bytes()).hexdigest() + ".crate" == p.name for p in (tmp_path / "cache/crates").iterdir())
    finally:
        reg.server.shutdown()


def test_no_configured_registry_says_what_to_configure(env, tmp_path, monkeypatch):
    w = env
    monkeypatch.delenv("IMAGEBUILD_CARGO_CONFIG")
    monkeypatch.delenv("CARGO_HOME", raising=False)
    root = make_project(tmp_path, w["app"].url(), w["with_rust"])
    r = prefetch(root, tmp_path / "cache")
    assert r.code == 1, r.err
    assert "no registry to take the crates of" in r.err and "replace-with" in r.err, r.err
    assert "Traceback" not in r.err


# ------------------------------------------------------------------ the toolchain the tree names (rust_dist.py)
STANDIN_CACHE = Path(os.environ.get("IMAGEBUILD_TEST_RUST_STANDIN", "/tmp/imagebuild-test-rust-standin"))
TARGET = "x86_64-unknown-linux-gnu"


def _standin_archives() -> tuple[str, str, dict[str, Path]]:
    """(rustc's version line, its X.Y.Z, {component: .tar.gz}): release-shaped archives of this
    machine's rustup stable toolchain (rustup's own per-component file lists say what goes where),
    made once and kept under STANDIN_CACHE (they are large)."""
    tc = Path("/root/.rustup/toolchains") / f"stable-{TARGET}"
    if not (tc / "bin/rustc").is_file() or not (tc / f"lib/rustlib/manifest-rustc-{TARGET}").is_file():
        _unavailable(f"no rustup stable toolchain for {TARGET} to make stand-in release archives of")
    line = subprocess.run([str(tc / "bin/rustc"), "--version"], capture_output=True, text=True, check=True).stdout.strip()
    version = line.split()[1]
    if not version.startswith("1.95."):
        _unavailable(f"the stand-in must be Rust 1.95 (the fixture's toolchain file); this machine has {line}")
    out = STANDIN_CACHE / version
    archives = {}
    for comp in ("rustc", "cargo", "rust-std"):
        pkg = f"{comp}-{version}-{TARGET}"
        dest = out / f"{pkg}.tar.gz"
        archives[comp] = dest
        if dest.is_file():
            continue
        out.mkdir(parents=True, exist_ok=True)
        cname = comp if comp != "rust-std" else f"rust-std-{TARGET}"
        files = [ln.split(":", 1)[1] for ln in (tc / f"lib/rustlib/manifest-{comp}-{TARGET}").read_text().splitlines()
                 if ln.startswith("file:")]
        tmp = dest.with_suffix(".tmp")
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=1) as gz, \
                tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tf:
            def add_bytes(name: str, data: bytes) -> None:
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o644
                tf.addfile(info, io.BytesIO(data))
            add_bytes(f"{pkg}/components", f"{cname}\n".encode())
            add_bytes(f"{pkg}/rust-installer-version", b"3\n")
            add_bytes(f"{pkg}/{cname}/manifest.in", "".join(f"file:{f}\n" for f in files).encode())
            for f in files:
                tf.add(str(tc / f), arcname=f"{pkg}/{cname}/{f}", recursive=False)
        tmp.rename(dest)
    return line, version, archives


@pytest.fixture(scope="module")
def dist_server(tmp_path_factory):
    """A stand-in Rust dist server on 127.0.0.1: dist/channel-rust-1.95.toml (+ .sha256) listing the
    stand-in archives with their sha256, under a published host that does not exist."""
    line, version, archives = _standin_archives()
    root = tmp_path_factory.mktemp("rustdist")
    day = root / "dist" / "2026-04-16"
    day.mkdir(parents=True)
    lines = ['manifest-version = "2"', 'date = "2026-04-16"']
    for comp, path in archives.items():
        os.symlink(path, day / path.name)
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        lines += ["", f"[pkg.{comp}]", f'version = "{line.split(" ", 1)[1]}"', "",
                  f"[pkg.{comp}.target.{TARGET}]", "available = true",
                  f'url = "https://dist.invalid/dist/2026-04-16/{path.name}"', f'hash = "{sha}"']
    text = "\n".join(lines) + "\n"
    (root / "dist/channel-rust-1.95.toml").write_text(text)
    (root / "dist/channel-rust-1.95.toml.sha256").write_text(
        f"{hashlib.sha256(text.encode()).hexdigest()}  channel-rust-1.95.toml\n")
    hits: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a):
            hits.append(self.path)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield {"url": f"http://127.0.0.1:{srv.server_address[1]}", "version": version, "hits": hits,
           "sha": {c: hashlib.sha256(p.read_bytes()).hexdigest() for c, p in archives.items()}}
    srv.shutdown()


def test_the_toolchain_the_tree_names_is_pinned_and_the_stage_builds_with_it_offline(env, dist_server, tmp_path,
                                                                                     monkeypatch):
    """rust_toolchain: dist: the archives of Rust 1.95 (rust-toolchain.toml) checked against the channel
    manifest, packed into deps-src, recorded in the lock; the stage installs them (no rustup, no other
    Rust on PATH) and builds the fixture offline; --offline prefetch again, with no network at all."""
    if not _no_net_works():
        _unavailable("unshare -n is not available (root needed)")
    w = env
    monkeypatch.setenv("RUSTUP_DIST_SERVER", dist_server["url"])
    root = make_project(tmp_path / "a", w["app"].url(), w["with_rust"])
    y = root / "docker-images" / IMAGE / "image.yaml"
    y.write_text(y.read_text() + "    rust_toolchain: dist\n")
    cache = tmp_path / "cache"
    r = prefetch(root, cache)
    assert r.code == 0, r.err
    lock = read_lock(root)
    td = lock["sources"]["APP"]["cargo"]["toolchain_dist"]
    assert (td["channel"], td["version"], td["target"], td["file"]) == ("1.95", dist_server["version"], TARGET,
                                                                       "rust-toolchain.toml")
    assert [a["component"] for a in td["archives"]] == ["rustc", "cargo", "rust-std"]
    for a in td["archives"]:
        assert a["sha256"] == dist_server["sha"][a["component"]]
        assert a["url"].startswith("https://dist.invalid/dist/2026-04-16/")  # as published, not the mirror's
        assert hashlib.sha256((root / a["tarball"]).read_bytes()).hexdigest() == a["sha256"]
        assert f"{a['sha256']}  {Path(a['tarball']).name}\n" in (root / f"deps-src/{IMAGE}/src/SHA256SUMS").read_text()

    # bundle carries them to an air-gapped node (and the SHA256SUMS that lists them)
    out = tmp_path / "b.tar"
    r = run_cli("--root", str(root), "bundle", IMAGE, "-o", str(out))
    assert r.code == 0, r.err
    with tarfile.open(out) as tf:
        names = set(tf.getnames())
        assert all(a["tarball"] in names for a in td["archives"])
        sums = tf.extractfile(f"deps-src/{IMAGE}/src/SHA256SUMS").read()
    assert sums == (root / f"deps-src/{IMAGE}/src/SHA256SUMS").read_bytes()
    out.unlink()

    # the stage: nothing but the mounted tarballs; no Rust on PATH before the script
    ms = source_mounts.source_mounts(lock, "build", ["APP"])
    assert [m.name for m in ms.mounts] == ["APP", "APP.cargo-vendor", "APP.rust-rustc", "APP.rust-cargo",
                                           "APP.rust-rust-std"]
    fake = tmp_path / "stage"
    mount = fake / "imagebuild/src"
    mount.mkdir(parents=True)
    for m in ms.mounts:
        os.link(root / m.tarball, mount / m.file)
    (mount / source_mounts.SCRIPT).write_text(ms.script().replace("/imagebuild/", f"{fake}/imagebuild/"))
    cmd = (f'set -e; ! command -v cargo; . {mount}/{source_mounts.SCRIPT}; cd "$IMAGEBUILD_SRC_APP/rust"; '
           'command -v cargo; rustc --version; cargo build --offline --locked -q; ./target/debug/fixture')
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CARGO", "RUSTUP", "GIT_CONFIG"))}
    b = subprocess.run(["unshare", "-n", "sh", "-c", cmd], capture_output=True, text=True, env=clean)
    assert b.returncode == 0, b.stdout + b.stderr
    assert f"{fake}/imagebuild/work/rust/bin/cargo" in b.stdout and f"rustc {dist_server['version']}" in b.stdout
    assert "fixture 4242 unix 42" in b.stdout
    assert f"imagebuild-src: Rust {dist_server['version']} for {TARGET}" in b.stderr

    # --offline, another project, the same cache, no network namespace route: all from the cache
    fresh = make_project(tmp_path / "b", w["app"].url(), w["with_rust"])
    yf = fresh / "docker-images" / IMAGE / "image.yaml"
    yf.write_text(yf.read_text() + "    rust_toolchain: dist\n")
    hits = len(dist_server["hits"])
    r = subprocess.run(["unshare", "-n", sys.executable, "-m", "imagebuild", "--root", str(fresh), "prefetch",
                        "--cache", str(cache), "--offline"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[3])
    assert r.returncode == 0, r.stderr
    assert len(dist_server["hits"]) == hits
    assert read_lock(fresh)["sources"]["APP"]["cargo"]["toolchain_dist"]["archives"] == td["archives"]


def test_no_dist_server_configured_says_so(env, tmp_path, monkeypatch):
    w = env
    monkeypatch.delenv("RUSTUP_DIST_SERVER", raising=False)
    root = make_project(tmp_path, w["app"].url(), w["with_rust"])
    y = root / "docker-images" / IMAGE / "image.yaml"
    y.write_text(y.read_text() + "    rust_toolchain: dist\n")
    r = prefetch(root, tmp_path / "cache")
    assert r.code == 1 and "RUSTUP_DIST_SERVER is not set" in r.err, r.err
    assert not (root / "docker-images" / IMAGE / "lock.json").exists()


def test_a_build_script_that_runs_protoc_needs_an_apt_protoc_unless_protox(env, tmp_path):
    """protoc: read from the commit (no build): tonic_prost_build in rust/build.rs needs it, and a stage
    that installs none is refused at prefetch; with protox in the Cargo.lock (vllm#52892) it is not needed."""
    w = env
    build_rs = ('fn main() {\n    tonic_prost_build::configure()\n        .compile_protos(&["proto/x.proto"], '
                '&["proto"])\n        .unwrap();\n}\n')
    needs = w["app"].commit({"rust/build.rs": build_rs}, "a build script that runs protoc")
    root = make_project(tmp_path / "a", w["app"].url(), needs)
    r = prefetch(root, tmp_path / "cache")
    # the stage installs no protoc (no apt list): refused before the lock is written, naming the script
    assert r.code == 1, r.err
    assert ("error: APP: rust/build.rs: tonic_prost_build runs the protobuf compiler (protoc), and no apt list of "
            "stage 'build' or of the stages below it installs protobuf-compiler") in r.err, r.err
    assert "Traceback" not in r.err and not (root / "docker-images" / IMAGE / "lock.json").exists()
    lock_text = cargo_lock(w["reg"], w["commit"])
    protox = w["app"].commit({"rust/Cargo.lock": lock_text.replace(
        '[[package]]\nname = "itoa"', '[[package]]\nname = "protox"\nversion = "0.9.0"\n\n[[package]]\nname = "itoa"')},
        "protox instead of protoc")
    root = make_project(tmp_path / "c", w["app"].url(), protox)
    r = prefetch(root, tmp_path / "cache")
    assert r.code == 0, r.err
    assert read_lock(root)["sources"]["APP"]["cargo"]["protoc"] == {
        "needed": False, "build_scripts": ["rust/build.rs: tonic_prost_build"], "compiler": "protox"}


@pytest.mark.engine
def test_a_real_stage_builds_the_fixture_with_the_pinned_toolchain_from_deps_src_alone(env, dist_server, tmp_path,
                                                                                        monkeypatch, engine_info):
    """The acceptance build: `imagebuild build` of a stage (--network none, Debian bookworm base: a C
    linker, no Rust at all) that sources imagebuild-src.sh and runs `cargo build --offline --locked`
    with the Rust 1.95 the tree's rust-toolchain.toml names, every byte from deps-src."""
    from tests.buildfixtures import cat, remove_images
    from tests.peers import DEBIAN

    w = env
    image = "rust31"
    monkeypatch.setenv("RUSTUP_DIST_SERVER", dist_server["url"])
    root = tmp_path / "project"
    img = root / "docker-images" / image
    img.mkdir(parents=True)
    (img / "versions.env").write_text(
        f"BASE_IMAGE={DEBIAN}\nAPP_REPO={w['app'].url()}\nAPP_REF={w['with_rust']}\nAPP_REQUIRE_RUST=0\n")
    (img / "image.yaml").write_text(
        "platform: linux/amd64\nstages:\n  - name: build\n    from: BASE_IMAGE\n    sources: [APP]\n"
        "sources:\n  APP:\n    scan_fetchcontent: false\n    cargo_switch: APP_REQUIRE_RUST\n    rust_toolchain: dist\n")
    (img / "Dockerfile.build").write_text(
        "ARG PARENT\nFROM ${PARENT}\n"
        "RUN ! command -v cargo && ! command -v rustc\n"
        "RUN --mount=type=bind,from=imagebuild-src,target=/imagebuild/src \\\n"
        "    . /imagebuild/src/imagebuild-src.sh && cd \"$IMAGEBUILD_SRC_APP/rust\" \\\n"
        "    && mkdir -p /out && rustc --version > /out/rustc.txt \\\n"
        "    && cargo build --offline --locked --release -q && ./target/release/fixture > /out/fixture.txt \\\n"
        "    && cd / && rm -rf /imagebuild/work\n")
    r = prefetch(root, tmp_path / "cache")
    assert r.code == 0, r.err
    remove_images(f"imagebuild/{image}", image)
    try:
        r = run_cli("--root", str(root), "build", image, "--json", "--no-gate", "--no-cache")
        assert r.code == 0, r.err
        st = json.loads(r.out)["stages"][0]
        assert st["status"] == "built" and st["network"] == "none"
        assert st["named_contexts"]["imagebuild-src"] == [
            "APP.cargo-vendor.tar", "APP.rust-cargo.tar.gz", "APP.rust-rust-std.tar.gz", "APP.rust-rustc.tar.gz",
            "APP.tar", "imagebuild-src.json", "imagebuild-src.sh"]  # ours plain tars, Rust's release archives gzip
        cand = f"{image}:candidate"
        assert cat(cand, "/out/fixture.txt") == "fixture 4242 unix 42\n"
        assert cat(cand, "/out/rustc.txt").startswith(f"rustc {dist_server['version']} ")
    finally:
        remove_images(f"imagebuild/{image}", image)


@pytest.mark.engine
def test_debian_bookworms_rustc_is_refused_for_the_newer_tree_at_prefetch(env, tmp_path, monkeypatch, engine_info):
    """R4, end to end: a stage that builds the newer tree with Debian bookworm's apt rustc 1.63 (pinned
    and fetched by prefetch from the machine's Debian mirror) is refused before the lock is written,
    naming the toolchain file, the version it asks for, the rustc found and the stage."""
    from tests.peers import DEBIAN

    if subprocess.run(["docker", "image", "inspect", DEBIAN], capture_output=True).returncode != 0:
        _unavailable(f"{DEBIAN} missing (scripts/testbed.sh imports it)")
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state"))
    w = env
    image = "rust31apt"
    root = tmp_path / "project"
    img = root / "docker-images" / image
    img.mkdir(parents=True)
    (img / "versions.env").write_text(
        f"BASE_IMAGE={DEBIAN}\nAPP_REPO={w['app'].url()}\nAPP_REF={w['with_rust']}\nAPP_REQUIRE_RUST=0\n")
    (img / "image.yaml").write_text(
        "platform: linux/amd64\nstages:\n  - name: build\n    from: BASE_IMAGE\n    sources: [APP]\n"
        "    apt: apt-rust.txt\nsources:\n  APP:\n    scan_fetchcontent: false\n    cargo_switch: APP_REQUIRE_RUST\n")
    (img / "apt-rust.txt").write_text("rustc=1.63.0+dfsg1-2\n")
    (img / "Dockerfile.build").write_text("ARG PARENT\nFROM ${PARENT}\nRUN true\n")
    r = run_cli("--root", str(root), "prefetch", "--cache", str(tmp_path / "cache"))
    assert r.code == 1, r.err
    assert (f"docker-images/{image}/apt-rust.txt: rustc=1.63.0+dfsg1-2 is older than the Rust 1.95 that "
            'rust-toolchain.toml (channel = "1.95") of APP asks for: stage \'build\' needs it to cargo-build '
            "rust/Cargo.lock") in r.err, r.err
    assert 'rust/Cargo.toml (edition = "2024")' in r.err and "rust/Cargo.lock (version = 4)" in r.err
    assert "Traceback" not in r.err and not (img / "lock.json").exists()
