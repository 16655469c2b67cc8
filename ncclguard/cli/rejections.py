"""``ncclguard rejections``: the signed records the collector refused, and why."""

from __future__ import annotations

from typing import Any

import click

from ncclguard.cli import output as out
from ncclguard.cli.context import format_options, get_ctx

COLUMNS: list[out.Column] = [
    ("file", "FILE"), ("host", "NODE"), ("cause", "CAUSE"), ("count", "COUNT"),
    ("last", "LAST"), ("resolved", "RESOLVED"), ("detail", "DETAIL"),
]
CSV: list[out.Column] = [
    ("file", "file"), ("host", "host"), ("cause", "cause"), ("count", "count"),
    ("first_at", "first_at"), ("last_at", "last_at"), ("resolved_at", "resolved_at"),
    ("detail", "detail"),
]


@click.command()
@click.option("--all", "show_all", is_flag=True,
              help="Also rejections that a later good record from the same file resolved.")
@format_options
def rejections(show_all: bool, as_json: bool, as_csv: bool) -> None:
    """Records the collector rejected (forged, wrong uid, expired, replayed, malformed...):
    the node kept its previous record. Causes: docs/collector.md."""
    c = get_ctx(as_json, as_csv)
    rows = c.inv("rejections", include_resolved=show_all)
    for r in rows:
        r["last"] = out.iso(r["last_at"])
        r["resolved"] = out.iso(r["resolved_at"]) or ""
        r["first_at"], r["last_at"] = out.iso(r["first_at"]), out.iso(r["last_at"])
        r["resolved_at"] = out.iso(r["resolved_at"])

    def doc() -> dict[str, Any]:
        keys = ("file", "host", "cause", "count", "first_at", "last_at", "resolved_at",
                "detail")
        return {"count": len(rows), "rejections": [{k: r[k] for k in keys} for r in rows]}

    text = None
    if c.fmt == "table":
        what = "rejections" if show_all else "unresolved rejections"
        text = out.table(rows, COLUMNS, c.width) + f"{len(rows)} {what}\n"
    c.emit(doc, rows=rows, columns=COLUMNS, text=text, csv_columns=CSV)
