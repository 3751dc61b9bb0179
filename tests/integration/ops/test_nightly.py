"""imagebuild nightly end to end, on real parts: upstreams in a loopback git daemon (as
https://github.com/example/... through git's url.insteadOf), a GitHub API on loopback, the real
engine, and a real peer: its own network namespace, sshd and engine (tests/conftest.py start_peer).

1. the first run pins, builds every stage, gates, promotes and syncs everything;
2. one upstream PR head moves and one patch changes: the second run re-pins, rebuilds only from the
   affected stage on, syncs only the new layers, and the report shows all of it;
3. the PR head moves to a commit that breaks the image: the gate fails, :local and the peer stay;
4. a serving container runs: the run is refused, nothing is prefetched or built.

Every report is validated against docs/nightly-report.schema.json, and GITHUB_TOKEN appears in no
output, report or record. The first and second runs' times and their ratio are printed (measured,
not asserted).

Sync is issue 12's ``imagebuild sync`` to a real peer: the second run must send under a quarter of
the first's bytes (only the new layers), and a failed gate leaves the peer untouched."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest

from tests.buildfixtures import image_id, remove_images
from tests.conftest import FIXTURES, run_cli, start_peer
from tests.gitfixtures import GitDaemon, GitHubApi, UpstreamFactory, git

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = json.loads((ROOT / "docs" / "nightly-report.schema.json").read_text())
TOKEN = "ghp_nightlyE2Etoken_" + secrets.token_hex(8)
NAME = f"nightly-e2e-{secrets.token_hex(3)}"

# The C++ extension: a real compile that dominates a cold build, as vLLM's kernels do on the real
# images (WORK_UNITS translation units using <regex>: several seconds of g++ -O2 each).
WORK_UNITS = 12
EXT_CMAKE = """cmake_minimum_required(VERSION 3.20)
project(fastext LANGUAGES CXX)
set(CMAKE_BUILD_TYPE Release)
include(FetchContent)
FetchContent_Declare(
  mathdep
  GIT_REPOSITORY https://github.com/example/mathdep.git
  GIT_TAG {sha}
)
FetchContent_MakeAvailable(mathdep)
add_library(fastext SHARED src/fastext.cpp {units})
target_link_libraries(fastext PRIVATE mathdep)
"""
WORK_CPP = """#include <map>
#include <regex>
#include <string>
extern "C" int work_{i}(const char* s) {{
  std::map<std::string, std::regex> m{{{{"a", std::regex("[a-z]+[0-9]*{i}")}}, {{"b", std::regex("(x|y)+z{i}")}}}};
  int n = 0;
  for (auto& kv : m) n += std::regex_search(std::string(s), kv.second);
  return n;
}}
"""
GATE = """description: the runner greets with the C++ library's answer and both PRs
python: python3
timeout: 120
checks:
  - id: smoke
    kind: command
    run: python3 /opt/mirror/smoke.py
    stdout: '^hello 42 pr1 1\\.0\\+pr2'
  - id: gpu-visible
    kind: command
    requires: gpu
    run: nvidia-smi -L
    stdout: '^GPU 0: '
