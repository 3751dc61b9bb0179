"""Issue 33, section 3: prefetch's patch check runs on a lazily populated tree (definition/lazytree.py:
a skeleton whose files get their bytes from the git mirror when first opened), not on a second full
unpack of the tarball. The verdicts must be the full unpack's, exactly:

- on the REAL vLLM tree (../shared/upstream/vllm-28be48fa.tar.gz, committed to a real git repository
  here), with glm53's real patch sets: the vllm-wheel stage's patches, and the runner's patch checked
  after them (as prefetch does, issue 29);
- on the runner-patch fixture trees of tests/integration/fetch/test_prefetch_runner_patch.py;
- with patches that read, list and stat files they do not edit, at import and while applying (what a
  skeleton could get wrong), and with one that starts a process (the lazy tree refuses, with the reason,
  and prefetch falls back to the full unpack).
"""

from __future__ import annotations

import os
import shutil
import tarfile
from pathlib import Path

import pytest

from imagebuild.definition import patchcheck
from imagebuild.definition import reader as d
from imagebuild.fetch import gitcache, tarball
from tests.gitfixtures import git

REPO = Path(__file__).resolve().parents[3]
UPSTREAM = Path(os.environ.get("IMAGEBUILD_SHARED_UPSTREAM", REPO.parent / "shared" / "upstream"))
if not (UPSTREAM / "vllm-28be48fa.tar.gz").is_file():
    UPSTREAM = Path("/work/shared/upstream")
SNAPSHOT = UPSTREAM / "vllm-28be48fa.tar.gz"
EPOCH = 1_700_000_000
FIXTURES = Path(__file__).resolve().parent


def _commit(tree: Path) -> tuple[tarball.Entry, list]:
    """``tree`` committed (fixed identity and date) and fetched into a packed mirror, as prefetch has it:
    (the entries prefetch packs, the listing the lazy check takes)."""
    git("init", "-q", "-b", "main", str(tree))
    git("add", "-A", ".", cwd=tree)
    git("commit", "-q", "-m", "tree", cwd=tree, epoch=EPOCH)
    m = gitcache.Cache(tree.parent / f"{tree.name}-cache", offline=True).mirror(tree.as_uri())
    git("clone", "-q", "--bare", "--no-local", tree.as_uri(), str(m.path))
    entries = [tarball.Entry(path, mode, sha, m) for mode, sha, path in tarball.list_tree(m, "HEAD")
               if mode != "160000"]
    return entries, [(e.path, e.mode, e.sha, e.repo.path) for e in entries]


def _full(paths: list, entries: list, tmp: Path) -> list:
    """The check as prefetch did it before: the packed tarball extracted whole."""
    out, tgz = tmp / "full", tmp / "packed.tar"
    shutil.rmtree(out, ignore_errors=True)
    if not tgz.is_file():
        tarball.pack(entries, tgz, EPOCH)
    with tarfile.open(tgz) as tf:
        tf.extractall(out, filter="data")
    return patchcheck.check(paths, out, copy=False)


def _same(paths: list, tree: tuple, tmp: Path) -> list:
    entries, listing = tree
    lazy, why = patchcheck.check_lazy(paths, listing, EPOCH)
    assert why is None, why
    full = _full(paths, entries, tmp)
    assert [r.as_dict() for r in lazy] == [r.as_dict() for r in full]
    return lazy


@pytest.fixture(scope="module")
def real_tree(tmp_path_factory):
    if not SNAPSHOT.is_file():
        pytest.skip(f"the real vLLM snapshot is not here ({SNAPSHOT})")
    base = tmp_path_factory.mktemp("real")
    with tarfile.open(SNAPSHOT) as tf:
        tf.extractall(base / "x", filter="data")
    (top,) = list((base / "x").iterdir())
    return _commit(top)


def _glm53_patches() -> tuple[list, list]:
    defn = d.load(REPO, "glm53-jovian-r12")
    st = {s.name: [i.path for i in s.inputs if i.kind == "patch"] for s in defn.stages}
    return st["vllm-wheel"], st["runner"]


def test_real_tree_verdicts_match_the_full_unpack(real_tree, tmp_path):
    listing = real_tree
    wheel, runner = _glm53_patches()
    assert len(wheel) >= 8 and [Path(p).name for p in runner] == ["patch_cuda_sm12x.py"]
    got = _same(wheel, listing, tmp_path)
    assert {r.outcome for r in got} - {"would-apply", "not-applicable", "not-needed", "already-applied", "failed"} == set()
    # the runner's patch on the tree as the wheel stage leaves it (prefetch's check, issue 29)
    both = _same([*wheel, *runner], listing, tmp_path)
    assert [r.as_dict() for r in both[:len(wheel)]] == [r.as_dict() for r in got]
    assert both[-1].patch == "patch_cuda_sm12x.py"


