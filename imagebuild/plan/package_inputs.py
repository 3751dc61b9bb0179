"""The part of a stage's cache key that comes from the packages it installs (docs/image-definition.md,
"Python wheels, apt packages and base images"): what decides a download, and the digest of the files
the lock holds for exactly those inputs. Pure: it reads the definition and the lock, nothing else.

The plan reads this; prefetch (``fetch/packages.py``) downloads what it describes and checks the
files against it before a build uses them.
"""

from __future__ import annotations

from pathlib import Path

from imagebuild.core import lock as lock_mod
from imagebuild.core import state
from imagebuild.core.fsutil import canonical_json, sha256_bytes
from imagebuild.definition import reader as d

FORMAT = 2  # raise when the layout of wheels/ or apt/ changes (part of every inputs digest); 2: a wheel a
# stage above installs is no longer copied into the folder of the stage below (lock: from_stage)


def _digest(doc: dict) -> str:
    return sha256_bytes(canonical_json(doc))


def root_image(defn: d.Definition, stage: d.Stage) -> d.ImageRef:
    """The base image at the bottom of ``stage``'s parent chain."""
    st = stage
    while st.parent.kind == "stage":
        st = defn.stage(st.parent.name)
    return defn.images[st.parent.name]


def _read_lock(defn: d.Definition) -> dict:
    return lock_mod.read(defn.dir, d.display_path(defn.root, lock_mod.lock_path(defn.dir))) or {}


def wheels_dir(defn: d.Definition, stage: str) -> Path:
    return state.deps_dir(defn.root, defn.name) / "wheels" / stage


def apt_dir(defn: d.Definition, stage: str) -> Path:
    return state.deps_dir(defn.root, defn.name) / "apt" / stage




def wheel_inputs(defn: d.Definition, stage: d.Stage) -> dict:
    req = stage.requirements
    py = defn.python
    index = req.index or py.index
    extras = req.extra_indexes if req.extra_indexes is not None else py.extra_indexes
    return {"format": FORMAT, "requirements_sha256": req.sha256, "python": py.version, "glibc": py.glibc,
            "platform": defn.platform, "index_url": index.shown,
            "extra_index_urls": [i.shown for i in extras]}


def apt_inputs(defn: d.Definition, stage: d.Stage) -> dict:
    return {"format": FORMAT, "list_sha256": stage.apt.sha256, "base": root_image(defn, stage).value,
            "platform": defn.platform, "snapshot": defn.apt_snapshot}


def _locked_digest(entry: dict | None, inputs_sha: str) -> str | None:
    if not entry or entry.get("inputs_sha256") != inputs_sha:
        return None
    return _digest({"files": [(f["filename"], f["sha256"]) for f in entry.get("files", [])]})


def lock_for_plan(defn: d.Definition) -> dict:
    """The lock's package sections (read-only; {} when there is no lock)."""
    data = _read_lock(defn)
    return {"wheels": data.get("wheels") or {}, "apt": data.get("apt") or {}}


def stage_key_inputs(defn: d.Definition, stage: d.Stage, locked: dict | None = None) -> dict:
    """The part of ``stage``'s cache key that comes from the packages it installs.

    The digest of what decides the download (the requirements or apt file, Python target,
    indexes, base image, snapshot) and, once prefetched for exactly those inputs, the digest of
    the locked files. Empty for a stage that installs no packages (its key is unchanged).
    """
    locked = locked if locked is not None else lock_for_plan(defn)
    out: dict = {}
    if stage.requirements is not None and defn.python is not None:
        ins = _digest(wheel_inputs(defn, stage))
        out["wheels"] = {"inputs": ins,
                         "locked": _locked_digest(locked.get("wheels", {}).get(stage.name), ins)}
    if stage.apt is not None:
        ins = _digest(apt_inputs(defn, stage))
        out["apt"] = {"inputs": ins,
                      "locked": _locked_digest(locked.get("apt", {}).get(stage.name), ins)}
    return out
