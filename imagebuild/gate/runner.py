"""Gate an image: run its gate spec's checks inside a container of it, write a receipt.

    spec (gatespec.py) + image ref
      -> identity (identity.py, store-independent) + ``docker image inspect`` data
      -> a keep-alive container: entrypoint overridden, ``--network none``, ``--gpus all`` only
         when the host has NVIDIA GPUs
      -> pytest, in-process, one test item per check; the items reach the container through
         pytest-testinfra's docker backend (``docker exec``); gatechecks.py holds the kinds
      -> log + receipt (receipts.py) keyed by the identity digest; the container is removed in
         every case (also on Ctrl-C, SIGTERM or a timeout)

``run_gate`` raises ``GateFailed`` (exit 4) after writing the receipt when the gate fails;
``execute`` returns the receipt either way. Nothing here prints: progress goes to the
``imagebuild`` logger (stderr), the CLI prints the table.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
import platform
import secrets
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from imagebuild import __version__
from imagebuild.core import context as context_mod
from imagebuild.core import identity as identity_mod
from imagebuild.core import interrupts, runs, state
from imagebuild.core import run as run_mod
from imagebuild.core.errors import GateFailed, OperationFailed, UsageError
from imagebuild.core.fsutil import atomic_write_bytes, atomic_write_text, held, sha256_file
from imagebuild.definition import gatespec
from imagebuild.definition import reader as defn_mod
from imagebuild.gate import checks as gatechecks
from imagebuild.gate import leftovers, receipts, signing

log = logging.getLogger("imagebuild")

CANDIDATE_TAG = "candidate"
CONTAINER_PREFIX = "imagebuild-gate-"


CONTAINER_LABEL = leftovers.CONTAINER_LABEL
# Works with busybox ash and dash/bash; keeps PID 1 alive and stops on TERM/INT.
KEEPALIVE = 'trap "exit 0" TERM INT; sleep 2147483647 & wait'
NO_GPU_ENV = "IMAGEBUILD_NO_GPU"


def default_ref(image: str) -> str:
    """The image a definition's gate runs against when no --ref is given."""
    return f"{image}:{CANDIDATE_TAG}"


# ------------------------------------------------------------------------------------------------ host


def detect_gpus() -> list[str]:
    """Names of the host's NVIDIA GPUs (``nvidia-smi``); empty without one or with IMAGEBUILD_NO_GPU=1.
    With ``--engine`` the host is the engine's node (remote_engine.facts, over ssh)."""
    if os.environ.get(NO_GPU_ENV) == "1":
        return []
    from imagebuild.core import remote_engine

    eng = remote_engine.active()
    if eng is not None:
        return list(remote_engine.facts(eng).gpus or [])
    if run_mod.which("nvidia-smi") is None:
        return []
    try:
        proc = run_mod.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], check=False, timeout=30)
    except OperationFailed:
        return []
    if proc.returncode != 0:
        return []
    return [ln.strip() for ln in proc.stdout.decode("utf-8", "replace").splitlines() if ln.strip()]


def _inspect(ref: str) -> dict:
    return identity_mod.inspect_data(
        ref, hint="docker image ls; build it first (imagebuild build), or pass --ref")


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ------------------------------------------------------------------------------------------------ target


@dataclass(frozen=True)
class Target:
    root: Path  # where receipts go (the project root, or the current folder for a bare REF)
    image: str | None  # definition name, None for a bare image reference
    ref: str
    spec_path: Path
    spec_display: str
    authority: str = receipts.AUTHORITY_AD_HOC  # "definition": the definition's own spec ran
    env: dict[str, str] | None = None  # the definition's versions.env (checks' `when:`); None: a bare REF


