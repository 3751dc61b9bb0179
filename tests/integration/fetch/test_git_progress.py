"""A long git fetch shows life (issue 23, section 1): a heartbeat names the source, the time and
git's own progress (objects and bytes received), and a silent attempt ends at its timeout. A real
``git daemon`` behind a real TCP relay that sends slowly, or not at all."""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time

import pytest

from imagebuild.fetch import gitcache
from tests.gitfixtures import DropProxy, UpstreamFactory, git_daemon, git_root  # noqa: F401


class SlowRelay:
    """A TCP relay to ``port`` that sends the server's bytes at about ``rate`` bytes a second."""

    def __init__(self, port: int, rate: int):
        self.port_to, self.rate = port, rate
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, path: str) -> str:
        return f"git://127.0.0.1:{self.port}/{path}"

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                client, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.port_to))
            threading.Thread(target=self._pump, args=(client, up, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, client, self.rate), daemon=True).start()

    def _pump(self, src, dst, rate) -> None:
        try:
            while data := src.recv(4096 if rate else 65536):
                dst.sendall(data)
                if rate:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.fixture
def big(git_daemon, tmp_path):  # noqa: F811
    """A repository of 600 kB that does not compress, in 300 files (a pack git indexes as it comes)."""
    factory = UpstreamFactory(git_daemon.base / f"progress-{os.getpid()}-{time.monotonic_ns()}", git_daemon)
    return factory.create("big", {f"blobs/{i:03d}.bin": os.urandom(2_000) for i in range(300)})


def _records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "imagebuild"]


def test_a_slow_fetch_beats_with_the_bytes_received(big, git_daemon, tmp_path, monkeypatch, caplog):  # noqa: F811
    monkeypatch.setenv("IMAGEBUILD_HEARTBEAT_S", "0.5")
    relay = SlowRelay(git_daemon.port, rate=150_000)  # about 4 s for the pack
    try:
        url = relay.url(big.bare.relative_to(git_daemon.base).as_posix())
        cache = gitcache.Cache(tmp_path / "cache", policy=gitcache.RetryPolicy(attempts=1, timeout=120))
        with caplog.at_level(logging.INFO, logger="imagebuild"):
            cache.mirror(url).fetch([big.head()], "BIG")
    finally:
        relay.close()
    assert cache.mirror(url).missing([big.head()]) == []
    beats = [m for m in _records(caplog) if "BIG: still fetching from" in m]
    assert len(beats) >= 3, _records(caplog)
    assert all(url in b for b in beats)
    # git's own meter, with the bytes received: "Receiving objects:  40% (1/3), 236.00 KiB | 117.00 KiB/s"
    got = [re.search(r"(?:Receiving|Unpacking) objects: +(\d+)% .*?([\d.]+) (KiB|MiB)", b) for b in beats]
    got = [m for m in got if m]
    assert got, beats
    assert int(got[0].group(1)) <= int(got[-1].group(1))


def test_a_silent_fetch_says_so_and_ends_at_its_timeout(big, git_daemon, tmp_path, monkeypatch, caplog):  # noqa: F811
    monkeypatch.setenv("IMAGEBUILD_HEARTBEAT_S", "0.5")
    with DropProxy(git_daemon.port, stall_rate=1.0, stall_s=60) as proxy:
        url = proxy.url(big.bare.relative_to(git_daemon.base).as_posix())
        cache = gitcache.Cache(tmp_path / "cache", policy=gitcache.RetryPolicy(attempts=1, timeout=3))
        t0 = time.monotonic()
        with caplog.at_level(logging.INFO, logger="imagebuild"), pytest.raises(gitcache.RemoteUnreachable) as exc:
            cache.mirror(url).fetch([big.head()], "BIG")
        took = time.monotonic() - t0
    assert took < 20
    assert "timed out after 3 s" in exc.value.message
    beats = [m for m in _records(caplog) if "BIG: still fetching from" in m]
    assert beats and all("nothing received yet" in b for b in beats), _records(caplog)