"""


def pkg_init(version: str) -> str:
    return f'"""greetpkg"""\nVERSION = "{version}"\n\n\ndef greet():\n    return "hello"\n'


@dataclass
class World:
    root: Path
    reports: Path
    greet: object  # the greetpkg Upstream
    peer_addr: str
    peer_docker: str
    outputs: list  # every stdout/stderr of the runs, to look for the token
    times: dict
    api: object = None  # the GitHub API stand-in (tests/gitfixtures.GitHubApi)


def peer_docker(w: World, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], env={**os.environ, "DOCKER_HOST": w.peer_docker},
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory, engine_info):
    base = tmp_path_factory.mktemp("nightly")
    (base / "served").mkdir()
    daemon = GitDaemon(base / "served").start()
    factory = UpstreamFactory(base / "served", daemon)
    mathdep = factory.create("mathdep", {
        "CMakeLists.txt": "cmake_minimum_required(VERSION 3.20)\nproject(mathdep LANGUAGES CXX)\n"
                          "add_library(mathdep INTERFACE)\n"
                          "target_include_directories(mathdep INTERFACE ${CMAKE_CURRENT_SOURCE_DIR}/include)\n",
        "include/mathdep.h": "inline int triple(int x) { return 3 * x; }\n"})
    factory.create("fastext", {
        "CMakeLists.txt": EXT_CMAKE.format(sha=mathdep.head(),
                                           units=" ".join(f"src/work_{i}.cpp" for i in range(WORK_UNITS))),
        "src/fastext.cpp": '#include "mathdep.h"\nextern "C" int fast_triple(int x) { return triple(x); }\n',
        **{f"src/work_{i}.cpp": WORK_CPP.format(i=i) for i in range(WORK_UNITS)}})
    greet = factory.create("greetpkg", {"greetpkg/__init__.py": pkg_init("1.0")})
    greet.pull_request(1, {"greetpkg/pr1.py": 'NAME = "pr1"\n'})
    greet.pull_request(2, {"greetpkg/__init__.py": pkg_init("1.0+pr2")})
    for n in (1, 2):  # open PRs have a merge ref on GitHub
        git("update-ref", f"refs/pull/{n}/merge", git("rev-parse", f"refs/pull/{n}/head", cwd=greet.bare),
            cwd=greet.bare)

    api = GitHubApi()
    api.states = {("example", "greetpkg", 1): {"state": "open", "merged": False},
                  ("example", "greetpkg", 2): {"state": "open", "merged": False}}

    root = base / "project"
    (root / "docker-images").mkdir(parents=True)
    d = root / "docker-images" / NAME
    shutil.copytree(FIXTURES / "project" / "docker-images" / "mirror", d)
    env = (d / "versions.env").read_text()
    env = env.replace("git://127.0.0.1:9/", "https://github.com/example/").replace(
        "MATHDEP_REF=main", f"MATHDEP_REF={mathdep.head()}")
    (d / "versions.env").write_text(env)
    (d / "image.yaml").write_text((d / "image.yaml").read_text() + "gate: gate.yaml\n")
    (d / "gate.yaml").write_text(GATE)

    mp = pytest.MonkeyPatch()
    mp.setenv("GIT_CONFIG_COUNT", "1")
    mp.setenv("GIT_CONFIG_KEY_0", f"url.git://127.0.0.1:{daemon.port}/.insteadOf")
    mp.setenv("GIT_CONFIG_VALUE_0", "https://github.com/example/")
    mp.setenv("IMAGEBUILD_GITHUB_API", api.url)
    mp.setenv("NO_PROXY", "127.0.0.1,localhost")
    mp.setenv("GITHUB_TOKEN", TOKEN)
    mp.setenv("IMAGEBUILD_CACHE", str(base / "git-cache"))
    mp.setenv("IMAGEBUILD_NO_GPU", "1")
    mp.setenv("IMAGEBUILD_HEARTBEAT_S", "0")
    mp.delenv("IMAGEBUILD_STATE_DIR", raising=False)

    try:
        peer, stop_peer = start_peer(tmp_path_factory, "nightly-peer")  # its own slot (namespace, addresses)
    except BaseException:
        mp.undo()
        raise
    addr, docker_host = peer.addr, peer.docker_host
    mp.setenv("IMAGEBUILD_SSH", peer.ssh_env)
    remove_images(f"imagebuild/{NAME}", NAME)
    try:
        yield World(root, base / "reports", greet, addr, docker_host, [], {}, api)
    finally:
        mp.undo()
        stop_peer()
        remove_images(f"imagebuild/{NAME}", NAME)
        api.stop()
        daemon.stop()


def nightly(w: World, *extra: str):
    peers = ["--peers", f"root@{w.peer_addr}"]
    r = run_cli("--root", str(w.root), "nightly", NAME, "--refresh", *peers, "--report-dir", str(w.reports),
                "--keep-reports", "3", "--progress", "quiet", "--json", *extra)
    w.outputs += [r.out, r.err]
    doc = json.loads(r.out) if r.out.strip().startswith("{") else None
    if doc is not None:
        jsonschema.Draft202012Validator(SCHEMA).validate(doc)
        stored = json.loads((w.reports / f"{doc['run_id']}.json").read_text())
        jsonschema.Draft202012Validator(SCHEMA).validate(stored)
        assert stored == doc
    return r, doc


def local_identity(docker_env: str | None = None) -> str | None:
    env = {**os.environ, **({"DOCKER_HOST": docker_env} if docker_env else {})}
    r = subprocess.run(["docker", "image", "inspect", f"{NAME}:local"], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        return None
    from imagebuild.core.identity import from_inspect

    return from_inspect(json.loads(r.stdout)[0]).digest


def test_nightly_end_to_end(world):
    w = world
    # --- 1. first run: everything is built, gated, promoted (and synced)
    r, doc = nightly(w)
    assert r.code == 0, r.err[-3000:]
    (im,) = doc["images"]
    assert im["status"] == "ok" and doc["status"] == "ok"
    assert [s["cache"] for s in im["stages"]] == ["miss"] * 6
    assert im["gate"]["result"] == "passed" and im["gate"]["ran"] and im["gate"]["gpu_checks_skipped"]
    assert any(c["outcome"] == "skipped" and c["requires_gpu"] for c in im["gate"]["checks"])
    assert im["promotion"]["status"] == "promoted"
    assert im["changes"] is None and "first promotion" in im["changes_note"]
    assert {p["number"]: p["state"] for p in im["upstream"]["pull_requests"]} == {1: "open", 2: "open"}
    assert all(p["via"] == ["git ls-remote", "GitHub API"] for p in im["upstream"]["pull_requests"])
    assert f"Bearer {TOKEN}" in w.api.seen_auth
    md = (w.reports / f"{doc['run_id']}.md").read_text()
    assert "**GPU checks were SKIPPED**" in md and "| SKIPPED (GPU) | gpu-visible |" in md
    first_local = local_identity()
    assert first_local == im["identity"] == im["tags"]["local"]["identity"]
    (p,) = im["sync"]["peers"]
    assert p["status"] == "synced" and p["bytes_sent"] > 0, im["sync"]
    assert local_identity(w.peer_docker) == first_local
    w.times["first"] = doc["seconds"]

    # --- 2. one PR head moved upstream, one patch changed here
    new_head = w.greet.move_pull_request(2, {"greetpkg/__init__.py": pkg_init("1.0+pr2.1")})
    git("update-ref", "refs/pull/2/merge", new_head, cwd=w.greet.bare)
    patch = w.root / "docker-images" / NAME / "patch_greetpkg.py"
    patch.write_text(patch.read_text().replace('reason="use the C++ library"', 'reason="use the C++ library (v2)"'))
    r, doc = nightly(w)
    assert r.code == 0, r.err[-3000:]
    (im,) = doc["images"]
    moved = im["upstream"]["moved"]
    assert [(m["source"], m["what"], m["to"]) for m in moved] == [("GREETPKG", "PR 2", new_head)]
    assert {s["name"]: s["cache"] for s in im["stages"]} == {
        "base": "hit", "toolchain": "hit", "ext": "hit", "pkg": "miss", "patches": "miss", "runner": "miss"}
    assert im["promotion"]["status"] == "promoted"
    ch = im["changes"]
    assert {c["name"] for c in ch["pins"]["changed"]} >= {"GREETPKG PR 2", "GREETPKG commit"}
    assert [c["name"] for c in ch["patches"]["changed"]] == ["patch_greetpkg.py"]
    assert ch["layers"]["shared"] >= 4 and ch["layers"]["added"]
    assert ch["dpkg"] is not None and not ch["dpkg"]["changed"]
    md = (w.reports / f"{doc['run_id']}.md").read_text()
    assert "**moved** GREETPKG PR 2" in md and "`patch_greetpkg.py`" in md
    second_local = local_identity()
    assert second_local == im["identity"] != first_local
    (p2,) = im["sync"]["peers"]
    assert p2["status"] == "synced" and p2["bytes_sent"] > 0, im["sync"]
    assert p2["bytes_sent"] < p["bytes_sent"] / 4, (p, p2)  # only the layers the peer lacks
    assert local_identity(w.peer_docker) == second_local
    print(f"sync: first run {p['bytes_sent'] / 1e6:.1f} MB in {p['seconds']:.1f} s, second run "
          f"{p2['bytes_sent'] / 1e6:.1f} MB in {p2['seconds']:.1f} s")
    w.times["second"] = doc["seconds"]
    ratio = w.times["second"] / w.times["first"]
    print(f"\nnightly timings: first run {w.times['first']:.1f} s, second run (one PR moved, one patch changed) "
          f"{w.times['second']:.1f} s, ratio {ratio:.2f}")
    r = run_cli("--root", str(w.root), "diff", f"{NAME}:previous", f"{NAME}:local")
    assert r.code == 0 and "`GREETPKG PR 2`" in r.out and "`patch_greetpkg.py`" in r.out, r.out + r.err

    # --- 3. upstream breaks the image (and PR 1 is merged): the gate fails, nothing moves
    w.greet.move_pull_request(2, {"greetpkg/__init__.py": pkg_init("broken")})
    git("update-ref", "-d", "refs/pull/1/merge", cwd=w.greet.bare)
    w.api.states[("example", "greetpkg", 1)] = {"state": "closed", "merged": True}
    r, doc = nightly(w)
    assert r.code == 4, r.err[-3000:]
    (im,) = doc["images"]
    assert doc["status"] == "gate-failed" and im["status"] == "gate-failed"
    assert "gate failed" in im["reason"] and "peers were not touched" in im["reason"]
    assert im["gate"]["result"] == "failed" and im["promotion"]["status"] == "gate-failed"
    assert [c["id"] for c in im["gate"]["checks"] if c["outcome"] == "failed"] == ["smoke"]
    assert im["sync"]["status"] == "not-run" and "gate failed" in im["sync"]["reason"]
    pr1 = next(p for p in im["upstream"]["pull_requests"] if p["number"] == 1)
    assert pr1["state"] == "closed" and pr1["merged"] is True and pr1["merge_ref"] == "absent"
    assert local_identity() == second_local
    assert local_identity(w.peer_docker) == second_local
    md = (w.reports / f"{doc['run_id']}.md").read_text()
    assert "gate failed" in md and "| FAILED | smoke |" in md

    # the last 3 reports are kept; `report` finds them; the token is nowhere
    assert len(list(w.reports.glob("*.json"))) == 3
    r = run_cli("--root", str(w.root), "report", NAME, "--report-dir", str(w.reports))
    assert r.code == 0 and f"## {NAME}: gate-failed" in r.out
    texts = list(w.outputs) + [p.read_text() for p in w.reports.iterdir()]
    texts += [p.read_text(errors="replace") for p in (w.root / ".imagebuild").rglob("*") if p.is_file()
              and p.suffix in (".json", ".log", ".md")]
    assert texts and not any(TOKEN in t for t in texts)


def test_nightly_refused_while_serving(world):
    w = world
    from imagebuild.core import runs

    before_runs = len(runs.list_runs(w.root, NAME))
    env_file = (w.root / "docker-images" / NAME / "versions.env").read_text()
    cand = image_id(f"{NAME}:candidate")
    w.greet.move_pull_request(2, {"greetpkg/__init__.py": pkg_init("1.0+pr2.2")})  # something to build
    label = f"imagebuild.test-serve={NAME}"
    c = subprocess.run(["docker", "run", "-d", "--rm", "--label", label, "--network", "none",
                        "imagebuild-test/busybox:1", "sleep", "300"], capture_output=True, text=True, check=True)
    cid = c.stdout.strip()
    mp = pytest.MonkeyPatch()
    mp.setenv("IMAGEBUILD_SERVING_LABELS", label)  # only this test's container counts for this run
    try:
        r, doc = nightly(w)
    finally:
        mp.undo()
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True)
    assert r.code == 3, r.err[-2000:]
    assert doc["status"] == "refused" and doc["refused"]["containers"][0]["id"] == cid[:12]
    (im,) = doc["images"]
    assert im["status"] == "refused" and im["steps"] == {} and im["stages"] == []
    assert len(runs.list_runs(w.root, NAME)) == before_runs  # nothing built
    assert (w.root / "docker-images" / NAME / "versions.env").read_text() == env_file  # nothing prefetched
    assert image_id(f"{NAME}:candidate") == cand
    md = (w.reports / f"{doc['run_id']}.md").read_text()
    assert "## Refused" in md and cid[:12] in md


def test_one_image_failing_does_not_stop_the_next(world):
    w = world
    broken = w.root / "docker-images" / f"{NAME}-broken"
    broken.mkdir()
    (broken / "versions.env").write_text("BASE=imagebuild-test/busybox:1\n")
    (broken / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: only\n    form: BASE\n")
    try:
        r = run_cli("--root", str(w.root), "nightly", broken.name, NAME, "--refresh", "--peers",
                    "--report-dir", str(w.reports), "--progress", "quiet", "--json")
    finally:
        shutil.rmtree(broken)
    w.outputs += [r.out, r.err]
    doc = json.loads(r.out)
    jsonschema.Draft202012Validator(SCHEMA).validate(doc)
    first, second = doc["images"]
    assert first["status"] == "failed" and first["exit_code"] == 2, first
    assert f"docker-images/{broken.name}/image.yaml" in first["reason"] and "form" in first["reason"]
    assert second["status"] == "ok" and second["exit_code"] == 0, second["reason"]
    assert r.code == 2 and doc["exit_code"] == 2  # the worst of the two
    assert "Traceback" not in r.err


def test_notify_hook_gets_the_report_not_the_token(project, engine_ready, tmp_path, monkeypatch):
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    bad = project / "docker-images" / "notify-broken"
    bad.mkdir()
    (bad / "versions.env").write_text("BASE=imagebuild-test/busybox:1\n")
    (bad / "image.yaml").write_text("platform: linux/amd64\nstages: []\n")
    out = tmp_path / "hook.out"
    hook = f"sh -c 'echo \"$1|$IMAGEBUILD_NIGHTLY_STATUS|$IMAGEBUILD_NIGHTLY_EXIT|${{GITHUB_TOKEN:-no token}}\" > {out}' hook"
    r = run_cli("--root", str(project), "nightly", "notify-broken", "--peers", "--no-gc", "--notify", hook,
                "--report-dir", str(tmp_path / "reports"))
    assert r.code == 2, r.err
    md, status, code, token = out.read_text().strip().split("|")
    assert Path(md).is_file() and Path(md).parent == tmp_path / "reports" and md.endswith(".md")
    assert (status, code, token) == ("failed", "2", "no token")
    assert TOKEN not in r.out + r.err + Path(md).read_text()
    # a failing hook is a warning; the run's exit code stays the build's
    r = run_cli("--root", str(project), "nightly", "notify-broken", "--peers", "--no-gc", "--notify", "false",
                "--report-dir", str(tmp_path / "reports"))
    assert r.code == 2 and "notify hook 'false' exited 1" in r.err
