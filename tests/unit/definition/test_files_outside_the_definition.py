"""Files outside the project are never read through a definition, and errors never echo a file
(issue 22, security 2): a versions.env, image.yaml or imagebuild.yaml that is a symlink out of its
folder is refused unread, and an error quotes at most a short, escaped excerpt of a line."""

from __future__ import annotations

import pytest

from imagebuild.core.errors import EXCERPT_CHARS, excerpt
from tests.conftest import run_cli

SECRET = "root:$6$saltsaltsalt$" + "h" * 80 + ":19000:0:99999:7:::"


@pytest.fixture
def secret(tmp_path):
    p = tmp_path / "shadow"
    p.write_text(SECRET + "\ndaemon:*:19000:0:99999:7:::\n")
    return p


@pytest.mark.parametrize("name", ["versions.env", "image.yaml"])
@pytest.mark.parametrize("command", [["validate", "tiny"], ["plan", "tiny", "--no-engine"], ["list"]])
def test_a_definition_file_linked_out_of_its_folder_is_not_read(project, secret, name, command):
    f = project / "docker-images" / "tiny" / name
    f.unlink()
    f.symlink_to(secret)
    res = run_cli("--root", str(project), *command)
    assert res.code == (0 if command == ["list"] else 2), res
    out = res.out + res.err
    assert "hhhhhhhh" not in out and "daemon:" not in out
    if command != ["list"]:
        assert f"docker-images/tiny/{name}: is a symlink that leads outside its definition folder" in res.err


def test_a_link_inside_the_folder_is_fine(project):
    d = project / "docker-images" / "tiny"
    (d / "versions.real").write_bytes((d / "versions.env").read_bytes())
    (d / "versions.env").unlink()
    (d / "versions.env").symlink_to("versions.real")
    assert run_cli("--root", str(project), "validate", "tiny").code == 0


def test_imagebuild_yaml_linked_out_of_the_project_is_not_read(project, secret):
    (project / "imagebuild.yaml").symlink_to(secret)
    res = run_cli("--root", str(project), "sync", "--dry-run", "--image", "tiny")
    assert res.code == 2, res
    assert "imagebuild.yaml: is a symlink that leads outside the project" in res.err
    assert "hhhhhhhh" not in res.out + res.err


def test_a_gate_spec_that_is_some_other_file_is_not_quoted_at_all(project, secret):
    """issue 34: a file none of whose top-level keys is a gate spec's is named, nothing of it quoted (its
    unknown keys were quoted in 32-character excerpts, the first bytes of a password hash)."""
    res = run_cli("--root", str(project), "gate", "imagebuild-test/busybox:1", "--spec", str(secret))
    assert res.code == 2, res
    assert "not a gate spec" in res.err and "unknown key" not in res.err
    assert "saltsalt" not in res.err and "daemon" not in res.err and "h" * 8 not in res.err


def test_a_bad_versions_env_line_is_quoted_short_and_escaped(project):
    env = project / "docker-images" / "tiny" / "versions.env"
    env.write_text(env.read_text() + SECRET + "\n")
    res = run_cli("--root", str(project), "validate", "tiny")
    assert res.code == 2
    assert f"expected KEY=VALUE, got {excerpt(SECRET)}" in res.err, res.err
    assert "h" * 40 not in res.err


def test_excerpt():
    assert excerpt("a\tb") == "'a\\tb'"
    assert excerpt("x" * 100) == repr("x" * EXCERPT_CHARS) + "..."
