"""``ncclguard-prolog``: the Slurm ``PrologSlurmctld`` gate. See docs/gate.md.

    SLURM_* env ─▶ Job ─▶ Inventory(readonly).load_values(nodes) ─▶ evaluate_values ─▶ Verdict
                                                                   │
        accept: log + audit, exit 0 (no Slurm call)                │
        warn:   AdminComment, log + audit, exit 0                  ▼
        refuse: AdminComment + notify, log + audit, exit 1; batch jobs: steer or hold
                through the detached follow-up (prolog/steer.py)

Errors (inventory missing/locked/corrupt, broken config, bad nodelist, Slurm failing)
fail open (exit 0) unless ``gate.on_error = "refuse"``, always with a loud log line
and an audit record. ``gate.deadline_s`` bounds the whole run with an interval timer
and caps every Slurm call; on expiry the run ends with the ``on_error`` outcome.

Hot path: only the standard library, the config, hostlist, the read-only store and the
policy are imported before a decision; the Slurm adapter only when a call is needed.

Over 500 lines: one run of the gate, from the environment to the exit status, shares its
deadline, its log and its audit record (the ``Run``) across decide, refuse and the
follow-up's start; the Job, the steering follow-up and the Epilog are modules of their own.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from collections.abc import Callable, Collection, Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ncclguard.config import Config
    from ncclguard.policy.verdict import Verdict
    from ncclguard.slurm import Slurm
    from ncclguard.store import GateValues, Inventory
    from prolog.job import Job
    from prolog.ownnccl import JobVars

EXIT_OK = 0
EXIT_REFUSE = 1
COMMENT_MAX = 400
_DEFAULT_DEADLINE_S = 5.0
DEADLINE_MARGIN_S = 0.2  # Slurm calls end this long before the deadline (the audit record)
#: Kept for the AdminComment (and notify) after the reads, out of what is left: reads that
#: wait for slurmctld's locks (a backfill cycle holds them up to 2 s at a time) cannot
#: take the time the comment needs. At most this share of the whole deadline.
COMMENT_RESERVE_S = 2.0
COMMENT_RESERVE_SHARE = 0.4
SHARED_WAIT_S = 1.0  # a run waits this long, at most, for another run's shared answer


class Run:
    """State of one prolog run, so that the deadline handler can finish it."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.t0 = time.monotonic()
        self.env = env
        self.job_id = env.get("SLURM_JOB_ID", "?")
        self.config: Config | None = None
        self.record: dict[str, Any] = {"job": _int_or(self.job_id)}
        self.finished = False
        # partitions -> their nodes and classes (one read a run, shared between runs)
        self.views: dict[frozenset[str], PartitionView] = {}
        # job id -> Slurm's record of it (one narrow read a run)
        self.jobs: dict[str, Any] = {}
        # judged by the job's own libnccl (prolog/ownnccl.py), not by the nodes' classes:
        # steering then asks only that enough other nodes exist (_cannot_steer)
        self.own_nccl = False

    @property
    def on_error(self) -> str:
        return self.config.gate.on_error if self.config else "accept"

    def elapsed_ms(self) -> float:
        return round((time.monotonic() - self.t0) * 1000, 1)

    def log(self, msg: str, *, error: bool = False) -> None:
        from ncclguard.text import safe

        # one line whatever a node, a record or a job put in the message: no value can
        # start a line of its own in the controller's log (docs/threat-model.md)
        line = (f"ncclguard-prolog[job {safe(str(self.job_id))}]: "
                f"{'ERROR: ' if error else ''}{safe(msg)}")
        try:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        except OSError:
            pass
        try:
            import syslog

            syslog.openlog("ncclguard-prolog", 0, syslog.LOG_DAEMON)
            syslog.syslog(syslog.LOG_ERR if error else syslog.LOG_INFO, line)
        except OSError:
            pass

    def audit(self, lock_timeout: float = 1.0, **fields: Any) -> None:
        self.record.update(fields)
        self.record["duration_ms"] = self.elapsed_ms()
        if self.config:
            path = self.config.gate.audit_path(self.config.inventory)
        else:
            from ncclguard.config import default_audit_path

            path = default_audit_path()
        try:
            from ncclguard import audit

            audit.append(path, self.record, lock_timeout=lock_timeout)
        except (OSError, ValueError) as e:
            self.log(f"cannot write the audit log {path}: {e}", error=True)

    def fail(self, what: str, err: BaseException | str, late: bool = False) -> int:
        """An error: the configured outcome (default: accept), loudly.

        ``late``: called from the deadline handler; the audit write then waits at most
        0.1 s for its lock and no Slurm command is run (their time is up). A hold is
        still arranged: starting the detached follow-up runs no Slurm command here.
        """
        from prolog.job import is_batch

        outcome = self.on_error
        lock_timeout = 0.1 if late else 1.0
        self.log(f"{what}: {err} -> {outcome} (gate.on_error = {outcome})", error=True)
        if outcome == "accept":
            self.audit(decision="error", action=outcome, error=f"{what}: {err}",
                       lock_timeout=lock_timeout)
            return EXIT_OK
        text = f"ncclguard: refused, gate error ({what}: {err})"
        batch = is_batch(self.env)
        action = "refuse"
        count = self._error_refusals()
        if batch and self.config and count >= self.config.gate.max_refusals:
            # fail closed must not requeue a batch job for ever: hold it, as for refusals
            text += f" | held: refused {count} times (gate.max_refusals)"
            try:
                _spawn(self, self.job_id, "hold", [], text)
                action = "hold"
            except OSError as e:
                self.log(f"cannot start the follow-up: {e}", error=True)
            self.log(f"{text} -> hold", error=True)
        self.audit(decision="error", action=action, error=f"{what}: {err}", refusal=count,
                   lock_timeout=lock_timeout)
        if late:
            return EXIT_REFUSE
        _set_comment(self, self.job_id, text)
        if not batch:
            _best_effort(self, lambda s: s.notify(self.job_id, text))
        return EXIT_REFUSE

    def _error_refusals(self) -> int:
        restarts = self.env.get("SLURM_JOB_RESTART_COUNT", "")
        return (int(restarts) if restarts.isdigit() else 0) + 1


