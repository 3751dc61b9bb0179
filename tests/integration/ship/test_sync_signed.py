"""Signed receipts on a real peer (issue 21): the peer verifies the receipt's OpenSSH signature against
its own allowed-signers file (``$XDG_CONFIG_HOME/imagebuild/allowed_signers`` of its ssh session,
scripts/peer.sh) before any byte moves, and ``gate --check-receipt`` there verifies what sync carried;
a tampered, unsigned or unknown-signer receipt is refused there (exit 3 for sync, 4 for the check).
Real sshd, docker and ssh-keygen on both sides; no mocks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from imagebuild.core import identity
from imagebuild.definition import gatespec
from tests.conftest import run_cli
from tests.syncfixtures import (  # noqa: F401 - fixtures
    _private_sync_cache,
    cache_files,
    env,
    gate,
    peer_identity,
    reset,
    sync,
    sync_images_fixture,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def _key(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)], check=True)
    return path


def _pub(key: Path) -> str:
    return " ".join(key.with_suffix(".pub").read_text().split()[:2])


def _receipt(root: Path, name: str, ref: str) -> Path:
    spec = gatespec.digest(root / "docker-images" / name / "gate.yaml")
    return root / ".imagebuild" / "receipts" / identity.inspect(ref).digest[7:] / f"{spec[7:]}.json"


def _edit(path: Path) -> None:
    """A change the receipt's structure allows (the gating host's name): only the signature catches it."""
    data = json.loads(path.read_text())
    data["host"]["hostname"] = "somewhere-else"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _check_on_peer(imgs, peer, trust: Path):
    with env(DOCKER_HOST=peer.docker_host, IMAGEBUILD_PEER_CACHE=peer.cache, IMAGEBUILD_ALLOWED_SIGNERS=str(trust),
             IMAGEBUILD_STATE_DIR=str(Path(peer.cache) / "no-local-state")):
        return run_cli("--root", str(imgs.root), "gate", imgs.name, "--check-receipt", "--json")


def test_signed_receipt_verified_on_the_peer_tampered_and_unsigned_refused(sync_images, peer, tmp_path):
    imgs = sync_images
    builder, stranger = _key(tmp_path / "builder"), _key(tmp_path / "stranger")
    trust = Path(peer.dir) / "config" / "imagebuild" / "allowed_signers"
    trust.parent.mkdir(parents=True, exist_ok=True)
    reset(peer)
    try:
        # the peer has no allowed-signers file yet: an unsigned receipt is carried as before
        imgs.set_local(imgs.v1)
        r, doc = sync(imgs, peer, peer.addr)
        assert r.code == 0 and doc["peers"][0]["status"] == "synced", r.err
        assert doc["receipt"]["signed"] is False
        reset(peer)
        trust.write_text(f'builder@build-host namespaces="imagebuild-receipt" {_pub(builder)}\n')

        # signed by the builder's key: synced; the peer says who signed; --check-receipt there verifies it
        with env(IMAGEBUILD_SIGNING_KEY=str(builder)):
            gate(imgs.root, imgs.name, imgs.v1)
        local = _receipt(imgs.root, imgs.name, imgs.v1)
        r, doc = sync(imgs, peer, peer.addr)
        assert r.code == 0, r.err
        (p,) = doc["peers"]
        assert p["status"] == "synced" and p["details"]["receipt_signer"] == "builder@build-host", p
        assert doc["receipt"]["signed"] is True
        carried = Path(peer.cache) / "receipts" / local.parent.name / local.name
        assert carried.read_bytes() == local.read_bytes()  # the exact bytes that were signed
        assert Path(str(carried) + ".sig").read_text() == Path(str(local) + ".sig").read_text()
        chk = _check_on_peer(imgs, peer, trust)
        assert chk.code == 0, chk.err
        out = json.loads(chk.out)
        assert out["synced"] and out["signed"] and out["signer"] == "builder@build-host"

        # the carried receipt changed on the peer, or its signature removed: --check-receipt refuses it (exit 4)
        saved = carried.read_bytes()
        _edit(carried)
        chk = _check_on_peer(imgs, peer, trust)
        assert chk.code == 4 and "is not trusted: its signature does not verify against" in chk.err, chk.err
        carried.write_bytes(saved)
        sig = Path(str(carried) + ".sig").read_text()
        Path(str(carried) + ".sig").unlink()
        chk = _check_on_peer(imgs, peer, trust)
        assert chk.code == 4 and "is not trusted: it is not signed" in chk.err, chk.err
        Path(str(carried) + ".sig").write_text(sig)
        v1 = identity.inspect(imgs.v1).digest
        assert peer_identity(peer, imgs.local) == v1

        def refused(says: str) -> None:
            imgs.set_local(imgs.v2)
            r, doc = sync(imgs, peer, peer.addr)
            assert r.code == 3, r.err
            (p,) = doc["peers"]
            assert p["status"] == "refused" and says in p["message"], p["message"]
            assert peer_identity(peer, imgs.local) == v1  # the tag did not move
            assert cache_files(peer) == []  # and no byte of the image was sent

        # tampered here after signing: the sender does not check signatures (no allowed-signers file here),
        # the peer does
        with env(IMAGEBUILD_SIGNING_KEY=str(builder)):
            gate(imgs.root, imgs.name, imgs.v2)
        _edit(_receipt(imgs.root, imgs.name, imgs.v2))
        refused("its signature does not verify")
        # unsigned
        with env(IMAGEBUILD_SIGNING_KEY="none"):
            gate(imgs.root, imgs.name, imgs.v2)
        assert not Path(str(_receipt(imgs.root, imgs.name, imgs.v2)) + ".sig").exists()
        refused("the receipt is not signed")
        # signed by a key the peer does not list
        with env(IMAGEBUILD_SIGNING_KEY=str(stranger)):
            gate(imgs.root, imgs.name, imgs.v2)
        refused("its signature does not verify")
        # --force (no receipt at all): the peer's rule still holds
        imgs.set_local(imgs.ungated)
        r, doc = sync(imgs, peer, peer.addr, "--force")
        assert r.code == 3 and "comes without a gate receipt" in doc["peers"][0]["message"], r.err
        assert peer_identity(peer, imgs.local) == v1
    finally:
        trust.unlink(missing_ok=True)
        with env(IMAGEBUILD_SIGNING_KEY="none"):
            gate(imgs.root, imgs.name, imgs.v1)
            gate(imgs.root, imgs.name, imgs.v2)
        imgs.set_local(imgs.v1)
        reset(peer)
