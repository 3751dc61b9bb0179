"""imagebuild build against the real engine (BuildKit, containerd store) on the `staged` test
definition: five busybox stages, a prefetched tarball mounted as a named build context, a patch
stage, a runner. Stages go to the session's shared stage store (an OCI layout, keyed by
content), so every test's private project copy reuses what the first build made; the session
removes the release images at the end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from imagebuild.buildstep.stagestore import StageStore
from tests.buildfixtures import IMAGE, cat, image_id, labels, remove_images, staged_project
from tests.conftest import BUSYBOX, run_cli

pytestmark = pytest.mark.engine

STAGES = ["base", "tools", "app", "patched", "runner"]


@pytest.fixture(scope="session")
def built(tmp_path_factory, engine_info):
    """One full build of `staged` (from nothing) shared by the tests below."""
    remove_images(f"imagebuild/{IMAGE}", IMAGE)
    # from nothing also when an earlier test (test_gc.py) built `staged` into the session's store
    shutil.rmtree(StageStore.for_image(None, IMAGE).dir / "refs", ignore_errors=True)
    root = staged_project(tmp_path_factory.mktemp("b") / "project")
    res = run_cli("--root", str(root), "build", IMAGE, "--json")
    assert res.code == 0, res.err
    yield root, json.loads(res.out)
    remove_images(f"imagebuild/{IMAGE}", IMAGE)


def _build(root, *args, env=None):
    res = run_cli("--root", str(root), "build", IMAGE, "--json", *args)
    rec = json.loads(res.out) if res.code == 0 else None
    return res, rec


def _status(rec):
    return {s["name"]: s["status"] for s in rec["stages"]}


def _manifests(rec):
    """Each stage's image in the stage store: the manifest digest its key names now."""
    store = StageStore.for_image(None, IMAGE)
    return {s["name"]: (store.lookup(s["key"]).manifest if store.lookup(s["key"]) else None) for s in rec["stages"]}


def test_full_build_every_stage_offline_with_provenance(built):
    root, rec = built
    assert _status(rec) == dict.fromkeys(STAGES, "built")
    assert all(s["network"] == "none" for s in rec["stages"])
    cand = f"{IMAGE}:candidate"
    # --network none for real: the stages saw only the loopback interface
    assert cat(cand, "/opt/staged/net-base").split() == ["lo"]
    assert cat(cand, "/opt/staged/net-app").split() == ["lo"]
    # the prefetched tarball was mounted, not copied: its contents are there, the tarball is not
    assert 'return "HELLO"  # imagebuild-patch: greet-loud' in cat(cand, "/opt/greet/greet.py")
    r = subprocess.run(["docker", "run", "--rm", cand, "sh", "-c", "ls -R / 2>/dev/null | grep -c tar.gz"],
                       capture_output=True, text=True)
    assert r.stdout.strip() == "0", (r.returncode, r.stderr[-2000:])
    # MAX_JOBS came from the documented rule (the stage declares ARG MAX_JOBS=1)
    assert rec["stages"][1]["args"]["MAX_JOBS"] == cat(cand, "/opt/staged/max-jobs").strip()
    # patch outcomes: in the image and in the build record
    in_image = json.loads(cat(cand, "/opt/imagebuild/patches.json"))
    assert in_image["patches"]["patch_greet.py"]["outcome"] == "applied"
    assert rec["patches"]["patch_greet.py"]["outcome"] == "applied"
    # every stage is in the stage store (an OCI layout), none in the engine's image store
    assert all(_manifests(rec).values())
    assert all(image_id(s["image"]) is None for s in rec["stages"])
    # release: provenance labels, the lock inside, candidate + b-<build id> tags; no gate spec -> no :local
    assert image_id(cand) == image_id(f"{IMAGE}:b-{rec['build_id']}")
    lab = labels(cand)
    assert lab["org.opencontainers.image.created"] == "2023-11-14T22:13:20Z"  # the lock's source_date_epoch
    assert lab["io.imagebuild.build-id"] == rec["build_id"]
    assert json.loads(lab["io.imagebuild.stage-keys"]) == {s["name"]: s["key"] for s in rec["stages"]}
    assert lab["org.opencontainers.image.version"] == f"b-{rec['build_id']}"
    assert lab["io.imagebuild.definition-sha256"].startswith("sha256:")
    lock_in_image = cat(cand, "/opt/imagebuild/lock.json")
    assert lock_in_image == (root / "docker-images" / IMAGE / "lock.json").read_text()
    assert image_id(f"{IMAGE}:local") is None
    assert rec["promotion"]["status"] == "skipped"
    # the config a recipe relies on
    cfg = json.loads(subprocess.run(["docker", "image", "inspect", "--format", "{{json .Config}}", cand],
                                    capture_output=True, text=True, check=True).stdout)
    assert cfg["Cmd"] == ["sh"] and not cfg.get("Entrypoint")
    # per-stage logs in the run's own folder
    logs = root / ".imagebuild" / "builds" / IMAGE / rec["run_id"] / "logs"
    assert sorted(p.stem for p in logs.glob("*.log")) == sorted(STAGES + ["release"])
    # build.json: which composed commits are local-only, each patch's script digest
    doc = json.loads(cat(cand, "/opt/imagebuild/build.json"))
    assert doc["sources"]["GREET"]["local_only"] is False


