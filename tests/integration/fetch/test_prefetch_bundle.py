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
