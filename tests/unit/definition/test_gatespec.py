"""Gate spec parsing and validation, receipts lookup, and the docs' examples (no Docker)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from imagebuild.core.errors import DefinitionError
from imagebuild.definition import gatespec
from imagebuild.gate import receipts
from tests.conftest import run_cli

DOCS = Path(__file__).resolve().parents[3] / "docs" / "gate.md"
ROOT = Path(__file__).resolve().parents[3]


def _problems(text: str) -> list[str]:
    with pytest.raises(DefinitionError) as ei:
        gatespec.parse(textwrap.dedent(text), "gate.yaml")
    return [p.render() for p in ei.value.problems]


def test_every_kind_parses_and_normalises():
    spec = gatespec.parse(textwrap.dedent("""\
        python: /opt/venv/bin/python
        timeout: 30
        checks:
          - {id: a, kind: import, module: vllm._C_stable_libtorch}
          - {id: b, kind: version, distribution: vllm, specifier: "==0.1.dev20489+g06f922207"}
          - {id: c, kind: command, run: [nvcc, --version], stdout: 'release 13\\.0', exit: 0}
          - {id: d, kind: file, path: /x, sha256: "sha256:%s"}
          - {id: e, kind: metadata, architecture: arm64, entrypoint: [], env: {A: 1, B: null}}
          - {id: f, kind: expression, expr: "x.y", imports: [x]}
          - {id: g, kind: elf, path: /usr/lib, machine: arm64}
          - {id: h, kind: pip-check, allow: '^b12x '}
          - {id: i, kind: import, module: vllm._flashkda_C, severity: warn, requires: [gpu]}
        """ % ("a" * 64)), "gate.yaml")
    assert spec.python == "/opt/venv/bin/python" and spec.timeout_s == 30
    assert [c.kind for c in spec.checks] == ["import", "version", "command", "file", "metadata", "expression",
                                            "elf", "pip-check", "import"]
    assert spec.check("c").params["run"] == ["nvcc", "--version"]
    assert spec.check("d").params["sha256"] == "a" * 64
    assert spec.check("e").params == {"architecture": "arm64", "entrypoint": None, "env": {"A": "1", "B": None}}
    assert spec.check("g").params["machine"] == 183
    assert spec.check("h").params["allow"] == ["^b12x "]
    i = spec.check("i")
    assert i.requires_gpu and i.severity == "warn" and i.line == 12


def test_unknown_keys_and_bad_specifiers_name_file_and_line():
    probs = _problems("""\
        checks:
          - id: torch
            kind: version
            distribution: torch
            specifier: "2.13.0"
          - id: v2
            kind: version
            distribution: torch
            specifier: ">=2.13,<"
          - id: imp
            kind: import
            modle: vllm
        extra: 1
        """)
    text = "\n".join(probs)
    assert "gate.yaml:5: checks[torch].specifier: invalid PEP 440 version specifier '2.13.0'" in text
    assert "gate.yaml:9: checks[v2].specifier: invalid PEP 440" in text
    assert "gate.yaml:12: checks[imp].modle: unknown key 'modle'" in text and "did you mean 'module'" in text
    assert "gate.yaml:10: checks[imp].module: a `import` check needs `module:`" in text
    assert "gate.yaml:13: extra: unknown key 'extra'" in text


@pytest.mark.parametrize("body, expected", [
    ("- {id: a, kind: imprt, module: x}", "unknown check kind 'imprt'"),
    ("- {id: a, kind: import, module: x}\n  - {id: a, kind: import, module: y}", "duplicate check id 'a'"),
    ("- {id: 'bad id', kind: import, module: x}", "invalid check id"),
    ("- {kind: import, module: x}", "missing `id:`"),
    ("- {id: a, kind: import, module: x, severity: fatal}", "expected one of error, warn"),
    ("- {id: a, kind: import, module: x, requires: tpu}", "unknown requirement 'tpu'"),
    ("- {id: a, kind: command, run: x, stdout: '(['}", "invalid regular expression"),
    ("- {id: a, kind: command, run: x, exit: 300}", "expected an exit code 0-255"),
    ("- {id: a, kind: file, path: relative}", "expected an absolute path"),
    ("- {id: a, kind: file, path: /x, sha256: abc}", "expected 64 lower-case hex digits"),
    ("- {id: a, kind: file, path: /x, exists: false, contains: y}", "cannot be combined"),
    ("- {id: a, kind: metadata}", "needs at least one of"),
    ("- {id: a, kind: expression, expr: 'x ='}", "not a Python expression"),
    ("- {id: a, kind: elf, path: /x, machine: vax}", "unknown ELF machine 'vax'"),
    ("- {id: a, kind: elf, path: /x, machine: arm64, min_files: 0}", "expected a number >= 1"),
    ("- {id: a, kind: version, distribution: x, specifier: 2}", "invalid PEP 440"),
    ("- {id: a, kind: cuda-targets, sass: [sm_121a]}", "needs exactly one of `path`"),
    ("- {id: a, kind: cuda-targets, path: /x, module: vllm, sass: [sm_121a]}", "needs exactly one of `path`"),
    ("- {id: a, kind: cuda-targets, path: /x}", "needs `sass:`"),
    ("- {id: a, kind: cuda-targets, path: /x, sass: []}", "expected at least one SASS target"),
    ("- {id: a, kind: cuda-targets, path: /x, sass: [12.1a]}", "not a CUDA target: '12.1a'"),
    ("- {id: a, kind: cuda-targets, path: /x, sass: [sm_121a], ptx: [sm_121a]}", "not a CUDA target"),
    ("- {id: a, kind: cuda-targets, path: /x, sass: [sm_121a], require: [sm_120]}",
     "'sm_120' is not one of the allowed targets"),
    ("- {id: a, kind: cuda-targets, module: 'a b', sass: [sm_121a]}", "expected a module name"),
    ("- {id: a, kind: cuda-targets, path: /x, sass: [sm_121a], tolerate: ['8.0']}", "not a CUDA target"),
    ("- {id: a, kind: cuda-targets, path: /x, sass: sm_121a, kernels: '(['}", "invalid regular expression"),
    ("- {id: a, kind: cuda-targets, path: /x, sass: [sm_121a], driver: {cuda: 13.0}}", "expected a quoted version X.Y"),
    ("- {id: a, kind: cuda-targets, path: /x, sass: [sm_121a], driver: {name: R580}}", "missing `cuda:`"),
    ("- {id: a, kind: cuda-targets, path: /x, sass: [sm_121a], driver: {cuda: '14.1'}}",
     "the PTX ISA limit of a CUDA 14.1 driver is not in imagebuild's table"),
    ("- {id: a, kind: cuda-targets, path: /x, sass: [sm_121a], driver: {cuda: '13.0', isa: '9.0'}}",
     "unknown key 'isa'"),
    ("- {id: a, kind: cuda-targets, path: /x, sass: [sm_121a], driver: R580}", "expected a mapping with `cuda:`"),
    ("- {id: a, kind: cuda-targets, path: /x, sass: [sm_121a], libraries: []}", "expected a list of libraries"),
    ("- {id: a, kind: cuda-targets, path: /x, sass: [sm_121a], libraries: [{files: a.so, targets: [sm_80]}]}",
     "missing `why:`"),
    ("- {id: a, kind: cuda-targets, path: /x, sass: [sm_121a], libraries: [{files: /a.so, targets: [sm_80], why: w}]}",
     "expected a glob relative to the checked folder"),
    ("- {id: a, kind: cuda-targets, path: /x, sass: [sm_121a], libraries: [{files: a.so, targets: ['8.0+PTX'], why: w}]}",
     "not a CUDA target: '8.0+PTX'"),
    ("- {id: a, kind: cuda-targets, path: /x, sass: [sm_121a], libraries: [{files: a.so, targets: [sm_80], why: w, "
     "arch: x}]}", "unknown key 'arch'"),
])
def test_each_problem_is_reported(body, expected):
    text = "\n".join(_problems("checks:\n  " + body + "\n"))
    assert expected in text and "gate.yaml:" in text


def test_cuda_targets_defaults():
    spec = gatespec.parse("checks:\n  - {id: a, kind: cuda-targets, module: vllm, sass: [sm_121a, sm_121f]}\n",
                          "gate.yaml")
    assert spec.checks[0].params == {"module": "vllm", "sass": ["sm_121a", "sm_121f"],
                                     "require": ["sm_121a", "sm_121f"], "ptx": [], "tolerate": [], "kernels": [],
                                     "glob": ["*.so", "*.so.*"], "min_files": 1}


def test_cuda_targets_driver_and_libraries():
    spec = gatespec.parse("checks:\n  - {id: a, kind: cuda-targets, module: vllm, sass: [sm_121a],\n"
                          "     driver: {name: R580, cuda: '13.0'},\n"
                          "     libraries: [{files: 'fa/_fa2*.so', targets: [sm_80, compute_80], why: its CMake}]}\n",
                          "gate.yaml")
    p = spec.checks[0].params
    assert p["driver"] == {"name": "R580", "cuda": "13.0", "ptx_isa": "9.0"}
    assert p["libraries"] == [{"files": "fa/_fa2*.so", "targets": ["sm_80", "compute_80"], "why": "its CMake",
                               "min_files": 0}]
    stated = gatespec.parse("checks:\n  - {id: a, kind: cuda-targets, path: /x, sass: [sm_121a], "
                            "driver: {cuda: '14.1', ptx_isa: '9.9'}}\n", "gate.yaml")
    assert stated.checks[0].params["driver"] == {"name": None, "cuda": "14.1", "ptx_isa": "9.9"}


@pytest.mark.parametrize(("cuda", "isa"), [("13.0", "9.0"), ("13.2", "9.2"), ("12.6", "8.5"), ("12.8", "8.7"),
                                           ("11.0", "7.0"), ("13.3", None), ("10.2", None)])
def test_the_ptx_isa_a_driver_takes(cuda, isa):
    assert gatespec.max_ptx_isa(cuda) == isa


def test_all_problems_at_once_and_yaml_errors_have_lines():
    probs = _problems("""\
        checks:
          - {id: a, kind: imprt}
          - {id: b, kind: version, distribution: x, specifier: "=>1"}
        """)
    assert len(probs) == 2
    probs = _problems("checks:\n  - id: a\n   kind: x\n")
    assert probs[0].startswith("gate.yaml:3:")


def test_zero_checks_and_a_missing_checks_key_are_errors():
    # issue 22: `checks: []` (or `checks:` with nothing) was accepted; a gate of no checks proves nothing
    assert "checks: expected at least one check" in _problems("checks: []\n")[0]
    assert "checks: expected at least one check" in _problems("checks:\n")[0]
    assert "missing `checks:`" in _problems("python: python3\n")[0]


def test_malformed_spec_via_cli_is_exit_2(tmp_path):
    spec = tmp_path / "gate.yaml"
    spec.write_text("checks:\n  - {id: a, kind: version, distribution: x, specifier: '~=1'}\n")
    r = run_cli("gate", "whatever:1", "--spec", str(spec))
    assert r.code == 2 and f"{spec}:2: checks[a].specifier" in r.err


def _doc_blocks() -> list[str]:
    return [b for b in re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), re.S) if "kind:" in b]


def test_docs_examples_are_valid_specs():
    blocks = _doc_blocks()
    assert len(blocks) >= 2
    for b in blocks:
        gatespec.parse(b, "docs/gate.md")


def test_docs_catalogue_covers_every_gb10_check():
    catalogue = next(b for b in _doc_blocks() if "device-capability" in b)
    spec = gatespec.parse(catalogue, "docs/gate.md")
    by_id = {c.id: c for c in spec.checks}
    # FACTS.md "What a GB10 gate checks", item by item
    assert by_id["platform-arm64"].params["architecture"] == "arm64"
    assert by_id["vllm-elf-aarch64"].params["machine"] == 183
    assert by_id["torch-version"].kind == "version" and "torch.version.cuda" in by_id["torch-cuda"].params["expr"]
    cap = by_id["device-capability"]
    assert cap.requires_gpu and "(12, 1)" in cap.params["expr"]
    assert "nvcc" in by_id["nvcc"].params["run"] and "ptxas" in by_id["ptxas"].params["run"]
    assert by_id["vllm-import"].params["module"] == "vllm" and by_id["vllm-version"].kind == "version"
    assert {by_id["vllm-c-stable"].params["module"], by_id["vllm-cumem"].params["module"]} == {
        "vllm._C_stable_libtorch", "vllm.cumem_allocator"}
    assert by_id["flashkda"].params["module"] == "vllm._flashkda_C" and by_id["flashkda"].severity == "warn"
    assert by_id["b12x-version"].params["distribution"] == "b12x"
    assert by_id["flashinfer-version"].params["distribution"] == "flashinfer-python"
    assert "B12X" in by_id["b12x-backend"].params["expr"]
    assert "get_supported_archs" in by_id["registered-archs"].params["expr"]
    assert by_id["sm12x-patch-marker"].kind == "file" and "patch-report" in by_id["patch-report"].params["expr"]
    assert by_id["pip-check"].kind == "pip-check" and by_id["pip-check"].params["allow"]


def test_example_definition_spec_is_valid():
    spec = gatespec.load(ROOT / "docker-images" / "example" / "gate.yaml")
    assert spec.checks and any(c.requires_gpu for c in spec.checks)


# ------------------------------------------------------------------------------------------------ receipts


S1, S2 = "sha256:" + "a" * 64, "sha256:" + "b" * 64


def _ident(n: str) -> dict:
    """An identity document (identity.py) and the digest it re-hashes to."""
    doc = {"imagebuild-identity": 1, "os": "linux", "architecture": "amd64", "variant": None,
           "layers": ["sha256:" + n * 64], "config": {}}
    return {"digest": receipts.rehash(doc), **doc}


def _receipt(ident: dict, result="passed", gpu_skipped=False, outcome="passed", spec=S1,
             authority="definition") -> dict:
    checks = [{"id": "a", "kind": "import", "severity": "error", "requires_gpu": gpu_skipped,
               "outcome": "skipped" if gpu_skipped else outcome}]
    summary = {o: sum(1 for c in checks if c["outcome"] == o) for o in receipts.OUTCOMES}
    return {"schema": receipts.SCHEMA, "version": receipts.VERSION, "result": result, "authority": authority,
            "reason": None if result == "passed" else "1 check(s) failed: a",
            "identity": ident, "spec": {"file": "gate.yaml", "sha256": spec},
            "gpu_checks_skipped": gpu_skipped, "summary": {**summary, "total": 1}, "checks": checks}


def test_find_passing_only_for_exactly_that_identity_and_spec(tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "s"))
    monkeypatch.setenv("IMAGEBUILD_ALLOWED_SIGNERS", "none")
    i1, i2 = _ident("1"), _ident("2")
    d1, d2 = i1["digest"], i2["digest"]
    assert receipts.find_passing(tmp_path, d1, S1) is None
    r = receipts.write(tmp_path, _receipt(i1))
    assert r.path == tmp_path / "s" / "receipts" / d1[7:] / ("a" * 64 + ".json")
    assert receipts.find_passing(tmp_path, d1, S1)["identity"]["digest"] == d1
    assert receipts.find_passing(tmp_path, d1, S2) is None  # another spec: another gate
    assert receipts.find_passing(tmp_path, d2, S1) is None
    receipts.write(tmp_path, _receipt(i2, gpu_skipped=True))
    assert receipts.find_passing(tmp_path, d2, S1) is not None
    assert receipts.find_passing(tmp_path, d2, S1, require_gpu=True) is None
    receipts.write(tmp_path, _receipt(i1, result="failed", outcome="failed"))
    assert receipts.find_passing(tmp_path, d1, S1) is None  # the latest run counts
    # an inconsistent (hand-edited) file is not trusted; a copy under another identity neither
    receipts.write(tmp_path, _receipt(i1, result="passed", outcome="failed"))
    assert receipts.find_passing(tmp_path, d1, S1) is None
    (tmp_path / "s" / "receipts" / ("3" * 64)).mkdir()
    (tmp_path / "s" / "receipts" / ("3" * 64) / ("a" * 64 + ".json")).write_text(
        (tmp_path / "s" / "receipts" / d2[7:] / ("a" * 64 + ".json")).read_text())
    assert receipts.find_passing(tmp_path, "sha256:" + "3" * 64, S1) is None
    assert receipts.find_passing(tmp_path, "sha256:nothex", S1) is None


def test_ad_hoc_receipts_never_authorize(tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "s"))
    i1 = _ident("1")
    d1 = i1["digest"]
    receipts.write(tmp_path, _receipt(i1, authority="ad-hoc"))
    assert receipts.read(tmp_path, d1, S1)["result"] == "passed"
    assert receipts.find_passing(tmp_path, d1, S1) is None
    with pytest.raises(ValueError):
        receipts.write(tmp_path, _receipt(i1, authority="someone"))


def test_validate_reports_gate_spec_problems(project):
    (project / "docker-images" / "tiny" / "gate.yaml").write_text("checks:\n  - {id: a, kind: imprt}\n")
    r = run_cli("--root", str(project), "validate", "tiny")
    assert r.code == 2
    assert "docker-images/tiny/gate.yaml:2: checks[a].kind: unknown check kind 'imprt'" in r.err


def test_when_parses_and_decides_from_versions_env():
    spec = gatespec.parse(textwrap.dedent("""\
        checks:
          - {id: rust, kind: import, module: vllm._rust_tool_parser, when: {VLLM_REQUIRE_RUST_FRONTEND: "1"}}
          - {id: num, kind: import, module: os, when: {A: 1, B: x}}
          - {id: always, kind: import, module: os}
        """), "gate.yaml")
    rust = spec.check("rust")
    assert rust.when == (("VLLM_REQUIRE_RUST_FRONTEND", "1"),)
    assert rust.as_dict()["when"] == {"VLLM_REQUIRE_RUST_FRONTEND": "1"}
    assert rust.when_unmet({"VLLM_REQUIRE_RUST_FRONTEND": "1"}) is None
    assert rust.when_unmet({"VLLM_REQUIRE_RUST_FRONTEND": "0"}) == \
        "not applicable: when VLLM_REQUIRE_RUST_FRONTEND=1; versions.env has VLLM_REQUIRE_RUST_FRONTEND=0"
    assert "(not set)" in rust.when_unmet({})
    assert "no image definition" in rust.when_unmet(None)
    assert spec.check("num").when == (("A", "1"), ("B", "x"))
    assert spec.check("always").when_unmet(None) is None and "when" not in spec.check("always").as_dict()


@pytest.mark.parametrize("body, expected", [
    ("when: VLLM_REQUIRE_RUST_FRONTEND", "checks[a].when: expected a mapping of versions.env keys to values"),
    ("when: {}", "checks[a].when: expected a mapping"),
    ("when: {A: true}", "checks[a].when.A: expected a string or number"),
    ("when: {A: [1]}", "checks[a].when.A: expected a string or number"),
    ("when: {1A: x}", "invalid versions.env key '1A'"),
])
def test_when_problems(body, expected):
    probs = _problems(f"checks:\n  - id: a\n    kind: import\n    module: os\n    {body}\n")
    assert any(expected in p for p in probs), probs
