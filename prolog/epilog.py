"""Optional ``EpilogSlurmctld`` hook: diagnose a failed job and keep it in the audit trail.

    # slurm.conf (controller): the console script installed with the package
    EpilogSlurmctld=/opt/ncclguard/bin/ncclguard-epilog

For a job that failed (``SLURM_JOB_EXIT_CODE`` / ``SLURM_JOB_DERIVED_EC`` non-zero, or
the state from Slurm), it reads the job's StdOut/StdErr (``SLURM_JOB_STDOUT`` /
``SLURM_JOB_STDERR``, else the typed ``std_out`` / ``std_err`` / ``start_time`` of
``Slurm.job`` through :func:`job_logs`), diagnoses them, correlates with the inventory as of
the job's start, and appends one record ``{"action": "diagnose", ...}`` to the audit
trail, so that ``ncclguard decisions --job ID`` shows it.

Bounded and fail-safe: reading stops at ``--budget`` seconds (default 20) and says so;
the reading runs in a child process that is killed :data:`GRACE_S` seconds later if a
read never returns (a file on a stalled FUSE mount);
every error is logged to stderr and recorded when possible; the exit status is always 0,
so that the hook can never hold a job, a node or the controller.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

DEFAULT_BUDGET_S = 20.0
GRACE_S = 5.0  # past the budget, before the reading process is killed
MAX_RECORD_DIAGNOSES = 3  # the audit line stays small (audit.MAX_LINE is 64 KiB)


def failed(env: Mapping[str, str]) -> bool | None:
    """Whether the job failed, from the epilog's environment; None: cannot tell."""
    seen = False
    for key in ("SLURM_JOB_EXIT_CODE", "SLURM_JOB_DERIVED_EC"):
        v = env.get(key)
        if v is None or v == "":
            continue
        seen = True
        try:
            if int(v.split(":")[0]) != 0:
                return True
        except ValueError:
            continue
    code2 = env.get("SLURM_JOB_EXIT_CODE2")  # "<exit>:<signal>"
    if code2:
        seen = True
        if any(p.strip() not in ("", "0") for p in code2.split(":")):
            return True
    return False if seen else None


def record(report: Any, job_id: str, elapsed_ms: int) -> dict[str, Any]:
    """The audit record: the first diagnoses, their evidence locations, and the verdict."""
    from ncclguard.hostlist import compress

    diags = report.diagnoses[:MAX_RECORD_DIAGNOSES]
    first = diags[0] if diags else None
    summary = (
        f"ncclguard diagnose: {first.signature.id}: {first.summary}"
        if first
        else "ncclguard diagnose: no communication-stack signature found"
    )
    rec: dict[str, Any] = {
        "job": job_id,
        "action": "diagnose",
        "decision": "diagnosis",
        "summary": summary[:500],
        "odd_nodes": compress(first.odd_nodes) if first and first.odd_nodes else "",
        "nodes": report.job.get("nodes", "") if report.job else compress(report.evidence.hosts),
        "diagnoses": [
            {
                "id": d.signature.id,
                "summary": d.summary[:500],
                "odd_nodes": compress(d.odd_nodes) if d.odd_nodes else "",
                "evidence": [e.where for e in d.evidence[:5]],
                # the diagnosis's own: a fault every host shows alike is no node's
                "verdict": d.verdict,
                "family": d.family,
                "fix": d.fix,
                "confirm": d.confirm_command,
                "confirmed": d.confirmed,
            }
            for d in diags
        ],
        "disagreements": [x[:300] for x in report.disagreements[:10]],
        "problems": report.evidence.problems[:5],
        "files": report.evidence.files,
        "duration_ms": elapsed_ms,
    }
    if report.view is not None and hasattr(report.view.verdict, "summary"):
        rec["verdict"] = report.view.verdict.summary()
    return rec


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ncclguard-epilog", description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds of reading")
    ap.add_argument("--config", help="config file (default: $NCCLGUARD_CONFIG or /etc/...)")
    ap.add_argument("--always", action="store_true", help="diagnose successful jobs too")
    a = ap.parse_args(argv)
    env = os.environ if env is None else env
    t0 = time.monotonic()
    job_id = env.get("SLURM_JOB_ID", "")
    if not job_id.isdigit():
        print("ncclguard-epilog: no SLURM_JOB_ID; nothing to do", file=sys.stderr)
        return 0
    pid = os.fork()
    if pid == 0:  # the child reads; the parent holds the hard deadline
        try:
            _safe_run(a, env, job_id, t0)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    return _wait(pid, a, job_id, t0 + max(a.budget, 1.0) + GRACE_S)


def _safe_run(a: argparse.Namespace, env: Mapping[str, str], job_id: str, t0: float) -> None:
    try:
        _run(a, env, job_id, t0)
    except Exception as e:  # fail-safe: never hold a job over a diagnosis
        from ncclguard.text import safe  # a path or a log line of the job's: one line

        print(f"ncclguard-epilog: job {safe(job_id) or '?'}: {type(e).__name__}: "
              f"{safe(str(e))}", file=sys.stderr)