def resolve(ctx: context_mod.Context | Path | None, target: str, *, ref: str | None = None,
            spec: str | Path | None = None) -> Target:
    """``IMAGE`` (a definition: its gate spec, ref ``IMAGE:candidate`` unless --ref) or ``REF`` + --spec;
    ``ctx`` None: no project (a bare REF with --spec; its receipt goes under the current folder)."""
    if spec is not None and not str(spec).strip():  # '' resolved to the current folder
        raise UsageError("--spec: expected a gate spec file, got an empty name",
                         hint="imagebuild gate REF --spec FILE (docs/gate.md)")
    ctx = context_mod.maybe(ctx)
    root = ctx.root if ctx is not None else None
    if root is not None and defn_mod.NAME_RE.match(target) and \
            (root / defn_mod.IMAGES_DIR / target / defn_mod.IMAGE_FILE).is_file():
        dfn = defn_mod.load(root, target)
        if spec is None:
            if dfn.gate is None:
                raise UsageError(f"image {target!r} has no gate spec",
                                 hint=f"create {defn_mod.IMAGES_DIR}/{target}/{defn_mod.DEFAULT_GATE_FILE} "
                                 "(docs/gate.md) or set `gate:` in image.yaml")
            spec_path = dfn.gate
        else:
            spec_path = Path(spec).resolve()
        # only the definition's own spec file proves its gate; any other --spec is an ad-hoc run
        own = dfn.gate is not None and spec_path.resolve() == Path(dfn.gate).resolve()
        return Target(root, target, ref or default_ref(target), spec_path, _display(root, spec_path, spec),
                      receipts.AUTHORITY_DEFINITION if own else receipts.AUTHORITY_AD_HOC, dfn.env.values())
    if spec is None:
        if root is not None and defn_mod.NAME_RE.match(target):  # a name: said as every command says it
            raise defn_mod.unknown_image(root, target, note="to gate an image reference, give its gate spec: "
                                         "imagebuild gate REF --spec FILE")
        where = f"under {root / defn_mod.IMAGES_DIR}" if root else "(no project root found)"
        raise UsageError(f"{target!r} is not an image definition {where}",
                         hint="to gate an image reference, give its gate spec: imagebuild gate REF --spec FILE")
    if ref is not None:
        raise UsageError("--ref only goes with an IMAGE (a definition name); here REF is the image",
                         hint=f"imagebuild gate {ref} --spec {spec}")
    spec_path = Path(spec).resolve()
    base = root or Path.cwd()
    return Target(base, None, target, spec_path, _display(base, spec_path, spec))


def _display(root: Path, path: Path, given=None) -> str:
    shown = defn_mod.display_path(root, path)
    return str(given) if given is not None and shown.startswith("../") else shown


# ------------------------------------------------------------------------------------------------ pytest


PLUGIN_KEY = pytest.StashKey["GatePlugin"]()


@dataclass
class _Result:
    outcome: str = "failed"
    detail: str = "not run"
    duration_s: float = 0.0
    ran: bool = False


class GateFile(pytest.File):
    def collect(self):
        plugin = self.config.stash[PLUGIN_KEY]
        for c in plugin.spec.checks:
            yield GateItem.from_parent(self, name=c.id, check=c)


class GateItem(pytest.Item):
    def __init__(self, *, check: gatespec.Check, **kw):
        super().__init__(**kw)
        self.check = check
        self.add_marker(pytest.mark.imagebuild_gate)

    def runtest(self) -> None:
        self.config.stash[PLUGIN_KEY].run_check(self.check)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, gatechecks.CheckFailed):
            return excinfo.value.detail
        return f"{excinfo.type.__name__}: {excinfo.value}"

    def reportinfo(self):
        return self.path, self.check.line - 1, f"{self.check.kind} check {self.check.id}"


