"""The idempotent anchor-patch primitive. Standard library only.

This file is shipped unchanged into the build context of every stage that declares patches
(as ``patches/imagebuild_patching.py``) and is what every ``patch_*.py`` imports::

    from imagebuild_patching import Edit

    EDITS = [
        Edit(
            file="greeting/core.py",                      # relative to the source tree
            anchor='    return "hello"\\n',                 # must occur exactly once
            replacement='    return "hello, world"  # imagebuild-patch: greeting-world\\n',
            marker="imagebuild-patch: greeting-world",     # present => already applied
            upstream=['return "hello, world"'],            # present => upstream has it: not needed
            applies_if=['def greet('],                     # none present => the code is not there
            alternatives=[(anchor2, replacement2)],          # other shapes, tried when anchor is absent
            reason="say hello to the world",
        ),
    ]
    REQUIRED = False                                       # True: "not applicable" fails instead

A patch is ``not-applicable`` (and writes nothing) when the code it repairs is not in the tree:
one of its files is absent, or an edit's file holds none of its ``applies_if`` strings (and
neither its marker nor an ``upstream`` string). A patch that sets ``REQUIRED = True`` fails
instead. Otherwise, for each edit, in this order: the marker is in the file ->
``already-applied``; one of the ``upstream`` strings is in the file -> ``not-needed`` (with a
message); the anchor occurs exactly once -> replaced (``applied``); anything else -> ``failed``,
naming the patch, the file and the anchor, and, when the anchor's first line is still in the
file, where (``file:line``) and which of its lines differs. A shape that is there but different
fails: ``applies_if`` only says whether the code is there at all. A ``.py`` result is re-parsed
with ``ast`` before it is written. A patch is all-or-nothing: its files are written only when
every edit of the patch succeeded. Running a patch set twice changes nothing (the second run
reports ``already-applied``).

Command line (used inside the image and by ``imagebuild patch``)::

    python3 imagebuild_patching.py apply --src DIR [--record FILE] [--check] PATCH_OR_DIR...

``--record`` merges the outcomes into a JSON file (``schema: imagebuild.patches``), by default
nothing is recorded. Exit 0 when every patch is applied / already applied / not needed / not
applicable (``--check``: or would apply), 1 when one failed, 2 on bad usage. Applying stops at
the first failure; ``--check`` checks every patch.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

RECORD_SCHEMA = "imagebuild.patches"
RECORD_VERSION = 1
MODULE_NAME = "imagebuild_patching"  # the name patch scripts import this file by

APPLIED = "applied"
ALREADY = "already-applied"
NOT_NEEDED = "not-needed"
WOULD_APPLY = "would-apply"
NOT_APPLICABLE = "not-applicable"
FAILED = "failed"
OK_OUTCOMES = (APPLIED, ALREADY, NOT_NEEDED, WOULD_APPLY, NOT_APPLICABLE)


class PatchError(Exception):
    """A patch could not be applied; the message names the patch, the file and the anchor."""


@dataclass(frozen=True)
class Edit:
    file: str
    anchor: str
    replacement: str
    marker: str
    upstream: list = field(default_factory=list)
    reason: str = ""
    applies_if: list = field(default_factory=list)  # strings of the code this edit repairs (see the module doc)
    # other shapes of the same code: (anchor, replacement) pairs, tried in order when ``anchor`` is absent
    alternatives: list = field(default_factory=list)

    def check(self, patch: str) -> None:
        if not self.anchor:
            raise PatchError(f"{patch}: edit of {self.file}: empty anchor")
        for alt in self.alternatives:
            if (not isinstance(alt, (tuple, list)) or len(alt) != 2 or not all(isinstance(x, str) and x for x in alt)
                    or self.marker not in alt[1] or self.marker in alt[0]):
                raise PatchError(f"{patch}: edit of {self.file}: each alternative is (anchor, replacement), the "
                                 f"replacement holding the marker {self.marker!r} and the anchor not")
        if not self.marker or self.marker not in self.replacement:
            raise PatchError(f"{patch}: edit of {self.file}: the replacement must contain the marker "
                             f"{self.marker!r} (that is how a second run knows it was applied)")
        if self.marker in self.anchor:
            raise PatchError(f"{patch}: edit of {self.file}: the anchor must not contain the marker")
        p = Path(self.file)
        if p.is_absolute() or ".." in p.parts:
            raise PatchError(f"{patch}: file {self.file!r} must be relative to the source tree, without '..'")


@dataclass
class EditOutcome:
    file: str
    outcome: str
    message: str

    def as_dict(self) -> dict:
        return {"file": self.file, "outcome": self.outcome, "message": self.message}


@dataclass
class PatchOutcome:
    patch: str
    outcome: str
    edits: list
    message: str = ""
    sha256: str | None = None  # of the patch script that ran (provenance: which script made the change)

    def as_dict(self) -> dict:
        return {"patch": self.patch, "outcome": self.outcome, "message": self.message,
                "sha256": self.sha256, "edits": [e.as_dict() for e in self.edits]}


def _short(text: str, n: int = 160) -> str:
    """``text`` as ``repr`` shows it: whitespace visible (``'\\t'``, ``'\\n'``, trailing blanks), cut at ``n``."""
    return repr(text) if len(text) <= n else repr(text[:n]) + "..."


def _near(anchor: str, text: str, file: str = "") -> str:
    """Where the anchor's first line still is (``file:line``) and the first of its lines that differs
    there (whitespace shown), to point at the drift."""
    want = anchor.split("\n")
    start = next((i for i, ln in enumerate(want) if ln.strip()), None)
    if start is None:
        return ""
    want = want[start:]
    if want and want[-1] == "":
        want = want[:-1]
    lines = text.split("\n")
    best = None  # (lines matching, line number)
    for n, line in enumerate(lines):
        if line.strip() != want[0].strip():
            continue
        k = 0
        while k < len(want) and n + k < len(lines) and lines[n + k] == want[k]:
            k += 1
        if best is None or k > best[0]:
            best = (k, n)
    if best is None:
        return ""
    k, n = best
    where = f"{file}:{n + 1}" if file else f"line {n + 1}"
    if k == 0:
        return f" (closest match: {where} has {lines[n]!r}, the anchor's first line is {want[0]!r})"
    got = lines[n + k] if n + k < len(lines) else "(end of file)"
    differs = f"{file}:{n + k + 1}" if file else f"line {n + k + 1}"
    return (f" (closest match: {where}, where its first {k} line(s) match; {differs} has {got!r} where the "
            f"anchor has {want[k]!r})")


def plan_edit(patch: str, edit: Edit, text: str) -> tuple[EditOutcome, str]:
    """(outcome, new text) for one edit on ``text``; raises PatchError when it cannot apply."""
    if edit.marker in text:
        return EditOutcome(edit.file, ALREADY, f"marker {edit.marker!r} present"), text
    for eq in edit.upstream or ():
        if eq and eq in text:
            return EditOutcome(edit.file, NOT_NEEDED,
                               f"upstream already has the change (found {_short(eq)})"), text
    count = text.count(edit.anchor)
    anchor, replacement = edit.anchor, edit.replacement
    if count == 0:  # another shape of the same code this edit knows
        for alt_anchor, alt_replacement in edit.alternatives:
            if text.count(alt_anchor) == 1:
                count, anchor, replacement = 1, alt_anchor, alt_replacement
                break
    if count != 1:
        found = "not found" + _near(edit.anchor, text, edit.file) if count == 0 else \
            f"found {count} times (must be exactly once)"
        if count == 0 and edit.alternatives:
            found += f" (nor any of its {len(edit.alternatives)} other shape(s))"
        raise PatchError(f"patch {patch}: file {edit.file}: anchor {_short(edit.anchor)} {found}; "
                         f"no marker {edit.marker!r} and no recognised upstream equivalent either "
                         "-- upstream moved: update the patch's anchor (imagebuild patch IMAGE --src DIR --check)")
    new = text.replace(anchor, replacement, 1)
    if edit.file.endswith(".py"):
        try:
            ast.parse(new, filename=edit.file)
        except SyntaxError as exc:
            raise PatchError(f"patch {patch}: file {edit.file}: the patched file does not parse "
                             f"(line {exc.lineno}: {exc.msg}); anchor {_short(edit.anchor)}") from None
    shape = "" if anchor == edit.anchor else " (another shape of the code)"
    return EditOutcome(edit.file, APPLIED, (edit.reason or "anchor replaced") + shape), new


def _not_applicable(edit: Edit, text: str | None) -> str | None:
    """Why ``edit`` is not applicable to ``text`` (None: the file is absent), or None when it is."""
    if text is None:
        return f"{edit.file} is not in the tree"
    if edit.marker in text or any(eq and eq in text for eq in edit.upstream or ()):
        return None
    if edit.applies_if and not any(s in text for s in edit.applies_if):
        shown = ", ".join(_short(s, 60) for s in edit.applies_if)
        return f"{edit.file} has none of {shown}: the code this patch repairs is not there"
    return None


def apply_edits(patch: str, edits: list, src: Path, *, write: bool = True,
                overlay: dict | None = None, required: bool = False) -> PatchOutcome:
    """Apply one patch's edits to the tree ``src``: all or nothing.

    ``overlay`` (file -> text), for a check that writes nothing: files are read from it first, and a
    patch that would apply leaves its result there, so the next patch sees the tree as the build would.
    ``required``: a patch that is not applicable fails (the patch script's ``REQUIRED = True``).
    """
    texts: dict[str, str] = {}
    originals: dict[str, str] = {}
    outcomes: list[EditOutcome] = []
    try:
        if not edits:
            raise PatchError(f"patch {patch}: no edits (define EDITS = [Edit(...), ...])")
        for edit in edits:
            if not isinstance(edit, Edit):
                raise PatchError(f"patch {patch}: EDITS must hold Edit(...) objects, got {type(edit).__name__}")
            edit.check(patch)
        absent: list[tuple[Edit, str]] = []
        for edit in edits:
            if edit.file not in texts and overlay is not None and edit.file in overlay:
                texts[edit.file] = originals[edit.file] = overlay[edit.file]
            if edit.file not in texts:
                path = src / edit.file
                try:
                    texts[edit.file] = originals[edit.file] = path.read_text(encoding="utf-8")
                except (FileNotFoundError, NotADirectoryError):
                    pass
            why = _not_applicable(edit, texts.get(edit.file))
            if why:
                absent.append((edit, why))
        if absent:
            reason = "; ".join(dict.fromkeys(why for _e, why in absent))
            if required:
                raise PatchError(f"patch {patch}: required (REQUIRED = True), but {reason}")
            return PatchOutcome(patch, NOT_APPLICABLE, [EditOutcome(e.file, NOT_APPLICABLE, why) for e, why in absent],
                                f"not applicable: {reason}")
        for edit in edits:
            try:
                outcome, texts[edit.file] = plan_edit(patch, edit, texts[edit.file])
            except PatchError as exc:  # the failing edit is one of the outcomes too (patch --json)
                outcomes.append(EditOutcome(edit.file, FAILED, str(exc)))
                raise
            outcomes.append(outcome)
    except PatchError as exc:
        return PatchOutcome(patch, FAILED, outcomes, str(exc))
    applied = any(o.outcome == APPLIED for o in outcomes)
    if applied and not write and overlay is not None:
        overlay.update(texts)
    if applied and write:
        for name, text in texts.items():
            if text != originals[name]:
                _atomic_write(src / name, text)
    if applied:
        overall = APPLIED if write else WOULD_APPLY
        if not write:
            for o in outcomes:
                if o.outcome == APPLIED:
                    o.outcome = WOULD_APPLY
    elif all(o.outcome == NOT_NEEDED for o in outcomes):
        overall = NOT_NEEDED
    else:
        overall = ALREADY
    msg = "; ".join(o.message for o in outcomes if o.outcome == NOT_NEEDED)
    return PatchOutcome(patch, overall, outcomes, msg)


def _atomic_write(path: Path, text: str) -> None:
    mode = os.stat(path).st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_edits(path: Path) -> list:
    """Import ``patch_*.py`` and return its ``EDITS``."""
    return load_patch(path)[0]


def load_patch(path: Path) -> tuple[list, bool]:
    """Import ``patch_*.py``: (its ``EDITS``, its ``REQUIRED``)."""
    # patch scripts import this file under MODULE_NAME, wherever it is
    sys.modules[MODULE_NAME] = sys.modules[__name__]
    spec = importlib.util.spec_from_file_location(f"_imagebuild_patch_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise PatchError(f"patch {path.name}: cannot be imported")
    mod = importlib.util.module_from_spec(spec)
    # no __pycache__ beside the patch: it would litter the definition folder (and a folder of
    # patches declared as 'files:' would change its cache key)
    saved, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(mod)
    except Exception as exc:  # a broken patch script is a failed patch, with its reason
        raise PatchError(f"patch {path.name}: importing it failed: {type(exc).__name__}: {exc}") from None
    finally:
        sys.dont_write_bytecode = saved
    edits = getattr(mod, "EDITS", None)
    if not isinstance(edits, (list, tuple)):
        raise PatchError(f"patch {path.name}: defines no EDITS list (EDITS = [Edit(...), ...])")
    required = getattr(mod, "REQUIRED", False)
    if not isinstance(required, bool):
        raise PatchError(f"patch {path.name}: REQUIRED must be True or False, got {required!r}")
    return list(edits), required


def collect(paths: list) -> list:
    """The patch files named by ``paths`` (files, or folders holding ``patch_*.py``), in order."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(q for q in p.iterdir() if q.name.startswith("patch_") and q.name.endswith(".py"))
        elif p.is_file():
            out.append(p)
        else:
            raise PatchError(f"{p}: no such patch file or folder")
    return out


def _sha256(path: Path) -> str | None:
    import hashlib

    try:
        return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def apply_all(patches: list, src: Path, *, write: bool = True, keep_going: bool | None = None) -> list:
    """Apply ``patches`` (paths) in order to ``src``; stops at the first failure, unless
    ``keep_going`` (default: when checking), so that a check reports every patch.

    Without ``write`` (a check) nothing is written, but each patch still sees what the earlier ones
    would have changed (an in-memory overlay): a patch that builds on an earlier one checks as it
    will apply in the build.
    """
    keep_going = (not write) if keep_going is None else keep_going
    results: list[PatchOutcome] = []
    overlay: dict | None = None if write else {}
    for path in patches:
        digest = _sha256(Path(path))
        try:
            edits, required = load_patch(Path(path))
        except PatchError as exc:
            results.append(PatchOutcome(Path(path).name, FAILED, [], str(exc), digest))
            if keep_going:
                continue
            break
        res = apply_edits(Path(path).name, edits, Path(src), write=write, overlay=overlay, required=required)
        res.sha256 = digest
        results.append(res)
        if res.outcome == FAILED and not keep_going:
            break
    return results


def record(path: Path, src: str, results: list) -> dict:
    """Merge ``results`` into the JSON record at ``path`` (one entry per patch name)."""
    data = {"schema": RECORD_SCHEMA, "version": RECORD_VERSION, "patches": {}}
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
            if old.get("schema") == RECORD_SCHEMA:
                data["patches"].update(old.get("patches") or {})
        except (OSError, ValueError):
            pass
    for r in results:
        data["patches"][r.patch] = {**r.as_dict(), "src": src}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return data


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(prog="imagebuild_patching", description="Apply or check anchor patches.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("apply", help="apply patch_*.py files (or folders of them) to a source tree")
    a.add_argument("--src", required=True, help="the source tree the patch paths are relative to")
    a.add_argument("--record", help="merge the outcomes into this JSON file")
    a.add_argument("--check", action="store_true", help="write nothing; say what would happen")
    a.add_argument("--json", action="store_true", help="print the outcomes as JSON on stdout")
    a.add_argument("--keep-going", action="store_true", help="apply every patch, not stopping at a failure")
    a.add_argument("patches", nargs="+", help="patch files or folders holding patch_*.py")
    args = ap.parse_args(argv)
    src = Path(args.src)
    if not src.is_dir():
        print(f"error: --src {src}: not a folder", file=sys.stderr)
        return 2
    try:
        patches = collect(args.patches)
    except PatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = apply_all(patches, src, write=not args.check, keep_going=True if args.keep_going else None)
    if args.record and not args.check:
        record(Path(args.record), str(args.src), results)
    for r in results:
        line = f"patch {r.patch}: {r.outcome}"
        if r.message:
            line += f" ({r.message})" if r.outcome != FAILED else f"\n  {r.message}"
        print(line, file=sys.stderr)
    if args.json:
        print(json.dumps({"schema": RECORD_SCHEMA, "version": RECORD_VERSION,
                          "patches": [r.as_dict() for r in results]}, indent=2, sort_keys=True))
    ok = len(results) == len(patches) and all(r.outcome in OK_OUTCOMES for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
