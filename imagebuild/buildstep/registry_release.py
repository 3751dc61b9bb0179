"""Release tags in the shared registry (docs/fleet.md, "Release tags"):

    <registry>/<image>:b-<build id>    the gated release of one build: immutable (never moved, never
                                       overwritten with another image)
    <registry>/<image>:local           the fleet's current image: moves only to a gated release
    <registry>/<image>:previous        what :local was before it last moved

``publish`` runs after the build's gate passed and ``:local`` moved here (or already held that
image): the engine pushes the release under ``b-<build id>`` (``docker push``: blobs the registry
holds, the stage layers among them, are not sent again), then ``:previous`` and ``:local`` move with
``skopeo copy`` of the manifest by digest (no blob moves). ``rollback`` swaps ``:local`` and
``:previous`` the same way. Nothing is pushed for a build whose gate did not pass or did not run.
"""

from __future__ import annotations

import hashlib
import logging
import re

from imagebuild.buildstep import promote as promote_mod
from imagebuild.core import identity as identity_mod
from imagebuild.core import registry as reg_mod
from imagebuild.core import run as run_mod
from imagebuild.core.errors import GuardRefused, OperationFailed

log = logging.getLogger("imagebuild")

PUSH_TIMEOUT_S = 6 * 3600
_DIGEST_RE = re.compile(r"digest: (sha256:[0-9a-f]{64})")


def identity_of_config(cfg: dict) -> str:
    """The store-independent identity (identity.py) of an image from its OCI config blob."""
    c = cfg.get("config") or {}
    data = {"Os": cfg.get("os", ""), "Architecture": cfg.get("architecture", ""), "Variant": cfg.get("variant"),
            "Config": {k: c.get(k) for k in identity_mod.CONFIG_FIELDS},
            "RootFS": {"Layers": list((cfg.get("rootfs") or {}).get("diff_ids") or [])}}
    return identity_mod.from_inspect(data).digest


def _manifest_digest(reg: reg_mod.Registry, ref: str, what: str) -> str | None:
    try:
        raw = reg_mod.inspect_raw(reg, ref, what=what)
    except reg_mod.RegistryError as exc:
        if exc.kind == "missing":
            return None
        raise
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def _identity_at(reg: reg_mod.Registry, ref: str, what: str) -> str:
    return identity_of_config(reg_mod.inspect_config(reg, ref, what=what))


def _move(reg: reg_mod.Registry, image: str, digest: str, tag: str) -> None:
    reg_mod.copy(reg, f"docker://{reg.at(image, digest)}", f"docker://{reg.ref(image, tag)}", src_remote=True,
                 dest_remote=True, what=f"moving {image}:{tag} to {digest[:19]}")


def push_release(reg: reg_mod.Registry, image: str, image_id: str, build_id: str, identity: str) -> dict:
    """``b-<build id>`` in the registry, holding exactly ``identity`` (pushed by the engine when missing)."""
    return push_image(reg, image, image_id, promote_mod.build_tag(build_id), identity,
                      hint="the same build id gave another image: is a stage not reproducible? "
                      "(imagebuild build --no-cache on both nodes, and compare)")