@dataclass(eq=False)  # hashed by identity: pytest 9.0 keeps its plugins in a set
class GatePlugin:
    spec: gatespec.GateSpec
    container: str
    inspect: dict
    gpu: bool
    require_gpu: bool
    env: dict[str, str] | None = None  # the definition's versions.env, for checks' `when:`
    transcript: list[str] = field(default_factory=list)
    results: dict[str, _Result] = field(default_factory=dict)
    collected: int = 0
    timed_out: bool = False
    _host: object = None

    def pytest_configure(self, config) -> None:
        config.stash[PLUGIN_KEY] = self
        config.addinivalue_line("markers", "imagebuild_gate: a check of an imagebuild gate spec")

    def pytest_collect_file(self, file_path, parent):
        if Path(file_path) == self.spec.path:
            return GateFile.from_parent(parent, path=file_path)
        return None

    def pytest_collection_modifyitems(self, items) -> None:
        self.collected = len(items)

    def pytest_runtest_logreport(self, report) -> None:
        cid = report.nodeid.rsplit("::", 1)[-1]
        r = self.results.setdefault(cid, _Result())
        r.duration_s += report.duration
        if report.when == "call" or (report.when == "setup" and not report.passed):
            r.ran = True
            if report.passed:
                r.outcome = "passed"
            elif report.skipped and hasattr(report, "wasxfail"):
                r.outcome = "warned"
            elif report.skipped:
                r.outcome = "skipped"
            else:
                r.outcome = "failed"
                if r.detail == "not run":
                    r.detail = report.longreprtext.strip().splitlines()[-1] if report.longreprtext else "failed"
        elif report.when == "teardown" and report.failed:
            r.outcome, r.detail = "failed", report.longreprtext.strip()[:300]
        if report.when == "teardown":
            log.info("  %-7s %s  %s", _LABEL[r.outcome], cid, r.detail)

    # the one thing each item does
    def run_check(self, check: gatespec.Check) -> None:
        r = self.results.setdefault(check.id, _Result())
        unmet = check.when_unmet(self.env)
        if unmet is not None:
            r.detail = unmet
            if self.env is None:  # cannot tell whether it applies: never silently passed
                pytest.fail(r.detail, pytrace=False)
            pytest.skip(r.detail)
        if check.requires_gpu and not self.gpu:
            if self.require_gpu:
                r.detail = "requires a GPU; this host has none (--require-gpu)"
                pytest.fail(r.detail, pytrace=False)
            r.detail = "requires a GPU; this host has none"
            pytest.skip(r.detail)
        if self.timed_out:
            r.detail = f"not run: the gate timed out after {self.spec.timeout_s} s"
            pytest.fail(r.detail, pytrace=False)
        ctx = gatechecks.Context(self.host, self.spec.python, self.inspect, self.transcript.append)
        try:
            r.detail = gatechecks.CHECKS[check.kind](ctx, check)
        except gatechecks.CheckFailed as exc:
            r.detail = exc.detail
            if self.timed_out:
                r.detail = f"the gate timed out after {self.spec.timeout_s} s ({exc.detail})"
            if check.severity == "warn":
                pytest.xfail(r.detail)
            raise
        except Exception as exc:  # the check could not run (docker exec failed, ...): a failure too
            r.detail = f"could not run: {type(exc).__name__}: {str(exc).strip()[:200]}"
            if check.severity == "warn":
                pytest.xfail(r.detail)
            raise gatechecks.CheckFailed(r.detail) from exc

    @property
    def host(self):
        if self._host is None:
            import testinfra

            self._host = testinfra.get_host(f"docker://{self.container}")
        return self._host


_LABEL = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIPPED", "warned": "WARN"}


def _pytest_args(spec_path: Path, ini: Path, junit: Path | None) -> list[str]:
    args = [str(spec_path), "-c", str(ini), "--rootdir", str(spec_path.parent), "--noconftest",
            "-p", "no:cacheprovider", "-p", "no:faulthandler", "-p", "no:stepwise", "-p", "no:terminal",
            "-s", "-o", "junit_suite_name=imagebuild-gate", "-o", "junit_family=xunit2",
            "-o", "junit_logging=no", "-o", "console_output_style=classic"]
    if junit is not None:
        args += ["--junitxml", str(junit)]
    return args


