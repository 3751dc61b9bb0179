"""``imagebuild sync --via registry PEER...``: the peers pull the image from the shared registry
(docs/fleet.md, "Sync through the registry").

The same run as the ssh transport (sync.py), with another delivery:

1. this host pushes the image once, ``docker push`` of ``<registry>/<image>:id-<identity hex>`` (a
   tag named after the store-independent identity: it never holds anything else; layers the
   registry has, the stage layers among them, are not sent), and reads the identity back from the
   registry's config: another identity there refuses;
2. per peer, the same read-only probe, the same refusals (receipt, serving containers, disk), and
   "unchanged" when its tag already holds the identity;
3. the peer's own engine pulls it **by digest** (``docker pull <addr>/<image>@sha256:...``): the
   engine asks only for the layers it lacks, so each layer crosses a peer's link at most once;
   when the peer cannot reach the registry itself (a registry on this host's loopback, or
   ``--tunnel``), ``<addr>`` is the peer's own loopback end of an ``ssh -R`` tunnel to the registry
   (the registry's port when free there, so a ``docker login 127.0.0.1:PORT`` on the peer keeps
   working; Docker talks plain HTTP to a loopback registry);
4. the pulled image is tagged with the staging name and then **verified and promoted exactly as the
   ssh transport does** (sync._PeerSync: identity from the peer's own ``docker image inspect``,
   listed, runs with ``--pull never``; then the tag moves, ``:previous``, the receipt and the
   record); the pull's registry reference is removed from the peer.

The registry's credentials on a peer are the peer's own docker config (``docker login`` there);
none is sent from here.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shlex
import tempfile
import time
from pathlib import Path

from imagebuild.buildstep import registry_release
from imagebuild.core import registry as reg_mod
from imagebuild.core import remote
from imagebuild.core import run as run_mod
from imagebuild.core.errors import OperationFailed
from imagebuild.ship import peer as peer_mod
from imagebuild.ship import peer_agent
from imagebuild.ship import sync as sync_mod

log = logging.getLogger("imagebuild")

TAG_PREFIX = "id-"
TUNNEL_ENV = "IMAGEBUILD_SYNC_TUNNEL"  # 1: always through an ssh tunnel, 0: never, else: loopback registries only


def identity_tag(identity: str) -> str:
    return TAG_PREFIX + sync_mod._hexof(identity)


def repo_name(image: str | None, ref: str) -> str:
    """The registry repository (under the prefix) for ``ref``: the definition's name, else the ref's
    last path component."""
    return image or sync_mod._repo(ref).rsplit("/", 1)[-1]


def wants_tunnel(reg: reg_mod.Registry, tunnel: bool | None) -> bool:
    if tunnel is not None:
        return tunnel
    env = os.environ.get(TUNNEL_ENV, "")
    if env in ("0", "1"):
        return env == "1"
    return reg.insecure and os.environ.get(reg_mod.INSECURE_ENV) != "1"  # loopback: peers cannot reach it


class Delivery:
    """What the peers pull: pushed once, before any peer starts."""

    def __init__(self, reg: reg_mod.Registry, image: str | None, ref: str, identity: str, tunnel: bool | None):
        self.reg, self.ref, self.identity = reg, ref, identity
        self.repo = repo_name(image, ref)
        self.tunnel = wants_tunnel(reg, tunnel)
        self.tag = identity_tag(identity)
        self.digest: str | None = None
        self.pushed = False
        self.blobs: dict[str, int] = {}  # digest -> size of the blobs the pushed image's manifests name

    def publish(self) -> None:
        log.info("registry %s: pushing %s as %s:%s (layers the registry holds are not sent)", self.reg, self.ref,
                 self.repo, self.tag)
        doc = registry_release.push_image(self.reg, self.repo, self.ref, self.tag, self.identity)
        self.digest, self.pushed = doc["digest"], doc["pushed"]
        self.blobs = self._blob_sizes()
        log.info("registry %s: %s:%s is %s (identity %s)%s", self.reg, self.repo, self.tag, self.digest[:19],
                 self.identity, "" if self.pushed else ", already there")

    def _blob_sizes(self) -> dict[str, int]:
        """digest -> size of the config and layers of the pushed image (of each manifest of an index):
        what a peer's pull can fetch, to count what it did fetch (``pulled_bytes``)."""
        import json

        out: dict[str, int] = {}
        try:
            top = json.loads(reg_mod.inspect_raw(self.reg, self.reg.at(self.repo, self.digest),
                                                 what=f"reading {self.repo}@{self.digest[:19]}"))
            docs = [top]
            for m in top.get("manifests") or []:
                docs.append(json.loads(reg_mod.inspect_raw(self.reg, self.reg.at(self.repo, m["digest"]),
                                                           what=f"reading {self.repo}@{m['digest'][:19]}")))
            for d in docs:
                for b in [d.get("config") or {}, *(d.get("layers") or [])]:
                    if b.get("digest"):
                        out[b["digest"]] = int(b.get("size") or 0)
        except (reg_mod.RegistryError, ValueError, KeyError, TypeError, AttributeError):
            return {}
        return out

    def as_dict(self) -> dict:
        return {"registry": str(self.reg), "repository": self.reg.repo(self.repo), "tag": self.tag,
                "digest": self.digest, "pushed": self.pushed, "tunnel": self.tunnel}