def push_image(reg: reg_mod.Registry, image: str, image_id: str, tag: str, identity: str, *,
               hint: str | None = None) -> dict:
    """The immutable ``tag`` of ``image`` in the registry, holding exactly ``identity``: pushed from the
    engine's ``image_id`` (an id or a ref) when missing; another identity already there refuses (exit 3)."""
    ref = reg.ref(image, tag)
    have = _manifest_digest(reg, ref, f"looking up {image}:{tag}")
    if have is not None:
        got = _identity_at(reg, reg.at(image, have), f"reading {image}:{tag}")
        if got != identity:
            raise GuardRefused(f"registry {reg}: {image}:{tag} already holds identity {got}, this image is "
                               f"{identity}: an immutable tag is never moved; :local and :previous stay there",
                               hint=hint)
        return {"tag": tag, "digest": have, "pushed": False}
    promote_mod.tag(image_id, ref)
    try:
        proc = run_mod.run(["docker", "push", ref], timeout=PUSH_TIMEOUT_S, check=False)
        out = reg_mod.scrub(proc.stdout.decode("utf-8", "replace"))
        if proc.returncode != 0:
            last = [ln for ln in out.splitlines() if ln.strip()][-1:] or ["no output"]
            raise OperationFailed(f"registry {reg}: docker push {image}:{tag} failed: {last[0][-400:]}",
                                  hint=reg_mod._HINTS.get(reg_mod._kind(out)))
    finally:
        run_mod.run(["docker", "image", "rm", ref], check=False, timeout=120)  # our registry-named tag only
    m = _DIGEST_RE.search(out)
    digest = m.group(1) if m else _manifest_digest(reg, ref, f"reading {image}:{tag}")
    if digest is None:
        raise OperationFailed(f"registry {reg}: {image}:{tag} is not there after docker push")
    got = _identity_at(reg, reg.at(image, digest), f"reading {image}:{tag}")
    if got != identity:
        raise OperationFailed(f"registry {reg}: {image}:{tag} holds identity {got} after the push, expected {identity}")
    return {"tag": tag, "digest": digest, "pushed": True}


def publish(reg: reg_mod.Registry, image: str, release: dict, build_id: str) -> dict:
    """Push the gated release and move :local (the old one becomes :previous). The record's ``publish``."""
    b = push_release(reg, image, release["image_id"] or promote_mod.ref(image, promote_mod.CANDIDATE), build_id,
                     release["identity"])
    local = _manifest_digest(reg, reg.ref(image, promote_mod.LOCAL), f"looking up {image}:local")
    doc = {"registry": str(reg), "repository": reg.repo(image), "release": b, "local": b["digest"],
           "previous": None, "moved": False}
    if local == b["digest"]:
        log.info("registry %s: %s:local already is %s", reg, image, b["digest"][:19])
        return doc
    if local is not None:
        _move(reg, image, local, promote_mod.PREVIOUS)
        doc["previous"] = local
    _move(reg, image, b["digest"], promote_mod.LOCAL)
    doc["moved"] = True
    log.info("registry %s: %s:local -> %s (b-%s)%s", reg, image, b["digest"][:19], build_id,
             f"; {image}:previous -> {local[:19]}" if local else "")
    return doc


def rollback(reg: reg_mod.Registry, image: str, ctx=None, *, dry_run: bool = False) -> dict:
    """Swap :local and :previous in the registry; warn when the image that becomes :local has no
    passing receipt (here) of the definition's current gate spec. ``dry_run``: look up, move nothing."""
    from imagebuild.gate import receipts

    local = _manifest_digest(reg, reg.ref(image, promote_mod.LOCAL), f"looking up {image}:local")
    prev = _manifest_digest(reg, reg.ref(image, promote_mod.PREVIOUS), f"looking up {image}:previous")
    if prev is None:
        raise OperationFailed(f"registry {reg}: {image}:previous does not exist: nothing to roll back to",
                              hint="a :previous exists there after a second gated release was published")
    warning = None
    ident = _identity_at(reg, reg.at(image, prev), f"reading {image}:previous")
    if ctx is not None:
        spec = promote_mod.current_spec_digest(ctx, image)
        if spec is not None and not receipts.find_passing(ctx, ident, spec, spec=promote_mod.current_spec(ctx, image)):
            warning = (f"registry {reg}: {image}:previous ({ident}) has no passing receipt here of the current gate "
                       f"spec ({spec[:19]}); rolling back anyway")
            log.warning("warning: %s", warning)
    if not dry_run:
        _move(reg, image, prev, promote_mod.LOCAL)
        if local is not None:
            _move(reg, image, local, promote_mod.PREVIOUS)
        log.info("registry %s: rolled back %s:local to %s%s", reg, image, prev[:19],
                 f" (the replaced one is now {image}:previous)" if local else "")
    return {"schema": "imagebuild.rollback", "version": 1, "image": image, "registry": str(reg),
            "local_digest": prev, "local_identity": ident, "previous_digest": local, "warning": warning,
            "dry_run": dry_run}