def test_noop_rebuild_skips_everything_fast(built):
    root, first = built
    t0 = time.perf_counter()
    res, rec = _build(root)
    took = time.perf_counter() - t0
    assert res.code == 0, res.err
    assert _status(rec) == dict.fromkeys(STAGES, "skipped")
    assert rec["release"]["identity"] == first["release"]["identity"]
    assert took < 2.0, took


def test_changing_only_a_patch_rebuilds_from_the_patch_stage(built, tmp_path):
    root = staged_project(tmp_path / "p")
    before = _manifests(built[1])
    p = root / "docker-images" / IMAGE / "patch_greet.py"
    p.write_text(p.read_text().replace('"HELLO"', '"HELLO!"'))
    res, rec = _build(root)
    assert res.code == 0, res.err
    assert _status(rec) == {"base": "skipped", "tools": "skipped", "app": "skipped", "patched": "built",
                            "runner": "built"}
    assert 'return "HELLO!"' in cat(f"{IMAGE}:candidate", "/opt/greet/greet.py")
    # a new image gets a new build id: the first build's b-<id> still names the first image
    assert rec["build_id"] != built[1]["build_id"]
    assert rec["release"]["identity"] != built[1]["release"]["identity"]
    assert image_id(f"{IMAGE}:b-{built[1]['build_id']}") == built[1]["release"]["image_id"]
    # the first build's stages are untouched in the store
    assert _manifests(built[1]) == before


def test_two_no_cache_builds_give_the_same_identity(built, tmp_path):
    """Every stage is reproducible by default: a whole chain rebuilt twice without any cache gives
    the same stage manifests and the same final identity (issue 9, item 2)."""
    root = staged_project(tmp_path / "p")
    first = built[1]
    ids = []
    for _ in range(2):
        res, rec = _build(root, "--no-cache")
        assert res.code == 0, res.err
        assert _status(rec) == dict.fromkeys(STAGES, "built")
        assert [s["manifest"] for s in rec["stages"]] == [s["manifest"] for s in first["stages"]]
        ids.append(rec["release"]["identity"])
    assert ids == [first["release"]["identity"]] * 2
    _assert_no_later_times(root, rec)


