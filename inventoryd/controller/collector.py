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
rollback journal (best effort), which a read-only reader (the gate as SlurmUser) reads
with nothing beside it (a WAL file left without its writer is read ``immutable=1``:
docs/store.md, "Readers leave no -wal or -shm").

See docs/collector.md for the threat model and the deployment.

Over 500 lines: judging a record and writing a batch share the collector's state
(what was seen, accepted and rejected per file) in one class; the service loop, the
addresses and the verification checks are modules of their own.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from inventoryd.controller import verify
from inventoryd.controller.addresses import Addresses, publisher_uid
from inventoryd.controller.container_records import ContainerRecords
from inventoryd.controller.pressure import DiskPressure, growth_failure
from inventoryd.controller.verify import printable
from ncclguard import config as configmod
from ncclguard import spool
from ncclguard.policy.schedule import class_values
from ncclguard.store import Inventory, InventoryError
from ncclguard.store.inventory import REFUSED, Published, Quota, Rejected

if TYPE_CHECKING:
    from inventoryd.controller.images.index import OwnerTime

__all__ = ["Collector", "ScanResult"]

log = logging.getLogger("ncclguard.collector")

FUTURE_SKEW_S = verify.FUTURE_SKEW_S  # signed further ahead: rejected as rewound
LOG_PER_SCAN = 50  # rejection lines logged per scan at most; the rest are counted
KEEP_RESOLVED_S = 30 * 86400  # resolved rejections are kept this long
PRUNE_EVERY_S = 3600.0  # history older than inventory.history_days is deleted this often
UNKNOWN_PER_SCAN = 256  # files that name no known node, judged per scan at most (unread)




@dataclass
class ScanResult:
    files: int = 0  # record files in the spool
    read: int = 0  # files read this scan (new or changed, or read again once after that)
    accepted: dict[str, str] = field(default_factory=dict)  # host -> upsert status
    rejected: dict[str, str] = field(default_factory=dict)  # file -> cause
    deferred: int = 0  # left for the next scan (munged or Slurm unavailable, or a stop)
    postponed: int = 0  # files that name no known node, left for later scans (the bound)
    unwritten: int = 0  # judged, but the inventory could not be written: read again
    written: bool = False  # a batch was written (and so the inventory stamped)
    seconds: float = 0.0


def _state_text(st: spool.FileState | None) -> str:
    return "-" if st is None else f"{st.ino}:{st.size}:{st.mtime_ns}"


def _telling(should_stop: Callable[[], bool], progress: Callable[[str], None],
             text: Callable[[], str]) -> Callable[[], bool]:
    """``should_stop`` that also tells ``progress`` how far the work is, each time it is
    asked (between records, between images): ``collect --once``'s progress line."""
    def ask() -> bool:
        progress(text())
        return should_stop()

    return ask


