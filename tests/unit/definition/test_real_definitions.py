"""Static checks of the real definitions (glm53-jovian-r12, dsv4-flash-vision), offline, no engine.

- `imagebuild plan IMAGE --json` succeeds offline, lists the stages in order, every stage without
  network, and lists the unpinned items (they are not hidden);
- every ARG resolves (the plan fails otherwise) and has a value;
- the gate specs parse; their versions are the pins of versions.env / the requirements files;
- the Dockerfiles fetch nothing (no curl/wget/git clone/ADD URL, pip only from the prefetched set);
- the vllm-wheel stage applies patches-eugr in image.yaml's order, each switched patch only behind
  its switch (the patch module's SWITCH), and the switches are set in versions.env;
- every 40-hex commit and 64-hex digest in a definition is named in its image doc (provenance).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from imagebuild.definition import gatespec, patching, pkgspec
from imagebuild.definition import reader as definition
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[3]
IMAGES = {
    "glm53-jovian-r12": ["apt", "torch", "vllm-wheel", "b12x-wheel", "runner"],
    "dsv4-flash-vision": ["plugin", "vllm-patches", "runner"],
}


def _plan(image: str, monkeypatch) -> dict:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/imagebuild-test.sock")  # offline: no engine either
    res = run_cli("--root", str(ROOT), "plan", image, "--json")
    assert res.code == 0, res.err
    return json.loads(res.out)


@pytest.mark.parametrize("image", list(IMAGES))
def test_plan_offline_lists_stages_in_order_and_the_unpinned(image, monkeypatch):
    doc = _plan(image, monkeypatch)
    assert doc["platform"] == "linux/arm64"
    assert [s["name"] for s in doc["stages"]] == IMAGES[image]
    for s in doc["stages"]:
        assert s["network"] is False, f"{image}/{s['name']} would run with the network"
        for a in s["args"]:
            assert a.get("value") not in (None, ""), f"{image}/{s['name']}: ARG {a} has no value"
    keys = {u["key"] for u in doc["unpinned"]}
    if image == "glm53-jovian-r12":
        assert keys == {"CUDA_BASE", "VLLM_PRS", "B12X_PRS", "CUTLASS_REF", "TRITON_KERNELS_REF", "libibverbs1", "rdma-core",
                        "ibverbs-providers",
                        "protobuf-compiler"}
        prs = [u["message"] for u in doc["unpinned"] if u["key"] == "VLLM_PRS"]
        assert [re.search(r"pull request (\d+)", m).group(1) for m in prs] == ["550", "552", "553", "554", "555",
                                                                                "557"]
        b12x = [u["message"] for u in doc["unpinned"] if u["key"] == "B12X_PRS"]
        # the lab's published r12 source contract (FACTS.md): five PRs, not the log's range 260-270
        assert [re.search(r"pull request (\d+)", m).group(1) for m in b12x] == ["260", "267", "268", "269", "270"]
    else:
        assert keys == {"DSV4_BASE"}


def test_glm53_build_settings_reach_the_vllm_stage(monkeypatch):
    doc = _plan("glm53-jovian-r12", monkeypatch)
    st = {s["name"]: s for s in doc["stages"]}
    args = {a["name"]: a["value"] for a in st["vllm-wheel"]["args"]}
    assert args["TORCH_CUDA_ARCH_LIST"] == "12.1a"
    assert args["VLLM_PRESERVE_SM12X_TARGET"] == "1" and args["VLLM_PATCH_B12X_C128A_ALIGNMENT"] == "1"
    assert {"MAX_JOBS", "NVCC_THREADS", "CMAKE_BUILD_PARALLEL_LEVEL"} <= set(args)  # the parallelism rule
    runner = {a["name"]: a["value"] for a in st["runner"]["args"]}
    assert runner["SERVE_MAX_JOBS"] == "2"
    assert {"STAGE_VLLM_WHEEL", "STAGE_B12X_WHEEL"} <= set(runner)


@pytest.mark.parametrize("image", list(IMAGES))
def test_gate_spec_parses(image):
    spec = gatespec.load(ROOT / "docker-images" / image / "gate.yaml")
    ids = {c.id for c in spec.checks}
    assert any(c.requires_gpu for c in spec.checks), "GPU checks must be written (skipped without a GPU)"
    if image == "glm53-jovian-r12":
        assert {"vllm-import", "b12x-import", "flashkda", "b12x-backend-enum", "sm12x-patch", "patch-report",
                "vllm-elf-aarch64", "device-capability", "b12x-kernel-runs"} <= ids
    else:
        assert {"plugin-entry-point", "plugin-architectures", "mm-gate-default-off", "patch-report"} <= ids


def _reqs(image: str, name: str) -> dict:
    path = ROOT / "docker-images" / image / name
    errors: list = []
    reqs = pkgspec.parse_requirements(path.read_text(), str(path), lambda *a, **k: errors.append(a))
    assert not errors and reqs
    return {r.name: r.version for r in reqs}


def test_glm53_gate_versions_are_the_pins():
    defn = definition.load(ROOT, "glm53-jovian-r12")
    spec = gatespec.load(defn.gate)
    versions = {c.params["distribution"]: str(c.params["specifier"]) for c in spec.checks if c.kind == "version"}
    torch_stage = _reqs("glm53-jovian-r12", "requirements-torch.txt")
    runner = _reqs("glm53-jovian-r12", "requirements-runner.txt")
    # vLLM's version is derived from the composed commit by prefetch (the lock's), never a constant
    assert "vllm" not in versions and defn.env.get("VLLM_VERSION_OVERRIDE") is None
    expr = spec.check("vllm-version").params["expr"]
    assert "importlib.metadata.version('vllm')" in expr and "['sources']['VLLM']['version']" in expr
    df = (defn.dir / "Dockerfile.vllm-wheel").read_text()
    assert 'VLLM_VERSION_OVERRIDE="${IMAGEBUILD_VERSION_VLLM:?' in df and "ARG VLLM_VERSION_OVERRIDE" not in df
    assert versions["torch"] == "==" + torch_stage["torch"] == "==" + runner["torch"]
    assert versions["flashinfer-python"] == "==" + torch_stage["flashinfer-python"] == "==" + runner["flashinfer-python"]
    assert torch_stage["torch"] == "2.13.0" and torch_stage["flashinfer-python"] == "0.6.17"
    # the runner and the torch stage agree on what both install
    for name in set(torch_stage) & set(runner):
        assert torch_stage[name] == runner[name], name


FETCHING = re.compile(r"\b(curl|wget|git\s+clone|git\s+fetch|apt-get\s+update|apt\s+update)\b|^\s*ADD\s+https?://",
                      re.M)


@pytest.mark.parametrize("dockerfile", sorted(p for img in IMAGES for p in (ROOT / "docker-images" / img).glob("Dockerfile.*")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_dockerfiles_fetch_nothing(dockerfile):
    text = dockerfile.read_text()
    assert not FETCHING.search(text), f"{dockerfile}: fetches from the network"
    for m in re.finditer(r"pip\s+(install|wheel|download)\b[^\n\\]*(?:\\\n[^\n\\]*)*", text):
        assert "--no-index" in m.group(0), f"{dockerfile}: pip without --no-index: {m.group(0)!r}"
    assert "syntax=" not in text.split("\n", 1)[0]


def _module(path: Path):
    sys.modules.setdefault(patching.MODULE_NAME, patching)
    spec = importlib.util.spec_from_file_location(f"_switch_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_glm53_applies_patches_eugr_in_order_with_switches():
    defn = definition.load(ROOT, "glm53-jovian-r12")
    declared = [i.path.name for i in defn.stage("vllm-wheel").inputs if i.kind == "patch"]
    assert sorted(declared) == sorted(p.name for p in (ROOT / "patches-eugr").glob("patch_*.py"))  # all twelve
    text = (defn.dir / "Dockerfile.vllm-wheel").read_text()
    used = re.findall(r"\$p/(patch_[a-z0-9_]+\.py)", text)
    assert used == declared, "the Dockerfile applies the patches in image.yaml's order"
    switched = {}
    for name in declared:
        switch = getattr(_module(ROOT / "patches-eugr" / name), "SWITCH", None)
        if switch:
            switched[name] = switch
            guard = re.search(r'if \[ "\$' + switch + r'" = 1 \]; then patches\+=\("\$p/' + re.escape(name), text)
            assert guard, f"{name} is applied only when {switch}=1"
            assert f"ARG {switch}\n" in text
            assert defn.env.get(switch) == "1", f"the seed builds with {switch}=1"
        else:
            assert not re.search(r"then patches\+=\(\"\$p/" + re.escape(name), text), f"{name} has no switch"
    assert switched == {"patch_vllm_preserve_sm12x_target.py": "VLLM_PRESERVE_SM12X_TARGET",
                        "patch_vllm_b12x_c128a_topk_alignment.py": "VLLM_PATCH_B12X_C128A_ALIGNMENT"}


HEX = re.compile(r"(?<![0-9a-f])([0-9a-f]{64}|[0-9a-f]{40})(?![0-9a-f])")


@pytest.mark.parametrize("image", list(IMAGES))
def test_every_sha_and_digest_is_named_in_the_image_doc(image):
    """Provenance: docs/images/<image>.md names the origin of each commit/digest the definition pins."""
    doc = (ROOT / "docs" / "images" / f"{image}.md").read_text()
    found = set()
    for f in (ROOT / "docker-images" / image).rglob("*"):
        if f.is_file():
            found |= set(HEX.findall(f.read_text(errors="replace")))
    missing = sorted(h for h in found if h not in doc)
    assert not missing, f"pins without a provenance line in docs/images/{image}.md: {missing}"


@pytest.mark.parametrize("outcome, marker, fork_b12x_first, passes", [
    ("applied", True, False, True),
    ("already-applied", True, False, True),
    ("applied", False, False, False),          # the report says applied, the file has no marker
    ("not-needed", False, True, True),         # the fork's own list starts with B12X
    ("not-needed", False, False, False),       # the report says not needed, the list does not lead with B12X
    ("not-applicable", False, False, False),   # the list the patch edits is gone
])
def test_glm53_sm12x_check_agrees_with_the_patch_report(tmp_path, outcome, marker, fork_b12x_first, passes):
    import importlib.util
    import json as json_mod

    spec = gatespec.load(ROOT / "docker-images" / "glm53-jovian-r12" / "gate.yaml")
    expr = spec.check("sm12x-patch").params["expr"]
    report = tmp_path / "patches.json"
    report.write_text(json_mod.dumps({"patches": {"patch_cuda_sm12x.py": {"outcome": outcome}}}))
    pkg = tmp_path / "vllm"
    (pkg / "platforms").mkdir(parents=True)
    first = "AttentionBackendEnum.B12X" if fork_b12x_first else "AttentionBackendEnum.TRITON_MLA"
    body = ("        elif device_capability.major == 12:\n            return [\n                " + first + ",\n")
    if marker:
        body = body.replace(first, "AttentionBackendEnum.B12X,  # imagebuild-patch: sm12x-b12x\n                " + first)
    (pkg / "platforms" / "cuda.py").write_text(body)
    expr = expr.replace("/opt/imagebuild/patches.json", str(report)).replace(
        "importlib.util.find_spec('vllm').submodule_search_locations[0]", repr(str(pkg)))
    assert bool(eval(expr, {"json": json_mod, "importlib": importlib})) is passes


def test_glm53_rust_frontend_follows_the_composed_tree():
    """VLLM_REQUIRE_RUST_FRONTEND is prefetch's switch of the vLLM source (1 when the composed tree
    has rust/Cargo.lock), and the gate checks the Rust tool parser exactly then."""
    defn = definition.load(ROOT, "glm53-jovian-r12")
    assert defn.source_options["VLLM"].cargo_switch == "VLLM_REQUIRE_RUST_FRONTEND"
    assert defn.env.get("VLLM_REQUIRE_RUST_FRONTEND") in ("0", "1")
    check = gatespec.load(defn.gate).check("vllm-rust-tool-parser")
    assert check.kind == "import" and check.params["module"] == "vllm._rust_tool_parser"
    assert check.when == (("VLLM_REQUIRE_RUST_FRONTEND", "1"),)
    df = (defn.dir / "Dockerfile.vllm-wheel").read_text()
    assert "ARG VLLM_REQUIRE_RUST_FRONTEND" in df and 'if [ "$VLLM_REQUIRE_RUST_FRONTEND" = 1 ]' in df
    # the choice, gated both ways: a tree without rust/ (as the served r12 image) has no module, on purpose
    absent = gatespec.load(defn.gate).check("vllm-rust-tool-parser-absent")
    assert absent.kind == "expression" and absent.when == (("VLLM_REQUIRE_RUST_FRONTEND", "0"),)
    assert "find_spec('vllm._rust_tool_parser') is None" in absent.params["expr"]
    # a tree with rust/: the toolchain its rust-toolchain.toml names, pinned (not noble's apt 1.75), and protoc
    assert defn.source_options["VLLM"].rust_toolchain == "dist"
    wheel = defn.stage("vllm-wheel")
    assert {a.name for a in wheel.apt.items} == {"protobuf-compiler"}


def test_glm53_pip_check_allows_exactly_the_runners_exceptions():
    """The gate's pip check may allow only the differences from vLLM's requirements that image.yaml
    justifies (requirements.exceptions), not everything vLLM requires."""
    defn = definition.load(ROOT, "glm53-jovian-r12")
    reqs = defn.stage("runner").requirements
    assert dict(reqs.satisfies) == {"VLLM": ("requirements/cuda.txt",)}
    names = {n for n, _ in reqs.exceptions}
    allow = gatespec.load(defn.gate).check("pip-check").params["allow"]
    [vllm] = [a for a in allow if a.startswith("^vllm")]
    assert set(re.search(r"\(has requirement\|requires\) \((.*?)\)", vllm).group(1).split("|")) == names
    assert re.search(vllm, "vllm 0.1.dev1+gabc has requirement torch==2.11.0, but you have torch 2.13.0.")
    assert not re.search(vllm, "vllm 0.1.dev1+gabc has requirement transformers>=4.56, but you have transformers 4.0.")
    assert all(len(why) > 20 for _, why in reqs.exceptions)


def test_dsv4_registry_check_tells_the_plugins_class_from_vllms_own():
    """The gate's plugin-owns-the-architectures expression, evaluated against registries shaped
    like vLLM's (lazy entries have module_name/class_name, imported ones model_cls)."""
    import types

    spec = gatespec.load(ROOT / "docker-images" / "dsv4-flash-vision" / "gate.yaml")
    expr = spec.check("plugin-owns-the-architectures").params["expr"]

    def lazy(mod, cls):
        return types.SimpleNamespace(module_name=mod, class_name=cls)

    def run(models):
        vllm = types.SimpleNamespace(plugins=types.SimpleNamespace(load_general_plugins=lambda: None),
                                     ModelRegistry=types.SimpleNamespace(models=models))
        return bool(eval(expr, {"vllm": vllm}))

    plugin = lazy("dsv4_vision.model", "DeepseekV4VisionForCausalLM")
    assert run({"DeepseekV4ForCausalLM": plugin, "DeepseekV4VisionForCausalLM": plugin})
    builtin = lazy("vllm.models.deepseek_v4", "DeepseekV4ForCausalLM")
    assert not run({"DeepseekV4ForCausalLM": builtin, "DeepseekV4VisionForCausalLM": plugin})
    imported = types.SimpleNamespace(model_cls=type("DeepseekV4VisionForCausalLM", (), {"__module__": "dsv4_vision.model"}))
    assert run({"DeepseekV4ForCausalLM": imported, "DeepseekV4VisionForCausalLM": plugin})