def _assert_no_later_times(root: Path, rec: dict) -> None:
    """No file time in a stage's own layers (those after its parent's) is later than the stage's
    SOURCE_DATE_EPOCH."""
    import io
    import tarfile

    import zstandard

    from imagebuild.definition import reader as definition
    from imagebuild.plan import planner as plan_mod

    base = plan_mod.make_plan(definition.load(root, IMAGE)).stages[0].parent_ref
    parent = json.loads(subprocess.run(["docker", "image", "inspect", "--format", "{{json .RootFS.Layers}}", base],
                                       capture_output=True, text=True, check=True).stdout)
    store = StageStore(Path(rec["stage_store"]))
    for s in rec["stages"]:
        epoch = int(s["args"]["SOURCE_DATE_EPOCH"])
        layers = store.read_json_blob(s["manifest"])["layers"]
        ids = store.diff_ids(s["manifest"])
        assert ids[:len(parent)] == parent
        for la in layers[len(parent):]:
            data = store.blob(la["digest"]).read_bytes()
            if la["mediaType"].endswith("zstd"):
                data = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read()
            with tarfile.open(fileobj=io.BytesIO(data)) as t:
                assert max((x.mtime for x in t.getmembers()), default=0) <= epoch, (s["name"], la["digest"])
        parent = ids


def test_no_cache_rebuild_of_a_no_compile_stage_gives_the_same_digest(built, tmp_path):
    root = staged_project(tmp_path / "p")
    first = built[1]
    res, rec = _build(root, "--from", "runner", "--no-cache")
    assert res.code == 0, res.err
    assert _status(rec)["runner"] == "built"
    assert rec["stages"][-1]["manifest"] == first["stages"][-1]["manifest"]
    assert rec["release"]["identity"] == first["release"]["identity"]
    assert rec["release"]["image_id"] == first["release"]["image_id"]
    # each run has its own record folder: the earlier run's record is still there
    runs = root / ".imagebuild" / "builds" / IMAGE
    assert (runs / rec["run_id"] / "record.json").is_file()
    res2, rec2 = _build(root)
    assert rec2["run_id"] != rec["run_id"] and (runs / rec["run_id"] / "record.json").is_file()
    out = run_cli("--root", str(root), "log", IMAGE)
    assert out.code == 0 and rec["run_id"] in out.out and rec2["run_id"] in out.out
    out = run_cli("--root", str(root), "log", IMAGE, rec["run_id"][:18], "--stage", "runner")
    assert out.code == 0 and "exporting" in out.out


