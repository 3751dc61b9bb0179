"""Cold prefetch of the real vLLM tree on a fork branch (issue 33, section 3), against the plain
baseline: fetch the branch head by SHA into an empty bare repository, then ``git archive | gzip -n``.

The tree is the vLLM snapshot of ../shared/upstream (local-inference-lab/vllm 28be48fa, about 5,000
files) committed as a stand-in commit and served by a real ``git daemon`` on 127.0.0.1, with one pull
request on top (a fork branch: base + PR head, composed by prefetch). The definition is glm53's shape:
the vLLM source with its wheel stage's patch set (patches-eugr + glm53's) and the runner stage's
``patch_cuda_sm12x.py``, so prefetch's patch check runs as it does for glm53 (scan_fetchcontent off:
the baseline fetches the vLLM tree alone too). Each run of ours starts from an empty cache and no
tarball (cold).

``python benchmarks/bench_prefetch_cold.py --cpu [--rounds N] [--imagebuild DIR]`` prints the CPU
seconds (user + system of the command and its children) of each side, interleaved, with the 1-minute
load average before each run, and the medians; ``--imagebuild DIR`` runs the imagebuild package found in
DIR (another checkout, e.g. the code before a change) for our side. It also runs, and gives the ratio
against, the same baseline without the compression (``git archive`` to a plain tar): not the issue's
baseline, but what the CPU left above the git tools is, now that imagebuild's tarballs are plain tars.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from harness import Benchmark, sh

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.gitfixtures import GitDaemon, UpstreamFactory, git  # noqa: E402

SNAPSHOT = ROOT.parent / "shared" / "upstream" / "vllm-28be48fa.tar.gz"
if not SNAPSHOT.is_file():
    SNAPSHOT = Path("/work/shared/upstream/vllm-28be48fa.tar.gz")
IMAGE = "coldvllm"
GLM53 = ROOT / "docker-images" / "glm53-jovian-r12"


class _Cold:
    def __init__(self, imagebuild: Path | None = None):
        self.imagebuild = imagebuild

    def available(self) -> bool:
        return SNAPSHOT.is_file()

    def setup(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-prefetch-cold-"))
        served = self.tmp / "served"
        served.mkdir()
        self.daemon = GitDaemon(served).start()
        f = UpstreamFactory(served, self.daemon)
        up = f.create("lab/vllm", {"README.md": "placeholder\n"}, message="placeholder")
        with tarfile.open(SNAPSHOT) as tf:
            tf.extractall(self.tmp / "x", filter="data")
        git("rm", "-q", "-r", ".", cwd=up.work)
        (top,) = list((self.tmp / "x").iterdir())
        subprocess.run(["cp", "-a", f"{top}/.", str(up.work)], check=True)
        shutil.rmtree(self.tmp / "x")
        git("add", "-A", ".", cwd=up.work)
        base = up.commit({}, "stand-in commit: the tree of local-inference-lab/vllm 28be48fa (snapshot)")
        pr = up.pull_request(41001, {"vllm/envs_fork_note.py": "# a fork branch's change\nNOTE = 1\n"})
        self.url, self.head = up.url(), pr
        self.root = self.tmp / "project"
        img = self.root / "docker-images" / IMAGE
        img.mkdir(parents=True)
        shutil.copytree(ROOT / "patches-eugr", self.root / "patches-eugr")
        stages = {s["name"]: s["patches"] for s in _glm53_stages()}
        wheel = [p if p.startswith("patches-eugr/") else _copy(GLM53 / p, img) for p in stages["vllm-wheel"]]
        runner = [_copy(GLM53 / p, img) for p in stages["runner"]]
        self.env = (f"BASE_IMAGE=imagebuild-test/busybox:1\nVLLM_REPO={self.url}\nVLLM_REF={base}\n"
                    f'VLLM_PRS="41001@{pr}"\n')
        (img / "image.yaml").write_text(
            "platform: linux/amd64\nsources:\n  VLLM:\n    scan_fetchcontent: false\nstages:\n"
            "  - name: wheel\n    from: BASE_IMAGE\n    sources: [VLLM]\n    patches:\n"
            + "".join(f"      - {p}\n" for p in wheel)
            + "  - name: runner\n    from: BASE_IMAGE\n    patches:\n" + "".join(f"      - {p}\n" for p in runner))
        (img / "Dockerfile.wheel").write_text("ARG PARENT\nFROM ${PARENT}\nRUN true\n")
        (img / "Dockerfile.runner").write_text("ARG STAGE_WHEEL\nARG PARENT\nFROM ${STAGE_WHEEL} AS wheel\n"
                                               "FROM ${PARENT}\nCOPY --from=wheel / /wheel/\n")
        self.fresh()

    def fresh(self) -> None:
        img = self.root / "docker-images" / IMAGE
        (img / "versions.env").write_text(self.env)
        (img / "lock.json").unlink(missing_ok=True)
        for p in (self.tmp / "cache", self.root / "deps-src", self.tmp / "plain.git", self.tmp / "plain.tar.gz",
                  self.tmp / "plain.tar"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)

    def ours(self) -> None:
        # run from the checkout whose code is measured: ``python -m`` puts the working folder first on
        # sys.path, ahead of PYTHONPATH, so from another checkout's root that one's package would run
        where = self.imagebuild or ROOT
        env = dict(os.environ, PYTHONPATH=str(where))
        sh(sys.executable, "-m", "imagebuild", "--root", str(self.root), "prefetch", IMAGE, "--cache",
           str(self.tmp / "cache"), "--json", env=env, cwd=str(where))

    def baseline(self) -> None:
        plain = self.tmp / "plain.git"
        sh("git", "init", "-q", "--bare", str(plain))
        sh("git", "-C", str(plain), "fetch", "-q", self.url, self.head)
        sh("bash", "-c", 'git -C "$1" archive --format=tar "$2" | gzip -n > "$3"', "_", str(plain), self.head,
           str(self.tmp / "plain.tar.gz"))

    def archive(self) -> None:
        """The baseline without gzip: fetch the head by SHA, then ``git archive`` to a plain tar."""
        plain = self.tmp / "plain.git"
        sh("git", "init", "-q", "--bare", str(plain))
        sh("git", "-C", str(plain), "fetch", "-q", self.url, self.head)
        sh("git", "-C", str(plain), "archive", "--format=tar", "-o", str(self.tmp / "plain.tar"), self.head)

    def teardown(self) -> None:
        self.daemon.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _copy(src: Path, img: Path) -> str:
    shutil.copyfile(src, img / src.name)
    return src.name


def _glm53_stages() -> list:
    """glm53's stages with their patches as image.yaml names them (patches-eugr/... from the project
    root, the image's own by file name)."""
    from imagebuild.definition import reader as d

    defn = d.load(ROOT, "glm53-jovian-r12")
    out = []
    for s in defn.stages:
        names = []
        for i in s.inputs:
            if i.kind == "patch":
                p = Path(i.path)
                names.append(p.name if p.parent == GLM53 else p.relative_to(ROOT).as_posix())
        out.append({"name": s.name, "patches": names})
    return out


