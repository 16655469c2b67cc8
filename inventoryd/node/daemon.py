"""``ncclguard-inventoryd run``: keep this node's signed record in the spool current.

Each cycle collects the fingerprint, publishes it (:mod:`inventoryd.node.publish`: signed by
the local munged, written atomically to ``<spool>/<host>.rec``) when it changed, when
``heartbeat_s`` has passed or when the file is no longer the one it wrote, refreshes the
textfile metrics, and sleeps ``interval_s`` with jitter. The node never opens the
inventory: the collector on the controller is its one writer (docs/collector.md).
``SIGTERM``/``SIGINT`` stop it between two cycles; ``SIGHUP`` reloads the config. It
tells systemd when it is ready and pets the watchdog while it sleeps.

When the record cannot be published (a missing mount, a read-only or full filesystem,
munged down) it keeps collecting, logs once per change of state, and retries every cycle
(at most every ``RETRY_S``) until it succeeds.
"""

from __future__ import annotations

import contextlib
import logging
import random
import socket
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from inventoryd.loop import Outcome, log_to_stderr, serve
from inventoryd.node.publish import Publisher, PublishError, publish_state
from inventoryd.sdnotify import Notifier
from ncclguard import config as configmod
from ncclguard.policy.schedule import class_values
from ncclguard.store import Inventory, InventoryError
from ncclguard.text import safe

if TYPE_CHECKING:
    from inventoryd.loop import WriteLog

RETRY_S = 10.0  # after a failed publish, try again this soon (or at interval_s if shorter)
Collector = Callable[[str, str | None, configmod.InventorydConfig], Mapping[str, Any]]

log = logging.getLogger("ncclguard.inventoryd")


def _short_hostname() -> str:
    return socket.gethostname().split(".")[0]


def _host(fp: Mapping[str, Any], fallback: str) -> str:
    h = fp.get("host") if isinstance(fp, Mapping) else None
    name = h.get("hostname") if isinstance(h, dict) else None
    return name if isinstance(name, str) and name else fallback


def _inventory(cfg: configmod.Config) -> Inventory:
    return Inventory(
        config=cfg.inventory, values=class_values(cfg.policy),
        heartbeat_s=cfg.inventoryd.heartbeat_s
    )


