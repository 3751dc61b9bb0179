"""A failed night explains itself, and the nights add up (issue 23, sections 2 and 3), on the real
engine with a tiny definition on the local busybox base:

1. night 1, under GitHub Actions (``GITHUB_ACTIONS=true``, a ``$GITHUB_OUTPUT`` file): a stage's
   RUN prints 25 lines (one of them the token's value) and exits 7, and a second definition has a
   definition error. The report (JSON, Markdown, summary) carries the RUN's own exit code 7 (not
   buildx's 1), its command and the last ~20 lines of its log, redacted; the summary does not count
   the failed stage as built; prefetch says it pinned the base and wrote the first lock (not
   ``unchanged``); the runner gets ``::group::`` folds per stage, ``::error`` lines (with
   ``file=`` and ``line=`` for the definition error) and tonight's report paths and the failed
   log in ``$GITHUB_OUTPUT``.
2. night 2, fixed: the first promotion does not claim an old ``:previous``; with ``--keep-reports 1``
   and gc, ``report --history`` still shows both nights and the HTML page sits beside the report.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import jsonschema
import pytest

from tests.buildfixtures import remove_images
from tests.conftest import run_cli

pytestmark = [pytest.mark.engine]

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = json.loads((ROOT / "docs" / "nightly-report.schema.json").read_text())
TOKEN = "ghp_failureTailToken_" + secrets.token_hex(8)

BROKEN = """ARG PARENT
FROM ${{PARENT}}
RUN for i in $(seq 1 24); do echo "output line $i"; done; echo "leaked {token}"; echo "last words" >&2; exit {code}
RUN echo fine > /opt/fine
"""


def _definitions(root: Path, name: str, code: int) -> None:
    d = root / "docker-images" / name
    d.mkdir(parents=True, exist_ok=True)
    if not (d / "versions.env").exists():  # night 2 keeps what night 1's prefetch pinned
        (d / "versions.env").write_text("BASE_IMAGE=imagebuild-test/busybox:1\n")
    (d / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: base\n    from: BASE_IMAGE\n"
                                  "  - name: broken\n    from: base\ngate: gate.yaml\n")
    (d / "Dockerfile.base").write_text("ARG PARENT\nFROM ${PARENT}\nRUN mkdir -p /opt && echo ok > /opt/ok\n")
    (d / "Dockerfile.broken").write_text(BROKEN.format(token=TOKEN, code=code))
    (d / "gate.yaml").write_text("checks:\n  - {id: ok, kind: file, path: /opt/ok, contains: ok}\n")


def _outputs(path: Path) -> dict:
    """$GITHUB_OUTPUT as a runner reads it (name=value and name<<DELIM ... DELIM)."""
    out, lines, i = {}, path.read_text().splitlines(), 0
    while i < len(lines):
        ln = lines[i]
        if "<<" in ln and "=" not in ln.split("<<", 1)[0]:
            k, delim = ln.split("<<", 1)
            j = lines.index(delim, i + 1)
            out[k] = "\n".join(lines[i + 1:j])
            i = j + 1
        else:
            k, v = ln.split("=", 1)
            out[k] = v
            i += 1
    return out


def test_a_failed_night_explains_itself_and_the_nights_add_up(project, engine_ready, tmp_path, monkeypatch):
    name = f"fail7-{secrets.token_hex(3)}"
    bad = f"{name}-baddef"
    _definitions(project, name, 7)
    (project / "docker-images" / bad).mkdir()
    (project / "docker-images" / bad / "versions.env").write_text("BASE_IMAGE=imagebuild-test/busybox:1\n")
    (project / "docker-images" / bad / "image.yaml").write_text(
        "platform: linux/amd64\nstages:\n  - name: only\n    form: BASE_IMAGE\n")
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state"))
    out_file = tmp_path / "github_output"
    out_file.write_text("")
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_OUTPUT", str(out_file))
    night1 = tmp_path / "reports" / "night1"
    try:
        # --- night 1: the RUN exits 7; a definition error beside it
        r = run_cli("--root", str(project), "nightly", bad, name, "--peers", "--report-dir", str(night1),
                    "--keep-reports", "1", "--progress", "quiet")
        assert r.code == 2, r.err[-3000:]  # the worst: the definition error
        outs = _outputs(out_file)
        assert Path(outs["report_dir"]) == night1.resolve() and outs["status"] == "failed" and outs["exit_code"] == "2"
        doc = json.loads(Path(outs["report_json"]).read_text())
        jsonschema.Draft202012Validator(SCHEMA).validate(doc)
        baddoc, im = doc["images"]
        assert Path(outs["report_md"]).is_file() and Path(outs["report_html"]).is_file()

        f = im["failure"]
        assert im["status"] == "failed" and im["exit_code"] == 1
        assert (f["step"], f["stage"], f["exit_code"], f["tool_exit_code"]) == ("build", "broken", 7, 1), f
        assert f["command"].startswith("/bin/sh -c for i in") and f["command"].endswith("exit 7")
        assert 15 <= len(f["tail"]) <= 20, f["tail"]
        assert any("output line 24" in ln for ln in f["tail"]) and any("last words" in ln for ln in f["tail"])
        assert any("leaked [redacted]" in ln for ln in f["tail"])
        assert "exit code: 7" in f["tail"][-1]
        assert "RUN exit 7" in im["reason"] and "buildx build exit 1" not in im["reason"]
        log = project / f["log"] if not Path(f["log"]).is_absolute() else Path(f["log"])
        assert log.is_file() and log.name == "broken.log"
        assert outs["failed_logs"].splitlines() == [str(log.resolve())]
        assert im["steps"]["prefetch"]["status"] == "pinned", im["steps"]["prefetch"]
        assert "wrote the first lock" in im["steps"]["prefetch"]["detail"]
        assert "BASE_IMAGE=" in im["steps"]["prefetch"]["detail"]
        assert {s["name"]: s["status"] for s in im["stages"]} == {"base": "built", "broken": "failed"}

        md = Path(outs["report_md"]).read_text()
        assert "RUN exit 7" in md and "output line 24" in md and "leaked [redacted]" in md
        assert "| prefetch | unchanged |" not in md and "| prefetch | pinned |" in md

        r2 = run_cli("--root", str(project), "report", name, "--report-dir", str(night1), "--summary")
        assert r2.code == 0, r2.err
        assert "stages: 0 cached, 1 built (base), 1 failed (broken)" in r2.out, r2.out
        assert "failed stage broken: RUN exit 7" in r2.out and "| #" in r2.out and "output line 24" in r2.out
        # the summary the run printed says the same
        assert "failed stage broken: RUN exit 7" in r.out and "1 failed (broken)" in r.out

        # the runner's log: a fold per stage that ran, the errors with the definition's file and line
        assert f"::group::{name}/base: built" in r.out and f"::group::{name}/broken: failed" in r.out
        assert r.out.count("::endgroup::") == 2
        assert f"::error title={name}/broken failed::stage broken of {name} failed: RUN exit 7" in r.out
        prob = baddoc["failure"]["problems"][0]
        assert prob["file"] == f"docker-images/{bad}/image.yaml" and prob["line"] == 4, baddoc["failure"]
        assert f"::error file=docker-images/{bad}/image.yaml,line=4,title={bad}%3A definition error::" in r.out

        texts = [r.out, r.err, out_file.read_text()] + [p.read_text() for p in night1.iterdir()]
        assert not [t[max(t.find(TOKEN) - 300, 0):t.find(TOKEN) + 50] for t in texts if TOKEN in t]

        # --- night 2: fixed; the first promotion; one report kept, gc ran, both nights in the history
        _definitions(project, name, 0)
        monkeypatch.delenv("GITHUB_ACTIONS")
        monkeypatch.delenv("GITHUB_OUTPUT")
        night2 = tmp_path / "reports" / "night2"
        r = run_cli("--root", str(project), "nightly", name, "--peers", "--report-dir", str(night2),
                    "--keep-reports", "1", "--progress", "quiet", "--json")
        assert r.code == 0, r.err[-3000:]
        # issue 35: its seconds before the first image and after the last are said, not silent
        said = [ln for ln in r.err.splitlines() if ln.startswith(("disk: ", "gc: ", "report: ", "== "))]
        assert [ln.split(":")[0] if not ln.startswith("==") else "==" for ln in said] == \
            ["disk", "==", "gc", "gc", "disk", "report"], r.err[-3000:]
        assert said[0] == f"disk: measuring what {name} holds (engine images, stage store, builds) before the run"
        assert said[2].startswith(f"gc: {name}: keeping the last ") and said[2].endswith(" builds, removing the rest")
        assert said[3].startswith("gc: freed ") and said[5].startswith("report: writing it")
        (im,) = json.loads(r.out)["images"]
        assert im["failure"] is None and im["promotion"]["status"] == "promoted"
        assert "previous" not in im["steps"]["promote"]["detail"].replace("no " + name + ":previous", "")
        assert "first promotion" in im["steps"]["promote"]["detail"]
        assert im["steps"]["prefetch"]["status"] == "unchanged"
        assert isinstance(im["size"], int) and im["size"] > 0
        assert "::group::" not in r.out + r.err  # not under Actions: no workflow commands
        assert len(list(night2.glob("*.json"))) == 1 and len(list(night2.glob("*.html"))) == 1

        r = run_cli("--root", str(project), "report", "--report-dir", str(night2), "--history", "--json")
        assert r.code == 0, r.err
        rows = [x for x in json.loads(r.out)["rows"] if x["image"] == name]
        assert [x["status"] for x in rows] == ["failed", "ok"]
        assert rows[0]["failure"]["exit_code"] == 7 and rows[1]["gate"]["result"] == "passed"
        assert rows[1]["cache"] == {"hits": 1, "misses": 1, "rate": 0.5}
        r = run_cli("--root", str(project), "report", name, "--report-dir", str(night2), "--history", "5")
        assert r.code == 0, r.err
        assert f"{name}: 2 night(s)" in r.out and "failed (exit 7)" in r.out and "PASS" in r.out, r.out
    finally:
        remove_images(name)