def _int_or(v: str) -> int | str:
    return int(v) if v.isdigit() else v


def _slurm(run: Run, *, reads: bool = False) -> Slurm:
    """The adapter, every call bounded by what is left of the deadline. ``reads``: for
    the reads before the AdminComment, which leave it :func:`_comment_reserve` s."""
    from ncclguard.slurm import Slurm

    total = run.config.gate.deadline_s if run.config else _DEFAULT_DEADLINE_S
    deadline = run.t0 + total - DEADLINE_MARGIN_S
    if reads:
        deadline -= _comment_reserve(total)
    gate = run.config.gate if run.config else None
    left = max(deadline - time.monotonic(), 0.0)
    return Slurm.from_config(gate, timeout=left, deadline=deadline)


def _comment_reserve(deadline_s: float) -> float:
    """What the reads leave the AdminComment: 2 s of a 5 s deadline (one call that waits
    out a backfill cycle's lock), 40 % of a shorter one."""
    return min(COMMENT_RESERVE_S, COMMENT_RESERVE_SHARE * deadline_s)


SEPARATOR = " || "  # between others' AdminComment text and ours: ours never holds it


def merge_admin_comment(existing: str, ours: str, limit: int | None = None) -> str:
    """The AdminComment to set: what someone else wrote stays, in order, ahead of ours,
    joined by :data:`SEPARATOR`; only our earlier text (a requeued job's: a segment that
    starts ``ncclguard:``) is replaced. ``ours`` is never cut for theirs: theirs is
    shortened first. ``limit``: Slurm's text bound as the adapter sends it
    (``ncclguard.slurm.model.MAX_TEXT``)."""
    if limit is None:
        from ncclguard.slurm.model import MAX_TEXT

        limit = MAX_TEXT
    kept = [seg.strip() for seg in existing.split(SEPARATOR)]
    theirs = SEPARATOR.join(seg for seg in kept if seg and not seg.startswith("ncclguard:"))
    if not theirs:
        return ours
    room = limit - len(ours) - len(SEPARATOR)
    if room < 20:
        return ours
    if len(theirs) > room:
        theirs = theirs[: room - 3] + "..."
    return f"{theirs}{SEPARATOR}{ours}"


