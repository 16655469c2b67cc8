"""The collector's join of what running job steps loaded (issue 42, docs/runtime.md).

Each accepted node record may carry ``loaded`` (:mod:`ncclguard.fingerprint.loaded`): the
steps of that node whose processes mapped a libnccl or an NCCL plugin. :class:`Runtime`
stores them (``job_loads``), and judges each step whose libraries changed on some node
against its other nodes (:func:`ncclguard.policy.loaded.judge`, the one home of the
verdict). A step found mixed is kept once (``mixed_steps``), logged, counted
(``ncclguard_mixed_steps_found_total``), and, with ``[runtime] on_mixed = "requeue"``,
its job is acted on once:

- a batch job is requeued (``scontrol requeue``) with an AdminComment that says why, and
  the gate's own detached follow-up (``prolog/steer.py``, started as the gate starts it)
  adds the odd nodes to its ExcNodeList once it is PENDING, so that it runs elsewhere;
- an interactive job is told (``scontrol notify``) and cancelled (``scancel``);
- a job of an exempt user or partition (``[runtime] exempt_users``,
  ``exempt_partitions``), or one opted out (``ncclguard=off``, when
  ``gate.allow_opt_out``), or outside the guarded partitions, is only recorded.

Work is bounded: at most :data:`JUDGE_PER_SCAN` steps are judged and
:data:`ACTIONS_PER_SCAN` jobs acted on per scan (the rest wait for the next); a Slurm call
that fails is recorded as the action's result and never retried in a loop.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ncclguard import config as configmod
from ncclguard.policy.loaded import Mixed, judge, node_load
from ncclguard.text import safe

if TYPE_CHECKING:
    from ncclguard.slurm import Slurm
    from ncclguard.store import Inventory
    from ncclguard.store.records import Published

__all__ = ["ACTIONS_PER_SCAN", "JUDGE_PER_SCAN", "Runtime"]

log = logging.getLogger("ncclguard.collector")

JUDGE_PER_SCAN = 512
ACTIONS_PER_SCAN = 8
STEER_WAIT_S = 60.0


def _before_the_plugin(loads: Sequence[Any], rows: Sequence[dict[str, Any]]) -> bool:
    """Whether a node found without a net plugin said so in a record older than the
    newest of those with one: it may have been scanned before its NCCL set up its net
    (which its other nodes' did since), so its absence is no evidence yet."""
    seen = {r["host"]: float(r["seen_at"] or 0.0) for r in rows}
    with_net = [seen[n.host] for n in loads if n.net_chosen and n.plugins.get("net")]
    without = [seen[n.host] for n in loads if n.net_chosen and "net" not in n.plugins]
    return bool(with_net and without) and min(without) < max(with_net)


class Runtime:
    def __init__(self, cfg: configmod.Config, inv: Inventory,
                 slurm: Slurm | None = None) -> None:
        self.cfg = cfg
        self.inv = inv
        self.slurm = slurm
        self.pending: set[tuple[str, str]] = set()
        self.found = 0  # mixed steps found since start (the metric's counter)
        self.acted: dict[str, int] = {}  # action result -> jobs, since start

    def accepted(self, records: Sequence[Published]) -> None:
        """Store what the accepted ``records`` say their nodes' steps loaded."""
        # a step's rows are dated by the node's scan (the clock its "since" is on; a
        # credential's time is whole seconds), never past the record's own time
        docs = [(str(p.loaded["host"]), p.loaded,
                 min(float(p.loaded["scanned_at"]), p.at + 1.0)) for p in records
                if p.loaded is not None]
        if docs:
            self.pending |= self.inv.write_loaded(docs)

    def judge_pending(self, now: float | None = None) -> list[tuple[str, str, Mixed]]:
        """Judge the steps whose libraries changed; the newly mixed ones."""
        now = time.time() if now is None else now
        todo = sorted(self.pending)[:JUDGE_PER_SCAN]
        self.pending.difference_update(todo)
        out = []
        by_job: dict[str, list[dict[str, Any]]] = {}
        for job, _ in todo:
            if job not in by_job:
                by_job[job] = self.inv.job_loads(job, current=True)
        for job, step in todo:
            rows = [r for r in by_job[job] if r["step"] == step]
            # each node's net is judged as of its own record (a node gone silent does not
            # settle past its last word)
            loads = [node_load(r["host"], r["libs"], r["since"], r["seen_at"] or now,
                               self.cfg.runtime.settle_s) for r in rows]
            verdict = judge(loads)
            if verdict is None:
                continue
            if verdict.kind == "net-missing" and _before_the_plugin(loads, rows):
                self.pending.add((job, step))  # judged again on its nodes' next records
                continue
            if self.inv.record_mixed(job, step, now, verdict.kind, verdict.summary,
                                     verdict.groups, verdict.odd):
                self.found += 1
                log.warning("job %s step %s is mixed: %s", job, step, safe(verdict.summary))
                out.append((job, step, verdict))
        acted = 0
        for job, _step, verdict in out:
            if self.cfg.runtime.on_mixed == "requeue" and acted < ACTIONS_PER_SCAN:
                acted += 1
                self.act(job, verdict, now)
        return out

    # ---- acting on a mixed job

    def _exempt(self, info: Any) -> str | None:
        from ncclguard.policy import in_scope
        from ncclguard.policy.optout import opted_out

        rt = self.cfg.runtime
        if info.partition and set(info.partition.split(",")) & set(rt.exempt_partitions):
            return f"partition {info.partition} is exempt ([runtime] exempt_partitions)"
        if (info.user and info.user in rt.exempt_users) or (
                info.user_id is not None and str(info.user_id) in rt.exempt_users):
            return f"user {info.user or info.user_id} is exempt ([runtime] exempt_users)"
        if self.cfg.gate.allow_opt_out and opted_out(info.comment,
                                                     str(info.raw.get("extra") or "")):
            return "the job opted out (ncclguard=off)"
        note = in_scope(self.cfg.policy, info.partition or None, max(info.node_count, 2))
        return note

    def act(self, job: str, verdict: Mixed, now: float) -> str:
        """Requeue (batch) or cancel (interactive) mixed job ``job`` once; the result."""
        from ncclguard.hostlist import HostlistError, compress, expand
        from ncclguard.slurm import SlurmError

        if any(m.get("action") for m in self.inv.mixed_steps(job)):
            return "already"  # at most one action per job: a requeued job's next run too
        if self.slurm is None:
            return self._done(job, "none", "no Slurm to act through", now)
        try:
            info = self.slurm.job(job)
        except SlurmError as e:
            return self._done(job, "failed", f"cannot read the job: {e}", now)
        if info is None or info.state not in ("RUNNING", "CONFIGURING"):
            return self._done(job, "skipped", f"job is {info.state if info else 'gone'}", now)
        # a node's record speaks for that node: one that claims a step of a job Slurm did
        # not give it is not believed enough to act on
        try:
            allocated = set(expand(info.nodes)) if info.nodes else set()
        except HostlistError:
            allocated = set()
        strangers = sorted({h for _, hosts in verdict.groups for h in hosts} - allocated)
        if strangers:
            return self._done(job, "skipped", f"{compress(strangers)} not the job's nodes "
                              f"({info.nodes or 'none'}): their records are not believed", now)
        why = self._exempt(info)
        if why is not None:
            return self._done(job, "exempt", why, now)
        odd = compress(verdict.odd)
        reason = f"ncclguard: mixed NCCL, {verdict.summary}"
        left = (info.end_time - now) if info.end_time else None
        saved = f"; up to {left:.0f} s of its time limit on {info.node_count} nodes" \
            if left and left > 0 else ""
        try:
            if info.batch:
                self.slurm.set_admin_comment(job, f"{reason} (requeued away from {odd})")
                self.slurm.run("scontrol", ["requeue", str(job)])
                self._steer(job, odd)
                return self._done(job, "requeued",
                                  f"requeued, steered away from {odd}{saved}", now)
            self.slurm.notify(job, f"{reason}: cancelled, resubmit to run on one class")
            self.slurm.run("scancel", [str(job)])
            return self._done(job, "cancelled", f"interactive: cancelled{saved}", now)
        except SlurmError as e:
            return self._done(job, "failed", str(e), now)

    def _steer(self, job: str, odd: str) -> None:
        """The gate's detached follow-up (prolog/steer.py), started as the gate starts it:
        once the job is PENDING, its ExcNodeList gains the odd nodes."""
        g = self.cfg.gate
        argv = [sys.executable, "-I", "-m", "prolog.steer", "--job", str(job),
                "--action", "steer", "--exclude", odd, "--wait", str(STEER_WAIT_S),
                "--audit", str(g.audit_path(self.cfg.inventory))]
        if g.slurm_conf:
            argv += ["--conf", g.slurm_conf]
        if g.slurm_bin_dir:
            argv += ["--bin-dir", g.slurm_bin_dir]
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)

    def _done(self, job: str, result: str, detail: str, now: float) -> str:
        if self.inv.set_mixed_action(job, self.cfg.runtime.on_mixed, f"{result}: {detail}",
                                     now):
            self.acted[result] = self.acted.get(result, 0) + 1
            log.warning("job %s (mixed): %s: %s", job, result, safe(detail))
        return result
