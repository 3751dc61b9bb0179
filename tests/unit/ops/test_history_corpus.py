"""The hostile-input corpus of issue 34 (round three): `report --history` (text, --json) and `report
--html` on a hand-edited or corrupted history line or kept report gave 46 different internal errors.
A property test: many seeded random corruptions of a good line and of the newest kept report (a value
of another type at any place, a key removed, a list or object where a value goes, a cut line); every
run exits 0 with no internal error, the good nights stay, and a bad line is skipped and named."""

from __future__ import annotations

import copy
import json
import random

import pytest

from imagebuild.ops import history, report
from tests.conftest import run_cli
from tests.unit.ops.test_nightly_history import failed_doc
from tests.unit.ops.test_nightly_report import full_doc

CASES = 300
ODD = [None, True, False, 0, -1, 1.5, 10**30, float("nan"), "", "x", "<b>&", "\x1b[2J", [], [1, "a"], {}, {"a": 1},
       [{"name": None}], {"run_id": 5}, "9" * 400]


def _places(obj, path=()):
    """Every (path) in a JSON value."""
    yield path
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _places(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _places(v, (*path, i))


def _corrupt(obj, rng: random.Random):
    """``obj`` with one to three random corruptions."""
    obj = copy.deepcopy(obj)
    for _ in range(rng.randint(1, 3)):
        places = [p for p in _places(obj) if p]
        if not places:
            break
        path = rng.choice(places)
        parent = obj
        for k in path[:-1]:
            parent = parent[k]
        if rng.random() < 0.2 and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(ODD))
    return obj


def _night(i: int, failed: bool = False) -> dict:
    doc = failed_doc() if failed else full_doc()
    doc["run_id"] = f"202611{10 + i:02d}T020000.000001Z-{i:06d}"
    return doc


@pytest.fixture
def setting(project, tmp_path, monkeypatch):
    state = tmp_path / "state"
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(state))
    rdir = tmp_path / "reports"
    good = [_night(0), _night(1, failed=True)]
    for doc in good:
        history.append(state / history.FILE, doc)
    return project, state / history.FILE, rdir, good


def _runs(project, rdir):
    for argv in (["--history"], ["--history", "--json"], ["--html"]):
        yield argv, run_cli("--root", str(project), "report", "--report-dir", str(rdir), *argv)


def test_corrupted_history_lines_and_kept_reports_never_crash_report(setting):
    project, hfile, rdir, good = setting
    base_lines = hfile.read_text().splitlines()
    row = json.loads(base_lines[1])
    rng = random.Random(34)
    named = 0
    for case in range(CASES):
        bad = _corrupt(row, rng)
        bad["run_id"] = f"20261120T020000.000001Z-{case:06d}" if isinstance(bad.get("run_id"), str) else bad.get("run_id")
        text = json.dumps(bad, default=str)
        if case % 10 == 0:
            text = text[:rng.randint(1, len(text) - 1)]  # a cut line
        hfile.write_text("\n".join([*base_lines, text]) + "\n")
        # the newest kept report, corrupted too
        for old in rdir.glob("*"):
            old.unlink()
        doc = _corrupt(_night(30 + case % 5), rng)
        rdir.mkdir(exist_ok=True)
        (rdir / f"20261201T020000.000001Z-{case:06d}.json").write_text(json.dumps(doc, default=str))
        (rdir / f"20261201T020000.000001Z-{case:06d}.md").write_text("x\n")
        why = history.check_row(json.loads(text)) if case % 10 else "cut"
        for argv, r in _runs(project, rdir):
            assert r.code == 0, (case, argv, text, r.err)
            assert "internal error" not in r.err and "Traceback" not in r.err, (case, argv, text, r.err)
            if argv == ["--history", "--json"]:
                ids = {x["run_id"] for x in json.loads(r.out)["rows"]}
                assert {d["run_id"] for d in good} <= ids, (case, ids)
            if why and argv == ["--history"]:
                assert f"line {len(base_lines) + 1}: " in r.err, (case, text, r.err)
                named += 1
    assert named > CASES // 2  # most corruptions make a line this version cannot show


def test_a_bad_line_is_named_with_its_key(setting):
    project, hfile, rdir, _ = setting
    lines = hfile.read_text().splitlines()
    row = json.loads(lines[0])
    row["gate"]["passed"] = "many"
    row["run_id"] = "20261125T020000.000001Z-zzzzzz"
    hfile.write_text("\n".join([*lines, "{not json", json.dumps(row)]) + "\n")
    r = run_cli("--root", str(project), "report", "--report-dir", str(rdir), "--history")
    assert r.code == 0, r.err
    assert "2 unreadable line(s)" in r.err and "line 3: not JSON" in r.err, r.err
    assert "line 4: gate.passed: unexpected str 'many'" in r.err.replace('"', "'") or "line 4: gate.passed" in r.err, r.err
    assert "2 night(s)" in r.out, r.out


def test_history_rows_from_good_reports_all_pass_the_check():
    for doc in (full_doc(), failed_doc()):
        for r in history.rows_of(doc):
            assert history.check_row(r) is None, history.check_row(r)
    assert report  # the module the reports are written with
