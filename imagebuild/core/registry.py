"""An OCI registry shared by the build nodes (docs/fleet.md): where it is, and the one tool that
talks to it, ``skopeo`` (Debian's; ``oci:`` layouts to and from ``docker://``). No registry
protocol is written here.

    registry: HOST[:PORT][/PREFIX]       imagebuild.yaml, or --cache-registry / --registry
    <HOST:PORT>/<PREFIX>/<image>         one repository per image, holding
        :stage-<key hex>                 each stage under its content key (registry_cache.py)
        :ccache-<cache id>               a compile stage's compiler cache (compilecache_share.py)
        :b-<build id>                    the gated release of a build (immutable), :local, :previous

Credentials come only from the standard docker config (``$DOCKER_CONFIG/config.json``, else
``~/.docker/config.json``: what ``docker login`` writes), handed to skopeo as ``--authfile``: never on
a command line, in an address, a log line, a label or a record. An address holding credentials
(``user:password@host``) is refused without being repeated.

Plain HTTP (``--tls-verify=false``) is used for a loopback registry (127.0.0.0/8, localhost, ::1),
as Docker does, or when ``IMAGEBUILD_REGISTRY_INSECURE=1``; everything else is HTTPS with the
system's certificates.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from imagebuild.core import run as run_mod
from imagebuild.core.errors import OperationFailed, UsageError

_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*|\[[0-9A-Fa-f:.]+\])"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_ADDR_RE = re.compile(rf"^(?P<host>{_HOST})(?::(?P<port>\d{{1,5}}))?(?P<prefix>(?:/{_COMPONENT})*)/?$")
INSECURE_ENV = "IMAGEBUILD_REGISTRY_INSECURE"
LOOKUP_TIMEOUT_S = 30
COPY_TIMEOUT_S = 6 * 3600


@dataclass(frozen=True)
class Registry:
    host: str  # HOST[:PORT]
    prefix: str  # "" or "a/b"

    @property
    def address(self) -> str:
        return f"{self.host}/{self.prefix}" if self.prefix else self.host

    def repo(self, image: str) -> str:
        return f"{self.address}/{image}"

    def ref(self, image: str, tag: str) -> str:
        return f"{self.repo(image)}:{tag}"

    def at(self, image: str, digest: str) -> str:
        return f"{self.repo(image)}@{digest}"

    @property
    def insecure(self) -> bool:
        if os.environ.get(INSECURE_ENV) == "1":
            return True
        name = self.host.rsplit(":", 1)[0] if not self.host.startswith("[") else self.host.split("]")[0] + "]"
        return name in ("localhost", "[::1]") or name.startswith("127.")

    def __str__(self) -> str:
        return self.address


def parse(value: str, *, what: str = "--cache-registry") -> Registry:
    """``HOST[:PORT][/PREFIX]`` as a Registry; exit 2 otherwise (never repeating credentials)."""
    v = (value or "").strip()
    if "@" in v:
        raise UsageError(f"{what}: a registry address never holds credentials (the value was not repeated here)",
                         hint="give HOST:PORT/PREFIX; log in once with `docker login HOST:PORT` (the docker config "
                         "holds the credentials)")
    if "://" in v:
        raise UsageError(f"{what} {v!r}: expected HOST[:PORT][/PREFIX], without a scheme",
                         hint="e.g. 10.0.0.5:5000/imagebuild (plain HTTP only on loopback, or with "
                         f"{INSECURE_ENV}=1)")
    m = _ADDR_RE.match(v)
    if not m or (m["port"] and not 0 < int(m["port"]) < 65536):
        raise UsageError(f"{what} {v!r}: expected HOST[:PORT][/PREFIX] (lower-case path components)",
                         hint="e.g. 127.0.0.1:5000/imagebuild")
    host = m["host"] + (f":{m['port']}" if m["port"] else "")
    return Registry(host, m["prefix"].strip("/"))


def docker_config_file() -> Path | None:
    """The standard docker config (credentials, credential helpers), when there is one."""
    base = os.environ.get("DOCKER_CONFIG") or os.path.join(os.path.expanduser("~"), ".docker")
    p = Path(base) / "config.json"
    return p if p.is_file() else None


# --------------------------------------------------------------------------------------------- skopeo


class RegistryError(OperationFailed):
    """A registry call failed; ``kind`` says how: missing | unreachable | transfer (the connection was cut
    part-way: a short read, a reset; not the content's fault) | auth | corrupt (the content does not
    verify: a digest or size that does not match) | other."""

    def __init__(self, kind: str, message: str, *, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.kind = kind


_KINDS = (
    ("missing", ("manifest unknown", "name unknown", "not found", "statuscode: 404", "status code 404")),
    ("corrupt", ("digest did not match", "does not match", "digest mismatch", "invalid checksum",
                 "size mismatch", "integrity")),
    # a connection cut mid-blob reads "unexpected EOF" (a short read) or a reset: a transfer failure
    ("transfer", ("unexpected eof", "connection reset", "broken pipe", "short read",
                  "use of closed network connection")),
    ("auth", ("unauthorized", "authentication required", "denied", "statuscode: 401", "statuscode: 403")),
    ("unreachable", ("connection refused", "no such host", "i/o timeout", "deadline exceeded", "connection reset",
                     "network is unreachable", "no route to host", "timeout", "tls: ", "eof",
                     "server gave http response")),
)
_CRED_RE = re.compile(r"(//)[^/\s@]+:[^/\s@]+@")
_AUTH_RE = re.compile(r"(?i)(authorization|auth|password|token)([\"']?\s*[:=]\s*[\"']?)[^\s\"',}]+")


def scrub(text: str) -> str:
    """Remove anything shaped like a credential from a tool's message before it is shown."""
    return _AUTH_RE.sub(r"\1\2***", _CRED_RE.sub(r"\1***@", text))


