"""``ncclguard diff`` and ``history``: which fields differ between nodes, and how a node's
fingerprint changed over time, each difference with the rule it triggers and its severity
(:mod:`ncclguard.policy.fpdiff`)."""

from __future__ import annotations

import click

from ncclguard.cli import output as out
from ncclguard.cli.context import TIME, TIME_HELP, expand_hosts, format_options, get_ctx
from ncclguard.cli.errors import fail
from ncclguard.hostlist import compress

__all__ = ["diff", "history"]


@click.command()
@click.argument("nodes_args", metavar="NODE NODE... | HOSTLIST", nargs=-1, required=True)
@click.option("--rules-only", is_flag=True, help="Only the differences that a rule looks at.")
@format_options
def diff(nodes_args: tuple[str, ...], rules_only: bool, as_json: bool, as_csv: bool) -> None:
    """The fields that differ, with the rule each difference triggers and its severity."""
    from ncclguard.policy.fpdiff import diff as fpdiff

    c = get_ctx(as_json, as_csv)
    hosts = expand_hosts(nodes_args, "NODE")
    if len(hosts) < 2:
        fail(f"diff needs at least two nodes, got {len(hosts)}: {' '.join(nodes_args)}")
    recs = c.inv("load", hosts)
    missing = [h for h in hosts if recs.get(h) is None]
    if missing:
        fail(f"not in the inventory {c.inventory.path}: {compress(missing)}")
    result = fpdiff({h: recs[h].fingerprint for h in hosts}, c.config.policy,
                    include_info=not rules_only)
    doc = {
        "hosts": hosts,
        "worst": result.worst(),
        "differences": [d.to_dict(compress) for d in result.differences],
        "unknown": [d.to_dict(compress) for d in result.unknown],
    }
    flat = [
        {"field": d.field, "value": v, "hosts": compress(list(hs)), "count": len(hs),
         "rule": d.rule, "severity": d.severity}
        for d in result.differences for v, hs in d.values
    ]
    flat_cols: list[out.Column] = [("field", "FIELD"), ("value", "VALUE"), ("hosts", "HOSTS"),
                                   ("rule", "RULE"), ("severity", "SEVERITY")]
    text = None
    if c.fmt == "table":
        if len(hosts) == 2:
            a, b = hosts
            rows = [{"field": d.field, "a": d.value_of(a), "b": d.value_of(b),
                     "rule": d.rule, "severity": d.severity} for d in result.differences]
            text = out.table(rows, [("field", "FIELD"), ("a", a), ("b", b), ("rule", "RULE"),
                                    ("severity", "SEVERITY")], c.width, wrap=("field",))
        else:
            text = out.table(flat, flat_cols, c.width, wrap=("field", "hosts"))
        if not result.differences:
            text = f"no differences between {compress(hosts)}\n"
        if result.unknown:
            text += "unknown (a probe could not read them; never counted as different):\n"
            text += out.table([{"field": d.field, "hosts": compress(list(d.unknown_on))}
                               for d in result.unknown], [("field", "FIELD"),
                                                          ("hosts", "UNREADABLE ON")],
                              c.width, wrap=("field", "hosts"))
    csv_cols: list[out.Column] = [("field", "field"), ("value", "value"), ("hosts", "hosts"),
                                  ("count", "count"), ("rule", "rule"),
                                  ("severity", "severity")]
    c.emit(doc, rows=flat, columns=flat_cols, text=text, csv_columns=csv_cols)


HISTORY_COLUMNS: list[out.Column] = [
    ("at", "AT"), ("host", "HOST"), ("field", "FIELD"), ("old", "OLD"), ("new", "NEW"),
    ("rule", "RULE"), ("severity", "SEVERITY"),
]


@click.command()
@click.argument("node", required=False)
@click.option("--since", type=TIME, default=None, metavar="TIME",
              help=f"Only changes since TIME: {TIME_HELP}.")
@format_options
def history(node: str | None, since: float | None, as_json: bool, as_csv: bool) -> None:
    """The changes of the fingerprint over time (all nodes, or NODE)."""
    from ncclguard.policy.fpdiff import compared, rule_for, severity_for

    c = get_ctx(as_json, as_csv)
    if node is not None and c.inv("load", [node]).get(node) is None:
        fail(f"{node}: not in the inventory {c.inventory.path}")
    policy = c.config.policy
    changes = []
    rows = []
    for h in c.inv("history", node, since):
        fields = []
        for d in h["diff"] if isinstance(h["diff"], list) else []:
            if not isinstance(d, dict):
                continue
            name = d.get("field", "")
            if not isinstance(name, str):
                continue
            if name == "" and isinstance(d.get("new"), str):  # what the store could not keep
                fields.append({"field": d["new"], "old": None, "new": None, "rule": None,
                               "severity": None})
                continue
            if not compared(name):
                continue
            rule = rule_for(name)
            fields.append({"field": name, "old": d.get("old"), "new": d.get("new"),
                           "rule": rule, "severity": severity_for(rule, policy)})
        change = {"id": h["id"], "host": h["host"], "at": out.iso(h["at"]),
                  "old_hash": h["old_hash"], "new_hash": h["new_hash"],
                  "first": h["old_hash"] is None, "fields": fields}
        changes.append(change)
        if change["first"]:
            rows.append({"at": change["at"], "host": h["host"], "field": "(first seen)",
                         "old": None, "new": (h["new_hash"] or "")[:16], "rule": None,
                         "severity": None})
        for f in fields:
            rows.append({"at": change["at"], "host": h["host"], **f})
    doc = {"host": node, "since": out.iso(since), "changes": changes}
    csv_rows = [{**r} for r in rows]
    text = None
    if c.fmt == "table":
        text = out.table(rows, HISTORY_COLUMNS, c.width, keep=("at", "host"),
                             wrap=("field",)) if rows else "no changes\n"
    c.emit(doc, rows=rows, columns=HISTORY_COLUMNS, text=text, csv_rows=csv_rows,
           csv_columns=[(k, k) for k, _ in HISTORY_COLUMNS])
