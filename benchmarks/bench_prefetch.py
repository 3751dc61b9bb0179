"""prefetch: (1) a re-run when nothing changed, a definition with a dozen git sources, against a
plain ``git fetch`` loop over the same dozen mirrors; (2) packing throughput of the
deterministic tarball writer (a plain tar, tarball format 2) against ``tar --sort=name ... -cf`` on the
same tree;
(3) ``imagebuild bundle`` and ``unbundle`` of a 150 MB prefetched source set against plain ``tar -c``
and ``tar -x`` of the same files.

Upstreams are real repositories served by a real ``git daemon`` on 127.0.0.1 (tests/gitfixtures).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from harness import Benchmark, sh

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from imagebuild.fetch import gitcache, tarball  # noqa: E402
from tests.gitfixtures import GitDaemon, UpstreamFactory, git  # noqa: E402

N_SOURCES = 12


class _Rerun:
    def __init__(self) -> None:
        self.tmp: Path | None = None
        self.daemon: GitDaemon | None = None

    def setup(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-prefetch-"))
        served = self.tmp / "served"
        served.mkdir()
        self.daemon = GitDaemon(served).start()
        f = UpstreamFactory(served, self.daemon)
        env = ["BASE_IMAGE=imagebuild-test/busybox:1"]
        self.fetch_args = []
        for i in range(N_SOURCES):
            files = {f"src/file{j}.c": f"int f{i}_{j}(void) {{ return {j}; }}\n" * 50 for j in range(40)}
            up = f.create(f"repo{i}", files)
            base = up.head()
            prs = []
            if i % 3 == 0:  # a third of them are forks with two PRs
                prs = [up.pull_request(100 + i, {f"pr{i}.txt": "a\n"}),
                       up.pull_request(200 + i, {f"pr{i}b.txt": "b\n"})]
            name = f"SRC{i}"
            env += [f"{name}_REPO={up.url()}", f"{name}_REF={base}"]
            if prs:
                env.append(f'{name}_PRS="{100 + i}@{prs[0]} {200 + i}@{prs[1]}"')
            self.fetch_args.append((up.url(), [base, *prs]))
        self.root = self.tmp / "project"
        img = self.root / "docker-images" / "dozen"
        img.mkdir(parents=True)
        (img / "versions.env").write_text("\n".join(env) + "\n")
        (img / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: s\n    from: BASE_IMAGE\n")
        (img / "Dockerfile.s").write_text("ARG PARENT\nFROM ${PARENT}\n")
        self.cache = self.tmp / "cache"
        self.ours()  # the first, real prefetch; the benchmark measures the re-run
        # the baseline's mirrors: one bare clone per upstream, already holding everything
        self.plain = self.tmp / "plain"
        self.plain.mkdir()
        for i, (url, _) in enumerate(self.fetch_args):
            git("clone", "-q", "--bare", url, str(self.plain / f"r{i}.git"))

    def ours(self) -> None:
        sh(sys.executable, "-m", "imagebuild", "--root", str(self.root), "prefetch", "--cache", str(self.cache),
           "--json")

    def baseline(self) -> None:
        # what a script does to make sure a dozen mirrors hold their pinned commits: fetch each
        for i, (url, shas) in enumerate(self.fetch_args):
            sh("git", "-C", str(self.plain / f"r{i}.git"), "fetch", "-q", url, *shas)

    def teardown(self) -> None:
        if self.daemon:
            self.daemon.stop()
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


class _Pack:
    """The Python standard library's sources (a real, mixed source tree) as a git tree."""

    def setup(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-pack-"))
        self.tree = self.tmp / "tree"
        stdlib = Path(os.__file__).parent
        shutil.copytree(stdlib, self.tree, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "site-packages", "*.pyc", "*.so",
                                                      "config-*", "lib-dynload", "idlelib", "turtledemo"))
        git("init", "-q", "-b", "main", str(self.tree))
        git("add", "-A", ".", cwd=self.tree)
        git("commit", "-q", "-m", "tree", cwd=self.tree, epoch=1_700_000_000)
        self.sha = git("rev-parse", "HEAD", cwd=self.tree)
        self.cache = gitcache.Cache(self.tmp / "cache", offline=True)
        self.mirror = self.cache.mirror(self.tree.as_uri())
        # a packed mirror, as a fetch makes it (a plain local clone would hard-link loose objects)
        git("clone", "-q", "--bare", "--no-local", self.tree.as_uri(), str(self.mirror.path))
        shutil.rmtree(self.tree / ".git")
        n = sum(1 for p in self.tree.rglob("*") if p.is_file())
        size = sum(p.stat().st_size for p in self.tree.rglob("*") if p.is_file())
        _Pack.note = f"{n} files, {size / 1e6:.0f} MB (CPython stdlib sources)"

    def ours(self) -> None:
        entries = [tarball.Entry(path, mode, sha, self.mirror)
                   for mode, sha, path in tarball.list_tree(self.mirror, self.sha) if mode != "160000"]
        tarball.pack(entries, self.tmp / "ours.tar", 1_700_000_000)

    def baseline(self) -> None:
        sh("tar", "--sort=name", "--mtime=@1700000000", "--owner=0", "--group=0", "--numeric-owner",
           "-C", str(self.tree), "-cf", str(self.tmp / "base.tar"), ".")

    def teardown(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


class _Bundle:
    """A prefetched image whose lock names 10 source tarballs of 15 MB each (random bytes: the bundle
    compresses nothing either way)."""

    N, SIZE = 10, 15 * 1000 * 1000

    def setup(self) -> None:
        import hashlib
        import json

        self.tmp = Path(tempfile.mkdtemp(prefix="bench-bundle-"))
        self.root = self.tmp / "project"
        shutil.copytree(ROOT / "tests" / "fixtures" / "project", self.root, symlinks=True)
        src = self.root / "deps-src" / "staged" / "src"
        src.mkdir(parents=True)
        sources, sums = {}, []
        for i in range(self.N):
            name = f"dep{i}-{i:012d}.tar"
            data = os.urandom(self.SIZE)
            (src / name).write_bytes(data)
            sha = hashlib.sha256(data).hexdigest()
            sources[f"DEP{i}"] = {"tarball": f"deps-src/staged/src/{name}", "sha256": sha}
            sums.append(f"{sha}  {name}\n")
        (src / "SHA256SUMS").write_text("".join(sorted(sums, key=lambda ln: ln.split()[1])))
        (self.root / "docker-images" / "staged" / "lock.json").write_text(json.dumps(
            {"schema": "imagebuild.lock", "version": 1, "image": "staged", "sources": sources}))
        self.ours_file, self.plain_file = self.tmp / "ours.tar", self.tmp / "plain.tar"
        self.bundle()
        self.plain_bundle()

    def bundle(self) -> None:
        sh(sys.executable, "-m", "imagebuild", "--root", str(self.root), "bundle", "staged", "-o", str(self.ours_file))

    def plain_bundle(self) -> None:
        sh("tar", "-C", str(self.root), "-cf", str(self.plain_file), "docker-images/staged/lock.json",
           "docker-images/staged/versions.env", "deps-src/staged")

    def fresh_targets(self) -> None:
        for t in ("node-ours", "node-plain"):
            shutil.rmtree(self.tmp / t, ignore_errors=True)
        shutil.copytree(ROOT / "tests" / "fixtures" / "project", self.tmp / "node-ours", symlinks=True)
        (self.tmp / "node-plain").mkdir()

    def unbundle(self) -> None:
        sh(sys.executable, "-m", "imagebuild", "--root", str(self.tmp / "node-ours"), "unbundle", str(self.ours_file))

    def plain_unbundle(self) -> None:
        sh("tar", "-C", str(self.tmp / "node-plain"), "-xf", str(self.plain_file))

    def teardown(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def benchmarks():
    rerun = _Rerun()
    pack = _Pack()
    bundle = _Bundle()
    unbundle = _Bundle()
    return [
        Benchmark(f"prefetch re-run, nothing changed ({N_SOURCES} sources, 4 forks with 2 PRs)", rerun.ours,
                  rerun.baseline, repeat=5, setup=rerun.setup, teardown=rerun.teardown,
                  note="ours: whole CLI run, no git run; baseline: `git fetch` of the pinned SHAs per mirror"),
        Benchmark("pack deterministic tar from git objects", pack.ours, pack.baseline, repeat=5,
                  setup=pack.setup, teardown=pack.teardown,
                  note="baseline: tar --sort=name --mtime --owner=0 --group=0 --numeric-owner -cf "
                  "on the same tree checked out"),
        Benchmark("bundle a 150 MB prefetched source set (10 tarballs)", bundle.bundle, bundle.plain_bundle,
                  repeat=5, setup=bundle.setup, teardown=bundle.teardown,
                  note="ours: checks every file against the lock while writing, deterministic tar + manifest; "
                  "baseline: tar -cf of the same files"),
        Benchmark("unbundle a 150 MB bundle (verify, then put in place)", unbundle.unbundle, unbundle.plain_unbundle,
                  repeat=5, setup=unbundle.setup, teardown=unbundle.teardown, per_run_setup=unbundle.fresh_targets,
                  note="ours: every member against manifest, SHA256SUMS and lock before anything is written; "
                  "baseline: tar -xf (no check)"),
    ]
