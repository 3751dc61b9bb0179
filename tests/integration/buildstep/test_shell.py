"""``imagebuild shell IMAGE STAGE`` (issue 35, section 4): a container of the stage's parent with the
stage's inputs mounted as the build mounts them, --network none, the stage's build args in its
environment; the command's exit code comes back; nothing is left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.fleetfixtures import fleet_project, remove_fleet_images, unique_name

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[3]


def _shell(root: Path, *argv: str) -> subprocess.CompletedProcess:
    # a real process: the container's output goes to its own stdout, as on a terminal
    return subprocess.run([sys.executable, "-m", "imagebuild", "--root", str(root), "shell", *argv],
                          capture_output=True, text=True, cwd=REPO, timeout=300, stdin=subprocess.DEVNULL)


def _left(name: str) -> tuple[str, str]:
    containers = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=io.imagebuild.shell={name}/app"],
                                capture_output=True, text=True, check=True).stdout.strip()
    tags = subprocess.run(["docker", "image", "ls", "--format", "{{.Tag}}", f"imagebuild/{name}"],
                          capture_output=True, text=True, check=True).stdout.split()
    return containers, " ".join(t for t in tags if t.startswith("shell-"))


def test_a_shell_in_a_stage_has_its_parent_its_inputs_its_args_and_no_network(engine_info, tmp_path):
    name = unique_name("shell")
    root = fleet_project(tmp_path / "p", name)
    try:
        r = run_cli("--root", str(root), "build", name, "--until", "tools", "--no-gate", "--force")
        assert r.code == 0, r.err
        # app: FROM tools (a stage, from the stage store), its source GREET mounted at /imagebuild/src
        probe = ("cat /opt/staged/tool-version; ls /imagebuild/src; tail -n +3 /proc/net/dev | cut -d: -f1 | "
                 "tr -d ' '; pwd; touch /imagebuild/src/x 2>/dev/null && echo WRITABLE; exit 5")
        res = _shell(root, name, "app", "--", "sh", "-c", probe)
        assert res.returncode == 5, res.stderr  # the command's own exit code
        out = res.stdout.split()
        assert out[0] == "1.0"  # the parent stage's file
        assert {"GREET.tar.gz", "imagebuild-src.sh", "imagebuild-src.json"} <= set(out)
        assert "lo" in out and not any(x.startswith("eth") for x in out) and "WRITABLE" not in out
        assert "/imagebuild/context" in out
        assert "FROM tools (its parent stage), network none" in res.stderr
        assert _left(name) == ("", "")  # no container, no temporary tag
        # tools: FROM base; its build args in the environment, its COPY sources in the context
        res = _shell(root, name, "tools", "--", "sh", "-c", 'echo "TV=$TOOL_VERSION"; ls /imagebuild/context/files')
        assert res.returncode == 0, res.stderr
        assert "TV=1.0" in res.stdout and "tool.sh" in res.stdout
        # base: FROM its base image
        res = _shell(root, name, "base", "--", "sh", "-c", "test -x /bin/busybox && echo busybox")
        assert res.returncode == 0 and "busybox" in res.stdout, res.stderr
        # a parent not built yet, a stage that does not exist
        res = _shell(root, name, "runner", "--", "true")
        assert res.returncode == 1 and f"imagebuild build {name} --until patched" in res.stderr, res.stderr
        res = _shell(root, name, "apps", "--", "true")
        assert res.returncode == 2 and "did you mean 'app'?" in res.stderr, res.stderr
    finally:
        remove_fleet_images(name)