def _set_comment(run: Run, job_id: int | str, text: str) -> str:
    """Set our AdminComment, keeping what someone else set there (issue 12: the warn
    path overwrote it), and return what was set. When the current one cannot be read,
    ours is set alone."""
    from ncclguard.slurm import SlurmError

    existing = ""
    try:
        info = _job_info(run, job_id)
        existing = info.admin_comment if info is not None else ""
    except SlurmError as e:
        run.log(f"slurm: {e}", error=True)
    merged = merge_admin_comment(existing, text)
    _best_effort(run, lambda s: s.set_admin_comment(job_id, merged))
    return merged


def _job_info(run: Run, job_id: int | str) -> Any:
    """Slurm's record of the job (``JobInfo`` or None), asked once per run: the steering
    check and the AdminComment both read it. A narrow read (``Slurm.job_brief``: that one
    job, whatever the queue holds). A failure raises and is not remembered."""
    key = str(job_id)
    if key not in run.jobs:
        run.jobs[key] = _slurm(run, reads=True).job_brief(job_id)
    return run.jobs[key]


def _best_effort(run: Run, call: Any) -> bool:
    """One Slurm call whose failure is logged, not fatal."""
    from ncclguard.slurm import SlurmError

    try:
        call(_slurm(run))
        return True
    except SlurmError as e:
        run.log(f"slurm: {e}", error=True)
        return False


# --------------------------------------------------------------------------- decision


def _inventory(run: Run, values: GateValues | None = None) -> Inventory:
    """The inventory, read-only, its busy wait capped at what is left of the deadline;
    ``values``: the policy's (default ``GATE_VALUES``; with the classes for a tie-break).

    SQLite waits for a lock inside C, where the deadline's signal handler cannot run;
    uncapped, a locked inventory would hold the prolog for the whole busy timeout.
    """
    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    cfg = run.config
    assert cfg is not None
    left_ms = (cfg.gate.deadline_s - (time.monotonic() - run.t0) - 0.3) * 1000
    busy_ms = int(max(min(cfg.inventory.busy_timeout_ms, left_ms), 0))
    return Inventory(readonly=True, values=values or GATE_VALUES,
                     config=cfg.inventory.replace(busy_timeout_ms=busy_ms))


