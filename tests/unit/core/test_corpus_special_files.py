"""Hostile-input corpus, issue 34: read-only commands never hang or exhaust memory on a special file.
A FIFO (a read waits for a writer for ever) or a link to /dev/zero (a read never ends) where a receipt,
its ``.sig``, ``nightly-history.jsonl`` (``report --history``, ``report --html``), a gc owners file, a
run record or the definition's lock belongs. Every file imagebuild reads goes through one reader,
``core/fsutil.read_bytes``: regular files only, a size bound, checked on the open file.

Each case runs in a child process with 60 s and 2 GiB of address space: on code that reads such a
file, it fails (a timeout, a MemoryError) instead of hanging the suite or the shared machine."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from imagebuild.core import fsutil

REPO = Path(__file__).resolve().parents[3]
KINDS = ["fifo", "dev-zero"]


def _special(p: Path, kind: str) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.exists() or p.is_symlink():
        p.unlink()
    if kind == "fifo":
        os.mkfifo(p)
    else:
        p.symlink_to("/dev/zero")
    return p


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def _child(code: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """``code`` (Python) in a bounded child; a hang fails the test, it does not hold the suite."""
    try:
        return subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **(env or {})},
                              capture_output=True, text=True, timeout=timeout, preexec_fn=_limits)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung for {timeout} s on a special file: {code!r}")


def _cli(*argv: str, env: dict) -> subprocess.CompletedProcess:
    return _child(f"import sys; from imagebuild.cli import main; sys.exit(main.main({list(argv)!r}))", env)


# ---------------------------------------------------------------------------------------------- the reader


@pytest.mark.parametrize("kind", [*KINDS, "folder"])
def test_the_one_reader_takes_regular_files_only(tmp_path, kind):
    p = tmp_path / "f"
    if kind == "folder":
        p.mkdir()
    else:
        _special(p, kind)
    with pytest.raises(fsutil.UnfitFile) as exc:
        fsutil.read_bytes(p)
    assert "not a regular file" in exc.value.strerror
    assert isinstance(exc.value, OSError)  # a reader that takes an unreadable file as absent does so here


def test_the_one_reader_has_a_size_bound(tmp_path):
    p = tmp_path / "big"
    with open(p, "wb") as f:
        f.truncate(10 << 20)  # sparse: no disk
    assert len(fsutil.read_bytes(p, 10 << 20)) == 10 << 20
    with pytest.raises(fsutil.UnfitFile, match="over the"):
        fsutil.read_bytes(p, (10 << 20) - 1)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "small")
    (tmp_path / "small").write_text("ok")
    assert fsutil.read_text(link) == "ok"  # a link to a regular file is read
    with pytest.raises(FileNotFoundError):
        fsutil.read_bytes(tmp_path / "missing")


# ---------------------------------------------------------------------------------------------- the files


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", ["receipt", "sig"])
def test_gate_check_receipt_on_a_special_receipt_or_sig(tmp_path, kind, which):
    """``gate --check-receipt`` reads the receipt and its ``.sig`` (receipts.check): both are refused
    unread, the receipt is not trusted, and nothing hangs."""
    code = f"""
import os, json
from pathlib import Path
os.environ["IMAGEBUILD_STATE_DIR"] = {str(tmp_path / "state")!r}
os.environ["IMAGEBUILD_ALLOWED_SIGNERS"] = "none"
from imagebuild.core import identity
from imagebuild.gate import receipts, signing
from tests.unit.gate.test_receipt_trust import PASSING, SPEC, _doc, _inspect
from tests.unit.core.test_corpus_special_files import _special
spec = Path({str(tmp_path / "gate.yaml")!r}); spec.write_text(SPEC)
sd = "sha256:" + __import__("hashlib").sha256(SPEC.encode()).hexdigest()
root = Path({str(tmp_path)!r})
a = identity.from_inspect(_inspect("a"))
receipts.write(root, _doc(a, sd, PASSING))
path = receipts.receipt_path(root, a.digest, sd)
target = path if {which!r} == "receipt" else Path(str(path) + signing.SIG_SUFFIX)
_special(target, {kind!r})
v = receipts.check(root, a.digest, sd, spec=spec)
print(json.dumps({{"trusted": v.trusted, "reason": v.reason, "sig": signing.read_sig(path),
                  "read": receipts.read(root, a.digest, sd) is not None,
                  "listed": len(receipts.for_identity(root, a.digest))}}))
