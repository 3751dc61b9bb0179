"""Vendoring from Cargo.lock (fetch/crates.py): reading the lock, the git sources, where registry
crates come from (the machine's cargo config only), the download URL template, and the source
replacement the stage's CARGO_HOME gets. The network paths run for real in
tests/integration/fetch/test_prefetch_rust.py."""

from __future__ import annotations

import pytest

from imagebuild.core.errors import OperationFailed
from imagebuild.fetch import crates

SHA = "a" * 64
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_parse_lock_keeps_sourced_packages_and_their_checksums():
    text = (f'version = 4\n\n[[package]]\nname = "app"\nversion = "0.1.0"\n\n'
            f'[[package]]\nname = "itoa"\nversion = "1.0.1"\nsource = "{crates.CRATES_IO_SOURCE}"\nchecksum = "{SHA}"\n\n'
            f'[[package]]\nname = "dep"\nversion = "0.2.0"\nsource = "git+https://h.invalid/dep?branch=main#{COMMIT}"\n')
    got = crates.parse_lock(text, "rust/Cargo.lock")
    assert [(c.dirname, c.kind, c.checksum) for c in got] == [("itoa-1.0.1", "registry", SHA), ("dep-0.2.0", "git", None)]
    # a v1 lockfile keeps checksums in [metadata]
    v1 = (f'[[package]]\nname = "itoa"\nversion = "1.0.1"\nsource = "{crates.CRATES_IO_SOURCE}"\n\n'
          f'[metadata]\n"checksum itoa 1.0.1 ({crates.CRATES_IO_SOURCE})" = "{SHA}"\n')
    assert crates.parse_lock(v1, "Cargo.lock")[0].checksum == SHA
    with pytest.raises(OperationFailed, match=r"rust/Cargo.lock: crate itoa 1.0.1: checksum 'xyz' is not a sha256"):
        crates.parse_lock(text.replace(SHA, "xyz"), "rust/Cargo.lock")
    with pytest.raises(OperationFailed, match=r"^x/Cargo.lock: not a Cargo.lock"):
        crates.parse_lock("[[package]\n", "x/Cargo.lock")


def test_git_source_and_the_replacement_config():
    assert crates.git_source(f"git+https://h.invalid/dep.git?rev=abc#{COMMIT}") == (
        "https://h.invalid/dep.git", COMMIT, "rev", "abc")
    assert crates.git_source(f"git+https://h.invalid/dep.git#{COMMIT}") == ("https://h.invalid/dep.git", COMMIT, None, None)
    with pytest.raises(OperationFailed, match="no commit"):
        crates.git_source("git+https://h.invalid/dep.git?branch=main")
    cs = [crates.Crate("itoa", "1.0.1", crates.CRATES_IO_SOURCE, SHA, "Cargo.lock"),
          crates.Crate("dep", "0.2.0", f"git+https://h.invalid/dep?branch=main#{COMMIT}", None, "Cargo.lock"),
          crates.Crate("x", "1.0.0", "sparse+https://reg.invalid/index/", SHA, "Cargo.lock")]
    cfg = crates.replacement_config(cs)
    assert cfg == ('[source.crates-io]\nreplace-with = "vendored-sources"\n\n'
                   '[source."sparse+https://reg.invalid/index/"]\nregistry = "sparse+https://reg.invalid/index/"\n'
                   'replace-with = "vendored-sources"\n\n'
                   '[source."git+https://h.invalid/dep?branch=main"]\ngit = "https://h.invalid/dep"\nbranch = "main"\n'
                   'replace-with = "vendored-sources"\n\n'
                   f'[source.vendored-sources]\ndirectory = "{crates.DIR_PLACEHOLDER}"\n')


def test_the_registry_comes_from_the_machines_cargo_config_only(tmp_path, monkeypatch):
    monkeypatch.delenv(crates.CONFIG_ENV, raising=False)
    monkeypatch.setenv("CARGO_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(OperationFailed) as exc:  # nothing configured: no built-in host
        crates.registry_for(crates.CRATES_IO_SOURCE)
    assert "no cargo config" in exc.value.message and "replace-with" in exc.value.hint
    (tmp_path / "home").mkdir()
    (tmp_path / "home/config.toml").write_text(
        '[source.crates-io]\nreplace-with = "a"\n[source.a]\nreplace-with = "b"\n'
        '[source.b]\nregistry = "sparse+http://127.0.0.1:9/index/"\n')
    reg = crates.registry_for(crates.CRATES_IO_SOURCE)
    assert (reg.kind, reg.where) == ("sparse", "http://127.0.0.1:9/index/") and "[source.b]" in reg.origin
    cfg = tmp_path / "explicit.toml"  # IMAGEBUILD_CARGO_CONFIG wins over CARGO_HOME
    cfg.write_text('[source.crates-io]\nreplace-with = "d"\n[source.d]\ndirectory = "/srv/crates"\n')
    monkeypatch.setenv(crates.CONFIG_ENV, str(cfg))
    assert crates.registry_for(crates.CRATES_IO_SOURCE).kind == "directory"
    cfg.write_text('[source.crates-io]\nreplace-with = "g"\n[source.g]\nregistry = "https://git.invalid/index"\n')
    with pytest.raises(OperationFailed, match="does not replace it with a sparse registry or a directory source"):
        crates.registry_for(crates.CRATES_IO_SOURCE)
    # a lock's own sparse registry is taken from where the lock says
    assert crates.registry_for("sparse+https://reg.invalid/index/").where == "https://reg.invalid/index/"


def test_download_url_template(monkeypatch):
    dl = crates._Dl()
    reg = crates.Registry("sparse", "http://r.invalid/index/", "test")
    c = crates.Crate("Serde_json", "1.0.0", crates.CRATES_IO_SOURCE, SHA, "Cargo.lock")
    dl._dl[reg.where] = "http://r.invalid/dl"
    assert dl.url(reg, c) == "http://r.invalid/dl/Serde_json/1.0.0/download"
    dl._dl[reg.where] = "http://r.invalid/{prefix}/{crate}-{version}.crate?sha={sha256-checksum}"
    assert dl.url(reg, c) == f"http://r.invalid/Se/rd/Serde_json-1.0.0.crate?sha={SHA}"
    short = crates.Crate("ab", "0.1.0", crates.CRATES_IO_SOURCE, SHA, "Cargo.lock")
    assert dl.url(reg, short) == f"http://r.invalid/2/ab-0.1.0.crate?sha={SHA}"
    dl._dl[reg.where] = "http://r.invalid/{lowerprefix}/{crate}"
    assert dl.url(reg, c) == "http://r.invalid/se/rd/Serde_json"
