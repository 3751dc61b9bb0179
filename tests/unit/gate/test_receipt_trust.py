"""When a receipt is trusted (receipts.check): consistent with itself, with the spec and with the image;
and signed (ssh-keygen -Y, the real OpenSSH tool) where an allowed-signers file says so. Issue 21,
"Receipts that lie". The same refusals on a real engine: tests/integration/gate/test_receipt_trust.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from imagebuild.core import identity
from imagebuild.core.errors import UsageError
from imagebuild.gate import receipts, signing

SPEC = """\
checks:
  - {id: ok, kind: file, path: /v}
  - {id: bad, kind: file, path: /nope}
  - {id: soft, kind: import, module: x, severity: warn}
  - {id: gpu, kind: command, run: nvidia-smi, requires: gpu}
"""


def _inspect(n: str) -> dict:
    return {"Id": "sha256:" + n * 64, "Os": "linux", "Architecture": "amd64",
            "RootFS": {"Layers": ["sha256:" + n * 64]}, "Config": {"Cmd": ["sh"]}}


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv(signing.SIGNERS_ENV, "none")
    spec = tmp_path / "gate.yaml"
    spec.write_text(SPEC)
    return tmp_path, spec, "sha256:" + __import__("hashlib").sha256(SPEC.encode()).hexdigest()


def _doc(ident: identity.ImageIdentity, spec_digest: str, outcomes: dict[str, str]) -> dict:
    """A receipt as runner.execute writes it."""
    kinds = {"ok": ("file", "error", False), "bad": ("file", "error", False), "soft": ("import", "warn", False),
             "gpu": ("command", "error", True)}
    checks = [{"id": i, "kind": kinds[i][0], "severity": kinds[i][1], "requires_gpu": kinds[i][2], "description": None,
               "outcome": o, "detail": "", "duration_s": 0.1} for i, o in outcomes.items()]
    summary = {o: sum(1 for c in checks if c["outcome"] == o) for o in receipts.OUTCOMES}
    summary["total"] = len(checks)
    failed = [c["id"] for c in checks if c["outcome"] == "failed"]
    return {"schema": receipts.SCHEMA, "version": receipts.VERSION,
            "result": "failed" if failed else "passed",
            "reason": f"{len(failed)} check(s) failed: " + ", ".join(failed) if failed else None,
            "authority": "definition", "identity": {"digest": ident.digest, **ident.document()},
            "image": {"ref": "x:candidate", "definition": "x", "local_id": ident.local_id},
            "spec": {"file": "gate.yaml", "sha256": spec_digest, "python": "python3"}, "require_gpu": False,
            "gpu_checks_skipped": any(c["requires_gpu"] and c["outcome"] == "skipped" for c in checks),
            "summary": summary, "checks": checks, "host": {"hostname": "h", "arch": "x86_64", "gpus": [],
                                                           "gpu_model": None},
            "imagebuild_version": "0", "run": {"started": "t", "finished": "t", "duration_s": 1.0}, "log": "l"}


PASSING = {"ok": "passed", "bad": "passed", "soft": "warned", "gpu": "skipped"}
FAILING = {"ok": "passed", "bad": "failed", "soft": "passed", "gpu": "skipped"}


def _edit(root: Path, ident, spec_digest: str, fn) -> None:
    path = receipts.receipt_path(root, ident.digest, spec_digest)
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _verdict(root, ident, spec, spec_digest, **kw):
    return receipts.check(root, ident.digest, spec_digest, spec=spec, **kw)


def test_a_genuine_pass_is_trusted(setup):
    root, spec, sd = setup
    a = identity.from_inspect(_inspect("a"))
    receipts.write(root, _doc(a, sd, PASSING))
    v = _verdict(root, a, spec, sd)
    assert v.trusted and v.reason is None and not v.signed
    assert receipts.find_passing(root, a.digest, sd, spec=spec) == v.data
    # with --require-gpu semantics, a skipped GPU check does not count (and is not a tamper)
    v = _verdict(root, a, spec, sd, require_gpu=True)
    assert not v.trusted and not v.untrusted and "GPU checks were skipped" in v.reason


def _failed_then(root, a, sd, fn):
    receipts.write(root, _doc(a, sd, FAILING))
    _edit(root, a, sd, fn)


def _flip(d):
    d["result"], d["reason"] = "passed", None


@pytest.mark.parametrize("name, tamper, says", [
    ("flip the result, the failed entry said passed (summary as written)",
     lambda d: (_flip(d), d["checks"][1].update(outcome="passed")),
     "its summary disagrees with its checks: passed 2 (the checks say 3), failed 1 (the checks say 0)"),
    ("flip the result, delete the failed entry, summary made to agree",
     lambda d: (_flip(d), d["checks"].pop(1), d["summary"].update(failed=0, total=3)),
     "its checks are not the spec's: missing bad"),
    ("flip the result only", _flip, "it says passed, but check bad failed"),
    ("the failed check turned into a warning", lambda d: (_flip(d), d["checks"][1].update(
        outcome="warned", severity="warn"), d["summary"].update(failed=0, warned=1)),
     "check bad says kind file, severity warn"),
    ("the failed check said skipped (summary untouched)", lambda d: (_flip(d), d["checks"][1].update(outcome="skipped")),
     "its summary disagrees with its checks"),
    ("a check added that the spec does not have", lambda d: (_flip(d), d["checks"][1].update(outcome="passed"),
                                                            d["checks"].append({**d["checks"][0], "id": "extra"})),
     "not in the spec extra"),
    ("a check listed twice", lambda d: (_flip(d), d["checks"].__setitem__(1, dict(d["checks"][0]))),
     "it lists a check twice: ok"),
    ("gpu_checks_skipped cleared", lambda d: (_flip(d), d["checks"][1].update(outcome="passed"),
                                             d["summary"].update(passed=3, failed=0), d.update(gpu_checks_skipped=False)),
     "gpu_checks_skipped False, its checks say True"),
])
def test_every_hand_edit_of_a_failed_receipt_is_refused(setup, name, tamper, says):
    root, spec, sd = setup
    a = identity.from_inspect(_inspect("a"))
    _failed_then(root, a, sd, tamper)
    v = _verdict(root, a, spec, sd)
    assert not v.trusted and v.untrusted, name
    assert says in v.reason, (name, v.reason)


def test_a_receipt_copied_from_another_image_with_the_digest_edited_is_refused(setup):
    root, spec, sd = setup
    a, b = identity.from_inspect(_inspect("a")), identity.from_inspect(_inspect("b"))
    receipts.write(root, _doc(a, sd, PASSING))
    src = receipts.receipt_path(root, a.digest, sd)
    dst = receipts.receipt_path(root, b.digest, sd)
    dst.parent.mkdir(parents=True)
    data = json.loads(src.read_text())
    data["identity"]["digest"] = b.digest
    dst.write_text(json.dumps(data))
    v = _verdict(root, b, spec, sd)
    assert not v.trusted and v.untrusted
    assert f"hashes to {a.digest}, not to this image's {b.digest}" in v.reason
    # the whole document copied too (layers and config of b) is b's own receipt: but then it says what
    # b is, and the spec's checks still have to match; it is the lie about *which* image that is refused
    assert _verdict(root, a, spec, sd).trusted


def test_a_receipt_of_another_spec_version_is_compared_with_todays_spec(setup, tmp_path):
    root, spec, sd = setup
    a = identity.from_inspect(_inspect("a"))
    receipts.write(root, _doc(a, sd, PASSING))
    spec.write_text(SPEC + "  - {id: more, kind: file, path: /w}\n")  # the spec moved on: the digest no longer matches
    v = _verdict(root, a, spec, sd)
    assert not v.trusted and "changed meanwhile" in v.reason


# ------------------------------------------------------------------------------------------------ signatures


def _key(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)], check=True)
    return path


def _allowed(path: Path, *entries: tuple[str, Path]) -> Path:
    path.write_text("".join(f"{p} namespaces=\"{signing.NAMESPACE}\" "
                            f"{' '.join(k.with_suffix('.pub').read_text().split()[:2])}\n" for p, k in entries))
    return path


def test_signed_receipts_verify_and_tampered_or_unsigned_ones_do_not(setup, monkeypatch):
    root, spec, sd = setup
    builder, other = _key(root / "builder"), _key(root / "other")
    allowed = _allowed(root / "allowed_signers", ("builder@dgx3", builder))
    a = identity.from_inspect(_inspect("a"))
    receipts.write(root, _doc(a, sd, PASSING), key=builder)
    path = receipts.receipt_path(root, a.digest, sd)
    sig = Path(str(path) + ".sig")
    assert sig.read_text().startswith(signing.SIG_BEGIN)
    # what was signed is the file's exact bytes, verifiable with ssh-keygen alone (docs/gate.md)
    r = subprocess.run(["ssh-keygen", "-Y", "verify", "-f", str(allowed), "-I", "builder@dgx3", "-n", signing.NAMESPACE,
                        "-s", str(sig)], stdin=path.open("rb"), capture_output=True)
    assert r.returncode == 0, r.stderr
    # no allowed-signers file: not required (the structure still is)
    assert _verdict(root, a, spec, sd).trusted
    monkeypatch.setenv(signing.SIGNERS_ENV, str(allowed))
    v = _verdict(root, a, spec, sd)
    assert v.trusted and v.signed and v.signer == "builder@dgx3"
    # any change after signing, even one the structure allows (the host name), breaks it
    _edit(root, a, sd, lambda d: d["host"].update(hostname="elsewhere"))
    v = _verdict(root, a, spec, sd)
    assert not v.trusted and v.untrusted and "does not verify" in v.reason
    # signed by a key the file does not list
    receipts.write(root, _doc(a, sd, PASSING), key=other)
    v = _verdict(root, a, spec, sd)
    assert not v.trusted and "signer's key is not in" in v.reason
    # unsigned: writing without a key removes the old signature, and nothing unsigned counts
    receipts.write(root, _doc(a, sd, PASSING))
    assert not sig.exists()
    v = _verdict(root, a, spec, sd)
    assert not v.trusted and "it is not signed" in v.reason
    # a signature made for another namespace (some other use of the same key) does not count
    raw = path.read_bytes()
    msg = root / "m"
    msg.write_bytes(raw)
    subprocess.run(["ssh-keygen", "-Y", "sign", "-f", str(builder), "-n", "file", str(msg)], check=True,
                   capture_output=True)
    sig.write_text((root / "m.sig").read_text())
    assert "does not verify" in _verdict(root, a, spec, sd).reason


def test_where_the_key_and_the_allowed_signers_come_from(tmp_path, monkeypatch):
    from imagebuild.core import config

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(signing.KEY_ENV, raising=False)
    monkeypatch.delenv(signing.SIGNERS_ENV, raising=False)
    assert signing.signing_key() is None and signing.allowed_signers() is None  # nothing there: unsigned, not required
    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    default = _key(tmp_path / "home" / ".ssh" / "id_ed25519")
    assert signing.signing_key() == default
    (tmp_path / "xdg" / "imagebuild").mkdir(parents=True)
    (tmp_path / "xdg" / "imagebuild" / "allowed_signers").write_text("")
    assert signing.allowed_signers() == tmp_path / "xdg" / "imagebuild" / "allowed_signers"
    # imagebuild.yaml, relative to the project
    proj = tmp_path / "proj"
    proj.mkdir()
    k = _key(proj / "k")
    (proj / "imagebuild.yaml").write_text("receipts:\n  signing_key: k\n  allowed_signers: /nowhere/as\n")
    cfg = config.load(proj)
    assert signing.signing_key(cfg) == k
    with pytest.raises(UsageError, match="imagebuild.yaml receipts.allowed_signers: the allowed-signers file "
                       "/nowhere/as is not a file"):
        signing.allowed_signers(cfg)
    # the environment over the file; `none` turns each off
    monkeypatch.setenv(signing.KEY_ENV, "none")
    monkeypatch.setenv(signing.SIGNERS_ENV, "none")
    assert signing.signing_key(cfg) is None and signing.allowed_signers(cfg) is None
    monkeypatch.setenv(signing.KEY_ENV, str(tmp_path / "missing"))
    with pytest.raises(UsageError, match=r"\$IMAGEBUILD_SIGNING_KEY: the signing key .*missing is not a file"):
        signing.signing_key(cfg)
    # an unknown key under receipts: names file, line and key
    (proj / "imagebuild.yaml").write_text("receipts:\n  signing_keys: k\n")
    from imagebuild.core.errors import DefinitionError

    with pytest.raises(DefinitionError) as exc:
        config.load(proj)
    assert "imagebuild.yaml:2: receipts.signing_keys: unknown key" in exc.value.render()
    assert "did you mean 'signing_key'?" in exc.value.render()


def test_a_signing_failure_still_withdraws_an_earlier_pass(setup):
    """The run's result is written (unsigned) even when signing fails, so a failure after a pass is never
    hidden behind the old, signed pass."""
    from imagebuild.core.errors import OperationFailed

    root, spec, sd = setup
    builder = _key(root / "builder")
    a = identity.from_inspect(_inspect("a"))
    receipts.write(root, _doc(a, sd, PASSING), key=builder)
    path = receipts.receipt_path(root, a.digest, sd)
    assert Path(str(path) + ".sig").is_file()
    not_a_key = root / "not-a-key"
    not_a_key.write_text("hello\n")
    with pytest.raises(OperationFailed):
        receipts.write(root, _doc(a, sd, FAILING), key=not_a_key)
    assert json.loads(path.read_text())["result"] == "failed"
    assert not Path(str(path) + ".sig").exists()
    assert not _verdict(root, a, spec, sd).trusted


def test_a_receipt_that_misstates_its_emulation_is_untrusted(setup):
    _, _, spec_digest = setup
    ident = identity.from_inspect(_inspect("a"))
    doc = _doc(ident, spec_digest, {"ok": "passed", "bad": "passed", "soft": "passed", "gpu": "passed"})
    assert receipts.problem(doc, ident.digest, spec_digest) is None
    doc["emulated"] = {"image_arch": "amd64", "host_arch": "arm64", "how": "binfmt handler qemu-x86_64",
                       "cpuinfo": None}
    assert receipts.problem(doc, ident.digest, spec_digest) is None
    doc["emulated"]["image_arch"] = "arm64"  # the image is amd64
    reason, untrusted = receipts.problem(doc, ident.digest, spec_digest)
    assert untrusted and "emulation of 'arm64'" in reason
    doc["emulated"] = "yes"
    assert receipts.problem(doc, ident.digest, spec_digest)[1]
