"""``ncclguard jobs``: what each running job step loaded, node by node, and whether it is
mixed (issue 42, docs/runtime.md); ``decisions --job`` shows the same rows
(:func:`loaded_rows`)."""

from __future__ import annotations

import time
from typing import Any

import click

from ncclguard.cli import output as out
from ncclguard.cli.context import format_options, get_ctx
from ncclguard.cli.errors import fail
from ncclguard.text import safe

__all__ = ["LOADED_COLUMNS", "jobs", "loaded_rows"]

LOADED_COLUMNS: list[out.Column] = [
    ("job", "JOB"), ("step", "STEP"), ("host", "NODE"), ("nccl", "NCCL LOADED"),
    ("plugins", "PLUGINS"), ("path", "LIBNCCL"), ("verdict", "VERDICT"), ("seen", "SEEN"),
]
LOADED_WRAP = ("path", "plugins", "verdict")
#: a step's verdict on one node, in ``ncclguard jobs``: "consistent" (as far as its nodes
#: could tell), "MIXED <kind>" (", odd": outside the largest group), "unidentified: ..."


def loaded_rows(c: Any, job: str | None = None, *, current: bool = True
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(rows, mixed)``: one row per (job, step, node) of what was loaded (of ``job``;
    ``current``: still running) with the step's verdict, and the mixed steps kept; ([], [])
    without an inventory."""
    from ncclguard.policy.loaded import shown_lib
    from ncclguard.store import InventoryError

    try:
        loads = c.inventory.job_loads(job, current=current)
        mixed = c.inventory.mixed_steps(job)
    except (InventoryError, SystemExit):
        return [], []
    verdicts = {(m["job"], m["step"]): m for m in mixed}
    rows = []
    for r in loads:
        libs = r["libs"]
        nccl = [x for x in libs if x.get("kind") == "nccl"]
        plugins = [x for x in libs if x.get("kind") not in ("nccl", "ibverbs")]
        m = verdicts.get((r["job"], r["step"]))
        verdict = "consistent"
        if m is not None:
            verdict = f"MIXED {m['kind']}" + (", odd" if r["host"] in m["odd"] else "")
        elif any(x.get("error") for x in libs):
            verdict = "unidentified: " + "; ".join(
                str(x["error"]) for x in libs if x.get("error"))
        rows.append({
            "job": r["job"], "step": r["step"], "host": r["host"],
            "nccl": ", ".join(shown_lib(x) for x in nccl) or "-",
            "plugins": ", ".join(shown_lib(x) for x in plugins) or "none",
            "path": ", ".join(str(x.get("path")) for x in nccl) or "-",
            "verdict": verdict, "seen": out.iso(r["seen_at"]),
            "gone": out.iso(r["gone_at"]) if r["gone_at"] else None,
            "uid": r["uid"], "procs": r["procs"], "cut": r["cut"], "libs": libs,
        })
    return rows, mixed


@click.command()
@click.option("--job", "job", default=None, metavar="ID", help="Only this job.")
@click.option("--mixed", "only_mixed", is_flag=True, help="Only the steps found mixed, "
              "running or not.")
@click.option("--all", "all_", is_flag=True, help="Also the steps that have ended (kept "
              "[runtime] keep_days).")
@format_options
def jobs(job: str | None, only_mixed: bool, all_: bool, as_json: bool, as_csv: bool) -> None:
    """What each running job step loaded on each node (libnccl, NCCL plugins), and
    whether its nodes loaded different ones (a mixed job)."""
    c = get_ctx(as_json, as_csv)
    if job is not None and not job.isdigit():
        fail(f"--job {job!r}: expected a numeric job id")
    rows, mixed = loaded_rows(c, job, current=not (all_ or only_mixed))
    if only_mixed:
        keys = {(m["job"], m["step"]) for m in mixed}
        rows = [r for r in rows if (r["job"], r["step"]) in keys]
    doc = {"at": out.iso(time.time()), "steps": rows, "mixed": mixed}
    text = None
    if c.fmt == "table":
        text = (out.table(rows, LOADED_COLUMNS, c.width, wrap=LOADED_WRAP,
                          optional=("seen", "path")) if rows
                else "no running job step has NCCL loaded (as the nodes last said)\n")
        for m in mixed:
            if job is not None or (m["job"], m["step"]) in {(r["job"], r["step"]) for r in rows}:
                text += (f"\njob {m['job']} step {m['step']} mixed since "
                         f"{out.iso(m['found_at'])}: {safe(m['summary'])}")
                if m.get("action"):
                    text += f"\n  {m['action']}: {safe(m['result'])}"
        if mixed:
            text += "\n"
    c.emit(doc, rows=rows, columns=LOADED_COLUMNS, text=text,
           csv_columns=[(k, k) for k, _ in LOADED_COLUMNS])
