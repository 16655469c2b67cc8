"""``ncclguard-inventoryd collect``: the one writer of the inventory, on the controller.

Every ``scan_interval_s`` it lists the spool (:mod:`ncclguard.spool`), reads each record
file that changed since it last looked, and accepts a record only when

1. its credential decodes on the local munged (:mod:`ncclguard.munge`) and is not expired
   or rewound;
2. it was signed by the configured publisher uid;
3. it was signed from one of the addresses of the node that the file names (Slurm's
   ``NodeAddr`` and ``NodeHostname``, resolved, or the static ``[collector.addresses]``);
4. its payload is a record of this version whose host agrees with the file name and with
   its fingerprint, within the size bound;
5. it is newer than the record already accepted for that node (an older one, or the
   same one again, is a replay: ignored).

Accepted records and rejections of one scan are written in one transaction
(:meth:`~ncclguard.store.Inventory.ingest`); a node's heartbeat is its credential's encode
time. A rejected record changes nothing: the node keeps its previous record, the
rejection is logged once per file and cause, counted in the ``rejections`` table (``ncclguard
rejections``) and in the metrics.

The inventory is on the controller's local disk in WAL mode, so that the gate and the CLI
never wait for this writer. When the collector stops it switches the file back to a
rollback journal: a read-only reader (the gate as SlurmUser) cannot open a WAL database
whose writer has gone and whose ``-shm`` it cannot create.

See docs/collector.md for the threat model and the deployment.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import os
import pwd
import select
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from inventoryd.sdnotify import Notifier
from ncclguard import config as configmod
from ncclguard import munge, spool
from ncclguard.policy import GATE_VALUES, load_config
from ncclguard.store import Inventory, InventoryError
from ncclguard.store.inventory import Published, Rejected

__all__ = ["Addresses", "Collector", "ScanResult", "run"]

log = logging.getLogger("ncclguard.collector")

ADDRESS_RETRY_S = 30.0  # an unknown node makes Slurm be asked again, at most this often
# A file changed this recently is read again at the next scan even if its (inode, size,
# mtime) look the same: mtimes come from a coarse clock (a jiffy on ext4), and inodes are
# reused, so two writes in one tick can leave the same triple ("racily clean", as git's
# index calls it). Reading again costs one read and one hash: the digest is known.
RACY_NS = 2_000_000_000


def _setup_logging() -> None:
    if log.handlers:
        return
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log.addHandler(h)
    log.setLevel(logging.INFO)
    log.propagate = False


def publisher_uid(name: str) -> int:
    """The uid of ``[collector] publisher`` (a user name or a number)."""
    if name.isdigit():
        return int(name)
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        raise configmod.ConfigError(
            f"collector.publisher = {name!r}: no such user on this host"
        ) from None


def resolve(names: Iterable[str]) -> frozenset[str]:
    """The IPv4 addresses of host names and address literals (MUNGE encodes IPv4)."""
    out: set[str] = set()
    for name in names:
        if not name:
            continue
        try:
            ip = ipaddress.ip_address(name)
        except ValueError:
            pass
        else:
            if ip.version == 4:
                out.add(str(ip))
            continue
        with contextlib.suppress(OSError, UnicodeError):
            for info in socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM):
                out.add(str(info[4][0]))
    return frozenset(out)


class Addresses:
    """Node name -> the addresses its records may be signed from.

    From the static map when ``[collector.addresses]`` is set; otherwise from Slurm
    (``NodeAddr`` and ``NodeHostname`` of every node, resolved), asked again after
    ``address_refresh_s``, or when a record names a node not known yet (at most every
    ``ADDRESS_RETRY_S``). When Slurm cannot be asked, the last answer is kept.
    """

    def __init__(
        self,
        config: configmod.CollectorConfig,
        slurm_nodes: Callable[[], Iterable[tuple[str, str, str]]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.slurm_nodes = slurm_nodes
        self.clock = clock
        self._map: dict[str, frozenset[str]] | None = None
        self._at = -1e18
        self.error: str | None = None
        if config.addresses:
            self._map = {n: resolve(a) for n, a in config.addresses.items()}

    def _refresh(self) -> None:
        if self.config.addresses or self.slurm_nodes is None:
            return
        self._at = self.clock()
        try:
            nodes = list(self.slurm_nodes())
        except Exception as e:  # a Slurm call: any failure keeps the previous map
            self.error = f"{type(e).__name__}: {e}"
            return
        self.error = None
        self._map = {name: resolve((addr, host)) for name, addr, host in nodes}

    def of(self, node: str) -> frozenset[str] | None:
        """The node's addresses, or None when the node is unknown."""
        age = self.clock() - self._at
        if (
            self._map is None
            or age >= self.config.address_refresh_s
            or (node not in self._map and age >= ADDRESS_RETRY_S)
        ):
            self._refresh()
        return None if self._map is None else self._map.get(node)

    @property
    def known(self) -> bool:
        return self._map is not None


