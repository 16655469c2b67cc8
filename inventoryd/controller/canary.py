"""``ncclguard-inventoryd canary``: a changed node rejoins its class only after a canary
job on it and a known-good peer passes (issue 43, docs/canary.md). On the controller, as
the ``ncclguard`` user (``systemd/ncclguard-canary.service``): it writes the inventory's
canary tables and submits, releases and cancels its own jobs; it needs no Slurm admin.

Each ``[canary] interval_s`` (15 s), one pass:

1. each node's class now (the inventory's :meth:`~ncclguard.store.Inventory.class_keys`)
   against its row (:func:`ncclguard.policy.canary.observe`): a node that changed, or
   first appears, is held; one whose class returned to its vetted one is let go; a canary
   whose nodes changed again while it ran is cancelled;
2. each running canary job is asked after (``squeue -j``): ``COMPLETED`` lets its changed
   nodes join their class; any other end (failed, timed out, cancelled, node failure)
   keeps them held, with the job id and the last lines of its output in the reason; one
   pending past ``pending_timeout_s`` (its peers were taken) is cancelled and tried again,
   and so is one another of whose nodes changed under it (a peer, or a node it shared);
   a job under that id that is not the service's (Slurm reuses ids) is no result;
3. when nodes wait, the service's own canary jobs that no row names (a submission whose
   answer was lost) are cancelled, and nothing is submitted in that pass; else Slurm's
   node states (one ``nodes()`` read) and :func:`ncclguard.policy.canary.plan` choose the
   canaries to start, at most ``max_running`` at once. Each is submitted held (``sbatch
   -H``), written as running, then released: the gate (``prolog/gate.py``) lets a held
   node into a job only when the inventory names that job as its canary and the job is
   the service's (its name, its user), so the job id is written before it can start.

A change of the policy's classes (a rule's severity, a release's values) moves every class
key and no stack: the nodes are re-keyed, none held for it. The history is bounded
(``inventory.history_days``, :data:`HISTORY_PER_HOST` per node).

Held nodes get no class feature (``ncclguard.sched.sync.desired``): job_submit.lua never
offers them to a multi-node job, and the gate refuses a multi-node job that has one. A
Slurm drain is never set or lifted here: an admin's drain stays, and the node's canary
waits until the node is idle. A pass that cannot reach Slurm submits nothing (the loop
logs it once and tries again at the next pass).
"""

from __future__ import annotations

import errno
import logging
import os
import shlex
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from inventoryd.loop import Outcome, log_to_stderr, serve
from inventoryd.sdnotify import Notifier
from ncclguard import audit
from ncclguard import config as configmod
from ncclguard.hostlist import HostlistError, compress, expand
from ncclguard.policy import stale_hosts
from ncclguard.policy.canary import (
    JOB_NAME,
    Launch,
    describe,
    observe,
    ok_row,
    plan,
    time_limit_minutes,
)
from ncclguard.policy.schedule import class_policy, class_values
from ncclguard.slurm import Slurm
from ncclguard.slurm.model import NodeInfo
from ncclguard.store import Inventory, InventoryError
from ncclguard.text import safe

__all__ = ["JOB_NAME", "CanaryService", "run"]

log = logging.getLogger("ncclguard.canary")

#: node flags under which a node is not free for a canary (besides an admin's drain)
NOT_FREE = frozenset({"DRAIN", "DRAINING", "DRAINED", "NOT_RESPONDING", "COMPLETING",
                      "MAINTENANCE", "RESERVED", "POWERED_DOWN", "POWERING_DOWN",
                      "POWERING_UP", "POWER_DOWN", "REBOOT_REQUESTED", "REBOOT_ISSUED",
                      "FAIL", "PLANNED", "INVALID_REG"})
TAIL_BYTES = 4096  # read of the canary's output, from its end
TAIL_LINES = 5
TAIL_LINE_CHARS = 110  # each of them, escaped: the reason's 600 characters hold all five
LOST_AFTER_S = 60.0  # a job Slurm does not list this long after its submission is lost
RUN_GRACE_S = 120.0  # past its time limit by this much (Slurm missed it): cancelled
PRUNE_EVERY_S = 3600.0  # the history is bounded this often:
HISTORY_PER_HOST = 1000  # each node's newest events kept (and none past history_days)


def _free(n: NodeInfo) -> bool:
    return n.state == "idle" and not (set(n.flags) & NOT_FREE) and not n.drained


