"""systemd's side of the notify protocol, for the services' tests."""

from __future__ import annotations

import socket
import threading
import time

from helpers.wait import wait_until

__all__ = ["Listener"]


class Listener:
    """A real AF_UNIX datagram socket, drained by a thread as systemd's manager would."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(addr)
        self.sock.settimeout(0.1)
        self.messages: list[str] = []
        self.stamped: list[tuple[float, str]] = []  # (time.monotonic() when read, message)
        self.closed = False
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while not self.closed:
            try:
                msg = self.sock.recv(4096).decode()
            except (TimeoutError, OSError):
                continue
            self.stamped.append((time.monotonic(), msg))
            self.messages.append(msg)

    def wait_for(self, line: str, timeout: float = 10) -> None:
        wait_until(lambda: any(line in m.split("\n") for m in list(self.messages)), timeout,
                   f"{line!r} on the notify socket", interval=0.02,
                   detail=lambda: f"got {self.messages[-20:]!r}")

    def close(self) -> None:
        self.closed = True
        self.thread.join(2)
        self.sock.close()
