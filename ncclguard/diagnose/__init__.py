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
from .correlate import correlate, inventory_view
from .diagnosis import diagnose
from .logparse import LogError
from .report import NO_SIGNATURE, Report
from .scanner import Scanner

__all__ = [
    "NO_SIGNATURE",
    "CatalogError",
    "JobLogs",
    "LogError",
    "Report",
    "job_logs",
    "load_catalog",
    "resolve_output",
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
    uid: int | None = None  # the job's user: the Epilog reads only that user's files

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


MAX_LISTING = 100_000  # entries of the output directory looked at for a %N file name


def resolve_output(path: str, node: str) -> str:
    """The file a job wrote for ``path`` (a :attr:`JobInfo.std_out`): ``%N`` is the short
    host name of the node that opened it, taken to be ``node`` (the batch host). When no
    such file exists, ``%N`` is in the file name only, and exactly one file of that one
    directory matches with ``%N`` as a wildcard, that one (several slurmd on one host, or
    a host name that is not the node name).

    The path is the job's user's choice: it is never globbed (``-o /%N/%N/.../x`` made a
    glob search the whole filesystem), only one directory is listed, at most
    :data:`MAX_LISTING` of its entries."""
    if "%N" not in path:
        return path
    guess = path.replace("%N", node) if node else path
    if os.path.exists(guess):
        return guess
    directory, _, name = path.rpartition("/")
    if "%N" in directory or "%N" not in name:
        return guess
    import itertools

    parts = name.split("%N")
    try:
        with os.scandir(directory or ".") as it:
            matches = [e.name for e in itertools.islice(it, MAX_LISTING)
                       if _matches(e.name, parts)]
    except OSError:
        return guess
    if len(matches) != 1:
        return guess
    return f"{directory}/{matches[0]}" if directory else matches[0]


def _matches(name: str, parts: list[str]) -> bool:
    """Whether ``name`` is ``parts`` joined by any text (each ``%N`` a wildcard), in
    linear time: no regex, whose backtracking a name with many ``%N`` made exponential."""
    first, *middle, last = parts
    if len(name) < len(first) + len(last) or not name.startswith(first):
        return False
    pos, end = len(first), len(name) - len(last)
    if not name.endswith(last):
        return False
    for part in middle:
        i = name.find(part, pos, end)
        if i < 0:
            return False
        pos = i + len(part)
    return pos <= end


def job_logs(slurm: Any, job_id: str) -> JobLogs | None:
    """The job's nodes, start time and output files from Slurm; None when Slurm forgot it.

    One call (:meth:`ncclguard.slurm.Slurm.job`): on every release it lists pending,
    running and finished jobs alike until ``MinJobAge`` seconds after their end, with
    epoch-second times (docs/slurm-versions.md).
    """
    from ncclguard.hostlist import expand

    info = slurm.job(job_id)
    if info is None:
        return None
    nodes = tuple(expand(info.nodes)) if info.nodes else ()
    files: list[str] = []
    for pattern in (info.std_out, info.std_err):
        if not pattern:
            continue
        path = resolve_output(pattern, info.batch_host or (nodes[0] if nodes else ""))
        if path not in files and path != "/dev/null":
            files.append(path)
    return JobLogs(
        job_id=str(info.job_id),
        nodes=nodes,
        start_time=info.start_time,
        files=tuple(files),
        partition=info.partition or None,
        state=info.state,
        uid=info.user_id,
    )


def _preferring_majority(inv: Any) -> Callable[..., Any]:
    """The policy's ``evaluate`` followed by its one tie-break
    (:func:`ncclguard.policy.break_tie`) over the inventory's classes, so that diagnose
    names the same odd nodes as the gate when the partition's nodes are not listed."""
    from ncclguard.policy import break_tie, evaluate

    def preferring(fps: Any, config: Any, **kw: Any) -> Any:
        verdict = evaluate(fps, config, **kw)
        return break_tie(
            verdict,
            again=lambda prefer: evaluate(fps, config, prefer=prefer, **kw),
            classes=lambda among: [c.hosts for c in inv.classes(among)],
        )[0]

    return preferring


SLURM_TIME_RESOLUTION_S = 1.0


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
    owner_uid: int | None = None,
    progress: Callable[[str, int, int], object] | None = None,
) -> Report:
    """Scan ``files``, diagnose, and correlate with the inventory when one is given.

    ``nodes``: the job's nodes (default: the job's, else the hosts seen in the log).
    ``when``: the time to read the inventory at (default: the job's start, else now).
    ``open_inventory``: returns an ``Inventory``; its errors become a note in the report,
    never a failure of the diagnosis. ``deadline`` (``time.monotonic()``): stop reading
    there and say so (the Epilog's bound; past it, the inventory is not consulted).
    ``owner_uid``: read only regular files of that
    user, never through a final symlink (the Epilog). ``progress(file, bytes, lines)``:
    called after each block read (``ncclguard diagnose``'s progress line). A file that
    cannot be opened is a
    problem in the report; :class:`LogError` is raised only when none could be.
    """
    known = list(nodes or (job.nodes if job else ()))
    # the job's nodes, when known, are the only hosts attributed (a log names any number)
    scanner = Scanner(catalog, hosts=known or None)
    unopened: list[LogError] = []
    for f in files:
        try:
            each = None if progress is None else (
                lambda n, lines, name=str(f): progress(name, n, lines))
            scanner.feed(f, deadline=deadline, owner_uid=owner_uid, progress=each)
        except LogError as e:  # one unreadable file must not cost the others' diagnosis
            unopened.append(e)
    if unopened and len(unopened) == len(files):
        raise unopened[0]
    ev = scanner.evidence()
    ev.problems.extend(str(e) for e in unopened)
    diags = diagnose(ev, catalog, known or None)
    report = Report(ev, diags, job=job.to_dict() if job else None)
    if open_inventory is None:
        report.inventory_note = "not consulted"
        return report
    if deadline is not None and time.monotonic() > deadline:
        report.inventory_note = "not consulted: the time limit was reached"
        return report
    node_list = known or ev.hosts
    if not node_list:
        report.inventory_note = "no nodes known (no --job, and no host names in the log)"
        return report
    at = when
    if at is None and job and job.start_time:
        # Slurm gives start times in whole seconds (truncated): a fingerprint written in
        # the job's starting second was there when it started
        at = job.start_time + SLURM_TIME_RESOLUTION_S
    if at is None:
        at = time.time()
        report.inventory_note = "no job start time (use --job or --at): inventory read as of now"
    try:
        inv = open_inventory()
        if evaluate is None:
            evaluate = _preferring_majority(inv)
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
