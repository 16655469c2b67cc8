"""``ncclguard drain-recommend``: nodes to drain per partition, grouped by reason; with
``--apply`` / ``--resume`` it carries the plan out through Slurm. The plan itself is
:func:`ncclguard.policy.drain.recommend` (pure); this module gathers its facts and shows it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import click

from ncclguard.cli import output as out
from ncclguard.cli.context import Ctx, format_options, get_ctx, resolve_sets
from ncclguard.cli.errors import fail
from ncclguard.hostlist import compress
from ncclguard.policy.settings import BASELINE_KEYS
from ncclguard.text import count

__all__ = ["drain_recommend", "gather_facts"]


RECO_COLUMNS: list[out.Column] = [
    ("set", "NODE SET"), ("reason", "REASON"), ("count", "NODES"), ("hosts", "HOSTS"),
]
ACTION_COLUMNS: list[out.Column] = [
    ("action", "ACTION"), ("host", "NODE"), ("reason", "REASON"), ("detail", "DETAIL"),
]


def gather_facts(c: Ctx, hosts: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(facts per host, values per class name) from the inventory's classes and query
    tables.

    The active ports are :func:`ncclguard.fingerprint.fields.active_ports`, as the store's
    ``rdma_ports_up`` column holds them. For nodes with probe errors they are read from
    the fingerprint itself: a row written before that column said "unknown" (NULL)
    counted an unreadable port as down.
    """
    from ncclguard.fingerprint.fields import active_ports
    from ncclguard.policy.drain import NodeFacts

    wanted = set(hosts)
    view = c.classes()  # all of them: cheaper than a 16,000-name filter
    values = {view.name(k.key): k.values for k in view.classes}
    class_of = {h: view.name(k.key) for k in view.classes for h in k.hosts}
    rows = [r for r in c.inv("nodes", None) if r["host"] in wanted]
    ports_up = {r["host"]: r["rdma_ports_up"] for r in rows}
    with_errors = [r["host"] for r in rows if r.get("error_count")]
    if with_errors:
        for h, rec in c.inv("load", with_errors).items():
            if rec is not None:
                ports_up[h] = active_ports(rec.fingerprint)
    facts = {
        r["host"]: NodeFacts(
            host=r["host"], klass=class_of.get(r["host"]),
            values=values.get(class_of.get(r["host"]) or "", {}),
            last_heartbeat=r["last_heartbeat"], ports_up=ports_up[r["host"]],
            ports_total=r["rdma_ports_total"],
        )
        for r in rows
    }
    return facts, values


def make_judge(c: Ctx, facts: Mapping[str, Any], values: Mapping[str, Any]) -> Any:
    """The gate's policy on one node per class (the class values alone for one class)."""
    from ncclguard.policy import drain

    reps: dict[str, str] = {}
    for f in facts.values():
        if f.klass is not None:
            reps.setdefault(f.klass, f.host)
    if len(reps) < 2:  # one class: nothing to judge
        return drain.values_judge(values, c.config)
    loaded = c.inv("load", list(reps.values()))
    fps = {k: loaded[h].fingerprint for k, h in reps.items() if loaded.get(h) is not None}
    return drain.policy_judge(fps, c.config)


@click.command("drain-recommend")
@click.option("--partition", "-p", default=None, help="Only this Slurm partition.")
@click.option("--nodes", "nodes_opt", metavar="HOSTLIST", default=None,
              help="Judge this node set instead of Slurm's partitions (no Slurm needed).")
@click.option("--apply", "do_apply", is_flag=True,
              help="Drain the recommended nodes (scontrol; needs Slurm operator rights).")
@click.option("--resume", "do_resume", is_flag=True,
              help="Resume nodes drained by ncclguard whose cause is gone.")
@click.option("--force", is_flag=True,
              help="Recommend (and apply) even above drain.max_share of a node set.")
