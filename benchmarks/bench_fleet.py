"""fleet: builds on another node's engine and a registry shared by the nodes (docs/fleet.md), against real
parts: a Debian ``docker-registry`` on this host's loopback, and three peers (scripts/peer.sh
--engine-in-netns: own namespace, sshd, own engine inside the namespace, so a peer reaches the registry only
through the ssh tunnel ``sync --via registry`` opens).

The definition: the tests' five-stage ``staged`` definition (busybox base, a prefetched source, a patch
stage), each stage given real work: 8 rounds of ``seq 1 1000000 | sha256sum`` and a 16 MB file of its own
(deterministic: the stages stay reproducible). "Node A" is this host's engine; "node B" is peer 1's engine
(``--engine ssh://root@PEER``), with a stage store of its own for every build.

Rows and the acceptance bounds they print:
- node B warm (a fresh stage store, every stage in the registry that node A filled) vs node B cold (a fresh
  stage store, ``--no-cache``, no registry): ratio <= 0.2; every warm stage pulled, none built;
- remote-engine build identity: node B's cold build on the peer's engine == node A's build on this engine;
- ``sync --via registry`` to three peers, fresh and after a one-file change: each layer fetched from the
  registry at most once per peer (its access log), bytes over each peer's link (its veth counter), vs
  ``docker save | ssh PEER docker load`` to the same three peers.

    python benchmarks/run.py fleet        # only these rows (about 10 minutes on the 2-core test machine)
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import Benchmark, sh

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PID = os.getpid()
NAME = f"fleetbench{PID}"
WORK = ("RUN i=0; while [ $i -lt 8 ]; do seq 1 1000000 | sha256sum > /dev/null; i=$((i+1)); done; "
        "seq 1 2300000 > /opt/staged/work-{stage}.txt\n")

S: dict = {}  # the shared context (set up once for every row)


class BPeer:
    """A bench peer (scripts/peer.sh up ... --engine-in-netns) in a free slot."""

    def __init__(self, name: str):
        from tests.conftest import _peer_slot

        n, self._slot = _peer_slot()
        self.env = {**os.environ, "PEER_NS": f"ibp{n}", "PEER_ADDR": f"10.77.{n}.2", "HOST_ADDR": f"10.77.{n}.1",
                    "PEER_VETH": f"ibpv{n}", "PEER_BRIDGE": f"ibpbr{n}", "PEER_BRIDGE_CIDR": f"172.29.{n}.1/24"}
        self.dir = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
        r = subprocess.run(["bash", str(ROOT / "scripts" / "peer.sh"), "up", str(self.dir), "--engine-in-netns"],
                           capture_output=True, text=True, env=self.env)
        if r.returncode != 0:
            self._slot.close()
            raise RuntimeError(f"peer {name}: {r.stderr[-400:]}")
        v = dict(ln.split("=", 1) for ln in r.stdout.splitlines() if "=" in ln)
        self.addr, self.ssh_config, self.docker_host = v["PEER_ADDR"], v["PEER_SSH_CONFIG"], v["PEER_DOCKER_HOST"]
        self.cache, self.veth, self.name = v["PEER_CACHE"], v["PEER_VETH"], name

    def docker(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", *args], env={**os.environ, "DOCKER_HOST": self.docker_host},
                              capture_output=True, text=True)

    def tx(self) -> int:
        return int((Path("/sys/class/net") / self.veth / "statistics" / "tx_bytes").read_text())

    def clear(self) -> None:
        """No image of ours and an empty sync cache (the base images stay)."""
        tags = [t for t in self.docker("image", "ls", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
                if t.split(":")[0] in (NAME, f"imagebuild/{NAME}", "imagebuild-incoming")]
        if tags:
            self.docker("image", "rm", "-f", *tags)
        shutil.rmtree(self.cache, ignore_errors=True)
        Path(self.cache).mkdir(parents=True, exist_ok=True)

    def down(self) -> None:
        subprocess.run(["bash", str(ROOT / "scripts" / "peer.sh"), "down", str(self.dir)], capture_output=True,
                       env=self.env)
        self._slot.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _cli(*args: str, stages: Path | None = None, check: bool = True) -> tuple[int, dict | None, str]:
    env = {**os.environ, "IMAGEBUILD_SSH": S["ssh"], "IMAGEBUILD_MIN_FREE_GB": "1"}
    if stages is not None:
        env["IMAGEBUILD_STAGES"] = str(stages)
    p = subprocess.run([sys.executable, "-m", "imagebuild", "--root", str(S["root"]), *args], capture_output=True,
                       text=True, cwd=str(ROOT), env=env)
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        doc = None
    if check and p.returncode != 0:
        raise RuntimeError(f"imagebuild {' '.join(args)} failed ({p.returncode}): {p.stderr[-1200:]}")
    return p.returncode, doc, p.stderr


def _store() -> Path:
    """A fresh stage store: another node's, or the same node before it built anything."""
    S["n"] = S.get("n", 0) + 1
    return S["tmp"] / f"stages-{S['n']}"


