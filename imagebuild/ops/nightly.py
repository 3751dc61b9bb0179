"""``imagebuild nightly``: the whole chain, per image, with a report people read (docs/nightly.md).

For each image in turn:

1. **prefetch** (``--refresh``: PR heads and followed branches move; ``git ls-remote`` of every PR's
   ``head`` and ``merge`` refs, and the GitHub API where reachable, say which PRs closed or merged);
2. **build** (every stage under ``--network none``, skipped by key), which **gates** the candidate
   (unless this identity already passed this spec) and **promotes** it to ``:local`` only on a
   passing receipt;
3. **sync** ``:local`` to the peers, only when the gate passed;
4. the **diff** of the new image against the ``:local`` from before the run.

Then ``gc`` under the retention (``--keep-builds``), the report (report.py, written atomically),
the retention of reports, and the optional notify hook.

Rules: a failed gate never promotes or syncs; a serving container on the build node stops the
run before anything is prefetched or built (exit 3, and the report says so); one image failing
does not stop the next; the exit code is the worst of the images' (``worst``). Two nightlies never
overlap (a lock in the state folder). Nothing here prints: progress goes to the ``imagebuild``
logger (stderr); the CLI prints the summary.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import shlex
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from imagebuild import __version__
from imagebuild.buildstep import guards
from imagebuild.buildstep import promote as promote_mod
from imagebuild.core import context as context_mod
from imagebuild.core import engine as engine_mod
from imagebuild.core import fsutil, state, units
from imagebuild.core import identity as identity_mod
from imagebuild.core import run as run_mod
from imagebuild.core.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_GATE_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REFUSED,
    DefinitionError,
    GateFailed,
    GuardRefused,
    ImagebuildError,
    UsageError,
)
from imagebuild.definition import reader as defn_mod
from imagebuild.ops import imagediff
from imagebuild.ops import report as report_mod

log = logging.getLogger("imagebuild")

# worst last: a refusal (serving) is routine, a failed gate needs a look, a failed step or a bad
# definition needs a fix, an interruption means the run did not finish
SEVERITY = (EXIT_OK, EXIT_REFUSED, EXIT_GATE_FAILED, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED)
STATUS_OF = {EXIT_OK: "ok", EXIT_REFUSED: "refused", EXIT_GATE_FAILED: "gate-failed", EXIT_FAILED: "failed",
             EXIT_BAD_INPUT: "failed", EXIT_INTERRUPTED: "interrupted"}
LOCK_NAME = "nightly.lock"
NOTIFY_ENV = "IMAGEBUILD_NOTIFY"
NOTIFY_TIMEOUT_S = 300


def worst(codes) -> int:
    codes = list(codes) or [EXIT_OK]
    return max(codes, key=lambda c: SEVERITY.index(c) if c in SEVERITY else len(SEVERITY))


@dataclass(frozen=True)
class Options:
    peers: tuple[str, ...] = ()
    refresh: bool = False
    report_dir: Path | None = None
    keep_reports: int = report_mod.DEFAULT_KEEP_REPORTS
    keep_builds: int = 3
    gc: bool = True
    notify: str | None = None
    progress: str = "auto"
    sync_jobs: int = 4


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _since_marker() -> str:
    # build run ids are UTC start times to the microsecond: a run that started after this sorts after it
    return _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S.%fZ")


# --------------------------------------------------------------------------------------------- entry


def nightly(ctx: context_mod.Context | Path, images: list[str], opts: Options) -> tuple[dict, report_mod.Stored]:
    """Run the chain for ``images``; returns (report, where it was written). Never raises for a
    failed image (its result is in the report); raises UsageError for bad input before anything
    runs, GuardRefused when another nightly holds the lock, KeyboardInterrupt after writing the
    report of an interrupted run."""
    ctx = context_mod.of(ctx)
    root = ctx.root
    if not images:
        raise UsageError("no IMAGE given", hint="imagebuild nightly IMAGE... (imagebuild list shows them)")
    for name in images:
        defn_mod.require_image(root, name)
    for flag, v in (("--keep-builds", opts.keep_builds), ("--keep-reports", opts.keep_reports)):
        if v < 1:
            raise UsageError(f"{flag} {v}: expected 1 or more")
    report_dir = Path(opts.report_dir) if opts.report_dir else report_mod.default_dir(ctx)
    _check_peers(ctx, opts)
    _check_folders(ctx)  # the nightly's lock lives in the state folder; the builds write in all three
    lock = guards.BuildLock(ctx.state / LOCK_NAME, "nightly")
    try:
        lock.acquire(command="imagebuild nightly " + " ".join(images))
    except GuardRefused:
        h = lock.holder() or {}
        raise GuardRefused(f"another imagebuild nightly is running: pid {h.get('pid')} on {h.get('host')} "
                           f"({h.get('command')})", hint=f"runs never overlap; the lock is {lock.path}") from None
    try:
        _check_report_dir(opts, report_dir)  # with the lock held: a refused second run makes no folder
        return _run(ctx, images, opts, report_dir)
    finally:
        lock.release()


# What the run's last steps need is checked before its first (issue 22): else a report folder that
# cannot be written loses the report of a run of hours at its end, and a peer sync refuses is found
# only after prefetch, build and gate. Each is a UsageError (exit 2) naming the flag or file.


def _check_peers(ctx: context_mod.Context, opts: Options) -> None:
    """Every peer an SSH destination, every ``@LIST`` one ``imagebuild.yaml`` names (as sync will
    resolve them). Whether a peer answers is found at its sync: it may be up by then."""
    from imagebuild.ship import sync as sync_mod

    if opts.peers:
        sync_mod.resolve_peers(ctx, list(opts.peers))


def _check_folders(ctx: context_mod.Context) -> None:
    """The state folder (an internal error at the lock otherwise), the stage store and the build lock
    folder (each image's build would refuse them, after its prefetch) made and writable."""
    from imagebuild.core.fsutil import usable_dir

    env = bool(os.environ.get("IMAGEBUILD_STATE_DIR"))
    usable_dir(ctx.state, "IMAGEBUILD_STATE_DIR" if env else "the state folder",
               hint="IMAGEBUILD_STATE_DIR names a folder this user can write (default <project>/.imagebuild)")
    usable_dir(state.stages_dir(), state.STAGES_ENV if os.environ.get(state.STAGES_ENV) else "the stage store",
               hint=f"{state.STAGES_ENV} names a folder this user can write (default "
               "$XDG_CACHE_HOME/imagebuild/stages)")
    guards.usable_lock_dir(guards.lock_top())


def _check_report_dir(opts: Options, report_dir: Path) -> None:
    """The report folder made and writable (a real probe)."""
    from imagebuild.core.fsutil import usable_dir

    usable_dir(report_dir, "--report-dir" if opts.report_dir else "the nightly report folder",
               hint="--report-dir names a folder this user can write (default .imagebuild/nightly, or "
               "nightly/ under IMAGEBUILD_STATE_DIR)")


def _run(ctx: context_mod.Context, images: list[str], opts: Options, report_dir: Path) -> tuple[dict, report_mod.Stored]:
    from imagebuild.buildstep.builder import new_run_id

    t0 = time.monotonic()
    doc: dict = {
        "schema": report_mod.SCHEMA, "version": report_mod.VERSION, "run_id": new_run_id(),
        "started": _now(), "finished": None, "seconds": None, "host": socket.gethostname(),
        "imagebuild_version": __version__,
        "command": {"images": list(images), "peers": list(opts.peers), "refresh": opts.refresh,
                    "keep_builds": opts.keep_builds, "keep_reports": opts.keep_reports, "gc": opts.gc},
        "status": "running", "exit_code": None, "refused": None, "images": [], "disk": None,
    }
    interrupted = False
    try:
        doc["refused"] = _serving(ctx)
        down = None if ctx.engine.reachable else engine_mod.unreachable_error(ctx.engine)
        if down is not None:  # said once, here and in each image's reason; no step can run without it
            log.error("%s", down.render())
        if doc["refused"] is None:  # seconds on a big store: said, so the start is not silent
            log.info("disk: measuring what %s hold%s (engine images, stage store, builds) before the run",
                     ", ".join(images), "s" if len(images) == 1 else "")
            doc["disk"] = {"before": _disk(ctx, images), "after": None, "gc": None, "gc_skipped": None}
        for name in images:
            if doc["refused"] is not None:
                doc["images"].append(_refused_image(name, doc["refused"]["reason"]))
                continue
            if down is not None:
                doc["images"].append(_engine_down_image(name, down))
                continue
            res = _blank(name)
            doc["images"].append(res)
            _one(ctx, name, opts, res)
        if doc["refused"] is None:
            _gc(ctx, images, opts, doc, down)
    except KeyboardInterrupt:
        interrupted = True
        for res in doc["images"]:
            if res["status"] == "running":
                res.update(status="interrupted", exit_code=EXIT_INTERRUPTED, reason="interrupted (Ctrl-C, SIGTERM or "
                           "SIGHUP): this image's chain did not finish")
    codes = [r["exit_code"] for r in doc["images"]] + ([EXIT_INTERRUPTED] if interrupted else [])
    if doc["refused"] is not None:
        codes.append(EXIT_REFUSED)
    doc["exit_code"] = worst(codes)
    doc["status"] = STATUS_OF.get(doc["exit_code"], "failed")
    doc["finished"] = _now()
    doc["seconds"] = round(time.monotonic() - t0, 3)
    log.info("report: writing it and the history page under %s", ctx.show(report_dir))
    stored = report_mod.write(report_dir, doc, keep=opts.keep_reports)
    log.debug("report written: %s (and .json)", stored.md_path)
    _history(ctx, report_dir, stored)
    if interrupted:
        raise KeyboardInterrupt
    _notify(opts.notify if opts.notify is not None else os.environ.get(NOTIFY_ENV), stored, doc)
    return report_mod.redact(doc), stored


def _history(ctx: context_mod.Context, report_dir: Path, stored: report_mod.Stored) -> None:
    """Add tonight to the history (``<state>/nightly-history.jsonl``, never trimmed) and write the
    history page beside the Markdown (``<run id>.html``). A failure here is a warning: the report
    is written and the run's result stands."""
    from imagebuild.ops import history as history_mod
    from imagebuild.ops import htmlpage

    try:
        doc = stored.load()
        history_mod.append(history_mod.path(ctx), doc)
        kept, pairs = [], []
        for s in report_mod.stored(report_dir):
            try:
                kept.append(s.load())
            except ImagebuildError:
                continue
            pairs.append((s.json_path, kept[-1]))
        h = history_mod.load(history_mod.path(ctx), kept)
        page_path = stored.json_path.with_suffix(".html")
        # links relative to the page's folder (the report dir): the reports beside it, the logs
        links = htmlpage.night_links(h.rows, pairs + [(page_path.with_suffix(".json"), doc)],
                                     context_mod.of(ctx).root, page_path.parent)
        page = htmlpage.render(h.rows, doc, links=links)
        from imagebuild.core.fsutil import atomic_write_text

        atomic_write_text(page_path, page)
    except (OSError, ImagebuildError) as exc:
        log.warning("warning: the nightly history was not updated: %s", getattr(exc, "message", exc))


# --------------------------------------------------------------------------------------------- refusal


def _serving(ctx: context_mod.Context) -> dict | None:
    """Serving containers on the build node (docs/build.md, 'Guard rails'): the run stops before
    anything runs. None when there are none (or no engine: the build then says so per image)."""
    if not ctx.engine.reachable:
        return None
    found = guards.serving_containers()
    if not found:
        return None
    names = "; ".join(f"{c.name} ({c.id})" for c in found)
    log.error("refused: a serving container is running: %s", names)
    return {"reason": f"a serving container is running on the build node: {names}; building while serving "
                      "OOM-kills one of them on 128 GB unified memory",
            "containers": [{"name": c.name, "id": c.id, "image": c.image, "why": c.why} for c in found]}


def _engine_down_image(name: str, down: ImagebuildError) -> dict:
    """An image of a night whose engine is unreachable: failed, nothing run, the reason said once."""
    res = _blank(name)
    res.update(status="failed", exit_code=down.exit_code, reason=_one_line(down), seconds=0.0,
               sync={"status": "not-run", "reason": "the engine is unreachable: nothing was built", "peers": []},
               changes_note="the engine is unreachable: nothing was built")
    res["failure"] = {"step": "engine", "stage": None, "exit_code": None, "command": None, "tool_exit_code": None,
                      "log": None, "tail": [], "problems": [], "reason": None}
    return res


def _blank(name: str) -> dict:
    return {"image": name, "status": "running", "exit_code": None, "reason": None, "seconds": None,
            "build_id": None, "identity": None, "run_id": None, "steps": {}, "upstream": None, "stages": [],
            "cache": {"hits": 0, "misses": 0}, "gate": None, "promotion": None, "sync": None, "tags": {},
            "changes": None, "changes_note": None, "failure": None, "size": None}


def _refused_image(name: str, reason: str) -> dict:
    res = _blank(name)
    res.update(status="refused", exit_code=EXIT_REFUSED, reason=reason, seconds=0.0,
               sync={"status": "not-run", "reason": "refused: nothing was built", "peers": []},
               changes_note="refused: nothing was built")
    return res


# --------------------------------------------------------------------------------------------- one image


def _one(ctx: context_mod.Context, name: str, opts: Options, res: dict) -> None:
    t0 = time.monotonic()
    log.info("== %s", name)
    try:
        _chain(ctx, name, opts, res)
    except ImagebuildError as exc:  # a step the chain does not handle itself: the image failed, the run goes on
        res["status"] = STATUS_OF.get(exc.exit_code, "failed")
        res["exit_code"] = exc.exit_code
        res["reason"] = _one_line(exc)
        if res["failure"] is None:
            res["failure"] = _failure_of_error(exc, res)
        elif res["failure"].get("reason"):
            res["reason"] = res["failure"]["reason"]
        log.error("%s: %s", name, report_mod.redact(exc.render()))  # a step's quoted output may hold a secret
    except Exception as exc:  # a bug must not stop the next image either; the traceback is behind --debug
        log.debug("%s: internal error", name, exc_info=True)
        _fail(res, EXIT_FAILED, f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the "
              "traceback; please report it)")
        log.error("%s: %s", name, res["reason"])
    finally:
        res["seconds"] = round(time.monotonic() - t0, 3)
    if res["exit_code"] is None:
        res["exit_code"] = EXIT_OK
        res["status"] = "ok"
    if res["sync"] is None:
        res["sync"] = {"status": "not-run", "reason": res["reason"] or "not reached", "peers": []}
    log.info("%s: %s (exit %d) in %.1f s", name, res["status"], res["exit_code"], res["seconds"])


def _one_line(exc: ImagebuildError) -> str:
    """An error's first line and its hint (a build failure's log tail stays in its log)."""
    lines = exc.message.strip().splitlines() or ["(no message)"]
    text = lines[0].rstrip(":; ")
    if isinstance(exc, DefinitionError):  # name every problem's file, line and key
        text += ": " + "; ".join(p.render().replace("\n    hint:", " (hint:") + (")" if p.hint else "")
                                 for p in exc.problems)
    return text + (f" (hint: {exc.hint})" if exc.hint else "")


def _build_failure(ctx: context_mod.Context, name: str, rec: dict | None, exc: ImagebuildError) -> dict:
    """Why the build failed, from the failed stage's own log: the RUN step's exit code (not docker
    buildx's 1), its command and the last lines of its output (buildstep/buildlog.py), redacted."""
    from imagebuild.buildstep import buildlog
    from imagebuild.core import runs as runs_mod

    stage = (rec or {}).get("failed_stage")
    out = {"step": "build", "stage": stage, "exit_code": None, "command": None, "tool_exit_code": None,
           "log": None, "tail": [], "problems": [], "reason": None}
    log_path = None
    if stage and rec and rec.get("run_id"):
        for r in runs_mod.list_runs(ctx, name):
            if r.run_id == rec["run_id"]:
                log_path = r.dir / "logs" / f"{stage}.log"
                break
    info = buildlog.explain_file(log_path) if log_path is not None else None
    if info is None:  # no log of its own (the release or publish step, an engine error): the message's lines
        out["tail"] = _message_tail(exc)
        out["reason"] = None
        return out
    out.update(exit_code=info["exit_code"], command=info["command"], tool_exit_code=info["tool_exit_code"],
               log=ctx.show(log_path), tail=info["tail"])
    what = (f"its step `{info['command']}` failed: RUN exit {info['exit_code']}" if info["exit_code"] is not None
            else "no step of it reported an exit code" + (f" (docker buildx exited {info['tool_exit_code']})"
                                                          if info["tool_exit_code"] is not None else ""))
    out["reason"] = (f"stage {stage!r} of {name} failed: {what}; the last lines of its log are in the report "
                     f"(full log: {out['log']}; :local and :candidate were not touched)")
    return out


def _message_tail(exc: ImagebuildError) -> list[str]:
    """The lines after an error's first one (a step's quoted output), cleaned and redacted."""
    from imagebuild.buildstep import buildlog

    lines = exc.message.strip().splitlines()[1:]
    return [buildlog.clean(ln[4:] if ln.startswith("  | ") else ln) for ln in lines][-buildlog.TAIL_LINES:]


def _failure_of_error(exc: ImagebuildError, res: dict) -> dict:
    """The ``failure`` part for an error the chain did not explain itself: which step, the error's
    own lines (a prefetch's git output, say) and, for a definition error, each problem's place."""
    step = next((k for k, v in res["steps"].items() if (v or {}).get("status") == "failed"), None)
    if isinstance(exc, DefinitionError):
        step = "definition"
    return {"step": step, "stage": None, "exit_code": None, "command": None, "tool_exit_code": None,
            "log": None, "tail": _message_tail(exc),
            "problems": [p.as_dict() for p in exc.problems] if isinstance(exc, DefinitionError) else [],
            "reason": None}


def _exit_words(failure: dict | None) -> str:
    if not failure or failure.get("exit_code") is None:
        return ""
    return f": RUN exit {failure['exit_code']}"


def _fail(res: dict, code: int, reason: str) -> None:
    res["exit_code"] = code
    res["status"] = STATUS_OF.get(code, "failed")
    res["reason"] = reason


def _chain(ctx: context_mod.Context, name: str, opts: Options, res: dict) -> None:
    from imagebuild.buildstep import builder as build_mod
    from imagebuild.fetch import packages
    from imagebuild.fetch import prefetch as prefetch_mod

    defn = defn_mod.load(ctx.root, name)  # DefinitionError: exit 2, this image only
    before = _tag(name, promote_mod.LOCAL)
    prev_inv = None
    if before is not None:
        try:
            prev_inv = imagediff.inventory(f"{name}:{promote_mod.LOCAL}", ctx)
        except ImagebuildError as exc:
            res["changes_note"] = f"the previous :local could not be read: {exc.message}"

    # 1. prefetch
    steps = res["steps"]
    if defn.sources or packages.has_packages(defn):
        t = time.monotonic()
        pins_before = _pin_files(defn)
        try:
            rep = prefetch_mod.prefetch(ctx, [name], refresh=[] if opts.refresh else None)
        except ImagebuildError as exc:
            steps["prefetch"] = {"status": "failed", "seconds": round(time.monotonic() - t, 3), "detail": exc.message}
            res["upstream"] = {"checked": False, "reason": "prefetch failed", "moved": [], "pull_requests": [],
                               "notices": []}
            raise
        ir = rep.images[0]
        status, what = _prefetch_outcome(defn, ir, pins_before)
        steps["prefetch"] = {"status": status,
                             "seconds": round(time.monotonic() - t, 3),
                             "detail": f"{what}; {rep.network_operations} network operation(s); build id "
                                       f"{ir.build_id or '-'}",
                             "network_operations": rep.network_operations, "build_id": ir.build_id}
        res["upstream"] = _upstream(defn, ir, opts.refresh)
    else:
        steps["prefetch"] = {"status": "not-needed", "seconds": 0.0,
                             "detail": "no git sources and no packages to prefetch"}
        res["upstream"] = {"checked": False, "reason": "no git sources", "moved": [], "pull_requests": [],
                           "notices": []}

    # 2. build (+ gate + promotion)
    since = _since_marker()
    t = time.monotonic()
    gate_error: GateFailed | None = None
    rec = None
    try:
        rec = build_mod.build(ctx, name, build_mod.Options(progress=opts.progress))
    except GateFailed as exc:
        gate_error = exc
        rec = _record_since(ctx, name, since)
    except GuardRefused as exc:
        steps["build"] = {"status": "refused", "seconds": round(time.monotonic() - t, 3), "detail": exc.message}
        raise
    except ImagebuildError as exc:
        rec = _record_since(ctx, name, since)
        _take_record(res, rec)
        failed_stage = (rec or {}).get("failed_stage")
        res["failure"] = _build_failure(ctx, name, rec, exc)
        steps["build"] = {"status": "failed", "seconds": round(time.monotonic() - t, 3),
                          "detail": (f"stage {failed_stage} failed" + _exit_words(res["failure"]))
                          if failed_stage else _one_line(exc),
                          "run_id": (rec or {}).get("run_id")}
        res["changes_note"] = "the build failed: there is no new image to compare"
        raise
    build_s = round(time.monotonic() - t, 3)
    _take_record(res, rec)
    gate = _gate(ctx, defn, rec, gate_error)
    res["gate"] = gate
    gate_s = gate.get("seconds") if gate and gate.get("ran") else 0.0
    steps["build"] = {"status": "built" if res["cache"]["misses"] else "cached",
                      "seconds": round(max(build_s - (gate_s or 0.0), 0.0), 3),
                      "detail": f"{res['cache']['misses']} stage(s) built, {res['cache']['hits']} from the stage store",
                      "run_id": res["run_id"]}
    promo = (rec or {}).get("promotion") or {}
    res["promotion"] = {"status": promo.get("status") or ("gate-failed" if gate_error else "skipped"),
                        "reason": promo.get("reason"), "local_identity": promo.get("local_identity"),
                        "previous_id": promo.get("previous_id")}
    if gate is not None:
        steps["gate"] = {"status": gate["result"], "seconds": gate_s,
                         "detail": ("ran" if gate["ran"] else "receipt of this identity and spec reused")
                         + ("; GPU checks SKIPPED" if gate.get("gpu_checks_skipped") else "")}
    steps["promote"] = {"status": res["promotion"]["status"], "seconds": None,
                        "detail": res["promotion"]["reason"] or {
                            "promoted": f"{name}:local moved; the old one is {name}:previous"
                            if res["promotion"]["previous_id"] or before is not None
                            else f"{name}:local set (first promotion: there was no :local before, so no "
                                 f"{name}:previous)",
                            "unchanged": f"{name}:local already held this identity",
                        }.get(res["promotion"]["status"], "")}

    # 4. the diff (before sync: a sync failure must not hide what changed)
    _changes(ctx, name, res, prev_inv, before)

    if gate_error is not None:
        _fail(res, EXIT_GATE_FAILED, f"gate failed: {gate_error.message}; {name}:local and the peers were not "
              "touched")
        res["sync"] = {"status": "not-run", "reason": "the gate failed: nothing is promoted or synced", "peers": []}
    elif res["promotion"]["status"] not in ("promoted", "unchanged"):
        res["sync"] = {"status": "not-run", "reason": f"not promoted ({res['promotion']['reason'] or 'no gate'}): "
                       "only a gated :local is synced", "peers": []}
    else:
        # 3. sync
        _sync(ctx, name, opts, res)
    res["tags"] = {t: _tag(name, t) for t in (promote_mod.LOCAL, promote_mod.PREVIOUS, promote_mod.CANDIDATE)}


def _pin_files(defn) -> dict[str, bytes | None]:
    """The bytes of the files prefetch may write (versions.env, lock.json), to tell afterwards what it did."""
    from imagebuild.core import lock as lock_mod

    out: dict[str, bytes | None] = {}
    for key, p in (("env", defn.dir / "versions.env"), ("lock", lock_mod.lock_path(defn.dir))):
        try:
            out[key] = fsutil.read_bytes(p)
        except OSError:
            out[key] = None
    return out


def _prefetch_outcome(defn, ir, before: dict[str, bytes | None]) -> tuple[str, str]:
    """``pinned`` (the first lock was written), ``updated`` (versions.env or the lock changed) or
    ``unchanged``, from the files themselves: a definition without git sources whose base image was
    pinned reports ``unchanged`` from prefetch's git part, but it wrote the lock."""
    after = _pin_files(defn)
    pinned = [f"{p['key']}={p['to']}" for p in ir.pinned] + list((ir.packages or {}).get("pinned") or [])
    words = []
    if pinned:
        words.append("pinned " + ", ".join(pinned))
    if before["lock"] is None and after["lock"] is not None:
        return "pinned", "; ".join([*words, "wrote the first lock"])
    if before != after:
        return "updated", "; ".join(words or ["the lock changed"])
    return "unchanged", "; ".join(words or ["pins and lock as they were"])


def _record_since(ctx: context_mod.Context, name: str, since: str) -> dict | None:
    from imagebuild.core import runs as runs_mod

    for r in runs_mod.list_runs(ctx, name):
        if r.run_id >= since:
            return r.record or None
        break
    return None


def _take_record(res: dict, rec: dict | None) -> None:
    if not rec:
        return
    res["run_id"] = rec.get("run_id")
    res["build_id"] = rec.get("build_id")
    res["identity"] = (rec.get("release") or {}).get("identity")
    stages = []
    for s in rec.get("stages") or []:
        action = s.get("action")
        cache = {"skip": "hit", "build": "miss", "reuse": "reused"}.get(action, action or "-")
        if action == "build" and s.get("status") not in ("built", "failed"):
            cache = "not-reached"  # an earlier stage failed
        stages.append({"name": s.get("name"), "action": action, "cache": cache, "status": s.get("status"),
                       "seconds": s.get("seconds"), "key": s.get("key"), "log": s.get("log"),
                       **({"compiler_cache": s["compiler_cache"]} if s.get("compiler_cache") else {})})
    res["stages"] = stages
    res["cache"] = {"hits": sum(1 for s in stages if s["cache"] == "hit"),
                    "misses": sum(1 for s in stages if s["cache"] == "miss")}


def _gate(ctx: context_mod.Context, defn, rec: dict | None, gate_error: GateFailed | None) -> dict | None:
    from imagebuild.definition import gatespec
    from imagebuild.gate import receipts

    rel = (rec or {}).get("release") or {}
    if defn.gate is None or not rel.get("identity"):
        return None
    promo = (rec or {}).get("promotion") or {}
    if promo.get("status") == "skipped" and gate_error is None:
        return None
    spec = gatespec.digest(defn.gate)
    data = receipts.read(ctx, rel["identity"], spec)
    if data is None:
        return {"result": "failed" if gate_error else "unknown", "ran": gate_error is not None, "seconds": None,
                "reason": gate_error.message if gate_error else "no receipt found", "spec": str(defn.gate),
                "identity": rel["identity"], "gpu_checks_skipped": False, "summary": {}, "checks": [],
                "receipt": None}
    return {"result": data.get("result"), "ran": bool(promo.get("gated")) or gate_error is not None,
            "seconds": (data.get("run") or {}).get("duration_s"), "reason": data.get("reason"),
            "spec": (data.get("spec") or {}).get("file"), "identity": rel["identity"],
            "gpu_checks_skipped": bool(data.get("gpu_checks_skipped")), "summary": data.get("summary") or {},
            "checks": [{"id": c.get("id"), "kind": c.get("kind"), "outcome": c.get("outcome"),
                        "severity": c.get("severity"), "requires_gpu": bool(c.get("requires_gpu")),
                        "detail": c.get("detail")} for c in data.get("checks") or []],
            "receipt": defn_mod.display_path(ctx.root, receipts.receipt_path(ctx, rel["identity"], spec))}


def _changes(ctx: context_mod.Context, name: str, res: dict, prev_inv: dict | None, before: dict | None) -> None:
    """The diff against the :local from before the run. The new image's inventory is read in every
    run, first promotion included: it is cached by identity, so the next night's "previous" costs
    nothing."""
    if not res["identity"]:
        res["changes_note"] = res["changes_note"] or "no new image to compare"
        return
    new_ref = f"{name}:{promote_mod.build_tag(res['build_id'])}" if res["build_id"] else \
        f"{name}:{promote_mod.CANDIDATE}"
    try:
        new_inv = imagediff.inventory(new_ref, ctx)
    except ImagebuildError as exc:
        res["changes_note"] = f"{new_ref} could not be read: {exc.message}"
        return
    if new_inv.get("identity") != res["identity"]:
        res["changes_note"] = f"{new_ref} is not this run's image any more (another build moved it)"
        return
    res["size"] = new_inv.get("size") if isinstance(new_inv.get("size"), int) else None
    if prev_inv is None:
        status = (res.get("promotion") or {}).get("status")  # "first promotion" only when it was promoted
        res["changes_note"] = res["changes_note"] or f"no previous {name}:local to compare with (" + (
            "first promotion)" if status == "promoted" else f"not promoted: {status or 'no promotion'})")
        return
    res["changes"] = imagediff.diff({**prev_inv, "ref": f"{name}:local (before this run)"}, new_inv)


def _tag(name: str, tag: str) -> dict | None:
    try:
        data = identity_mod.inspect_data(f"{name}:{tag}")
    except ImagebuildError:
        return None
    labels = (data.get("Config") or {}).get("Labels") or {}
    return {"identity": identity_mod.from_inspect(data).digest, "image_id": data.get("Id"),
            "build_id": labels.get("io.imagebuild.build-id")}


# --------------------------------------------------------------------------------------------- upstream


def _upstream(defn, ir, refreshed: bool) -> dict:
    """What moved upstream (prefetch's report) and each pinned PR's state: ``git ls-remote`` of its
    ``refs/pull/N/head`` and ``refs/pull/N/merge`` (GitHub drops the merge ref when a PR is closed
    or merged), plus the GitHub API's answer when it gave one (prefetch asked it, with
    ``GITHUB_TOKEN`` when set)."""
    from imagebuild.core import lock as lock_mod
    from imagebuild.fetch import gitcache

    lock = lock_mod.read(defn.dir) or {}
    repos = {src: gitcache.redact(e.get("repo") or "") or None
             for src, e in (lock.get("sources") or {}).items() if isinstance(e, dict)}
    moved = [{"source": m["source"], "what": f"PR {m['number']}" if "number" in m else str(m.get("ref")),
              "from": m["from"], "to": m["to"], "repo": repos.get(m["source"])} for m in ir.moved]
    out = {"checked": refreshed, "reason": None if refreshed else "run without --refresh: pins kept as they are",
           "moved": moved, "pull_requests": [], "notices": list(ir.notices)}
    api = {(s["source"], s["number"]): s for s in ir.pr_states}
    by_repo: dict[str, list[tuple[str, int, str | None]]] = {}
    for src, entry in sorted((lock.get("sources") or {}).items()):
        if not isinstance(entry, dict):
            continue
        for pr in entry.get("prs") or []:
            n, sha = (pr.get("number"), pr.get("sha")) if isinstance(pr, dict) else (pr[0], pr[1])
            by_repo.setdefault(entry.get("repo") or "", []).append((src, int(n), sha))
    ls: dict[str, dict[str, str] | None] = {}
    if refreshed:
        cache = gitcache.Cache(gitcache.default_cache_dir(None))
        for repo, prs in by_repo.items():
            pats = [f"refs/pull/{n}/{k}" for _, n, _ in prs for k in ("head", "merge")]
            try:
                ls[repo] = cache.mirror(repo).ls_remote(pats, prs[0][0])
            except ImagebuildError as exc:
                ls[repo] = None
                out["notices"].append(f"git ls-remote {gitcache.redact(repo)} failed: {exc.message}")
    for repo, prs in by_repo.items():
        refs = ls.get(repo)
        has_merge_refs = bool(refs) and any(r.endswith("/merge") for r in refs)
        for src, n, sha in prs:
            item = {"source": src, "number": n, "head": sha, "moved": any(m["source"] == src and m["what"] == f"PR {n}"
                                                                           for m in moved),
                    "head_ref": None, "merge_ref": None, "state": None, "merged": None, "via": [],
                    "repo": repos.get(src)}
            if refs is not None and refreshed:
                item["via"].append("git ls-remote")
                item["head_ref"] = "present" if f"refs/pull/{n}/head" in refs else "gone"
                item["merge_ref"] = "present" if f"refs/pull/{n}/merge" in refs else "absent"
                if item["head_ref"] == "gone":
                    item["state"] = "closed (head ref gone)"
                elif has_merge_refs:
                    item["state"] = "open" if item["merge_ref"] == "present" else "closed or merged (no merge ref)"
            st = api.get((src, n))
            if st:
                item["via"].append("GitHub API")
                item["state"] = st.get("state")
                item["merged"] = bool(st.get("merged"))
            out["pull_requests"].append(item)
    return out


# --------------------------------------------------------------------------------------------- sync


def _sync(ctx: context_mod.Context, name: str, opts: Options, res: dict) -> None:
    peers = list(opts.peers)
    steps = res["steps"]
    if not peers:
        res["sync"] = {"status": "not-requested", "reason": "no peers (--peers, or peers: in imagebuild.yaml)",
                       "peers": []}
        return
    try:
        from imagebuild.ship import sync as sync_mod
    except ImportError:
        res["sync"] = {"status": "failed", "reason": "imagebuild.sync is not installed in this version (issue 12)",
                       "peers": [{"peer": p, "status": "failed", "bytes_sent": 0, "seconds": 0.0,
                                  "message": "sync not available", "identity": None} for p in peers]}
        steps["sync"] = {"status": "failed", "seconds": 0.0, "detail": res["sync"]["reason"]}
        _fail(res, EXIT_FAILED, res["sync"]["reason"])
        return
    t = time.monotonic()
    try:
        rep = sync_mod.sync(ctx, peers, image=name, jobs=opts.sync_jobs)
    except ImagebuildError as exc:
        res["sync"] = {"status": "failed" if exc.exit_code != EXIT_REFUSED else "refused", "reason": exc.message,
                       "peers": []}
        steps["sync"] = {"status": res["sync"]["status"], "seconds": round(time.monotonic() - t, 3),
                         "detail": exc.message}
        _fail(res, exc.exit_code, f"sync: {exc.message}")
        return
    rows = [{"peer": p.peer, "status": p.status, "bytes_sent": int(p.bytes_sent or 0),
             "seconds": round(float(p.seconds or 0.0), 3), "message": p.message, "identity": p.identity}
            for p in rep.peers]
    ok = bool(rep.ok)
    res["sync"] = {"status": "ok" if ok else "failed", "reason": None if ok else "a peer did not get the image",
                   "identity": rep.identity, "ref": rep.ref, "peers": rows}
    steps["sync"] = {"status": "ok" if ok else "failed", "seconds": round(time.monotonic() - t, 3),
                     "detail": ", ".join(f"{r['peer']} {r['status']}" for r in rows)}
    if not ok:
        bad = [r for r in rows if r["status"] not in ("synced", "unchanged")]
        _fail(res, EXIT_REFUSED if bad and all(r["status"] == "refused" for r in bad) else EXIT_FAILED,
              "sync: " + "; ".join(f"{r['peer']}: {r['status']} ({r['message']})" for r in bad))


# --------------------------------------------------------------------------------------------- disk


def _disk(ctx: context_mod.Context, images: list[str]) -> dict:
    from imagebuild.ops import gc as gc_mod

    sd = ctx.state
    probe = sd if sd.exists() else ctx.root
    out = {"free_bytes": shutil.disk_usage(probe).free, "docker_free_bytes": None, "images": {}}
    info = ctx.engine
    if info.root_dir and Path(info.root_dir).exists():
        out["docker_free_bytes"] = shutil.disk_usage(info.root_dir).free
    try:
        from imagebuild.buildstep.stagestore import StageStore
        from imagebuild.core import runs as runs_mod

        for name in images:  # what `imagebuild df IMAGE` counts, without its shared caches (the git mirrors' walk)
            engine = gc_mod.engine_bytes(name) if info.reachable else 0
            out["images"][name] = (engine + gc_mod.tree_bytes(StageStore.for_image(ctx.root, name).dir)
                                   + gc_mod.tree_bytes(state.deps_dir(ctx.root, name))
                                   + sum(gc_mod.tree_bytes(r.dir) for r in runs_mod.list_runs(ctx, name)))
    except ImagebuildError as exc:
        log.warning("warning: disk use not measured: %s", exc.message)
    return out


def _gc(ctx: context_mod.Context, images: list[str], opts: Options, doc: dict,
        down: ImagebuildError | None = None) -> None:
    from imagebuild.ops import gc as gc_mod

    disk = doc["disk"]
    if not opts.gc:
        disk["gc_skipped"] = "--no-gc"
    elif down is not None:
        disk["gc_skipped"] = "the engine is unreachable"
    else:
        freed = removed = 0
        t = time.monotonic()
        try:
            for name in images:
                log.info("gc: %s: keeping the last %d builds, removing the rest", name, opts.keep_builds)
                plan = gc_mod.collect(ctx, name, opts.keep_builds)  # under the image's build lock
                freed += plan.freed
                removed += sum(len(p.remove) for p in plan.images) + len(plan.shared)
            disk["gc"] = {"keep": opts.keep_builds, "freed_bytes": freed, "removed": removed,
                          "seconds": round(time.monotonic() - t, 3)}
            log.info("gc: freed %s (%d item(s)) in %.1f s", units.human_bytes(freed), removed, disk["gc"]["seconds"])
        except ImagebuildError as exc:
            disk["gc_skipped"] = f"gc failed: {exc.message}"
            log.warning("warning: gc failed: %s", exc.message)
    log.info("disk: measuring again after the run")
    disk["after"] = _disk(ctx, images)


# --------------------------------------------------------------------------------------------- notify


def _notify(command: str | None, stored: report_mod.Stored, doc: dict) -> None:
    """Run the site's hook with the Markdown report's path as its last argument (and both paths
    and the status in the environment). Its failure is a warning: the run's result stands. The
    hook does not inherit GITHUB_TOKEN (or the other SECRET_ENV variables)."""
    if not command:
        return
    argv = [*shlex.split(command), str(stored.md_path)]
    env = {"IMAGEBUILD_REPORT_JSON": str(stored.json_path), "IMAGEBUILD_REPORT_MD": str(stored.md_path),
           "IMAGEBUILD_NIGHTLY_STATUS": doc["status"], "IMAGEBUILD_NIGHTLY_EXIT": str(doc["exit_code"]),
           **{k: "" for k in report_mod.SECRET_ENV}}
    try:
        proc = run_mod.run(argv, check=False, env=env, timeout=NOTIFY_TIMEOUT_S)
    except ImagebuildError as exc:
        log.warning("warning: notify hook %r did not run: %s", argv[0], report_mod.redact(exc.message))
        return
    if proc.returncode != 0:
        tail = report_mod.redact(proc.stdout.decode("utf-8", "replace").strip()[-500:])
        log.warning("warning: notify hook %r exited %d: %s", argv[0], proc.returncode, tail)
    else:
        log.info("notify: %s ok", argv[0])
