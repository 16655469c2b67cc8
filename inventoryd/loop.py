"""What the three services share (``run`` on each node; ``collect`` and ``features`` on the
controller): :func:`serve`, the one loop that runs each (reload, the watchdog, failures
logged once, the sleep); the log on stderr (journald keeps a unit's stderr), escaped; the
signals: SIGTERM/SIGINT ask to stop, SIGHUP to reload, and each ends a sleep at once (a
wakeup fd), while the sleep pets systemd's watchdog, and so does a step each time it
asks whether to stop (its loops' check-in, rate-limited); :class:`WriteLog`, a
textfile's failures logged once."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from inventoryd.sdnotify import Notifier

if TYPE_CHECKING:
    from ncclguard.config import Config

__all__ = ["Outcome", "SafeFormatter", "Service", "Signals", "WriteLog", "log_to_stderr", "serve"]


class SafeFormatter(logging.Formatter):
    """``LEVEL message``, one line per record whatever its arguments hold: the message
    goes through :func:`ncclguard.text.safe` (a node's value, a file name or a record's
    detail cannot start a line that looks like one of ours in the journal), and each
    line of a traceback is indented under it."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        from ncclguard.text import safe

        record.message = safe(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        from ncclguard.text import safe

        return "\n".join(f"  | {safe(line)}"
                         for line in super().formatException(ei).splitlines())


def log_to_stderr(log: logging.Logger) -> None:
    """``LEVEL message`` lines on stderr for ``log`` (once per process), escaped
    (:class:`SafeFormatter`)."""
    if log.handlers:
        return
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(SafeFormatter("%(levelname)s %(message)s"))
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


class WriteLog:
    """The log of a textfile written every cycle: one line when writing starts failing
    (and one per new cause), one when it works again, nothing while it stays as it was.
    Shared by the node daemon and the collector."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.cause: str | None = None  # why the last write failed; None: it worked

    def failed(self, directory: Path | str, e: OSError, who: str = "") -> None:
        cause = e.strerror or str(e)
        if cause != self.cause:
            self.log.error("%scannot write metrics to %s: %s", who, directory, cause)
            self.cause = cause

    def written(self, path: Path | str, who: str = "") -> None:
        if self.cause is not None:
            self.log.info("%smetrics written to %s again", who, path)
            self.cause = None


# ------------------------------------------------------------------- the one service loop


@dataclass(frozen=True)
class Outcome:
    """What one step of a service says: whether its work is current (a step that is not
    may be tried again sooner: :meth:`Service.delay`), a line for systemd's ``STATUS=``
    (sent when it changes), and a line for the log (INFO)."""

    ok: bool = True
    status: str | None = None
    note: str | None = None


class Service(Protocol):
    """One service's state under one config: what :func:`serve` runs."""

    @property
    def label(self) -> str:
        """The log's subject: ``"collector"``, ``"features"``, ``"n7:"`` (a node)."""
        ...

    @property
    def what(self) -> str:
        """What a step does, for its log-once failure line: ``"scan"``, ``"collection"``."""
        ...

    def started(self) -> str:
        """The log's start line (after ``label``): the config, the paths."""
        ...

    def step(self, should_stop: Callable[[], bool]) -> Outcome:
        """One pass of the work. An exception is a failed step: logged once per cause and
        tried again after ``delay(False)``; it never stops the service."""
        ...

    def delay(self, ok: bool) -> float:
        """Seconds until the next step."""
        ...

    def reloaded(self, config: Config) -> Service:
        """This service under a new config (SIGHUP), carrying over what must survive.
        Raising leaves this one running."""
        ...

    def close(self, *, replaced: bool = False) -> None:
        """Give back what it holds (``replaced``: a reload, the new one runs on)."""
        ...


def serve(service: Service, log: logging.Logger, *, config_path: str | None,
          notifier: Notifier | None = None, max_steps: int | None = None,
          reload_errors: tuple[type[Exception], ...] = ()) -> int:
    """Run ``service`` until SIGTERM/SIGINT (or ``max_steps``): the one loop of the node
    daemon, the collector and the features daemon.

    It owns what they share: the signals (a SIGHUP reloads the config into a new service,
    ``RELOADING=1`` then ``READY=1``; a config that cannot be loaded leaves the old one
    running), the watchdog (petted after each step, through each sleep, and during a
    step each time it asks ``should_stop``, at most once per quarter of the timeout:
    :meth:`Notifier.keepalive`; a step that stops asking is ended by it), failures
    logged once per cause and once when the work recovers, ``STATUS=`` when it changes,
    and the sleep, which a signal ends at once. Returns 0."""
    from ncclguard.config import ConfigError
    from ncclguard.policy import load_config

    notifier = notifier or Notifier()
    not_loaded: tuple[type[Exception], ...] = (ConfigError, *reload_errors)
    with Signals() as sig:

        def should_stop() -> bool:
            # asked by the step in every loop of its work (the collector: between records,
            # in every loop of an image being read): work that checks in is alive, and
            # pets the watchdog. An image read up to its time limit (30 s, or more in a
            # site's config) had no WATCHDOG=1 until the scan ended (issue 48)
            notifier.keepalive()
            return sig.stop

        log.info("%s started (%s)", service.label, service.started())
        notifier.ready(f"{service.what} started")
        steps = 0
        failure: str | None = None
        last_status: str | None = None
        try:
            while not sig.stop:
                if sig.reload:
                    sig.reload = False
                    notifier.reloading()
                    try:  # the new one first: a config that fails leaves the old one working
                        config = load_config(config_path)
                        new = service.reloaded(config)
                    except not_loaded as e:
                        log.error("%s config not reloaded, keeping the previous one: %s",
                                  service.label, e)
                    else:
                        service.close(replaced=True)
                        service = new
                        log.info("%s config reloaded from %s", service.label, config.source)
                    notifier.ready("config reloaded")
                try:
                    out = service.step(should_stop)
                    now_failing = None
                except Exception as e:  # a failed step never stops the service
                    out = Outcome(ok=False)
                    now_failing = f"{type(e).__name__}: {e}"
                if now_failing != failure:
                    if now_failing:
                        log.error("%s %s failed, retrying: %s", service.label, service.what,
                                  now_failing)
                    else:
                        log.info("%s %s works again", service.label, service.what)
                    failure = now_failing
                if out.note:
                    log.info("%s %s", service.label, out.note)
                notifier.watchdog()
                if out.status is not None and out.status != last_status:
                    # only on a change: the manager's queue is short
                    last_status = out.status if notifier.status(out.status) else None
                steps += 1
                if sig.stop or (max_steps is not None and steps >= max_steps):
                    break
                sig.sleep(service.delay(out.ok), notifier)
        finally:
            service.close()
        notifier.stopping()
        log.info("%s stopped", service.label)
        return 0