def _setup() -> None:
    if S:
        return
    from tests.conftest import DEBIAN
    from tests.fleetfixtures import BUSYBOX, fleet_project, put_on_peer, start_registry

    atexit.register(_teardown)
    S["tmp"] = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    root = S["root"] = fleet_project(S["tmp"] / "project", NAME, gate=True)
    d = root / "docker-images" / NAME
    for stage in ("base", "tools", "app", "patched", "runner"):
        f = d / f"Dockerfile.{stage}"
        f.write_text(f.read_text() + WORK.format(stage=stage))
    S["registry"] = start_registry(S["tmp"] / "registry")
    S["reg"] = f"{S['registry'].addr}/bench"
    S["peers"] = [BPeer(f"fleet{i}") for i in range(3)]
    cfg = S["tmp"] / "ssh_config"
    cfg.write_text("".join(Path(p.ssh_config).read_text() + "\n" for p in S["peers"]))
    S["ssh"] = f"ssh -F {cfg}"
    put_on_peer(S["peers"][0], BUSYBOX, DEBIAN)
    # node A fills the registry (stages, release tags) and gates the image here
    _, a, _ = _cli("build", NAME, "--cache-registry", S["reg"], "--json", stages=_store())
    S["a"] = a


def _teardown() -> None:
    if not S:
        return
    for p in S.get("peers", []):
        p.clear()
        p.down()
    if "registry" in S:
        S["registry"].stop()
    for repo in (NAME, f"imagebuild/{NAME}"):
        tags = subprocess.run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", repo],
                              capture_output=True, text=True).stdout.split()
        if tags:
            subprocess.run(["docker", "image", "rm", "-f", *tags], capture_output=True)
    shutil.rmtree(S["tmp"], ignore_errors=True)
    S.clear()


def _node_b() -> str:
    return f"ssh://root@{S['peers'][0].addr}"


# ----------------------------------------------------------------------------------------------- rows


def _warm_row() -> Benchmark:
    b = Benchmark("fleet: node B build, warm registry cache (baseline: node B cold build, 5 stages)",
                  lambda: None, lambda: None, repeat=3, note="bound: ratio <= 0.2")
    warm: list[dict] = []
    cold: list[dict] = []

    def ours():
        _, rec, _ = _cli("build", NAME, "--engine", _node_b(), "--cache-registry", S["reg"], "--json",
                         stages=_store())
        warm.append(rec)

    def baseline():
        _, rec, _ = _cli("build", NAME, "--engine", _node_b(), "--no-cache-registry", "--no-cache", "--json",
                         stages=_store())
        cold.append(rec)

    def teardown():
        pulled = all(s["status"] == "pulled" for r in warm for s in r["stages"])
        ident = {r["release"]["identity"] for r in warm + cold} | {S["a"]["release"]["identity"]}
        stage_w = sum(s["seconds"] or 0 for s in warm[-1]["stages"])
        stage_c = sum(s["seconds"] or 0 for s in cold[-1]["stages"])
        S["cold"] = cold
        b.note = (f"bound: ratio <= 0.2; every warm stage pulled, none built: {'yes' if pulled else 'NO'}; stages "
                  f"alone {stage_w:.1f} s warm vs {stage_c:.1f} s cold; one identity across A and B's builds: "
                  f"{'yes' if len(ident) == 1 else 'NO'}")

    b.ours, b.baseline, b.setup, b.teardown = ours, baseline, _setup, teardown
    return b


def _identity_row() -> Benchmark:
    b = Benchmark("fleet: remote-engine build identity (ours: node B cold on the peer's engine; baseline: node "
                  "A cold on this engine)", lambda: None, lambda: None, repeat=1, note="")
    recs: dict = {}

    def ours():
        _, recs["b"], _ = _cli("build", NAME, "--engine", _node_b(), "--no-cache-registry", "--no-cache", "--json",
                               stages=_store())

    def baseline():
        _, recs["a"], _ = _cli("build", NAME, "--no-cache-registry", "--no-cache", "--json", stages=_store())

    def teardown():
        ia, ib = recs["a"]["release"]["identity"], recs["b"]["release"]["identity"]
        b.note = (f"remote == local: {'yes' if ia == ib else 'NO'} ({ib[:19]} on {recs['b']['engine']['id'][:12]}, "
                  f"{ia[:19]} here)")

    b.ours, b.baseline, b.setup, b.teardown = ours, baseline, _setup, teardown
    return b


