"""``ncclguard-inventoryd collect``: the one writer of the inventory, on the controller.

Every ``scan_interval_s`` it lists the spool (:mod:`ncclguard.spool`), reads each record
file that changed since it last looked, and accepts a record only when

1. its credential decodes on the local munged (:mod:`ncclguard.munge`), is not expired,
   and was not signed more than ``FUTURE_SKEW_S`` in the future (munged itself allows a
   skew as long as the credential's time to live);
2. it was signed by the configured publisher uid;
3. it was signed from one of the addresses of the node that the file names (Slurm's
   ``NodeAddr`` and ``NodeHostname``, resolved, or the static ``[collector.addresses]``);
4. its payload is a record of this version whose host agrees with the file name and with
   its fingerprint, within the size bound;
5. it is newer than the record already accepted for that node, by (encode time, the
   signed ``seq``): an older one is a replay, ignored.

Accepted records and rejections of one scan are written in one transaction
(:meth:`~ncclguard.store.Inventory.ingest`); a node's heartbeat is its credential's encode
time. A rejected record changes nothing: the node keeps its previous record, the
rejection is logged once per file and cause, counted in the ``rejections`` table (``ncclguard
rejections``) and in the metrics.

Every file is read twice after each change of its (inode, size, mtime): mtimes come from a
coarse clock and inodes are reused, so two writes can leave the same triple, and a file
can change between its ``stat`` and its read. The second read costs a hash (the digest
is known), never a decode.

The inventory is on the controller's local disk in WAL mode, so that the gate and the CLI
never wait for this writer. When the collector stops it switches the file back to a
rollback journal (best effort): a read-only reader (the gate as SlurmUser) cannot open a
WAL database whose writer has gone and whose ``-shm`` it cannot create.

See docs/collector.md for the threat model and the deployment.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import pwd
import re
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from inventoryd.loop import Signals, log_to_stderr
from inventoryd.sdnotify import Notifier
from ncclguard import config as configmod
from ncclguard import munge, spool
from ncclguard.policy import GATE_VALUES, load_config
from ncclguard.store import Inventory, InventoryError
from ncclguard.store.inventory import Published, Rejected

if TYPE_CHECKING:
    from inventoryd.exporter import Served

__all__ = ["Addresses", "Collector", "ScanResult", "run"]

log = logging.getLogger("ncclguard.collector")

ADDRESS_RETRY_S = 30.0  # Slurm is asked again at most this often when it failed, or
                        # when a record names a node it did not list
FUTURE_SKEW_S = configmod.HEARTBEAT_SKEW_S  # signed further ahead: rejected as rewound
LOG_PER_SCAN = 50  # rejection lines logged per scan at most; the rest are counted
KEEP_RESOLVED_S = 30 * 86400  # resolved rejections are kept this long
CONTAINER_RECORDS_PER_SCAN = 4096  # enroot hook records judged per scan at most
PRUNE_EVERY_S = 3600.0  # history older than inventory.history_days is deleted this often
_PRINTABLE = re.compile(r"[A-Za-z0-9_.+@:=,-]{1,200}")




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
    """The IPv4 addresses of host names and address literals (MUNGE encodes IPv4).

    A name that resolves to a loopback address counts for nothing: munged's default
    origin is the address of its own host name, which many images map to 127.0.1.1 or
    127.0.0.1, so a loopback address from a lookup would let every such node sign as
    this one. A loopback *literal* (an admin's explicit NodeAddr) is kept.
    ``0.0.0.0`` (munged's origin when it cannot find one) never counts."""
    out: set[str] = set()
    for name in names:
        if not name:
            continue
        try:
            ip = ipaddress.ip_address(name)
        except ValueError:
            pass
        else:
            if ip.version == 4 and not ip.is_unspecified:
                out.add(str(ip))
            continue
        with contextlib.suppress(OSError, UnicodeError):
            for info in socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM):
                found = ipaddress.ip_address(info[4][0])
                if not (found.is_loopback or found.is_unspecified):
                    out.add(str(found))
    return frozenset(out)


class Addresses:
    """Node name -> the addresses its records may be signed from.

    From the static map when ``[collector.addresses]`` is set; otherwise from Slurm
    (``NodeAddr`` and ``NodeHostname`` of every node, resolved), asked again after
    ``address_refresh_s``, and at most every ``ADDRESS_RETRY_S`` when it failed or when
    a record names a node it did not list. When Slurm cannot be asked, the last answer
    is kept. An address that several nodes share proves nothing about which one signed:
    it is dropped from all of them (``shared`` lists them).
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
        self._at: float | None = None
        self.error: str | None = None
        self.shared: dict[str, list[str]] = {}  # address -> the nodes that share it
        if config.addresses:
            self._map = self._unshared({n: resolve(a) for n, a in config.addresses.items()})

    def _unshared(self, m: dict[str, frozenset[str]]) -> dict[str, frozenset[str]]:
        owners: dict[str, list[str]] = {}
        for node, addrs in m.items():
            for a in addrs:
                owners.setdefault(a, []).append(node)
        self.shared = {a: sorted(n) for a, n in owners.items() if len(n) > 1}
        if not self.shared:
            return m
        return {node: addrs - self.shared.keys() for node, addrs in m.items()}

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
        self._map = self._unshared({name: resolve((addr, host)) for name, addr, host in nodes})

    def of(self, node: str) -> frozenset[str] | None:
        """The node's addresses, or None when the node is unknown."""
        age = None if self._at is None else self.clock() - self._at
        if (
            age is None
            or age >= self.config.address_refresh_s
            or ((self._map is None or node not in self._map) and age >= ADDRESS_RETRY_S)
        ):
            self._refresh()
        return None if self._map is None else self._map.get(node)

    @property
    def known(self) -> bool:
        return self._map is not None


@dataclass
class ScanResult:
    files: int = 0  # record files in the spool
    read: int = 0  # files read this scan (new or changed, or read again once after that)
    accepted: dict[str, str] = field(default_factory=dict)  # host -> upsert status
    rejected: dict[str, str] = field(default_factory=dict)  # file -> cause
    deferred: int = 0  # left for the next scan (munged or Slurm unavailable, or a stop)
    seconds: float = 0.0


class _Defer(Exception):
    """The rest of this scan cannot be judged now (munged down, no node addresses)."""


def _state_text(st: spool.FileState | None) -> str:
    return "-" if st is None else f"{st.ino}:{st.size}:{st.mtime_ns}"


def printable(name: str) -> str:
    """A spool file name as logs and tables may show it: as it is when it holds only
    harmless characters, else its ``repr`` (no newline, escape or control character of
    a spool writer's choosing reaches a log line or a terminal)."""
    return name if _PRINTABLE.fullmatch(name) else repr(name)[:200]


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
        self.spool_state: str | None = None  # "ok", or why the spool cannot be listed
        self.defer_state: str | None = None  # why records were deferred, or None
        self.logged: dict[str, str] = {}  # file -> the cause last logged for it
        self.shared_logged: dict[str, list[str]] = {}
        self._pruned_at = -PRUNE_EVERY_S
        self._images_at = -float("inf")
        self._container_seen: dict[str, str] = {}  # container record file -> state judged
        self._load_state()

    def _slurm_nodes(self) -> list[tuple[str, str, str]]:
        from ncclguard.slurm import Slurm

        nodes = Slurm.from_config(self.cfg.gate, timeout=30.0).nodes()
        return [(n.name, n.address, n.hostname) for n in nodes]

    def _load_state(self) -> None:
        """What was handled before a restart: unchanged files are read once more (a
        hash: the digests are known), never decoded again."""
        self.seen: dict[str, str] = {}  # file -> its state when last judged
        self.confirmed: set[str] = set()  # files read twice in that state
        self.judged: dict[str, str] = {}  # file -> digest of the content last rejected
        self._digests: dict[str, str] = {}  # file -> digest of what judge() read (a batch)
        # host -> (digest, encode time, seq) of the record accepted last
        self.latest: dict[str, tuple[str, float, int]] = {}
        for file, p in self.inv.publishers().items():
            self.seen[file] = p["file_state"]
            self.latest[p["host"]] = (p["digest"], p["encoded_at"], p["seq"])
        for r in self.inv.rejections():  # newest first: the first row of a file wins
            if r["file"] not in self.logged:
                self.seen[r["file"]] = r["file_state"]
                self.logged[r["file"]] = r["cause"]

    def close(self, *, leave_wal: bool = False) -> None:
        """Close the inventory; unless ``leave_wal``, switch it back to a rollback
        journal first, so that readers without write access can open it while no
        collector runs. Best effort: a reader holding the file keeps the -wal and -shm
        files in place, which readers can use."""
        if not leave_wal:
            try:
                self.inv.set_journal_mode("delete", wait_s=2.0)
            except InventoryError as e:
                log.warning("%s stays in WAL mode (-wal and -shm stay; readers can use "
                            "them): %s", self.inv.path, e)
        self.inv.close()

    # ---------------------------------------------------------------- one record

    def judge(self, name: str, st: spool.FileState | None) -> Published | Rejected | None:
        """The verdict on one spool file: accepted, rejected, or None when there is
        nothing to write (the record already accepted, the content already rejected,
        or a file gone since the listing)."""
        state = _state_text(st)
        host = spool.host_of(name)
        shown = printable(name)

        def reject(cause: str, detail: str) -> Rejected:
            return Rejected(shown, cause, host, detail, state)

        if self.judged.get(name) == f"state:{state}":
            return None  # rejected for what this state alone shows (name, type, size)
        if host is None:
            return reject("name-mismatch", f"{shown} is not <node name>{spool.SUFFIX}")
        if st is None:
            return reject("not-a-file", f"{self.spool / name} is not a regular file")
        try:
            data = spool.read(self.spool / name, max_bytes=self.cfg.spool.max_record_bytes)
        except spool.RecordError as e:
            if e.cause == "unreadable" and not (self.spool / name).exists():
                return None  # removed since the listing: gone, not bad
            return reject(e.cause, e.detail)
        digest = hashlib.sha256(data).hexdigest()
        self._digests[name] = digest
        latest = self.latest.get(host)
        if (latest is not None and latest[0] == digest) or self.judged.get(name) == digest:
            return None
        try:
            cred = munge.decode(data, socket_path=self.cfg.spool.munge_socket or None)
        except munge.MungeUnavailable as e:
            raise _Defer(f"munged: {e}") from None
        except munge.MungeError as e:
            return reject("undecodable", f"{self.spool / name}: {e}")
        if cred.status == munge.EXPIRED:
            return reject("expired", f"signed at {_ts(cred.encoded_at)}, ttl {cred.ttl} s")
        now = time.time()
        if cred.status == munge.REWOUND or cred.encoded_at > now + FUTURE_SKEW_S:
            return reject("rewound", f"signed at {_ts(cred.encoded_at)}, "
                          f"{cred.encoded_at - now:.0f} s in the future (the node's clock "
                          f"is ahead; at most {FUTURE_SKEW_S} s is accepted)")
        if cred.uid != self.uid:
            return reject("wrong-uid", f"signed by uid {cred.uid}, expected {self.uid} "
                          f"({self.cfg.collector.publisher})")
        addrs = self.addresses.of(host)
        if addrs is None:
            if not self.addresses.known:
                raise _Defer(f"no node addresses from Slurm yet: {self.addresses.error}")
            return reject("unknown-node", f"{host} is not a node of Slurm or of "
                          f"[collector.addresses] (signed from {cred.origin})")
        if cred.origin not in addrs:
            return reject("wrong-address", f"signed from {cred.origin}, which is not "
                          f"{host}'s ({', '.join(sorted(addrs)) or 'no address resolved'})")
        try:
            rec = spool.parse_payload(
                cred.payload, max_bytes=8 * self.cfg.spool.max_record_bytes
            )
        except spool.RecordError as e:
            return reject(e.cause, e.detail)
        if rec.host != host:
            return reject("name-mismatch", f"file {shown} holds the record of {rec.host!r}")
        if latest is not None and (cred.encoded_at, rec.seq) <= (latest[1], latest[2]):
            return reject("replayed", f"signed at {_ts(cred.encoded_at)} (seq {rec.seq}), "
                          f"not newer than the record accepted from {_ts(latest[1])} "
                          f"(seq {latest[2]})")
        return Published(rec.fingerprint, float(min(cred.encoded_at, now)), shown, state,
                         digest, cred.origin, cred.uid, float(cred.encoded_at), rec.seq)

    # ---------------------------------------------------------------- one scan

    def scan(self, should_stop: Callable[[], bool] = lambda: False) -> ScanResult:
        """List the spool, judge every new or changed file (and each once more after
        that), write the verdicts. ``should_stop`` is asked between records."""
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
        self._forget_vanished({n for n, _ in listing})
        todo = [(n, st) for n, st in listing
                if self.seen.get(n) != _state_text(st) or n not in self.confirmed]
        batch_max = self.cfg.collector.batch_max
        logged = 0
        for i in range(0, len(todo), batch_max):
            done, logged = self._batch(todo[i : i + batch_max], result, logged, should_stop)
            if not done:
                result.deferred += max(0, len(todo) - (i + batch_max))
                break
        else:
            self._defer_state(None)
        if logged > LOG_PER_SCAN:
            log.error("%d more rejections in this scan were not logged: ncclguard rejections "
                      "lists them all", logged - LOG_PER_SCAN)
        self._log_shared()
        self._prune(t0)
        for extra in (lambda: self._images(t0, should_stop), lambda: self._containers(should_stop)):
            try:  # the image index and the container records never cost the node records
                extra()
            except InventoryError:
                raise
            except Exception:
                log.exception("images or container records: failed, retried at the next scan")
        result.seconds = time.monotonic() - t0
        return result

    def _images(self, now_mono: float, should_stop: Callable[[], bool]) -> None:
        """The image index (``[images] roots``), every ``scan_interval_s``; each pass
        spends at most ``scan_budget_s`` scanning, the rest waits for the next cycle."""
        cfg = self.cfg.images
        if not cfg.roots or should_stop():
            return
        if now_mono - self._images_at < cfg.scan_interval_s:
            return
        from inventoryd.images.index import update_index

        res = update_index(self.inv, cfg)
        # what is left is scanned at the next cycle, not after a whole interval
        self._images_at = now_mono if not res.left else -float("inf")
        if res.scanned or res.failed or res.gone:
            log.info("images: %d scanned, %d unreadable, %d gone, %d left in %.2fs",
                     len(res.scanned), len(res.failed), len(res.gone), res.left, res.seconds)

    def _containers(self, should_stop: Callable[[], bool]) -> None:
        """The enroot hook's records (``<spool>/containers``, docs/containers.md): kept
        when authentic, not expired, signed from the named node's address, and naming the
        node, job and step of their file name. Others are logged once per file state."""
        from inventoryd import containerhook

        d = self.spool / containerhook.SUBDIR
        try:
            names = sorted(e.name for e in os.scandir(d) if e.is_file(follow_symlinks=False))
        except OSError:
            return  # no such directory: the site does not record containers
        stored = self.inv.container_states()
        runs = []
        present = set()
        for name in names[:CONTAINER_RECORDS_PER_SCAN]:
            if should_stop():
                break
            parts = containerhook.parse_name(name)
            if parts is None:
                continue
            present.add(name)
            host, job, step = parts
            try:
                st = os.stat(d / name, follow_symlinks=False)
            except OSError:
                continue
            state = f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
            if stored.get((job, step, host)) == state or self._container_seen.get(name) == state:
                continue
            self._container_seen[name] = state
            why = None
            try:
                data = spool.read(d / name, max_bytes=containerhook.MAX_RECORD_BYTES)
                cred = munge.decode(data, socket_path=self.cfg.spool.munge_socket or None)
            except (spool.RecordError, munge.MungeError) as e:
                why = f"unreadable or not authentic: {e}"
            else:
                addrs = self.addresses.of(host)
                if cred.status in (munge.EXPIRED, munge.REWOUND):
                    why = f"credential status {cred.status} (expired or rewound)"
                elif addrs is None or cred.origin not in addrs:
                    why = f"signed from {cred.origin}, which is not {host}'s"
                else:
                    try:
                        rec = json.loads(cred.payload)
                    except (ValueError, RecursionError):
                        rec = None
                    if not (isinstance(rec, dict) and rec.get("ncclguard_container_record")
                            == containerhook.RECORD_VERSION and (rec.get("host"),
                            rec.get("job"), rec.get("step")) == (host, job, step)):
                        why = "not a container record of this node, job and step"
                    else:
                        runs.append({"job": job, "step": step, "host": host,
                                     "encoded_at": float(cred.encoded_at), "uid": cred.uid,
                                     "origin": cred.origin, "file_state": state,
                                     "record": rec})
            if why:
                log.warning("container record %s ignored: %s", printable(name), why)
        for name in set(self._container_seen) - present:
            del self._container_seen[name]
        if runs:
            self.inv.write_container_runs(runs)

    def _prune(self, now_mono: float) -> None:
        """Bound the history (``inventory.history_days``), at most once an hour."""
        if now_mono - self._pruned_at < PRUNE_EVERY_S:
            return
        self._pruned_at = now_mono
        n = self.inv.prune_history(time.time(), self.cfg.inventory.history_days)
        if n:
            log.info("history: %d rows older than %d days deleted", n,
                     self.cfg.inventory.history_days)

    def _batch(
        self,
        files: list[tuple[str, spool.FileState | None]],
        result: ScanResult,
        logged: int,
        should_stop: Callable[[], bool],
    ) -> tuple[bool, int]:
        """Judge and write one batch. (False, ...) when the scan must stop here."""
        accepted: list[Published] = []
        rejected: list[Rejected] = []
        judged: list[tuple[str, spool.FileState | None]] = []
        done = True
        for k, (name, st) in enumerate(files):
            if should_stop():
                result.deferred += len(files) - k
                done = False
                break
            try:
                verdict = self.judge(name, st)
            except _Defer as e:
                result.deferred += len(files) - k
                self._defer_state(str(e))
                done = False
                break
            except Exception as e:  # one record must never stop the rest
                verdict = Rejected(printable(name), "malformed", spool.host_of(name),
                                   f"{type(e).__name__}: {str(e)[:300]}", _state_text(st))
            result.read += 1
            judged.append((name, st))
            if isinstance(verdict, Published):
                accepted.append(verdict)
            elif isinstance(verdict, Rejected):
                rejected.append(verdict)
        statuses = self.inv.ingest(accepted, rejected) if accepted or rejected else []
        invalid = [
            Rejected(p.file, "malformed", spool.host_of(p.file), s, p.file_state)
            for p, s in zip(accepted, statuses, strict=True) if s.startswith("invalid")
        ]
        if invalid:
            self.inv.ingest([], invalid)
        for name, st in judged:  # the first read of a state, then its confirmation
            state = _state_text(st)
            if self.seen.get(name) == state:
                self.confirmed.add(name)
            else:
                self.seen[name] = state
                self.confirmed.discard(name)
        by_shown = {printable(n): n for n, _ in judged}
        for p, status in zip(accepted, statuses, strict=True):
            if status.startswith("invalid"):
                continue
            host = spool.host_of(by_shown.get(p.file, p.file)) or p.file
            self.latest[host] = (p.digest, p.encoded_at, p.seq)
            self.judged.pop(by_shown.get(p.file, p.file), None)
            self.counts["accepted"] += 1
            result.accepted[host] = status
            if self.logged.pop(p.file, None) is not None:
                log.info("%s: %s accepted again", host, p.file)
            if status in ("inserted", "changed"):
                log.info("%s: fingerprint %s (record signed at %s)", host, status,
                         _ts(p.encoded_at))
        for r in [*rejected, *invalid]:
            name = by_shown.get(r.file, r.file)
            result.rejected[r.file] = r.cause
            self.counts[r.cause] = self.counts.get(r.cause, 0) + 1
            # not judged again as it is: its content, or (unread) its name, type and size
            self.judged[name] = self._digests.get(name, f"state:{r.file_state}")
            if self.logged.get(r.file) != r.cause:
                self.logged[r.file] = r.cause
                logged += 1
                if logged <= LOG_PER_SCAN:
                    level = logging.WARNING if r.cause == "replayed" else logging.ERROR
                    log.log(level, "%s: record %s rejected (%s), the node keeps its previous "
                            "record: %s", r.host or "?", r.file, r.cause, r.detail)
        self._digests.clear()
        return done, logged

    def _forget_vanished(self, present: set[str]) -> None:
        """Drop what is known of files that are gone, and mark their rejections
        resolved (the file is gone); drop resolved rejections older than a month."""
        gone = [n for n in self.seen if n not in present]
        for n in gone:
            self.seen.pop(n, None)
            self.confirmed.discard(n)
            self.judged.pop(n, None)
        gone_shown = {printable(n) for n in gone}
        stale_logged = [f for f in self.logged if f in gone_shown]
        for f in stale_logged:
            del self.logged[f]
        if stale_logged:
            self.inv.resolve_rejections(stale_logged, keep_s=KEEP_RESOLVED_S)

    def _log_shared(self) -> None:
        if self.addresses.shared != self.shared_logged:
            self.shared_logged = dict(self.addresses.shared)
            for addr, nodes in self.shared_logged.items():
                named = ", ".join(nodes[:8]) + (f" and {len(nodes) - 8} more"
                                                if len(nodes) > 8 else "")
                log.warning("address %s belongs to %s: it proves nothing about which of "
                            "them signed, so no record signed from it is accepted for "
                            "them", addr, named)

    def _spool_state(self, state: str) -> None:
        if state != self.spool_state:
            if state == "ok":
                if self.spool_state is not None:
                    log.info("spool %s readable again", self.spool)
            else:
                log.error("%s", state)
            self.spool_state = state

    def _defer_state(self, state: str | None) -> None:
        if state != self.defer_state:
            if state is None:
                log.info("records are judged again (munged and Slurm answer)")
            else:
                log.error("records deferred to the next scan: %s", state)
            self.defer_state = state


def _ts(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


# -------------------------------------------------------------------- the service


def collect_once(config: configmod.Config, db: Path | None = None) -> ScanResult:
    """One scan (``collect --once``): the demo, tests, a cron-style deployment."""
    log_to_stderr(log)
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
    log_to_stderr(log)
    notifier = notifier or Notifier()
    try:
        with Signals() as flags:
            return _serve(config_path, config, db, notifier, max_scans, flags)
    except (InventoryError, configmod.ConfigError) as e:
        log.error("collector cannot start: %s", e)
        return 1


def _serve(config_path: str | None, config: configmod.Config, db: Path | None,
           notifier: Notifier, max_scans: int | None, flags: Signals) -> int:
    collector = Collector(config, db=db)
    served = _metrics(collector)
    try:
        log.info("collector started (config %s, spool %s, inventory %s, publisher uid %d)",
                 config.source, collector.spool, collector.inv.path, collector.uid)
        notifier.ready("collecting")
        scans = 0
        last_failure: str | None = None
        while not flags.stop:
            if flags.reload:
                flags.reload = False
                notifier.reloading()
                try:  # the new one first: a config that fails leaves the old one working
                    new = Collector(load_config(config_path), db=db)
                except (configmod.ConfigError, InventoryError) as e:
                    log.error("config not reloaded, keeping the previous one: %s", e)
                else:
                    collector.close(leave_wal=True)
                    collector = new
                    if served is not None:
                        served.close()
                    served = _metrics(collector)
                    log.info("config reloaded from %s", new.cfg.source)
                notifier.ready("config reloaded")
            try:
                res = collector.scan(lambda: flags.stop)
                failure = None
            except InventoryError as e:
                failure = f"inventory write failed, retrying at the next scan: {e}"
                res = ScanResult()
            except Exception as e:  # a bug must not stop the cluster's one writer
                failure = f"scan failed, retrying at the next scan: {type(e).__name__}: {e}"
                res = ScanResult()
            if failure != last_failure:
                if failure:
                    log.error("%s", failure)
                last_failure = failure
            scans += 1
            notifier.watchdog()
            if res.accepted or res.rejected:
                notifier.status(f"{len(res.accepted)} accepted, {len(res.rejected)} rejected "
                                f"in {res.seconds:.2f}s")
            if served is not None:
                _report(served, collector, res, scans)
            if max_scans is not None and scans >= max_scans:
                break
            flags.sleep(collector.cfg.collector.scan_interval_s, notifier)
        notifier.stopping()
        log.info("collector stopped")
        return 0
    finally:
        if served is not None:
            served.close()
        collector.close()


# -------------------------------------------------------------------- the metrics


def _metrics(collector: Collector) -> Served | None:
    """The cluster's metrics (inventoryd/exporter.py), when ``[collector] metrics_port``
    or ``textfile_dir`` asks for them. A port that cannot be bound is logged, and the
    collector runs on without its endpoint: it is the inventory's one writer."""
    c = collector.cfg.collector
    if not (c.metrics_port or c.textfile_dir):
        return None
    from inventoryd.exporter import Served, from_config

    exporter = from_config(collector.cfg, collector.inv.path)
    try:
        return Served(exporter, address=c.metrics_address, port=c.metrics_port,
                      textfile_dir=c.textfile_dir)
    except OSError as e:
        log.error("metrics: cannot listen on %s:%d (%s); no HTTP endpoint",
                  c.metrics_address, c.metrics_port, e.strerror or e)
        return Served(exporter, textfile_dir=c.textfile_dir) if c.textfile_dir else None


def _report(served: Served, collector: Collector, res: ScanResult, scans: int) -> None:
    """After each scan: the collector's counters to the exporter; the textfile."""
    from inventoryd.exporter import ScanStats

    served.exporter.scanned(ScanStats(
        counts=dict(collector.counts), files=res.files, seconds=res.seconds,
        deferred=res.deferred, spool_ok=collector.spool_state == "ok", scans=scans,
        last_scan=time.time()))
    try:
        served.write_textfile()
    except OSError as e:
        log.error("cannot write metrics to %s: %s", served.textfile_dir, e.strerror or e)
