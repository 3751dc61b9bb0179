"""Signed gate receipts: OpenSSH's own signature format (``ssh-keygen -Y sign`` / ``-Y verify``).

The gate signs the exact bytes of each receipt it writes with the build host's SSH key, in the
namespace ``imagebuild-receipt``; the signature (an armored ``SSH SIGNATURE`` block) is kept beside
the receipt as ``<spec-hex>.json.sig`` and travels with it to the peers (``imagebuild sync``).
A node with an **allowed-signers file** (ssh-keygen(1), "ALLOWED SIGNERS") counts only receipts whose
signature verifies against it, and learns which principal (which builder) signed them.

Where the key and the file come from (the first that is set; docs/gate.md#signed-receipts):

- signing key: ``$IMAGEBUILD_SIGNING_KEY`` (``none``: do not sign), ``receipts: signing_key:`` in
  imagebuild.yaml, else ``~/.ssh/id_ed25519`` when it exists (else receipts are not signed);
- allowed signers: ``$IMAGEBUILD_ALLOWED_SIGNERS`` (``none``: not required), ``receipts:
  allowed_signers:``, else ``${XDG_CONFIG_HOME:-~/.config}/imagebuild/allowed_signers`` when it exists.
  When one is set, verification is **required**: an unsigned receipt, or one whose signature does not
  verify, is not trusted.

An explicitly named file that does not exist is an error (exit 2), never a silent "unsigned". So is a
default allowed-signers file that is there but cannot be read as one (a dangling link, a FIFO, a
folder, unreadable): signature checking never turns itself off.
Every ssh-keygen call goes through ``core/run.py``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from imagebuild.core import fsutil
from imagebuild.core import run as run_mod
from imagebuild.core.errors import OperationFailed, UsageError
from imagebuild.core.printable import one_line

NAMESPACE = "imagebuild-receipt"
SIG_SUFFIX = ".sig"
KEY_ENV = "IMAGEBUILD_SIGNING_KEY"
SIGNERS_ENV = "IMAGEBUILD_ALLOWED_SIGNERS"
OFF = "none"
DEFAULT_KEY = Path("~/.ssh/id_ed25519")
SIG_BEGIN = "-----BEGIN SSH SIGNATURE-----"
SIG_END = "-----END SSH SIGNATURE-----"
SIG_MAX = 64 << 10  # an SSH signature is well under 1 KiB; a bigger file is not one
SIGNERS_MAX = 4 << 20  # an allowed-signers file: a line per builder key


class NotVerified(Exception):
    """The receipt's signature did not verify (``reason`` says why, for the user)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def default_allowed_signers() -> Path:
    xdg = os.environ.get("XDG_CONFIG_HOME")
    return (Path(xdg) if xdg else Path.home() / ".config") / "imagebuild" / "allowed_signers"


def _configured(cfg, key: str) -> Path | None:
    return ((getattr(cfg, "receipts", None) or {}).get(key)) if cfg is not None else None


DEFAULT = "the default"  # ``where`` of a default file that is there (as a name, a link, anything)


def _setting(env: str, cfg, key: str, default: Path, *, strict_default: bool = False) -> tuple[Path | None, str | None]:
    """(path, where it was set) or (None, None): not set and the default file is absent. With
    ``strict_default``, a default that is there in any form (a dangling link, a FIFO, a folder) counts
    as set, so that ``_usable`` refuses it rather than taking it for "not configured"."""
    value = os.environ.get(env)
    if value is not None and value.strip():
        if value.strip() == OFF:
            return None, None
        return Path(value).expanduser(), f"${env}"
    p = _configured(cfg, key)
    if p is not None:
        return p, f"imagebuild.yaml receipts.{key}"
    default = default.expanduser()
    if strict_default:
        return (default, DEFAULT) if os.path.lexists(default) else (None, None)
    return (default, None) if default.is_file() else (None, None)


def _usable(path: Path, where: str | None, what: str, env: str = SIGNERS_ENV) -> Path:
    if where is None:
        return path
    why = None
    if not path.is_file():
        why = "is not a file" if not os.path.lexists(path) or where != DEFAULT else \
            f"is {_kind(path)}, not a file"
    elif what == "the allowed-signers file":  # there, but can it be read? (root passes os.access anyway)
        try:
            fsutil.read_bytes(path, SIGNERS_MAX)
        except OSError as exc:
            why = f"cannot be read: {exc.strerror or exc}"
    if why is not None:
        if where == DEFAULT:
            raise UsageError(f"{what} {path} {why}: signature checking cannot be left off because of it",
                             hint=f"make it an allowed-signers file, remove it, or set {env}={OFF} "
                             "(docs/gate.md#signed-receipts)")
        hint = f"name an existing file, or {where[1:]}={OFF}" if where.startswith("$") else \
            "fix it in imagebuild.yaml (docs/gate.md#signed-receipts)"
        raise UsageError(f"{where}: {what} {path} {why}", hint=hint)
    return path


