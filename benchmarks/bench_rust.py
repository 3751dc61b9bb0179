"""prefetch's Rust crates step, cold, on a vLLM-sized tree (issue 31): vendoring the crates of
``rust/Cargo.lock`` from the lock alone (fetch/crates.py: the Cargo.lock blob read from the mirror,
nothing extracted) against what prefetch did before: the whole composed tree extracted
(``git archive | tar -x``) and ``cargo vendor --locked`` run on it.

The tree is the vLLM snapshot of ../shared/upstream (about 5,600 files) with a ``rust/`` crate of
two dependencies added; the crates come from a cargo directory source of Debian's packaged crates
(``librust-itoa-dev``, ``librust-cfg-if-dev``) on both sides, so no network and the same crates.
The baseline needs a cargo on the machine; the row is left out without one, or without the snapshot.

``python benchmarks/bench_rust.py --cpu`` prints the CPU seconds (user + system, this process and
its children) of each side instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from harness import Benchmark, sh

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from imagebuild.fetch import cargo as cargo_mod  # noqa: E402
from imagebuild.fetch import gitcache, tarball  # noqa: E402

SNAPSHOT = ROOT.parent / "shared" / "upstream" / "vllm-28be48fa.tar.gz"
if not SNAPSHOT.is_file():
    SNAPSHOT = Path("/work/shared/upstream/vllm-28be48fa.tar.gz")
DEBIAN = Path("/usr/share/cargo/registry")
CARGO_TOML = '[package]\nname = "fixture"\nversion = "0.1.0"\nedition = "2021"\n\n[dependencies]\nitoa = "1"\ncfg-if = "1"\n'


def _cargo() -> str | None:
    found = shutil.which("cargo")
    home = Path.home() / ".cargo/bin/cargo"
    return found or (str(home) if home.is_file() else None)


class _Vendor:
    def available(self) -> bool:
        return SNAPSHOT.is_file() and _cargo() is not None and \
            all(list(DEBIAN.glob(f"{n}-[0-9]*")) for n in ("itoa", "cfg-if"))

    def setup(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-rust-"))
        reg = self.tmp / "registry"
        reg.mkdir()
        for n in ("itoa", "cfg-if"):
            src = sorted(DEBIAN.glob(f"{n}-[0-9]*"))[-1]
            out = reg / src.name
            shutil.copytree(src, out, ignore=shutil.ignore_patterns(".cargo-checksum.json"))
            files = {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                     for p in sorted(out.rglob("*")) if p.is_file()}
            (out / ".cargo-checksum.json").write_text(json.dumps({"files": files, "package": None}))
        self.cfg = self.tmp / "config.toml"
        self.cfg.write_text(f'[source.crates-io]\nreplace-with = "deb"\n[source.deb]\ndirectory = "{reg}"\n')
        work = self.tmp / "work"
        work.mkdir()
        with tarfile.open(SNAPSHOT) as tf:
            tf.extractall(work, filter="data")
        tops = list(work.iterdir())
        tree = tops[0] if len(tops) == 1 and tops[0].is_dir() else work
        (tree / "rust/src").mkdir(parents=True, exist_ok=True)
        (tree / "rust/Cargo.toml").write_text(CARGO_TOML)
        (tree / "rust/src/main.rs").write_text("fn main() {}\n")
        home = self.tmp / "home"
        home.mkdir()
        shutil.copy(self.cfg, home / "config.toml")
        sh(_cargo(), "generate-lockfile", "--offline", cwd=tree / "rust", env={**os.environ, "CARGO_HOME": str(home)})
        git = ["git", "-c", "user.name=b", "-c", "user.email=b@b"]
        sh(*git, "init", "-q", str(tree))
        sh(*git, "-C", str(tree), "add", "-A")
        sh(*git, "-C", str(tree), "commit", "-q", "-m", "snapshot")
        self.commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True,
                                     text=True, check=True).stdout.strip()
        self.cache = gitcache.Cache(self.tmp / "cache")
        self.m = self.cache.mirror(tree.as_uri())
        self.m.fetch([self.commit], "bench")
        self.locks = cargo_mod.find_lockfiles(tarball.list_tree(self.m, self.commit))
        assert [x.path for x in self.locks] == ["rust/Cargo.lock"]
        os.environ[cargo_mod.CONFIG_ENV] = str(self.cfg)

    def ours(self) -> None:
        dest = self.tmp / "ours.tar"
        v = cargo_mod.vendor("VLLM", self.m, self.commit, None, self.locks, dest, cache=self.cache)
        assert v.crates == 2

    def baseline(self) -> None:
        """What prefetch did before: the whole tree extracted, then cargo vendor, then the same pack."""
        t = Path(tempfile.mkdtemp(prefix="old-", dir=self.tmp))
        (t / "tree").mkdir()
        (t / "home").mkdir()
        shutil.copy(self.cfg, t / "home/config.toml")
        arch = subprocess.Popen(["git", "--git-dir", str(self.m.path), "archive", "--format=tar", self.commit],
                                stdout=subprocess.PIPE)
        sh("tar", "-x", "-C", str(t / "tree"), stdin=arch.stdout)
        arch.wait()
        sh(_cargo(), "vendor", "--locked", "--versioned-dirs", "--respect-source-config", "--manifest-path",
           str(t / "tree/rust/Cargo.toml"), str(t / "vendor"), cwd=t / "tree",
           env={**os.environ, "CARGO_HOME": str(t / "home"), "CARGO_TARGET_DIR": str(t / "target")})
        tarball.pack_dir(t / "vendor", t / "old.tar", cargo_mod.VENDOR_MTIME)
        shutil.rmtree(t)

    def teardown(self) -> None:
        os.environ.pop(cargo_mod.CONFIG_ENV, None)
        shutil.rmtree(self.tmp, ignore_errors=True)


def benchmarks():
    v = _Vendor()
    if not v.available():
        return []
    return [Benchmark("prefetch: vendor the Rust crates of a vLLM-sized tree, cold", v.ours, v.baseline, repeat=5,
                      setup=v.setup, teardown=v.teardown,
                      note="ours: from rust/Cargo.lock alone (only its blob read); baseline: the whole tree "
                      "extracted (git archive | tar -x) + cargo vendor --locked, as prefetch did before")]


def _cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


if __name__ == "__main__" and "--cpu" in sys.argv:
    v = _Vendor()
    if not v.available():
        sys.exit("needs the vLLM snapshot, a cargo and Debian's librust-itoa-dev/librust-cfg-if-dev")
    v.setup()
    try:
        for side in ("ours", "baseline") * 3:
            t0 = _cpu()
            getattr(v, side)()
            print(f"{side}: {_cpu() - t0:.3f} s CPU")
    finally:
        v.teardown()
