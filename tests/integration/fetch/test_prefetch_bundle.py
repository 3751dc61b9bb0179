"""imagebuild bundle / unbundle without an engine: what a bundle holds, and every way a bad one is
refused with the project left exactly as it was."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from imagebuild.fetch import bundle as bundle_mod
from tests.buildfixtures import staged_project
from tests.conftest import run_cli, tree_state

IMAGE = "staged"


@pytest.fixture
def src(tmp_path) -> Path:
    root = staged_project(tmp_path / "src")
    lock = json.loads((root / "docker-images" / IMAGE / "lock.json").read_text())
    e = lock["sources"]["GREET"]
    (root / "deps-src" / IMAGE / "src" / "SHA256SUMS").write_text(f"{e['sha256']}  {Path(e['tarball']).name}\n")
    return root


def _bundle(root: Path, out: Path) -> Path:
    r = run_cli("--root", str(root), "bundle", IMAGE, "-o", str(out))
    assert r.code == 0, r.err
    return out


def _target(tmp_path: Path) -> Path:
    return staged_project(tmp_path / "node", greet={"other.py": "x = 1\n"})


def _rewrite(bundle: Path, out: Path, change) -> Path:
    """A bundle whose members went through ``change(name, data) -> [(name, data, type)]``, with a
    manifest and SHA256SUMS made consistent again (so only the lock check can catch it)."""
    members = []
    with tarfile.open(bundle) as tf:
        for m in tf:
            members.append((m.name, tf.extractfile(m).read()))
    files = []
    for name, data in members:
        if name in (bundle_mod.MANIFEST, bundle_mod.SUMS):
            continue
        files += change(name, data)
    man = json.loads(dict(members)[bundle_mod.MANIFEST])
    regular = [(n, d) for n, d, t in files if t == tarfile.REGTYPE]
    sums = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in regular).encode()
    man["files"] = [{"path": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in regular]
    man["sums_sha256"] = hashlib.sha256(sums).hexdigest()
    with tarfile.open(out, "w") as tf:
        for n, d, t in files + [(bundle_mod.SUMS, sums, tarfile.REGTYPE),
                                (bundle_mod.MANIFEST, json.dumps(man).encode(), tarfile.REGTYPE)]:
            ti = tarfile.TarInfo(n)
            ti.type = t
            if t == tarfile.SYMTYPE:
                ti.linkname = "/etc/passwd"
                tf.addfile(ti)
            else:
                ti.size = len(d)
                tf.addfile(ti, io.BytesIO(d))
    return out


def test_bundle_holds_lock_pins_and_files(src, tmp_path):
    b = _bundle(src, tmp_path / "b.tar")
    with tarfile.open(b) as tf:
        names = tf.getnames()
        assert all(m.mtime == 0 and m.uid == 0 and m.mode == 0o644 for m in tf.getmembers())
        man = json.loads(tf.extractfile(bundle_mod.MANIFEST).read())
    assert names == [f"docker-images/{IMAGE}/lock.json", f"docker-images/{IMAGE}/versions.env",
                     f"deps-src/{IMAGE}/src/SHA256SUMS", f"deps-src/{IMAGE}/src/greet-000000000000.tar.gz",
                     "SHA256SUMS", "imagebuild-bundle.json"]
    assert man["image"] == IMAGE and len(man["files"]) == 4
    assert man["lock_sha256"] == hashlib.sha256((src / "docker-images" / IMAGE / "lock.json").read_bytes()).hexdigest()


def test_unbundle_puts_everything_in_place(src, tmp_path):
    b = _bundle(src, tmp_path / "b.tar")
    node = _target(tmp_path)
    r = run_cli("--root", str(node), "unbundle", str(b), "--json")
    assert r.code == 0, r.err
    for rel in (f"docker-images/{IMAGE}/lock.json", f"deps-src/{IMAGE}/src/greet-000000000000.tar.gz",
                f"deps-src/{IMAGE}/src/SHA256SUMS"):
        assert (node / rel).read_bytes() == (src / rel).read_bytes(), rel
    assert not list((node / "deps-src").glob(".unbundle-*"))


@pytest.mark.parametrize("case", ["traversal", "symlink", "extra", "damaged", "truncated", "not_a_tar"])
def test_bad_bundles_change_nothing(src, tmp_path, case):
    good = _bundle(src, tmp_path / "b.tar")
    bad = tmp_path / "bad.tar"
    if case == "traversal":
        _rewrite(good, bad, lambda n, d: [(n, d, tarfile.REGTYPE)] +
                 ([("../escape.txt", b"x", tarfile.REGTYPE)] if n.endswith("lock.json") else []))
    elif case == "symlink":
        _rewrite(good, bad, lambda n, d: [(n, d, tarfile.REGTYPE)] +
                 ([(f"deps-src/{IMAGE}/src/link", b"", tarfile.SYMTYPE)] if n.endswith("lock.json") else []))
    elif case == "extra":  # consistent manifest, but a file the lock does not name
        _rewrite(good, bad, lambda n, d: [(n, d, tarfile.REGTYPE)] +
                 ([(f"deps-src/{IMAGE}/src/extra.tar.gz", b"x", tarfile.REGTYPE)] if n.endswith("lock.json") else []))
    elif case == "damaged":  # consistent manifest, but the tarball is not what the lock says
        _rewrite(good, bad, lambda n, d: [(n, d + b"\0" if n.endswith(".tar.gz") else d, tarfile.REGTYPE)])
    elif case == "truncated":
        bad.write_bytes(good.read_bytes()[:3000])
    else:
        bad.write_bytes(b"hello, not a bundle\n" * 100)
    node = _target(tmp_path)
    before = tree_state(node)
    r = run_cli("--root", str(node), "unbundle", str(bad))
    assert r.code == 1, (r.code, r.err)
    assert "Traceback" not in r.err and "error:" in r.err
    want = {"traversal": "is not inside the project", "symlink": "is not a regular file",
            "extra": "not in the lock: deps-src/staged/src/extra.tar.gz",
            "damaged": "the bundled lock says", "truncated": "not", "not_a_tar": "not a readable bundle"}[case]
    assert want in r.err
    assert tree_state(node) == before
    assert not (tmp_path / "escape.txt").exists() and not (node.parent / "escape.txt").exists()


def test_unbundle_needs_the_definition_here(src, tmp_path):
    b = _bundle(src, tmp_path / "b.tar")
    node = tmp_path / "empty"
    (node / "docker-images").mkdir(parents=True)
    r = run_cli("--root", str(node), "unbundle", str(b))
    assert r.code == 2 and "no such image definition here" in r.err
    assert not (node / "deps-src").exists()


def test_bundle_without_lock_says_what_to_do(tmp_path):
    import shutil

    from tests.conftest import FIXTURES

    root = tmp_path / "p"
    shutil.copytree(FIXTURES / "project", root)
    r = run_cli("--root", str(root), "bundle", "tiny", "-o", str(tmp_path / "x.tar"))
    assert r.code == 1 and "nothing to bundle" in r.err and "imagebuild prefetch tiny" in r.err
    assert not (tmp_path / "x.tar").exists()


# ------------------------------------------------------------------------------------------------ hostile bundles
# issue 22, item 5: unbundle reads and checks the manifest before it writes anything, refuses what
# it does not list or what is bigger than it says, and validates the definition before installing.

FSIZE_LIMIT = 8 << 20  # no single file unbundle writes in these tests may pass this


def _unbundle_bounded(node: Path, bundle: Path):
    """``imagebuild unbundle`` in a child process that cannot write a file over FSIZE_LIMIT (RLIMIT_FSIZE:
    Python ignores SIGXFSZ, so a larger write fails with EFBIG); returns (code, stderr)."""
    import os
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, FSIZE_LIMIT))

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    r = subprocess.run([sys.executable, "-m", "imagebuild", "--root", str(node), "unbundle", str(bundle)],
                       capture_output=True, text=True, env=env, preexec_fn=limit, timeout=120)
    return r.returncode, r.stderr


def _du(path: Path) -> int:
    """Bytes actually allocated under ``path`` (sparse holes not counted)."""
    return sum(p.lstat().st_blocks * 512 for p in [path, *path.rglob("*")])


def _gnu_sparse(name: str, realsize: int, data: bytes = b"x") -> bytes:
    """One old-GNU sparse member ('S'): ``data`` stored at the end of a ``realsize``-byte file of holes."""
    ti = tarfile.TarInfo(name)
    ti.size, ti.type = len(data), tarfile.GNUTYPE_SPARSE
    buf = bytearray(ti.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape"))
    buf[386:398] = b"%011o\0" % (realsize - len(data))
    buf[398:410] = b"%011o\0" % len(data)
    buf[482] = 0
    buf[483:495] = b"%011o\0" % realsize
    buf[148:156] = b" " * 8
    buf[148:156] = b"%06o\0 " % sum(buf[:512])
    return bytes(buf) + data + b"\0" * (-len(data) % tarfile.BLOCKSIZE)


def _members(bundle: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(bundle) as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf]


def _tar(out: Path, members, head: bytes = b"") -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for n, data in members:
            ti = tarfile.TarInfo(n)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    out.write_bytes(head + buf.getvalue())
    return out


def test_gnu_sparse_member_is_refused_before_anything_is_written(src, tmp_path):
    good = _members(_bundle(src, tmp_path / "b.tar"))
    tarball = f"deps-src/{IMAGE}/src/greet-000000000000.tar.gz"
    bad = _tar(tmp_path / "sparse.tar", [(n, d) for n, d in good if n != tarball],
               head=_gnu_sparse(tarball, 4 << 30))
    assert bad.stat().st_size < 64 << 10  # a small file ...
    with tarfile.open(bad) as tf:  # ... that tarfile reads as a 4 GiB member
        assert tf.getmember(tarball).size == 4 << 30
    node = _target(tmp_path)
    before, du0 = tree_state(node), _du(node)
    code, err = _unbundle_bounded(node, bad)
    assert code == 1, err
    assert "is not a regular file (a sparse file of 4294967296 bytes)" in err and tarball in err
    assert "File too large" not in err and "Traceback" not in err
    assert tree_state(node) == before and _du(node) - du0 < 1 << 20


def test_pax_sparse_member_is_refused(src, tmp_path):
    import shutil
    import subprocess

    if not shutil.which("tar"):
        pytest.skip("no tar")
    good = _members(_bundle(src, tmp_path / "b.tar"))
    tarball = f"deps-src/{IMAGE}/src/greet-000000000000.tar.gz"
    work = tmp_path / "w"
    (work / Path(tarball).parent).mkdir(parents=True)
    with open(work / tarball, "wb") as f:
        f.truncate(4 << 30)
    for n, d in good:
        if n != tarball:
            (work / n).parent.mkdir(parents=True, exist_ok=True)
            (work / n).write_bytes(d)
    bad = tmp_path / "pax.tar"
    r = subprocess.run(["tar", "--sparse", "--format=posix", "-cf", str(bad), "-C", str(work), tarball,
                        *[n for n, _ in good if n != tarball]], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"tar cannot write pax sparse files here: {r.stderr.strip()}")
    assert bad.stat().st_size < 1 << 20
    node = _target(tmp_path)
    before = tree_state(node)
    code, err = _unbundle_bounded(node, bad)
    assert code == 1 and "is not a regular file" in err and "File too large" not in err, err
    assert tree_state(node) == before


def test_member_bigger_than_the_manifest_says_is_refused_unread(src, tmp_path):
    good = _members(_bundle(src, tmp_path / "b.tar"))
    tarball = f"deps-src/{IMAGE}/src/greet-000000000000.tar.gz"
    bad = _tar(tmp_path / "big.tar", [(n, d + b"\0" * (2 * FSIZE_LIMIT) if n == tarball else d) for n, d in good])
    node = _target(tmp_path)
    before = tree_state(node)
    code, err = _unbundle_bounded(node, bad)
    assert code == 1, err
    assert f"member '{tarball}' is {len(dict(good)[tarball]) + 2 * FSIZE_LIMIT} bytes, the manifest says" in err
    assert "File too large" not in err and tree_state(node) == before


def test_member_not_in_the_manifest_is_refused(src, tmp_path):
    good = _members(_bundle(src, tmp_path / "b.tar"))
    bad = _tar(tmp_path / "x.tar", [(f"deps-src/{IMAGE}/src/zz.tar.gz", b"x")] + good)
    node = _target(tmp_path)
    before = tree_state(node)
    r = run_cli("--root", str(node), "unbundle", str(bad))
    assert r.code == 1 and f"member 'deps-src/{IMAGE}/src/zz.tar.gz' is not in the manifest" in r.err, r.err
    assert tree_state(node) == before


def _with_manifest(good: list[tuple[str, bytes]], out: Path, change) -> Path:
    """The good bundle with its manifest changed by ``change(man)``; SHA256SUMS and every hash left as they are."""
    man = json.loads(dict(good)[bundle_mod.MANIFEST])
    man = change(man) or man
    return _tar(out, [(n, json.dumps(man).encode() if n == bundle_mod.MANIFEST else d) for n, d in good])


def _set(path, value):
    def change(man):
        obj = man
        for k in path[:-1]:
            obj = obj[k]
        if value is KeyError:
            del obj[path[-1]]
        else:
            obj[path[-1]] = value
    return change


@pytest.mark.parametrize("change, key", [
    (lambda m: m.update(files={"a": 1}), "files"),
    (lambda m: m.update(files=[]), "files"),
    (_set(["files", 0, "sha256"], KeyError), "files[0]"),
    (_set(["files", 0], "docker-images/staged/lock.json"), "files[0]"),
    (_set(["files", 1, "size"], "12"), "files[1].size"),
    (_set(["files", 1, "size"], True), "files[1].size"),
    (_set(["files", 1, "size"], -1), "files[1].size"),
    (_set(["files", 2, "sha256"], 5), "files[2].sha256"),
    (_set(["files", 2, "path"], None), "files[2].path"),
    (_set(["files", 2, "path"], "../../etc/x"), "files[2].path"),
    (_set(["files", 2, "path"], "deps-src/other/src/x"), "files[2].path"),
    (_set(["image"], 5), "image"),
    (_set(["image"], None), "image"),
    (_set(["image"], "../staged"), "image"),
    (_set(["lock"], ["x"]), "lock"),
    (_set(["lock_sha256"], None), "lock_sha256"),
    (_set(["definition_sha256"], 7), "definition_sha256"),
    (_set(["sums_sha256"], {}), "sums_sha256"),
    (lambda m: [1, 2], None),
    (_set(["version"], True), None),
])
def test_malformed_hash_consistent_manifest_is_a_clear_error(src, tmp_path, change, key):
    good = _members(_bundle(src, tmp_path / "b.tar"))
    bad = _with_manifest(good, tmp_path / "m.tar", change)
    node = _target(tmp_path)
    before = tree_state(node)
    r = run_cli("--root", str(node), "unbundle", str(bad))
    assert r.code == 1, (r.code, r.err)
    assert "internal error" not in r.err and "Traceback" not in r.err
    assert bundle_mod.MANIFEST in r.err and (key is None or f"{bundle_mod.MANIFEST}: {key}: expected" in r.err), r.err
    assert tree_state(node) == before


def test_malformed_hash_consistent_lock_is_a_clear_error(src, tmp_path):
    lock_rel = f"docker-images/{IMAGE}/lock.json"
    bad = _rewrite(_bundle(src, tmp_path / "b.tar"), tmp_path / "l.tar", lambda n, d: [(
        n, json.dumps({"schema": "imagebuild.lock", "version": 1, "image": IMAGE,
                       "sources": {"GREET": {"tarball": 5}}}).encode() if n == lock_rel else d, tarfile.REGTYPE)])
    node = _target(tmp_path)
    before = tree_state(node)
    r = run_cli("--root", str(node), "unbundle", str(bad))
    assert r.code == 1 and "internal error" not in r.err and lock_rel in r.err, r.err
    assert tree_state(node) == before


def test_bundle_whose_versions_env_breaks_the_definition_is_not_installed(src, tmp_path):
    env_rel = f"docker-images/{IMAGE}/versions.env"
    bad = _rewrite(_bundle(src, tmp_path / "b.tar"), tmp_path / "v.tar",
                   lambda n, d: [(n, b"this is not an assignment\n" if n == env_rel else d, tarfile.REGTYPE)])
    node = _target(tmp_path)
    before = tree_state(node)
    r = run_cli("--root", str(node), "unbundle", str(bad))
    assert r.code == 2, (r.code, r.err)
    assert f"{bad}: {env_rel}:1" in r.err and "internal error" not in r.err, r.err
    assert tree_state(node) == before