@contextlib.contextmanager
def _clean_pytest_env():
    """No PYTEST_* of the caller; and pytest-testinfra's ``docker exec`` (its own subprocesses) reaches the
    engine of the build (``--engine``: remote_engine.use), through this process's environment."""
    from imagebuild.core import run as run_mod

    saved = {k: os.environ.pop(k) for k in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS") if k in os.environ}
    engine = run_mod.engine_env()
    saved.update({k: os.environ[k] for k in engine if k in os.environ and k not in saved})
    added = [k for k in engine if k not in os.environ]
    for k, v in engine.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)
        os.environ.update(saved)


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM (e.g. a CI cancel) ends the gate like Ctrl-C: the container is still removed, and a
    second signal cannot cut that removal short (core/interrupts.py; the CLI has installed it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with interrupts.as_interrupt():
        yield


# ------------------------------------------------------------------------------------------------ container


def _emulation(data: dict) -> dict | None:
    """How a foreign image runs here: None for the engine's own architecture; else what the receipt
    records (the image's and the host's architectures, and the handler that runs it). Refuses (exit 3)
    when nothing can run it, saying how to register a handler."""
    from imagebuild.core import emulation, engine, remote_engine

    image_arch = emulation.docker_arch(str(data.get("Architecture") or "")) if data.get("Architecture") else None
    if image_arch is None or image_arch == emulation.docker_arch(platform.machine()) and remote_engine.active() is None:
        return None
    host = engine.probe().architecture or platform.machine()  # the engine's (--engine: another node's)
    host_arch = emulation.docker_arch(host)
    if image_arch == host_arch:
        return None
    how = emulation.check(f"linux/{image_arch}", engine_arch=host)
    # an AArch64 /proc/cpuinfo for the container (emulation.aarch64_cpuinfo): only where the bind source
    # is on this machine, i.e. a local engine
    cpuinfo = image_arch == "arm64" and remote_engine.active() is None
    return {"image_arch": image_arch, "host_arch": host_arch, "how": how,
            "cpuinfo": "aarch64 stand-in bind-mounted on /proc/cpuinfo" if cpuinfo else None}


def _start_container(name: str, ref: str, identity_digest: str, gpu: bool, emulated: dict | None = None,
                     tmp: Path | None = None) -> None:
    # the owner label says which process gated: a container whose owner is gone is reaped (leftovers.py)
    argv = ["docker", "run", "-d", "--name", name, "--label", f"{CONTAINER_LABEL}={identity_digest}",
            "--label", f"{leftovers.OWNER_LABEL}={runs.owner()}",
            "--pull", "never", "--network", "none", "--entrypoint", "/bin/sh"]
    if gpu:
        argv += ["--gpus", "all"]
    if emulated is not None:
        argv += ["--platform", f"linux/{emulated['image_arch']}"]
        if emulated.get("cpuinfo") and tmp is not None:
            from imagebuild.core import emulation

            cpuinfo = tmp / "cpuinfo"
            cpuinfo.write_text(emulation.aarch64_cpuinfo(os.cpu_count() or 1), encoding="ascii")
            argv += ["--mount", f"type=bind,source={cpuinfo},target=/proc/cpuinfo,readonly"]
    argv += [ref, "-c", KEEPALIVE]
    run_mod.run(argv, timeout=120, hint="the gate needs /bin/sh in the image; with a GPU, the NVIDIA "
                "container toolkit (docker run --gpus all)")


def _remove_container(name: str) -> None:
    with contextlib.suppress(OperationFailed):
        run_mod.run(["docker", "rm", "-f", "-v", name], check=False, timeout=60)


def _container_log(name: str) -> str:
    try:
        proc = run_mod.run(["docker", "logs", name], check=False, timeout=60)
    except OperationFailed as exc:
        return f"(docker logs failed: {exc.message})\n"
    return proc.stdout.decode("utf-8", "replace")


# ------------------------------------------------------------------------------------------------ run


def _check_receipts_dir(target: Target) -> None:
    from imagebuild.core.fsutil import usable_dir

    usable_dir(receipts.receipts_dir(target.root),
               "IMAGEBUILD_STATE_DIR" if os.environ.get("IMAGEBUILD_STATE_DIR") else "the state folder",
               hint="IMAGEBUILD_STATE_DIR names a folder this user can write (default <project>/.imagebuild); "
               "the receipt and the gate's log go under it")


def execute(target: Target, *, require_gpu: bool = False, junit: Path | None = None) -> receipts.Receipt:
    """Run the gate for ``target``; write the log and the receipt; return the receipt (pass or fail)."""
    spec = gatespec.load(target.spec_path, display=target.spec_display)  # exit 2 before touching docker
    key = signing.signing_key(context_mod.of(target.root).config)  # a bad key setting too
    _check_receipts_dir(target)  # and where the receipt goes: not an internal error after the checks ran
    started, t0 = _now(), time.monotonic()
    data = _inspect(target.ref)
    ident = identity_mod.from_inspect(data)
    gpus = detect_gpus()
    gpu = bool(gpus)
    emulated = _emulation(data)
    if emulated is not None:
        log.info("the image is linux/%s, this host linux/%s: its checks run under emulation (%s)",
                 emulated["image_arch"], emulated["host_arch"], emulated["how"])
    log.info("gate %s (%s) with %s: %d check(s), %s", target.ref, ident.digest[:19], target.spec_display,
             len(spec.checks), f"GPU: {gpus[0]}" if gpu else "no GPU on this host")

    leftovers.reap()  # containers of gates killed with -9 would sleep forever
    name = f"{CONTAINER_PREFIX}{ident.digest[7:19]}-{secrets.token_hex(4)}"
    plugin = GatePlugin(spec, name, data, gpu, require_gpu, target.env)
    container_log = ""
    exit_code = None
    reason = None
    if not spec.checks:
        reason = "no checks in the gate spec (a gate with zero checks fails)"
    else:
        watchdog = threading.Timer(spec.timeout_s, _timeout, args=(plugin, name))
        watchdog.daemon = True
        try:
            with _sigterm_as_interrupt():
                log.info("starting container %s (entrypoint overridden, --network none%s)", name,
                         ", --gpus all" if gpu else "")
                with tempfile.TemporaryDirectory(prefix=state.GATE_TMP_PREFIX) as tmp, _clean_pytest_env(), \
                        held(Path(tmp) / state.GATE_TMP_LOCK):
                    _start_container(name, target.ref, ident.digest, gpu, emulated, Path(tmp))
                    watchdog.start()
                    ini = Path(tmp) / "pytest.ini"
                    ini.write_text("[pytest]\n", encoding="utf-8")
                    # pytest writes the report beside its ini; it reaches --junit whole, in one rename,
                    # creating the missing parent folders, and not at all when the run was interrupted
                    tmp_junit = Path(tmp) / "junit.xml" if junit is not None else None
                    exit_code = pytest.main(_pytest_args(spec.path, ini, tmp_junit), plugins=[plugin])
                    if tmp_junit is not None and tmp_junit.is_file() and \
                            exit_code != pytest.ExitCode.INTERRUPTED:
                        atomic_write_bytes(Path(junit), tmp_junit.read_bytes())
                if exit_code == pytest.ExitCode.INTERRUPTED:
                    raise KeyboardInterrupt
        finally:
            watchdog.cancel()
            if watchdog.is_alive():  # a timeout is removing the container right now: let it finish
                watchdog.join(120)
            container_log = _container_log(name)
            _remove_container(name)
        if exit_code == pytest.ExitCode.INTERNAL_ERROR:
            reason = (f"pytest {pytest.__version__} failed internally (INTERNAL_ERROR, its traceback is in the "
                      "log): no check ran")
        elif exit_code == pytest.ExitCode.NO_TESTS_COLLECTED or plugin.collected == 0:
            reason = "no checks collected (a gate with zero checks fails)"
        elif exit_code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
            reason = f"pytest ended with {pytest.ExitCode(exit_code).name}"
        elif plugin.timed_out:
            reason = f"the gate timed out after {spec.timeout_s} s"

    checks = []
    for c in spec.checks:
        r = plugin.results.get(c.id) or _Result()
        checks.append({"id": c.id, "kind": c.kind, "severity": c.severity, "requires_gpu": c.requires_gpu,
                       "description": c.description, "outcome": r.outcome, "detail": r.detail,
                       "duration_s": round(r.duration_s, 3)})
    summary = {o: sum(1 for c in checks if c["outcome"] == o) for o in receipts.OUTCOMES}
    summary["total"] = len(checks)
    failed = [c for c in checks if c["outcome"] == "failed"]
    if reason is None and failed:
        reason = f"{len(failed)} check(s) failed: " + ", ".join(c["id"] for c in failed)
    gpu_skipped = any(c["requires_gpu"] and c["outcome"] == "skipped" for c in checks)
    spec_digest = "sha256:" + sha256_file(spec.path)
    log_file = receipts.log_path(target.root, ident.digest, spec_digest)
    doc = {
        "schema": receipts.SCHEMA, "version": receipts.VERSION,
        "result": "failed" if reason else "passed",
        "reason": reason,
        "authority": target.authority,
        "identity": {"digest": ident.digest, **ident.document()},
        "image": {"ref": target.ref, "definition": target.image, "local_id": ident.local_id},
        "spec": {"file": target.spec_display, "sha256": spec_digest, "python": spec.python},
        "require_gpu": require_gpu,
        "gpu_checks_skipped": gpu_skipped,
        "summary": summary,
        "checks": checks,
        "host": {"hostname": socket.gethostname(), "arch": platform.machine(), "gpus": gpus,
                 "gpu_model": gpus[0] if gpus else None},
        "emulated": emulated,
        "imagebuild_version": __version__,
        "run": {"started": started, "finished": _now(), "duration_s": round(time.monotonic() - t0, 3)},
        "log": log_file.relative_to(receipts.receipts_dir(target.root).parent).as_posix(),
    }
    text = (f"# imagebuild gate {target.ref} {ident.digest} ({started})\n"
            + "".join(t if t.endswith("\n") else t + "\n" for t in plugin.transcript)
            + f"# container log ({name})\n" + container_log)
    atomic_write_text(log_file, text)
    if key is not None:
        log.info("signing the receipt with %s (ssh-keygen -Y sign, namespace %s)", key, signing.NAMESPACE)
    return receipts.write(target.root, doc, key=key)


def _timeout(plugin: GatePlugin, name: str) -> None:
    plugin.timed_out = True
    log.warning("gate timed out after %d s: removing container %s", plugin.spec.timeout_s, name)
    _remove_container(name)


def run_gate(ctx: context_mod.Context | Path, image: str | None, ref: str | None = None, *, require_gpu: bool = False,
             junit: Path | None = None, spec: Path | None = None) -> receipts.Receipt:
    """Gate ``image`` (a definition name; its gate spec) at ``ref`` (default ``IMAGE:candidate``),
    or, with ``image=None``, the image ``ref`` against ``spec``. Raises ``GateFailed`` (exit 4)
    after writing the receipt when the gate fails."""
    if image is not None:
        target = resolve(ctx, image, ref=ref, spec=spec)
    else:
        if ref is None or spec is None:
            raise UsageError("gating an image reference needs both the reference and a spec")
        target = resolve(ctx, ref, spec=spec)
    receipt = execute(target, require_gpu=require_gpu, junit=junit)
    if not receipt.passed:
        raise failure(receipt)
    return receipt


def failure(receipt: receipts.Receipt) -> GateFailed:
    d = receipt.data
    return GateFailed(f"gate of {d['image']['ref']} failed: {d['reason']}",
                      hint=f"the log of every command: {_shown(receipt.path.with_suffix('.log'))}; "
                      f"the receipt: {_shown(receipt.path)}")


def _shown(path: Path) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return str(path)
    return str(path) if rel.startswith("..") else rel


def render_table(receipt: receipts.Receipt, root: Path | None = None) -> str:
    """The human table of a receipt: one row per check, then the verdict."""
    d = receipt.data
    rows = [(_LABEL[c["outcome"]] + (" (warn)" if c["severity"] == "warn" and c["outcome"] == "passed" else ""),
             c["id"], c["kind"] + (" [gpu]" if c["requires_gpu"] else ""), c["detail"]) for c in d["checks"]]
    head = ("RESULT", "CHECK", "KIND", "DETAIL")
    w = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    lines = [f"gate {d['image']['ref']}  identity {d['identity']['digest']}",
             f"spec {d['spec']['file']} ({d['spec']['sha256'][:19]}, {d['authority']})  host {d['host']['hostname']} ({d['host']['arch']}, "
             f"{'GPU: ' + d['host']['gpu_model'] if d['host']['gpu_model'] else 'no GPU'})", ""]
    lines += [f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}" for r in [head, *rows]]
    s = d["summary"]
    verdict = "PASSED" if receipt.passed else "FAILED"
    lines += ["", f"{verdict}: {s['passed']} passed, {s['failed']} failed, {s['warned']} warned, "
              f"{s['skipped']} skipped of {s['total']}" + (f" ({d['reason']})" if d["reason"] else "")]
    if d["gpu_checks_skipped"]:
        lines.append("GPU checks skipped: no GPU on this host (run with a GPU, or --require-gpu to make that a "
                     "failure)")
    if d["authority"] == receipts.AUTHORITY_AD_HOC:
        lines.append("ad-hoc spec: this receipt never authorizes a promotion (only the definition's own gate "
                     "spec does)")
    lines.append(f"receipt {_shown(receipt.path)}")
    sig = Path(str(receipt.path) + signing.SIG_SUFFIX)
    if sig.is_file():
        lines.append(f"signed  {_shown(sig)} (ssh-keygen -Y, namespace {signing.NAMESPACE})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ `gate` alone


@dataclass(frozen=True)
class Pending:
    """What ``imagebuild gate`` with no IMAGE does with one definition: ``target`` to gate, or none and
    ``status`` (skipped, already-gated, failed) with ``detail`` saying why."""

    image: str
    status: str  # "gate", "skipped", "already-gated", "failed"
    detail: str
    target: Target | None = None
    exit_code: int = 0  # "failed": the error's exit code


def pending(ctx: context_mod.Context | Path) -> list[Pending]:
    """Every definition of the project, in name order, with what a bare ``imagebuild gate`` does with it.

    The rule (docs/cli.md): the newest build of the image recorded here (its run record with a release,
    ``imagebuild log IMAGE``) is gated, as its release tag ``IMAGE:b-<build id>``, when no receipt of
    the definition's current gate spec exists for its identity. Skipped, saying why: a definition
    without a gate spec, one never built here, a release no longer in the engine, and a build that
    already has a receipt of that spec (passed or failed: ``imagebuild gate IMAGE --ref REF`` runs it
    again). A definition that does not load is failed (exit 2)."""
    from imagebuild.core.errors import DefinitionError

    ctx = context_mod.of(ctx)
    out: list[Pending] = []
    for name in defn_mod.list_images(ctx.root):
        try:
            dfn = defn_mod.load(ctx.root, name)
        except DefinitionError as exc:
            out.append(Pending(name, "failed", f"{exc.message}: imagebuild validate {name}",
                               exit_code=exc.exit_code))
            continue
        if dfn.gate is None:
            out.append(Pending(name, "skipped", "no gate spec"))
            continue
        built = next((r.summary() for r in runs.list_runs(ctx, name) if r.summary()["identity"]
                      and r.summary()["build_id"]), None)
        if built is None:
            out.append(Pending(name, "skipped", f"no build recorded here (imagebuild build {name})"))
            continue
        ref = f"{name}:b-{built['build_id']}"
        try:
            ident = identity_mod.inspect(ref)
        except OperationFailed:
            out.append(Pending(name, "skipped", f"the release {ref} of run {built['run_id']} is no longer in the "
                               f"engine (imagebuild build {name} makes it again)"))
            continue
        if ident.digest != built["identity"]:
            out.append(Pending(name, "skipped", f"{ref} is identity {ident.digest}, not the {built['identity']} "
                               f"run {built['run_id']} recorded (imagebuild build {name})"))
            continue
        spec_digest = gatespec.digest(dfn.gate)
        have = receipts.read(ctx, ident.digest, spec_digest)
        if have is not None:
            path = receipts.receipt_path(ctx, ident.digest, spec_digest)
            out.append(Pending(name, "already-gated", f"{ref} already gated: {have.get('result')} "
                               f"(receipt {_shown(path)})"))
            continue
        out.append(Pending(name, "gate", ref, resolve(ctx, name, ref=ref)))
    return out