def decide(run: Run, job: Job) -> int:
    from ncclguard.policy import evaluate_image, stale_hosts
    from ncclguard.policy.rules.container import is_path_image  # loaded with the policy
    from ncclguard.store import InventoryError

    cfg = run.config
    assert cfg is not None
    image = job.image_path
    image_values = None
    registry_row: dict | None = None
    registry_host: str | None = None  # a registry reference's registry
    own, resolved = _job_env(run, job) if not image else None, None
    try:
        with _inventory(run) as inv:
            records = inv.load_values(job.nodes)
            if own is not None and own.own:
                resolved = inv.load_job_env(own.key, check_file=True)
            if image.startswith("/"):
                image_values = inv.load_image_values(image, check_file=True)
            elif image and not is_path_image(image):  # a registry reference
                from ncclguard.fingerprint.imageref import RefError, parse

                try:
                    ref = parse(image)
                    run.record["image_ref"] = ref.key
                    registry_row = inv.load_registry_values(ref.key)
                    registry_host = ref.registry
                except RefError as e:
                    run.record["image_ref_error"] = str(e)
            written_at, pressure = inv.writer_state()
            holds = inv.canary_holds(job.nodes) if cfg.canary.enabled else {}
            owner = inv.canary_owner() if holds else None
    except InventoryError as e:
        return run.fail("inventory", e)
    from ncclguard.policy.freshness import writer_note

    note = writer_note(written_at, pressure, time.time())
    if note:  # a frozen inventory: the records below are as old as it is
        run.log(note)
        run.record["inventory"] = note
    stale = stale_hosts({h: r[1] for h, r in records.items() if r is not None},
                        time.time(), cfg.inventory.stale_after_s)
    values = {h: (r[0] if r is not None else None) for h, r in records.items()}
    if registry_host is not None:
        from ncclguard.policy.rules.container import registry_image

        image_values = registry_image(registry_row, time.time(), cfg.registry, registry_host)
        if registry_row is not None:
            run.record["image_digest"] = registry_row.get("digest")
            run.record["image_resolved_at"] = registry_row.get("resolved_at")
    if image:
        run.record["image"] = image
        verdict = evaluate_image(values, cfg.policy, image, image_values, stale,
                                 job.partition or None)
    else:
        from prolog import ownnccl

        verdict = ownnccl.judge(values, cfg.policy, stale, job.partition or None, own,
                                resolved)
        if resolved is not None:
            run.record["job_nccl"] = ownnccl.summary(resolved)
            run.own_nccl = resolved.library is not None
    # refuse path only: several minimum odd sets, ask which to keep (host stacks only)
    if verdict.odd_tie and not image and not run.own_nccl:
        from prolog import ownnccl

        verdict, run.record["tie_break"] = _break_tie(
            run, job, verdict, lambda prefer: ownnccl.judge(
                values, cfg.policy, stale, job.partition or None, own, resolved, prefer))
    if holds:  # nodes held until a canary passes (docs/canary.md)
        from ncclguard.policy.canary import gate_holds, submitted_by_service

        # a row names its canary by job id; only a job the service can have submitted
        # (its name, the inventory owner's uid) may be that job: ids are reused
        ours = submitted_by_service(job.name, job.uid, owner)
        verdict, canary = gate_holds(verdict, holds, int(job.job_id) if ours else 0)
        run.record["canary_held"] = sorted(holds)
        if canary:
            run.record["canary"] = True
    run.record.update(
        decision=verdict.decision,
        # which check decided: Slurm placing the job on one class (the gate accepted or
        # warned: classes ignore warn-level differences), or the gate (no class group,
        # or the group's class no longer held: the backstop)
        path="features" if job.class_group and verdict.decision != "refuse" else "gate",
        summary=verdict.summary(),
        findings=[f.to_dict() for f in verdict.findings],
        odd_nodes=verdict.odd_nodes,
        stale=sorted(stale),
        notes=list(verdict.notes),
    )
    if stale:  # the inventory's freshness, in the controller's log: an outage shows
        from ncclguard.policy.rules.unknown_node import age_text

        ages = [a for a in stale.values() if a >= 0]
        oldest = f", oldest heartbeat {age_text(max(ages))} old" if ages else ""
        run.log(f"{len(stale)} of {len(job.nodes)} nodes stale{oldest}: compared by their "
                "last known record")
    if verdict.decision == "accept":
        run.log(f"accept {job.nodelist}: {verdict.summary()}")
        run.audit(action="none")
        return EXIT_OK
    if verdict.decision == "warn":
        run.log(verdict.summary())
        _set_comment(run, job.job_id, verdict.summary())
        run.audit(action="none")
        return EXIT_OK
    return refuse(run, job, verdict)


def _job_env(run: Run, job: Job) -> JobVars | None:
    """A batch job's loading variables from its saved environment (prolog/ownnccl.py),
    recorded for the collector; None for a job that has none, or when it is not read."""
    cfg = run.config
    assert cfg is not None
    if not (job.batch and cfg.gate.read_job_env):
        return None
    from prolog import ownnccl

    env, why = ownnccl.read(cfg.gate, job.job_id, job.array_job_id)
    if env is None:
        run.record["job_env_error"] = why
        return None
    if env.inputs:
        run.record["job_env"] = env.record(job.uid)
    if env.nccl:  # applied to each node by the verdict (ncclguard/policy/jobvars.py)
        from ncclguard.text import cut

        # the user's values, cut as in every message (a line that outgrows the audit's
        # bound loses its findings: ncclguard.audit); JSON escapes the rest
        run.record["job_nccl_vars"] = {k: cut(v) for k, v in env.nccl.items()}
    if env.problems:
        run.record["job_env_problems"] = list(env.problems)
    return env


