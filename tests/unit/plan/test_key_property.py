"""The stage key property, over every kind of input the build hands to a stage.

For each input: change it, re-plan, and check that exactly the stage receiving it and every stage
built on it (through ``from`` or a ``${STAGE_*}`` reference) got a new key, and no other stage.
Changes that cannot reach a stage change no key. The definition below has a stage graph with a
branch, so "every stage after it" is tested against the real dependency relation, not the order:

    base -> src -> pkgs -> patched -> final
      \\-> side -------------------/   (final copies from ${STAGE_SIDE})
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from imagebuild.core import lock
from imagebuild.core.fsutil import sha256_bytes
from imagebuild.definition import reader as definition
from imagebuild.fetch import packages
from imagebuild.plan import planner as plan

STAGES = ["base", "src", "side", "pkgs", "patched", "final"]
DESCENDANTS = {
    "base": set(STAGES),
    "src": {"src", "pkgs", "patched", "final"},
    "side": {"side", "final"},
    "pkgs": {"pkgs", "patched", "final"},
    "patched": {"patched", "final"},
    "final": {"final"},
}
SHA = "0123456789abcdef0123456789abcdef0123456{:d}"

VERSIONS = """\
# pins of the property-test definition
BASE_IMAGE=imagebuild-test/busybox:1
HELPER_IMAGE=imagebuild-test/debian:bookworm
BASE_FLAVOUR=plain
SIDE_NOTE=left
MAIN_REPO=https://example.invalid/main.git
MAIN_REF={main}
DEP_REPO=https://example.invalid/dep.git
DEP_REF={dep}
OTHER_REPO=https://example.invalid/other.git
OTHER_REF={other}
UNUSED_PIN=42
"""

IMAGE_YAML = """\
description: every input kind a stage key covers
platform: linux/amd64
python: "3.11"
sources:
  DEP: {dependency_of: MAIN}
stages:
  - name: base
    from: BASE_IMAGE
    files: [files/base.txt]
  - name: src
    from: base
    sources: [MAIN]
  - name: side
    from: base
  - name: pkgs
    from: src
    requirements: requirements.txt
    apt: apt.txt
  - name: patched
    from: pkgs
    patches: [patch_one.py]
  - name: final
    from: patched