def _kind(text: str) -> str:
    low = text.lower()
    for kind, needles in _KINDS:
        if any(n in low for n in needles):
            return kind
    return "other"


def skopeo(reg: Registry, *args: str, src: bool = False, dest: bool = False, timeout: float = LOOKUP_TIMEOUT_S,
           what: str) -> bytes:
    """Run ``skopeo ARGS`` against ``reg`` (TLS and credentials as the module doc says); stdout, or a
    RegistryError naming the registry and what was asked."""
    if run_mod.which("skopeo") is None:
        raise RegistryError("other", "skopeo not found: the registry is used through it",
                            hint="apt-get install skopeo (scripts/testbed.sh installs it)")
    argv = ["skopeo", "--command-timeout", f"{int(timeout)}s", args[0]]
    auth = docker_config_file()
    tls = "false" if reg.insecure else "true"
    if src or dest:
        if src:
            argv += [f"--src-tls-verify={tls}"] + (["--src-authfile", str(auth)] if auth else [])
        if dest:
            argv += [f"--dest-tls-verify={tls}"] + (["--dest-authfile", str(auth)] if auth else [])
    else:
        argv += [f"--tls-verify={tls}"] + (["--authfile", str(auth)] if auth else [])
    argv += list(args[1:])
    try:
        proc = run_mod.run(argv, timeout=timeout + 30, capture=True, check=False)
    except OperationFailed as exc:
        raise RegistryError("unreachable", f"registry {reg}: {what}: {scrub(exc.message)}") from None
    out = proc.stdout or b""
    if proc.returncode != 0:
        text = scrub(out.decode("utf-8", "replace").strip())
        last = [ln for ln in text.splitlines() if ln.strip()][-1:] or ["no output"]
        kind = _kind(text)
        raise RegistryError(kind, f"registry {reg}: {what}: {last[0][-400:]}", hint=_HINTS.get(kind))
    return out


_HINTS = {
    "auth": "log in once with `docker login HOST:PORT` (credentials are read from the docker config only)",
    "transfer": "the connection to the registry was cut part-way (a proxy, a load balancer, a network fault?); "
                "rerun: the content was not found wrong",
    "unreachable": "is the registry running and reachable from this node? (a loopback registry is plain HTTP; "
                   f"another plain-HTTP one needs {INSECURE_ENV}=1)",
}


def inspect_raw(reg: Registry, ref: str, *, what: str) -> bytes:
    """The manifest bytes ``ref`` (``repo:tag`` or ``repo@digest``) names."""
    return skopeo(reg, "inspect", "--raw", f"docker://{ref}", what=what)


def inspect_config(reg: Registry, ref: str, *, what: str) -> dict:
    """The image config blob of ``ref``."""
    out = skopeo(reg, "inspect", "--config", "--raw", f"docker://{ref}", what=what)
    try:
        data = json.loads(out)
    except ValueError:
        raise RegistryError("corrupt", f"registry {reg}: {what}: the config is not JSON") from None
    if not isinstance(data, dict):
        raise RegistryError("corrupt", f"registry {reg}: {what}: the config is not a JSON object")
    return data


def copy(reg: Registry, src: str, dest: str, *, src_remote: bool, dest_remote: bool, what: str,
         digestfile: Path | None = None) -> None:
    """``skopeo copy --preserve-digests SRC DEST`` (blobs the destination has are not sent again)."""
    args = ["copy", "--preserve-digests", "--quiet"]
    if digestfile is not None:
        args += ["--digestfile", str(digestfile)]
    skopeo(reg, *args, src, dest, src=src_remote, dest=dest_remote, timeout=COPY_TIMEOUT_S, what=what)