@format_options
def drain_recommend(partition: str | None, nodes_opt: str | None, do_apply: bool,
                    do_resume: bool, force: bool, as_json: bool, as_csv: bool) -> None:
    """Nodes to drain per partition, grouped by reason; --apply / --resume carry it out."""
    from ncclguard.policy import drain
    from ncclguard.slurm import SlurmError

    c = get_ctx(as_json, as_csv)
    sets = resolve_sets(c, partition, nodes_opt, all_partitions=True) or []
    if (do_apply or do_resume) and any(s.source == "inventory" for s in sets):
        fail(f"--apply/--resume need Slurm, and it is not reachable ({sets[0].note})")
    all_hosts = list(dict.fromkeys(h for s in sets for h in s.hosts))
    facts, values = gather_facts(c, all_hosts)
    judge = make_judge(c, facts, values)
    plan = drain.recommend({s.name: s.hosts for s in sets}, facts, judge, c.config,
                           now=c.now, force=force)
    actions: list[drain.Action] = []
    if do_apply or do_resume:
        try:
            snodes = {n.name: n for n in c.slurm_nodes()}
            if do_apply:
                actions += drain.plan_apply(plan, snodes)
            if do_resume:
                actions += drain.plan_resume(plan, snodes, all_hosts)
            drain.execute(actions, c.slurm)
            if any(a.action != "skip" for a in actions):  # report what Slurm now shows
                actions = drain.outcome(actions, {n.name: n for n in c.slurm.nodes()})
        except SlurmError as e:
            fail(f"Slurm: {e}" + (f" ({e.stderr.strip()})" if e.stderr.strip() else ""))
    by_name = {s.name: s for s in sets}
    doc = {
        "node_sets": [by_name[sp.name].to_dict() | sp.to_dict(compress) for sp in plan.sets],
        "force": force,
        "drain": plan.drains(),
        "applied": do_apply,
        "resumed": do_resume,
        "actions": [a.to_dict() for a in actions],
    }
    rows = [
        {"set": sp.name, "reason": g["reason"], "count": g["count"], "hosts": g["hosts"],
         "kind": g["kind"], "withheld": sp.capped}
        for sp in plan.sets for g in sp.to_dict(compress)["groups"]
    ]
    text = None
    if c.fmt == "table":
        lines = []
        for sp in plan.sets:
            ns = by_name[sp.name]
            lines.append(ns.describe())
            b = sp.baseline
            if b and b.get("class"):
                vals = b.get("values") or {}
                desc = out.cell(", ".join(f"{k} {out.known(vals.get(k))}"
                                          for k in BASELINE_KEYS))
                how = "pinned" if b.get("pinned") else f"majority {b.get('share', 0):.0%}"
                lines.append(f"  baseline: class {b['class']} ({how}, {b['count']} "
                             f"nodes): {desc}")
            elif b:
                lines.append(f"  baseline: pinned {out.cell(b.get('pin'))}, no class matches")
            if sp.note:
                lines.append(f"  NOTE: {out.cell(sp.note)}")
            if not sp.recommendations:
                lines.append("  nothing to drain")
            else:
                verb = "WITHHELD (cap)" if sp.capped else "recommend drain"
                sub = [r for r in rows if r["set"] == sp.name]
                of = count(len(sp.hosts), "node")
                lines.append(f"  {verb}: {len(sp.recommendations)} of {of}")
                lines.append(out.table(sub, RECO_COLUMNS[1:], c.width,
                                       wrap=("reason", "hosts")).rstrip("\n"))
        if actions:
            lines.append("actions:")
            lines.append(out.table([a.to_dict() for a in actions], ACTION_COLUMNS,
                                   c.width, keep=("host",), wrap=("reason", "detail")).rstrip("\n"))
        elif do_apply or do_resume:
            lines.append("actions: none (nothing to do)")
        text = "\n".join(lines) + "\n"
    c.emit(doc, rows=rows, columns=RECO_COLUMNS, text=text,
           csv_columns=[("set", "set"), ("reason", "reason"), ("kind", "kind"),
                        ("count", "count"), ("hosts", "hosts"), ("withheld", "withheld")])
