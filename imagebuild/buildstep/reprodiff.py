"""Which files differ between two builds of one stage: the readable answer when a reproducibility
check fails.

Two builds of the same stage key must give the same manifest (docs/build.md, Reproducibility).
When they do not, this module reads the stage's own layers of both manifests from the stage store
(those after the parent's diff ids), member by member, and names every path whose header or
content differs, and how (``content``, ``mode``, ``mtime``, ``owner``, ``link``, ``type``, only in
one build). A plain tar-member comparison: no tool outside Python is needed, and it says *which
file*; ``diffoscope A B`` on two exported trees then says *how* the bytes differ.

No process is started here.
"""

from __future__ import annotations

import functools
import hashlib
import tarfile
from dataclasses import dataclass

from imagebuild.buildstep import layerclamp
from imagebuild.buildstep.stagestore import StageStore
from imagebuild.core.errors import OperationFailed


@dataclass(frozen=True)
class Member:
    type: str
    mode: int
    owner: tuple[int, int]
    mtime: int
    link: str
    size: int
    sha256: str  # of the data ("" for what has none)


@dataclass(frozen=True)
class Difference:
    layer: int  # index of the layer in the image (base first)
    path: str
    what: tuple[str, ...]  # "content", "mode", "owner", "mtime", "link", "type", "only in first", "only in second"

    def line(self) -> str:
        return f"{self.path}: {', '.join(self.what)} (layer {self.layer})"

    def as_dict(self) -> dict:
        return {"layer": self.layer, "path": self.path, "differs": list(self.what)}


def members(store: StageStore, desc: dict) -> dict[str, Member]:
    """Every member of one layer blob: path -> Member."""
    out: dict[str, Member] = {}
    path = store.blob(desc["digest"])
    try:
        with open(path, "rb") as f:
            stream = layerclamp._decompressed(f, str(desc.get("mediaType", "")))
            with tarfile.open(fileobj=stream, mode="r|") as tar:
                for ti in tar:
                    digest = ""
                    if ti.isreg():
                        h = hashlib.sha256()
                        data = tar.extractfile(ti)
                        if data is not None:
                            for chunk in iter(functools.partial(data.read, layerclamp.CHUNK), b""):
                                h.update(chunk)
                        digest = h.hexdigest()
                    out[ti.name.lstrip("./") or "."] = Member(
                        type=ti.type.decode("ascii", "replace") or "0", mode=ti.mode, owner=(ti.uid, ti.gid),
                        mtime=int(ti.mtime), link=ti.linkname, size=ti.size, sha256=digest)
    except (OSError, tarfile.TarError, layerclamp.TarError) as exc:
        raise OperationFailed(f"layer {desc['digest']} in {store.dir} cannot be read: {exc}",
                              hint="rebuild the stage") from None
    return out


def _what(a: Member, b: Member) -> tuple[str, ...]:
    out = []
    if a.type != b.type:
        out.append("type")
    if a.sha256 != b.sha256 or a.size != b.size:
        out.append("content")
    if a.mode != b.mode:
        out.append("mode")
    if a.owner != b.owner:
        out.append("owner")
    if a.mtime != b.mtime:
        out.append("mtime")
    if a.link != b.link:
        out.append("link")
    return tuple(out)


def _own_layers(store: StageStore, manifest: str, parent_layers: int) -> list[dict]:
    m = store.read_json_blob(manifest)
    if m is None:
        raise OperationFailed(f"manifest {manifest} is not in {store.dir}", hint="build the stage again")
    return [{**d, "index": i} for i, d in enumerate(m.get("layers") or []) if i >= parent_layers]


def diff(store: StageStore, first: str, second: str, parent_layers: int) -> list[Difference]:
    """Every path that differs between two manifests of one stage, in the stage's own layers (those
    after the first ``parent_layers``, which its parent gave: two builds whose parents differ are
    compared on what the stage itself wrote), layer by layer, in path order. Empty when the
    manifests are equal, or differ only by their parents' layers. A difference in what the stage
    set in its image config alone is given as ``<image config>``."""
    if first == second:
        return []
    a_layers = _own_layers(store, first, parent_layers)
    b_layers = _own_layers(store, second, parent_layers)
    out: list[Difference] = []
    if len(a_layers) != len(b_layers):
        out.append(Difference(-1, "<layers>", (f"{len(a_layers)} own layer(s) against {len(b_layers)}",)))
    for a, b in zip(a_layers, b_layers, strict=False):
        if a["digest"] == b["digest"]:
            continue
        ma, mb = members(store, a), members(store, b)
        for path in sorted(set(ma) | set(mb)):
            if path not in mb:
                out.append(Difference(a["index"], path, ("only in first",)))
            elif path not in ma:
                out.append(Difference(a["index"], path, ("only in second",)))
            else:
                what = _what(ma[path], mb[path])
                if what:
                    out.append(Difference(a["index"], path, what))
        if not out or out[-1].layer != a["index"]:  # same members, other bytes: their order
            out.append(Difference(a["index"], "<layer>", ("member order or tar headers",)))
    if not out and _config_without_parent(store, first, parent_layers) != _config_without_parent(
            store, second, parent_layers):
        out.append(Difference(-1, "<image config>", ("config",)))
    return out


def _config_without_parent(store: StageStore, manifest: str, parent_layers: int) -> dict:
    """The image config with the parent's diff ids and history taken out: what the stage itself set."""
    c = dict(store.config(manifest) or {})
    rootfs = dict(c.get("rootfs") or {})
    rootfs["diff_ids"] = list(rootfs.get("diff_ids") or [])[parent_layers:]
    c["rootfs"] = rootfs
    return c
