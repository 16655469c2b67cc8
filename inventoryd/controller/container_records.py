"""The collector's reading of the enroot hook's container records
(``<spool>/containers/<node>+<job>+<step>.rec``, docs/containers.md, issue 25).

A record is kept only when it is authentic and fresh (:mod:`inventoryd.controller.verify`), signed
from the named node's address, of a container record's shape with storable values
(:func:`ncclguard.spool.parse_container_record`, before anything is written), and
signed by the **owner of a job that ran on that node** (Slurm's ``user_id`` and node
list of the job its file names). Anything else is rejected alone, under a named cause
(:data:`CAUSES`), logged once per file state and counted.

The directory is the users' (mode 1733): the scan is bounded and fair. Per scan at most
:data:`STATS_PER_SCAN` files are looked at (new names first, then the others in turn
from where the last scan stopped: the new ones too, so that names a user makes to sort
first hold nothing back), a file whose mtime is past any credential's time to
live is not read, at most :data:`READS_PER_SCAN` files are read and decoded, taken one
file owner at a time in turn (a user who writes thousands of files waits behind
everyone else's), and at most :data:`JOBS_PER_SCAN` jobs are asked of Slurm. When
munged or Slurm cannot answer, the records wait for the next scan (nothing is judged
on an outage). Rows older than ``inventory.container_days`` are pruned.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inventoryd.controller import verify
from ncclguard import config as configmod
from ncclguard import spool
from ncclguard.hostlist import HostlistError, expand

if TYPE_CHECKING:
    from inventoryd.controller.addresses import Addresses
    from ncclguard.store import Inventory

__all__ = ["CAUSES", "JOBS_PER_SCAN", "READS_PER_SCAN", "STATS_PER_SCAN", "ContainerRecords"]

log = logging.getLogger("ncclguard.collector")

STATS_PER_SCAN = 4096
READS_PER_SCAN = 256
JOBS_PER_SCAN = 8
STEPS_PER_JOB = 256  # container records kept per job and node at most
JOB_CACHE_S = 60.0  # what Slurm said of a job is used this long
SLURM_RETRY_S = 30.0  # after Slurm failed, it is asked again this late at the earliest
SLURM_TIMEOUT_S = 5.0
LOG_PER_SCAN = 50
MUNGE_MAX_TTL_S = 3600  # munged's default --max-ttl: no credential lives longer by default

#: why a container record was rejected (the spool's causes, and three of its own)
CAUSES: dict[str, str] = {
    **{k: spool.CAUSES[k] for k in ("unreadable", "not-a-file", "oversized", "undecodable",
                                    "expired", "rewound", "unknown-node", "wrong-address",
                                    "malformed", "too-deep", "name-mismatch")},
    "unknown-job": "Slurm does not know the job the file names (or not its user)",
    "wrong-node": "the job the file names did not run on the node it names",
    "wrong-uid": "signed by a uid that is not the job's owner",
    "over-quota": f"more than {STEPS_PER_JOB} steps of one job on one node",
}


class _NotNow(Exception):
    """This scan asked Slurm about JOBS_PER_SCAN jobs already."""


@dataclass
class _Job:
    user_id: int | None
    nodes: frozenset[str]
    at: float


@dataclass
class ContainerScan:
    accepted: int = 0
    rejected: dict[str, str] = field(default_factory=dict)  # file -> cause
    left: int = 0  # candidates left for a later scan (the bounds above)
    deferred: str | None = None  # why the scan stopped (munged, Slurm)


class ContainerRecords:
    """What the collector knows of the container records' directory between scans."""

    def __init__(self, spool_dir: Path, config: configmod.Config, addresses: Addresses,
                 jobs: Callable[[str], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dir = spool_dir / spool.CONTAINER_SUBDIR
        self.cfg = config
        self.addresses = addresses
        self.ask_job = jobs or self._slurm_job
        self.clock = clock
        self.states: dict[str, str] = {}  # file -> the state last judged
        self.cursor = ""  # the known files are looked at in turn from here
        self.new_cursor = ""  # and the new ones from here
        self.counts: dict[str, int] = dict.fromkeys(CAUSES, 0)
        self.accepted = 0
        self.logged: dict[str, str] = {}  # file -> the cause last logged
        self.defer_state: str | None = None
        self._jobs: dict[str, _Job | None] = {}
        self._asked = 0  # Slurm lookups this scan
        self._slurm_failed_at = -float("inf")

    def _slurm_job(self, job: str) -> Any:
        from ncclguard.slurm import Slurm

        return Slurm.from_config(self.cfg.gate, timeout=SLURM_TIMEOUT_S).job_owner(job)

    # ------------------------------------------------------------------ one scan

    def scan(self, inv: Inventory, should_stop: Callable[[], bool], writable: bool
             ) -> ContainerScan:
        """One bounded pass; ``writable``: False under disk pressure (nothing is written,
        and nothing accepted is marked as judged: it is read again later)."""
        res = ContainerScan()
        try:
            with os.scandir(self.dir) as it:  # a name that is not a record's is never looked at
                names = sorted(e.name for e in it if e.is_file(follow_symlinks=False)
                               and spool.parse_container_record_name(e.name))
        except OSError:
            return res  # no such directory: the site does not record containers
        present = set(names)
        for gone in [n for n in self.states if n not in present]:
            del self.states[gone]
            self.logged.pop(gone, None)
        candidates = self._changed(names, inv, res)
        runs: list[dict[str, Any]] = []
        judged: dict[str, str] = {}  # file -> state, for the rejected
        self._asked = 0
        logged = 0
        for name, st in _fair(candidates)[:READS_PER_SCAN]:
            if should_stop():
                break
            parts = spool.parse_container_record_name(name)
            assert parts is not None
            state = _state(st)
            try:
                runs.append(self._judge(name, parts, st, state))
            except _NotNow:  # its job would be one Slurm lookup too many: the next scan
                res.left += 1
            except verify.Defer as e:
                res.deferred = str(e)
                break
            except verify.Reject as e:
                judged[name] = state
                res.rejected[name] = e.cause
                self.counts[e.cause] = self.counts.get(e.cause, 0) + 1
                if self.logged.get(name) != e.cause:
                    self.logged[name] = e.cause
                    logged += 1
                    if logged <= LOG_PER_SCAN:
                        log.warning("container record %s rejected (%s): %s",
                                    spool_name(name), e.cause, e.detail)
        res.left += max(0, len(candidates) - READS_PER_SCAN)
        self._defer_state(res.deferred)
        self.states.update(judged)
        if runs and writable:
            statuses = inv.write_container_runs(runs, max_steps=STEPS_PER_JOB)
            for run, status in zip(runs, statuses, strict=True):
                name = run.pop("_file")
                self.states[name] = run["file_state"]
                if status == "written":
                    self.accepted += 1
                    res.accepted += 1
                    self.logged.pop(name, None)
                else:  # the store refused it (a value it cannot bind, or over the bound)
                    cause = "over-quota" if status.startswith("over-quota") else "malformed"
                    res.rejected[name] = cause
                    self.counts[cause] += 1
                    log.warning("container record %s rejected (%s): %s", spool_name(name),
                                cause, status)
        self._jobs = {j: v for j, v in self._jobs.items()
                      if v is not None and self.clock() - v.at < JOB_CACHE_S}
        return res

    def _changed(self, names: list[str], inv: Inventory,
                 res: ContainerScan) -> list[tuple[str, os.stat_result]]:
        """The files to read this scan: stat at most STATS_PER_SCAN, new names first
        (at least three quarters of them when there are known ones), each kind in turn
        from where the last scan stopped; those unchanged, already stored, or older than
        any credential (not read, rejected as expired) left out. New names are taken in
        turn, not in name order: names that sort first, however many a user writes
        before each scan, do not keep the others from being looked at."""
        new = _from([n for n in names if n not in self.states], self.new_cursor)
        known = _from([n for n in names if n in self.states], self.cursor)
        take = min(len(new), STATS_PER_SCAN - min(len(known), STATS_PER_SCAN // 4))
        look = new[:take] + known[:STATS_PER_SCAN - take]
        res.left += len(new) + len(known) - len(look)
        if take:
            self.new_cursor = new[take - 1]
        if len(look) > take:
            self.cursor = look[-1]
        stored = inv.container_states()
        too_old = time.time() - max(self.cfg.spool.record_ttl_s, MUNGE_MAX_TTL_S) \
            - verify.FUTURE_SKEW_S
        out = []
        for name in look:
            parts = spool.parse_container_record_name(name)
            assert parts is not None  # (listed only if it parses)
            try:
                st = os.stat(self.dir / name, follow_symlinks=False)
            except OSError:
                continue
            state = _state(st)
            host, job, step = parts
            if stored.get((job, step, host)) == state or self.states.get(name) == state:
                self.states[name] = state  # known from now on: looked at in turn
                continue
            if st.st_mtime < too_old:  # written before any credential in it could live
                self.states[name] = state
                res.rejected[name] = "expired"
                self.counts["expired"] += 1
                continue
            out.append((name, st))
        return out

    def _judge(self, name: str, parts: tuple[str, str, str], st: os.stat_result,
               state: str) -> dict[str, Any]:
        """The row of one record, or :class:`verify.Reject` / :class:`verify.Defer`."""
        host, job, step = parts
        if not job.isdigit():
            raise verify.Reject("name-mismatch", f"{spool_name(name)}: job {job!r} is not a "
                                "Slurm job id")
        try:
            data = spool.read(self.dir / name, max_bytes=spool.MAX_CONTAINER_RECORD_BYTES)
        except spool.RecordError as e:
            raise verify.Reject(e.cause, e.detail) from None
        cred = verify.authentic(data, str(self.dir / name), self.cfg.spool.munge_socket or None)
        verify.from_node(self.addresses, host, cred.origin)
        try:
            rec = spool.parse_container_record(cred.payload, host=host, job=job, step=step,
                                               max_bytes=8 * spool.MAX_CONTAINER_RECORD_BYTES)
        except spool.RecordError as e:
            raise verify.Reject(e.cause, e.detail) from None
        info = self._job(job)
        if info is None or info.user_id is None:
            raise verify.Reject("unknown-job", f"Slurm does not know job {job}"
                                + ("'s user" if info is not None else "")
                                + " (it may have ended longer ago than MinJobAge)")
        if host not in info.nodes:
            raise verify.Reject("wrong-node", f"job {job} did not run on {host}")
        if cred.uid != info.user_id:
            raise verify.Reject("wrong-uid", f"signed by uid {cred.uid}; job {job} is uid "
                                f"{info.user_id}'s")
        view = spool.container_view(rec)
        assert view is not None  # parse_container_record checked it
        return {"job": job, "step": step, "host": host, "encoded_at": float(cred.encoded_at),
                "uid": cred.uid, "origin": cred.origin, "file_state": state,
                "nccl_version": view.nccl_version, "record": rec, "_file": name}

    def _job(self, job: str) -> _Job | None:
        """What Slurm says of ``job`` (cached); :class:`verify.Defer` when Slurm fails."""
        if job in self._jobs:
            return self._jobs[job]
        if self._asked >= JOBS_PER_SCAN:
            raise _NotNow
        self._asked += 1
        if self.clock() - self._slurm_failed_at < SLURM_RETRY_S:
            raise verify.Defer("Slurm did not answer (job lookups paused for "
                               f"{SLURM_RETRY_S:.0f} s)")
        try:
            info = self.ask_job(job)
        except Exception as e:  # a Slurm call: any failure waits for the next scan
            self._slurm_failed_at = self.clock()
            raise verify.Defer(f"Slurm: {type(e).__name__}: {str(e)[:200]}") from None
        if info is None:
            self._jobs[job] = None
            return None
        nodes: set[str] = set()
        for hostlist in (getattr(info, "nodes", ""), getattr(info, "batch_host", "")):
            try:
                nodes.update(expand(hostlist) if hostlist else ())
            except HostlistError:
                continue
        found = _Job(getattr(info, "user_id", None), frozenset(nodes), self.clock())
        self._jobs[job] = found
        return found

    def _defer_state(self, state: str | None) -> None:
        if state != self.defer_state:
            if state is None:
                log.info("container records are judged again")
            else:
                log.error("container records deferred to the next scan: %s", state)
            self.defer_state = state


def spool_name(name: str) -> str:
    """A container record's file name as logs show it (escaped)."""
    return verify.printable(name)


def _state(st: os.stat_result) -> str:
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def _from(names: list[str], cursor: str) -> list[str]:
    """``names`` (sorted) from the first one after ``cursor``, then from the start."""
    i = bisect.bisect_right(names, cursor)
    return names[i:] + names[:i]


def _fair(files: list[tuple[str, os.stat_result]]) -> list[tuple[str, os.stat_result]]:
    """One file of each owner in turn (by name within an owner)."""
    by_owner: dict[int, list[tuple[str, os.stat_result]]] = {}
    for item in files:
        by_owner.setdefault(item[1].st_uid, []).append(item)
    queues = [sorted(q, key=lambda t: t[0]) for _, q in sorted(by_owner.items())]
    out: list[tuple[str, os.stat_result]] = []
    for i in range(max((len(q) for q in queues), default=0)):
        out += [q[i] for q in queues if i < len(q)]
    return out
