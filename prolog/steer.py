"""The gate's detached, bounded follow-up for a refused batch job.

Slurm requeues a batch job whose PrologSlurmctld fails, but while the prolog runs the job
is CONFIGURING and ``ExcNodeList`` cannot be changed. So the gate starts this process in
its own session (``setsid``) and exits; this process waits (at most ``--wait`` seconds,
and a hard alarm a little later) until ``squeue`` shows the job PENDING again, then

- ``--action steer``: ``scontrol update jobid=J ExcNodeList=<user's + odd> StartTime=now``
  (the requeue would otherwise delay the job by ~121 s, Reason=BeginTime);
- ``--action hold``: ``scontrol hold J`` (the AdminComment already says why).

Each outcome is appended to the audit trail (decision ``followup``).

    python -I -m prolog.steer --job 42 --action steer --exclude n3 --wait 30 \
        --conf /etc/slurm/slurm.conf --audit /var/lib/ncclguard/decisions.jsonl
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence
from types import FrameType

from ncclguard import audit
from ncclguard.hostlist import compress, expand
from ncclguard.slurm import Slurm, SlurmError

POLL_S = 0.2
GRACE_S = 10.0  # beyond --wait, for the updates themselves


def _record(args: argparse.Namespace, result: str, **extra: object) -> None:
    if not args.audit:
        return
    try:
        audit.append(
            args.audit,
            {
                "job": args.job,
                "decision": "followup",
                "action": args.action,
                "result": result,
                **extra,
            },
        )
    except OSError as e:
        from ncclguard.text import safe

        print(f"ncclguard-steer[job {args.job}]: audit: {safe(str(e))}", file=sys.stderr)


def wait_pending(slurm: Slurm, job: int, wait_s: float) -> str | None:
    """Poll until the job is PENDING; its last state (None: Slurm forgot it)."""
    end = time.monotonic() + wait_s
    state: str | None = ""
    while True:
        try:
            state = slurm.job_state(job)
        except SlurmError:
            state = ""
        if state in ("PENDING", None) or time.monotonic() >= end:
            return state
        time.sleep(POLL_S)


def steer(slurm: Slurm, job: int, exclude: Sequence[str]) -> str:
    """Merge ``exclude`` into the job's ExcNodeList and make it eligible now (the job
    read narrowly: ``Slurm.job_brief``, whatever the queue holds)."""
    info = slurm.job_brief(job, admin_comment=False)
    if info is None:
        raise SlurmError(f"job {job}: gone before it could be steered")
    merged = compress([*expand(info.excluded_nodes), *exclude])
    slurm.update_job(job, ExcNodeList=merged, StartTime="now")
    return merged


def run(args: argparse.Namespace) -> int:
    slurm = Slurm(
        args.bin_dir or None,
        conf=args.conf or None,
        timeout=5.0,
        deadline=time.monotonic() + args.wait + GRACE_S - 1,
    )
    state = wait_pending(slurm, args.job, args.wait)
    if state != "PENDING":
        _record(args, "skipped", state=state, error=f"job not PENDING within {args.wait:.0f}s")
        return 1
    try:
        if args.action == "steer":
            merged = steer(slurm, args.job, expand(args.exclude))
            _record(args, "done", excluded=merged)
        else:
            if args.comment:
                slurm.set_admin_comment(args.job, args.comment)
            slurm.hold(args.job)
            _record(args, "done")
    except SlurmError as e:
        _record(args, "failed", error=str(e))
        from ncclguard.text import safe

        print(f"ncclguard-steer[job {args.job}]: {safe(str(e))}", file=sys.stderr)
        return 1
    return 0


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ncclguard-steer", description=__doc__.splitlines()[0])
    p.add_argument("--job", type=int, required=True)
    p.add_argument("--action", choices=("steer", "hold"), required=True)
    p.add_argument("--exclude", default="", help="hostlist of the odd nodes")
    p.add_argument("--comment", default="", help="AdminComment to set with a hold")
    p.add_argument("--wait", type=float, default=30.0)
    p.add_argument("--conf", default="", help="slurm.conf for the Slurm commands")
    p.add_argument("--bin-dir", default="")
    p.add_argument("--audit", default="")
    return p.parse_args(argv)


def _alarm(signum: int, frame: FrameType | None) -> None:
    sys.stderr.write("ncclguard-steer: hard time limit reached, giving up\n")
    raise SystemExit(3)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, args.wait + GRACE_S)
    try:
        return run(args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


if __name__ == "__main__":
    sys.exit(main())
