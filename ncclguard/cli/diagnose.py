"""``ncclguard diagnose``: which communication-stack failure a job's logs show.

Exit status, as for every command (:mod:`ncclguard.cli.errors`): 0 when the logs were read
(a signature found or not; the JSON's ``result`` says which), 3 when an input cannot be
used (a missing log, a bad catalog or config, a job Slurm no longer knows and no files
given). ``--db`` and ``--config`` may also be given before the command, as for the others.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click

from ncclguard import config as cfgmod
from ncclguard.cli.context import TIME, TIME_HELP, get_ctx
from ncclguard.cli.errors import fail
from ncclguard.diagnose import JobLogs, job_logs, load_catalog, run
from ncclguard.diagnose.catalog import CatalogError
from ncclguard.diagnose.logparse import LogError

__all__ = ["diagnose"]

#: How long ``--job`` reads the job's own files by default: they are the user's (a 2 GiB
#: log took 95 s), and the Epilog reads them within 20 s.
JOB_BUDGET_S = 120.0


@click.command("diagnose")
@click.argument("logfiles", nargs=-1, type=click.Path(dir_okay=False, path_type=str))
@click.option("--job", "job_id", metavar="ID", help="Find the job's nodes, start and output files.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--at", "at", type=TIME, metavar="TIME",
    help=f"Read the inventory as of TIME (default: the job's start): {TIME_HELP}.",
)
@click.option(
    "--nodes", metavar="HOSTLIST", help="The job's nodes (default: --job's, else the log's hosts)."
)
@click.option("--no-inventory", is_flag=True, help="Diagnose the logs alone.")
@click.option(
    "--budget", type=click.FloatRange(min=1.0), metavar="SECONDS",
    help=f"Stop reading after SECONDS and say so (default: {JOB_BUDGET_S:g} for --job's "
    "own files, none for files named).",
)
@click.option("--quiet", "-q", is_flag=True,
              help="No progress line (it is shown on a terminal only, on stderr).")
@click.option("--db", type=click.Path(dir_okay=False, path_type=str), help="Inventory database.")
@click.option(
    "--config", "config_path", type=click.Path(dir_okay=False, path_type=str), help="Config file."
)
def diagnose(
    logfiles: tuple[str, ...],
    job_id: str | None,
    as_json: bool,
    at: float | None,
    nodes: str | None,
    no_inventory: bool,
    budget: float | None,
    quiet: bool,
    db: str | None,
    config_path: str | None,
) -> None:
    """Say which communication-stack failure the job logs LOGFILE... show (plain or gzip).

    The most likely cause comes first, with its evidence lines (file:line), the odd
    nodes, the fix and the command that confirms it; then the inventory's view of the
    job's nodes as of the job's start, and where the log and the inventory disagree.

    Only regular files are read (a FIFO or a device is refused, named). The output
    files of --job are the user's: read as the Epilog reads them, only if the job's user
    owns them, never through a final symbolic link, within --budget.
    """
    c = get_ctx(as_json)
    if c.fmt == "csv":
        fail("--csv is not available for diagnose (a report is not rows); use --json")
    if config_path is not None:
        c.config_path = config_path
    if db is not None:
        c.db = db
    cfg = c.config
    try:
        catalog = load_catalog(cfg.diagnose.signature_files)
    except CatalogError as e:
        fail(str(e))
    job: JobLogs | None = None
    if job_id is not None:
        if not job_id.isdigit():
            fail(f"--job {job_id!r}: expected a numeric job id")
        job = _lookup(job_id, cfg, have_files=bool(logfiles))
    files = list(logfiles) or list(job.files if job else ())
    # the job's own files (its user chose their paths): only that user's, as the Epilog
    owner_uid: int | None = None
    if not logfiles and job is not None:
        owner_uid = job.uid if job.uid is not None else -1
        budget = JOB_BUDGET_S if budget is None else budget
    if not files:
        fail("no log files: name them, or use --job ID for a job whose output Slurm still knows")
    node_list: list[str] | None = None
    if nodes:
        from ncclguard.hostlist import HostlistError, expand

        try:
            node_list = expand(nodes)
        except HostlistError as e:
            fail(f"--nodes: {e}")
    opener = None
    if not no_inventory:

        def opener() -> Any:
            from ncclguard.sched.classes import open_classes

            return open_classes(cfg.policy, cfg.inventory, c.db)

    from ncclguard.progress import Progress

    shown = Progress(sys.stderr, "ncclguard diagnose", enabled=not quiet)

    def progress(name: str, n: int, lines: int) -> None:
        rate = n / max(time.monotonic() - shown.t0, 1e-3) / (1 << 20)
        shown.update(f"{name}: {n / (1 << 20):,.0f} MiB, {lines:,} lines read "
                     f"({rate:,.0f} MiB/s)")

    try:
        report = run(
            files,
            catalog=catalog,
            job=job,
            nodes=node_list,
            when=at,
            open_inventory=opener,
            policy_config=cfg.policy,
            deadline=None if budget is None else time.monotonic() + budget,
            owner_uid=owner_uid,
            progress=progress if shown.enabled else None,
        )
    except LogError as e:
        fail(str(e))
    finally:
        shown.done()
    # what each node's container really had (the enroot hook's records, docs/containers.md)
    ran: list[dict[str, Any]] = []
    # what each node's processes of the job loaded (docs/runtime.md): the ground truth
    # the log's reading starts from
    loaded: list[dict[str, Any]] = []
    mixed: list[dict[str, Any]] = []
    if job_id is not None and not no_inventory:
        from ncclguard.cli.decisions import CONTAINER_COLUMNS, CONTAINER_WRAP, container_rows
        from ncclguard.cli.jobs import loaded_rows

        ran = container_rows(c, job_id)
        loaded, mixed = loaded_rows(c, job_id, current=False)
    if c.fmt == "json":
        doc = report.to_dict()
        if job_id is not None:
            doc["containers"] = ran
            doc["loaded"], doc["mixed"] = loaded, mixed
        click.echo(json.dumps(doc, indent=2, default=str))
    else:
        text = report.text()
        if loaded:
            from ncclguard.cli import output as out
            from ncclguard.cli.jobs import LOADED_COLUMNS, LOADED_WRAP

            head = "what each node's processes loaded (ncclguard-jobmaps, docs/runtime.md):\n"
            head += out.table(loaded, LOADED_COLUMNS, c.width, wrap=LOADED_WRAP,
                              optional=("seen", "path"))
            for m in mixed:
                head += f"job {m['job']} step {m['step']} MIXED: {m['summary']}\n"
            if not mixed:
                head += ("its nodes loaded the same NCCL libraries and plugins, as far as "
                         "the nodes that ran ncclguard-jobmaps could tell\n")
            text = head + "\n" + text
        if ran:
            from ncclguard.cli import output as out

            text = (text.rstrip("\n") + "\n\nwhat each node's container had (the enroot "
                    "hook's signed records):\n"
                    + out.table(ran, CONTAINER_COLUMNS, c.width, wrap=CONTAINER_WRAP)
                    .rstrip("\n"))
        from ncclguard.text import safe

        click.echo(safe(text, keep_newlines=True))  # log lines quoted: no terminal sequence


def _lookup(job_id: str, cfg: cfgmod.Config, have_files: bool) -> JobLogs | None:
    from ncclguard.slurm import Slurm, SlurmError

    try:
        job = job_logs(Slurm.from_config(cfg.gate), job_id)
    except SlurmError as e:
        if not have_files:
            fail(f"job {job_id}: Slurm query failed: {e}")
        from ncclguard.text import safe

        click.echo(f"warning: job {job_id}: Slurm query failed ({safe(str(e))}); using the "
                   "files", err=True)
        return None
    if job is None:
        if not have_files:
            fail(f"job {job_id}: Slurm no longer knows this job; name its log files")
        click.echo(f"warning: job {job_id}: Slurm no longer knows it; using the files", err=True)
    return job