def _gets() -> list[tuple[str, int]]:
    return S["registry"].blob_gets()


def _sync() -> tuple[dict, list[tuple[str, int]], list[int]]:
    n0, tx0 = len(_gets()), [p.tx() for p in S["peers"]]
    _, doc, _ = _cli("sync", "--via", "registry", "--registry", S["reg"], "--image", NAME, "--json",
                     *[p.addr for p in S["peers"]])
    return doc, _gets()[n0:], [p.tx() - t for p, t in zip(S["peers"], tx0, strict=True)]


def _summary(doc: dict, gets: list[tuple[str, int]], tx: list[int]) -> tuple[str, bool]:
    """Layer fetches from the registry's access log, bytes over each peer's link."""
    count: dict[str, int] = {}
    for dg, _ in gets:
        count[dg] = count.get(dg, 0) + 1
    need = {la for r in doc["peers"] for la in r["details"].get("layers_needed", [])}
    per_layer = sorted(count.get(la, 0) for la in need)
    ok = all(r["status"] in ("synced", "unchanged") for r in doc["peers"]) and \
        all(count.get(la, 0) <= len(S["peers"]) for la in need)
    moved = sum(sz for dg, sz in gets if dg in need)
    peers = ", ".join(f"{r['peer']}: {r['status']}, {len(r['details'].get('layers_needed', []))} layers it lacked "
                      f"by the probe, {tx_ / 1e3:.0f} kB over its link" for r, tx_ in zip(doc["peers"], tx, strict=True))
    return (f"{len(need)} layers, fetches per layer for the 3 peers {per_layer}, {moved / 1e3:.0f} kB of layers from "
            f"the registry in all; {peers}", ok)


def _fresh_sync_row() -> Benchmark:
    b = Benchmark("fleet: sync --via registry to 3 peers through ssh tunnels, fresh peers (baseline: docker save | "
                  "ssh PEER docker load to each)", lambda: None, lambda: None, repeat=1,
                  note="bound: each layer at most once per peer")
    res: list = []

    def clear():
        for p in S["peers"]:
            p.clear()

    def ours():
        res.append(_sync())

    def baseline():
        for p in S["peers"]:
            sh("bash", "-c", f"set -o pipefail; docker save {NAME}:local | {S['ssh']} {p.addr} docker load")

    def teardown():
        text, ok = _summary(*res[-1])
        b.note = f"bound: each layer at most once per peer: {'ok' if ok else 'FAIL'} | {text}"

    b.ours, b.baseline, b.setup, b.teardown, b.per_run_setup = ours, baseline, _setup, teardown, clear
    return b


def _change_sync_row() -> Benchmark:
    b = Benchmark("fleet: sync --via registry to 3 peers after a one-file change (baseline: docker save | ssh PEER "
                  "docker load to each)", lambda: None, lambda: None, repeat=1,
                  note="bound: each layer at most once per peer")
    res: list = []

    def prepare():
        _setup()
        for p in S["peers"]:  # every peer at the current :local, by the tool
            p.clear()
        _sync()
        d = S["root"] / "docker-images" / NAME
        (d / "files" / "motd.txt").write_text(f"bench {time.time()}\n")
        _cli("build", NAME, "--cache-registry", S["reg"], "--json", stages=_store())  # gated on node A

    def ours():
        res.append(_sync())

    def baseline():
        for p in S["peers"]:
            sh("bash", "-c", f"set -o pipefail; docker save {NAME}:local | {S['ssh']} {p.addr} docker load")

    def teardown():
        try:
            text, ok = _summary(*res[-1])
            need = {la for r in res[-1][0]["peers"] for la in r["details"].get("layers_needed", [])}
            t0 = time.monotonic()
            doc3, gets3, _ = _sync()
            again = time.monotonic() - t0
            noop = all(r["status"] == "unchanged" for r in doc3["peers"]) and not any(dg in need for dg, _ in gets3)
            b.note = (f"bound: each layer at most once per peer: {'ok' if ok and noop else 'FAIL'} | {text} | synced "
                      f"again: {'unchanged, no layer fetched' if noop else 'FAIL'} ({again:.1f} s)")
        finally:
            _teardown()

    b.ours, b.baseline, b.setup, b.teardown = ours, baseline, prepare, teardown
    return b


def benchmarks():
    return [_warm_row(), _identity_row(), _fresh_sync_row(), _change_sync_row()]
