"""An image's identity that does not depend on the local image store.

The local image id differs between Docker's classic store (id = config digest) and the
containerd store (id = manifest digest), and between nodes whose engines use different stores.
What stays the same for the same image everywhere is its content: the uncompressed layer
digests (``RootFS.Layers``, the diff ids) and its runtime config. The identity digest is the
SHA-256 of a canonical JSON document holding exactly those, so gate receipts, promotion and
sync can say "this very image" on any node.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from imagebuild.core import run as run_mod
from imagebuild.core.errors import OperationFailed
from imagebuild.core.fsutil import canonical_json, sha256_bytes

IDENTITY_VERSION = 1
# The parts of the image config that change what a container does.
CONFIG_FIELDS = ("Entrypoint", "Cmd", "Env", "User", "WorkingDir", "Labels", "ExposedPorts", "Volumes",
                 "StopSignal")


@dataclass(frozen=True)
class ImageIdentity:
    digest: str  # "sha256:<hex>" over the document below
    os: str
    architecture: str
    variant: str | None
    layers: tuple[str, ...]  # diff ids, base first
    config: dict
    local_id: str | None = None  # informational only: the engine's own id for the image

    def document(self) -> dict:
        return {"imagebuild-identity": IDENTITY_VERSION, "os": self.os, "architecture": self.architecture,
                "variant": self.variant, "layers": list(self.layers), "config": self.config}

    def as_dict(self) -> dict:
        return {"digest": self.digest, **self.document(), "local_id": self.local_id}


def from_inspect(data: dict) -> ImageIdentity:
    """Identity from one ``docker image inspect`` object."""
    cfg = data.get("Config") or {}
    config = {k: _norm(cfg.get(k)) for k in CONFIG_FIELDS}
    layers = tuple((data.get("RootFS") or {}).get("Layers") or [])
    doc = {"imagebuild-identity": IDENTITY_VERSION, "os": data.get("Os", ""),
           "architecture": data.get("Architecture", ""), "variant": data.get("Variant") or None,
           "layers": list(layers), "config": config}
    return ImageIdentity("sha256:" + sha256_bytes(canonical_json(doc)), doc["os"], doc["architecture"],
                         doc["variant"], layers, config, data.get("Id"))


def _norm(value):
    # null and empty mean the same to a container; make them hash the same
    if value in (None, "", [], {}):
        return None
    return value


def inspect(ref: str, *, docker: list[str] | None = None) -> ImageIdentity:
    """Identity of ``ref`` in the engine that ``docker`` (default ``["docker"]``) talks to.

    ``docker`` may be a remote command prefix, e.g. ``["ssh", "dgx4", "docker"]``.
    """
    return from_inspect(inspect_data(ref, docker=docker))


def inspect_data(ref: str, *, docker: list[str] | None = None, hint: str | None = None) -> dict:
    """The ``docker image inspect`` object of ``ref``; a clear error when the image is not there."""
    argv = [*(docker or ["docker"]), "image", "inspect", ref]
    proc = run_mod.run(argv, check=False, timeout=60)
    text = proc.stdout.decode("utf-8", "replace")
    if proc.returncode != 0:
        raise OperationFailed(f"image {ref!r} not found in the engine",
                              hint=hint or "docker image ls; build it first (imagebuild build)")
    try:
        (data,) = json.loads(text[text.index("["):])
    except (ValueError, json.JSONDecodeError):
        raise OperationFailed(f"unexpected output of docker image inspect {ref}") from None
    return data