def _wait(pid: int, a: argparse.Namespace, job_id: str, limit: float) -> int:
    """Wait for the reading child until ``limit``, then kill it (SIGKILL: a read of a
    file on a stalled FUSE mount ends only on a fatal signal, issue 47's review: the
    deadline, checked between reads, held the Epilog for good) and record that."""
    import signal

    while True:
        done, _status = os.waitpid(pid, os.WNOHANG)
        if done:
            return 0
        if time.monotonic() > limit:
            break
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    why = (f"stopped: a read of the job's output did not return within the budget "
           f"({a.budget:g} s) and {GRACE_S:g} s more; the reading process was killed")
    print(f"ncclguard-epilog: job {job_id}: {why}", file=sys.stderr)
    try:
        from ncclguard import audit
        from ncclguard.policy import load_config

        cfg = load_config(a.config)
        audit.append(cfg.gate.audit_path(cfg.inventory),
                     {"job": job_id, "action": "diagnose", "decision": "diagnosis",
                      "error": why})
    except Exception as e:  # fail-safe
        print(f"ncclguard-epilog: job {job_id}: cannot record it: {type(e).__name__}: {e}",
              file=sys.stderr)
    return 0


def _run(a: argparse.Namespace, env: Mapping[str, str], job_id: str, t0: float) -> int:
    from ncclguard import audit
    from ncclguard.diagnose import JobLogs, job_logs, load_catalog, resolve_output, run
    from ncclguard.diagnose.logparse import LogError
    from ncclguard.policy import load_config

    is_failed = failed(env)
    if is_failed is False and not a.always:
        return 0
    cfg = load_config(a.config)
    deadline = t0 + max(a.budget, 1.0)
    nodes: tuple[str, ...] = ()
    if env.get("SLURM_JOB_NODELIST"):
        from ncclguard.hostlist import expand

        nodes = tuple(expand(env["SLURM_JOB_NODELIST"]))
    # a %N left in these is the batch host: the first node
    files = [
        resolve_output(env[k], nodes[0] if nodes else "")
        for k in ("SLURM_JOB_STDOUT", "SLURM_JOB_STDERR")
        if env.get(k)
    ]
    files = [f for i, f in enumerate(files) if f not in files[:i] and f != "/dev/null"]
    start = _float(env.get("SLURM_JOB_START_TIME"))
    job: JobLogs | None = None
    if not files or start is None:
        from ncclguard.slurm import Slurm, SlurmError

        remaining = max(deadline - time.monotonic(), 1.0)
        try:
            job = job_logs(Slurm.from_config(cfg.gate, timeout=min(5.0, remaining)), job_id)
        except SlurmError as e:
            from ncclguard.text import safe

            print(f"ncclguard-epilog: job {safe(job_id)}: Slurm: {safe(str(e))}",
                  file=sys.stderr)
        if job is not None:
            if is_failed is None and job.state in ("COMPLETED",) and not a.always:
                return 0
            files = files or list(job.files)
            nodes = nodes or job.nodes
            start = start if start is not None else job.start_time
    if job is None:
        job = JobLogs(job_id, nodes, start, tuple(files), env.get("SLURM_JOB_PARTITION") or None)
    readable = [f for f in files if os.path.isfile(f)]
    problems = [f"{f}: log file not found" for f in files if f not in readable]
    audit_path = cfg.gate.audit_path(cfg.inventory)
    if not readable:
        audit.append(
            audit_path,
            {
                "job": job_id,
                "action": "diagnose",
                "decision": "diagnosis",
                "summary": "ncclguard diagnose: no job output file to read",
                "problems": problems or ["Slurm named no StdOut/StdErr (interactive job?)"],
            },
        )
        return 0

    def opener() -> Any:
        from ncclguard.sched.classes import open_classes  # the tie-break reads the classes

        return open_classes(cfg.policy, cfg.inventory)

    try:
        report = run(
            readable,
            catalog=load_catalog(cfg.diagnose.signature_files),
            job=job,
            nodes=list(nodes) or None,
            open_inventory=opener,
            policy_config=cfg.policy,
            deadline=deadline,
            owner_uid=_job_uid(env, job),
        )
    except LogError as e:
        problems.append(str(e))
        audit.append(
            audit_path,
            {"job": job_id, "action": "diagnose", "decision": "diagnosis", "error": str(e)},
        )
        return 0
    report.evidence.problems.extend(problems)
    rec = record(report, job_id, int((time.monotonic() - t0) * 1000))
    audit.append(audit_path, rec)
    return 0


def _job_uid(env: Mapping[str, str], job: Any) -> int:
    """The job's uid: the Epilog (as SlurmUser) reads only output files that user owns.

    From ``SLURM_JOB_UID``, else from Slurm's record of the job; without either no file
    is trusted (uid -1 matches no file).
    """
    uid = env.get("SLURM_JOB_UID", "")
    if uid.isdigit():
        return int(uid)
    known = getattr(job, "uid", None)
    return known if isinstance(known, int) else -1


def _float(v: str | None) -> float | None:
    try:
        f = float(v) if v else None
    except ValueError:
        return None
    return f if f and f > 0 else None


if __name__ == "__main__":
    sys.exit(main())
