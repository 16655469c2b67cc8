"""``ncclguard-inventoryd run``: keep this node's signed record in the spool current.

Each cycle collects the fingerprint, publishes it (:mod:`inventoryd.publish`: signed by
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
from typing import Any

from inventoryd.loop import Signals, log_to_stderr
from inventoryd.publish import Publisher, PublishError, publish_state
from inventoryd.sdnotify import Notifier
from ncclguard import config as configmod
from ncclguard.policy import GATE_VALUES, load_config
from ncclguard.store import Inventory, InventoryError

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
        config=cfg.inventory, values=GATE_VALUES, heartbeat_s=cfg.inventoryd.heartbeat_s
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
        print(f"ncclguard-inventoryd: {host}: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"ncclguard-inventoryd: {host}: not stored: {e}", file=sys.stderr)
        return 1
    print(f"ncclguard-inventoryd: {host}: {status} in {where}", file=sys.stderr)
    return 0


def publish_once(fp: Mapping[str, Any], cfg: configmod.Config) -> int:
    """Sign and publish one fingerprint (``once --publish``). 0, or 1 with a message."""
    host = _host(fp, _short_hostname())
    try:
        path = Publisher(cfg.spool, cfg.inventoryd.heartbeat_s).publish(fp)
    except (PublishError, ValueError) as e:
        print(f"ncclguard-inventoryd: {host}: not published: {e}", file=sys.stderr)
        return 1
    print(f"ncclguard-inventoryd: {host}: published {path}", file=sys.stderr)
    return 0


def _default_collector() -> Collector:
    from inventoryd.collect import collect

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
    """The state of one ``run``: the config, the store's state, what was last written."""

    def __init__(
        self,
        root: str,
        hostname: str | None,
        config_path: str | None,
        config: configmod.Config,
        collector: Collector,
        notifier: Notifier,
    ) -> None:
        self.root = root
        self.hostname = hostname
        self.config_path = config_path
        self.cfg = config
        self.collect = collector
        self.notifier = notifier
        self.node = hostname or _short_hostname()
        self.publisher = Publisher(config.spool, config.inventoryd.heartbeat_s)
        self.publish_state: str | None = None  # "ok", or the class of the last failure
        self.collect_state: str | None = None
        self.last_change: float | None = None
        self.last_publish: float | None = None
        self.signals = Signals()
        self.cycles = 0

    def do_reload(self) -> None:
        self.signals.reload = False
        self.notifier.reloading()
        try:
            new = load_config(self.config_path)
        except configmod.ConfigError as e:
            log.error("%s: config not reloaded, keeping the previous one: %s", self.node, e)
        else:
            if new.spool.spool_path() != self.cfg.spool.spool_path():
                self.publish_state = None  # a new spool: report its state afresh
            self.cfg = new
            last_hash = self.publisher.last_hash
            self.publisher = Publisher(new.spool, new.inventoryd.heartbeat_s)  # publish now
            self.publisher.last_hash = last_hash  # ... but it is not a change
            log.info("%s: config reloaded from %s", self.node, new.source)
        self.notifier.ready(f"config reloaded from {self.cfg.source}")

    # ---- one cycle

    def _set_publish_state(self, state: str, message: str, *, error: bool) -> None:
        if state != self.publish_state:
            (log.error if error else log.info)("%s: %s", self.node, message)
            self.publish_state = state

    def cycle(self) -> bool:
        """Collect and publish once. True when the published record is up to date."""
        from inventoryd.nodefs import progress

        self.cycles += 1
        token = progress.set(self.notifier.watchdog)  # a long read is progress, not a hang
        try:
            fp = self.collect(self.root, self.hostname, self.cfg.inventoryd)
        except Exception as e:  # a probe bug must not stop the node's daemon
            state = f"{type(e).__name__}: {e}"
            if state != self.collect_state:
                log.error("%s: collection failed: %s", self.node, state)
                self.collect_state = state
            return False
        finally:
            progress.reset(token)
        if self.collect_state is not None:
            log.info("%s: collection works again", self.node)
            self.collect_state = None
        self.node = _host(fp, self.node)
        ok = self._publish(fp)
        self._metrics(fp)
        return ok

    def _publish(self, fp: Mapping[str, Any]) -> bool:
        now = time.time()

        if not self.publisher.due(fp, now):
            return True
        before = self.publisher.last_hash  # the stack: a change; the errors: shown only
        changed = before is None or before[:64] != publish_state(fp)[:64]
        try:
            path = self.publisher.publish(fp, now)
        except PublishError as e:
            self._set_publish_state(
                e.kind, f"record not published, collecting on and retrying: {e}", error=True
            )
            return False
        except ValueError as e:
            self._set_publish_state("invalid", f"fingerprint not published: {e}", error=True)
            return False
        self.last_publish = now
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
        from inventoryd.metrics import write_textfile

        try:
            write_textfile(d, fp, last_change=self.last_change,
                           publish_ok=self.publish_state == "ok",
                           last_publish=self.last_publish)
        except OSError as e:
            state = f"metrics:{e.errno}"
            if state != self.collect_state:
                log.error("%s: cannot write metrics to %s: %s", self.node, d, e.strerror or e)
                self.collect_state = state

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
    """The service loop. Returns 0 after SIGTERM/SIGINT (or ``max_cycles``)."""
    log_to_stderr(log)
    daemon = Daemon(root, hostname, config_path, config, collector or _default_collector(),
                    notifier or Notifier())
    sig = daemon.signals
    with sig:
        log.info("%s: started (config %s, spool %s)", daemon.node, config.source,
                 config.spool.spool_path())
        daemon.notifier.ready("collecting")
        last_status: str | None = None
        while not sig.stop:
            if sig.reload:
                daemon.do_reload()
            ok = daemon.cycle()
            daemon.notifier.watchdog()
            status = f"publishing {daemon.publish_state or 'unknown'}"
            if status != last_status:  # only on a change: the manager's queue is short
                last_status = status if daemon.notifier.status(status) else None
            if max_cycles is not None and daemon.cycles >= max_cycles:
                break
            if sig.stop:
                break
            sig.sleep(daemon.delay(ok), daemon.notifier)
        daemon.notifier.stopping()
        log.info("%s: stopped", daemon.node)
        return 0
