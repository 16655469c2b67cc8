"""``ncclguard diagnose``: read a failed job's logs and say which communication-stack
problem they show, with the evidence lines, the odd nodes, the fix and the command that
confirms it; then put the inventory's view of the job's nodes (as of the job's start)
next to it.

The one entry point used by the CLI and the Epilog hook alike is :func:`run`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .catalog import Catalog, CatalogError
from .catalog import load as load_catalog
from .engine import NO_SIGNATURE, Report, Scanner, correlate, diagnose, inventory_view
from .logparse import LogError

__all__ = [
    "NO_SIGNATURE",
    "CatalogError",
    "JobLogs",
    "LogError",
    "Report",
    "job_logs",
    "load_catalog",
    "run",
]


@dataclass(frozen=True)
class JobLogs:
    """What Slurm still knows about a job that diagnose needs."""

    job_id: str
    nodes: tuple[str, ...]
    start_time: float | None
    files: tuple[str, ...]  # StdOut / StdErr paths, expanded, deduplicated
    partition: str | None = None
    state: str = ""

    def to_dict(self) -> dict[str, Any]:
        from ncclguard.hostlist import compress

        return {
            "id": self.job_id,
            "nodes": compress(self.nodes) if self.nodes else "",
            "start_time": self.start_time,
            "files": list(self.files),
            "partition": self.partition,
            "state": self.state,
        }


def _num(v: Any) -> float | None:
    if isinstance(v, dict):  # openapi v0.0.39+: {"set": true, "number": 5}
        if v.get("set") is False:
            return None
        v = v.get("number")
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f > 0 else None


def expand_output_path(pattern: str, job_id: str, raw: dict[str, Any], first_node: str) -> str:
    """Slurm's filename pattern (sbatch --output): %j %J %A %a %x %u %N %%."""
    if "%" not in pattern:
        return pattern
    subs = {
        "j": job_id,
        "J": job_id,
        "A": str(raw.get("array_job_id") or job_id),
        "a": str(raw.get("array_task_id") or "0"),
        "x": str(raw.get("name") or ""),
        "u": str(raw.get("user_name") or ""),
        "N": first_node,
        "%": "%",
    }
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "%" and i + 1 < len(pattern):
            j = i + 1
            while j < len(pattern) and pattern[j].isdigit():  # %5j: zero-padded
                j += 1
            key = pattern[j] if j < len(pattern) else ""
            if key in subs:
                width = int(pattern[i + 1 : j] or 0)
                val = subs[key]
                out.append(val.zfill(width) if key in "jJAa" and width else val)
                i = j + 1
                continue
        out.append(c)
        i += 1
    return "".join(out)


def job_logs(slurm: Any, job_id: str) -> JobLogs | None:
    """The job's nodes, start time and output files from Slurm; None when Slurm forgot it."""
    from ncclguard.hostlist import expand

    info = slurm.job(job_id)
    if info is None:
        return None
    raw = info.raw or {}
    nodes = tuple(expand(info.nodes)) if info.nodes else ()
    files: list[str] = []
    for key in ("standard_output", "standard_error"):
        p = raw.get(key)
        if isinstance(p, str) and p:
            path = expand_output_path(p, str(info.job_id), raw, nodes[0] if nodes else "")
            if path not in files and path != "/dev/null":
                files.append(path)
    return JobLogs(
        job_id=str(info.job_id),
        nodes=nodes,
        start_time=_num(raw.get("start_time")),
        files=tuple(files),
        partition=info.partition or None,
        state=info.state,
    )


def run(
    files: Sequence[str | os.PathLike[str]],
    *,
    catalog: Catalog,
    job: JobLogs | None = None,
    nodes: Sequence[str] | None = None,
    when: float | None = None,
    open_inventory: Callable[[], Any] | None = None,
    policy_config: Any = None,
    evaluate: Callable[..., Any] | None = None,
    deadline: float | None = None,
) -> Report:
    """Scan ``files``, diagnose, and correlate with the inventory when one is given.

    ``nodes``: the job's nodes (default: the job's, else the hosts seen in the log).
    ``when``: the time to read the inventory at (default: the job's start, else now).
    ``open_inventory``: returns an ``Inventory``; its errors become a note in the report,
    never a failure of the diagnosis. ``deadline`` (``time.monotonic()``): stop reading
    there and say so (the Epilog's bound). Raises :class:`LogError` for a file that
    cannot be opened.
    """
    scanner = Scanner(catalog)
    for f in files:
        scanner.feed(f, deadline=deadline)
    ev = scanner.evidence()
    diags = diagnose(ev, catalog)
    report = Report(ev, diags, job=job.to_dict() if job else None)
    if open_inventory is None:
        report.inventory_note = "not consulted"
        return report
    node_list = list(nodes or (job.nodes if job else ()) or ev.hosts)
    if not node_list:
        report.inventory_note = "no nodes known (no --job, and no host names in the log)"
        return report
    at = when if when is not None else (job.start_time if job and job.start_time else None)
    if at is None:
        at = time.time()
        report.inventory_note = "no job start time (use --job or --at): inventory read as of now"
    try:
        inv = open_inventory()
        if evaluate is None:
            from prolog.policy import evaluate as evaluate
        view = inventory_view(
            node_list, at, inv, policy_config, evaluate, job.partition if job else None
        )
    except Exception as e:
        report.inventory_note = f"inventory unavailable: {e}"
        return report
    report.view = view
    report.disagreements = correlate(diags, ev, view)
    report.diagnoses.sort(key=lambda d: -d.score)
    return report