"""

DOCKERFILES = {
    "base": "ARG PARENT\nFROM ${PARENT}\nARG BASE_FLAVOUR\nCOPY files/base.txt /base.txt\nRUN echo $BASE_FLAVOUR\n",
    "src": "ARG PARENT\nFROM ${PARENT}\nARG SRC_DEFAULT=one\n"
           "RUN --mount=type=bind,from=imagebuild-src,target=/src ls /src\n",
    "side": "ARG PARENT\nFROM ${PARENT}\nARG SIDE_NOTE\nRUN echo $SIDE_NOTE > /side\n",
    "pkgs": "ARG PARENT\nFROM ${PARENT}\nRUN --mount=type=bind,from=imagebuild-wheels,target=/w true\n",
    "patched": "ARG PARENT\nARG HELPER_IMAGE\nFROM ${PARENT} AS parent\nFROM ${HELPER_IMAGE} AS helper\n"
               "COPY patches/ /p/\nFROM ${PARENT}\nCOPY --from=helper /p /p\n",
    "final": "ARG PARENT\nARG STAGE_SIDE\nFROM ${STAGE_SIDE} AS side\nFROM ${PARENT}\n"
             "COPY --from=side /side /side\nARG MAX_JOBS=1\nRUN echo $MAX_JOBS\n",
}

PATCH = "from imagebuild_patching import Edit\nEDITS = [Edit(file='a', anchor='x', replacement='y', marker='m')]\n"


def _write(root: Path) -> Path:
    d = root / "docker-images" / "prop"
    (d / "files").mkdir(parents=True)
    (d / "versions.env").write_text(VERSIONS.format(main=SHA.format(1), dep=SHA.format(2), other=SHA.format(3)))
    (d / "image.yaml").write_text(IMAGE_YAML)
    for name, text in DOCKERFILES.items():
        (d / f"Dockerfile.{name}").write_text(text)
    (d / "files" / "base.txt").write_text("base\n")
    (d / "requirements.txt").write_text("termcolor==2.4.0\n")
    (d / "apt.txt").write_text("jq=1.6-2.1\n")
    (d / "patch_one.py").write_text(PATCH)
    defn = definition.load(root, "prop")
    entries = {}
    for n, sha_i in (("MAIN", 1), ("DEP", 2), ("OTHER", 3)):
        src = defn.sources[n]
        entries[n] = {**src.pins(), "commit": src.ref, "tree": None, "source_date_epoch": 1700000000 + sha_i,
                      "tarball": f"deps-src/prop/src/{n.lower()}.tar.gz", "sha256": sha256_bytes(n.encode()),
                      "dependency_of": "MAIN" if n == "DEP" else None}
    st = defn.stage("pkgs")
    w_in = packages._digest(packages.wheel_inputs(defn, st))
    a_in = packages._digest(packages.apt_inputs(defn, st))
    lock.update_sections(d, "prop", {
        "sources": entries,
        "wheels": {"pkgs": {"inputs_sha256": w_in, "files": [{"filename": "termcolor-2.4.0-py3-none-any.whl",
                                                              "sha256": "a" * 64}]}},
        "apt": {"pkgs": {"inputs_sha256": a_in, "files": [{"filename": "jq_1.6-2.1_amd64.deb",
                                                           "sha256": "b" * 64}]}},
    })
    return d


@pytest.fixture
def prop(tmp_path) -> Path:
    return _write(tmp_path)


def keys(d: Path) -> dict[str, str]:
    p = plan.make_plan(definition.load(d.parent.parent, "prop"))
    return {s.name: s.key for s in p.stages}


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, 1))


def edit_lock(d: Path, fn) -> None:
    data = json.loads((d / "lock.json").read_text())
    fn(data)
    (d / "lock.json").write_text(lock.serialise(data))


# (id, receiving stage, mutation)
MUTATIONS = [
    ("base image pin", "base", lambda d: edit(d / "versions.env", "busybox:1", "busybox:2")),
    ("platform", "base", lambda d: edit(d / "image.yaml", "linux/amd64", "linux/arm64")),
    ("versions.env value of a declared arg", "base", lambda d: edit(d / "versions.env", "=plain", "=fancy")),
    ("file content", "base", lambda d: (d / "files" / "base.txt").write_text("base 2\n")),
    ("file x bit", "base", lambda d: os.chmod(d / "files" / "base.txt", 0o755)),
    ("Dockerfile byte", "src", lambda d: edit(d / "Dockerfile.src", "ls /src", "ls  /src")),
    ("Dockerfile default arg", "src", lambda d: edit(d / "Dockerfile.src", "=one", "=two")),
    ("own source tarball (locked sha256)", "src",
     lambda d: edit_lock(d, lambda x: x["sources"]["MAIN"].update(sha256="c" * 64))),
    ("FetchContent dependency tarball (locked sha256)", "src",
     lambda d: edit_lock(d, lambda x: x["sources"]["DEP"].update(sha256="d" * 64))),
    ("dependency commit time (SOURCE_DATE_EPOCH)", "src",
     lambda d: edit_lock(d, lambda x: x["sources"]["DEP"].update(source_date_epoch=1800000000))),
    ("side stage's versions.env value", "side", lambda d: edit(d / "versions.env", "=left", "=right")),
    ("requirements file", "pkgs", lambda d: (d / "requirements.txt").write_text("termcolor==2.5.0\n")),
    ("apt file", "pkgs", lambda d: (d / "apt.txt").write_text("jq=1.6-2.2\n")),
    ("locked wheel set", "pkgs",
     lambda d: edit_lock(d, lambda x: x["wheels"]["pkgs"]["files"][0].update(sha256="e" * 64))),
    ("locked deb set", "pkgs",
     lambda d: edit_lock(d, lambda x: x["apt"]["pkgs"]["files"][0].update(sha256="f" * 64))),
    ("network flag", "pkgs", lambda d: edit(d / "image.yaml", "    apt: apt.txt\n",
                                            "    apt: apt.txt\n    network: true\n")),
    ("patch script", "patched", lambda d: edit(d / "patch_one.py", "'y'", "'z'")),
    ("helper image of a multi-FROM stage", "patched",
     lambda d: edit(d / "versions.env", "debian:bookworm", "debian:trixie")),
    ("stage used through ${STAGE_SIDE} only", "side", lambda d: edit(d / "Dockerfile.side", "/side\n", "/side \n")),
    ("last stage's Dockerfile", "final", lambda d: edit(d / "Dockerfile.final", "echo $MAX", "echo  $MAX")),
]


@pytest.mark.parametrize("what, receiver, mutate", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_an_input_changes_its_stage_and_the_stages_built_on_it_only(prop, what, receiver, mutate):
    before = keys(prop)
    mutate(prop)
    after = keys(prop)
    changed = {s for s in STAGES if before[s] != after[s]}
    assert changed == DESCENDANTS[receiver], what


def test_the_patch_primitive_is_an_input_of_patching_stages(prop, monkeypatch, tmp_path):
    before = keys(prop)
    changed_primitive = tmp_path / "patching.py"  # the primitive with one more line, as an upgrade may
    changed_primitive.write_text(plan.primitive_path().read_text() + "# changed\n")
    monkeypatch.setattr(plan, "primitive_path", lambda: changed_primitive)
    after = keys(prop)
    assert {s for s in STAGES if before[s] != after[s]} == DESCENDANTS["patched"]


NO_OPS = [
    ("comment in versions.env", lambda d: edit(d / "versions.env", "# pins", "# the pins")),
    ("pin no stage uses", lambda d: edit(d / "versions.env", "UNUSED_PIN=42", "UNUSED_PIN=43")),
    ("source no stage mounts (pin and lock)", lambda d: (
        edit(d / "versions.env", "OTHER_REF=" + SHA.format(3), "OTHER_REF=" + SHA.format(9)),
        edit_lock(d, lambda x: x["sources"]["OTHER"].update(sha256="9" * 64, ref=SHA.format(9))))),
    ("comment in image.yaml", lambda d: edit(d / "image.yaml", "platform:", "# a comment\nplatform:")),
    ("description", lambda d: edit(d / "image.yaml", "every input kind", "all the input kinds")),
    ("blank line in a Dockerfile's neighbour file", lambda d: (d / "notes.txt").write_text("not an input\n")),
]


@pytest.mark.parametrize("what, mutate", NO_OPS, ids=[m[0] for m in NO_OPS])
def test_a_change_that_reaches_no_stage_changes_no_key(prop, what, mutate):
    before = keys(prop)
    mutate(prop)
    assert keys(prop) == before, what


def test_parallelism_knobs_are_not_in_the_key(prop, monkeypatch):
    before = keys(prop)
    monkeypatch.setenv("MAX_JOBS", "7")
    assert keys(prop) == before


def test_stage_epoch_is_the_newest_commit_among_its_mounts_and_ancestors(prop):
    p = plan.make_plan(definition.load(prop.parent.parent, "prop"))
    epochs = {s.name: s.source_date_epoch for s in p.stages}
    assert epochs["base"] == epochs["side"] == plan.DEFAULT_SOURCE_DATE_EPOCH
    assert epochs["src"] == epochs["pkgs"] == epochs["final"] == 1700000002  # DEP's, newer than MAIN's
    assert [m.name for m in p.stage("src").mounts] == ["MAIN", "DEP"]


def test_build_id_changes_with_every_stage_key_and_the_lock_but_not_with_nothing(prop):
    def bid():
        return plan.make_plan(definition.load(prop.parent.parent, "prop")).build_id

    first = bid()
    assert bid() == first
    edit(prop / "versions.env", "# pins", "# the pins")
    comment = bid()  # the definition's content changed (its digest is provenance), keys did not
    assert comment != first
    edit(prop / "patch_one.py", "'y'", "'z'")
    assert bid() != comment
    b2 = bid()
    edit_lock(prop, lambda x: x["sources"]["OTHER"].update(sha256="9" * 64))
    assert bid() != b2


def test_stale_lock_is_named_in_the_plan(prop):
    edit(prop / "versions.env", "DEP_REF=" + SHA.format(2), "DEP_REF=" + SHA.format(7))
    p = plan.make_plan(definition.load(prop.parent.parent, "prop"))
    dep = next(m for m in p.stage("src").mounts if m.name == "DEP")
    assert dep.stale and SHA.format(7) in dep.stale
