"""Hostile-input corpus, issue 34: terminal escapes the old stripper let through, and a URL's userinfo.

``ESC c`` (reset), ``ESC ( 0`` (line drawing), ``ESC # 8`` (screen fill) and the 8-bit CSI byte
0x9b reached the stage log, ``log --stage``, ``-v``, plain output, the failure tail, the heartbeat and
the live display; and, through ``report --history``, an allowed-signers principal name and
``config --env``. Everything shown or written goes through one filter by allow-list
(core/printable.py). A credential in a URL (``DOCKER_HOST``, ``--engine``,
``IMAGEBUILD_GITHUB_API``) is never shown (core/secrets.without_userinfo)."""

from __future__ import annotations

import base64
import json

import pytest

from imagebuild.buildstep import buildlog
from imagebuild.buildstep import progress as progress_mod
from imagebuild.core.errors import OperationFailed
from imagebuild.core.printable import one_line, printable
from imagebuild.core.secrets import without_userinfo
from tests.conftest import run_cli

HOSTILE = {
    "reset": "\x1bc",
    "line-drawing": "\x1b(0",
    "screen-fill": "\x1b#8",
    "c1-csi": "\x9b2J",
    "c1-osc": "\x9d0;title\x9c",
    "csi": "\x1b[2J\x1b[H",
    "osc": "\x1b]0;title\x07",
    "dcs": "\x1bPq#0;2;0;0;0\x1b\\",
    "bell-backspace-cr": "\x07\x08\r",
    "bidi-override": "\u202e",
    "del": "\x7f",
}
SECRET = "S3cr3t-pw-7781"


def _clean(text: str) -> bool:
    """Printable text only (newlines and tabs allowed): no escape, no control character."""
    return all(c.isprintable() or c in "\n\t" for c in text)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_the_filter_keeps_printable_text_only(name):
    bad = HOSTILE[name]
    got = printable(f"before{bad}after\tx\n")
    assert _clean(got) and got.startswith("before") and got.endswith("after\tx\n"), repr(got)
    assert _clean(one_line(f"a{bad}\nb")) and "\n" not in one_line("a\nb")
    assert printable("plain text, ünïcode ✓") == "plain text, ünïcode ✓"


@pytest.mark.parametrize("name", list(HOSTILE))
def test_the_stage_log_the_plain_lines_and_the_heartbeat(name, capsys):
    """A RUN that prints the sequence, in a step whose name carries it: the stage log text, the plain
    output, the step's last line (heartbeat, live display) and its name are printable text."""
    bad = HOSTILE[name]
    v = "sha256:" + "cd" * 32
    p = progress_mod.Progress("plain")
    p.every = 0
    p.verbose = True
    p.begin(["only"])
    p.stage("only")
    dec = progress_mod.Decoder()
    p.start("only", "/logs/only.log", decoder=dec)
    log_text = ""
    for msg in ({"vertexes": [{"digest": v, "name": f"[1/1] RUN echo {bad}x", "started": "2026-12-01T15:27:55Z"}]},
                {"logs": [{"vertex": v, "stream": 1, "timestamp": "2026-12-01T15:27:55.5Z",
                           "data": base64.b64encode(f"out{bad}put\nlast{bad}line".encode()).decode()}]}):
        raw = json.dumps(msg) + "\n"
        plain = dec.feed(raw)
        log_text += plain
        p.feed(raw, dec, plain)
    p.stop()
    err = capsys.readouterr().err
    st = dec.order[0]
    for text in (log_text, err, st.name, st.last_line() or "", p.heartbeat()):
        assert _clean(text), repr(text)
    assert "output" in log_text
    # buildx's own (not JSON) lines and the failure tail a report quotes
    assert _clean(dec.feed(f"ERROR: failed{bad}\n"))
    assert _clean(buildlog.clean(f"x{bad}y"))
    tail = buildlog.explain(f'#1 [1/1] RUN x\n#1 0.1 boom{bad}\n#1 ERROR: process "/bin/sh -c x{bad}" did not '
                            "complete successfully: exit code: 3\n")
    assert all(_clean(t) for t in tail["tail"]) and _clean(tail["command"] or ""), tail


