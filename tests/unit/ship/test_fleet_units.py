"""Units of the registry features that need no engine: registry addresses (no credentials, ever), the
project config's registry, error classification and scrubbing, the identity of a registry config."""

from __future__ import annotations

import json

import pytest

from imagebuild.buildstep import registry_cache, registry_release
from imagebuild.core import config, identity, registry
from imagebuild.core.errors import DefinitionError, UsageError
from tests.conftest import run_cli

SECRET = "s3cr3t-Pa55"


@pytest.mark.parametrize("value,host,prefix,insecure", [
    ("127.0.0.1:5000/imagebuild", "127.0.0.1:5000", "imagebuild", True),
    ("localhost:5000", "localhost:5000", "", True),
    ("registry.lab:443/a/b-c", "registry.lab:443", "a/b-c", False),
    ("10.0.0.5:5000/ib/", "10.0.0.5:5000", "ib", False),
    ("[::1]:5000/x", "[::1]:5000", "x", True),
])
def test_registry_address(value, host, prefix, insecure, monkeypatch):
    monkeypatch.delenv(registry.INSECURE_ENV, raising=False)
    r = registry.parse(value)
    assert (r.host, r.prefix, r.insecure) == (host, prefix, insecure)
    assert r.ref("img", "stage-ab") == f"{r.address}/img:stage-ab"


def test_registry_insecure_by_environment(monkeypatch):
    monkeypatch.setenv(registry.INSECURE_ENV, "1")
    assert registry.parse("10.0.0.5:5000/ib").insecure


@pytest.mark.parametrize("value", [f"user:{SECRET}@127.0.0.1:5000/ib", f"https://user:{SECRET}@reg/ib",
                                   f"{SECRET}@reg"])
def test_registry_address_with_credentials_is_refused_without_repeating_them(value):
    with pytest.raises(UsageError) as e:
        registry.parse(value)
    text = e.value.render()
    assert SECRET not in text and "credentials" in text and "docker login" in text


@pytest.mark.parametrize("value", ["http://127.0.0.1:5000/ib", "127.0.0.1:99999/ib", "reg/Upper", "", "reg//x",
                                   "reg:5000/a b"])
def test_registry_address_malformed(value):
    with pytest.raises(UsageError):
        registry.parse(value)


def test_scrub_removes_credentials():
    text = (f'Get "https://bob:{SECRET}@reg/v2/": unauthorized; {{"auth": "{SECRET}"}} password={SECRET} '
            f"Authorization: {SECRET}")
    out = registry.scrub(text)
    assert SECRET not in out and "unauthorized" in out


@pytest.mark.parametrize("text,kind", [
    ("reading manifest stage-ab in 127.0.0.1:5/x/y: manifest unknown", "missing"),
    ('pinging container registry 127.0.0.1:5: Get "http://127.0.0.1:5/v2/": dial tcp 127.0.0.1:5: connect: '
     "connection refused", "unreachable"),
    ("writing blob: Digest did not match, expected sha256:404abc, got sha256:401def", "corrupt"),
    # a connection cut mid-blob (what skopeo says, measured through a cutting proxy): a transfer failure
    ("writing blob: happened during read: unexpected EOF", "transfer"),
    ("writing blob: happened during read: read tcp 127.0.0.1:38890->127.0.0.1:35947: read: connection reset by "
     "peer", "transfer"),
    ("requested access to the resource is denied: unauthorized: authentication required", "auth"),
    ("something else", "other"),
])
def test_registry_error_kinds(text, kind):
    assert registry._kind(text) == kind


def test_stage_tag_is_the_key():
    key = "sha256:" + "ab" * 32
    assert registry_cache.stage_tag(key) == "stage-" + "ab" * 32


@pytest.mark.parametrize("manifest,why", [
    ({"layers": []}, "no config"),
    ({"config": {"digest": "sha256:" + "0" * 64}, "layers": []}, "without digest and size"),
    ({"config": {"digest": "md5:x", "size": 1}, "layers": []}, "not a sha256 digest"),
])
def test_manifest_descriptors_checked(manifest, why):
    with pytest.raises(registry_cache.Refused, match=why):
        registry_cache._descriptors(manifest)