class PartitionView:
    """The nodes of some partitions and their classes (the configured refuse-level
    rules' class keys, the classes Slurm's features name): what the tie-break and the
    steering check need of the cluster. Its cost does not grow with the
    cluster's other partitions: one narrow Slurm read (``scontrol show partition``) and
    the inventory's classes of these nodes, shared between concurrent runs
    (:mod:`prolog.shared`). ``members``: the partitions' node lists as Slurm wrote them
    (compressed); ``classes``: each class's hosts, largest first (JSON lists: at 16,384
    nodes 200 KB, read in 2 ms, where compressing them cost 60 to 90 ms a run)."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        members, classes = doc.get("members"), doc.get("classes")
        if not isinstance(members, str) or not isinstance(classes, list) or not all(
                isinstance(c, list) and all(isinstance(h, str) for h in c) for c in classes):
            raise ValueError("not a partition view")
        self.members_text = members
        self.classes: list[list[str]] = classes

    def members(self) -> list[str]:
        from ncclguard.hostlist import expand

        return sorted(set(expand(self.members_text))) if self.members_text else []

    def largest_without(self, removed: set[str], need: int) -> int:
        """The size of the largest class once ``removed`` is taken out when it is below
        ``need``; some size of at least ``need`` otherwise. ``removed`` is the odd and the
        excluded nodes (few): a class is looked into only when they could make the
        difference."""
        best = 0
        for hosts in self.classes:  # largest first
            size = len(hosts)
            if size <= best:
                break
            if size - len(removed) >= need:
                return size
            best = max(best, size - len(removed.intersection(hosts)))
            if best >= need:
                break
        return best


def _partition_view(run: Run, partitions: set[str]) -> PartitionView:
    """The view of ``partitions``, once per run: as a concurrent run wrote it (at most
    ``gate.shared_max_age_s`` old), else computed here and written for the others."""
    key = frozenset(partitions)
    view = run.views.get(key)
    if view is None:
        view = run.views[key] = PartitionView(_shared_view(run, sorted(key)))
    return view


def _shared_view(run: Run, names: list[str]) -> dict[str, Any]:
    from prolog.shared import SharedError, shared

    cfg = run.config
    assert cfg is not None
    if cfg.gate.shared_max_age_s <= 0:
        return _compute_view(run, names)
    left = run.t0 + cfg.gate.deadline_s - _comment_reserve(cfg.gate.deadline_s) - time.monotonic()
    try:
        doc, how = shared(cfg.gate.shared_path(cfg.inventory), _view_file(names),
                          "partitions " + ",".join(names), cfg.gate.shared_max_age_s,
                          min(SHARED_WAIT_S, max(left, 0.0) / 2),
                          lambda: _compute_view(run, names))
    except SharedError as e:  # the directory: not shared, never wrong
        run.log(f"shared work: {e}; computed for this run alone", error=True)
        return _compute_view(run, names)
    run.record["shared"] = how
    return doc


def _view_file(names: list[str]) -> str:
    import zlib

    return f"partitions-{zlib.crc32(','.join(names).encode()):08x}.json"


#: Above this many nodes, the view reads every node's class key and keeps the partition's
#: in Python, rather than ask SQLite for that many names (one ``json_each`` a chunk).
FILTER_IN_SQL_MAX = 4096


def _compute_view(run: Run, names: list[str]) -> dict[str, Any]:
    """One narrow Slurm read (every partition's node list, compressed) and the
    inventory's classes of these partitions' nodes."""
    from ncclguard.hostlist import HostlistError, expand
    from ncclguard.slurm import SlurmSchemaError

    cfg = run.config
    assert cfg is not None

    lists = _slurm(run, reads=True).partitions()
    members: set[str] = set()
    for name in names:
        if name not in lists:  # the job's own partition: Slurm's answer is not whole
            raise SlurmSchemaError(f"scontrol show partition: no partition {name!r} in "
                                   f"Slurm's answer (it names {len(lists)})")
        try:
            members.update(expand(lists[name]) if lists[name] else ())
        except HostlistError as e:
            raise SlurmSchemaError(f"scontrol show partition: {name} has Nodes="
                                   f"{lists[name][:200]!r}: {e}") from None
    by_key: dict[str, list[str]] = {}
    if members:
        from ncclguard.policy.schedule import class_values

        # the classes Slurm schedules by (ncclguard/sched/classes.py); opened after Slurm
        # answered: its wait is capped at what is left then
        with _inventory(run, class_values(cfg.policy)) as inv:
            few = len(members) <= FILTER_IN_SQL_MAX
            keys = inv.class_keys(sorted(members) if few else None)
        for host, key in sorted(keys.items()):
            if key is not None and host in members:
                by_key.setdefault(key, []).append(host)
    classes = [hosts for _, hosts in sorted(by_key.items(), key=lambda kv: (-len(kv[1]), kv[0]))]
    return {"members": ",".join(lists[n] for n in names if lists[n]), "classes": classes}


def _break_tie(
    run: Run, job: Job, verdict: Verdict, again: Callable[[Collection[str]], Verdict]
) -> tuple[Verdict, str | None]:
    """The policy's one tie-break (:func:`ncclguard.policy.break_tie`): keep the largest
    class of the job's partition, as Slurm lists its nodes (of the whole inventory when
    Slurm cannot say). A failed inventory read keeps the choice by name. ``again``: the
    job's verdict with nodes to keep (``prefer``)."""
    from ncclguard.policy import break_tie
    from ncclguard.slurm import SlurmError
    from ncclguard.store import InventoryError

    cfg = run.config
    assert cfg is not None

    views: list[PartitionView] = []

    def members(names: set[str]) -> list[str]:
        try:
            view = _partition_view(run, names)
        except (SlurmError, OSError, ValueError) as e:
            run.log(f"tie-break: partition nodes unknown ({e}); using the whole inventory")
            return []
        views.append(view)
        return view.members()

    def classes(among: list[str] | None) -> list[list[str]]:
        if among is not None and views:  # the partition's classes, as its view holds them
            return views[-1].classes
        # the classes of this config (ncclguard/sched/classes.py), as Slurm's features;
        # opened after Slurm was asked: its busy wait is capped at what is left by then
        from ncclguard.policy.schedule import class_values

        with _inventory(run, class_values(cfg.policy)) as inv:
            return [c.hosts for c in inv.classes(among)]

    try:
        return break_tie(
            verdict,
            again=again,
            classes=classes,
            members=members,
        )
    except InventoryError as e:
        run.log(f"tie-break: {e}; odd nodes chosen by name", error=True)
        return verdict, f"none ({e})"


