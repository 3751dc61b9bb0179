"""Units of ``--engine`` that need no engine: its forms, an unknown docker context (exit 2), the
MAX_JOBS rule's wording for another node."""

from __future__ import annotations

import pytest

from imagebuild.buildstep import guards
from imagebuild.core import remote_engine
from imagebuild.core.errors import UsageError
from tests.conftest import run_cli


@pytest.mark.parametrize("spec,kind,ssh", [
    ("ssh://dgx3", "ssh", ("dgx3", None)),
    ("ssh://root@10.77.0.2:2222", "ssh", ("root@10.77.0.2", "2222")),
    ("tcp://10.0.0.3:2376", "tcp", None),
    ("unix:///run/other.sock", "unix", None),
])
def test_engine_forms(spec, kind, ssh):
    e = remote_engine.resolve(spec)
    assert (e.kind, e.ssh) == (kind, ssh)


@pytest.mark.parametrize("spec", ["ssh://", "ftp://x", "ssh://a b", "bad name!"])
def test_engine_malformed_is_exit_2(spec):
    with pytest.raises(UsageError):
        remote_engine.resolve(spec)


def test_engine_unknown_context_names_it(project):
    res = run_cli("--root", str(project), "build", "tiny", "--engine", "imagebuild-no-such-context-x9")
    assert res.code == 2, res
    assert "imagebuild-no-such-context-x9" in res.err and "docker context" in res.err


def test_jobs_rule_names_the_node():
    j = guards.jobs_rule(16, 100.0, env={}, where="ssh://dgx3")
    assert j.max_jobs == 16 and "(on ssh://dgx3)" in j.rule
