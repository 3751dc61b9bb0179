"""Gate containers left behind by a gate that was killed (``kill -9``, a power cut, an OOM kill).

A gate removes its keep-alive container in every way it can end by itself (a failure, Ctrl-C,
SIGTERM, a timeout), but a process killed with SIGKILL runs no cleanup: its container would sleep
forever (``sleep 2147483647``) and keep its image "used by a container" for ``gc``. Each gate
container carries its owner (``imagebuild.gate.owner=host:pid``); ``reap`` removes those whose
owner is a process of this host that is gone. A container of a live gate, or of another host's,
is never touched. The next gate (also the one a build runs) and ``gc`` call it.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

from imagebuild.core import run as run_mod
from imagebuild.core import runs
from imagebuild.core.errors import OperationFailed

log = logging.getLogger("imagebuild")

CONTAINER_LABEL = "imagebuild.gate"
OWNER_LABEL = f"{CONTAINER_LABEL}.owner"


@dataclass(frozen=True)
class Leftover:
    id: str
    name: str
    owner: str


def find() -> list[Leftover]:
    """Gate containers (running or stopped) whose owner on this host is gone."""
    try:
        text = run_mod.output(["docker", "ps", "-a", "--no-trunc", "--filter", f"label={OWNER_LABEL}",
                               "--format", '{{.ID}}\t{{.Names}}\t{{.Label "' + OWNER_LABEL + '"}}'],
                              timeout=60, check=False)
    except OperationFailed:
        return []
    out = []
    for line in text.splitlines():
        parts = line.strip().split("\t")
        if len(parts) == 3 and runs.owner_gone(parts[2]):
            out.append(Leftover(*parts))
    return out


def reap() -> list[Leftover]:
    """Remove the gate containers ``find`` gives; returns those removed."""
    gone = []
    for c in find():
        with contextlib.suppress(OperationFailed):
            proc = run_mod.run(["docker", "rm", "-f", "-v", c.id], check=False, timeout=60)
            if proc.returncode == 0:
                log.info("removed gate container %s: its gate (%s) is gone, killed before it could",
                         c.name, c.owner)
                gone.append(c)
    return gone
