"""Where built stages live: one OCI image layout per image, and a ref per stage key.

    <stages>/<image>/                 an OCI image layout (BuildKit's ``type=oci,tar=false`` output);
                                      <stages> is state.stages_dir(), shared by every clone
      oci-layout, index.json, blobs/sha256/...
      refs/<key-hex>.json             {"key", "stage", "manifest", "patches"}: written by imagebuild,
                                      atomically, only after the stage's build finished and every
                                      blob it names is there

Every stage is exported here by BuildKit, then its own layers' file times are clamped to its
``SOURCE_DATE_EPOCH`` (layerclamp.py: the same key gives the same bytes) before its ref is
written, and the next stage builds ``FROM`` it through a named build context
``oci-layout://<dir>@<manifest digest>``; only the release image is loaded into the engine.

A stage *exists* when its ref file names a manifest whose config and layer blobs are all in the
layout. BuildKit's own ``index.json`` is never trusted for that: an export that failed half-way
can leave a named entry there (the image store does the same), but never a ref file.

Nothing here talks to the engine; planning reads refs without side effects.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from imagebuild.core import fsutil, lazy, state
from imagebuild.core.fsutil import atomic_write_json

REF_SCHEMA = "imagebuild.stage-ref"
STAGE_KEY_LABEL = "io.imagebuild.stage-key"  # every stage carries the key it was built for (builder.py)
REF_VERSION = 1
log = lazy.logger()
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")


def layout_dir(root: Path | None, image: str) -> Path:
    return state.stages_dir() / image


def digest_hex(digest: str) -> str:
    """The hex part of a ``sha256:<hex>`` digest; ValueError for anything else (also used by localblobs)."""
    algo, _, h = digest.partition(":")
    if algo != "sha256" or len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return h


_hex = digest_hex


@dataclass(frozen=True)
class StageRef:
    key: str
    stage: str
    manifest: str  # sha256:<hex> of the OCI manifest in the layout
    patches: dict | None = None  # the stage's /opt/imagebuild/patches.json, for patching stages

    def as_dict(self) -> dict:
        return {"schema": REF_SCHEMA, "version": REF_VERSION, "key": self.key, "stage": self.stage,
                "manifest": self.manifest, "patches": self.patches}


class StageStore:
    """The OCI layout of one image's stages (see the module doc)."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)

    @classmethod
    def for_image(cls, root: Path, image: str) -> StageStore:
        return cls(layout_dir(root, image))

    # -- paths

    def blob(self, digest: str) -> Path:
        return self.dir / "blobs" / "sha256" / _hex(digest)

    def ref_path(self, key: str) -> Path:
        return self.dir / "refs" / f"{_hex(key)}.json"

    def context(self, manifest: str) -> str:
        """The ``--build-context`` value through which a build reads that stage."""
        return f"oci-layout://{self.dir}@{manifest}"

    # -- reading

    def read_json_blob(self, digest: str) -> dict | None:
        try:
            data = json.loads(fsutil.read_bytes(self.blob(digest)))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def manifest_blobs(self, manifest: str) -> list[str] | None:
        """The config and layer digests a manifest names (None when the manifest is not here)."""
        m = self.read_json_blob(manifest)
        if m is None or not isinstance(m.get("config"), dict):
            return None
        try:
            return [m["config"]["digest"], *[la["digest"] for la in m.get("layers") or []]]
        except (KeyError, TypeError):
            return None

    def complete(self, manifest: str) -> bool:
        """Whether the manifest and every blob it names are in the layout."""
        blobs = self.manifest_blobs(manifest)
        if blobs is None:
            return False
        try:
            return all(self.blob(d).is_file() for d in blobs)
        except ValueError:
            return False

    def lookup(self, key: str) -> StageRef | None:
        """The stage built for ``key``, or None (also when any of its blobs went missing)."""
        try:
            data = json.loads(fsutil.read_text(self.ref_path(key)))
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("schema") != REF_SCHEMA or data.get("key") != key:
            return None
        manifest = data.get("manifest")
        if not isinstance(manifest, str) or not self.complete(manifest):
            return None
        # the stage's own label says which key it was built for: a ref edited to point at another stage
        # (an older one) contradicts it, and is not taken
        labels = ((self.config(manifest) or {}).get("config") or {}).get("Labels") or {}
        built_for = labels.get(STAGE_KEY_LABEL) if isinstance(labels, dict) else None
        if built_for is not None and built_for != key:
            log.warning("warning: the stage store's ref %s names the manifest %s, which was built for another "
                        "key (%s): not used, built again", self.ref_path(key).name, manifest[:19], str(built_for)[:19])
            return None
        patches = data.get("patches")
        return StageRef(key, str(data.get("stage")), manifest, patches if isinstance(patches, dict) else None)

    def refs(self) -> list[StageRef]:
        out = []
        d = self.dir / "refs"
        if not d.is_dir():
            return out
        for p in sorted(d.glob("*.json")):
            try:
                data = json.loads(fsutil.read_text(p))
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and data.get("schema") == REF_SCHEMA and isinstance(data.get("manifest"), str):
                out.append(StageRef(str(data.get("key")), str(data.get("stage")), data["manifest"]))
        return out

    def config(self, manifest: str) -> dict | None:
        m = self.read_json_blob(manifest)
        digest = (m or {}).get("config", {}).get("digest")
        return self.read_json_blob(digest) if isinstance(digest, str) else None

    def diff_ids(self, manifest: str) -> list[str]:
        cfg = self.config(manifest) or {}
        return list((cfg.get("rootfs") or {}).get("diff_ids") or [])

    # -- writing (build only)

    def commit(self, key: str, stage: str, manifest: str, patches: dict | None = None) -> StageRef:
        """Record that ``key`` was built as ``manifest``: only once every blob is in the layout."""
        if not self.complete(manifest):
            raise ValueError(f"manifest {manifest} is not complete in {self.dir}")
        ref = StageRef(key, stage, manifest, patches)
        atomic_write_json(self.ref_path(key), ref.as_dict())
        return ref

    def forget(self, key: str) -> None:
        try:
            os.unlink(self.ref_path(key))
        except FileNotFoundError:
            pass