def test_tampered_tarball_is_refused_before_docker_starts(built, tmp_path):
    root = staged_project(tmp_path / "p")
    tb = next((root / "deps-src" / IMAGE / "src").glob("*.tar.gz"))
    data = bytearray(tb.read_bytes())
    data[len(data) // 2] ^= 0x01
    tb.write_bytes(bytes(data))
    before = _manifests(built[1])
    res, _ = _build(root, "--no-cache")
    assert res.code == 1
    assert tb.name in res.err and "does not match the lock" in res.err and "imagebuild prefetch" in res.err
    # nothing ran: no log, no record, every stage image as it was
    assert not (root / ".imagebuild" / "builds").exists()
    assert _manifests(built[1]) == before


@pytest.fixture
def serving_container(engine_info):
    name = f"imagebuild-test-serving-{os.getpid()}"
    subprocess.run(["docker", "run", "-d", "--rm", "--name", name, "--network", "none",
                    "--label", "imagebuild.role=serve", BUSYBOX, "sh", "-c", "exec sleep 300", "vllm", "serve"],
                   check=True, capture_output=True)
    yield name
    subprocess.run(["docker", "rm", "-f", name], capture_output=True)


def test_serving_container_makes_build_refuse(built, serving_container, monkeypatch):
    root = built[0]
    res, _ = _build(root)
    assert res.code == 3, res.err
    assert serving_container in res.err and "vllm serve" in res.err and "--force" in res.err
    # configurable: the label alone still counts when no command pattern matches
    monkeypatch.setenv("IMAGEBUILD_SERVING_COMMANDS", "*nothing-like-this*")
    res, _ = _build(root)
    assert res.code == 3 and "label 'imagebuild.role=serve'" in res.err
    # --force overrides, with a warning
    res = run_cli("--root", str(root), "build", IMAGE, "--force", "--dry-run")
    assert res.code == 0 and "warning: building while serving containers run" in res.err
    monkeypatch.setenv("IMAGEBUILD_SERVING_LABELS", "some.other=label")
    assert run_cli("--root", str(root), "build", IMAGE, "--dry-run").code == 0


def test_a_serve_started_by_docker_exec_makes_build_refuse(built, engine_info):
    """eugr's launcher: `sleep infinity` as the container's command, `vllm serve` docker-exec'd."""
    root = built[0]
    name = f"imagebuild-test-exec-serve-{os.getpid()}"
    subprocess.run(["docker", "run", "-d", "--rm", "--name", name, "--network", "none", BUSYBOX,
                    "sleep", "300"], check=True, capture_output=True)
    try:
        assert run_cli("--root", str(root), "build", IMAGE, "--dry-run").code == 0  # only sleep runs
        subprocess.run(["docker", "exec", "-d", name, "sh", "-c",
                        "while :; do sleep 1; done; : vllm serve /models/glm --port 8000"], check=True)
        deadline = time.monotonic() + 10
        while "vllm serve" not in subprocess.run(["docker", "top", name, "-o", "pid,args"], capture_output=True,
                                                 text=True).stdout and time.monotonic() < deadline:
            time.sleep(0.2)
        res, _ = _build(root)
        assert res.code == 3, res.err
        assert name in res.err and "started by docker exec" in res.err and "vllm serve" in res.err
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)


def test_failing_stage_leaves_local_and_candidate_where_they_were(built, tmp_path):
    root = staged_project(tmp_path / "p")
    subprocess.run(["docker", "tag", BUSYBOX, f"{IMAGE}:local"], check=True)
    try:
        local, cand = image_id(f"{IMAGE}:local"), image_id(f"{IMAGE}:candidate")
        df = root / "docker-images" / IMAGE / "Dockerfile.runner"
        df.write_text(df.read_text().replace("RUN cat", "RUN echo about-to-fail && false && cat"))
        res, _ = _build(root)
        assert res.code == 1
        assert "stage 'runner'" in res.err and "about-to-fail" in res.err and "full log:" in res.err
        log = root / ".imagebuild" / "builds" / IMAGE
        assert list(log.glob("*/logs/runner.log"))
        rec = json.loads(next(log.glob("*/record.json")).read_text())
        assert rec["status"] == "failed" and rec["failed_stage"] == "runner"
        assert image_id(f"{IMAGE}:local") == local and image_id(f"{IMAGE}:candidate") == cand
    finally:
        subprocess.run(["docker", "image", "rm", f"{IMAGE}:local"], capture_output=True)


GATE = """\
description: the staged runner greets loudly
timeout: 60
checks:
  - id: loud
    kind: file
    path: /opt/greet/greet.py
    matches: '{pattern}'
"""


def test_gate_pass_promotes_previous_and_rollback(built, tmp_path):
    root = staged_project(tmp_path / "p")
    gate = root / "docker-images" / IMAGE / "gate.yaml"
    gate.write_text(GATE.format(pattern="HELLO"))
    try:
        res, rec = _build(root)
        assert res.code == 0, res.err
        first = image_id(f"{IMAGE}:candidate")
        assert rec["promotion"]["status"] == "promoted" and image_id(f"{IMAGE}:local") == first
        # a second, different build passes too: :local moves, the old one becomes :previous
        motd = root / "docker-images" / IMAGE / "files" / "motd.txt"
        motd.write_text("second\n")
        res, rec = _build(root)
        assert res.code == 0, res.err
        second = image_id(f"{IMAGE}:candidate")
        assert second != first
        assert image_id(f"{IMAGE}:local") == second and image_id(f"{IMAGE}:previous") == first
        # a failing gate leaves :local where it was (exit 4)
        gate.write_text(GATE.format(pattern="no-such-text"))
        motd.write_text("third\n")
        res, _ = _build(root)
        assert res.code == 4, res.err
        assert image_id(f"{IMAGE}:local") == second
        # rollback swaps :local and :previous
        r = run_cli("--root", str(root), "rollback", IMAGE)
        assert r.code == 0, r.err
        assert image_id(f"{IMAGE}:local") == first and image_id(f"{IMAGE}:previous") == second
    finally:
        subprocess.run(["docker", "image", "rm", f"{IMAGE}:local", f"{IMAGE}:previous"], capture_output=True)