"""
    r = _child(code)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    if which == "receipt":
        assert not got["trusted"] and got["read"] is False and got["listed"] == 0, got
    else:  # the receipt itself is sound; its .sig is there but no signature (not read)
        assert got["sig"] == "not a signature", got


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("flag", [["--history"], ["--html"], ["--history", "--json"]])
def test_report_history_and_html_on_a_special_history_file(project, tmp_path, kind, flag):
    state = tmp_path / "state"
    _special(state / "nightly-history.jsonl", kind)
    r = _cli("--root", str(project), "report", *flag, env={"IMAGEBUILD_STATE_DIR": str(state)})
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr[-2000:]
    assert r.returncode in (0, 1, 2), (r.returncode, r.stderr[-2000:])


@pytest.mark.parametrize("kind", KINDS)
def test_a_special_gc_owners_file_claims_nothing_and_is_not_read(tmp_path, kind):
    store = tmp_path / "stages" / "img"
    (store / "owners").mkdir(parents=True)
    (store / "owners" / "good.json").write_text(json.dumps(
        {"schema": "imagebuild.store-owner", "version": 1, "root": str(tmp_path), "builds": {"b1": ["k"]}}))
    _special(store / "owners" / "bad.json", kind)
    r = _child(f"from imagebuild.buildstep import owners; print([c.root for c in owners.claims({str(store)!r})])")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == repr([str(tmp_path)])


@pytest.mark.parametrize("kind", KINDS)
def test_a_special_run_record_or_lock_is_not_read(project, tmp_path, kind):
    """The definition's lock (``plan``, ``build``) and a run record (``log``, ``history``) the same way."""
    lock = next(project.glob("docker-images/*/lock.json"), None)
    if lock is None:
        lock = next(p for p in project.glob("docker-images/*") if p.is_dir()) / "lock.json"
    _special(lock, kind)
    r = _cli("--root", str(project), "plan", lock.parent.name, env={"IMAGEBUILD_STATE_DIR": str(tmp_path / "s")})
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr[-2000:]
    assert r.returncode != 0 and "not a regular file" in r.stderr, r.stderr[-2000:]
    rec = tmp_path / "run" / "record.json"
    _special(rec, kind)
    r = _child(f"from imagebuild.core import runs; from pathlib import Path; print(runs._read(Path({str(rec.parent)!r})))")
    assert r.returncode == 0 and r.stdout.strip() == "{}", (r.stdout, r.stderr[-2000:])


# ------------------------------------------------------------------------------- round three, second pass
# files read outside the state folder: the machine's cargo and docker configuration, a directory
# source's checksum record, a stage log's tail, a definition's gate spec


@pytest.mark.parametrize("kind", KINDS)
def test_a_special_cargo_config_is_named_not_read(tmp_path, kind):
    cfg = _special(tmp_path / "config.toml", kind)
    r = _child("from imagebuild.fetch import crates\n"
               "try:\n    crates.registry_for(crates.CRATES_IO_SOURCE)\n"
               "except crates.OperationFailed as exc:\n    print(exc.message)", {"IMAGEBUILD_CARGO_CONFIG": str(cfg)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert str(cfg) in r.stdout and "not a regular file" in r.stdout, r.stdout


@pytest.mark.parametrize("kind", KINDS)
def test_a_special_docker_config_does_not_hold_the_engine_query(tmp_path, kind):
    _special(tmp_path / "config.json", kind)
    r = _child("from imagebuild.core import engine; print(engine.local_socket())",
               {"DOCKER_CONFIG": str(tmp_path), "DOCKER_HOST": "", "DOCKER_CONTEXT": "default"})
    assert r.returncode == 0 and r.stdout.strip() == "/var/run/docker.sock", (r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize("kind", KINDS)
def test_a_special_stage_log_has_no_tail(tmp_path, kind):
    log = _special(tmp_path / "logs" / "app.log", kind)
    r = _child(f"from imagebuild.buildstep import buildlog; print(buildlog.read_end({str(log)!r}))")
    assert r.returncode == 0 and r.stdout.strip() == "None", (r.stdout, r.stderr[-2000:])


def test_a_special_directory_source_checksum_is_no_record(tmp_path):
    """A FIFO where a vendored directory source keeps ``.cargo-checksum.json``: read as no record."""
    src = tmp_path / "vendor" / "foo-1.0.0"
    src.mkdir(parents=True)
    (src / "Cargo.toml").write_text('[package]\nname = "foo"\nversion = "1.0.0"\n')
    _special(src / ".cargo-checksum.json", "fifo")
    cfg = tmp_path / "config.toml"
    cfg.write_text('[source.crates-io]\nreplace-with = "v"\n[source.v]\ndirectory = "%s"\n' % (tmp_path / "vendor"))
    c = ("crates.Crate('foo', '1.0.0', crates.CRATES_IO_SOURCE, 'ab' * 32, 'Cargo.lock')")
    r = _child("from imagebuild.fetch import crates; from pathlib import Path\n"
               f"crates._registry_crate({c}, Path({str(tmp_path / 'out')!r}), Path({str(tmp_path / 'cache')!r}), "
               "True, None, 'src')\n"
               f"print(sorted(p.name for p in Path({str(tmp_path / 'out' / 'foo-1.0.0')!r}).iterdir()))",
               {"IMAGEBUILD_CARGO_CONFIG": str(cfg)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "['.cargo-checksum.json', 'Cargo.toml']", r.stdout


def test_a_special_gate_spec_is_named_for_what_it_is(tmp_path):
    import shutil

    project = tmp_path / "project"
    shutil.copytree(REPO / "docker-images" / "example", project / "docker-images" / "example")
    _special(project / "docker-images" / "example" / "gate.yaml", "fifo")
    r = _cli("--root", str(project), "validate", "example", env={"IMAGEBUILD_STATE_DIR": str(tmp_path / "s")})
    assert r.returncode != 0 and "is a FIFO, expected a gate spec file" in r.stderr, r.stderr[-2000:]