@pytest.mark.parametrize("name", ["reset", "screen-fill", "c1-csi", "line-drawing"])
def test_errors_and_log_lines_are_printable(name, project, tmp_path, monkeypatch):
    bad = HOSTILE[name]
    assert _clean(OperationFailed(f"a{bad}b", hint=f"c{bad}").render())
    # an error carrying the sequence: said as printable text (here through an image name's excerpt)
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state"))
    r = run_cli("--root", str(project), "plan", f"x{bad}")
    assert r.code == 2 and _clean(r.err), repr(r.err)


@pytest.mark.parametrize("name", ["reset", "screen-fill", "c1-csi", "line-drawing"])
def test_log_stage_prints_printable_text(name, project):
    """``log --stage`` of a log written with the sequence in it (by an older imagebuild, or by hand)."""
    bad = HOSTILE[name]
    d = project / ".imagebuild" / "builds" / "tiny" / "20990101T000000Z-esc"
    (d / "logs").mkdir(parents=True)
    (d / "record.json").write_text(json.dumps({"status": "failed", "stages": [{"name": "base", "log": "logs/base.log"}]}))
    (d / "logs" / "base.log").write_text(f"#1 RUN x\n#1 0.1 a{bad}b\n")
    r = run_cli("--root", str(project), "log", "tiny", "latest", "--stage", "base")
    assert r.code == 0, r.err
    assert "a" in r.out and _clean(r.out), repr(r.out)