@dataclass
class ScanResult:
    files: int = 0  # record files in the spool
    read: int = 0  # files read this scan (new or changed)
    accepted: dict[str, str] = field(default_factory=dict)  # host -> upsert status
    rejected: dict[str, str] = field(default_factory=dict)  # file -> cause
    deferred: int = 0  # left for the next scan (munged or Slurm unavailable)
    seconds: float = 0.0


class _Defer(Exception):
    """This record cannot be judged now (munged down, no node addresses yet)."""


def _state_text(st: spool.FileState | None) -> str:
    return "-" if st is None else f"{st.ino}:{st.size}:{st.mtime_ns}"


class Collector:
    """One collector: its config, its inventory, what it has seen of the spool."""

    def __init__(
        self,
        config: configmod.Config,
        *,
        db: Path | None = None,
        spool_dir: Path | None = None,
        addresses: Addresses | None = None,
    ) -> None:
        self.cfg = config
        self.spool = spool_dir or config.spool.spool_path()
        self.uid = publisher_uid(config.collector.publisher)
        inv_cfg = config.inventory.replace(journal_mode="wal")
        self.inv = Inventory(db, config=inv_cfg, values=GATE_VALUES, heartbeat_s=0)
        self.addresses = addresses or Addresses(config.collector, self._slurm_nodes)
        self.counts: dict[str, int] = {"accepted": 0}
        self.spool_state: str | None = None
        self.logged: dict[str, str] = {}  # file -> the cause last logged for it
        self._load_state()

    def _slurm_nodes(self) -> list[tuple[str, str, str]]:
        from ncclguard.slurm import Slurm

        nodes = Slurm.from_config(self.cfg.gate, timeout=30.0).nodes()
        return [(n.name, n.address, n.hostname) for n in nodes]

    def _load_state(self) -> None:
        """What was handled before a restart: unchanged files are not read again."""
        self.seen: dict[str, str] = {}
        self.latest: dict[str, tuple[str, float]] = {}  # host -> (digest, encoded_at)
        for file, p in self.inv.publishers().items():
            self.seen[file] = p["file_state"]
            self.latest[p["host"]] = (p["digest"], p["encoded_at"])
        for r in self.inv.rejections():
            self.seen[r["file"]] = r["file_state"]
            self.logged[r["file"]] = r["cause"]

    def close(self) -> None:
        """Leave the inventory readable without a writer (rollback journal), and close."""
        try:
            self.inv.set_journal_mode("delete")
        except InventoryError as e:
            log.error("cannot switch %s back from WAL (readers need the collector "
                      "running until it is): %s", self.inv.path, e)
        self.inv.close()

    # ---------------------------------------------------------------- one record

    def judge(self, name: str, st: spool.FileState | None) -> Published | Rejected | None:
        """The verdict on one spool file: accepted, rejected, or None for a record that
        is the one already accepted (nothing to write)."""
        state = _state_text(st)
        host = spool.host_of(name)

        def reject(cause: str, detail: str) -> Rejected:
            return Rejected(name, cause, host, detail, state)

        if host is None:
            return reject("name-mismatch", f"{name!r} is not <node name>{spool.SUFFIX}")
        if st is None:
            return reject("not-a-file", f"{self.spool / name} is not a regular file")
        try:
            data = spool.read(self.spool / name, max_bytes=self.cfg.spool.max_record_bytes)
        except spool.RecordError as e:
            return reject(e.cause, e.detail)
        digest = hashlib.sha256(data).hexdigest()
        latest = self.latest.get(host)
        if latest is not None and latest[0] == digest:
            return None
        try:
            cred = munge.decode(data, socket_path=self.cfg.spool.munge_socket or None)
        except munge.MungeUnavailable as e:
            raise _Defer(str(e)) from None
        except munge.MungeError as e:
            return reject("undecodable", f"{self.spool / name}: {e}")
        if cred.status == munge.EXPIRED:
            return reject("expired", f"signed at {_ts(cred.encoded_at)}, ttl {cred.ttl} s")
        if cred.status == munge.REWOUND:
            return reject("rewound", f"signed at {_ts(cred.encoded_at)}, in the future")
        if cred.uid != self.uid:
            return reject("wrong-uid", f"signed by uid {cred.uid}, expected {self.uid} "
                          f"({self.cfg.collector.publisher})")
        addrs = self.addresses.of(host)
        if addrs is None:
            if not self.addresses.known:
                raise _Defer(f"no node addresses yet: {self.addresses.error}")
            return reject("unknown-node", f"{host} is not a node of Slurm or of "
                          f"[collector.addresses] (signed from {cred.origin})")
        if cred.origin not in addrs:
            return reject("wrong-address", f"signed from {cred.origin}, which is not "
                          f"{host}'s ({', '.join(sorted(addrs)) or 'no address resolved'})")
        try:
            rec_host, fp = spool.parse_payload(
                cred.payload, max_bytes=8 * self.cfg.spool.max_record_bytes
            )
        except spool.RecordError as e:
            return reject(e.cause, e.detail)
        if rec_host != host:
            return reject("name-mismatch", f"file {name} holds the record of {rec_host!r}")
        if latest is not None and cred.encoded_at < latest[1]:
            return reject("replayed", f"signed at {_ts(cred.encoded_at)}, older than the "
                          f"record accepted from {_ts(latest[1])}")
        return Published(fp, float(cred.encoded_at), name, state, digest, cred.origin, cred.uid)

    # ---------------------------------------------------------------- one scan

    def scan(self) -> ScanResult:
        """List the spool, judge every new or changed file, write the verdicts."""
        t0 = time.monotonic()
        result = ScanResult()
        try:
            spool.check_dir(self.spool)
            listing = list(spool.scan(self.spool))
        except (spool.SpoolError, OSError) as e:
            self._spool_state(f"spool unavailable: {e}")
            result.seconds = time.monotonic() - t0
            return result
        self._spool_state("ok")
        result.files = len(listing)
        todo = [(n, st) for n, st in listing if self.seen.get(n) != _state_text(st)]
        batch_max = self.cfg.collector.batch_max
        racy_after = time.time_ns() - RACY_NS
        for i in range(0, len(todo), batch_max):
            self._batch(todo[i : i + batch_max], result, racy_after)
        result.seconds = time.monotonic() - t0
        return result

    def _batch(self, files: list[tuple[str, spool.FileState | None]], result: ScanResult,
               racy_after: int) -> None:
        accepted: list[Published] = []
        rejected: list[Rejected] = []
        seen_now: dict[str, str] = {}
        racy = {n for n, st in files if st is not None and st.mtime_ns >= racy_after}
        for name, st in files:
            try:
                verdict = self.judge(name, st)
            except _Defer as e:
                result.deferred += 1
                self._spool_state(f"records deferred: {e}")
                continue
            result.read += 1
            if verdict is None:
                seen_now[name] = _state_text(st)
            elif isinstance(verdict, Published):
                accepted.append(verdict)
            else:
                rejected.append(verdict)
        if not accepted and not rejected:
            self._mark_seen(seen_now, racy)
            return
        statuses = self.inv.ingest(accepted, rejected)
        invalid = [
            Rejected(p.file, "malformed", spool.host_of(p.file), s, p.file_state)
            for p, s in zip(accepted, statuses, strict=True) if s.startswith("invalid")
        ]
        if invalid:
            self.inv.ingest([], invalid)
        self._mark_seen(seen_now, racy)
        for p, status in zip(accepted, statuses, strict=True):
            self._mark_seen({p.file: p.file_state}, racy)
            if status.startswith("invalid"):
                continue
            host = spool.host_of(p.file) or p.file
            self.latest[host] = (p.digest, p.at)
            self.counts["accepted"] += 1
            result.accepted[host] = status
            if self.logged.pop(p.file, None) is not None:
                log.info("%s: %s accepted again", host, p.file)
            if status in ("inserted", "changed"):
                log.info("%s: fingerprint %s (record signed at %s)", host, status, _ts(p.at))
        for r in [*rejected, *invalid]:
            self._mark_seen({r.file: r.file_state}, racy)
            result.rejected[r.file] = r.cause
            self.counts[r.cause] = self.counts.get(r.cause, 0) + 1
            if self.logged.get(r.file) != r.cause:
                self.logged[r.file] = r.cause
                level = logging.WARNING if r.cause == "replayed" else logging.ERROR
                log.log(level, "%s: record %s rejected (%s), the node keeps its previous "
                        "record: %s", r.host or "?", r.file, r.cause, r.detail)

    def _mark_seen(self, states: dict[str, str], racy: set[str]) -> None:
        for name, state in states.items():
            if name in racy:
                self.seen.pop(name, None)  # look again next scan
            else:
                self.seen[name] = state

    def _spool_state(self, state: str) -> None:
        if state != self.spool_state:
            if state == "ok":
                if self.spool_state is not None:
                    log.info("spool %s readable again", self.spool)
            else:
                log.error("%s", state)
            self.spool_state = state


