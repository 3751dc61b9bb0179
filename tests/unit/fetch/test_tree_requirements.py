"""The locked set against the composed tree's own requirement files (image.yaml
``requirements.satisfies``, issue 20 section 2): the runner installs the built vLLM --no-deps, so
prefetch checks the set against what the tree's requirements/*.txt ask, refuses a difference no
``requirements.exceptions`` entry justifies (naming the tree's file and line), and reports the
justified ones. The tree is a tarball in the lock, as prefetch packs it; the index is the small
local one of test_resolve.py (no network)."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from imagebuild.core.errors import EXIT_BAD_INPUT, DefinitionError
from imagebuild.definition import reader as d
from imagebuild.fetch import packages
from tests.unit.fetch.test_resolve import IMG, _project, _untouched, index  # noqa: F401  (a fixture)


def _with_tree(tmp_path, index, exceptions: str = "") -> d.Definition:  # noqa: F811
    defn = _project(tmp_path, index, "alpha==1.0\n", "delta==2.0\n")
    img = defn.dir
    tar = defn.root / "deps-src" / IMG / "src" / "app-1.tar.gz"
    tar.parent.mkdir(parents=True)
    with tarfile.open(tar, "w:gz") as tf:
        for name, text in {"requirements/cuda.txt": "-r common.txt\ndelta == 2.0  # ok\ngamma<2.0\n",
                           "requirements/common.txt": "# common\nalpha>=1.0\nmissing-pkg>=1\n"
                                                      "x86only; platform_machine == 'x86_64'\n"}.items():
            data = text.encode()
            ti = tarfile.TarInfo("./" + name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    (img / "versions.env").write_text((img / "versions.env").read_text() + "APP_REPO=https://example.invalid/app\n"
                                      f"APP_REF={'a' * 40}\n")
    (img / "lock.json").write_text(json.dumps({"schema": "imagebuild.lock", "version": 1, "image": IMG,
                                               "sources": {"APP": {"tarball": f"deps-src/{IMG}/src/app-1.tar.gz",
                                                                   "sha256": "0" * 64}}}))
    y = img / "image.yaml"
    y.write_text(y.read_text().replace(
        "    requirements: requirements-runner.txt\n",
        "    requirements:\n      file: requirements-runner.txt\n      satisfies: {APP: [requirements/cuda.txt]}\n"
        + exceptions))
    return d.load(defn.root, IMG)


def test_a_difference_from_the_tree_is_refused_naming_its_file_and_line(tmp_path, index):  # noqa: F811
    defn = _with_tree(tmp_path, index)
    with pytest.raises(DefinitionError) as ei:
        packages.prefetch_wheels(defn)
    assert ei.value.exit_code == EXIT_BAD_INPUT
    text = ei.value.render()
    # gamma: the set installs 2.0, the tree asks <2.0 (cuda.txt:3); missing-pkg: not installed
    # (common.txt:3, through -r); the x86-only line does not apply to linux/arm64
    assert "APP:requirements/cuda.txt:3: gamma: gamma<2.0: stage 'runner' installs gamma==2.0" in text, text
    assert "APP:requirements/common.txt:3: missing-pkg: missing-pkg>=1: stage 'runner' installs no missing-pkg" in text
    assert "x86only" not in text and "delta" not in text and "alpha" not in text
    assert "requirements.exceptions" in text
    assert not (defn.root / "deps-src" / IMG / "wheels").exists()  # refused before any download


def test_justified_differences_pass_and_are_reported(tmp_path, index, caplog):  # noqa: F811
    exc = ("      exceptions:\n        gamma: alpha 1.0 needs gamma>=2.0, which the tree's cap predates\n"
           "        missing-pkg: only the tree's optional feature imports it, not served here\n"
           "        alpha: listed but not needed, so a warning says to remove it\n")
    defn = _with_tree(tmp_path, index, exc)
    report = packages.Report()
    packages.prefetch_wheels(defn, report)
    [step] = [s for s in report.steps if s["kind"] == "tree-requirements"]
    # in reading order: common.txt through cuda.txt's -r (line 1), then cuda.txt's own lines
    assert [(e["requirement"], e["installed"]) for e in step["excepted"]] == [("missing-pkg>=1", None),
                                                                              ("gamma<2.0", "2.0")]
    assert step["excepted"][1]["where"] == "APP:requirements/cuda.txt:3"
    assert step["unused_exceptions"] == ["alpha"]


def test_bad_satisfies_and_exceptions_are_definition_errors(tmp_path, index):  # noqa: F811
    with pytest.raises(DefinitionError) as ei:
        _with_tree(tmp_path / "a", index, "      exceptions: {gamma: why}\n")
    assert "image.yaml:15:" in ei.value.render() and "gamma: say why" in ei.value.render()
    defn = _with_tree(tmp_path / "b", index)
    y = defn.dir / "image.yaml"
    y.write_text(y.read_text().replace("{APP:", "{NOPE:"))
    with pytest.raises(DefinitionError) as ei:
        d.load(defn.root, IMG)
    assert "'NOPE' is no git source" in ei.value.render()
