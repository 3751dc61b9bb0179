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

from tests.peers import BUSYBOX, DEBIAN, Peer, clear_peer, joint_ssh, put_on_peer, start_peer  # noqa: E402

PID = os.getpid()
NAME = f"fleetbench{PID}"
WORK = ("RUN i=0; while [ $i -lt 8 ]; do seq 1 1000000 | sha256sum > /dev/null; i=$((i+1)); done; "
        "seq 1 2300000 > /opt/staged/work-{stage}.txt\n")

S: dict = {}  # the shared context (set up once for every row)


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
    from tests.fleetfixtures import fleet_project, start_registry

    atexit.register(_teardown)
    S["tmp"] = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    root = S["root"] = fleet_project(S["tmp"] / "project", NAME, gate=True)
    d = root / "docker-images" / NAME
    for stage in ("base", "tools", "app", "patched", "runner"):
        f = d / f"Dockerfile.{stage}"
        f.write_text(f.read_text() + WORK.format(stage=stage))
    S["registry"] = start_registry(S["tmp"] / "registry")
    S["reg"] = f"{S['registry'].addr}/bench"
    S["peers"], S["stops"] = [], []
    for i in range(3):  # scripts/peer.sh up ... --engine-in-netns, each in a free slot
        p, stop = start_peer(None, f"fleet{i}", "--engine-in-netns")
        S["peers"].append(p)
        S["stops"].append(stop)
    S["ssh"] = joint_ssh(S["peers"], S["tmp"] / "ssh_config")
    put_on_peer(S["peers"][0], BUSYBOX, DEBIAN)
    # node A fills the registry (stages, release tags) and gates the image here
    _, a, _ = _cli("build", NAME, "--cache-registry", S["reg"], "--json", stages=_store())
    S["a"] = a


def _teardown() -> None:
    if not S:
        return
    for p, stop in zip(S.get("peers", []), S.get("stops", []), strict=True):
        _clear(p)
        stop()
    if "registry" in S:
        S["registry"].stop()
    from tests.fleetfixtures import remove_fleet_images

    remove_fleet_images(NAME)
    shutil.rmtree(S["tmp"], ignore_errors=True)
    S.clear()


def _clear(p: Peer) -> None:
    """No image of ours and an empty sync cache (the base images stay)."""
    clear_peer(p, NAME, f"imagebuild/{NAME}", containers=False)


def _clear_peers() -> None:
    for p in S["peers"]:
        _clear(p)


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
    n0, tx0 = len(_gets()), [p.tx_bytes() for p in S["peers"]]
    _, doc, _ = _cli("sync", "--via", "registry", "--registry", S["reg"], "--image", NAME, "--json",
                     *[p.addr for p in S["peers"]])
    return doc, _gets()[n0:], [p.tx_bytes() - t for p, t in zip(S["peers"], tx0, strict=True)]


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


def _save_load_each() -> None:
    """The plain tool's way: docker save | ssh PEER docker load, to each peer."""
    for p in S["peers"]:
        sh("bash", "-c", f"set -o pipefail; docker save {NAME}:local | {S['ssh']} {p.addr} docker load")


def _fresh_sync_row() -> Benchmark:
    b = Benchmark("fleet: sync --via registry to 3 peers through ssh tunnels, fresh peers (baseline: docker save | "
                  "ssh PEER docker load to each)", lambda: None, lambda: None, repeat=1,
                  note="bound: each layer at most once per peer")
    res: list = []

    def ours():
        res.append(_sync())

    def teardown():
        text, ok = _summary(*res[-1])
        b.note = f"bound: each layer at most once per peer: {'ok' if ok else 'FAIL'} | {text}"

    b.ours, b.baseline, b.setup, b.teardown, b.per_run_setup = ours, _save_load_each, _setup, teardown, _clear_peers
    return b


def _change_sync_row() -> Benchmark:
    b = Benchmark("fleet: sync --via registry to 3 peers after a one-file change (baseline: docker save | ssh PEER "
                  "docker load to each)", lambda: None, lambda: None, repeat=1,
                  note="bound: each layer at most once per peer")
    res: list = []

    def prepare():
        _setup()
        _clear_peers()  # then every peer at the current :local, by the tool
        _sync()
        d = S["root"] / "docker-images" / NAME
        (d / "files" / "motd.txt").write_text(f"bench {time.time()}\n")
        _cli("build", NAME, "--cache-registry", S["reg"], "--json", stages=_store())  # gated on node A

    def ours():
        res.append(_sync())

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

    b.ours, b.baseline, b.setup, b.teardown = ours, _save_load_each, prepare, teardown
    return b


def benchmarks():
    return [_warm_row(), _identity_row(), _fresh_sync_row(), _change_sync_row()]
