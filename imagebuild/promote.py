"""Promotion that never breaks the working image.

Tags of an image NAME (one repository per image, beside the stage images under
``imagebuild/NAME``):

    NAME:b-<build id>   the release image of one build (final stage + provenance); immutable
    NAME:candidate      the latest successful build, not yet gated
    NAME:local          what serving uses; moves ONLY to a candidate whose gate passed, i.e. for
                        which ``imagebuild.receipts.find_passing`` holds a passing receipt for
                        exactly that image identity
    NAME:previous       what ``:local`` was before the last promotion; ``imagebuild rollback``
                        swaps ``:local`` and ``:previous``

A failed build or gate never touches ``:local`` (it is only ever re-tagged here, after the
receipt check). Each tag move is one ``docker tag``: atomic in the engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from . import identity as identity_mod
from . import run as run_mod
from .errors import GateFailed, OperationFailed

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
    return all(importlib.util.find_spec(f"imagebuild.{m}") is not None for m in ("gate", "receipts"))


@dataclass(frozen=True)
class Promotion:
    image: str
    local: str  # the identity digest now at :local
    local_id: str | None
    previous_id: str | None  # what :local was (now :previous), None when there was nothing
    receipt: dict

    def as_dict(self) -> dict:
        return {"image": self.image, "local_identity": self.local, "local_id": self.local_id,
                "previous_id": self.previous_id, "receipt": self.receipt}


def promote(root: Path, image: str, candidate: str | None = None) -> Promotion:
    """Move ``image:local`` to ``candidate`` (default ``image:candidate``) if a passing gate receipt
    exists for exactly its identity; the old ``:local`` becomes ``:previous``."""
    from . import receipts

    candidate = candidate or ref(image, CANDIDATE)
    ident = identity_mod.inspect(candidate)
    receipt = receipts.find_passing(Path(root), ident.digest)
    if not receipt:
        raise GateFailed(f"{candidate} ({ident.digest}) has no passing gate receipt: :local stays where it is",
                         hint=f"imagebuild gate {image} (the receipt is tied to this exact image identity)")
    # the id from the very inspect the receipt was checked against: if :candidate moves meanwhile,
    # :local still goes to the image that passed
    cand_id = ident.local_id or image_id(candidate)
    old_id = image_id(ref(image, LOCAL))
    previous = None
    if old_id and old_id != cand_id:
        tag(old_id, ref(image, PREVIOUS))
        previous = old_id
    if old_id and old_id == cand_id:
        log.info("%s:local already is %s (identity %s)", image, candidate, ident.digest)
        return Promotion(image, ident.digest, cand_id, None, receipt)
    tag(cand_id or candidate, ref(image, LOCAL))
    log.info("promoted %s -> %s:local (identity %s)%s", candidate, image, ident.digest,
             f"; previous :local kept as {image}:previous" if previous else "")
    return Promotion(image, ident.digest, cand_id, previous, receipt)


def rollback(image: str) -> dict:
    """Swap ``image:local`` and ``image:previous``."""
    local_id = image_id(ref(image, LOCAL))
    prev_id = image_id(ref(image, PREVIOUS))
    if not prev_id:
        raise OperationFailed(f"{image}:previous does not exist: nothing to roll back to",
                              hint="a :previous exists after a second successful promotion")
    tag(prev_id, ref(image, LOCAL))
    if local_id:
        tag(local_id, ref(image, PREVIOUS))
    log.info("rolled back %s:local to %s%s", image, prev_id[:19],
             f" (the replaced one is now {image}:previous)" if local_id else "")
    return {"schema": "imagebuild.rollback", "version": 1, "image": image, "local_id": prev_id,
            "previous_id": local_id}
