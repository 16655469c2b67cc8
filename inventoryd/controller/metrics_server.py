"""The collector's metrics endpoint: a small HTTP/1.0-style server that no client can use
to hurt the collector (issue 25, docs/metrics.md).

One thread of its own, apart from the scan loop, serves every connection from one
``selectors`` loop (epoll), so that:

- **connections are bounded**: at most ``max_connections`` are open; a new one past the
  bound closes the oldest that has not yet sent its request (an idle or slow client),
  or, when all of them are being answered, is closed at once. Threads: one, whatever
  the load; descriptors: ``max_connections`` plus a few;
- **time is bounded**: a request must arrive whole within ``timeout_s`` of the
  connection, and its answer must be taken within ``timeout_s`` of the first byte sent;
  then the connection is closed. A request is at most :data:`MAX_REQUEST` bytes;
- **the scan loop never waits for a client**: the server's thread only reads sockets
  that are ready, writes what the kernel takes, and renders the metrics (the exporter
  reads the inventory at most every ``metrics_cache_s``; the scan loop, writing the
  textfile, may wait for that read to end, never for a socket).

``GET /metrics`` (and ``GET /``) answers the Prometheus text format, ``HEAD`` the same
headers, anything else 404 or 405; every answer closes the connection.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["MAX_REQUEST", "BoundedServer"]

log = logging.getLogger("ncclguard.collector")

MAX_REQUEST = 8192  # bytes of request line and headers
ACCEPTS_PER_TURN = 256  # new connections taken per loop turn, so that ready ones are served
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class _Conn:
    sock: socket.socket
    deadline: float
    inbuf: bytes = b""
    out: memoryview | None = None  # the answer, from the first byte not yet sent


class BoundedServer:
    """Serve ``render()`` (the metrics text) on ``address:port`` until :meth:`close`."""

    def __init__(self, address: str, port: int, render: Callable[[], bytes], *,
                 max_connections: int = 64, timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.listener = socket.create_server((address, port), family=family, backlog=128)
        self.listener.setblocking(False)
        self.port = int(self.listener.getsockname()[1])
        self.render = render
        self.max_connections = max(1, max_connections)
        self.timeout_s = timeout_s
        self.clock = clock
        self.conns: dict[socket.socket, _Conn] = {}  # in the order they were accepted
        self.counts = {"accepted": 0, "served": 0, "evicted": 0, "refused": 0, "timed_out": 0}
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.listener, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="metrics-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=10)
        for c in list(self.conns.values()):
            self._drop(c)
        self._sel.close()
        for s in (self.listener, self._wake_r, self._wake_w):
            s.close()

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while not self._stop:
            now = self.clock()
            nearest = min((c.deadline for c in self.conns.values()), default=now + 1.0)
            try:
                events = self._sel.select(max(0.0, min(nearest - now, 1.0)))
            except OSError:  # pragma: no cover - select itself failing: try again
                time.sleep(0.1)
                continue
            for key, mask in events:
                sock = key.fileobj
                try:
                    if sock is self.listener:
                        self._accept()
                    elif sock is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    else:
                        c = self.conns.get(sock)  # type: ignore[call-overload]
                        if c is not None:
                            self._read(c) if mask & selectors.EVENT_READ else self._write(c)
                except Exception:  # one connection's failure is that connection's
                    log.exception("metrics: serving a connection failed")
                    c = self.conns.get(sock)  # type: ignore[call-overload]
                    if c is not None:
                        self._drop(c)
            now = self.clock()
            for c in [c for c in self.conns.values() if c.deadline <= now]:
                self.counts["timed_out"] += 1
                self._drop(c)

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, _addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: what is open is served first
                log.warning("metrics: cannot accept a connection: %s", e.strerror or e)
                return
            self.counts["accepted"] += 1
            if len(self.conns) >= self.max_connections:
                idle = next((c for c in self.conns.values() if c.out is None), None)
                if idle is None:  # every one is being answered: this one waits its turn
                    self.counts["refused"] += 1
                    sock.close()
                    continue
                self.counts["evicted"] += 1
                self._drop(idle)
            sock.setblocking(False)
            c = _Conn(sock, self.clock() + self.timeout_s)
            self.conns[sock] = c
            self._sel.register(sock, selectors.EVENT_READ)

    def _read(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(c)
            return
        if not data:
            self._drop(c)
            return
        c.inbuf += data
        end = c.inbuf.find(b"\r\n\r\n")
        if end < 0:
            end = c.inbuf.find(b"\n\n")
        if end < 0:
            if len(c.inbuf) > MAX_REQUEST:
                self._answer(c, 431, b"request too large\n")
            return
        self._answer(c, *self._handle(c.inbuf[:end]))

    def _handle(self, head: bytes) -> tuple[int, bytes, bool]:
        line = head.split(b"\n", 1)[0].strip().split()
        if len(line) < 2:
            return 400, b"bad request\n", True
        method, target = line[0], line[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return 405, b"only GET and HEAD\n", True
        if target not in (b"/metrics", b"/"):
            return 404, b"see /metrics\n", method == b"GET"
        return 200, self.render(), method == b"GET"

    def _answer(self, c: _Conn, status: int, body: bytes, with_body: bool = True) -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found",
                  405: "Method Not Allowed", 431: "Request Header Fields Too Large"}[status]
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: "
                f"{CONTENT_TYPE if status == 200 else 'text/plain'}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        c.out = memoryview(head + body if with_body else head)
        c.inbuf = b""
        c.deadline = self.clock() + self.timeout_s  # to take the answer
        self._sel.modify(c.sock, selectors.EVENT_WRITE)
        self.counts["served"] += status == 200
        self._write(c)

    def _write(self, c: _Conn) -> None:
        assert c.out is not None
        try:
            n = c.sock.send(c.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(c)
            return
        c.out = c.out[n:]
        if not c.out:
            with contextlib.suppress(OSError):
                c.sock.shutdown(socket.SHUT_WR)
            self._drop(c)

    def _drop(self, c: _Conn) -> None:
        self.conns.pop(c.sock, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(c.sock)
        with contextlib.suppress(OSError):
            c.sock.close()
