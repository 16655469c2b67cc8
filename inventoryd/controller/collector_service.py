"""``ncclguard-inventoryd collect``, the collector's service: a scan of
:class:`~inventoryd.controller.collector.Collector` every ``scan_interval_s`` in the one
service loop (:func:`inventoryd.loop.serve`: reload, watchdog, failures logged once), and
after each scan its counters to the cluster's metrics (:mod:`.exporter`), served on the
bounded endpoint and/or written to the textfile. ``collect --once``: one scan."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from inventoryd.controller.collector import Collector, ScanResult
from inventoryd.loop import Outcome, log_to_stderr, serve
from inventoryd.sdnotify import Notifier
from ncclguard import config as configmod
from ncclguard.store import InventoryError

if TYPE_CHECKING:
    from inventoryd.controller.exporter import Served

__all__ = ["CollectorService", "collect_once", "run"]

log = logging.getLogger("ncclguard.collector")


def collect_once(config: configmod.Config, db: Path | None = None,
                 progress: Callable[[str], None] | None = None) -> ScanResult:
    """One scan (``collect --once``): the demo, tests, a cron-style deployment.
    ``progress``: told how far the scan is (the command's progress line on a terminal)."""
    log_to_stderr(log)
    c = Collector(config, db=db, registry_thread=False)
    try:
        if c.registry is not None:  # one pass of the registry index, written by the scan
            if progress is not None:
                progress("registry: one pass")
            c.registry.run_pass()
        c.jobenvs.run_pass()  # the job environments in the trail, written by the scan
        return c.scan(progress=progress)
    finally:
        c.close()


def run(
    config_path: str | None,
    config: configmod.Config,
    *,
    db: Path | None = None,
    notifier: Notifier | None = None,
    max_scans: int | None = None,
) -> int:
    """The collector's service (:func:`inventoryd.loop.serve`): a scan every
    ``scan_interval_s`` until SIGTERM/SIGINT. 1 when it cannot start."""
    log_to_stderr(log)
    try:
        service = CollectorService(config, db)
    except (InventoryError, configmod.ConfigError) as e:
        log.error("collector cannot start: %s", e)
        return 1
    return serve(service, log, config_path=config_path, notifier=notifier,
                 max_steps=max_scans, reload_errors=(InventoryError,))


class CollectorService:
    """The collector under one config, with its metrics (:class:`inventoryd.loop.Service`)."""

    label = "collector"
    what = "scan"

    def __init__(self, config: configmod.Config, db: Path | None) -> None:
        self.db = db
        self.collector = Collector(config, db=db)
        self.served = _metrics(self.collector)
        self.serve_metrics = False  # after a reload: once the old one has let the port go
        self.scans = 0

    def started(self) -> str:
        c = self.collector
        return (f"config {c.cfg.source}, spool {c.spool}, inventory {c.inv.path}, "
                f"publisher uid {c.uid}")

    def step(self, should_stop: Callable[[], bool]) -> Outcome:
        if self.serve_metrics:
            self.serve_metrics, self.served = False, _metrics(self.collector)
        self.scans += 1
        try:
            res = self.collector.scan(should_stop)
        except Exception:
            if self.served is not None:  # the metrics say the scan failed
                _report(self.served, self.collector, ScanResult(), self.scans)
            raise
        if self.served is not None:
            _report(self.served, self.collector, res, self.scans)
        return Outcome(status=f"{len(res.accepted)} accepted, {len(res.rejected)} rejected "
                              f"in {res.seconds:.2f}s" if res.accepted or res.rejected
                       else None)

    def delay(self, ok: bool) -> float:
        return self.collector.cfg.collector.scan_interval_s

    def reloaded(self, config: configmod.Config) -> CollectorService:
        new = CollectorService.__new__(CollectorService)
        new.db, new.scans = self.db, self.scans
        new.collector = Collector(config, db=self.db)
        new.collector.image_time = self.collector.image_time  # who used the image passes
        new.served, new.serve_metrics = None, True  # the old one closes first: its port
        return new

    def close(self, *, replaced: bool = False) -> None:
        if self.served is not None:
            self.served.close()
        self.collector.close(leave_wal=replaced)


# -------------------------------------------------------------------- the metrics


def _metrics(collector: Collector) -> Served | None:
    """The cluster's metrics (inventoryd/controller/exporter.py), when ``[collector] metrics_port``
    or ``textfile_dir`` asks for them. A port that cannot be bound is logged, and the
    collector runs on without its endpoint: it is the inventory's one writer."""
    c = collector.cfg.collector
    if not (c.metrics_port or c.textfile_dir):
        return None
    from inventoryd.controller.exporter import Served, from_config

    exporter = from_config(collector.cfg, collector.inv.path)
    try:
        return Served(exporter, address=c.metrics_address, port=c.metrics_port,
                      textfile_dir=c.textfile_dir, max_connections=c.metrics_max_connections,
                      timeout_s=c.metrics_timeout_s)
    except OSError as e:
        log.error("metrics: cannot listen on %s:%d (%s); no HTTP endpoint",
                  c.metrics_address, c.metrics_port, e.strerror or e)
        return Served(exporter, textfile_dir=c.textfile_dir) if c.textfile_dir else None


def _report(served: Served, collector: Collector, res: ScanResult, scans: int) -> None:
    """After each scan: the collector's counters to the exporter; the textfile."""
    from inventoryd.controller.exporter import ScanStats

    served.exporter.scanned(ScanStats(
        counts=dict(collector.counts), files=res.files, seconds=res.seconds,
        deferred=res.deferred, spool_ok=collector.spool_state == "ok", scans=scans,
        last_scan=time.time(), postponed=res.postponed, unwritten=res.unwritten,
        pressure=collector.pressure is not None,
        writable=collector.disk.write_failure is None, free_bytes=collector.disk.free_bytes,
        containers={"accepted": collector.containers.accepted, **collector.containers.counts},
        mixed_found=collector.runtime.found, mixed_actions=dict(collector.runtime.acted)))
    try:
        path = served.write_textfile()
    except OSError as e:
        served.write_log.failed(served.textfile_dir, e)
    else:
        if path is not None:
            served.write_log.written(path)