def test_one_build_per_image_at_a_time(built):
    root = built[0]
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from imagebuild.buildstep import guards; from pathlib import Path; "
         "from imagebuild.core import engine; "
         f"lk = guards.BuildLock(guards.build_lock_path(engine.probe().id, {IMAGE!r}), {IMAGE!r}); "
         "lk.acquire('holder'); "
         "print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    try:
        assert holder.stdout.readline().strip() == "held"
        res, _ = _build(root)
        assert res.code == 3
        assert f"pid {holder.pid}" in res.err and "another build of 'staged' is running" in res.err
    finally:
        holder.kill()
        holder.wait()
    res, _ = _build(root)
    assert res.code == 0, res.err  # released when the holder died


def test_foreign_platform_refused_unless_emulate(built, tmp_path):
    root = staged_project(tmp_path / "p")
    y = root / "docker-images" / IMAGE / "image.yaml"
    y.write_text(y.read_text().replace("platform: linux/amd64", "platform: linux/riscv64"))
    res, _ = _build(root)
    assert res.code == 3 and "linux/riscv64" in res.err and "--emulate" in res.err
    # with --emulate the host may run it, but the local bases are amd64: labelling the result riscv64 would
    # lie, so the build is refused before anything runs, naming the pin (issue 9, item 8)
    res = run_cli("--root", str(root), "build", IMAGE, "--emulate", "--dry-run")
    assert res.code == 2, res.err
    assert "versions.env" in res.err and "BASE_IMAGE" in res.err and "linux/amd64" in res.err


def test_from_until_and_dry_run(built, tmp_path):
    root = built[0]
    res = run_cli("--root", str(root), "build", IMAGE, "--dry-run", "--json", "--no-cache", "--from", "app",
                  "--until", "patched")
    assert res.code == 0, res.err
    plan = json.loads(res.out)
    assert [s["action"] for s in plan["stages"]] == ["reuse", "reuse", "build", "build", "not-requested"]
    assert plan["release"] is False and plan["stages"][2]["args"]["SOURCE_DATE_EPOCH"] == "1700000000"
    res = run_cli("--root", str(root), "build", IMAGE, "--from", "nope")
    assert res.code == 2 and "stages: base, tools, app, patched, runner" in res.err
    res, rec = _build(root, "--until", "tools")
    assert res.code == 0 and rec["release"] is None
    # the dry run shows every docker command: each stage with --network none, from the stage store
    res = run_cli("--root", str(root), "build", IMAGE, "--dry-run", "--no-cache")
    assert res.code == 0, res.err
    cmds = [ln for ln in res.out.splitlines() if ln.strip().startswith("docker buildx build")]
    assert len(cmds) == len(STAGES) and all("--network none" in c for c in cmds)
    assert not any("rewrite-timestamp" in c for c in cmds)  # file times are clamped by layerclamp.py
    assert sum("imagebuild-parent=oci-layout://" in c for c in cmds) == len(STAGES) - 1