def _kind(path: Path) -> str:
    try:
        return fsutil.special_kind(path.stat().st_mode) or "not a regular file"
    except OSError:
        return "a link to nothing" if path.is_symlink() else "unreadable"


def signing_key(cfg=None) -> Path | None:
    """The private key the gate signs receipts with, or None (receipts stay unsigned)."""
    path, where = _setting(KEY_ENV, cfg, "signing_key", DEFAULT_KEY)
    return None if path is None else _usable(path, where, "the signing key", KEY_ENV)


def allowed_signers(cfg=None) -> Path | None:
    """The allowed-signers file receipts must verify against, or None (verification not required)."""
    path, where = _setting(SIGNERS_ENV, cfg, "allowed_signers", default_allowed_signers(), strict_default=True)
    return None if path is None else _usable(path, where, "the allowed-signers file")


def sign(data: bytes, key: Path) -> str:
    """The armored SSH signature of ``data`` by ``key`` in the receipt namespace."""
    with tempfile.TemporaryDirectory(prefix="imagebuild-sign-") as tmp:
        msg = Path(tmp) / "receipt.json"
        msg.write_bytes(data)
        run_mod.run(["ssh-keygen", "-Y", "sign", "-f", str(key), "-n", NAMESPACE, str(msg)], timeout=300,
                    hint=f"the receipt signing key {key} (an SSH private key, or the public half of a key that "
                    f"ssh-agent holds); ${KEY_ENV}={OFF} turns signing off")
        sig = (Path(tmp) / ("receipt.json" + SIG_SUFFIX)).read_text(encoding="ascii")
    if SIG_BEGIN not in sig:
        raise OperationFailed(f"ssh-keygen -Y sign wrote no SSH signature with {key}")
    return sig


def verify(data: bytes, sig: str | None, allowed: Path) -> str:
    """The principal of ``allowed`` whose key signed ``data`` (namespace ``imagebuild-receipt``);
    ``NotVerified`` otherwise (no signature, not an SSH signature, unknown key, altered data)."""
    if not sig:
        raise NotVerified(f"it is not signed, and {allowed} requires a signature")
    if len(sig) > SIG_MAX or SIG_BEGIN not in sig or SIG_END not in sig:
        raise NotVerified("its signature file is not an SSH signature")
    with tempfile.TemporaryDirectory(prefix="imagebuild-verify-") as tmp:
        sig_file = Path(tmp) / "receipt.json.sig"
        sig_file.write_text(sig, encoding="ascii", errors="replace")
        proc = run_mod.run(["ssh-keygen", "-Y", "find-principals", "-s", str(sig_file), "-f", str(allowed)],
                           check=False, timeout=60, hint="install OpenSSH's ssh-keygen (8.2 or later)")
        principals = [ln.strip() for ln in proc.stdout.decode("utf-8", "replace").splitlines()
                      if proc.returncode == 0 and ln.strip()]
        if not principals:
            raise NotVerified(f"its signer's key is not in {allowed}")
        for principal in principals:
            proc = run_mod.run(["ssh-keygen", "-Y", "verify", "-f", str(allowed), "-I", principal, "-n", NAMESPACE,
                                "-s", str(sig_file)], check=False, input=data, timeout=60)
            if proc.returncode == 0:  # a name from the file, shown and recorded: printable text only
                return one_line(principal)
    raise NotVerified(f"its signature does not verify against {allowed} (the receipt was changed after it was "
                      f"signed, or signed for another namespace than {NAMESPACE!r})")


def read_sig(receipt_file: Path) -> str | None:
    """The signature beside ``receipt_file`` (``.json.sig``), or None."""
    p = Path(str(receipt_file) + SIG_SUFFIX)
    try:
        return fsutil.read_bytes(p, SIG_MAX).decode("ascii", "replace")
    except fsutil.UnfitFile:  # a FIFO, a device, a folder or too big: there, but no signature
        return "not a signature"
    except OSError:
        return None
