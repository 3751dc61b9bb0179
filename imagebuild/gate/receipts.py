"""Gate receipts: the record of one gate run, keyed by (image identity, gate spec digest).

``<state>/receipts/<identity-hex>/<spec-hex>.json`` holds the receipt of the LATEST run of that
spec against that image (a later run replaces it, so a failure after a pass withdraws the pass),
and ``<spec-hex>.log`` that run's log (every command, its output, the container's own log).
Receipts are written atomically.

A receipt says which gate it proved: ``spec.sha256`` is the digest of the spec file that ran
and ``authority`` says where that spec came from:

- ``definition``: the definition's own gate spec (``gate:`` in image.yaml);
- ``ad-hoc``: any other spec (``imagebuild gate IMAGE --spec FILE``, or an image reference).

Promotion and sync ask ``find_passing(ctx, identity, spec_digest)`` (``ctx``: a ``context.Context``
or a project root) with the digest of the
definition's CURRENT spec: only a passing ``definition`` receipt for exactly that image and
exactly that spec counts. An ad-hoc run never authorizes a promotion, and adding a check to
gate.yaml makes every earlier receipt irrelevant.

A receipt is **trusted** (``check``) only when it is consistent with itself and with what it claims:
its identity document re-hashes to the identity of the image being promoted (computed from that
image, never taken from the receipt), its check entries are exactly the spec's checks (same ids,
kinds, severities), its summary and ``gpu_checks_skipped`` agree with those entries, and, where an
allowed-signers file is configured (signing.py), its signature ``<spec-hex>.json.sig`` verifies.

Format (schema ``imagebuild.receipt``, version 2): docs/gate.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from imagebuild.core import fsutil, state
from imagebuild.core.fsutil import atomic_write_bytes, canonical_json, sha256_bytes
from imagebuild.gate import signing

SCHEMA = "imagebuild.receipt"
VERSION = 2
RECEIPT_MAX = 4 << 20  # a receipt is a few KiB; a bigger file (or a FIFO, a device) is not read
OUTCOMES = ("passed", "failed", "skipped", "warned")
AUTHORITY_DEFINITION = "definition"
AUTHORITY_AD_HOC = "ad-hoc"


def receipts_dir(ctx) -> Path:
    """``<state>/receipts`` of a ``context.Context`` (or of a project root)."""
    from imagebuild.core.context import of

    return of(ctx).state / "receipts"


def _hex(digest: str, what: str = "identity") -> str:
    algo, _, hexpart = str(digest).partition(":")
    if algo != "sha256" or len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise ValueError(f"not a {what} digest: {digest!r} (expected sha256:<64 hex>)")
    return hexpart


def receipt_path(ctx, identity_digest: str, spec_digest: str) -> Path:
    return receipts_dir(ctx) / _hex(identity_digest) / f"{_hex(spec_digest, 'spec')}.json"


def log_path(ctx, identity_digest: str, spec_digest: str) -> Path:
    return receipt_path(ctx, identity_digest, spec_digest).with_suffix(".log")


@dataclass(frozen=True)
class Receipt:
    data: dict
    path: Path

    @property
    def passed(self) -> bool:
        return self.data.get("result") == "passed"

    @property
    def identity_digest(self) -> str:
        return self.data["identity"]["digest"]

    @property
    def spec_digest(self) -> str:
        return self.data["spec"]["sha256"]

    @property
    def authority(self) -> str:
        return self.data.get("authority", AUTHORITY_AD_HOC)

    @property
    def checks(self) -> list[dict]:
        return self.data["checks"]

    @property
    def gpu_checks_skipped(self) -> bool:
        return bool(self.data.get("gpu_checks_skipped"))


def encode(data: dict) -> bytes:
    """The bytes of a receipt file (what is signed)."""
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8")


def write(ctx, data: dict, *, key: Path | None = None) -> Receipt:
    """Validate the shape and write ``data`` atomically to its (identity, spec) receipt file; with
    ``key``, its signature (signing.py) first, beside it (a receipt never sits beside a stale
    signature that verifies: without ``key`` an old signature is removed)."""
    if data.get("schema") != SCHEMA or data.get("version") != VERSION:
        raise ValueError("not a receipt document")
    if data.get("authority") not in (AUTHORITY_DEFINITION, AUTHORITY_AD_HOC):
        raise ValueError(f"bad authority {data.get('authority')!r}")
    for c in data["checks"]:
        if c["outcome"] not in OUTCOMES:
            raise ValueError(f"bad outcome {c['outcome']!r} for check {c['id']!r}")
    path = receipt_path(ctx, data["identity"]["digest"], data["spec"]["sha256"])
    raw = encode(data)
    sig_path = Path(str(path) + signing.SIG_SUFFIX)
    try:
        if key is not None:
            atomic_write_bytes(sig_path, signing.sign(raw, key).encode("ascii"))
        else:
            sig_path.unlink(missing_ok=True)
    except BaseException:
        # the run's result is still written (a failure after a pass withdraws the pass), unsigned
        sig_path.unlink(missing_ok=True)
        atomic_write_bytes(path, raw)
        raise
    atomic_write_bytes(path, raw)
    return Receipt(data, path)


def read(ctx, identity_digest: str, spec_digest: str) -> dict | None:
    """The latest receipt for that identity and spec, or None (also for an unreadable or foreign file)."""
    try:
        path = receipt_path(ctx, identity_digest, spec_digest)
        data = json.loads(fsutil.read_text(path, RECEIPT_MAX))
    except (ValueError, OSError):
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("version") != VERSION:
        return None
    if (data.get("identity") or {}).get("digest") != identity_digest or \
            (data.get("spec") or {}).get("sha256") != spec_digest:
        return None
    return data


def for_identity(ctx, identity_digest: str) -> list[dict]:
    """Every receipt of that image (any spec), newest run first."""
    try:
        d = receipts_dir(ctx) / _hex(identity_digest)
    except ValueError:
        return []
    out = []
    for p in d.glob("*.json") if d.is_dir() else ():
        try:
            data = json.loads(fsutil.read_text(p, RECEIPT_MAX))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("schema") == SCHEMA and data.get("version") == VERSION:
            out.append(data)
    return sorted(out, key=lambda x: (x.get("run") or {}).get("finished") or "", reverse=True)


# ------------------------------------------------------------------------------------------------ trust


@dataclass(frozen=True)
class Verdict:
    """What one receipt file is worth for one image and spec: ``trusted`` (the passing receipt, its
    data), or why not (``reason``; ``untrusted``: the file is there but inconsistent, altered or
    badly signed, as opposed to missing, failed or ad hoc)."""

    path: Path
    data: dict | None = None  # set only when trusted
    reason: str | None = None
    untrusted: bool = False
    signer: str | None = None  # the allowed-signers principal whose signature verified
    signed: bool = False  # a signature file is beside it
    raw: bytes | None = None  # the file's exact bytes (what sync carries, with ``signature``)
    signature: str | None = None

    @property
    def trusted(self) -> bool:
        return self.data is not None


def rehash(identity: dict) -> str | None:
    """The identity digest the receipt's own identity document hashes to (identity.py), or None."""
    if not isinstance(identity, dict):
        return None
    doc = {k: v for k, v in identity.items() if k != "digest"}
    return "sha256:" + sha256_bytes(canonical_json(doc))


