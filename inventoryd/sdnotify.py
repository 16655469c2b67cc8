"""systemd's notify protocol (sd_notify(3)), without libsystemd.

A ``Type=notify`` service sends newline-separated ``KEY=VALUE`` lines as one datagram to
the ``AF_UNIX`` socket named by ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the
abstract namespace). ``WatchdogSec=`` sets ``$WATCHDOG_USEC`` (and ``$WATCHDOG_PID``);
the service must send ``WATCHDOG=1`` more often than that. Outside systemd nothing is
set and every call is a no-op, so the daemon runs the same in a terminal.

:meth:`Notifier.keepalive` is the ping of a long piece of work that checks in often (the
services' "stop now?", asked in every loop of an image being read): one ``WATCHDOG=1``
per quarter of the timeout however often it is called. Work that stops checking in (a
loop with no deadline) sends nothing, and systemd's watchdog still ends it.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Mapping


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        self.address: str | None = None
        if raw.startswith("@"):
            self.address = "\0" + raw[1:]
        elif raw.startswith("/"):
            self.address = raw
        self.watchdog_s: float | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6
        self.last_error: str | None = None
        self.pinged_at = -math.inf  # time.monotonic() of the last WATCHDOG=1 sent

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def ping_interval(self) -> float | None:
        """How often to send WATCHDOG=1: half the watchdog timeout, as systemd advises."""
        return None if self.watchdog_s is None else self.watchdog_s / 2

    def send(self, *lines: str) -> bool:
        """Send one datagram. False (and ``last_error`` set) when it could not be sent."""
        if self.address is None:
            return False
        data = "\n".join(lines).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                # never block: a listener that stopped reading must not stall the daemon
                s.setblocking(False)
                s.sendto(data, self.address)
        except OSError as e:
            self.last_error = f"{self.address.lstrip(chr(0))}: {e.strerror or e}"
            return False
        return True

    def ready(self, status: str = "") -> bool:
        extra = [f"STATUS={status}"] if status else []
        return self.send("READY=1", f"MAINPID={os.getpid()}", *extra)

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def watchdog(self) -> bool:
        if self.watchdog_s is None:
            return False
        self.pinged_at = time.monotonic()
        return self.send("WATCHDOG=1")

    def keepalive(self) -> bool:
        """``WATCHDOG=1`` when a quarter of the watchdog timeout has passed since the last
        one (half of :meth:`ping_interval`: what is left covers the time between two
        calls), else nothing: for work that calls it at every step, thousands of times a
        second. True when it sent one."""
        interval = self.ping_interval()
        if interval is None or time.monotonic() - self.pinged_at < interval / 2:
            return False
        return self.watchdog()

    def reloading(self) -> bool:
        return self.send("RELOADING=1")

    def stopping(self) -> bool:
        return self.send("STOPPING=1")
