"""What the two services share, ``run`` (the node) and ``collect`` (the controller): the
log on stderr (journald keeps a unit's stderr), and the signals: SIGTERM/SIGINT ask to
stop, SIGHUP to reload, and each ends a sleep at once (a wakeup fd), while the sleep
pets systemd's watchdog."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import sys
import time
from types import FrameType, TracebackType

from inventoryd.sdnotify import Notifier

__all__ = ["Signals", "log_to_stderr"]


def log_to_stderr(log: logging.Logger) -> None:
    """``LEVEL message`` lines on stderr for ``log`` (once per process)."""
    if log.handlers:
        return
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log.addHandler(h)
    log.setLevel(logging.INFO)
    log.propagate = False


class Signals:
    """``with Signals() as s:`` installs the handlers for the block; ``s.stop`` and
    ``s.reload`` say what was asked (the loop clears ``reload`` when it has reloaded)."""

    def __init__(self) -> None:
        self.stop = False
        self.reload = False
        self._fds: tuple[int, int] | None = None
        self._old: dict[int, object] = {}
        self._old_fd = -1

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            self.reload = True
        else:
            self.stop = True

    def __enter__(self) -> Signals:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._fds = (r, w)
        self._old_fd = signal.set_wakeup_fd(w)
        self._old = {s: signal.signal(s, self.on_signal)
                     for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)  # type: ignore[arg-type]
        signal.set_wakeup_fd(self._old_fd)
        if self._fds:
            for fd in self._fds:
                os.close(fd)
        self._fds = None

    def sleep(self, seconds: float, notifier: Notifier) -> None:
        """Sleep, petting the watchdog, until the time is up or a signal arrives."""
        assert self._fds is not None, "sleep() inside the with block only"
        wake_fd = self._fds[0]
        end = time.monotonic() + seconds
        ping = notifier.ping_interval()
        while not (self.stop or self.reload):
            left = end - time.monotonic()
            if left <= 0:
                return
            ready, _, _ = select.select([wake_fd], [], [], min(left, ping) if ping else left)
            if ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_fd, 512)
            notifier.watchdog()
