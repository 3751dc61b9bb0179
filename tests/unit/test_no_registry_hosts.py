"""No package-registry or mirror host name is written in the project's files (issue 9, section 8):
index and mirror defaults come from the machine's own configuration. The hosts are read from this
machine (apt's sources, `pip config list`, pip's own default index), never listed here."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTBED = REPO / "scripts" / "testbed.sh"
_URL_HOST = re.compile(r"[a-z][a-z0-9+.-]*://(?:[^@/\s\]'\"]*@)?([^/:\s\]'\"]+)", re.I)
_LOOPBACK = {"localhost", "127.0.0.1", "::1", ""}


def _hosts_in(text: str) -> set[str]:
    return {m.group(1).lower() for m in _URL_HOST.finditer(text)} - _LOOPBACK


def apt_hosts() -> set[str]:
    """Hosts of the URIs apt uses here (deb822 `URIs:` and one-line `deb` entries; not comments)."""
    files = sorted(Path("/etc/apt/sources.list.d").glob("*.sources")) + \
        sorted(Path("/etc/apt/sources.list.d").glob("*.list")) + [Path("/etc/apt/sources.list")]
    hosts: set[str] = set()
    for f in files:
        if not f.is_file():
            continue
        for line in f.read_text(errors="replace").splitlines():
            line = line.split("#", 1)[0].strip()
            if line.lower().startswith(("uris:", "deb ", "deb-src ")):
                hosts |= _hosts_in(line)
    return hosts


def pip_hosts() -> set[str]:
    """Hosts of every URL in pip's configuration here, plus pip's own default index."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    hosts = _hosts_in(out)
    for line in out.splitlines():  # trusted-host values are bare host names
        key, _, value = line.partition("=")
        if key.endswith("trusted-host"):
            hosts |= {h.split(":")[0].lower() for h in value.strip("'\" ").split()}
    help_text = subprocess.run([sys.executable, "-m", "pip", "download", "--help", "--isolated"],
                               capture_output=True, text=True).stdout
    m = re.search(r"\(default\s+(\S+?)\)", " ".join(help_text.split()))
    if m:
        hosts |= _hosts_in(m.group(1))
    return hosts - _LOOPBACK


def _tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: no list of tracked files")
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
    return [REPO / p for p in out.decode().split("\0") if p]


def test_no_configured_mirror_or_registry_host_in_tracked_files():
    hosts = apt_hosts() | pip_hosts()
    if not hosts:
        pytest.skip("this machine configures no apt or pip host to look for")
    found = []
    for path in _tracked_files():
        if not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", "replace").lower()
        for host in hosts:
            if host in text:
                line = text[:text.index(host)].count("\n") + 1
                found.append(f"{path.relative_to(REPO)}:{line}: {host}")
    assert not found, "registry/mirror host names written in the project (read them from the machine's " \
        "configuration instead):\n" + "\n".join(found)


# ----------------------------------------------------------------------------- the test bed's mirror


def _mirror(tmp_path, env: dict | None = None, sources: dict | None = None, sources_list: str | None = None):
    parts = tmp_path / "sources.list.d"
    parts.mkdir(exist_ok=True)
    for name, text in (sources or {}).items():
        (parts / name).write_text(text)
    lst = tmp_path / "sources.list"
    if sources_list is not None:
        lst.write_text(sources_list)
    e = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "IMAGEBUILD_APT_SOURCE_PARTS": str(parts), "IMAGEBUILD_APT_SOURCE_LIST": str(lst),
         **(env or {})}
    return subprocess.run(["bash", str(TESTBED), "--print-mirror"], capture_output=True, text=True, env=e)


def test_testbed_reads_the_mirror_from_deb822_sources(tmp_path):
    r = _mirror(tmp_path, sources={"debian.sources": (
        "Types: deb\n# http://comment.example/ignored\nURIs: http://sec.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n\n"
        "Types: deb\nURIs: http://main.example/debian/\nSuites: bookworm bookworm-updates\nComponents: main\n")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "http://main.example/debian"


def test_testbed_reads_the_mirror_from_sources_list(tmp_path):
    r = _mirror(tmp_path, sources_list=(
        "# deb http://old.example/debian bookworm main\n"
        "deb [signed-by=/k.gpg arch=amd64] http://sec.example/debian-security bookworm-security main\n"
        "deb [signed-by=/k.gpg] http://main.example/debian bookworm main\n"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "http://main.example/debian"


def test_testbed_mirror_override_and_none(tmp_path):
    r = _mirror(tmp_path, env={"IMAGEBUILD_DEBIAN_MIRROR": "http://mine.example/debian/"})
    assert r.stdout.strip() == "http://mine.example/debian"
    r = _mirror(tmp_path)
    assert r.returncode == 1 and "no Debian mirror in apt's sources" in r.stderr


def test_testbed_uses_this_machines_mirror():
    if not apt_hosts():
        pytest.skip("apt has no sources here")
    r = subprocess.run(["bash", str(TESTBED), "--print-mirror"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert _hosts_in(r.stdout) <= apt_hosts()