def _comment(verdict: Verdict, suffix: str) -> str:
    return verdict.summary(limit=max(COMMENT_MAX - len(suffix), 80)) + suffix


def refuse(run: Run, job: Job, verdict: Verdict) -> int:
    from ncclguard.hostlist import compress
    from ncclguard.slurm import SlurmError
    from ncclguard.store import InventoryError

    cfg = run.config
    assert cfg is not None
    gate = cfg.gate
    summary = verdict.summary()
    if not job.batch:
        # salloc/srun: Slurm kills the job; the user's terminal gets the notify line.
        _set_comment(run, job.job_id, summary)
        _best_effort(run, lambda s: s.notify(job.job_id, summary))
        run.log(f"{summary} -> interactive job killed")
        run.audit(action="kill")
        return EXIT_REFUSE

    count = job.restart_count + 1  # this refusal; restarts count the earlier ones
    odd = verdict.odd_nodes
    hold_reason = ""
    steerable = True
    if count >= gate.max_refusals:
        hold_reason = f"refused {count} times (gate.max_refusals = {gate.max_refusals})"
    elif gate.steering == "hold":
        hold_reason = "incompatible nodes (gate.steering = hold)"
    elif gate.steering == "steer":
        if not odd:
            hold_reason = "no odd nodes to steer away from"
        else:
            try:
                hold_reason = _cannot_steer(run, job, odd)
            except (SlurmError, InventoryError, OSError, ValueError) as e:
                # without the check, steering could leave the job PENDING for ever
                # (BadConstraints): requeue it plainly, and max_refusals still bounds it
                run.log(f"steering check failed: {e}; requeueing without steering", error=True)
                steerable = False
    if hold_reason:
        action = "hold"
        suffix = f" | held: {hold_reason}"
    elif gate.steering == "steer" and odd and steerable:
        action = "steer"
        suffix = f" | requeued without {compress(odd)} (refusal {count}/{gate.max_refusals})"
    else:
        action = "requeue"
        suffix = f" | requeued (refusal {count}/{gate.max_refusals})"
    comment = _comment(verdict, suffix)
    comment = _set_comment(run, job.job_id, comment)  # the follow-up sets it again: merged
    if action in ("steer", "hold"):
        try:
            spawn_followup(run, job, action, odd, comment)
        except OSError as e:
            run.log(f"cannot start the follow-up: {e}", error=True)
            action = "requeue"
    run.log(f"{comment} -> {action}")
    run.audit(action=action, refusal=count, hold_reason=hold_reason or None)
    return EXIT_REFUSE