def test_identity_of_a_registry_config_is_the_engines_identity():
    cfg = {"architecture": "arm64", "os": "linux", "variant": "v8",
           "config": {"Env": ["PATH=/bin"], "Cmd": ["sh"], "Labels": {"a": "b"}, "WorkingDir": ""},
           "rootfs": {"type": "layers", "diff_ids": ["sha256:" + "1" * 64, "sha256:" + "2" * 64]}}
    inspect = {"Id": "sha256:whatever", "Os": "linux", "Architecture": "arm64", "Variant": "v8",
               "Config": {"Env": ["PATH=/bin"], "Cmd": ["sh"], "Labels": {"a": "b"}, "Entrypoint": None},
               "RootFS": {"Type": "layers", "Layers": cfg["rootfs"]["diff_ids"]}}
    assert registry_release.identity_of_config(cfg) == identity.from_inspect(inspect).digest


def test_config_registry(tmp_path):
    (tmp_path / "imagebuild.yaml").write_text("peers: [dgx4]\nregistry: 127.0.0.1:5000/ib\n")
    assert config.load(tmp_path).registry == "127.0.0.1:5000/ib"


def test_config_registry_with_credentials_is_a_definition_error_without_them(tmp_path):
    (tmp_path / "imagebuild.yaml").write_text(f"registry: bob:{SECRET}@127.0.0.1:5000/ib\n")
    with pytest.raises(DefinitionError) as e:
        config.load(tmp_path)
    text = e.value.render()
    assert "imagebuild.yaml:1" in text and SECRET not in text


def test_build_cache_registry_with_credentials_exit_2(project):
    res = run_cli("--root", str(project), "build", "tiny", "--cache-registry", f"bob:{SECRET}@127.0.0.1:5/ib")
    assert res.code == 2 and SECRET not in res.err + res.out


def test_rollback_registry_needs_a_registry(project):
    res = run_cli("--root", str(project), "rollback", "tiny", "--registry")
    assert res.code == 2 and "registry" in res.err


def test_docker_config_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    assert registry.docker_config_file() is None
    (tmp_path / "config.json").write_text(json.dumps({"auths": {}}))
    assert registry.docker_config_file() == tmp_path / "config.json"


def test_sync_via_registry_needs_a_registry(project):
    res = run_cli("--root", str(project), "sync", "--via", "registry", "--image", "tiny", "somepeer")
    assert res.code == 2 and "which registry" in res.err


@pytest.mark.parametrize("extra", [["--registry", "127.0.0.1:5000/ib"], ["--tunnel"], ["--no-tunnel"]])
def test_sync_registry_options_need_via_registry(project, extra):
    res = run_cli("--root", str(project), "sync", "--image", "tiny", *extra, "somepeer")
    assert res.code == 2 and "--via registry" in res.err


def test_sync_via_registry_with_credentials_in_the_address_exit_2(project):
    res = run_cli("--root", str(project), "sync", "--via", "registry", "--registry", f"bob:{SECRET}@10.0.0.5:5000/ib",
                  "--image", "tiny", "somepeer")
    assert res.code == 2 and SECRET not in res.err + res.out


def test_registry_sync_tunnel_default(monkeypatch):
    from imagebuild.ship import registry_sync

    monkeypatch.delenv(registry_sync.TUNNEL_ENV, raising=False)
    monkeypatch.delenv(registry.INSECURE_ENV, raising=False)
    assert registry_sync.wants_tunnel(registry.parse("127.0.0.1:5000/ib"), None) is True
    assert registry_sync.wants_tunnel(registry.parse("10.0.0.5:5000/ib"), None) is False
    assert registry_sync.wants_tunnel(registry.parse("10.0.0.5:5000/ib"), True) is True
    monkeypatch.setenv(registry_sync.TUNNEL_ENV, "1")
    assert registry_sync.wants_tunnel(registry.parse("10.0.0.5:5000/ib"), None) is True
    monkeypatch.setenv(registry_sync.TUNNEL_ENV, "0")
    assert registry_sync.wants_tunnel(registry.parse("127.0.0.1:5000/ib"), None) is False
    assert registry_sync.identity_tag("sha256:" + "ab" * 32) == "id-" + "ab" * 32
    assert registry_sync.repo_name(None, "10.0.0.5:5000/x/vllm:local") == "vllm"
