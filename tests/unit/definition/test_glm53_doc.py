"""docs/images/glm53-jovian-r12.md against the gate spec it describes (issue 29, section 4): what the doc
says the gate checks is read from gate.yaml, so the next drift (a renamed check, a severity changed, the
PTX the gate lets through) fails here. Cheap: two files read, nothing run."""

from __future__ import annotations

import re
from pathlib import Path

from imagebuild.definition import gatespec

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "images" / "glm53-jovian-r12.md"
SPEC = gatespec.load(ROOT / "docker-images" / "glm53-jovian-r12" / "gate.yaml")
ID_LIKE = re.compile(r"`([a-z][a-z0-9]*(?:-[a-z0-9]+)+)`")


def _section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _bullets(section: str) -> list[str]:
    """The section's top-level bullets, each with its continuation lines."""
    return ["- " + b for b in re.split(r"\n- ", section)[1:]]


def test_every_check_the_doc_names_is_in_the_spec():
    ids = {c.id for c in SPEC.checks}
    kinds = set(gatespec.KINDS)
    named = set(ID_LIKE.findall(_section("What the gate proves")))
    assert named - ids - kinds == set(), "the doc names checks the gate spec does not have"


def test_the_doc_says_warning_exactly_for_the_checks_of_severity_warn():
    by_id = {c.id: c for c in SPEC.checks}
    warned = {c.id for c in SPEC.checks if c.severity == "warn"}
    for b in _bullets(_section("What the gate proves")):
        ids = {i for i in ID_LIKE.findall(b) if i in by_id}
        if "warning" in b:  # a bullet that calls something a warning names that check, of severity warn
            assert ids & warned, f"the doc calls a check a warning that is not one: {b[:100]!r}"
        for i in ids - warned:
            assert f"`{i}` (a warning" not in b and f"`{i}`: a warning" not in b, b[:100]
    text = _section("What the gate proves")
    for i in warned:
        assert re.search(rf"warning[^.;]*`{i}`|`{i}`[^.;]*warning", text), f"{i} is a warning: the doc must say so"
    pip = [c for c in SPEC.checks if c.kind == "pip-check"]
    assert pip and all(f"`{c.id}` (severity {c.severity}" in text for c in pip)


def test_the_ptx_and_sass_the_doc_says_the_gate_lets_through_are_the_specs():
    (ct,) = [c for c in SPEC.checks if c.kind == "cuda-targets"]
    bullet = next(b for b in _bullets(_section("What the gate proves")) if f"`{ct.id}`" in b)
    # what it lets through, said before the kernels it requires (after them: examples of what fails)
    said = set(re.findall(r"`((?:sm|compute)_\d+[af]?)`", bullet.split("The NVFP4 quantizer")[0]))
    allowed = set(ct.params["sass"]) | set(ct.params["tolerate"]) | set(ct.params["ptx"])
    assert said == allowed, (sorted(said), sorted(allowed))
    ptx = sorted(t for t in allowed if t.startswith("compute_"))
    if ptx:  # some embedded PTX is accepted: the doc must not say the gate refuses PTX
        assert "refuses embedded PTX" not in DOC.read_text() and "no\n  PTX," not in bullet


def test_the_doc_names_the_nodes_driver_not_the_images_toolkit_as_the_driver_requirement():
    cuda = _section("CUDA versions: toolkit, torch, driver")
    assert "R580" in cuda and "must support CUDA 13.2" not in cuda