def _real_vllm_registry(src):
    """The model registry table (_VLLM_MODELS) of a real vLLM tree's registry.py, read with ast, and
    shaped as vLLM's ModelRegistry builds it (lazy entries with module_name/class_name)."""
    import ast
    import types

    table = {}  # _VLLM_MODELS merges per-family literal dicts (**_TEXT_GENERATION_MODELS, ...): read each
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            try:
                d = ast.literal_eval(node.value)
            except ValueError:
                continue
            table.update({k: v for k, v in d.items() if isinstance(k, str) and isinstance(v, tuple) and len(v) == 2})
    return {arch: types.SimpleNamespace(module_name=mod if mod.startswith("vllm.") else f"vllm.model_executor.models.{mod}",
                                        class_name=cls)
            for arch, (mod, cls) in table.items()}


def test_glm53_registry_check_requires_the_forks_native_glm5next_classes():
    """The gate's model-architectures expression passes only when both served architectures map to
    vLLM's own glm5next module; it fails on a missing architecture, on a plugin's class, and on the
    real 28be48fa snapshot (which has no Glm5Next model, so serving would fall back and fail)."""
    import types

    from tests import realtrees

    expr = gatespec.load(ROOT / "docker-images" / "glm53-jovian-r12" / "gate.yaml").check("model-architectures").params["expr"]

    def run(models):
        return bool(eval(expr, {"vllm": types.SimpleNamespace(ModelRegistry=types.SimpleNamespace(models=models))}))

    def lazy(mod, cls):
        return types.SimpleNamespace(module_name=mod, class_name=cls)

    native = {"Glm5NextForConditionalGeneration": lazy("vllm.models.glm5next", "Glm5NextForConditionalGeneration"),
              "Glm5NextMTPModel": lazy("vllm.models.glm5next.mtp", "Glm5NextMTP")}
    assert run(native)
    assert run({**native, "Glm5NextMTPModel": types.SimpleNamespace(
        model_cls=type("Glm5NextMTP", (), {"__module__": "vllm.model_executor.models.glm5next_mtp"}))})
    assert not run({"Glm5NextForConditionalGeneration": native["Glm5NextForConditionalGeneration"]})
    assert not run({**native, "Glm5NextForConditionalGeneration": lazy("glm5_plugin.model", "Glm5NextForConditionalGeneration")})
    assert not run({**native, "Glm5NextMTPModel": lazy("vllm.model_executor.models.deepseek_mtp", "DeepSeekMTP")})

    import tarfile

    with tarfile.open(realtrees.tarball(realtrees.VLLM)) as tf:
        src = tf.extractfile(f"{realtrees.VLLM.name}/vllm/model_executor/models/registry.py").read().decode()
    real = _real_vllm_registry(src)
    assert "GlmMoeDsaForCausalLM" in real and "DeepseekV4ForCausalLM" in real  # the table was read
    assert not run(real)


