"""A run record's owner (``host:pid``): only a process of this host that is gone makes a ``running``
record ``abandoned`` (core/runs.py). Real processes: one that ran and was reaped, this one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from imagebuild.core import runs


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_owner_gone_only_for_a_dead_process_of_this_host():
    host = socket.gethostname()
    assert runs.owner().endswith(":" + str(os.getpid()))
    assert runs.owner_gone(f"{host}:{_dead_pid()}")
    assert not runs.owner_gone(runs.owner())  # this process
    assert not runs.owner_gone(f"another-host-{host}:{_dead_pid()}")  # cannot be told from here
    for bad in (None, "", "nopid", f"{host}:", f"{host}:-1", f"{host}:x", 42):
        assert not runs.owner_gone(bad)


def test_a_running_record_of_a_dead_owner_reads_and_is_recorded_abandoned(tmp_path):
    top = runs.builds_dir(tmp_path) / "img"
    dead, live = f"{socket.gethostname()}:{_dead_pid()}", runs.owner()
    for run_id, status, owner in (("1-a", "running", dead), ("2-b", "running", live), ("3-c", "ok", dead),
                                  ("4-d", "running", None)):
        (top / run_id).mkdir(parents=True)
        rec = {"status": status, **({"owner": owner} if owner else {})}
        (top / run_id / "record.json").write_text(json.dumps(rec))
    by_id = {r.run_id: r.status for r in runs.list_runs(tmp_path, "img")}
    assert by_id == {"1-a": "abandoned", "2-b": "running", "3-c": "ok", "4-d": "running"}
    assert [r.run_id for r in runs.mark_abandoned(tmp_path, "img")] == ["1-a"]
    rec = json.loads((top / "1-a" / "record.json").read_text())
    assert rec["status"] == "abandoned" and dead in rec["abandoned"]
    assert runs.mark_abandoned(tmp_path, "img") == []  # once