def _why_busy(n: NodeInfo) -> str:
    if n.drained:
        return f"drained ({safe(n.reason) or 'no reason'}), left as the admin set it"
    flags = ",".join(sorted(set(n.flags) & NOT_FREE))
    return f"{n.state}{'+' + flags if flags else ''} in Slurm"


class CanaryService:
    """The service's state (:class:`inventoryd.loop.Service`): only its config; every
    fact is in the inventory and in Slurm, read again each pass."""

    label = "canary"
    what = "pass"

    def __init__(self, config: configmod.Config, slurm: Slurm | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = config
        self.slurm = slurm or Slurm.from_config(config.gate)
        self.clock = clock
        self._pruned_at = -float("inf")  # the service's clock when it last pruned

    def started(self) -> str:
        c = self.cfg.canary
        return (f"config {self.cfg.source}, command {shlex.join(c.command)!r}, at most "
                f"{c.max_running} at once, settle {c.settle_s:g}s")

    def step(self, should_stop: Callable[[], bool] = lambda: False) -> Outcome:
        return Outcome(note=self.apply() or None)

    def delay(self, ok: bool) -> float:
        return self.cfg.canary.interval_s

    def reloaded(self, config: configmod.Config) -> CanaryService:
        return CanaryService(config)

    def close(self, *, replaced: bool = False) -> None:
        pass

    def _inventory(self) -> Inventory:
        return Inventory(values=class_values(self.cfg.policy), config=self.cfg.inventory)

    def apply(self) -> str:
        """One pass; what it did, in words (for the log and the tests)."""
        if not self.cfg.canary.enabled:
            return "[canary] enabled = false: nothing held"
        now = self.clock()
        policy = class_policy(self.cfg.policy)
        with self._inventory() as inv:
            keys = inv.class_keys()
            rows = inv.canary_nodes()
            first = inv.canary_adopted() is None
            was = inv.canary_policy()
            if not first and was is not None and was != policy:
                return self._rekey(inv, rows, keys, now, policy)
            upd, events, cancel = observe(rows, keys, now, self.cfg.canary.settle_s,
                                          first=first)
            if first:
                inv.canary_write(list(upd.values()), events, adopted=now, policy=policy)
                return f"first pass: {len(upd)} nodes taken as vetted in their classes"
            if was is None:  # rows of a release that did not record it: theirs is this one
                inv.canary_write([], policy=policy)
            self._prune(inv, now)
            notes: list[str] = []
            if upd:
                if not inv.canary_write(list(upd.values()), events, expect=_expect(rows, upd)):
                    return "the canary's rows changed meanwhile (an admin): next pass"
                rows = {**rows, **upd}
                held = [e["host"] for e in events if e["event"] == "held"]
                if held:
                    notes.append(f"held {compress(held)}")
            for job in sorted(cancel):
                self._cancel(job, "its nodes' stack moved while it ran")
            notes += self._follow(inv, rows, now)
            if any(r["state"] in ("waiting", "approval") for r in rows.values()):
                notes += self._start(inv, rows, keys, now)
        return "; ".join(notes)

    def _rekey(self, inv: Inventory, rows: dict[str, dict[str, Any]],
               keys: Mapping[str, str | None], now: float, policy: str) -> str:
        """The policy's classes changed (an admin moved a rule's severity, or a release
        reads the records another way): every class key moved, and no node's stack did.
        The vetted nodes are vetted in their new class; a held one keeps its state (its
        canary still decides), under its new key."""
        upd: dict[str, dict[str, Any]] = {}
        for host, r in rows.items():
            key = keys.get(host)
            if key is None:
                continue
            if r["state"] == "ok":
                upd[host] = ok_row(host, key, now)
            elif r["class_key"] != key:
                upd[host] = dict(r, class_key=key, updated_at=now)
        if not inv.canary_write(list(upd.values()), policy=policy,
                                expect=_expect(rows, upd)):
            return "the canary's rows changed meanwhile (an admin): next pass"
        log.info("the policy's classes changed (class policy %s): %d nodes under their new "
                 "class keys, none held for it", policy, len(upd))
        return f"the policy's classes changed: {len(upd)} nodes under their new class keys"

    def _prune(self, inv: Inventory, now: float) -> None:
        """Bound the history: events past ``inventory.history_days``, and each node's past
        its newest :data:`HISTORY_PER_HOST` (a node that flaps its stack writes one per
        change), at most once per :data:`PRUNE_EVERY_S`."""
        if now - self._pruned_at < PRUNE_EVERY_S:
            return
        self._pruned_at = now
        days = self.cfg.inventory.history_days
        n = inv.prune_canary_history(now - days * 86400 if days > 0 else None,
                                     per_host=HISTORY_PER_HOST)
        if n:
            log.info("canary history: %d events deleted (history_days %d, %d per node)", n,
                     days, HISTORY_PER_HOST)

    # ------------------------------------------------------------ running canaries
    def _follow(self, inv: Inventory, rows: dict[str, dict[str, Any]], now: float
                ) -> list[str]:
        jobs: dict[int, list[str]] = {}
        for host, r in rows.items():
            if r["state"] == "running" and r["job_id"] is not None:
                jobs.setdefault(int(r["job_id"]), []).append(host)
        notes = []
        for job, hosts in sorted(jobs.items()):
            info = self.slurm.job_progress(job)
            submitted = min(float(rows[h]["submitted_at"] or now) for h in hosts)
            upd: dict[str, dict[str, Any]] = {}
            events: list[dict[str, Any]] = []
            other = info is not None and not _ours(info)
            moved = _peers_moved(rows, hosts)
            if info is None or other:
                if not other and now - submitted < LOST_AFTER_S:
                    continue
                gone = (f"job {job} is now another job ({safe(info.name)!r} of uid "
                        f"{info.user_id}): Slurm's job ids went round"
                        if other and info is not None else "gone from Slurm")
                _again(rows, hosts, now, job, upd, events, "lost", gone,
                       f"waiting: its canary job {job} is gone from Slurm without a result; "
                       "tried again")
            elif moved and info.state != "COMPLETED":
                # another of its nodes (a peer, or a changed node it shares) moved its
                # stack under it: the gate refuses the job, or it was cancelled for that
                # node. Not these nodes' failure: tried again (a node that flaps cannot
                # keep the others of its canary held)
                if info.state not in _ENDED:
                    self._cancel(job, f"{moved}, of its nodes, changed while it ran")
                _again(rows, hosts, now, job, upd, events, "retry",
                       f"{moved}, of its nodes, changed",
                       f"waiting: its canary job {job} was stopped: {moved}, of its nodes, "
                       "changed under it; tried again")
            elif info.state == "PENDING":
                if now - submitted > self.cfg.canary.pending_timeout_s:
                    self._cancel(job, "pending too long")
                    _again(rows, hosts, now, job, upd, events, "retry", "pending too long",
                           f"waiting: its canary job {job} pended {now - submitted:.0f}s (its "
                           "peers were taken); tried again")
                else:
                    if info.priority == 0 and now - submitted > 2 * self.cfg.canary.interval_s:
                        self._release(job)  # a pass that stopped between submit and release
                    continue
            elif info.state not in _ENDED:  # running, or a state this release adds
                started = info.start_time or submitted
                if now - started > self.cfg.canary.time_limit_s + RUN_GRACE_S:
                    self._cancel(job, "past its time limit")
                continue
            elif info.state == "COMPLETED":
                for h in hosts:
                    upd[h] = ok_row(h, rows[h]["class_key"], now)
                    events.append(_event(h, now, "passed", rows[h], job,
                                         f"canary job {job} passed on {rows[h]['job_nodes']}"))
                notes.append(f"canary {job} passed: {compress(hosts)} back in their class")
            else:  # failed, timed out, cancelled, node failure, ...
                tail = self._tail(job)
                why = f" ({safe(info.state_reason)})" if info.state_reason not in (
                    "", "None") else ""
                text = (f"its canary job {job} ended {safe(info.state)}{why} on "
                        f"{rows[hosts[0]]['job_nodes']}" + (f": {tail}" if tail else ""))
                for h in hosts:
                    upd[h] = dict(rows[h], state="failed", updated_at=now, reason=text)
                    events.append(_event(h, now, "failed", rows[h], job, text))
                log.error("canary %s of %s failed: %s", job, compress(hosts), text)
                notes.append(f"canary {job} failed: {compress(hosts)} stay held")
            if upd and inv.canary_write(list(upd.values()), events, expect=_expect(rows, upd)):
                rows.update(upd)
        return notes

    def _tail(self, job: int) -> str:
        """The last lines of the canary's output, escaped; "" without ``output_dir``.
        Read only from a regular file this service's user owns (the job runs as it), not
        through a link (nor a second name of another file), in a directory no one else
        can write."""
        out = self.cfg.canary.output_dir
        if not out:
            return ""
        unsafe = _unsafe_dir(out)
        if unsafe:
            return f"(its output: {unsafe})"
        path = Path(out) / f"{JOB_NAME}-{job}.out"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            why = "a link" if e.errno == errno.ELOOP else (e.strerror or str(e))
            return f"(its output {safe(str(path))}: {why})"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                return f"(its output {safe(str(path))}: not a file of this service's user)"
            if st.st_nlink != 1:
                return f"(its output {safe(str(path))}: has {st.st_nlink} names (a hard link))"
            os.lseek(fd, max(st.st_size - TAIL_BYTES, 0), os.SEEK_SET)
            data = os.read(fd, TAIL_BYTES)
        finally:
            os.close(fd)
        lines = [ln.strip() for ln in data.decode("utf-8", "replace").splitlines() if ln.strip()]
        # each line cut to its share, so that a long one (a node's padding) hides no other
        return " | ".join(safe(ln)[:TAIL_LINE_CHARS] for ln in lines[-TAIL_LINES:])

    def _cancel(self, job: int, why: str) -> None:
        from ncclguard.slurm import SlurmError

        try:
            self.slurm.cancel(job)
            log.info("cancelled canary job %s: %s", job, why)
        except SlurmError as e:
            log.warning("cannot cancel canary job %s (%s): %s", job, why, e)

    def _release(self, job: int) -> None:
        from ncclguard.slurm import SlurmError

        try:
            self.slurm.release(job)
        except SlurmError as e:
            log.warning("cannot release canary job %s: %s", job, e)

    # ------------------------------------------------------------ new canaries
    def _partition(self) -> str | None:
        return self.cfg.canary.partition or self.slurm.default_partition()

    def _start(self, inv: Inventory, rows: dict[str, dict[str, Any]],
               keys: Mapping[str, str | None], now: float) -> list[str]:
        # the canary jobs Slurm has of ours that no row names: a submission whose answer
        # was lost (sbatch timed out, printed no job id) or whose rows were not written.
        # Pending ones are cancelled, and nothing is submitted in this pass: a Slurm that
        # takes jobs but does not answer gets one at a time, not one per pass.
        named = {int(r["job_id"]) for r in rows.values()
                 if r["state"] == "running" and r["job_id"] is not None}
        orphans = [j for j in self.slurm.own_jobs(JOB_NAME) if j.job_id not in named]
        stray = [j.job_id for j in orphans if j.state == "PENDING"]
        for job in stray:
            self._cancel(job, "no row names it (a submission whose answer was lost)")
        if stray:
            return [f"cancelled canary job{'s' if len(stray) > 1 else ''} "
                    f"{', '.join(map(str, stray))} that no row names; nothing submitted"]
        part = self._partition()
        idle: set[str] = set()
        why: dict[str, str] = {}
        for n in self.slurm.nodes():
            if part is not None and part not in n.partitions:
                why[n.name] = f"not in the canary's partition {part}"
            elif _free(n):
                idle.add(n.name)
            else:
                why[n.name] = _why_busy(n)
        beats = inv.heartbeats()
        stale = stale_hosts({h: beats[h] for h in rows if h in beats}, now,
                            self.cfg.inventory.stale_after_s)
        # running canaries: the rows' and ours no row names any more (an admin's approve
        # leaves its canary to end): at most max_running of them run at once
        running = len(named) + len(orphans)
        p = plan(rows, keys, idle, why, running, self.cfg.canary, now, stale)
        if p.rows and inv.canary_write(list(p.rows.values()), expect=_expect(rows, p.rows)):
            rows.update(p.rows)
        notes = []
        for launch in p.launches:
            notes.append(self._launch(inv, rows, launch, now))
        return [n for n in notes if n]

    def _launch(self, inv: Inventory, rows: dict[str, dict[str, Any]], launch: Launch,
                now: float) -> str:
        c = self.cfg.canary
        every = [*launch.nodes, *launch.peers]
        script = (f"#!/bin/sh\n# {JOB_NAME}: {describe(launch)}\n"
                  f"exec {shlex.join(c.command)}\n")
        out = "/dev/null"
        if c.output_dir:  # written by the job as this service's user: where no one else
            unsafe = _unsafe_dir(c.output_dir)  # can put a link to one of its files first
            if unsafe:
                log.error("canary of %s: its output is not kept: %s", describe(launch), unsafe)
            else:
                out = f"{c.output_dir.rstrip('/')}/{JOB_NAME}-%j.out"
        args = ["-J", JOB_NAME, "-H", "--exclusive", "--no-requeue", "-N", str(len(every)),
                "-w", compress(every), "-t", str(time_limit_minutes(c.time_limit_s)),
                "-o", out, "-e", out, "--comment", f"ncclguard canary of {compress(launch.nodes)}"]
        for flag, value in (("-p", c.partition), ("-q", c.qos), ("-A", c.account)):
            if value:
                args += [flag, value]
        job = self.slurm.submit(args, script)
        upd = {}
        events = []
        for h in launch.nodes:
            r = rows[h]
            upd[h] = dict(r, state="running", job_id=job, job_nodes=compress(every),
                          submitted_at=now, attempts=int(r["attempts"] or 0) + 1, updated_at=now,
                          reason=f"its canary job {job} runs: {describe(launch)}")
            events.append(_event(h, now, "submitted", r, job, describe(launch)))
        try:
            written = inv.canary_write(list(upd.values()), events, expect=_expect(rows, upd))
        except InventoryError:
            self._cancel(job, "its rows could not be written")  # held: it never ran
            raise
        if not written:
            self._cancel(job, "its nodes' rows changed before it was released")
            return ""
        rows.update(upd)
        self._release(job)
        log.info("canary job %s submitted: %s", job, describe(launch))
        return f"canary {job} for {describe(launch)}"


_ENDED = ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY",
          "BOOT_FAIL", "DEADLINE", "PREEMPTED", "REVOKED", "SPECIAL_EXIT")


