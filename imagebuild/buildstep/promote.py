"""Promotion that never breaks the working image.

Tags of an image NAME (one repository per image, beside the stage images under
``imagebuild/NAME``):

    NAME:b-<build id>   the release image of one build (final stage + provenance); immutable
    NAME:candidate      the latest successful build, not yet gated
    NAME:local          what serving uses; moves ONLY to a candidate for which
                        ``imagebuild.receipts.find_passing`` holds a passing receipt of the
                        definition's current gate spec for exactly that image identity, and
                        never when it already holds that identity
    NAME:previous       what ``:local`` was before the last promotion; ``imagebuild rollback``
                        swaps ``:local`` and ``:previous``

A failed build or gate never touches ``:local`` (it is only ever re-tagged here, after the
receipt check). Each tag move is one ``docker tag``: atomic in the engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from imagebuild.core import identity as identity_mod
from imagebuild.core import run as run_mod
from imagebuild.core.errors import GateFailed, OperationFailed

log = logging.getLogger("imagebuild")

CANDIDATE = "candidate"
LOCAL = "local"
PREVIOUS = "previous"


def ref(image: str, tag: str) -> str:
    return f"{image}:{tag}"


def build_tag(build_id: str) -> str:
    return f"b-{build_id}"


def image_id(reference: str) -> str | None:
    """The engine's id for ``reference``, or None when there is no such image."""
    proc = run_mod.run(["docker", "image", "inspect", "--format", "{{.Id}}", reference], check=False, timeout=60)
    if proc.returncode != 0:
        return None
    return proc.stdout.decode().strip() or None


def tag(source: str, target: str) -> None:
    run_mod.run(["docker", "tag", source, target], timeout=60, hint="is the Docker engine healthy?")


def tag_candidate(image: str, release_ref: str, build_id: str) -> list[str]:
    tags = [ref(image, build_tag(build_id)), ref(image, CANDIDATE)]
    for t in tags:
        tag(release_ref, t)
    return tags


def gate_available() -> bool:
    """Whether the gate (issue 6: imagebuild.receipts + imagebuild.gate) is installed."""
    import importlib.util

    # find_spec only: importing the gate pulls in pytest, which a no-op build must not pay for
    return all(importlib.util.find_spec(f"imagebuild.gate.{m}") is not None for m in ("runner", "receipts"))


@dataclass(frozen=True)
class Promotion:
    image: str
    local: str  # the identity digest now at :local
    local_id: str | None
    previous_id: str | None  # what :local was (now :previous), None when nothing moved there
    receipt: dict
    moved: bool = True  # False: :local already held this very image identity (nothing was touched)
    replaced_other: str | None = None  # the other checkout whose build :local held (and that promoted it)

    def as_dict(self) -> dict:
        return {"image": self.image, "local_identity": self.local, "local_id": self.local_id,
                "previous_id": self.previous_id, "moved": self.moved, "replaced_other": self.replaced_other,
                "receipt": {"identity": self.receipt.get("identity", {}).get("digest"),
                            "spec": self.receipt.get("spec"), "authority": self.receipt.get("authority"),
                            "result": self.receipt.get("result")}}


def current_spec(ctx, image: str):
    """The definition's gate spec file now (None: no definition or no spec)."""
    from imagebuild.core.context import of
    from imagebuild.definition import reader as defn_mod

    root = of(ctx).root
    if not (root / defn_mod.IMAGES_DIR / image / defn_mod.IMAGE_FILE).is_file():
        return None
    return defn_mod.load(root, image).gate


def current_spec_digest(ctx, image: str) -> str | None:
    """The digest of the definition's gate spec now (None: no definition or no spec)."""
    from imagebuild.definition import gatespec

    path = current_spec(ctx, image)
    return gatespec.digest(path) if path is not None else None


def untrusted_note(verdict) -> str:
    """`` (the receipt PATH is not trusted: WHY)`` for a receipt that is there but not believed."""
    return f"; the receipt {verdict.path} is not trusted: {verdict.reason}" if verdict.untrusted else ""


def _identity_or_none(reference: str) -> identity_mod.ImageIdentity | None:
    try:
        return identity_mod.inspect(reference)
    except OperationFailed:
        return None