def _spec_checks(spec) -> dict[str, tuple] | None:
    if spec is None:
        return None
    return {c.id: (c.kind, c.severity, bool(c.requires_gpu)) for c in spec.checks}


def problem(data: dict, identity_digest: str, spec_digest: str, spec=None, *, require_gpu: bool = False) \
        -> tuple[str, bool] | None:
    """Why ``data`` is no passing receipt of ``spec`` (a ``gatespec.GateSpec`` whose digest is
    ``spec_digest``; None: the spec is not known here) for the image ``identity_digest``: (reason,
    untrusted) or None. ``untrusted``: the receipt contradicts itself, the image or the spec."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("version") != VERSION:
        return f"it is not a receipt (schema {SCHEMA} version {VERSION})", True
    ident = data.get("identity") if isinstance(data.get("identity"), dict) else {}
    if ident.get("digest") != identity_digest:
        return f"it is for identity {ident.get('digest')}, not this image's {identity_digest}", True
    again = rehash(ident)
    if again != identity_digest:
        return (f"its identity document (layers and config) hashes to {again}, not to this image's "
                f"{identity_digest}: it is another image's receipt with the digest edited"), True
    if (data.get("spec") or {}).get("sha256") != spec_digest:
        return f"it is for spec {(data.get('spec') or {}).get('sha256')}, not {spec_digest}", True
    if data.get("authority") != AUTHORITY_DEFINITION:
        return "its spec is ad hoc (only the definition's own gate spec authorizes)", False
    if data.get("result") != "passed":
        return f"the latest run failed ({data.get('reason') or 'no reason given'})", False
    checks = data.get("checks")
    if not isinstance(checks, list) or not checks or not all(isinstance(c, dict) for c in checks):
        return "it lists no checks (a gate with zero checks fails)", True
    ids = [c.get("id") for c in checks]
    if len(set(ids)) != len(ids):
        return "it lists a check twice: " + ", ".join(sorted({str(i) for i in ids if ids.count(i) > 1})), True
    want = _spec_checks(spec)
    if want is not None:
        missing = [i for i in want if i not in ids]
        extra = [str(i) for i in ids if i not in want]
        if missing or extra:
            return ("its checks are not the spec's: " + "; ".join(
                ([f"missing {', '.join(missing)}"] if missing else []) +
                ([f"not in the spec {', '.join(extra)}"] if extra else []))), True
        for c in checks:
            kind, severity, gpu = want[c["id"]]
            if (c.get("kind"), c.get("severity"), bool(c.get("requires_gpu"))) != (kind, severity, gpu):
                return (f"check {c['id']} says kind {c.get('kind')}, severity {c.get('severity')}, requires_gpu "
                        f"{bool(c.get('requires_gpu'))}; the spec says {kind}, {severity}, {gpu}"), True
    for c in checks:
        o = c.get("outcome")
        if o not in OUTCOMES:
            return f"check {c.get('id')} has no outcome of {', '.join(OUTCOMES)}: {o!r}", True
        if o == "failed":
            return f"it says passed, but check {c.get('id')} failed", True
        if o == "warned" and c.get("severity") != "warn":
            return f"check {c.get('id')} is warned but its severity is {c.get('severity')}", True
    if data.get("reason") is not None:
        return f"it says passed with a reason for failing ({data.get('reason')})", True
    summary = data.get("summary") if isinstance(data.get("summary"), dict) else {}
    counts = {o: sum(1 for c in checks if c.get("outcome") == o) for o in OUTCOMES}
    counts["total"] = len(checks)
    wrong = [f"{k} {summary.get(k)!r} (the checks say {v})" for k, v in counts.items() if summary.get(k) != v]
    if wrong:
        return "its summary disagrees with its checks: " + ", ".join(wrong), True
    gpu_skipped = any(c.get("requires_gpu") and c.get("outcome") == "skipped" for c in checks)
    if bool(data.get("gpu_checks_skipped")) != gpu_skipped:
        return (f"it says gpu_checks_skipped {bool(data.get('gpu_checks_skipped'))}, its checks say "
                f"{gpu_skipped}"), True
    emulated = data.get("emulated")
    if emulated is not None:
        if not isinstance(emulated, dict) or emulated.get("image_arch") != ident.get("architecture"):
            said = emulated.get("image_arch") if isinstance(emulated, dict) else emulated
            return (f"it says it ran under emulation of {said!r}, but the image is "
                    f"{ident.get('architecture')!r}"), True
    if require_gpu and gpu_skipped:
        return "its GPU checks were skipped (no GPU on the gating host)", False
    return None


def judge(path: Path, identity_digest: str, spec_digest: str, *, spec=None, require_gpu: bool = False,
          allowed: Path | None = None) -> Verdict:
    """The ``Verdict`` on the receipt file ``path`` for that image and spec; with ``allowed`` (an
    allowed-signers file) its signature must verify too."""
    try:
        raw = fsutil.read_bytes(path, RECEIPT_MAX)
        data = json.loads(raw)
    except FileNotFoundError:
        return Verdict(path, reason="there is no receipt")
    except (OSError, ValueError) as exc:
        return Verdict(path, reason=f"it cannot be read as JSON ({type(exc).__name__})", untrusted=True)
    sig = signing.read_sig(path)
    found = problem(data, identity_digest, spec_digest, spec, require_gpu=require_gpu)
    if found is not None:
        return Verdict(path, reason=found[0], untrusted=found[1], signed=sig is not None, raw=raw, signature=sig)
    signer = None
    if allowed is not None:
        try:
            signer = signing.verify(raw, sig, allowed)
        except signing.NotVerified as exc:
            return Verdict(path, reason=exc.reason, untrusted=True, signed=sig is not None, raw=raw, signature=sig)
    return Verdict(path, data, signer=signer, signed=sig is not None, raw=raw, signature=sig)


def _load_spec(spec, spec_digest: str):
    """``spec`` (a path or a loaded GateSpec) as a GateSpec of exactly ``spec_digest``, or None."""
    if spec is None:
        return None
    from imagebuild.definition import gatespec

    if isinstance(spec, gatespec.GateSpec):
        return spec
    if gatespec.digest(Path(spec)) != spec_digest:
        return None
    return gatespec.load(Path(spec))


def check(ctx, identity_digest: str, spec_digest: str, *, spec=None, require_gpu: bool = False) -> Verdict:
    """The ``Verdict`` on the latest receipt of that image (``identity_digest``, computed from the
    image) and spec in the project's state folder. ``spec``: the spec file (or GateSpec) whose digest
    is ``spec_digest``, so the receipt's checks are compared with it; the project's allowed-signers
    file (signing.py), when one is configured, must have signed it."""
    from imagebuild.core.context import of

    try:
        path = receipt_path(ctx, identity_digest, spec_digest)
    except ValueError as exc:
        return Verdict(Path(), reason=str(exc))
    loaded = _load_spec(spec, spec_digest)
    if spec is not None and loaded is None:
        return Verdict(path, reason=f"the spec {spec} is no longer {spec_digest} (it changed meanwhile)")
    return judge(path, identity_digest, spec_digest, spec=loaded, require_gpu=require_gpu,
                 allowed=signing.allowed_signers(of(ctx).config))


def find_passing(ctx, identity_digest: str, spec_digest: str, *, require_gpu: bool = False,
                 spec=None) -> dict | None:
    """The trusted passing receipt of the definition's spec ``spec_digest`` for exactly this image,
    or None (``check`` says why).

    Only the latest run counts: a failed run after a pass returns None. An ad-hoc receipt never
    counts. With ``require_gpu``, a pass whose GPU checks were skipped does not count either.
    """
    return check(ctx, identity_digest, spec_digest, spec=spec, require_gpu=require_gpu).data


# ------------------------------------------------------------------------------------------ synced receipts


def synced_dir() -> Path:
    """Where ``imagebuild sync`` carries receipts on a peer: the peer's sync cache
    (``$IMAGEBUILD_PEER_CACHE``, default ``$XDG_CACHE_HOME/imagebuild/peer``) ``/receipts/``, laid out
    like ``<state>/receipts/`` (with each receipt's ``.json.sig``). ``imagebuild gate IMAGE
    --check-receipt`` reads it."""
    explicit = os.environ.get("IMAGEBUILD_PEER_CACHE")
    base = Path(explicit) if explicit else state.cache_home() / "imagebuild" / "peer"
    return base / "receipts"


def check_synced(identity_digest: str, spec_digest: str | None, *, spec=None,
                 allowed: Path | None = None) -> Verdict | None:
    """The best ``Verdict`` among the receipts sync carried here for the identity: of exactly
    ``spec_digest`` (``spec``: that spec, to compare the checks with), or (None) of any spec, newest
    trusted first; a verdict that is not trusted says why; None when there is none at all."""
    try:
        d = synced_dir() / _hex(identity_digest)
    except ValueError:
        return None
    if spec_digest:
        loaded = _load_spec(spec, spec_digest)
        paths = [d / f"{_hex(spec_digest, 'spec')}.json"]
    else:
        loaded, paths = None, sorted(d.glob("*.json"))
    verdicts = []
    for path in paths:
        digest = spec_digest or "sha256:" + path.stem
        v = judge(path, identity_digest, digest, spec=loaded, allowed=allowed)
        if v.reason == "there is no receipt":
            continue
        verdicts.append(v)
    if not verdicts:
        return None
    trusted = [v for v in verdicts if v.trusted]
    if trusted:
        trusted.sort(key=lambda v: (v.data.get("run") or {}).get("finished") or "", reverse=True)
        return trusted[0]
    return verdicts[0]
