"""A peer node as ``imagebuild sync`` sees it: one ssh connection (multiplexed), the shell agent
(``peer_agent.py``) run through it, and what a probe learns about the peer.

The peer is reached only through ``$IMAGEBUILD_SSH`` (remote.py) and its own ``docker`` CLI; never
through a TCP socket of its engine. Nothing is installed there.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shlex
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from imagebuild.core import emulation, remote
from imagebuild.core import run as run_mod
from imagebuild.core.errors import GuardRefused, OperationFailed
from imagebuild.ship import peer_agent

log = logging.getLogger("imagebuild")

# aes128-gcm moved data 1.5x faster than chacha20 on this machine class (../shared/FACTS.md); "^" puts
# it first in ssh's own list, so a peer without it still negotiates
DEFAULT_CIPHERS = "^aes128-gcm@openssh.com,aes256-gcm@openssh.com"
STAGING_REPO = "imagebuild-incoming"


class PeerUnreachable(OperationFailed):
    pass


class AgentFailed(OperationFailed):
    def __init__(self, host: str, code: str, message: str, output: str = ""):
        self.host, self.code, self.detail, self.output = host, code, message, output
        super().__init__(f"{host}: {message}")


class StepTimeout(OperationFailed):
    """A remote step gave no answer within its bound."""


class AgentRefused(GuardRefused):
    def __init__(self, host: str, message: str):
        self.host = host
        super().__init__(f"{host}: {message}")


@dataclass
class AgentResult:
    host: str
    rc: int
    text: str
    sections: dict[str, str]
    sent: int  # bytes of script sent

    def section(self, name: str) -> str:
        return self.sections.get(name, "")

    def lines(self, name: str) -> list[str]:
        return [ln for ln in self.section(name).splitlines() if ln.strip()]


def parse_sections(text: str) -> tuple[dict[str, str], tuple[str, str] | None]:
    sections: dict[str, list[str]] = {}
    cur = "_"
    error = None
    for line in text.splitlines():
        if line.startswith("@@error "):
            _, code, *msg = line.split(" ", 2)
            error = (code, msg[0] if msg else "")
            continue
        if line.startswith("@@") and not line.startswith("@@rc "):
            cur = line[2:].strip()
            sections.setdefault(cur, [])
            continue
        sections.setdefault(cur, []).append(line)
    return {k: "\n".join(v) for k, v in sections.items()}, error


def _start_time(pid: int | str) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, /proc/PID/stat field 22), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def sender_token() -> str:
    """Who holds a peer's sync lock, from this side: this machine's boot id, this process's pid and
    start time (``BOOT:PID:START``): a later sync from this machine can tell whether that process is
    gone (``dead_sender``)."""
    return f"{_boot_id() or '-'}:{os.getpid()}:{_start_time(os.getpid()) or '-'}"


def dead_sender(holder: str) -> str:
    """The sender token of the holder record ``holder`` (``... sender BOOT:PID:START``) when that sender
    ran on this machine, since its last boot, and is gone: its ssh connection is gone with it (after a
    cut link the peer's sshd may not notice for minutes, or ever, and its session holds the lock). ''
    when it lives, ran elsewhere, or the record says no sender."""
    words = holder.split()
    if "sender" not in words[:-1]:
        return ""
    token = words[words.index("sender") + 1]
    boot, _, rest = token.partition(":")
    pid, _, start = rest.partition(":")
    if not boot or boot != _boot_id() or not pid.isdigit() or not start.isdigit():
        return ""
    return token if _start_time(pid) != start else ""


class Connection:
    """One ssh session to a peer that runs the agent for the whole conversation: the library is sent
    once, then each call is a frame (``@@call ID N`` + N bytes of script) answered by its output and
    ``@@done ID RC``. One ssh connection and one remote shell per sync, whatever the number of steps
    (each ssh session start costs 0.2-0.6 s: key exchange, the remote login shell). rsync opens its own
    connection with the same options (``rsync_shell``). ``close()`` ends the session: the agent exits
    when its stdin closes (a step that runs finishes first)."""

    def __init__(self, host: str):
        self.host = host
        self.proc = None  # the ssh session (core/run.popen)
        self.bytes_sent = 0
        self._lines: queue.Queue = queue.Queue()
        self._seq = 0
        self._early: list[str] = []
        self.timings: list[tuple[str, float]] = []  # (what, seconds) of the session start and each call
        self.control: str | None = None  # the ssh control socket, once a master runs

    # -- the ssh command line

    def options(self) -> list[str]:
        opts = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={remote.CONNECT_TIMEOUT_S}",
                "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4"]
        ciphers = os.environ.get("IMAGEBUILD_SYNC_CIPHERS", DEFAULT_CIPHERS)
        if ciphers:
            opts += ["-o", f"Ciphers={ciphers}"]
        if self.control:
            opts += ["-o", f"ControlPath={self.control}", "-o", "ControlMaster=no"]
        return opts

    # -- connection sharing

    def _control_path(self) -> str | None:
        """A control socket shared by the ssh calls of this user to this peer with this ssh command
        (``IMAGEBUILD_SSH_MUX=0``: none). Its master persists 60 s after the last use, so a sync
        started right after another (sync, then nightly's sync) skips the key exchange."""
        if os.environ.get("IMAGEBUILD_SSH_MUX", "1") == "0":
            return None
        import hashlib

        key = hashlib.sha256("\0".join([*remote.ssh_command(), self.host]).encode()).hexdigest()[:20]
        d = Path(tempfile.gettempdir()) / f"imagebuild-sync-ssh-{os.getuid()}"
        try:
            d.mkdir(mode=0o700, exist_ok=True)
            if d.stat().st_uid != os.getuid() or d.stat().st_mode & 0o077:
                return None
        except OSError:
            return None
        return str(d / key)

    def _ensure_master(self, ctl: str) -> None:
        base = [*remote.ssh_command(), "-o", f"ControlPath={ctl}"]
        if run_mod.run([*base, "-O", "check", "--", self.host], check=False).returncode == 0:
            return
        opts = [o for o in self.options() if not o.startswith(("ControlPath", "ControlMaster"))]
        opts = [o for i, o in enumerate(opts) if not (o == "-o" and i + 1 < len(opts) and
                                                       opts[i + 1].startswith(("ControlPath", "ControlMaster")))]
        argv = [*base, "-f", "-N", "-o", "ControlMaster=yes", "-o", "ControlPersist=60", *opts, "--",
                remote.check_destination(self.host)]
        # the master goes to the background once authenticated (its stderr into a file: it outlives this call)
        rc, err = run_mod.detach(argv, timeout=60, hint="install an ssh client")
        if rc is None:
            raise PeerUnreachable(f"cannot reach {self.host} over ssh: no answer within 60 s",
                                  hint=f"check `ssh {self.host} true`")
        if rc != 0:
            raise self._unreachable(err, rc)

    def ssh_argv(self, *remote_cmd: str) -> list[str]:
        return [*remote.ssh_command(), *self.options(), "--", remote.check_destination(self.host), *remote_cmd]

    def rsync_shell(self) -> str:
        """The ``rsync -e`` value: the same ssh command and options."""
        return shlex.join([*remote.ssh_command(), *self.options()])

    # -- the session

    def open(self, timeout: float = 60) -> None:
        """Start the session. Raises PeerUnreachable with ssh's own words."""
        t_open = time.monotonic()
        ctl = self._control_path()
        if ctl:
            self._ensure_master(ctl)
            self.control = ctl
        boot = (peer_agent.AGENT + peer_agent.LOOP).encode()
        argv = self.ssh_argv(f"sh -c 'eval \"$(head -c {len(boot)})\"'")
        self.proc = run_mod.popen(argv, merge_stderr=True, hint="install an ssh client")
        threading.Thread(target=self._reader, daemon=True, name=f"ssh-{self.host}").start()
        try:
            self.proc.stdin.write(boot)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        self.bytes_sent += len(boot)
        deadline = time.monotonic() + timeout
        while True:
            line = self._next(deadline)
            if line is None:
                self._kill()
                text = "\n".join(self._early)
                rc = self.proc.returncode if self.proc.returncode is not None else 255
                raise self._unreachable(text, rc) if rc == 255 or not text.startswith("@@") else \
                    AgentFailed(self.host, "start", f"the agent did not start: {text[-300:]}")
            if line.startswith("@@ready"):
                self.timings.append(("ssh session", round(time.monotonic() - t_open, 3)))
                return
            self._early.append(line)

    def _reader(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            self._lines.put(raw.decode("utf-8", "replace").rstrip("\n"))
        self._lines.put(None)

    def _next(self, deadline: float | None, beat=None) -> str | None:
        """The next line; None when the session ended. ``beat``: (seconds, fn) calls fn() each time
        that many seconds pass without the line. A StepTimeout at the deadline."""
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if beat is not None:
                wait = beat[0] if wait is None else min(wait, beat[0])
            try:
                line = self._lines.get(timeout=wait)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise StepTimeout(f"{self.host}: no answer from the peer within the time allowed") from None
                beat[1]()
                continue
            if line is None:
                run_mod.wait(self.proc, 5)
                return None
            return line

    def _unreachable(self, text: str, rc: int) -> PeerUnreachable:
        key = remote.host_key_trouble(text, self.host)
        if key is not None:  # not a password problem: say what ssh refused
            return PeerUnreachable(f"cannot reach {self.host} over ssh: ssh refused it: {key[0]}", hint=key[1])
        lines = [ln for ln in text.strip().splitlines() if ln.strip() and "Warning: Permanently added" not in ln]
        why = lines[-1] if lines else f"ssh exit {rc}"
        return PeerUnreachable(f"cannot reach {self.host} over ssh: {why}",
                               hint=f"make `ssh {self.host} true` work without a password (check the host name, "
                               "~/.ssh/config, $IMAGEBUILD_SSH)")

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            # a call that waits for an answer hears at once that the session ended: the session's output
            # pipe may stay open long after (the ssh ControlMaster holds a mux client's stdio)
            self._lines.put(None)

    def close(self, wait: float = 10) -> None:
        """End the session: the agent exits when its stdin closes; ssh is waited for ``wait`` seconds,
        then killed (the peer's step, if one still runs, finishes)."""
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        if run_mod.wait(self.proc, wait) is None:
            self._kill()
        self.proc = None

    def hold(self, name: str, wait: int, run_id: str = "", on_wait=None, dead: str = "") -> tuple[bool, str]:
        """Take the peer's lock ``name`` (hex) for the rest of this session (the agent's ``ib_hold``):
        waits up to ``wait`` seconds for another session that holds it (``on_wait(holder)`` is told
        once), then AgentFailed with code ``busy``. Returns (whether it waited, the holder before).
        The holder record names this process (``sender_token``); ``dead``: the token of a holder's
        sender known to be gone (``dead_sender``): the peer ends that holder's idle session first."""
        if self.proc is None:
            self.open()
        waited, previous = False, ""
        try:
            self.proc.stdin.write(f"@@hold {name} {int(wait)} {run_id or '-'} {sender_token()} {dead or '-'}\n"
                                  .encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise PeerUnreachable(f"the ssh session to {self.host} ended", hint="rerun imagebuild sync") from None
        t0 = time.monotonic()
        out: list[str] = []
        while True:
            line = self._next(t0 + wait + 60)
            if line is None:
                raise PeerUnreachable(f"the ssh session to {self.host} ended while taking the sync lock",
                                      hint="rerun imagebuild sync")
            if line.startswith("@@waiting"):
                waited = True
                if on_wait is not None:
                    on_wait(line[len("@@waiting"):].strip())
                continue
            if line.startswith("@@ended"):
                log.info("%s: the sync that held this lock is gone (its process no longer runs here), and so is "
                         "its ssh connection: ended its session on the peer (%s)", self.host,
                         line[len("@@ended"):].strip())
                continue
            if line.startswith("@@previous"):
                previous = line[len("@@previous"):].strip()
                continue
            if line.startswith("@@done hold "):
                break
            out.append(line)
        self.timings.append(("lock", round(time.monotonic() - t0, 3)))
        _, error = parse_sections("\n".join(out))
        if error is not None:
            raise AgentFailed(self.host, error[0], error[1], "\n".join(out))
        return waited, previous

    def agent(self, *lines: str, timeout: float | None = 120, what: str = "", heartbeat=None) -> AgentResult:
        """Run the agent steps ``lines`` as one call. Raises PeerUnreachable (the session broke),
        AgentRefused (a peer-side guard), AgentFailed (``@@error``) or StepTimeout (no answer within
        ``timeout`` seconds: the session is ended, the step may still run on the peer).
        ``heartbeat``: (seconds, fn(elapsed)) calls fn while the step runs."""
        if self.proc is None:
            self.open()
        self._seq += 1
        body = peer_agent.script(*lines).encode()
        frame = f"@@call {self._seq} {len(body)}\n".encode() + body
        log.debug("%s: agent call %d (%s, %d bytes)", self.host, self._seq, what or "step", len(frame))
        try:
            self.proc.stdin.write(frame)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise PeerUnreachable(f"the ssh session to {self.host} ended", hint="rerun imagebuild sync") from None
        self.bytes_sent += len(frame)
        t_call = time.monotonic()
        deadline = None if timeout is None else t_call + timeout
        out: list[str] = []
        rc = None
        beat = None
        if heartbeat is not None:
            beat = (heartbeat[0], lambda: heartbeat[1](time.monotonic() - t_call))
        while True:
            try:
                line = self._next(deadline, beat)
            except StepTimeout:
                self._kill()  # the session is stuck in the step: end it (the lock goes with it)
                raise StepTimeout(f"{self.host}: {what or 'a step'} did not finish within {timeout:.0f} s",
                                  hint=f"is the peer's Docker engine stuck? (ssh {self.host} docker info); the "
                                  "bound is IMAGEBUILD_SYNC_TIMEOUT (seconds, every remote step)") from None
            if line is None:
                raise PeerUnreachable(f"the ssh session to {self.host} ended during {what or 'a step'}: "
                                      f"{(out or ['no output'])[-1]}", hint="rerun imagebuild sync")
            if line.startswith(f"@@done {self._seq} "):
                rc = int(line.split()[2])
                break
            out.append(line)
        self.timings.append((what or "step", round(time.monotonic() - t_call, 3)))
        text = "\n".join(out)
        sections, error = parse_sections(text)
        if error is not None:
            code, msg = error
            if code == "refused":
                raise AgentRefused(self.host, msg)
            raise AgentFailed(self.host, code, msg, text)
        if rc != 0:
            tail = "\n".join(text.strip().splitlines()[-5:])
            raise AgentFailed(self.host, "exit", f"{what or 'the peer agent'} exited {rc}: {tail}", text)
        return AgentResult(self.host, rc, text, sections, len(frame))


# ------------------------------------------------------------------------------------------------ probe


def chain_ids(diff_ids: list[str]) -> list[str]:
    """The layer chain ids (OCI image spec): what an engine keys an unpacked layer stack by."""
    import hashlib

    out: list[str] = []
    for d in diff_ids:
        out.append(d if not out else "sha256:" + hashlib.sha256(f"{out[-1]} {d}".encode()).hexdigest())
    return out


@dataclass
class DiskFree:
    available: int  # bytes
    mount: str
    path: str


def _df(line: str) -> DiskFree | None:
    parts = line.split()
    if len(parts) < 6:
        return None
    try:
        return DiskFree(int(parts[3]) * 1024, parts[5], "")
    except ValueError:
        return None


@dataclass
class PeerImage:
    id: str
    tags: list[str]
    layers: list[str]


@dataclass
class PeerState:
    """What one probe learned (read only: a probe changes nothing on the peer)."""

    host: str
    cache: str = ""
    tools: dict[str, str] = field(default_factory=dict)
    signers: str = ""  # whether the peer verifies receipts' signatures: file | none | broken ('' unknown)
    rsync_version: str = ""
    rsync_zstd: bool = False
    dd_bytes: bool = False  # GNU dd with iflag=skip_bytes,count_bytes: the streamed load can follow a blob
    docker_error: str | None = None  # None: the engine answered
    engine: dict = field(default_factory=dict)  # docker info
    containerd_store: bool = False
    df_cache: DiskFree | None = None
    df_docker: DiskFree | None = None
    images: list[PeerImage] = field(default_factory=list)
    listing: list[tuple[str, str]] = field(default_factory=list)  # (id, repo:tag) from docker image ls
    target: dict | None = None  # docker image inspect of the target ref
    staging: dict | None = None
    containers: list[dict] = field(default_factory=list)  # running: id, image (id), config_image, name
    incoming: dict[str, int] = field(default_factory=dict)  # hex -> size in incoming/ or this image's partial/
    records: list[dict] = field(default_factory=list)
    pending: list[dict] = field(default_factory=list)
    has_receipt: bool = False
    has_signature: bool = False  # the receipt's .json.sig is there too
    quick: bool = False  # only the target was inspected (it is the image already)
    synclock: tuple[str, str] = ("none", "")  # the image's sync lock at the probe: none | free | held, its holder
    binfmt: list = field(default_factory=list)  # the peer kernel's binfmt_misc handlers (emulation.Handler)

    @property
    def store(self) -> str:
        return "containerd" if self.containerd_store else "classic"

    @property
    def server_version(self) -> str:
        return str(self.engine.get("ServerVersion") or "?")

    def chains(self) -> set[str]:
        out: set[str] = set()
        for im in self.images:
            out.update(chain_ids(im.layers))
        return out

    def image_ids(self) -> set[str]:
        return {im.id for im in self.images}

    def known_blobs(self) -> set[str]:
        """Blob digests the peer's content store holds for sure: those of images this tool loaded there
        that the engine still has (a containerd store keeps an image's content while the image exists)."""
        ids = self.image_ids()
        out: set[str] = set()
        for r in self.records:
            if r.get("image_id") in ids:
                out.update(r.get("blobs") or [])
        return out

    def listed(self, image_id: str) -> list[str]:
        return [tag for i, tag in self.listing if i == image_id]


def _json_or_none(text: str):
    text = "\n".join(ln for ln in text.splitlines() if not ln.startswith("@@")).strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _first_inspect(text: str) -> dict | None:
    data = _json_or_none(text)
    if isinstance(data, list) and data and isinstance(data[0], dict):
        return data[0]
    return None


def _norm_ref(ref: str) -> str:
    return ref.removeprefix("docker.io/").removeprefix("library/")


def _inspect_for(items: list, ref: str | None) -> dict | None:
    """The object of ``docker image inspect A B`` whose tags include ``ref``."""
    if not ref or not isinstance(items, list):
        return None
    want = _norm_ref(ref)
    for it in items:
        if isinstance(it, dict) and any(_norm_ref(t) == want for t in it.get("RepoTags") or []):
            return it
    return None


def parse_probe(host: str, res: AgentResult, target_ref: str | None = None,
                staging_ref: str | None = None) -> PeerState:
    st = PeerState(host)
    for line in res.lines("meta"):
        k, _, v = line.partition(" ")
        if k == "cache":
            st.cache = v.strip()
        elif k == "dd-bytes":
            st.dd_bytes = v.strip() == "yes"
        elif k == "signers":
            st.signers = v.strip()
        elif k == "tool":
            name, _, path = v.partition(" ")
            if path.strip():
                st.tools[name] = path.strip()
    lock = res.lines("synclock")
    if lock:
        holder = next((ln[len("holder"):].strip() for ln in lock if ln.startswith("holder")), "")
        st.synclock = (lock[0].strip(), holder)
    st.has_receipt = "present" in res.section("receipt")
    st.has_signature = "signed" in res.lines("receipt")
    if "quick" in res.sections:  # the target already is the image: only what the no-op needs was asked
        st.quick = True
        st.target = _first_inspect(res.section("target"))
        st.listing = [tuple(ln.split(" ", 1)) for ln in res.lines("target-listed") if " " in ln]
        return st
    st.rsync_version = (res.lines("rsync") or [""])[0]
    st.rsync_zstd = "zstd" in res.section("rsync")
    st.df_cache = _df((res.lines("df-cache") or [""])[-1])
    if "docker" not in st.tools:
        st.docker_error = "docker: command not found on the peer"
        return st
    info_text = res.section("info").strip()
    info = None
    for line in reversed(info_text.splitlines()):
        info = _json_or_none(line)
        if isinstance(info, dict):
            break
    if not isinstance(info, dict) or not info.get("ServerVersion"):
        why = next((ln for ln in info_text.splitlines() if "Cannot connect" in ln or "rror" in ln),
                   info_text.splitlines()[-1] if info_text else "docker info failed")
        st.docker_error = f"the peer's Docker engine does not answer: {why.strip()[:200]}"
        return st
    st.engine = info
    status = dict(info.get("DriverStatus") or [])
    st.containerd_store = str(info.get("Driver", "")).startswith("overlayfs") or \
        "io.containerd" in str(status.get("driver-type", ""))
    st.df_docker = _df((res.lines("df-docker") or [""])[-1])
    for line in res.lines("images"):
        parts = line.split("\t")
        if len(parts) != 3:
            continue
        tags, layers = _json_or_none(parts[1]) or [], _json_or_none(parts[2]) or []
        st.images.append(PeerImage(parts[0], list(tags), list(layers)))
    for line in res.lines("target-listed"):
        i, _, tag = line.partition(" ")
        st.listing.append((i, tag))
    refs = _json_or_none(res.section("refs")) or []
    st.target = _inspect_for(refs, target_ref)
    st.staging = _inspect_for(refs, staging_ref)
    for line in res.lines("containers"):
        parts = line.split("\t")
        if len(parts) == 4:
            st.containers.append({"id": parts[0], "image": parts[1], "config_image": parts[2],
                                  "name": parts[3].lstrip("/")})
    for line in res.lines("incoming"):
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0].isdigit():
            st.incoming[os.path.basename(parts[2])] = int(parts[0])
    for line in res.lines("partial"):  # this image's own partial blobs (a cut transfer): what a rerun resumes
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0].isdigit():
            name = os.path.basename(parts[2])
            st.incoming[name] = max(st.incoming.get(name, 0), int(parts[0]))
    entries: dict[str, list[str]] = {}
    for line in res.lines("binfmt"):
        name, _, rest = line.partition(" ")
        entries.setdefault(name, []).append(rest)
    st.binfmt = [h for h in (emulation.parse_entry(n, "\n".join(ls)) for n, ls in entries.items()) if h is not None]
    st.records = [r for r in (_json_or_none(ln.split(" ", 1)[1]) for ln in res.lines("records") if " " in ln)
                  if isinstance(r, dict)]
    st.pending = [r for r in (_json_or_none(ln.split(" ", 1)[1]) for ln in res.lines("pending") if " " in ln)
                  if isinstance(r, dict)]
    return st


def probe(conn: Connection, target_ref: str, staging_ref: str, identity_hex: str, spec_hex: str | None,
          quick_ids: list[str] | None = None, timeout: float = 120, lock: str = "-") -> PeerState:
    """Read-only. With ``quick_ids`` (engine ids the image has on some store: its index, manifest or
    config digest), a peer whose target already has one of them answers only what the no-op needs."""
    res = conn.agent(peer_agent.call("ib_probe", target_ref, staging_ref, identity_hex, spec_hex or "-",
                                     ",".join(quick_ids or []), lock), timeout=timeout, what="the probe")
    return parse_probe(conn.host, res, target_ref, staging_ref)


def wait_text(seconds: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(seconds))