def _runner_fixture_trees() -> dict:
    src = (FIXTURES / "test_prefetch_runner_patch.py").read_text()
    ns: dict = {}
    start = src.index("R12 = ")
    exec(compile(src[start:src.index("@pytest.fixture", start)], "fixture", "exec"),  # noqa: S102
         {"Path": Path, "REPO": REPO}, ns)
    return {"r12": ns["R12"], "other": ns["OTHER"], "none": ns["NONE"], "wheel_patch": ns["WHEEL_PATCH"]}


@pytest.mark.parametrize("which, outcome", [("r12", "would-apply"), ("other", "failed"), ("none", "not-applicable")])
def test_runner_patch_fixture_trees(tmp_path, which, outcome):
    fx = _runner_fixture_trees()
    tree = tmp_path / "t"
    (tree / "vllm" / "platforms").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("")
    (tree / "vllm" / "platforms" / "cuda.py").write_text(fx[which])
    listing = _commit(tree)
    (tmp_path / "patch_wheel_stage.py").write_text(fx["wheel_patch"])
    runner = REPO / "docker-images" / "glm53-jovian-r12" / "patch_cuda_sm12x.py"
    got = _same([tmp_path / "patch_wheel_stage.py", runner], listing, tmp_path)
    assert got[-1].outcome == outcome


# a patch that decides its edits from files it does not edit: content (open), a listing, stat sizes and
# existence, at import; its edit's file is read by the runner; a symlink and an executable file are in the tree
NOSY = '''
import os
from pathlib import Path
from imagebuild_patching import Edit

conf = Path("pkg/conf.txt").read_text()          # relative to the tree (the check runs there)
names = sorted(os.listdir("pkg/sub"))
size = os.path.getsize("pkg/big.bin")
exists = Path("pkg/absent.py").exists(), Path("pkg/link.py").is_symlink(), os.access("pkg/run.sh", os.X_OK)
with open("pkg/link.py") as f:
    via_link = f.read()
with open("pkg/big.bin", "rb") as f:
    f.seek(size - 4)
    tail = f.read().hex()
import glob
walked = sorted((d, sorted(f)) for d, _s, f in os.walk("pkg"))
globbed = sorted(glob.glob("**/*.py", recursive=True)) + sorted(str(p) for p in Path(".").rglob("*.bin"))
try:
    os.stat("pkg/main.py/x")
    lookup = "found"
except OSError as exc:
    lookup = type(exc).__name__
mtime = int(os.path.getmtime("pkg/sub/a.py")), oct(os.stat("pkg/run.sh").st_mode)
tag = f"{conf.strip()}|{names}|{size}|{exists}|{via_link.strip()}|{tail}|{walked}|{globbed}|{lookup}|{mtime}"
EDITS = [Edit(file="pkg/main.py", anchor="X = 1\\n", replacement=f"X = 2  # imagebuild-patch: nosy {tag}\\n",
              marker="imagebuild-patch: nosy", applies_if=["X = "], reason=tag)]
'''


def _nosy_tree(tmp_path: Path) -> list:
    tree = tmp_path / "t"
    (tree / "pkg" / "sub").mkdir(parents=True)
    (tree / "pkg" / "main.py").write_text("X = 1\n")
    (tree / "pkg" / "conf.txt").write_text("mode=fast\n")
    (tree / "pkg" / "sub" / "b.py").write_text("")
    (tree / "pkg" / "sub" / "a.py").write_text("")
    (tree / "pkg" / "big.bin").write_bytes(bytes(range(256)) * 4000 + b"\x01\x02\x03\x04")
    (tree / "pkg" / "run.sh").write_text("#!/bin/sh\n")
    (tree / "pkg" / "run.sh").chmod(0o755)
    os.symlink("conf.txt", tree / "pkg" / "link.py")
    return _commit(tree)


def test_a_patch_reading_files_it_does_not_edit_sees_the_full_tree(tmp_path):
    listing = _nosy_tree(tmp_path)
    (tmp_path / "patch_nosy.py").write_text(NOSY)
    (got,) = _same([tmp_path / "patch_nosy.py"], listing, tmp_path)
    assert got.outcome == "would-apply", got
    # what the patch saw (its reason) is what the full unpack shows: checked equal above, and right here
    msg = got.edits[0].message
    assert msg.startswith("mode=fast|['a.py', 'b.py']|1024004|(False, True, True)|mode=fast|01020304|"), msg
    assert "NotADirectoryError" in msg and "'pkg/big.bin'" in msg and "0o100755" in msg, msg


def test_a_patch_starting_a_process_falls_back_with_the_reason(tmp_path):
    listing = _nosy_tree(tmp_path)
    (tmp_path / "patch_spawn.py").write_text("import subprocess\nsubprocess.run(['true'])\n" + NOSY)
    res, why = patchcheck.check_lazy([tmp_path / "patch_spawn.py"], listing[1], EPOCH)
    assert res is None and "subprocess.Popen" in why, why