def _cannot_steer(run: Run, job: Job, odd: list[str]) -> str:
    """Why excluding ``odd`` cannot give the job a compatible set ('' if it can)."""
    from ncclguard.hostlist import compress, expand
    from ncclguard.policy import partitions_of

    cfg = run.config
    assert cfg is not None
    if job.partition:  # known from the environment: read the job and the view at once
        _overlapped(run, lambda: _job_info(run, job.job_id),
                    lambda: _partition_view(run, partitions_of(job.partition)))
    info = _job_info(run, job.job_id)  # the thread's answer; asked again if it failed
    required = set(expand(info.required_nodes)) if info and info.required_nodes else set()
    pinned = required & set(odd)
    if pinned:
        return f"pinned with -w to {compress(pinned)}"
    excluded = set(expand(info.excluded_nodes)) if info and info.excluded_nodes else set()
    partition = job.partition or (info.partition if info else "")
    view = _partition_view(run, partitions_of(partition)) if partition else None
    if run.own_nccl:
        # the classes are the nodes' own stacks, which a job of its own NCCL does not
        # load: only whether enough other nodes exist (a set that holds another node its
        # NCCL cannot use is refused again, and max_refusals bounds that)
        left = len(set(view.members()) - excluded - set(odd)) if view else 0
        if left < job.num_nodes:
            return (f"partition {partition} has {left} nodes without {compress(odd)}, "
                    f"the job needs {job.num_nodes}")
        return ""
    largest = view.largest_without(excluded | set(odd), job.num_nodes) if view else 0
    if largest < job.num_nodes:
        return (
            f"the largest compatible class in partition {partition} without "
            f"{compress(odd)} has {largest} nodes, the job needs {job.num_nodes}"
        )
    return ""


def _overlapped(run: Run, waiting: Any, working: Any) -> None:
    """Run ``waiting`` (a read that mostly waits for slurmctld) in a thread while
    ``working`` runs here; both are bounded by the reads' deadline. ``working``'s error
    propagates; ``waiting``'s is dropped (its caller asks again, and fails then)."""
    import contextlib
    import threading

    def quietly() -> None:
        with contextlib.suppress(Exception):  # asked again by the caller, which reports it
            waiting()

    t = threading.Thread(target=quietly, name="slurm-read", daemon=True)
    t.start()
    try:
        working()
    finally:
        t.join()


def spawn_followup(run: Run, job: Job, action: str, odd: list[str], comment: str) -> None:
    """Start prolog/steer.py detached (own session, no inherited fds), and return."""
    _spawn(run, job.job_id, action, odd, comment)