def _ours(info: Any) -> bool:
    """Whether a job Slurm lists under a canary's id is a canary of this service (its
    name, its user): Slurm reuses ids (they wrap, and restart with a new state)."""
    return (info.user_id is None or info.user_id == os.geteuid()) and \
        (not info.name or info.name == JOB_NAME)


def _peers_moved(rows: Mapping[str, Mapping[str, Any]], hosts: list[str]) -> str:
    """A canary's other nodes (its peers, and the changed nodes it vetted whose stack
    moved again, no longer running it) held now, as a hostlist; "" when none is."""
    try:
        every = expand(str(rows[hosts[0]]["job_nodes"] or ""))
    except HostlistError:
        return ""
    moved = [p for p in every if p not in hosts and p in rows and rows[p]["state"] != "ok"]
    return compress(moved) if moved else ""


def _unsafe_dir(path: str) -> str:
    """Why the canary's output directory is not safe to write the job's output into and
    read it back from (:func:`ncclguard.audit.check_dir`: a directory only this user or
    root can write), escaped; "" when it is safe."""
    try:
        audit.check_dir(Path(path), "the canary's output")
    except OSError as e:
        return safe(str(e))
    return ""


def _expect(rows: Mapping[str, Mapping[str, Any]], upd: Mapping[str, Any]
            ) -> dict[str, tuple[str, int | None]]:
    return {h: ((rows[h]["state"], rows[h]["job_id"]) if h in rows else ("", None))
            for h in upd}


def _again(rows: Mapping[str, Mapping[str, Any]], hosts: list[str], now: float, job: int,
           upd: dict[str, dict[str, Any]], events: list[dict[str, Any]], event: str,
           detail: str, reason: str) -> None:
    """Send the nodes of canary ``job`` back to ``waiting`` (it ended without a verdict
    on them: lost, stopped by another node's change, pended too long), into ``upd`` and
    ``events``."""
    for h in hosts:
        upd[h] = dict(rows[h], state="waiting", job_id=None, updated_at=now, reason=reason)
        events.append(_event(h, now, event, rows[h], job, detail))


def _event(host: str, at: float, event: str, row: Mapping[str, Any], job: int | None,
           detail: str) -> dict[str, Any]:
    return {"at": at, "host": host, "event": event, "class_key": row.get("class_key"),
            "job_id": job, "detail": detail, "by": "ncclguard"}


def run(config_path: str | None, config: configmod.Config, *,
        notifier: Notifier | None = None, max_passes: int | None = None) -> int:
    """The service (:func:`inventoryd.loop.serve`): a pass every ``interval_s``."""
    log_to_stderr(log)
    return serve(CanaryService(config), log, config_path=config_path, notifier=notifier,
                 max_steps=max_passes)