@pytest.mark.parametrize("name", ["reset", "screen-fill", "c1-csi", "line-drawing", "bidi-override"])
def test_report_history_shows_printable_text(name, project, tmp_path, monkeypatch):
    bad = HOSTILE[name]
    state = tmp_path / "state"
    state.mkdir()
    row = {"schema": "imagebuild.nightly-history", "version": 1, "run_id": "20261201T020000.000001Z-abcdef",
           "image": f"tiny{bad}", "status": f"failed{bad}", "seconds": 3.0, "stages": [],
           "gate": None, "cache": None, "size": None}
    (state / "nightly-history.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(state))
    r = run_cli("--root", str(project), "report", "--history")
    assert r.code == 0, r.err
    assert "tiny" in r.out and "failed" in r.out and _clean(r.out + r.err), repr(r.out)


@pytest.mark.parametrize("name", ["reset", "screen-fill", "c1-csi", "line-drawing"])
def test_config_env_shows_printable_text_and_no_url_credential(name, project, monkeypatch):
    bad = HOSTILE[name]
    monkeypatch.setenv("IMAGEBUILD_SSH", f"ssh -v{bad}")
    monkeypatch.setenv("DOCKER_HOST", f"tcp://bob:{SECRET}@127.0.0.1:9")
    monkeypatch.setenv("IMAGEBUILD_GITHUB_API", f"https://u:{SECRET}@api.example.invalid")
    for argv in (["config"], ["config", "--env"], ["config", "--json"], ["config", "--env", "--json"]):
        r = run_cli("--root", str(project), *argv)
        assert r.code == 0, r.err
        assert _clean(r.out) and "\\u001b" not in r.out and "\\u009b" not in r.out, (argv, r.out)
        assert SECRET not in r.out + r.err and "bob" not in r.out, (argv, r.out)
        assert "127.0.0.1:9" in r.out and "api.example.invalid" in r.out


def test_a_url_credential_is_never_shown_by_plan_or_build(project, tmp_path, monkeypatch):
    """``DOCKER_HOST`` and ``--engine`` with a password: the unreachable engine's error names the host
    only. (Nothing listens on port 9.)"""
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("DOCKER_HOST", f"tcp://bob:{SECRET}@127.0.0.1:9")
    for argv in (["plan", "tiny"], ["plan", "tiny", "--json"], ["build", "tiny", "--no-gate"]):
        r = run_cli("--root", str(project), *argv)
        assert SECRET not in r.out + r.err, (argv, r.out, r.err)
        assert "127.0.0.1:9" in r.out + r.err, (argv, r.out, r.err)
    monkeypatch.delenv("DOCKER_HOST")
    r = run_cli("--root", str(project), "build", "tiny", "--no-gate", "--engine", f"tcp://bob:{SECRET}@127.0.0.1:9")
    assert r.code != 0 and SECRET not in r.out + r.err and "tcp://127.0.0.1:9" in r.err, r.err


@pytest.mark.parametrize("url, want", [
    (f"https://u:{SECRET}@h/x", "https://h/x"),
    (f"https://ci:{SECRET}@with@at@h/x", "https://h/x"),  # a password holding "@"
    (f"https://{SECRET}@h", "https://h"),  # a token as the user name
    ("ssh://root@dgx3", "ssh://root@dgx3"),  # a login name is no credential
    (f"ssh://root:{SECRET}@dgx3", "ssh://dgx3"),
    ("git@github.com:o/r.git", "git@github.com:o/r.git"),  # no URL
    ("https://github.com/a@b", "https://github.com/a@b"),  # an @ in the path
])
def test_a_urls_userinfo_goes(url, want):
    assert without_userinfo(f"see {url} now") == f"see {want} now"


def test_an_allowed_signers_principal_name_is_shown_as_printable_text(tmp_path):
    """The signer's name comes from the allowed-signers file, and is shown (gate --check-receipt) and
    recorded: an escape in it never reaches a terminal."""
    from imagebuild.gate import signing
    from tests.unit.gate.test_receipt_trust import _key

    key = _key(tmp_path / "k")
    allowed = tmp_path / "allowed_signers"
    pub = " ".join(key.with_suffix(".pub").read_text().split()[:2])
    allowed.write_bytes(f'ev\x1bcil\x9b2J namespaces="{signing.NAMESPACE}" {pub}\n'.encode())
    data = b'{"x": 1}'
    sig = signing.sign(data, key)
    who = signing.verify(data, sig, allowed)  # OpenSSH takes the name as it is written
    assert who == "evil", repr(who)  # the sequences out whole, parameters included



def test_a_nightly_report_stores_no_url_credential_even_with_no_token_set(tmp_path, monkeypatch):
    """The nightly's report (.json, .md) and its history page (.html): a stale-lock error that quoted a
    source URL with its token was stored as it was when no GITHUB_TOKEN was set (nothing to redact)."""
    from imagebuild.ops import htmlpage
    from imagebuild.ops import report as report_mod
    from tests.unit.ops.test_nightly_report import full_doc

    for var in ("GITHUB_TOKEN", "GH_TOKEN", "IMAGEBUILD_GITHUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    doc = full_doc("20261129T020000.000001Z-abcde0", image="a")
    doc["images"][0]["reason"] = (f"stage 'build' mounts source APP, but lock.json is stale: the lock has 'x' [] "
                                  f"from 'https://github.com/o/r', versions.env says 'y' [] from "
                                  f"'https://ci-bot:{SECRET}@github.com/o/r'")
    st = report_mod.write(tmp_path / "reports", doc)
    page = htmlpage.render([], st.load())
    for text in (st.json_path.read_text(), st.md_path.read_text(), page):
        assert SECRET not in text and "ci-bot" not in text
    assert "https://github.com/o/r" in st.md_path.read_text()


def test_a_history_line_with_a_url_credential_is_shown_without_it(project, tmp_path, monkeypatch):
    """A line kept from before (or edited by hand) that holds a URL with its token: ``report --history``
    (text, JSON) and ``--html`` show the URL without it."""
    state = tmp_path / "state"
    state.mkdir()
    row = {"schema": "imagebuild.nightly-history", "version": 1, "run_id": "20261201T020000.000001Z-abcdef",
           "image": "tiny", "status": "failed", "seconds": 3.0, "stages": [], "gate": None, "cache": None,
           "size": None, "upstream": {"moved": [{"source": "APP", "repo": f"https://ci:{SECRET}@github.com/o/r",
                                                 "from": "a" * 40, "to": "b" * 40}]}}
    (state / "nightly-history.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(state))
    for argv in (["--history"], ["--history", "--json"], ["--html"]):
        r = run_cli("--root", str(project), "report", *argv)
        assert r.code == 0, (argv, r.err)
        assert SECRET not in r.out + r.err, argv


@pytest.mark.parametrize("json_lines", [False, True], ids=["text", "rawjson"])
def test_every_log_line_is_printable_and_shows_no_url_credential(json_lines, monkeypatch):
    """What ``-v`` adds (every command run, ``+ docker ...``), the notes and warnings: one formatter."""
    import argparse
    import io
    import logging
    import sys

    from imagebuild.cli import main

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    logger = logging.getLogger("imagebuild")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    try:
        main._configure_logging(argparse.Namespace(debug=False, verbose=True, quiet=False, json_lines=json_lines))
        for bad in HOSTILE.values():
            logger.info("+ docker run x%sy https://u:%s@h/", bad, SECRET)
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
    out = err.getvalue()
    assert out.count("docker run x") == len(HOSTILE)
    assert _clean(out) and "\\u001b" not in out and SECRET not in out, repr(out)