def promote(ctx, image: str, candidate: str | None = None, *, spec_digest: str | None = None) -> Promotion:
    """Move ``image:local`` to ``candidate`` (default ``image:candidate``) if a passing receipt of the
    definition's current gate spec (``spec_digest``) exists for exactly its identity; the old
    ``:local`` becomes ``:previous``. When ``:local`` already holds that identity nothing moves,
    so ``:previous`` keeps the real previous image."""
    from imagebuild.definition import gatespec
    from imagebuild.gate import receipts

    candidate = candidate or ref(image, CANDIDATE)
    spec_path = current_spec(ctx, image)
    current = gatespec.digest(spec_path) if spec_path is not None else None
    spec_digest = spec_digest or current
    if spec_digest != current:
        spec_path = None  # a receipt of another spec than today's was asked for: its checks are unknown here
    if spec_digest is None:
        raise GateFailed(f"{image} has no gate spec: nothing can authorize a promotion of {candidate}",
                         hint="add a gate spec (docs/gate.md)")
    # the identity is computed from the candidate itself: the receipt must re-hash to it
    ident = identity_mod.inspect(candidate)
    verdict = receipts.check(ctx, ident.digest, spec_digest, spec=spec_path)
    receipt = verdict.data
    if not receipt:
        raise GateFailed(f"{candidate} ({ident.digest}) has no trusted passing receipt of {image}'s current gate "
                         f"spec ({spec_digest[:19]}){untrusted_note(verdict)}: :local stays where it is",
                         hint=f"imagebuild gate {image} (the receipt is tied to this exact image identity and spec; "
                         "runs with another --spec are ad hoc and never count)")
    # the id from the very inspect the receipt was checked against: if :candidate moves meanwhile,
    # :local still goes to the image that passed
    cand_id = ident.local_id or image_id(candidate)
    try:
        local_data = identity_mod.inspect_data(ref(image, LOCAL))
    except OperationFailed:
        local_data = None
    local = identity_mod.from_inspect(local_data) if local_data is not None else None
    if local is not None and local.digest == ident.digest:
        log.info("%s:local already is identity %s: nothing moves (:previous stays)", image, ident.digest)
        return Promotion(image, ident.digest, local.local_id, None, receipt, moved=False)
    other = _promoted_elsewhere(ctx, image, local_data) if local_data is not None else None
    if other is not None:  # the engine's :local is shared by every checkout on this node
        log.warning("warning: %s:local holds build %s of another checkout (%s), which promoted it; this promotion "
                    "replaces it (kept as %s:previous: imagebuild rollback %s brings it back)",
                    image, other[1], other[0], image, image)
    previous = None
    if local is not None and local.local_id:
        tag(local.local_id, ref(image, PREVIOUS))
        previous = local.local_id
    tag(cand_id or candidate, ref(image, LOCAL))
    log.info("promoted %s -> %s:local (identity %s)%s", candidate, image, ident.digest,
             f"; previous :local kept as {image}:previous" if previous else "")
    return Promotion(image, ident.digest, cand_id, previous, receipt,
                     replaced_other=other[0] if other is not None else None)


def _promoted_elsewhere(ctx, image: str, local_data: dict) -> tuple[str, str] | None:
    """(checkout root, build id) when ``:local`` holds a build that another live checkout claims in the
    shared stage store (buildstep/owners.py) and this one does not: that checkout promoted it. None when
    this checkout made it too (the same content: the same build id), or nobody claims it."""
    from imagebuild.buildstep import owners
    from imagebuild.buildstep.stagestore import StageStore
    from imagebuild.core.context import maybe

    c = maybe(ctx)
    labels = ((local_data.get("Config") or {}).get("Labels")) or {}
    build_id = labels.get("io.imagebuild.build-id")
    if c is None or not build_id:
        return None
    store = StageStore.for_image(c.root, image).dir
    mine = owners.read(owners.owner_path(store, c.root))
    if mine is not None and build_id in mine.builds:
        return None
    theirs = [cl for cl in owners.others(store, c.root) if build_id in cl.builds]
    return (theirs[0].root, build_id) if theirs else None


def rollback(image: str, ctx=None, *, dry_run: bool = False) -> dict:
    """Swap ``image:local`` and ``image:previous``; warn when the image that becomes ``:local``
    has no passing receipt of the definition's current gate spec. ``dry_run``: the same checks and
    document, no tag moved. With ``ctx`` (and not ``dry_run``), under the image's build lock
    (GuardRefused, exit 3, while a build or gc of it runs): a build that promotes meanwhile would
    move ``:local`` over the rollback without a word."""
    if ctx is None or dry_run:
        return _rollback(image, ctx, dry_run=dry_run)
    from imagebuild.buildstep import guards

    lk = guards.BuildLock.held(ctx.engine.id, image, f"imagebuild rollback {image}")
    try:
        return _rollback(image, ctx, dry_run=False)
    finally:
        lk.release()


def _rollback(image: str, ctx, *, dry_run: bool) -> dict:
    from imagebuild.gate import receipts

    local_id = image_id(ref(image, LOCAL))
    prev_id = image_id(ref(image, PREVIOUS))
    if not prev_id:
        raise OperationFailed(f"{image}:previous does not exist: nothing to roll back to",
                              hint="a :previous exists after a second successful promotion")
    warning = None
    if ctx is not None:
        spec = current_spec_digest(ctx, image)
        prev = _identity_or_none(prev_id)
        if spec is not None and prev is not None and \
                not receipts.find_passing(ctx, prev.digest, spec, spec=current_spec(ctx, image)):
            warning = (f"{image}:previous ({prev.digest}) has no passing receipt of the current gate spec "
                       f"({spec[:19]}): it passed an older gate or none; rolling back anyway "
                       f"(imagebuild gate {image} --ref {image}:local checks it)")
            log.warning("warning: %s", warning)
    if not dry_run:
        tag(prev_id, ref(image, LOCAL))
        if local_id:
            tag(local_id, ref(image, PREVIOUS))
        log.info("rolled back %s:local to %s%s", image, prev_id[:19],
                 f" (the replaced one is now {image}:previous)" if local_id else "")
    return {"schema": "imagebuild.rollback", "version": 1, "image": image, "local_id": prev_id,
            "previous_id": local_id, "warning": warning, "dry_run": dry_run}
