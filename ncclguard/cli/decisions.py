"""``ncclguard decisions``: the gate's audit trail (:mod:`ncclguard.audit`), one line per
decision."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import click

from ncclguard.cli import output as out
from ncclguard.cli.context import TIME, TIME_HELP, format_options, get_ctx
from ncclguard.cli.errors import fail
from ncclguard.text import safe

__all__ = ["decisions"]


DECISION_COLUMNS: list[out.Column] = [
    ("time", "TIME"), ("job", "JOB"), ("partition", "PARTITION"), ("decision", "DECISION"),
    ("action", "ACTION"), ("path", "BY"), ("nodes", "NODES"), ("summary", "SUMMARY"),
]


def _first(rec: Mapping[str, Any], *keys: str) -> Any:
    for k in keys:
        if rec.get(k) not in (None, ""):
            return rec[k]
    return None


def _decision_row(rec: Mapping[str, Any]) -> dict[str, Any]:
    t = _first(rec, "time", "ts", "at", "timestamp")
    if isinstance(t, int | float):
        t = out.iso(float(t))
    given = rec.get("verdict")
    verdict = given if isinstance(given, Mapping) else {}
    return {
        "time": t,
        "job": _first(rec, "job", "job_id"),
        "partition": _first(rec, "partition"),
        "decision": _first(rec, "decision") or verdict.get("decision"),
        "action": _first(rec, "action"),
        # which check placed the job (docs/scheduling.md): features (Slurm, one class) or
        # gate; records written before it existed have neither
        "path": _first(rec, "path"),
        "nodes": _first(rec, "nodes", "nodelist", "hosts"),
        "summary": _first(rec, "summary", "message") or verdict.get("summary"),
    }


#: wrapped, not cut, where the table is too wide: a library's path (a cut one lost what
#: told two apart: its directory's tail and the file's name)
CONTAINER_WRAP = ("libnccl", "judged")
CONTAINER_COLUMNS: list[out.Column] = [
    ("step", "STEP"), ("host", "NODE"), ("nccl_version", "NCCL"), ("net_plugin", "NET PLUGIN"),
    ("libnccl", "LIBNCCL"), ("judged", "AS JUDGED"), ("at", "STARTED"), ("uid", "UID"),
]


def _judged_sha(c: Any, digest: Any) -> str | None:
    """The sha256 of the libnccl the registry image ``digest`` loads (None: unknown)."""
    if not isinstance(digest, str):
        return None
    rec = c.inventory.registry_record(digest) or {}
    lib = next((x for x in rec.get("libnccl") or [] if isinstance(x, dict) and x.get("default")),
               None)
    sha = lib.get("sha256") if lib else None
    return sha if isinstance(sha, str) else None


def container_rows(c: Any, job: str, digest: Any = None) -> list[dict[str, Any]]:
    """The container records of ``job`` (docs/containers.md); [] without an inventory.
    ``digest``: the registry image the gate judged the job by; each row says whether the
    node's container loaded that image's libnccl (a tag that moved between the gate's
    resolution and a node's import shows as another)."""
    from ncclguard.store import InventoryError

    try:
        runs = c.inventory.container_runs(job)
        judged = _judged_sha(c, digest)
    except (InventoryError, SystemExit):
        return []
    from ncclguard.spool import container_view

    out_rows = []
    for r in runs:
        view = container_view(r["record"])  # any stored shape: None, "unreadable"
        at = r["encoded_at"]
        out_rows.append({
            "step": r["step"], "host": r["host"],
            "nccl_version": (view.nccl_version if view else None) or (
                "unknown" if view else "unreadable record"),
            "net_plugin": f"{view.net_name or 'none'} v{view.net_abi or 0}" if view else None,
            "libnccl": view.libnccl if view else None,
            "judged": "" if judged is None or not view else (
                f"the libnccl of {digest[:19]}" if view.sha256 == judged
                else f"another libnccl than {digest[:19]}'s: the tag moved?"),
            "at": out.iso(at) if isinstance(at, int | float) else None, "uid": r["uid"]})
    return out_rows


@click.command()
@click.option("--job", "job", default=None, metavar="ID", help="Only this job.")
@click.option("--since", type=TIME, default=None, metavar="TIME",
              help=f"Only decisions since TIME: {TIME_HELP}.")
@click.option("--refused", is_flag=True, help="Only refusals.")
@click.option("--audit-log", "audit_log", metavar="FILE", default=None,
              help="The audit trail (default: the config's gate.audit_log).")
@format_options
def decisions(job: str | None, since: float | None, refused: bool, audit_log: str | None,
              as_json: bool, as_csv: bool) -> None:
    """The gate's audit trail: one line per decision."""
    from ncclguard import audit

    c = get_ctx(as_json, as_csv)
    if job is not None and not job.isdigit():
        fail(f"--job {job!r}: expected a numeric job id")
    path = audit_log or str(c.config.gate.audit_path(c.config.inventory))
    skipped = [0]
    try:
        if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would block
            fail(f"{path}: not a regular file; not an audit trail")
        # a path given by hand must exist (a typo is not an empty trail); the
        # configured one may not exist yet (the gate has not decided anything)
        records = list(audit.read(path, job=int(job) if job else None, since=since,
                                  refused=refused, missing_ok=audit_log is None,
                                  skipped=skipped))
    except FileNotFoundError:
        fail(f"--audit-log {path}: no such file")
    except (OSError, ValueError) as e:
        fail(f"{path}: cannot read the audit trail: {e}")
    if skipped[0] and not records and job is None and since is None and not refused:
        fail(f"{path}: not an audit trail (none of its {skipped[0]} line(s) is a record)")
    if skipped[0]:
        click.echo(f"warning: {path}: {skipped[0]} line(s) that are not audit records were "
                   "skipped", err=True)
    rows = [_decision_row(r) for r in records]
    doc: dict[str, Any] = {"audit_log": path, "count": len(records), "decisions": records,
                           "skipped_lines": skipped[0]}
    digest = next((r.get("image_digest") for r in reversed(records)
                   if r.get("image_digest")), None)
    ran = container_rows(c, job, digest) if job is not None else []
    loaded: list[dict[str, Any]] = []
    if job is not None:
        from ncclguard.cli.jobs import loaded_rows

        doc["containers"] = ran
        loaded, mixed = loaded_rows(c, job, current=False)
        doc["loaded"], doc["mixed"] = loaded, mixed
    text = None
    if c.fmt == "table":
        text = (out.table(rows, DECISION_COLUMNS, c.width) if rows else "no decisions\n")
        if ran:
            text += "\nwhat each node's container had (the enroot hook's signed records):\n"
            text += out.table(ran, CONTAINER_COLUMNS, c.width, wrap=CONTAINER_WRAP)
        if loaded:
            from ncclguard.cli.jobs import LOADED_COLUMNS, LOADED_WRAP

            text += ("\nwhat each node's processes loaded (the gate's prediction is above; "
                     "the nodes' signed records):\n")
            text += out.table(loaded, LOADED_COLUMNS, c.width, wrap=LOADED_WRAP,
                              optional=("seen", "path"))
            for m in doc["mixed"]:
                text += f"job {m['job']} step {m['step']} mixed: {safe(m['summary'])}\n"
                if m.get("action"):
                    text += f"  {m['action']}: {safe(m['result'])}\n"
    c.emit(doc, rows=rows, columns=DECISION_COLUMNS, text=text,
           csv_columns=[(k, k) for k, _ in DECISION_COLUMNS])