# --------------------------------------------------------------------------------------------- the tunnel


class Tunnel:
    """``ssh -R 127.0.0.1:PORT:HOST:PORT`` to ``host``: the registry on the peer's loopback. A master
    connection of its own (control socket in a private folder), ended with ``ssh -O exit``."""

    def __init__(self, host: str, reg: reg_mod.Registry):
        self.host, self.reg = host, reg
        self.dir = Path(tempfile.mkdtemp(prefix="imagebuild-tunnel-"))
        self.ctl = str(self.dir / "ctl")
        self.port: int | None = None

    def _base(self) -> list[str]:
        return [*remote.ssh_command(), "-o", "BatchMode=yes", "-o", f"ConnectTimeout={remote.CONNECT_TIMEOUT_S}",
                "-S", self.ctl]

    def open(self) -> str:
        """The registry's address as the peer reaches it (127.0.0.1:PORT)."""
        rhost, _, rport = self.reg.host.rpartition(":")
        if not rhost or not rport.isdigit():
            rhost, rport = self.reg.host, "443"
        rhost = rhost.strip("[]")
        argv = [*self._base(), "-f", "-N", "-M", "-o", "ControlPersist=no", "-o", "ExitOnForwardFailure=yes",
                "--", remote.check_destination(self.host)]
        rc, err = run_mod.detach(argv, timeout=60, hint="install an ssh client")
        if rc is None:
            raise OperationFailed(f"cannot open an ssh tunnel to {self.host}: no answer within 60 s")
        if rc != 0:
            raise OperationFailed(f"cannot open an ssh tunnel to {self.host}: {err[-300:] or f'ssh exit {rc}'}",
                                  hint=f"check `ssh {self.host} true`")
        # the registry's own port on the peer's loopback when free there (a docker login of it keeps
        # working), else one the peer's sshd picks
        for want in (rport, "0"):
            rc, out, err = self._control("-O", "forward", "-R", f"127.0.0.1:{want}:{rhost}:{rport}")
            if rc == 0:
                got = out if want == "0" else want
                if got.isdigit():
                    self.port = int(got)
                    return f"127.0.0.1:{self.port}"
        raise OperationFailed(f"cannot forward the registry {self.reg} to {self.host}'s loopback over ssh: "
                              f"{(err or out)[-300:]}",
                              hint="the peer's sshd must allow remote forwarding (AllowTcpForwarding yes)")

    def _control(self, *op: str) -> tuple[int | None, str, str]:
        """A control command to the tunnel's master (``ssh -O ...``): (exit code, stdout, stderr),
        the exit code None when the master did not answer within 60 s."""
        rc, out, err = run_mod.communicate(run_mod.popen([*self._base(), *op, "--", self.host], stdin=False),
                                           timeout=60)
        return rc, out.decode("utf-8", "replace").strip(), err.decode("utf-8", "replace").strip() or \
            ("no answer within 60 s" if rc is None else "")

    def close(self) -> None:
        self._control("-O", "exit")
        for p in self.dir.iterdir():
            p.unlink(missing_ok=True)
        self.dir.rmdir()


# --------------------------------------------------------------------------------------------- per peer


