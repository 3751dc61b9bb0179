"""Which Cargo.lock files prefetch vendors, what names the tarball, and what the stage gets."""

from __future__ import annotations

from imagebuild.fetch import cargo
from imagebuild.plan import source_mounts


def _listing(*paths: str) -> list[tuple[str, str, str]]:
    return [("100644", f"{i:040x}", p) for i, p in enumerate(paths, 1)]


def test_find_lockfiles_skips_other_projects_and_hidden_folders():
    listing = _listing("rust/Cargo.lock", "Cargo.lock", "third_party/x/Cargo.lock", "vendor/y/Cargo.lock",
                       ".github/z/Cargo.lock", "tools/a/Cargo.lock", "rust/Cargo.toml", "csrc/3rdparty/b/Cargo.lock")
    listing.append(("160000", "f" * 40, "sub/Cargo.lock"))  # a gitlink is no file
    assert [x.path for x in cargo.find_lockfiles(listing)] == ["Cargo.lock", "rust/Cargo.lock", "tools/a/Cargo.lock"]
    assert [x.path for x in cargo.find_lockfiles(listing, "tools")] == ["a/Cargo.lock"]
    assert cargo.find_lockfiles(_listing("setup.py", "CMakeLists.txt")) == []


def test_vendor_id_follows_the_cargo_lock_files_only():
    a = cargo.find_lockfiles(_listing("rust/Cargo.lock"))
    same = cargo.find_lockfiles(_listing("rust/Cargo.lock", "rust/src/main.rs"))
    moved = [cargo.LockFile("rust/Cargo.lock", "e" * 40)]
    assert cargo.vendor_id(a) == cargo.vendor_id(same) != cargo.vendor_id(moved)


def test_stage_gets_the_crates_and_an_offline_cargo_home():
    cfg = ('[source.crates-io]\nreplace-with = "vendored-sources"\n\n[source.vendored-sources]\n'
           f'directory = "{cargo.DIR_PLACEHOLDER}"\n')
    lock = {"sources": {
        "VLLM": {"tarball": "deps-src/i/src/vllm-0.tar", "sha256": "a" * 64,
                 "cargo": {"tarball": "deps-src/i/src/vllm-cargo-vendor-0.tar", "sha256": "b" * 64,
                           "lockfiles": [{"path": "rust/Cargo.lock", "blob": "c" * 40}], "config": cfg}},
        "OTHER": {"tarball": "deps-src/i/src/other-0.tar.gz", "sha256": "d" * 64, "cargo": None}}}
    assert cargo.DIR_PLACEHOLDER == source_mounts.CARGO_DIR_PLACEHOLDER
    ms = source_mounts.source_mounts(lock, "wheel", ["VLLM"])
    assert [(m.name, m.file, m.dir) for m in ms.mounts] == [
        ("VLLM", "VLLM.tar", "/imagebuild/work/vllm"),
        ("VLLM.cargo-vendor", "VLLM.cargo-vendor.tar", "/imagebuild/work/cargo-vendor")]
    text = ms.cargo_config()
    assert 'directory = "/imagebuild/work/cargo-vendor"' in text and text.endswith("[net]\noffline = true\n")
    assert text.count("[source.crates-io]") == 1
    script = ms.script()
    assert f"{'b' * 64} /imagebuild/work/cargo-vendor" in script  # checked against the lock like the others
    assert "export CARGO_HOME=/imagebuild/work/cargo-home CARGO_NET_OFFLINE=true" in script
    assert ms.as_dict()["cargo"]["lockfiles"] == {"VLLM": ["rust/Cargo.lock"]}
    # a stage without crates gets nothing of it
    other = source_mounts.source_mounts(lock, "x", ["OTHER"])
    assert [m.file for m in other.mounts] == ["OTHER.tar.gz"]  # a lock packed by tarball format 1: its suffix
    assert other.cargo_config() is None and "CARGO_HOME" not in other.script() and other.as_dict()["cargo"] is None