def _ts(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


# -------------------------------------------------------------------- the service


class _Flags:
    stop = False
    reload = False

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            self.reload = True
        else:
            self.stop = True


def collect_once(config: configmod.Config, db: Path | None = None) -> ScanResult:
    """One scan (``collect --once``): the demo, tests, a cron-style deployment."""
    _setup_logging()
    c = Collector(config, db=db)
    try:
        return c.scan()
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
    """The collector service: scan every ``scan_interval_s`` until SIGTERM/SIGINT."""
    _setup_logging()
    notifier = notifier or Notifier()
    flags = _Flags()
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    old_fd = signal.set_wakeup_fd(w)
    old = {s: signal.signal(s, flags.on_signal)
           for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    collector: Collector | None = None
    try:
        collector = Collector(config, db=db)
        log.info("collector started (config %s, spool %s, inventory %s, publisher uid %d)",
                 config.source, collector.spool, collector.inv.path, collector.uid)
        notifier.ready("collecting")
        scans = 0
        while not flags.stop:
            if flags.reload:
                flags.reload = False
                notifier.reloading()
                try:
                    new = load_config(config_path)
                    collector.close()
                    collector = Collector(new, db=db)
                    log.info("config reloaded from %s", new.source)
                except (configmod.ConfigError, InventoryError) as e:
                    log.error("config not reloaded, keeping the previous one: %s", e)
                notifier.ready("config reloaded")
            try:
                res = collector.scan()
            except InventoryError as e:
                log.error("inventory write failed, retrying at the next scan: %s", e)
                res = ScanResult()
            scans += 1
            notifier.watchdog()
            if res.accepted or res.rejected:
                notifier.status(f"{len(res.accepted)} accepted, {len(res.rejected)} rejected "
                                f"in {res.seconds:.2f}s")
            _write_metrics(collector, res)
            if max_scans is not None and scans >= max_scans:
                break
            _sleep(flags, collector.cfg.collector.scan_interval_s, r, notifier)
        notifier.stopping()
        log.info("collector stopped")
        return 0
    except (InventoryError, configmod.ConfigError) as e:
        log.error("collector cannot start: %s", e)
        return 1
    finally:
        if collector is not None:
            collector.close()
        for s, h in old.items():
            signal.signal(s, h)
        signal.set_wakeup_fd(old_fd)
        os.close(r)
        os.close(w)


def _sleep(flags: _Flags, seconds: float, wake_fd: int, notifier: Notifier) -> None:
    end = time.monotonic() + seconds
    ping = notifier.ping_interval()
    while not (flags.stop or flags.reload):
        left = end - time.monotonic()
        if left <= 0:
            return
        ready, _, _ = select.select([wake_fd], [], [], min(left, ping) if ping else left)
        if ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_fd, 512)
        notifier.watchdog()


def _write_metrics(collector: Collector, res: ScanResult) -> None:
    d = collector.cfg.collector.textfile_dir
    if not d:
        return
    from inventoryd.metrics import write_collector_textfile

    try:
        write_collector_textfile(d, collector.counts, files=res.files, seconds=res.seconds,
                                 spool_ok=collector.spool_state == "ok")
    except OSError as e:
        log.error("cannot write metrics to %s: %s", d, e.strerror or e)
