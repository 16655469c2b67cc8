"""``ncclguard canary status|run|approve``: the nodes held until their canary passes, and
an admin's say over them (issue 43, docs/canary.md). ``nodes`` and ``show`` read the same
rows (:func:`holds`) and say them the same way (:func:`held_text`, :func:`held_doc`)."""

from __future__ import annotations

import getpass
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import click

from ncclguard.cli import output as out
from ncclguard.cli.context import Ctx, format_options, get_ctx
from ncclguard.cli.errors import fail
from ncclguard.text import safe

__all__ = ["STATUS_COLUMNS", "canary", "held_doc", "held_text", "holds"]

STATUS_COLUMNS: list[out.Column] = [
    ("host", "NODE"), ("state", "STATE"), ("class", "CLASS"), ("vetted", "VETTED IN"),
    ("held_since", "HELD SINCE"), ("job", "CANARY JOB"), ("reason", "REASON"),
]


def held_text(row: Mapping[str, Any] | None) -> str | None:
    """``held by canary (STATE) since T: REASON`` for a held row, else None."""
    if not row or row.get("state") == "ok":
        return None
    since = out.iso(row["held_since"]) if row.get("held_since") else "?"
    return f"held by canary ({row['state']}) since {since}: {safe(str(row['reason']))}"


