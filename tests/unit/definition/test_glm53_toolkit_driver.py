"""glm53-jovian-r12: the toolkit of its base writes PTX that the driver its gate states can JIT, and
its doc names both (docs/images/glm53-jovian-r12.md, "CUDA versions")."""

from __future__ import annotations

import re
from pathlib import Path

from imagebuild.definition import gatespec
from imagebuild.definition import reader as definition

ROOT = Path(__file__).resolve().parents[3]
IMAGE = "glm53-jovian-r12"


def _cuda_targets():
    spec = gatespec.load(ROOT / "docker-images" / IMAGE / "gate.yaml")
    [c] = [c for c in spec.checks if c.kind == "cuda-targets"]
    return c


def test_the_bases_toolkit_writes_ptx_the_stated_driver_takes():
    base = definition.load(ROOT, IMAGE).env.get("CUDA_BASE")
    m = re.search(r":(\d+\.\d+)\.\d+-devel", base or "")
    assert m, base
    toolkit = m.group(1)
    # the PTX ISA a toolkit writes is the one whose first release it is (measured: 13.0 -> 9.0, 13.2 -> 9.2)
    [writes] = [isa for isa, first in gatespec.PTX_ISA_FIRST_CUDA.items() if first == toolkit]
    driver = _cuda_targets().params["driver"]
    assert tuple(map(int, writes.split("."))) <= tuple(map(int, driver["ptx_isa"].split("."))), (
        f"CUDA_BASE {base} writes PTX ISA {writes}; driver {driver} takes up to {driver['ptx_isa']}")


def test_the_doc_names_the_base_and_the_driver():
    doc = (ROOT / "docs" / "images" / f"{IMAGE}.md").read_text()
    base = definition.load(ROOT, IMAGE).env.get("CUDA_BASE")
    assert f"`CUDA_BASE` | `{base}`" in doc
    driver = _cuda_targets().params["driver"]
    assert f'driver: {{name: {driver["name"]}, cuda: "{driver["cuda"]}"}}' in doc
    assert "must support CUDA 13.2" not in doc
