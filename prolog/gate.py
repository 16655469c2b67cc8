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
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from collections.abc import Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ncclguard.config import Config
    from ncclguard.policy.verdict import Verdict
    from ncclguard.slurm import Slurm
    from ncclguard.store import Inventory
    from prolog.job import Job

EXIT_OK = 0
EXIT_REFUSE = 1
COMMENT_MAX = 400
_DEFAULT_DEADLINE_S = 5.0
SLURM_CALL_S = 2.0  # one Slurm command, at most (the deadline caps it further)


class Run:
    """State of one prolog run, so that the deadline handler can finish it."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.t0 = time.monotonic()
        self.env = env
        self.job_id = env.get("SLURM_JOB_ID", "?")
        self.config: Config | None = None
        self.record: dict[str, Any] = {"job": _int_or(self.job_id)}
        self.finished = False
        # partitions -> their nodes (one sinfo a run)
        self.members: dict[frozenset[str], list[str]] = {}
        # job id -> Slurm's record of it (one squeue a run: on 22.05 it lists every job)
        self.jobs: dict[str, Any] = {}

    @property
    def on_error(self) -> str:
        return self.config.gate.on_error if self.config else "accept"

    def elapsed_ms(self) -> float:
        return round((time.monotonic() - self.t0) * 1000, 1)

    def log(self, msg: str, *, error: bool = False) -> None:
        line = f"ncclguard-prolog[job {self.job_id}]: {'ERROR: ' if error else ''}{msg}"
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


def _slurm(run: Run) -> Slurm:
    from ncclguard.slurm import Slurm

    deadline = run.t0 + (run.config.gate.deadline_s if run.config else _DEFAULT_DEADLINE_S) - 0.2
    gate = run.config.gate if run.config else None
    return Slurm.from_config(gate, timeout=SLURM_CALL_S, deadline=deadline)


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
    check and the AdminComment both read it. A failure raises and is not remembered."""
    key = str(job_id)
    if key not in run.jobs:
        run.jobs[key] = _slurm(run).job(job_id)
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


def _inventory(run: Run) -> Inventory:
    """The inventory, read-only, its busy wait capped at what is left of the deadline.

    SQLite waits for a lock inside C, where the deadline's signal handler cannot run;
    uncapped, a locked inventory would hold the prolog for the whole busy timeout.
    """
    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    cfg = run.config
    assert cfg is not None
    left_ms = (cfg.gate.deadline_s - (time.monotonic() - run.t0) - 0.3) * 1000
    busy_ms = int(max(min(cfg.inventory.busy_timeout_ms, left_ms), 0))
    return Inventory(
        readonly=True, values=GATE_VALUES, config=cfg.inventory.replace(busy_timeout_ms=busy_ms)
    )


def decide(run: Run, job: Job) -> int:
    from ncclguard.policy import evaluate_image, evaluate_values, stale_hosts
    from ncclguard.store import InventoryError

    cfg = run.config
    assert cfg is not None
    image = job.image_path
    image_values = None
    try:
        with _inventory(run) as inv:
            records = inv.load_values(job.nodes)
            if image.startswith("/"):
                image_values = inv.load_image_values(image)
    except InventoryError as e:
        return run.fail("inventory", e)
    stale = stale_hosts({h: r[1] for h, r in records.items() if r is not None},
                        time.time(), cfg.inventory.stale_after_s)
    values = {h: (r[0] if r is not None else None) for h, r in records.items()}
    if image:
        run.record["image"] = image
        verdict = evaluate_image(values, cfg.policy, image, image_values, stale,
                                 job.partition or None)
    else:
        verdict = evaluate_values(values, cfg.policy, stale, job.partition or None)
    # refuse path only: several minimum odd sets, ask which to keep (host stacks only)
    if verdict.odd_tie and not image:
        verdict, run.record["tie_break"] = _break_tie(run, job, verdict, values, stale)
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


def _partition_nodes(run: Run, partitions: set[str]) -> list[str]:
    """The nodes of any of ``partitions``, asked of Slurm once per run."""
    key = frozenset(partitions)
    members = run.members.get(key)
    if members is None:
        names = [n.name for n in _slurm(run).nodes() if key & set(n.partitions)]
        members = run.members[key] = sorted(set(names))
    return members


def _break_tie(
    run: Run, job: Job, verdict: Verdict, values: Mapping[str, Any], stale: Mapping[str, float]
) -> tuple[Verdict, str | None]:
    """The policy's one tie-break (:func:`ncclguard.policy.break_tie`): keep the largest
    class of the job's partition, as Slurm lists its nodes (of the whole inventory when
    Slurm cannot say). A failed inventory read keeps the choice by name."""
    from ncclguard.policy import break_tie, evaluate_values
    from ncclguard.slurm import SlurmError
    from ncclguard.store import InventoryError

    cfg = run.config
    assert cfg is not None

    def members(names: set[str]) -> list[str]:
        try:
            return _partition_nodes(run, names)
        except SlurmError as e:
            run.log(f"tie-break: partition nodes unknown ({e}); using the whole inventory")
            return []

    def classes(among: list[str] | None) -> list[list[str]]:
        # opened after Slurm was asked: its busy wait is capped at what is left by then
        with _inventory(run) as inv:
            return [c.hosts for c in inv.classes(among)]

    try:
        return break_tie(
            verdict,
            again=lambda prefer: evaluate_values(
                values, cfg.policy, stale, job.partition or None, prefer
            ),
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
    info = _job_info(run, job.job_id)
    required = set(expand(info.required_nodes)) if info and info.required_nodes else set()
    pinned = required & set(odd)
    if pinned:
        return f"pinned with -w to {compress(pinned)}"
    excluded = set(expand(info.excluded_nodes)) if info and info.excluded_nodes else set()
    partition = job.partition or (info.partition if info else "")
    members = _partition_nodes(run, partitions_of(partition)) if partition else []
    candidates = sorted(set(members) - excluded - set(odd))
    with _inventory(run) as inv:
        classes = inv.classes(candidates) if candidates else []
    largest = max((len(c.hosts) for c in classes), default=0)
    if largest < job.num_nodes:
        return (
            f"the largest compatible class in partition {partition} without "
            f"{compress(odd)} has {largest} nodes, the job needs {job.num_nodes}"
        )
    return ""


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
    )


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
