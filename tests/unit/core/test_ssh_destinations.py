"""Peer names and engines never reach ssh as options (issue 22, security 1): every destination is
checked the way sync checks it, before anything runs, and every ssh command line puts ``--`` before
the destination. Each case used to run the attacker's command (ProxyCommand) or pass silently."""

from __future__ import annotations

import pytest

from imagebuild.core import remote, remote_engine
from imagebuild.core.errors import UsageError
from tests.conftest import run_cli

HOSTILE = ["-oProxyCommand=touch {m}", "-F{m}", "", " dgx4", "dgx4 -oProxyCommand=x", "dgx\n4", "dgx\x7f4"]


@pytest.mark.parametrize("dest", ["dgx4", "root@10.0.0.5", "user@host.example", "dgx-4_a"])
def test_good_destinations_pass_and_come_after_a_double_dash(dest):
    assert remote.check_destination(dest) == dest
    argv = remote.ssh_argv(dest, "true")
    assert argv[argv.index("--") + 1] == dest and argv[-1] == "true"


@pytest.mark.parametrize("dest", HOSTILE)
def test_option_like_or_blank_destinations_are_refused(dest, tmp_path):
    dest = dest.format(m=tmp_path / "x")
    with pytest.raises(UsageError, match="not an SSH destination"):
        remote.check_destination(dest)
    with pytest.raises(UsageError):
        remote.ssh_argv(dest, "true")


def test_doctor_refuses_an_option_like_peer_before_running_anything(tmp_path):
    marker = tmp_path / "pwned"
    res = run_cli("doctor", f"--peer=-oProxyCommand=touch {marker}")
    assert res.code == 2, res
    assert "not an SSH destination" in res.err and "Traceback" not in res.err
    assert res.out == ""  # no check ran
    assert not marker.exists()


@pytest.mark.parametrize("value", ["['-oProxyCommand=touch {m}']", "[' dgx4']", "['dgx4', '']"])
def test_a_hostile_peer_in_imagebuild_yaml_is_a_definition_error(project, tmp_path, value):
    marker = tmp_path / "pwned"
    (project / "imagebuild.yaml").write_text(f"peers: {value.format(m=marker)}\n")
    res = run_cli("--root", str(project), "doctor")
    assert res.code == 2, res
    assert "imagebuild.yaml:1: peers: expected a list of SSH destinations" in res.err, res.err
    assert not marker.exists()
    (project / "imagebuild.yaml").write_text(f"peer_lists:\n  rack: {value.format(m=marker)}\n")
    res = run_cli("--root", str(project), "sync", "@rack", "--dry-run")
    assert res.code == 2 and "peer_lists.rack" in res.err, res


@pytest.mark.parametrize("spec", ["ssh://-Fevil.conf", "ssh://-oProxyCommand=x@host", "ssh://user@-host", ""])
def test_an_engine_that_ssh_would_read_as_an_option_or_an_empty_one_is_refused(spec):
    with pytest.raises(UsageError):
        remote_engine.resolve(spec)


@pytest.mark.parametrize("spec", ["", "ssh://-Fevil.conf"])
def test_build_engine_flag_refuses_them(project, spec):
    res = run_cli("--root", str(project), "build", "tiny", "--engine", spec, "--dry-run")
    assert res.code == 2, res
    assert "--engine" in res.err and "Traceback" not in res.err


@pytest.mark.parametrize("spec, dest", [("ssh://dgx4", "dgx4"), ("ssh://root@10.0.0.5:2222", "root@10.0.0.5")])
def test_the_engine_master_connection_puts_a_double_dash_before_the_destination(spec, dest, tmp_path, monkeypatch):
    """The build's shared ssh connection to an ``--engine ssh://`` node (open and close): ``--`` before
    the destination, as on every other ssh command line."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its wrapper script goes under the temp folder
    mux = remote_engine._Mux(remote_engine.resolve(spec))
    for argv in (mux._argv("-N", "-f"), mux._argv("-O", "exit")):
        assert argv[-2:] == ["--", dest], argv
    mux.dest = "-oProxyCommand=x"  # never reaches ssh, even past the check in resolve
    with pytest.raises(UsageError):
        mux._argv("-O", "exit")