def test_glm53_pins_the_r12_contract_by_tree():
    """The lab's published r12 source contract (FACTS.md): both compositions pinned by their source tree,
    and no dependency pin overrides the composed tree without a reason (none is justified by a fact)."""
    defn = definition.load(ROOT, "glm53-jovian-r12")
    v, b = defn.sources["VLLM"], defn.sources["B12X"]
    assert (v.ref, [p.number for p in v.prs], v.tree) == (
        "54f6e9826c20ef06ed65d838c0ad497ad0abdecf", [550, 552, 553, 554, 555, 557],
        "237bc2b7bb297ab69b83704fad0b9f6628bfcde8")
    assert (b.ref, [p.number for p in b.prs], b.tree) == (
        "139e04048bc3bb4f7210c99e7184d8d2f0e345e7", [260, 267, 268, 269, 270],
        "aace94c2fcc0657c1aa255e9480277c8f30240fc")
    env = (ROOT / "docker-images" / "glm53-jovian-r12" / "versions.env").read_text()
    assert "override:" not in env
    doc = (ROOT / "docs" / "images" / "glm53-jovian-r12.md").read_text()
    assert "237bc2b7bb297ab69b83704fad0b9f6628bfcde8" in doc and "aace94c2fcc0657c1aa255e9480277c8f30240fc" in doc
    assert "models/glm-5.3-flash.md" in doc


def test_glm53_rust_parser_absent_check_tells_a_tree_without_rust_from_one_with(tmp_path, monkeypatch):
    """The absent-on-purpose check, evaluated as the gate does, against a vllm package without and with
    the Rust tool parser module."""
    import importlib
    import sys

    defn = definition.load(ROOT, "glm53-jovian-r12")
    expr = gatespec.load(defn.gate).check("vllm-rust-tool-parser-absent").params["expr"]
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    assert eval(expr, {"importlib": importlib}) is True
    (pkg / "_rust_tool_parser.py").write_text("")
    importlib.invalidate_caches()
    assert eval(expr, {"importlib": importlib}) is False
