"""The scheduling files, read with real parsers: the workflows (PyYAML, and actionlint when it is
installed: the test extras install it on x86_64 Linux), the systemd units, the README's two
commands and CI's use of them."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
WF = ROOT / ".github" / "workflows"


FORGEJO = ROOT / ".forgejo" / "workflows"


def load(name: str, folder: Path = WF) -> dict:
    doc = yaml.safe_load((folder / name).read_text())
    assert isinstance(doc, dict)
    doc["on"] = doc.pop(True, doc.get("on"))  # YAML 1.1 reads the key `on` as true
    return doc


def readme_commands() -> list[str]:
    """The commands the README's quick start tells a newcomer to run (indented code lines)."""
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [ln.strip() for ln in quick.splitlines() if ln.startswith("    ") and ln.strip()]


def steps_run(job: dict) -> list[str]:
    return [s.get("run", "") for s in job["steps"]]


def test_readme_has_exactly_two_commands_and_ci_runs_them():
    assert readme_commands() == ["make demo", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make demo$", ci, re.M) and re.search(r"^make test$", ci, re.M)


def test_nightly_workflow_triggers_concurrency_artifact_and_failure():
    wf = load("nightly.yml")
    on = wf["on"]
    assert on["schedule"] and all(re.fullmatch(r"[\d*/,-]+( [\d*/,-]+){4}", c["cron"]) for c in on["schedule"])
    assert "workflow_dispatch" in on and "images" in on["workflow_dispatch"]["inputs"]
    assert wf["concurrency"]["group"] and wf["concurrency"]["cancel-in-progress"] is False
    (job,) = wf["jobs"].values()
    assert {"self-hosted", "arm64", "linux"} <= set(job["runs-on"])
    runs = steps_run(job)
    nightly = next(r for r in runs if "imagebuild nightly" in r)
    assert "--report-dir" in nightly and "--refresh" in nightly
    step = next(s for s in job["steps"] if "imagebuild nightly" in s.get("run", ""))
    assert "continue-on-error" not in step and "|| true" not in nightly  # a failed night fails the job
    ups = [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    assert ups and all(u["if"].startswith("always()") and u["with"]["path"] for u in ups)
    assert any("GITHUB_STEP_SUMMARY" in r for r in runs)
    assert job["env"]["GITHUB_TOKEN"] == "${{ secrets.GITHUB_TOKEN }}"
    assert wf["permissions"] == {"contents": "read"}


@pytest.mark.parametrize("folder", [WF, FORGEJO], ids=["github", "forgejo"])
def test_nightly_workflow_reads_tonights_report_and_uploads_the_failed_logs(folder):
    """One report folder per run, whose paths imagebuild hands over ($GITHUB_OUTPUT, cli/actions.py):
    the summary shows tonight's report or says there is none (never the newest file of an old folder);
    the failed stages' logs and the history page are uploaded."""
    wf = load("nightly.yml", folder)
    (job,) = wf["jobs"].values()
    step = next(s for s in job["steps"] if "imagebuild nightly" in s.get("run", ""))
    assert step["id"] == "nightly" and "$GITHUB_RUN_ID" in step["run"] and '--report-dir "$report_dir"' in step["run"]
    assert "REPORT_DIR" not in job["env"]  # no folder shared between runs
    text = (folder / "nightly.yml").read_text()
    assert "ls -1" not in text and "tail -n 1" not in text  # nothing picks "the newest report"
    summary = next(s for s in job["steps"] if "REPORT_MD" in s.get("run", ""))
    assert summary["env"]["REPORT_MD"] == "${{ steps.nightly.outputs.report_md }}" and summary["if"] == "always()"
    paths = {u["with"]["path"] for u in job["steps"] if str(u.get("uses", "")).startswith("actions/upload-artifact@")}
    assert paths == {"${{ steps.nightly.outputs.report_dir }}", "${{ steps.nightly.outputs.failed_logs }}",
                     "${{ steps.nightly.outputs.report_html }}"}
    assert load("nightly.yml", WF)["on"] == wf["on"]  # the same nights on both forges


def test_ci_workflow_runs_the_readme_test_command_on_push():
    wf = load("ci.yml")
    assert "push" in wf["on"]
    (job,) = wf["jobs"].values()
    test_cmd = readme_commands()[-1]
    assert any(re.search(rf"(^|\s){re.escape(test_cmd)}\s*$", r) for r in steps_run(job)), steps_run(job)


def _actionlint() -> str | None:
    return shutil.which("actionlint") or next(
        (str(p) for p in [Path(sys.executable).parent / "actionlint"] if p.exists()), None)


def test_workflows_pass_actionlint():
    exe = _actionlint()
    if exe is None:
        pytest.skip("actionlint is not installed here (the test extras install it on x86_64 Linux only)")
    r = subprocess.run([exe, "-config-file", str(ROOT / ".github" / "actionlint.yaml"),
                        *sorted(str(p) for p in [*WF.glob("*.yml"), *FORGEJO.glob("*.yml")])],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def _unit(name: str) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str
    cp.read_string((ROOT / "contrib" / "systemd" / name).read_text().replace("\\\n", " "))
    return cp


def test_systemd_timer_is_persistent_and_service_locked():
    timer = _unit("imagebuild-nightly.timer")
    assert timer["Timer"]["Persistent"] == "true" and timer["Timer"]["OnCalendar"]
    assert timer["Install"]["WantedBy"] == "timers.target"
    svc = _unit("imagebuild-nightly.service")
    s = svc["Service"]
    assert s["Type"] == "oneshot"
    exec_start = s["ExecStart"]
    assert exec_start.startswith("/usr/bin/flock --nonblock") and "/imagebuild nightly " in exec_start
    code = re.search(r"--conflict-exit-code (\d+)", exec_start).group(1)
    assert code in s["SuccessExitStatus"].split()  # a second start while one runs is not a failure
    assert timer["Timer"]["Unit"] == "imagebuild-nightly.service"
