"""Receipts that lie (issue 21), on a real engine: a hand-edited receipt of a failed gate, or one copied
from another image with only ``identity.digest`` edited, never promotes and never passes
``gate --check-receipt`` (exit 4, the reason named); a signed one verifies, and a tampered or unsigned
one is refused where an allowed-signers file is configured. The peer side: tests/integration/ship/
test_sync_signed.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from imagebuild.buildstep import promote
from imagebuild.core import identity
from imagebuild.core.errors import EXIT_BAD_INPUT, EXIT_GATE_FAILED, GateFailed
from imagebuild.definition import gatespec
from tests.conftest import run_cli
from tests.peers import BUSYBOX, build_image, one_stage_project

pytestmark = pytest.mark.engine

NAME = f"trust{os.getpid()}"
FAILING = """\
checks:
  - {id: has-v, kind: file, path: /v, contains: "1"}
  - {id: has-nope, kind: file, path: /nope}
"""
PASSING = """\
checks:
  - {id: has-v, kind: file, path: /v}
"""


@pytest.fixture(scope="module")
def images(engine_info, tmp_path_factory):
    """Two images of one definition: A and B (other content, other identity)."""
    ctx = tmp_path_factory.mktemp("trustctx")
    (ctx / "Dockerfile").write_text(f"FROM {BUSYBOX}\nARG V=1\nRUN echo $V > /v\n")
    a, b = f"imagebuild-test/{NAME}:a", f"imagebuild-test/{NAME}:b"
    build_image(a, ctx, V="1")
    build_image(b, ctx, V="2")
    yield a, b
    subprocess.run(["docker", "image", "rm", "-f", a, b, f"{NAME}:local", f"{NAME}:previous"], capture_output=True)


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.delenv("IMAGEBUILD_STATE_DIR", raising=False)
    monkeypatch.setenv("IMAGEBUILD_NO_GPU", "1")
    monkeypatch.setenv("IMAGEBUILD_SIGNING_KEY", "none")
    monkeypatch.setenv("IMAGEBUILD_ALLOWED_SIGNERS", "none")
    subprocess.run(["docker", "image", "rm", f"{NAME}:local"], capture_output=True)
    return one_stage_project(tmp_path / "p", NAME, FAILING)


def _spec(root: Path) -> Path:
    return root / "docker-images" / NAME / "gate.yaml"


def _receipt(root: Path, ref: str) -> Path:
    ident = identity.inspect(ref).digest
    return root / ".imagebuild" / "receipts" / ident[7:] / f"{gatespec.digest(_spec(root))[7:]}.json"


def _edit(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _refused(root: Path, ref: str, says: str) -> None:
    """Neither promotion nor --check-receipt believes the receipt; both say why; :local never moves."""
    with pytest.raises(GateFailed) as exc:
        promote.promote(root, NAME, ref)
    assert exc.value.exit_code == EXIT_GATE_FAILED
    assert "is not trusted: " in exc.value.message and says in exc.value.message, exc.value.message
    assert promote.image_id(f"{NAME}:local") is None
    r = run_cli("--root", str(root), "gate", NAME, "--check-receipt", "--ref", ref)
    assert r.code == EXIT_GATE_FAILED and says in r.err and "Traceback" not in r.err, r.err


def _flip(d: dict) -> None:
    d["result"], d["reason"] = "passed", None


def _failed_entry(d: dict) -> dict:
    return next(c for c in d["checks"] if c["id"] == "has-nope")


@pytest.mark.parametrize("tamper, says", [
    # the case: result flipped and the failed check's entry deleted (summary made to agree)
    (lambda d: (_flip(d), d["checks"].remove(_failed_entry(d)), d["summary"].update(failed=0, total=1)),
     "its checks are not the spec's: missing has-nope"),
    # result flipped, the failed entry said passed; the summary still counts the failure
    (lambda d: (_flip(d), _failed_entry(d).update(outcome="passed")),
     "its summary disagrees with its checks: passed 1 (the checks say 2), failed 1 (the checks say 0)"),
    # the failure made a warning: not what the spec says of that check
    (lambda d: (_flip(d), _failed_entry(d).update(outcome="warned", severity="warn"),
                d["summary"].update(failed=0, warned=1)),
     "check has-nope says kind file, severity warn"),
])
def test_a_hand_edited_failed_receipt_never_promotes(images, project, tamper, says):
    a, _ = images
    assert run_cli("--root", str(project), "gate", NAME, "--ref", a).code == EXIT_GATE_FAILED
    path = _receipt(project, a)
    _edit(path, tamper)
    _refused(project, a, says)


def test_a_receipt_copied_from_another_image_never_promotes(images, project):
    a, b = images
    _spec(project).write_text(PASSING)
    assert run_cli("--root", str(project), "gate", NAME, "--ref", a).code == 0
    src, dst = _receipt(project, a), _receipt(project, b)
    dst.parent.mkdir(parents=True)
    dst.write_text(src.read_text())
    _edit(dst, lambda d: d["identity"].update(digest=identity.inspect(b).digest))
    _refused(project, b, f"hashes to {identity.inspect(a).digest}, not to this image's "
                         f"{identity.inspect(b).digest}")
    # the genuine receipt of A still promotes A
    assert promote.promote(project, NAME, a).moved


def _key(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "builder", "-f", str(path)], check=True)
    return path


def test_a_signed_receipt_and_an_allowed_signers_file(images, project, tmp_path, monkeypatch):
    a, _ = images
    _spec(project).write_text(PASSING)
    key = _key(tmp_path / "builder")
    allowed = tmp_path / "allowed_signers"
    allowed.write_text(f"builder@build-host {' '.join(key.with_suffix('.pub').read_text().split()[:2])}\n")
    # the key from imagebuild.yaml (relative to the project), the allowed signers from the environment
    (project / "imagebuild.yaml").write_text(f"receipts:\n  signing_key: {key}\n")
    monkeypatch.delenv("IMAGEBUILD_SIGNING_KEY")
    r = run_cli("--root", str(project), "gate", NAME, "--ref", a)
    assert r.code == 0, r.err
    assert "signing the receipt with" in r.err
    path = _receipt(project, a)
    assert Path(str(path) + ".sig").read_text().startswith("-----BEGIN SSH SIGNATURE-----")
    monkeypatch.setenv("IMAGEBUILD_ALLOWED_SIGNERS", str(allowed))
    r = run_cli("--root", str(project), "gate", NAME, "--check-receipt", "--ref", a, "--json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert doc["signed"] and doc["signer"] == "builder@build-host" and doc["allowed_signers"] == str(allowed)
    # changed after signing (a field the structure does not check): refused, by promotion too
    saved = path.read_bytes()
    _edit(path, lambda d: d["host"].update(hostname="another-host"))
    _refused(project, a, "its signature does not verify against")
    # unsigned
    path.write_bytes(saved)
    Path(str(path) + ".sig").unlink()
    _refused(project, a, "it is not signed")
    # an allowed-signers file that is configured but missing is a usage error, not "unsigned"
    monkeypatch.setenv("IMAGEBUILD_ALLOWED_SIGNERS", str(tmp_path / "missing"))
    r = run_cli("--root", str(project), "gate", NAME, "--check-receipt", "--ref", a)
    assert r.code == EXIT_BAD_INPUT and "$IMAGEBUILD_ALLOWED_SIGNERS: the allowed-signers file" in r.err, r.err