def store_once(fp: Mapping[str, Any], cfg: configmod.Config) -> int:
    """Write one fingerprint straight into an inventory this process can write (``once
    --store``: tests, a single machine, seeding). 0 on success, 1 with a message otherwise.
    Nodes of a cluster publish instead (:func:`publish_once`)."""
    host = _host(fp, _short_hostname())
    try:
        with _inventory(cfg) as inv:
            status = inv.upsert(fp)
            where = inv.path
    except InventoryError as e:
        print(f"ncclguard-inventoryd: {safe(host)}: {safe(str(e))}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"ncclguard-inventoryd: {safe(host)}: not stored: {safe(str(e))}", file=sys.stderr)
        return 1
    print(f"ncclguard-inventoryd: {safe(host)}: {status} in {safe(str(where))}", file=sys.stderr)
    return 0


def _loaded(cfg: configmod.Config, host: str, said: dict[str, str | None] | None = None
            ) -> dict[str, Any] | None:
    """What the node's running job steps loaded (``[runtime] loaded_file``), for the
    record; None when not watched or not trusted (said once per cause in ``said``)."""
    path = cfg.runtime.loaded_file
    if not path:
        return None
    from inventoryd.node.jobmaps import read_loaded

    doc, why = read_loaded(path, host, cfg.runtime.max_age_s)
    if said is None or said.get("loaded") != why:
        if why is not None:
            log.error("%s: what running jobs loaded is not published: %s", host, safe(why))
        elif said is not None and said.get("loaded") is not None:
            log.info("%s: what running jobs loaded is published again", host)
        if said is not None:
            said["loaded"] = why
    return doc


def publish_once(fp: Mapping[str, Any], cfg: configmod.Config) -> int:
    """Sign and publish one fingerprint (``once --publish``). 0, or 1 with a message."""
    host = _host(fp, _short_hostname())
    try:
        path = Publisher(cfg.spool, cfg.inventoryd.heartbeat_s).publish(
            fp, loaded=_loaded(cfg, host))
    except (PublishError, ValueError) as e:
        print(f"ncclguard-inventoryd: {safe(host)}: not published: {safe(str(e))}", file=sys.stderr)
        return 1
    print(f"ncclguard-inventoryd: {safe(host)}: published {safe(str(path))}", file=sys.stderr)
    return 0


def _default_collector() -> Collector:
    from inventoryd.node.fingerprint import collect

    cache: Any = None
    with contextlib.suppress(Exception):
        from inventoryd.filecache import FileCache

        cache = FileCache.open  # opened per config, kept across cycles

    caches: dict[int, Any] = {}

    def run(
        root: str, hostname: str | None, config: configmod.InventorydConfig
    ) -> Mapping[str, Any]:
        c = None
        if cache is not None:
            c = caches.get(id(config))
            if c is None:
                caches.clear()
                c = caches[id(config)] = cache(config)
        return collect(root=root, hostname=hostname, config=config, cache=c)

    return run


class Daemon:
    """The node's service (:class:`inventoryd.loop.Service`) under one config: what was
    last published and written, run by :func:`inventoryd.loop.serve`."""

    what = "collection"

    def __init__(
        self,
        root: str,
        hostname: str | None,
        config: configmod.Config,
        collector: Collector,
        notifier: Notifier,
    ) -> None:
        self.root = root
        self.hostname = hostname
        self.cfg = config
        self.collect = collector
        self.notifier = notifier
        self.node = hostname or _short_hostname()
        self.publisher = Publisher(config.spool, config.inventoryd.heartbeat_s)
        self.publish_state: str | None = None  # "ok", or the class of the last failure
        self.metrics_log: WriteLog | None = None  # the textfile's failures, logged once
        self.last_change: float | None = None
        self.last_publish: float | None = None
        self.cycles = 0
        self.said: dict[str, str | None] = {}  # what was last logged of the loaded file

    @property
    def label(self) -> str:
        return f"{self.node}:"

    def started(self) -> str:
        return f"config {self.cfg.source}, spool {self.cfg.spool.spool_path()}"

    def reloaded(self, config: configmod.Config) -> Daemon:
        new = Daemon(self.root, self.hostname, config, self.collect, self.notifier)
        new.node = self.node
        if config.spool.spool_path() == self.cfg.spool.spool_path():
            new.publish_state = self.publish_state  # a new spool: its state afresh
        new.publisher.last_hash = self.publisher.last_hash  # published now, not a change
        new.metrics_log = self.metrics_log
        new.last_change, new.last_publish = self.last_change, self.last_publish
        new.cycles = self.cycles
        new.said = self.said
        return new

    def close(self, *, replaced: bool = False) -> None:
        pass  # the node holds nothing open between cycles

    # ---- one cycle

    def _set_publish_state(self, state: str, message: str, *, error: bool) -> None:
        if state != self.publish_state:
            (log.error if error else log.info)("%s: %s", self.node, message)
            self.publish_state = state

    def step(self, should_stop: Callable[[], bool] = lambda: False) -> Outcome:
        """Collect and publish once; ``ok`` when the published record is up to date. A
        collection that fails raises (the loop logs it once and tries again soon)."""
        from inventoryd.nodefs import progress

        self.cycles += 1
        token = progress.set(self.notifier.watchdog)  # a long read is progress, not a hang
        try:
            fp = self.collect(self.root, self.hostname, self.cfg.inventoryd)
        finally:
            progress.reset(token)
        self.node = _host(fp, self.node)
        ok = self._publish(fp, _loaded(self.cfg, self.node, self.said))
        self._metrics(fp)
        return Outcome(ok=ok, status=f"publishing {self.publish_state or 'unknown'}")

    def _publish(self, fp: Mapping[str, Any], loaded: Mapping[str, Any] | None = None) -> bool:
        now = time.time()

        if not self.publisher.due(fp, now, loaded):
            return True
        before = self.publisher.last_hash  # the stack: a change; the errors: shown only
        changed = before is None or before[:64] != publish_state(fp)[:64]
        try:
            path = self.publisher.publish(fp, now, loaded)
        except PublishError as e:
            self._set_publish_state(
                e.kind, f"record not published, collecting on and retrying: {e}", error=True
            )
            return False
        except ValueError as e:
            self._set_publish_state("invalid", f"fingerprint not published: {e}", error=True)
            return False
        self.last_publish = now
        left_out = self.publisher.loaded_left_out
        if self.said.get("left_out") != left_out:
            if left_out is not None:
                log.error("%s: record published without what running jobs loaded: %s",
                          self.node, left_out)
            self.said["left_out"] = left_out
        if changed:
            self.last_change = now
            log.info("%s: fingerprint published to %s", self.node, path)
        was = self.publish_state
        self._set_publish_state(
            "ok",
            f"publishing to {path} works again" if was not in (None, "ok")
            else f"publishing to {path}",
            error=False,
        )
        return True

    def _metrics(self, fp: Mapping[str, Any]) -> None:
        d = self.cfg.inventoryd.textfile_dir
        if not d:
            return
        from inventoryd.loop import WriteLog
        from inventoryd.node.textfile import write_textfile

        if self.metrics_log is None:
            self.metrics_log = WriteLog(log)
        try:
            path = write_textfile(d, fp, last_change=self.last_change,
                                  publish_ok=self.publish_state == "ok",
                                  last_publish=self.last_publish)
        except OSError as e:
            self.metrics_log.failed(d, e, f"{self.node}: ")
        else:
            self.metrics_log.written(path, f"{self.node}: ")

    def delay(self, ok: bool) -> float:
        c = self.cfg.inventoryd
        d = c.interval_s * (1 + random.uniform(-c.jitter, c.jitter))
        return d if ok else min(d, RETRY_S)


def run(
    root: str,
    hostname: str | None,
    config_path: str | None,
    config: configmod.Config,
    *,
    collector: Collector | None = None,
    notifier: Notifier | None = None,
    max_cycles: int | None = None,
) -> int:
    """The node's service (:func:`inventoryd.loop.serve`). Returns 0 after SIGTERM/SIGINT
    (or ``max_cycles``)."""
    log_to_stderr(log)
    notifier = notifier or Notifier()
    daemon = Daemon(root, hostname, config, collector or _default_collector(), notifier)
    return serve(daemon, log, config_path=config_path, notifier=notifier, max_steps=max_cycles)