def test_provenance_names_an_uncommitted_definition_as_dirty(built, tmp_path):
    """Issue 9, item 5: the revision label never names a commit whose tree lacks what was built."""
    root = staged_project(tmp_path / "p")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "definitions"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    res, rec = _build(root)
    assert res.code == 0, res.err
    lab = labels(f"{IMAGE}:candidate")
    assert lab["org.opencontainers.image.revision"] == head  # the lock came with the commit: clean
    clean_digest = lab["io.imagebuild.definition-sha256"]
    motd = root / "docker-images" / IMAGE / "files" / "motd.txt"
    motd.write_text("not committed\n")
    res, rec2 = _build(root)
    assert res.code == 0, res.err
    lab = labels(f"{IMAGE}:candidate")
    assert lab["org.opencontainers.image.revision"] == head + "-dirty"
    assert lab["io.imagebuild.definition-sha256"] != clean_digest
    assert rec2["build_id"] != rec["build_id"]
    doc = json.loads(cat(f"{IMAGE}:candidate", "/opt/imagebuild/build.json"))
    assert doc["provenance"]["dirty"] is True and doc["provenance"]["revision"] == head + "-dirty"
    # every patch in the record carries the sha256 of its script
    import hashlib

    script = (root / "docker-images" / IMAGE / "patch_greet.py").read_bytes()
    rec_patch = json.loads(cat(f"{IMAGE}:candidate", "/opt/imagebuild/patches.json"))["patches"]["patch_greet.py"]
    assert rec_patch["sha256"] == "sha256:" + hashlib.sha256(script).hexdigest()


def test_a_build_with_no_lock_at_all_is_told_it_is_absent_and_prefetch_makes_it(tmp_path, engine_info):
    """Issue 35: a definition never prefetched has no lock.json: the build says that (and that
    `prefetch` makes it), not that the lock is "stale"; nothing is built."""
    root = staged_project(tmp_path / "p")
    (root / "docker-images" / IMAGE / "lock.json").unlink()
    res = run_cli("--root", str(root), "build", IMAGE, "--no-gate", "--force")
    assert res.code == 1, res.err
    assert f"docker-images/{IMAGE}/lock.json does not exist: the image was never prefetched" in res.err, res.err
    assert f"hint: imagebuild prefetch {IMAGE} makes it" in res.err and "stale" not in res.err, res.err


def test_diff_shows_a_changed_versions_env_value(tmp_path, engine_info):
    """Issue 35: the build args that reached each stage are in the image's build.json, so `imagebuild
    diff` names a changed versions.env value (TOOL_VERSION of the stage tools)."""
    from tests.fleetfixtures import fleet_project, remove_fleet_images, unique_name

    name = unique_name("bargs")
    root = fleet_project(tmp_path / "p", name)
    env = root / "docker-images" / name / "versions.env"
    try:
        r1 = run_cli("--root", str(root), "build", name, "--no-gate", "--force", "--json")
        assert r1.code == 0, r1.err
        env.write_text(env.read_text().replace("TOOL_VERSION=1.0", "TOOL_VERSION=1.1"))
        r2 = run_cli("--root", str(root), "build", name, "--no-gate", "--force", "--json")
        assert r2.code == 0, r2.err
        ids = [json.loads(r.out)["build_id"] for r in (r1, r2)]
        d = run_cli("--root", str(root), "diff", f"{name}:b-{ids[0]}", f"{name}:b-{ids[1]}", "--json")
        assert d.code == 0, d.err
        args = json.loads(d.out)["build_args"]
        assert args["changed"] == [{"name": "tools TOOL_VERSION", "from": "1.0", "to": "1.1"}], args
        assert not any(c["name"].endswith("MAX_JOBS") for c in args["changed"] + args["added"])
        md = run_cli("--root", str(root), "diff", f"{name}:b-{ids[0]}", f"{name}:b-{ids[1]}")
        assert "`tools TOOL_VERSION`: 1.0 -> 1.1" in md.out, md.out
    finally:
        remove_fleet_images(name)