def benchmarks():
    c = _Cold()
    if not c.available():
        return []
    return [Benchmark("prefetch cold: the real vLLM tree on a fork branch (glm53's patch check)", c.ours, c.baseline,
                      repeat=3, setup=c.setup, teardown=c.teardown, per_run_setup=c.fresh,
                      note="ours: whole CLI run from an empty cache (fetch, compose, pack, patch check); baseline: "
                      "git fetch of the branch head by SHA into an empty bare repo + git archive | gzip -n")]


def _cpu_of(fn) -> float:
    before = os.times()
    fn()
    after = os.times()
    return (after.children_user - before.children_user) + (after.children_system - before.children_system)


def main(argv: list[str]) -> int:
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 5
    ib = Path(argv[argv.index("--imagebuild") + 1]).resolve() if "--imagebuild" in argv else None
    c = _Cold(ib)
    if not c.available():
        sys.exit(f"needs the vLLM snapshot ({SNAPSHOT})")
    c.setup()
    sides = ("ours", "baseline", "archive")
    got: dict[str, list] = {s: [] for s in sides}
    wrote: dict[str, str] = {}
    try:
        for i in range(rounds):
            for side in sides[i % 3:] + sides[:i % 3]:  # each side first in turn
                c.fresh()
                load = os.getloadavg()[0]
                t0 = time.perf_counter()
                cpu = _cpu_of(getattr(c, side))
                got[side].append((cpu, load))
                print(f"round {i + 1} {side:8s} {cpu:6.2f} s CPU  {time.perf_counter() - t0:6.2f} s wall  "
                      f"load {load:5.2f}", flush=True)
                if i == 0:  # what each side wrote (the code measured, and the sizes on disk)
                    out = (sorted((c.root / "deps-src" / IMAGE / "src").glob("*.tar*")) if side == "ours" else
                           [c.tmp / ("plain.tar.gz" if side == "baseline" else "plain.tar")])
                    wrote[side] = ", ".join(f"{f.name} {f.stat().st_size / 1e6:.1f} MB" for f in out)
    finally:
        c.teardown()
    med = {s: statistics.median(x[0] for x in v) for s, v in got.items()}
    loads = {s: statistics.median(x[1] for x in v) for s, v in got.items()}
    print(f"median CPU: ours {med['ours']:.2f} s (load {loads['ours']:.2f}), baseline {med['baseline']:.2f} s "
          f"(load {loads['baseline']:.2f}); ratio {med['ours'] / med['baseline']:.2f}x"
          + (f"  [imagebuild from {ib}]" if ib else ""))
    ratios = [o[0] / b[0] for o, b in zip(got["ours"], got["baseline"], strict=True)]
    print(f"per-round ratios: {' '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}x")
    print("written: " + "; ".join(f"{s}: {w}" for s, w in wrote.items()))
    print(f"against git archive without gzip (fetch + git archive > .tar, not the issue's baseline): "
          f"{med['archive']:.2f} s (load {loads['archive']:.2f}); ratio {med['ours'] / med['archive']:.2f}x")
    return 0


if __name__ == "__main__" and "--cpu" in sys.argv:
    sys.exit(main(sys.argv[1:]))
