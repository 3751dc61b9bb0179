"""A small loopback HTTP proxy in front of the real test registry (tests/fleetfixtures.py), for the
registry fault tests: it forwards every request as it is, and on demand cuts a connection part-way
through a blob, answers 500 to chosen requests, and counts the blob bytes it served."""

from __future__ import annotations

import http.client
import socket
import struct
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "te", "upgrade"}


class RegistryProxy:
    """``RegistryProxy(upstream_port)``: listens on 127.0.0.1:``port`` (plain HTTP, as the registry).

    - ``cut``: blob digests whose GET is cut half-way (headers with the full length, half the body,
      then a clean close, or a reset with ``cut_with = "reset"``);
    - ``fail``: ``fail(method, path)`` true -> 500 Internal Server Error, nothing forwarded;
    - ``blob_bytes``: body bytes of the blob GETs it served (``reset_counts`` zeroes it)."""

    def __init__(self, upstream_port: int):
        self.upstream = upstream_port
        self.cut: set[str] = set()
        self.cut_with = "eof"  # or "reset"
        self.fail: Callable[[str, str], bool] | None = None
        self.blob_bytes = 0
        self.blob_gets: list[tuple[str, int]] = []
        self.failed: list[str] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def handle_one_request(self):
                # a TLS hello (an engine tries https first): answer in plain HTTP, as a Go server does, so
                # that the client falls back to plain HTTP for this loopback registry
                try:
                    first = self.connection.recv(1, socket.MSG_PEEK)
                except OSError:
                    first = b""
                if first == b"\x16":
                    self.connection.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS "
                                            b"server.\n")
                    self.close_connection = True
                    return
                super().handle_one_request()

            def _body(self) -> bytes | None:
                if (self.headers.get("Transfer-Encoding") or "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else None

            def _forward(self) -> None:
                method, path = self.command, self.path
                body = self._body()
                if proxy.fail is not None and proxy.fail(method, path):
                    with proxy._lock:
                        proxy.failed.append(f"{method} {path}")
                    msg = b'{"errors":[{"code":"UNKNOWN","message":"test proxy: internal error"}]}'
                    self.send_response(500)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                up = http.client.HTTPConnection("127.0.0.1", proxy.upstream, timeout=300)
                headers = {k: ", ".join(self.headers.get_all(k)) for k in dict.fromkeys(self.headers.keys())
                           if k.lower() not in _HOP}  # repeated ones (Accept) joined
                if body is not None:
                    headers["Content-Length"] = str(len(body))
                up.request(method, path, body=body, headers=headers)
                resp = up.getresponse()
                data = resp.read()
                up.close()
                blob = "/blobs/sha256:" in path and method == "GET" and resp.status in (200, 206)
                digest = path.split("/blobs/", 1)[1].split("?", 1)[0] if blob else ""
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                if method == "HEAD":
                    cl = resp.getheader("Content-Length")
                    if cl is not None:
                        self.send_header("Content-Length", cl)
                    self.end_headers()
                    return
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if blob and digest in proxy.cut and len(data) > 1:
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    if proxy.cut_with == "reset":  # what a dropped link gives; "eof": a clean close (a short read)
                        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    else:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    self.connection.close()
                    return
                self.wfile.write(data)
                if blob:
                    with proxy._lock:
                        proxy.blob_bytes += len(data)
                        proxy.blob_gets.append((digest, len(data)))

            do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="registry-proxy")
        self.thread.start()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def reset_counts(self) -> None:
        with self._lock:
            self.blob_bytes = 0
            self.blob_gets = []

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
