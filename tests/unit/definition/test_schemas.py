"""The published JSON Schemas (docs/schemas/: image.yaml, gate.yaml, imagebuild.yaml; editors complete
from them) against the parsers: every key a parser accepts is in its schema and every key of the schema
is one the parser accepts; the definitions and specs the parsers accept validate; a mistyped key is
refused by both (issue 23, section 4)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from imagebuild.core import config
from imagebuild.core.errors import DefinitionError
from imagebuild.definition import gatespec, model, pkgspec, reader, source_options

REPO = Path(__file__).resolve().parents[3]
SCHEMAS = REPO / "docs" / "schemas"
PROJECTS = [REPO, *sorted(p.parent for p in (REPO / "tests" / "fixtures").glob("*/docker-images"))]


def schema(name: str) -> dict:
    doc = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(doc)
    return doc


def validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(schema(name))


def _keys(obj: dict) -> list[str]:
    assert obj.get("additionalProperties") is False, "a schema object that lets unknown keys through"
    return sorted(obj["properties"])


def test_image_schema_has_the_parsers_keys():
    s = schema("image")
    assert _keys(s) == sorted(model.TOP_KEYS)
    assert _keys(s["properties"]["stages"]["items"]) == sorted(model.STAGE_KEYS)
    assert _keys(s["properties"]["sources"]["additionalProperties"]) == sorted(source_options.SOURCE_KEYS)
    python_map = [v for v in s["properties"]["python"]["oneOf"] if v.get("type") == "object"][0]
    assert _keys(python_map) == sorted(pkgspec.PYTHON_KEYS)
    req_map = [v for v in s["properties"]["stages"]["items"]["properties"]["requirements"]["oneOf"]
               if v.get("type") == "object"][0]
    assert _keys(req_map) == sorted(pkgspec.REQ_KEYS)


def test_gate_schema_has_the_parsers_keys():
    s = schema("gate")
    assert _keys(s) == sorted(gatespec.TOP_KEYS)
    check = s["properties"]["checks"]["items"]
    assert check["properties"]["kind"]["enum"] == list(gatespec.KINDS)
    by_kind = {v["if"]["properties"]["kind"]["const"]: v["then"] for v in check["allOf"]}
    assert sorted(by_kind) == sorted(gatespec.KINDS)
    for kind, (required, optional) in gatespec.KINDS.items():
        assert _keys(by_kind[kind]) == sorted({*gatespec.COMMON_KEYS, *required, *optional}), kind
        assert sorted(by_kind[kind]["required"]) == sorted({"id", "kind", *required}), kind


def test_imagebuild_yaml_schema_has_the_parsers_keys():
    assert _keys(schema("imagebuild")) == sorted(config.KEYS)


def _definitions():
    for root in PROJECTS:
        for name in reader.list_images(root):
            yield pytest.param(root, name, id=f"{root.name}/{name}")


@pytest.mark.parametrize("root, name", list(_definitions()))
def test_definitions_the_parser_accepts_validate(root, name):
    folder = root / "docker-images" / name
    try:
        reader.load(root, name)  # the parser accepts it (the smoke fixture's files are put in place
    except DefinitionError as exc:  # by its test: then only its missing files are refused, never a key)
        assert all("not found" in p.message for p in exc.problems), exc.render()
    data = yaml.safe_load((folder / "image.yaml").read_text())
    errors = [e.message for e in validator("image").iter_errors(data)]
    assert errors == [], f"{folder}/image.yaml"  # ... and so does the schema
    gate = folder / data.get("gate", "gate.yaml")
    if gate.is_file():
        gatespec.load(gate)
        spec = yaml.safe_load(gate.read_text())
        assert [e.message for e in validator("gate").iter_errors(spec)] == [], str(gate)


def test_settings_the_parser_accepts_validate(tmp_path):
    text = "peers: [dgx4, ops@dgx5]\npeer_lists:\n  rack2: [dgx5, dgx6]\nregistry: 127.0.0.1:5000/imagebuild\n"
    (tmp_path / "imagebuild.yaml").write_text(text)
    config.load(tmp_path)
    assert list(validator("imagebuild").iter_errors(yaml.safe_load(text))) == []


@pytest.mark.parametrize("name, text", [
    ("imagebuild", "peers: [dgx4]\nregistyr: 127.0.0.1:5000\n"),
    ("imagebuild", "peers: [-oProxyCommand=x]\n"),
    ("gate", "checks:\n  - id: a\n    kind: import\n    modul: vllm\n"),
    ("gate", "checks:\n  - id: a\n    kind: nosuchkind\n"),
    ("gate", "checks:\n  - id: a\n    kind: file\n"),
])
def test_both_refuse_a_wrong_key(tmp_path, name, text):
    data = yaml.safe_load(text)
    assert list(validator(name).iter_errors(data)), "the schema let it through"
    with pytest.raises(DefinitionError):
        if name == "gate":
            gatespec.parse(text, "gate.yaml")
        else:
            (tmp_path / "imagebuild.yaml").write_text(text)
            config.load(tmp_path)


def test_image_schema_refuses_a_mistyped_stage_key(project):
    path = project / "docker-images" / "tiny" / "image.yaml"
    data = yaml.safe_load(path.read_text())
    data["stages"][0]["dockerfil"] = data["stages"][0].pop("dockerfile", "Dockerfile.x")
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(DefinitionError):
        reader.load(project, "tiny")
    assert list(validator("image").iter_errors(data))
