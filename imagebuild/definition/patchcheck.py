"""``patch --check`` and prefetch's patch check: a patch set applied twice, in another process, to a
scratch tree (docs/patches.md). Nothing of a patch runs in imagebuild's own process."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from imagebuild.core import fsutil
from imagebuild.core import run as run_mod
from imagebuild.core.errors import OperationFailed
from imagebuild.definition import patching


def check(paths: list, src: Path, *, copy: bool = True) -> list:
    """The patches run in another process on a scratch copy of ``src`` (never imported into this one:
    a patch module's import-time code runs only there), applied twice; a patch the second run still
    changes is not idempotent and fails. Outcomes as a check reports them (``would-apply``).
    ``copy=False``: ``src`` is a scratch tree already, and is used (and changed) as it is."""
    with tempfile.TemporaryDirectory(prefix="imagebuild-patch-check-") as tmp:
        scratch = Path(tmp) / "src"
        if copy:
            shutil.copytree(src, scratch, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        else:
            scratch = Path(src)
        runs = []
        for i in (1, 2):
            record = Path(tmp) / f"run{i}.json"
            run_mod.run([sys.executable, patching.__file__, "apply", "--src", str(scratch), "--keep-going",
                         "--record", str(record), *map(str, paths)], check=False, timeout=600,
                        cwd=scratch)  # what a patch does at import, relative to where it runs, stays there
            try:
                runs.append(json.loads(fsutil.read_text(record))["patches"])
            except (OSError, ValueError, KeyError):
                raise OperationFailed("the patch check in a scratch copy recorded nothing",
                                      hint="run it with --debug to see the patch run") from None
    out = []
    for p in map(Path, paths):
        first, second = runs[0].get(p.name), runs[1].get(p.name)
        if first is None:
            out.append(patching.PatchOutcome(p.name, patching.FAILED, [], "the patch did not run"))
            continue
        outcome, message = first["outcome"], first.get("message") or ""
        if outcome == patching.APPLIED:
            outcome = patching.WOULD_APPLY
            if second is not None and second["outcome"] not in (patching.ALREADY, patching.NOT_NEEDED):
                outcome = patching.FAILED
                message = (f"patch {p.name}: not idempotent: applied once, a second run gave "
                           f"{second['outcome']!r} ({(second.get('message') or '').splitlines()[0][:160]})")
        edits = [patching.EditOutcome(e["file"], patching.WOULD_APPLY if e["outcome"] == patching.APPLIED
                                      else e["outcome"], e.get("message") or "") for e in first.get("edits") or []]
        out.append(patching.PatchOutcome(p.name, outcome, edits, message, first.get("sha256")))
    return out
