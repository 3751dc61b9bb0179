"""`make demo` takes a free peer slot as the tests do (issue 35, section 4): scripts/demo.sh used one
fixed namespace and address (ibdemo1, 10.77.9.2) and tore down a same-named peer first, so two
checkouts running the demo on one machine broke each other's sync. scripts/peer_slot.sh takes the
slot the way tests/peers.py does (no namespace ibpN, an flock on its lock file), so a slot held by a
test session or by another demo is never taken."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.peers import peer_slot

ROOT = Path(__file__).resolve().parents[2]
TAKE = ("source scripts/peer_slot.sh && take_peer_slot && echo \"$PEER_SLOT $PEER_NS $PEER_ADDR $HOST_ADDR "
        "$PEER_VETH $PEER_BRIDGE $PEER_BRIDGE_CIDR\" && exec sleep 30")

pytestmark = pytest.mark.skipif(shutil.which("flock") is None or shutil.which("ip") is None,
                                reason="needs flock and ip")


def _take() -> tuple[subprocess.Popen, list[str]]:
    p = subprocess.Popen(["bash", "-c", TAKE], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().split()
    return p, line


def test_the_demo_takes_a_free_slot_never_one_a_test_session_or_another_demo_holds():
    held, lockf = peer_slot()  # a test session's peer
    procs = []
    try:
        a, got_a = _take()
        procs.append(a)
        b, got_b = _take()  # a second checkout's demo, while the first still holds its slot
        procs.append(b)
        slots = {held, int(got_a[0]), int(got_b[0])}
        assert len(slots) == 3, (held, got_a, got_b)
        n = int(got_a[0])
        assert got_a[1:] == [f"ibp{n}", f"10.77.{n}.2", f"10.77.{n}.1", f"ibpv{n}", f"ibpbr{n}", f"172.29.{n}.1/24"]
        # a slot is free again once its holder is gone
        a.kill()
        a.wait()
        c, got_c = _take()
        procs.append(c)
        assert int(got_c[0]) not in (held, int(got_b[0]))
    finally:
        for p in procs:
            p.kill()
            p.wait()
        lockf.close()


def test_the_demo_names_no_fixed_peer():
    text = (ROOT / "scripts" / "demo.sh").read_text()
    assert "take_peer_slot" in text and "source scripts/peer_slot.sh" in text
    assert "PEER_NS=" not in text and "10.77.9." not in text