class RegistryPeerSync(sync_mod._PeerSync):
    """sync._PeerSync with the registry as the delivery: the same probe, refusals, verification and
    promotion."""

    transport = "registry"

    def _preflight_tools(self, st: peer_mod.PeerState) -> None:
        if st.docker_error:
            raise OperationFailed(st.docker_error, hint=f"install Docker on {self.host} and let the ssh user use it "
                                  "(imagebuild doctor --peer " + self.host + ")")
        if "flock" not in st.tools:
            raise OperationFailed("missing on the peer: flock", hint=f"install it on {self.host} (Debian/Ubuntu: "
                                  "apt-get install util-linux)")

    def _deliver(self, st: peer_mod.PeerState, need) -> str:
        d: Delivery = self.s.delivery
        tunnel = Tunnel(self.host, d.reg) if d.tunnel else None
        try:
            addr = tunnel.open() if tunnel else d.reg.host
            where = f"{d.reg.host} through an ssh tunnel ({addr} on the peer)" if tunnel else d.reg.host
            src = f"{addr}/{d.reg.prefix + '/' if d.reg.prefix else ''}{d.repo}@{d.digest}"
            self.res.details["registry"] = {"pulled": src, "tunnel": bool(tunnel)}
            self.say("pulling %s from %s (%d of %d layers missing there, %s)", d.digest[:19], where, len(need),
                     len(self.s.img.layers), sync_mod.human(sum(la.size for la in need)))
            self.s.pause("load", self.host)
            t0 = time.monotonic()
            r = self.conn.agent(*self._pull_lines(src), timeout=sync_mod.load_timeout(self.s.img.compressed_size()),
                                what="the pull", heartbeat=self.heartbeat("pulling"))
            self.res.details["registry"]["pull_seconds"] = round(time.monotonic() - t0, 3)
            self.conn.timings.append(("docker pull", self.res.details["registry"]["pull_seconds"]))
        except peer_mod.AgentFailed as exc:
            if exc.code != "pull":
                raise
            text = "\n".join(ln for ln in exc.output.splitlines() if ln.strip() and not ln.startswith("@@"))
            raise OperationFailed(f"docker pull on the peer failed: {reg_mod.scrub(text)[-500:] or exc.message}",
                                  hint="can the peer's engine reach the registry? (--tunnel goes through ssh; "
                                  "credentials: docker login on the peer)") from None
        finally:
            if tunnel is not None:
                tunnel.close()
        # what the peer's engine really fetched: the blobs its pull reports downloading (a classic-store
        # peer whose layers came by ssh fetches them all again: it has no registry digests for them)
        pulled = pulled_blobs(r.section("pull"), d.blobs)
        if pulled is None:  # the pull's output did not say: the layers the probe found missing
            self.res.bytes_sent += sum(la.size for la in need)
            self.res.details["registry"]["pulled_bytes"] = None
        else:
            self.res.bytes_sent += sum(pulled.values())
            self.res.details["registry"]["pulled_bytes"] = sum(pulled.values())
            self.res.details["registry"]["blobs_pulled"] = sorted(pulled)
        got = self._verified(r)
        if got is None:
            raise OperationFailed(self._mismatch or "the pulled image failed verification")
        return got

    def _pull_lines(self, src: str) -> list[str]:
        s = self.s
        q = shlex.quote
        tmp = f"pull-{secrets.token_hex(4)}"
        return ["ib_lock\n", "ib_docker_ok\n",
                f"docker pull {q(src)} >\"$CACHE/{tmp}.log\" 2>&1 </dev/null || "
                f"{{ cat \"$CACHE/{tmp}.log\"; rm -f \"$CACHE/{tmp}.log\"; ib_fail pull \"docker pull failed\"; }}\n",
                "ib_sect pull\n",
                f"cat \"$CACHE/{tmp}.log\"\n",
                f"rm -f \"$CACHE/{tmp}.log\"\n",
                f"docker tag {q(src)} {q(s.staging)} </dev/null || ib_fail pull \"docker tag failed\"\n",
                f"docker image rm {q(src)} >/dev/null 2>&1 </dev/null\n",
                peer_agent.call("ib_verify", s.staging), "ib_sect end\n"]


_PULL_LINE = re.compile(r"^([0-9a-f]{12}): (.+?)\s*$")
_FETCHED = ("Pull complete", "Download complete", "Downloading", "Verifying Checksum", "Extracting")


def pulled_blobs(output: str, blobs: dict[str, int]) -> dict[str, int] | None:
    """digest -> size of the blobs a ``docker pull`` (not ``-q``) fetched, from its own lines
    (``<12 hex>: Pull complete`` / ``Download complete``; ``Already exists`` fetched nothing); None
    when the output names none of ``blobs`` at all (nothing to go by)."""
    by_short = {d.split(":", 1)[-1][:12]: d for d in blobs}
    seen: set[str] = set()
    fetched: dict[str, int] = {}
    for line in output.splitlines():
        m = _PULL_LINE.match(line.strip())
        if not m or m.group(1) not in by_short:
            continue
        d = by_short[m.group(1)]
        seen.add(d)
        if m.group(2).startswith(_FETCHED):
            fetched[d] = blobs[d]
    if not seen:
        return None
    return fetched


Delivery.worker = RegistryPeerSync  # each peer's worker when the image goes through the registry


def delivery(reg: reg_mod.Registry, tunnel: bool | None = None):
    """``sync.sync(..., delivery=delivery(reg, tunnel))``: the peers pull the image from ``reg``."""
    def make(image: str | None, ref: str, identity: str) -> Delivery:
        return Delivery(reg, image, ref, identity, tunnel)

    return make
