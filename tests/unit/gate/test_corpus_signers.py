"""Hostile-input corpus, issue 34: signature checking never turns itself off. The default
allowed-signers file (``${XDG_CONFIG_HOME}/imagebuild/allowed_signers``) that is there but cannot be
read as one (a dangling link, a FIFO, a folder) is an error, never "not configured": before, an
unsigned receipt then passed. (A receipt or ``.sig`` that is a FIFO or a device:
tests/unit/core/test_corpus_special_files.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from imagebuild.core import identity
from imagebuild.core.errors import UsageError
from imagebuild.gate import receipts, signing
from tests.unit.gate.test_receipt_trust import PASSING, SPEC, _doc, _inspect


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(signing.SIGNERS_ENV, raising=False)
    monkeypatch.delenv(signing.KEY_ENV, raising=False)
    (tmp_path / "xdg" / "imagebuild").mkdir(parents=True)
    spec = tmp_path / "gate.yaml"
    spec.write_text(SPEC)
    return tmp_path, spec, "sha256:" + __import__("hashlib").sha256(SPEC.encode()).hexdigest()


def _dangling(p: Path) -> None:
    p.symlink_to(p.parent / "gone")


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _folder(p: Path) -> None:
    p.mkdir()


def _unreadable_link(p: Path) -> None:
    p.symlink_to("/dev/zero")


@pytest.mark.parametrize("make", [_dangling, _fifo, _folder, _unreadable_link],
                         ids=["dangling-link", "fifo", "folder", "link-to-dev-zero"])
def test_a_default_allowed_signers_file_that_is_not_one_is_an_error(home, make):
    root, spec, sd = home
    default = signing.default_allowed_signers()
    make(default)
    a = identity.from_inspect(_inspect("a"))
    receipts.write(root, _doc(a, sd, PASSING))  # unsigned
    with pytest.raises(UsageError) as exc:
        receipts.check(root, a.digest, sd, spec=spec)  # before: trusted, the check silently off
    msg = exc.value.render()
    assert str(default) in msg and "cannot be left off" in msg and f"{signing.SIGNERS_ENV}=none" in msg, msg
    # said as well when asked for directly (gate --check-receipt, sync, doctor ask this way)
    with pytest.raises(UsageError):
        signing.allowed_signers()
    # `none` still turns it off on purpose
    os.environ[signing.SIGNERS_ENV] = "none"
    try:
        assert receipts.check(root, a.digest, sd, spec=spec).trusted
    finally:
        del os.environ[signing.SIGNERS_ENV]


def test_a_missing_default_allowed_signers_file_is_not_configured(home):
    assert signing.allowed_signers() is None