class Collector:
    """One collector: its config, its inventory, what it has seen of the spool."""

    def __init__(
        self,
        config: configmod.Config,
        *,
        db: Path | None = None,
        spool_dir: Path | None = None,
        addresses: Addresses | None = None,
        registry_thread: bool = True,
    ) -> None:
        self.cfg = config
        self.spool = spool_dir or config.spool.spool_path()
        self.uid = publisher_uid(config.collector.publisher)
        inv_cfg = config.inventory.replace(journal_mode="wal")
        # each node's class under this config's policy; derived anew for every node when
        # the policy changed (a severity): ncclguard.store.Inventory.derive_classes
        self.inv = Inventory(db, config=inv_cfg, values=class_values(config.policy), heartbeat_s=0)
        self.addresses = addresses or Addresses(config.collector, self._slurm_nodes)
        self.counts: dict[str, int] = {"accepted": 0}
        self.spool_state: str | None = None  # "ok", or why the spool cannot be listed
        self.defer_state: str | None = None  # why records were deferred, or None
        self.logged: dict[str, str] = {}  # file -> the cause last logged for it
        self.shared_logged: dict[str, list[str]] = {}
        self._pruned_at = -PRUNE_EVERY_S
        self._images_at = -float("inf")
        # the time each file owner's images took to scan, across passes (a reload hands
        # it on: collector_service.py): the owner who used least goes first
        self.image_time: OwnerTime | None = None  # made at the first pass
        self.containers = ContainerRecords(self.spool, config, self.addresses)
        # what running job steps loaded (issue 42): stored and judged after each batch
        from inventoryd.controller.runtime import Runtime
        from ncclguard.slurm import Slurm

        self.runtime = Runtime(config, self.inv, Slurm.from_config(config.gate, timeout=10.0))
        # free space below collector.min_free_bytes, or a failed write: records are still
        # judged; the inventory stops growing (inventoryd/controller/pressure.py)
        self.disk = DiskPressure(self.inv.path, config.collector.min_free_bytes)
        self._unknown_cursor = ""  # files of unknown nodes are judged in turn from here
        self._load_state()
        # registry images: read in a thread of their own, written here (the one writer)
        self.registry = None
        if config.registry.enabled:
            from inventoryd.controller.images.registry_index import RegistryIndex

            self.registry = RegistryIndex(config, db=self.inv.path)
            if registry_thread:  # else the caller runs its passes (collect --once)
                self.registry.start()
        # the job environments the gate saw (issue 40): resolved in a thread, written here
        from inventoryd.controller.jobenv_index import JobEnvIndex

        self.jobenvs = JobEnvIndex(config.gate.audit_path(config.inventory), db=self.inv.path,
                                   inv_config=config.inventory)
        if registry_thread:
            self.jobenvs.start()

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
        if self.registry is not None:
            self.registry.stop()
        self.jobenvs.stop()
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
        or a file gone since the listing). A file that names no known node is rejected
        before it is read (its bytes cost nothing)."""
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
        if self.addresses.listed(host) is False:
            return reject("unknown-node", f"{host} is not a node of Slurm or of "
                          "[collector.addresses] (the file was not read)")
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
        now = time.time()
        try:
            cred = verify.authentic(data, str(self.spool / name),
                                    self.cfg.spool.munge_socket or None, now)
            if cred.uid != self.uid:
                raise verify.Reject("wrong-uid", f"signed by uid {cred.uid}, expected "
                                    f"{self.uid} ({self.cfg.collector.publisher})")
            verify.from_node(self.addresses, host, cred.origin)
        except verify.Reject as e:
            return reject(e.cause, e.detail)
        try:
            rec = spool.parse_payload(
                cred.payload, max_bytes=8 * self.cfg.spool.max_record_bytes
            )
        except spool.RecordError as e:
            return reject(e.cause, e.detail)
        if rec.host != host:
            return reject("name-mismatch", f"file {shown} holds the record of {rec.host!r}")
        if latest is not None and (cred.encoded_at, rec.seq) <= (latest[1], latest[2]):
            return reject("replayed", f"signed at {verify.ts(cred.encoded_at)} (seq "
                          f"{rec.seq}), not newer than the record accepted from "
                          f"{verify.ts(latest[1])} (seq {latest[2]})")
        if rec.loaded_error is not None and self.logged.get(f"loaded:{shown}") != rec.loaded_error:
            self.logged[f"loaded:{shown}"] = rec.loaded_error
            log.error("%s: the record's loaded part is left out (the fingerprint is kept): %s",
                      host, rec.loaded_error)
        return Published(rec.fingerprint, float(min(cred.encoded_at, now)), shown, state,
                         digest, cred.origin, cred.uid, float(cred.encoded_at), rec.seq,
                         rec.loaded)

    # ---------------------------------------------------------------- one scan

    def scan(self, should_stop: Callable[[], bool] = lambda: False,
             progress: Callable[[str], None] | None = None) -> ScanResult:
        """List the spool, judge every new or changed file (and each once more after
        that), write the verdicts. ``should_stop`` is asked between records;
        ``progress`` (``collect --once``'s progress line) is told how far the scan is."""
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
        self.disk.check_space()
        self.disk.guarded(lambda: self._forget_vanished({n for n, _ in listing}))
        todo = self._fair([(n, st) for n, st in listing
                           if self.seen.get(n) != _state_text(st) or n not in self.confirmed],
                          result)
        batch_max = self.cfg.collector.batch_max
        logged = 0
        judging = should_stop if progress is None else _telling(
            should_stop, progress, lambda: f"spool: {result.read:,} of {len(todo):,} records "
            "judged")
        for i in range(0, len(todo), batch_max):
            done, logged = self._batch(todo[i : i + batch_max], result, logged, judging)
            if not done:
                result.deferred += max(0, len(todo) - (i + batch_max))
                break
        else:
            self._defer_state(None)
        if logged > LOG_PER_SCAN:
            log.error("%d more rejections in this scan were not logged: ncclguard rejections "
                      "lists them all", logged - LOG_PER_SCAN)
        self._log_shared()
        self.disk.guarded(lambda: self._prune(t0))
        reading = should_stop if progress is None else _telling(
            should_stop, progress, lambda: "image index: reading images")
        if self.pressure is None:  # neither grows the inventory under disk pressure
            self._extra(lambda: self._images(t0, reading))
            self._extra(self._registry)
            self._extra(self._job_envs)
        elif self.registry is not None:  # the worker waits: nothing it reads is written
            self.registry.hold(self.pressure)
        self._extra(lambda: self._container_records(should_stop))
        self._extra(self._judge_steps)
        self.disk.stamp(self.inv, t0, result.written)
        result.seconds = time.monotonic() - t0
        return result

    def _fair(self, todo: list[tuple[str, spool.FileState | None]], result: ScanResult
              ) -> list[tuple[str, spool.FileState | None]]:
        """The known nodes' files first, all of them; of the files that name no known
        node (junk, a node Slurm does not list), at most UNKNOWN_PER_SCAN, in turn from
        where the last scan stopped (they are rejected unread, but each costs a row)."""
        known: list[tuple[str, spool.FileState | None]] = []
        other: list[tuple[str, spool.FileState | None]] = []
        for item in todo:
            host = spool.host_of(item[0])
            (known if host is not None and self.addresses.listed(host) is not False
             else other).append(item)
        if len(other) <= UNKNOWN_PER_SCAN:
            return known + other
        other.sort(key=lambda t: t[0])
        turn = [t for t in other if t[0] > self._unknown_cursor]
        turn += [t for t in other if t[0] <= self._unknown_cursor]
        taken = turn[:UNKNOWN_PER_SCAN]
        self._unknown_cursor = taken[-1][0]
        result.postponed = len(other) - len(taken)
        return known + taken

    def _extra(self, work: Callable[[], None]) -> None:
        try:  # the image index and the container records never cost the node records
            self.disk.guarded(work)
        except InventoryError:
            raise
        except Exception:
            log.exception("images or container records: failed, retried at the next scan")

    def _registry(self) -> None:
        """Write what the registry worker found since the last scan."""
        if self.registry is None:
            return
        self.registry.hold(None)
        from inventoryd.controller.images.registry_index import write_batches

        n = write_batches(self.inv, self.registry.drain())
        if n:
            log.info("registry: %d references written", n)

    def _job_envs(self) -> None:
        """Write the job environments the worker resolved since the last scan."""
        from inventoryd.controller.jobenv_index import write_job_envs

        n = write_job_envs(self.inv, self.jobenvs)
        if n:
            log.info("job environments: %d resolved", n)

    def _judge_steps(self) -> None:
        self.runtime.judge_pending()

    def _container_records(self, should_stop: Callable[[], bool]) -> None:
        res = self.containers.scan(self.inv, should_stop, writable=self.pressure is None)
        if res.accepted or res.rejected:
            log.info("container records: %d kept, %d rejected", res.accepted,
                     len(res.rejected))

    def _images(self, now_mono: float, should_stop: Callable[[], bool]) -> None:
        """The image index (``[images] roots``), every ``scan_interval_s``; each pass
        spends at most ``scan_budget_s`` scanning, the rest waits for the next cycle."""
        cfg = self.cfg.images
        if not cfg.roots or should_stop():
            return
        if now_mono - self._images_at < cfg.scan_interval_s:
            return
        from inventoryd.controller.images.index import OwnerTime, update_index

        if self.image_time is None:
            self.image_time = OwnerTime()
        res = update_index(self.inv, cfg, should_stop=should_stop, owners=self.image_time)
        # what is left is scanned at the next cycle, not after a whole interval
        self._images_at = now_mono if not res.left else -float("inf")
        if res.scanned or res.failed or res.gone:
            log.info("images: %d scanned, %d unreadable, %d gone, %d left in %.2fs",
                     len(res.scanned), len(res.failed), len(res.gone), res.left, res.seconds)

    def _prune(self, now_mono: float) -> None:
        """Bound the history (``inventory.history_days``) and the container records
        (``inventory.container_days``), at most once an hour."""
        if now_mono - self._pruned_at < PRUNE_EVERY_S:
            return
        self._pruned_at = now_mono
        inv = self.cfg.inventory
        n = self.inv.prune_history(time.time(), inv.history_days)
        if n:
            log.info("history: %d rows older than %d days deleted", n, inv.history_days)
        n = self.inv.prune_container_runs(time.time(), inv.container_days)
        if n:
            log.info("container records: %d older than %d days deleted", n,
                     inv.container_days)
        n = self.inv.prune_loads(time.time(), self.cfg.runtime.keep_days)
        if n:
            log.info("job loads: %d rows older than %g days deleted", n,
                     self.cfg.runtime.keep_days)

    # ---------------------------------------------------------------- disk pressure

    @property
    def pressure(self) -> str | None:
        """Why the inventory cannot grow now, or None."""
        return self.disk.state

    def _quota(self) -> Quota:
        c = self.cfg.collector
        return Quota(c.node_quota_bytes, c.max_changes_per_hour, self.pressure is None)

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
            except verify.Defer as e:
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
        written = self._ingest(accepted, rejected)
        if written is None:  # nothing could be written: all of it is read again
            result.unwritten += len(judged)
            self._digests.clear()
            return done, logged
        statuses, unwritten = written
        invalid = [
            Rejected(p.file, s.split(":", 1)[0] if s.startswith(REFUSED) else "malformed",
                     spool.host_of(p.file), s.split(": ", 1)[-1] if s.startswith(REFUSED)
                     else s, p.file_state)
            for p, s in zip(accepted, statuses, strict=True)
            if s.startswith(("invalid", *REFUSED))
        ]
        if invalid:
            self.disk.guarded(lambda: self.inv.ingest([], invalid))
        result.written |= bool(accepted or rejected)
        result.unwritten += len(unwritten)
        for name, st in judged:  # the first read of a state, then its confirmation
            if printable(name) in unwritten:
                continue  # read and judged again at the next scan
            state = _state_text(st)
            if self.seen.get(name) == state:
                self.confirmed.add(name)
            else:
                self.seen[name] = state
                self.confirmed.discard(name)
        by_shown = {printable(n): n for n, _ in judged}
        kept: list[Published] = []
        for p, status in zip(accepted, statuses, strict=True):
            if status.startswith(("invalid", "unwritten", *REFUSED)):
                continue
            kept.append(p)
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
        # what the kept records say their running jobs loaded (issue 42)
        self._extra(lambda: self.runtime.accepted(kept))
        for r in [*rejected, *invalid]:
            if r.file in unwritten:
                continue  # its row could not be written: judged again at the next scan
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

    def _ingest(self, accepted: list[Published], rejected: list[Rejected]
                ) -> tuple[list[str], set[str]] | None:
        """Write one batch: ``(a status per accepted record, the files not written)``, or
        None when nothing could be written. When the write fails for want of space (or
        of a writable disk), the batch is written again without growth (no history
        copies), then record by record: whatever fits is written, the rest is read and
        judged again at the next scan."""
        if not (accepted or rejected):
            return [], set()
        try:
            out = self.inv.ingest(accepted, rejected, quota=self._quota())
            self.disk.wrote(None)
            return out, set()
        except InventoryError as e:
            if not growth_failure(e):
                raise
            self.disk.wrote(e)
        lean = self._quota()  # keep_history is False now
        try:
            return self.inv.ingest(accepted, rejected, quota=lean), set()
        except InventoryError as e:
            if not growth_failure(e):
                raise
        statuses: list[str] = []
        unwritten: set[str] = set()
        for p in accepted:
            try:
                statuses += self.inv.ingest([p], quota=lean)
            except InventoryError as e:
                if not growth_failure(e):
                    raise
                statuses.append("unwritten")
                unwritten.add(p.file)
        if not self.disk.guarded(lambda: self.inv.ingest([], rejected)):
            unwritten.update(r.file for r in rejected)
        if len(unwritten) == len(accepted) + len(rejected):
            return None
        return statuses, unwritten

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
    return verify.ts(t)
