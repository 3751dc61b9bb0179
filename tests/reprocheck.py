"""Compare two build records of one image: the same identity, or the files that differ, by stage.

Used by the tests that build a definition twice with --no-cache (tests/integration/buildstep/
test_reproducible.py, the smoke lane): a new source of non-determinism fails with the paths that
differ (imagebuild/buildstep/reprodiff.py), not with two digests.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from imagebuild.buildstep import reprodiff
from imagebuild.buildstep.stagestore import StageStore


def base_layers(base: str) -> int:
    """How many layers the local image ``base`` (the first stage's parent) has."""
    out = subprocess.run(["docker", "image", "inspect", "--format", "{{json .RootFS.Layers}}", base],
                         capture_output=True, text=True, check=True).stdout
    return len(json.loads(out))


def differences(first: dict, second: dict, *, root: Path, image: str) -> str:
    """'' when both records' stages have the same manifests; else, for each stage that differs,
    every path that does in the stage's own layers (reprodiff). Both builds' blobs must be in the
    second's stage store (clones on one host share it)."""
    from imagebuild.definition import reader as definition
    from imagebuild.plan import planner as plan_mod

    plan = plan_mod.make_plan(definition.load(root, image))
    store = StageStore(Path(second["stage_store"]))
    manifests = {s["name"]: s["manifest"] for s in first["stages"]}
    lines = []
    for a, b in zip(first["stages"], second["stages"], strict=True):
        if a["manifest"] == b["manifest"]:
            continue
        st = plan.stage(a["name"])
        n = len(store.diff_ids(manifests[st.parent])) if st.parent_kind == "stage" else base_layers(st.parent_ref)
        diffs = reprodiff.diff(store, a["manifest"], b["manifest"], n)
        if not diffs:
            lines.append(f"stage {a['name']}: {a['manifest']} != {b['manifest']}: its own layers are the same, "
                         "only its parent differs")
            continue
        lines.append(f"stage {a['name']}: {a['manifest']} != {b['manifest']}, {len(diffs)} path(s) differ:")
        lines += [f"  {d.line()}" for d in diffs[:60]]
    return "\n".join(lines)
