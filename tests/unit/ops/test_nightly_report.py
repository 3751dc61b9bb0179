"""The nightly's pieces that need no engine: exit-code order, the report (schema, atomic files,
retention, lookup, secrets), the image diff's parsers and comparison."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from imagebuild.core.errors import UsageError
from imagebuild.ops import imagediff, nightly, report
from tests.conftest import run_cli

SCHEMA_PATH = Path(__file__).resolve().parents[3] / "docs" / "nightly-report.schema.json"
TOKEN = "ghp_unitTestToken0123456789abcdefXYZ"
SHA = "sha256:" + "ab" * 32
SHA2 = "sha256:" + "cd" * 32


def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


def validate(doc: dict) -> None:
    jsonschema.Draft202012Validator(schema()).validate(doc)


def test_schema_is_a_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(schema())


def test_worst_exit_code_order():
    assert nightly.worst([]) == 0
    assert nightly.worst([0, 3]) == 3
    assert nightly.worst([3, 4, 0]) == 4
    assert nightly.worst([4, 1]) == 1
    assert nightly.worst([1, 2, 4]) == 2
    assert nightly.worst([2, 130]) == 130


def _inv(ref, identity, *, pins, patches, pip, dpkg, layers):
    return {"ref": ref, "identity": identity, "build_id": "0123456789abcdef", "size": 1000,
            "lock": {"sources": {"GREET": {"ref": pins[0], "commit": pins[1],
                                           "prs": [{"number": 2, "sha": pins[2]}]}}},
            "build": {"patches": {"patch_x.py": {"outcome": "applied", "sha256": patches}}},
            "pip": pip, "dpkg": dpkg, "layers": [{"diff_id": d, "size": s} for d, s in layers]}


def sample_diff() -> dict:
    a = _inv("x:local", SHA, pins=("a" * 40, "b" * 40, "c" * 40), patches="1" * 64,
             pip={"greet": "1.0", "old": "2"}, dpkg={"bash": "5.2"},
             layers=[(SHA, 100), ("sha256:" + "01" * 32, 10)])
    b = _inv("x:b-1", SHA2, pins=("a" * 40, "d" * 40, "e" * 40), patches="2" * 64,
             pip={"greet": "1.1", "new": "3"}, dpkg={"bash": "5.2"},
             layers=[(SHA, 100), ("sha256:" + "02" * 32, 20)])
    return imagediff.diff(a, b)


def test_diff_compares_pins_patches_packages_layers():
    d = sample_diff()
    assert not d["same_image"]
    assert {c["name"] for c in d["pins"]["changed"]} == {"GREET PR 2", "GREET commit"}
    assert d["patches"]["changed"][0]["name"] == "patch_x.py"
    assert d["pip"]["changed"] == [{"name": "greet", "from": "1.0", "to": "1.1"}]
    assert [x["name"] for x in d["pip"]["added"]] == ["new"] and [x["name"] for x in d["pip"]["removed"]] == ["old"]
    assert d["dpkg"]["unchanged"] == 1 and not d["dpkg"]["changed"]
    assert d["layers"]["shared"] == 1 and d["layers"]["added_bytes"] == 20
    md = imagediff.render(d)
    assert "`GREET PR 2`: cccccccccccc -> eeeeeeeeeeee" in md
    assert "**layers**: 1 of 2 shared" in md


def test_diff_names_a_patch_digest_once_and_lists_a_follows_change_among_the_pins():
    """Issue 21: a build record's patch digest is already ``sha256:<hex>`` and the diff printed
    ``sha256:sha256:``; a pin that follows another branch (NAME_REF=<name>@<sha>) was not listed."""
    a = _inv("x:local", SHA, pins=("a" * 40, "b" * 40, "c" * 40), patches="sha256:" + "1" * 64,
             pip={}, dpkg={}, layers=[(SHA, 100)])
    b = _inv("x:b-1", SHA2, pins=("a" * 40, "b" * 40, "c" * 40), patches="sha256:" + "2" * 64,
             pip={}, dpkg={}, layers=[(SHA, 100)])
    a["lock"]["sources"]["GREET"]["follows"] = "main"
    b["lock"]["sources"]["GREET"]["follows"] = "release-2"
    d = imagediff.diff(a, b)
    md = imagediff.render(d)
    assert "sha256:sha256:" not in md
    assert "`patch_x.py`: applied sha256:111111111111 -> applied sha256:222222222222" in md
    assert d["pins"]["changed"] == [{"name": "GREET follows", "from": "main", "to": "release-2"}]
    assert "`GREET follows`: main -> release-2" in md


def test_the_changes_note_says_first_promotion_only_when_the_image_was_promoted(monkeypatch):
    """Issue 21: a gate-failed first image was noted "(first promotion)"."""
    inv = {"identity": SHA, "ref": "x:b-1"}
    monkeypatch.setattr(imagediff, "inventory", lambda ref, ctx: inv)
    notes = {}
    for status in ("promoted", "gate-failed"):
        res = {"identity": SHA, "build_id": "1", "changes_note": None, "promotion": {"status": status}}
        nightly._changes(None, "x", res, None, None)
        notes[status] = res["changes_note"]
    assert notes["promoted"].endswith("(first promotion)")
    assert "first promotion" not in notes["gate-failed"] and "not promoted: gate-failed" in notes["gate-failed"]


def test_package_list_parsers():
    status = ("Package: bash\nStatus: install ok installed\nVersion: 5.2-1\nDescription: x\n continued\n\n"
              "Package: gone\nStatus: deinstall ok config-files\nVersion: 1\n\n"
              "Package: libc6\nStatus: install ok installed\nArchitecture: amd64\nVersion: 2.36\n")
    assert imagediff.parse_dpkg_status(status) == {"bash": "5.2-1", "libc6": "2.36"}
    assert imagediff.parse_dpkg_list("bash\t5.2-1\nlibc6\t2.36\n") == {"bash": "5.2-1", "libc6": "2.36"}
    assert imagediff.parse_freeze("# c\nTorch==2.13.0\nvllm @ file:///w/vllm.whl\nmy_pkg==1\n") == {
        "torch": "2.13.0", "vllm": "file:///w/vllm.whl", "my-pkg": "1"}


def full_doc(run_id="20261129T020000.000001Z-abcdef", image="img") -> dict:
    """A report as nightly writes it: one image that passed with a GPU check skipped, synced."""
    res = nightly._blank(image)
    res.update(status="ok", exit_code=0, seconds=12.5, build_id="0123456789abcdef", identity=SHA2, run_id=run_id,
               steps={"prefetch": {"status": "updated", "seconds": 1.0, "detail": "3 network operation(s)"},
                      "build": {"status": "built", "seconds": 8.0, "detail": "1 stage(s) built"},
                      "gate": {"status": "passed", "seconds": 2.0, "detail": "ran; GPU checks SKIPPED"},
                      "promote": {"status": "promoted", "seconds": None, "detail": "moved"},
                      "sync": {"status": "ok", "seconds": 1.5, "detail": "dgx4 synced"}},
               upstream={"checked": True, "reason": None,
                         "moved": [{"source": "GREET", "what": "PR 2", "from": "c" * 40, "to": "e" * 40}],
                         "pull_requests": [{"source": "GREET", "number": 2, "head": "e" * 40, "moved": True,
                                            "head_ref": "present", "merge_ref": "absent",
                                            "state": "closed", "merged": True, "via": ["git ls-remote", "GitHub API"]}],
                         "notices": []},
               stages=[{"name": "base", "action": "skip", "cache": "hit", "status": "skipped", "seconds": None,
                        "key": SHA},
                       {"name": "app", "action": "build", "cache": "miss", "status": "built", "seconds": 7.9,
                        "key": SHA2}],
               cache={"hits": 1, "misses": 1},
               gate={"result": "passed", "ran": True, "seconds": 2.0, "reason": None, "spec": "gate.yaml",
                     "identity": SHA2, "gpu_checks_skipped": True,
                     "summary": {"passed": 1, "failed": 0, "skipped": 1, "warned": 0, "total": 2},
                     "checks": [{"id": "runs", "kind": "command", "outcome": "passed", "severity": "error",
                                 "requires_gpu": False, "detail": "ok"},
                                {"id": "gpu", "kind": "command", "outcome": "skipped", "severity": "error",
                                 "requires_gpu": True, "detail": "requires a GPU; this host has none"}],
                     "receipt": ".imagebuild/receipts/x.json"},
               promotion={"status": "promoted", "reason": None, "local_identity": SHA2, "previous_id": "sha256:1"},
               sync={"status": "ok", "reason": None, "peers": [
                   {"peer": "dgx4", "status": "synced", "bytes_sent": 2048, "seconds": 1.5, "message": "ok",
                    "identity": SHA2}]},
               tags={"local": {"identity": SHA2, "image_id": "sha256:1", "build_id": "0123456789abcdef"},
                     "previous": {"identity": SHA, "image_id": "sha256:2", "build_id": "fedcba9876543210"},
                     "candidate": None},
               changes=sample_diff())
    return {"schema": report.SCHEMA, "version": report.VERSION, "run_id": run_id, "started": "2026-11-29T02:00:00Z",
            "finished": "2026-11-29T02:01:00Z", "seconds": 60.0, "host": "dgx3", "imagebuild_version": "0.1.0",
            "command": {"images": [image], "peers": ["dgx4"], "refresh": True, "keep_builds": 3, "keep_reports": 14,
                        "gc": True},
            "status": "ok", "exit_code": 0, "refused": None, "images": [res],
            "disk": {"before": {"free_bytes": 10, "docker_free_bytes": 10, "images": {image: 5}},
                     "after": {"free_bytes": 12, "docker_free_bytes": 12, "images": {image: 3}},
                     "gc": {"keep": 3, "freed_bytes": 2, "removed": 1}, "gc_skipped": None}}


def test_full_and_refused_reports_validate_and_render():
    doc = full_doc()
    validate(doc)
    md = report.render_markdown(doc)
    assert "**GPU checks were SKIPPED**" in md and "| SKIPPED (GPU) | gpu |" in md
    assert "**moved** GREET PR 2" in md and "GREET PR 2: closed (merged)" in md
    assert "| dgx4 | synced | 2.0 KiB |" in md
    refused = {**doc, "status": "refused", "exit_code": 3, "disk": None,
               "refused": {"reason": "a serving container is running", "containers": [
                   {"name": "vllm", "id": "abc", "image": "img:local", "image_": None, "why": "label"}]},
               "images": [nightly._refused_image("img", "a serving container is running")]}
    refused["refused"]["containers"][0].pop("image_")
    validate(refused)
    assert "## Refused" in report.render_markdown(refused)
    bad = json.loads(json.dumps(doc))
    bad["images"][0]["sync"]["peers"][0]["status"] = "copied"
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_write_is_atomic_redacts_prunes_and_finds(tmp_path, monkeypatch):
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    d = tmp_path / "reports"
    ids = [f"20261129T02000{i}.000001Z-abcde{i}" for i in range(5)]
    for i, rid in enumerate(ids):
        doc = full_doc(rid, image="a" if i % 2 else "b")
        doc["images"][0]["reason"] = f"git said: https://x-access-token:{TOKEN}@github.com/o/r.git"
        st = report.write(d, doc, keep=3)
        assert st.json_path.is_file() and st.md_path.is_file()
    names = sorted(p.name for p in d.iterdir())
    assert names == sorted([f"{r}.{ext}" for r in ids[2:] for ext in ("json", "md")])  # no .tmp left, last 3 kept
    for p in d.iterdir():
        text = p.read_text()
        # the token's value is redacted, and a URL's userinfo goes whole (issue 34)
        assert TOKEN not in text and "x-access-token" not in text and "https://github.com/o/r.git" in text
    assert report.find(d).run_id == ids[4]
    assert report.find(d, "latest", image="a").run_id == ids[3]
    assert report.find(d, ids[2][:17] + ids[2][17:]).run_id == ids[2]
    with pytest.raises(UsageError):
        report.find(d, "2026")  # ambiguous
    with pytest.raises(UsageError):
        report.find(d, image="nope")


def test_report_command(tmp_path, project):
    rdir = tmp_path / "r"
    report.write(rdir, full_doc("20261129T020000.000001Z-aaaaaa", image="tiny"))
    r = run_cli("--root", str(project), "report", "tiny", "latest", "--report-dir", str(rdir))
    assert r.code == 0, r.err
    assert r.out.startswith("# Nightly build 20261129T020000.000001Z-aaaaaa") and "## tiny: ok" in r.out
    r = run_cli("--root", str(project), "report", "--report-dir", str(rdir), "--json")
    assert r.code == 0 and json.loads(r.out)["run_id"] == "20261129T020000.000001Z-aaaaaa"
    r = run_cli("--root", str(project), "report", "--report-dir", str(rdir), "--summary")
    assert r.code == 0 and r.out.startswith("nightly 20261129T020000.000001Z-aaaaaa: OK")
    r = run_cli("--root", str(project), "report", "staged", "--report-dir", str(rdir))
    assert r.code == 2 and "no nightly reports of staged" in r.err and "Traceback" not in r.err
    r = run_cli("--root", str(project), "report", "--report-dir", str(tmp_path / "none"))
    assert r.code == 2 and "imagebuild nightly IMAGE" in r.err


def test_nightly_bad_input_is_exit_2_before_anything(project):
    r = run_cli("--root", str(project), "nightly", "no-such-image")
    assert r.code == 2 and "docker-images/no-such-image: IMAGE: no such image definition" in r.err
    r = run_cli("--root", str(project), "nightly", "tiny", "--keep-builds", "0")
    assert r.code == 2 and "--keep-builds 0" in r.err
    assert not (project / ".imagebuild" / "nightly").exists()


def test_two_nightlies_never_overlap(project):
    from imagebuild.buildstep import guards
    from imagebuild.core import state

    held = guards.BuildLock(state.state_dir(project) / nightly.LOCK_NAME, "nightly")
    held.acquire(command="imagebuild nightly tiny")
    try:
        r = run_cli("--root", str(project), "nightly", "tiny")
    finally:
        held.release()
    assert r.code == 3 and "another imagebuild nightly is running" in r.err and "imagebuild nightly tiny" in r.err
    assert not (project / ".imagebuild" / "nightly").exists()  # no report: the running one writes its own


def test_layer_sizes_from_history_rows():
    # `docker history` of the example image (oldest first): imported base, then BuildKit's steps
    rows = [(649895936, ""), (0, "ARG PY_OPT_LEVEL=2"), (0, "ENV PYTHONOPTIMIZE=2"),
            (12288, "RUN |1 PY_OPT_LEVEL=2 /bin/sh -c python3 --version # buildkit"), (0, "ARG GREETING_VERSION=1.2.0"),
            (0, "COPY app/ /opt/app/ # buildkit"), (1163264, "RUN |1 GREETING_VERSION=1.2.0 /bin/sh -c x # buildkit"),
            (0, "COPY app/greeting.txt /opt/app/greeting.txt # buildkit"), (1048576, "RUN /bin/sh -c y # buildkit"),
            (0, "ENTRYPOINT []"), (0, 'CMD ["python3"]'), (20480, "COPY opt/ /opt/ # buildkit")]
    assert imagediff.layer_sizes_from_history(rows, 7) == [649895936, 12288, 0, 1163264, 0, 1048576, 20480]
    assert imagediff.layer_sizes_from_history([(5, "/bin/sh -c #(nop)  WORKDIR /x"), (7, "RUN a")], 2) == [5, 7]
    assert imagediff.layer_sizes_from_history(rows, 3) == [None, None, None]
    assert imagediff.parse_dpkg_list("libc6:amd64 2.36\n") == {"libc6": "2.36"}


def test_compiler_cache_figures_reach_the_report():
    """A compile stage's compiler-cache figures (build record, buildstep/compilecache.py) reach the nightly
    report: its JSON stage entry, the terminal summary and the markdown stage table."""
    cc = {"tool": "ccache version 4.14.2", "hits": 19, "direct_hits": 18, "preprocessed_hits": 1, "misses": 1,
          "uncacheable": 0, "uncacheable_by_reason": {}, "hit_rate": 0.95, "cache_bytes": 64 << 20, "files": 40}
    res = nightly._blank("demo")
    res["status"] = "ok"
    nightly._take_record(res, {"run_id": "r1", "build_id": "b1", "stages": [
        {"name": "apt", "action": "skip", "status": "skipped"},
        {"name": "vllm-wheel", "action": "build", "status": "built", "seconds": 60.0, "compiler_cache": cc}]})
    assert res["stages"][1]["compiler_cache"] == cc and "compiler_cache" not in res["stages"][0]
    doc = {"run_id": "n1", "status": "ok", "exit_code": 0, "seconds": 61.0, "images": [res]}
    lines = report.summary_lines(doc)
    assert "    vllm-wheel: ccache 95.0% hit (19 hits, 1 misses, 0 uncacheable; 64 MiB)" in lines
    md = "\n".join(report._image_md(res))
    assert "| vllm-wheel | miss | built | 1m00s | ccache 95.0% hit (19 hits, 1 misses, 0 uncacheable; 64 MiB) |" in md or \
        "ccache 95.0% hit (19 hits, 1 misses, 0 uncacheable; 64 MiB) |" in md


def test_diff_names_a_changed_build_arg_of_a_stage():
    """Issue 35: build.json records the build args that reached each stage, so a changed versions.env
    value shows in the diff; an image from before they were recorded says so."""
    d = sample_diff()
    assert d["build_args"] is None  # neither records them
    a, b = (_inv(r, i, pins=("a" * 40,) * 3, patches="1" * 64, pip={}, dpkg={}, layers=[(SHA, 1)])
            for r, i in (("x:previous", SHA), ("x:local", SHA2)))
    a["build"]["stages"] = [{"name": "tools", "args": {"PARENT": "imagebuild-parent", "TOOL_VERSION": "1.0"}}]
    b["build"]["stages"] = [{"name": "tools", "args": {"PARENT": "imagebuild-parent", "TOOL_VERSION": "1.1"}},
                            {"name": "extra", "args": {}}]
    d = imagediff.diff(a, b)
    assert d["build_args"]["changed"] == [{"name": "tools TOOL_VERSION", "from": "1.0", "to": "1.1"}]
    assert d["build_args"]["unchanged"] == 1
    md = imagediff.render(d)
    assert "- **build args**: 1 changed, 0 added, 0 removed, 1 unchanged" in md and "`tools TOOL_VERSION`: 1.0 -> 1.1" in md
    del a["build"]["stages"]
    assert "**build args**: not recorded in one of the images" in imagediff.render(imagediff.diff(a, b))