def held_doc(row: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A held row for ``--json`` (``nodes``, ``show``): its state, since when, its canary
    job, the reason and :func:`held_text`; None when not held."""
    text = held_text(row)
    if row is None or text is None:
        return None
    return {"state": row["state"], "held_since": out.iso(row.get("held_since")),
            "job_id": row.get("job_id"), "reason": safe(str(row.get("reason") or "")),
            "text": text}


def holds(c: Ctx, hosts: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The held rows of ``hosts``, by host: none while ``[canary]`` is off, as the gate and
    the features daemon read them (a row left from an earlier time holds nothing then)."""
    if not c.config.canary.enabled:
        return {}
    got: dict[str, dict[str, Any]] = c.inv("canary_holds", list(hosts))
    return got


def _admin() -> str:
    """Who is acting: the sudo user when run through sudo, else this process's user."""
    who = os.environ.get("SUDO_USER") or ""
    if not who:
        try:
            who = getpass.getuser()
        except (KeyError, OSError):
            who = f"uid {os.getuid()}"
    return safe(who)[:64]


def _writable(c: Any) -> Any:
    from ncclguard.policy.schedule import class_values
    from ncclguard.store import Inventory, InventoryError

    try:
        return Inventory(c.db, config=c.config.inventory, values=class_values(c.config.policy))
    except InventoryError as e:
        fail(str(e))


def _write(inv: Any, rows: list[dict[str, Any]], events: list[dict[str, Any]],
           read: dict[str, dict[str, Any]]) -> None:
    """Write ``rows`` only if each node's row is still as ``read`` (the service's pass may
    have written since: a canary submitted, passed or failed)."""
    from ncclguard.store import InventoryError

    if not rows:
        return
    expect = {r["host"]: ((read[r["host"]]["state"], read[r["host"]]["job_id"])
                          if r["host"] in read else ("", None)) for r in rows}
    try:
        written = inv.canary_write(rows, events, expect=expect)
    except InventoryError as e:
        fail(str(e))
    if not written:
        fail("the canary service changed these nodes' rows meanwhile (a canary submitted or "
             "ended): nothing written; see `ncclguard canary status` and run it again")


def _hosts(c: Any, nodes: str) -> list[str]:
    from ncclguard.hostlist import HostlistError, expand

    try:
        return expand(nodes)
    except HostlistError as e:
        fail(f"{nodes!r}: {e}")
    return []


@click.group()
def canary() -> None:
    """Nodes held out of multi-node jobs until a canary job on them and a known-good peer
    passes ([canary] in the config; docs/canary.md)."""


@canary.command()
@click.argument("nodes", required=False)
@click.option("--history", "history", is_flag=True, help="The last events instead (of NODES).")
@click.option("--all", "all_", is_flag=True, help="Also the nodes not held.")
@format_options
def status(nodes: str | None, history: bool, all_: bool, as_json: bool, as_csv: bool) -> None:
    """The held nodes: their state, class, canary job and why."""
    c = get_ctx(as_json, as_csv)
    wanted = set(_hosts(c, nodes)) if nodes else None
    if history:
        events: list[dict[str, Any]] = []
        for h in sorted(wanted) if wanted else [None]:
            events += c.inv("canary_history", h, 200)
        events.sort(key=lambda e: e["at"], reverse=True)
        rows = [{"at": out.iso(e["at"]), "host": e["host"], "event": e["event"],
                 "job": e["job_id"] or "", "by": e["by"], "detail": safe(e["detail"])}
                for e in events]
        cols: list[out.Column] = [("at", "AT"), ("host", "NODE"), ("event", "EVENT"),
                                  ("job", "JOB"), ("by", "BY"), ("detail", "DETAIL")]
        c.emit({"events": rows}, rows=rows, columns=cols,
               text=out.table(rows, cols, c.width, wrap=("detail",)) if rows
               else "no canary events\n", csv_columns=[(k, k) for k, _ in cols])
        return
    got = c.inv("canary_nodes")
    rows = []
    for host, r in sorted(got.items()):
        if wanted is not None and host not in wanted:
            continue
        if r["state"] == "ok" and not all_ and wanted is None:
            continue
        rows.append({"host": host, "state": r["state"], "class": (r["class_key"] or "")[:10],
                     "vetted": (r["accepted"] or "none")[:10],
                     "held_since": out.iso(r["held_since"]) if r["held_since"] else "",
                     "job": r["job_id"] or "", "reason": safe(r["reason"])})
    enabled = c.config.canary.enabled
    text = out.table(rows, STATUS_COLUMNS, c.width, wrap=("reason",)) if rows else \
        "no node is held by the canary\n"
    if not enabled:
        text += "([canary] enabled = false: nothing is held, and these rows are not used)\n"
    c.emit({"at": out.iso(time.time()), "enabled": enabled, "nodes": rows}, rows=rows,
           columns=STATUS_COLUMNS, text=text, csv_columns=[(k, k) for k, _ in STATUS_COLUMNS])


#: one admin change of one node: its new row, or why it is left as it is
Change = Callable[[str, "dict[str, Any] | None", "str | None", float], "dict[str, Any] | str"]


def _change(nodes: str, reason: str, event: str, decide: Change) -> list[dict[str, Any]]:
    """An admin's change of NODES (``approve``, ``run``): each node's new row from
    ``decide(host, row, class key now, now)`` (a string: why not), written in one
    transaction with an event each, recorded with the admin's name and ``reason``; exit 1
    when no node changed."""
    c = get_ctx()
    hosts = _hosts(c, nodes)
    who, now = _admin(), time.time()
    detail = f"{event} by {who}" + (f": {safe(reason)}" if reason else "")
    with _writable(c) as inv:
        rows = inv.canary_nodes()
        keys = inv.class_keys(hosts)
        upd, events = [], []
        for h in hosts:
            r = rows.get(h)
            got = decide(h, r, keys.get(h), now)
            if isinstance(got, str):
                click.echo(f"{h}: {got}", err=True)
                continue
            upd.append(got)
            events.append({"at": now, "host": h, "event": event, "class_key": got["class_key"],
                           "job_id": r["job_id"] if r is not None else None, "by": who,
                           "detail": detail})
        _write(inv, upd, events, rows)
    if not upd:
        raise SystemExit(1)
    return events


@canary.command()
@click.argument("nodes")
@click.option("--reason", default="", help="Why, for the history.")
def approve(nodes: str, reason: str) -> None:
    """Let held NODES join their class without (or despite) a canary; recorded with your
    name. A canary job still running is left to end; its result no longer counts."""
    from ncclguard.policy.canary import ok_row

    def decide(h: str, r: dict[str, Any] | None, key: str | None, now: float
               ) -> dict[str, Any] | str:
        if r is None or r["state"] == "ok":
            return "not held"
        return ok_row(h, key or r["class_key"], now)

    for e in _change(nodes, reason, "approved", decide):
        click.echo(f"{e['host']}: approved (class {str(e['class_key'])[:10]}), by {e['by']}")


@canary.command(name="run")
@click.argument("nodes")
@click.option("--reason", default="", help="Why, for the history.")
def run_(nodes: str, reason: str) -> None:
    """Canary NODES at the service's next pass: a held node skips its settle time (a failed
    one is tried again); a node not held is held until a canary passes."""
    from ncclguard.policy.canary import held_row

    def decide(h: str, r: dict[str, Any] | None, key: str | None, now: float
               ) -> dict[str, Any] | str:
        if key is None:
            return "no readable record in the inventory"
        if r is not None and r["state"] == "running":
            return f"its canary job {r['job_id']} runs now"
        why = f"canary asked by {_admin()}" + (f": {safe(reason)}" if reason else "")
        accepted = r["accepted"] if r is not None else None
        since = r["held_since"] if r is not None and r["held_since"] else now
        new = held_row(h, accepted, key, now, why, since=since, state="waiting")
        new["attempts"] = int(r["attempts"] or 0) if r is not None else 0
        return new

    for e in _change(nodes, reason, "run", decide):
        click.echo(f"{e['host']}: held, its canary runs at the service's next pass")
