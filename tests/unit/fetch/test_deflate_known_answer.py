"""Tarballs are byte-identical across machines only where deflate writes the same bytes: the
known-answer test refuses a deflate that differs from mainline zlib before anything is written."""

import pytest
from zlib_ng import zlib_ng

from imagebuild.core.errors import OperationFailed
from imagebuild.fetch import tarball


@pytest.fixture(autouse=True)
def _fresh_check(monkeypatch):
    monkeypatch.setattr(tarball, "_deflate_checked", False)


def test_this_hosts_zlib_passes():
    tarball.check_deflate()


def test_zlib_ng_is_refused(monkeypatch, tmp_path):
    # zlib-ng (a real, widely shipped deflate) writes valid but different bytes
    monkeypatch.setattr(tarball, "zlib", zlib_ng)
    with pytest.raises(OperationFailed, match="known-answer test failed") as ei:
        tarball.check_deflate()
    assert "mainline zlib" in ei.value.message
    dest = tmp_path / "x.tar.gz"
    with pytest.raises(OperationFailed):
        tarball.pack([], dest, 0)
    assert not dest.exists() and not list(tmp_path.iterdir())