def _spawn(run: Run, job_id: int | str, action: str, odd: list[str], comment: str) -> None:
    import subprocess

    from ncclguard.hostlist import compress

    cfg = run.config
    assert cfg is not None
    slurm = _slurm(run)
    argv = [
        sys.executable, "-I", "-m", "prolog.steer",
        "--job", str(job_id), "--action", action,
        "--wait", str(cfg.gate.steer_wait_s),
        "--audit", str(cfg.gate.audit_path(cfg.inventory)),
    ]  # fmt: skip
    if odd:
        argv += ["--exclude", compress(odd)]
    if action == "hold":
        argv += ["--comment", comment]
    if slurm.conf:
        argv += ["--conf", slurm.conf]
    if slurm.bin_dir:
        argv += ["--bin-dir", str(slurm.bin_dir)]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C"}
    subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd="/",
        close_fds=True,
        start_new_session=True,
        preexec_fn=_lower_priority,  # the gate is single-threaded here (the read joined)
    )


#: The follow-up's nice value: in a burst of refusals it starts while other gates still
#: run, and each one polls squeue; it never needs the CPU before them or slurmctld.
FOLLOWUP_NICE = 10


def _lower_priority() -> None:
    os.nice(FOLLOWUP_NICE)


# --------------------------------------------------------------------------- entry


def _arm_deadline(run: Run, seconds: float) -> None:
    def expired(signum: int, frame: FrameType | None) -> None:
        if run.finished:
            return
        run.finished = True
        code = run.fail("deadline", f"gate.deadline_s = {seconds:g} s reached", late=True)
        os._exit(code)

    signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def main(env: Mapping[str, str] | None = None) -> int:
    """One gate run over ``env`` (default: this process's): the exit status for Slurm.
    The program ``ncclguard-prolog`` is :func:`run_as_program`."""
    environ = os.environ if env is None else env
    run = Run(environ)
    _arm_deadline(run, _DEFAULT_DEADLINE_S)
    try:
        return _main(run)
    except Exception as e:  # a bug must not stop the cluster: on_error decides
        return run.fail("internal error", f"{type(e).__name__}: {e}")
    finally:
        run.finished = True
        signal.setitimer(signal.ITIMER_REAL, 0)


def _main(run: Run) -> int:
    from ncclguard.config import ConfigError
    from ncclguard.policy import load_config

    try:
        run.config = load_config()
    except ConfigError as e:
        return run.fail("config", e)
    # the configured deadline replaces the default one, counted from the start
    _arm_deadline(run, max(run.config.gate.deadline_s - (time.monotonic() - run.t0), 0.01))

    from prolog.job import Job, JobError

    try:
        job = Job.from_env(run.env)
    except JobError as e:
        return run.fail("job", e)
    run.job_id = str(job.job_id)
    run.record.update(
        user=job.user,
        partition=job.partition,
        nodes=job.nodelist,
        num_nodes=job.num_nodes,
        batch=job.batch,
        restart_count=job.restart_count,
    )
    if run.config.gate.allow_opt_out and job.opted_out:
        run.log(f"accept {job.nodelist}: opted out (ncclguard=off), not checked")
        run.audit(decision="accept", action="opt-out", summary="ncclguard: accept: opted out")
        return EXIT_OK

    from ncclguard.policy import in_scope

    note = in_scope(run.config.policy, job.partition or None, job.num_nodes)
    if note is not None:  # no inventory read for single-node or unguarded jobs
        run.audit(decision="accept", action="skip", summary=f"ncclguard: accept: {note}")
        return EXIT_OK
    return decide(run, job)


def run_as_program() -> None:
    """The program ``ncclguard-prolog``: :func:`main` in a process of its own.

    One short-lived process per job that frees nothing before it exits: the cyclic garbage
    collector would only cost it time (passes over the imports and the inventory's records).
    """
    gc.disable()
    sys.exit(main())


if __name__ == "__main__":
    run_as_program()
