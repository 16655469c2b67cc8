"""``ncclguard nodes`` and ``classes``: what the inventory holds (``show``:
:mod:`ncclguard.cli.show`).

- ``nodes``: one row per node (filters: ``--where``, ``--stale``, ``--errors``), and the
  nodes the canary holds, with why (:mod:`ncclguard.cli.canary`);
- ``classes``: the classes (what the configured refuse-level rules tell apart, each named
  by its Slurm feature: ncclguard/sched/classes.py), with the baseline marked
  (:func:`ncclguard.policy.baseline.choose_baseline`, the one ``drain-recommend`` uses);
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from ncclguard.cli import output as out
from ncclguard.cli.canary import held_doc, held_text, holds
from ncclguard.cli.context import Ctx, format_options, get_ctx, resolve_sets
from ncclguard.cli.errors import fail
from ncclguard.config import HEARTBEAT_SKEW_S
from ncclguard.hostlist import compress
from ncclguard.policy.baseline import choose_baseline
from ncclguard.policy.freshness import heartbeat_state
from ncclguard.text import count

__all__ = ["NO_HOST_NCCL", "classes", "nodes", "parse_where"]


#: --where FIELD: the names an admin types, and the store column each one filters.
WHERE_ALIASES = {
    "nccl": "nccl_version",
    "nccl_any": "has_nccl",
    "plugin": "net_plugin_name",
    "plugin_path": "net_plugin",
    "abi": "net_abi",
    "transport": "transport",
    "driver": "driver",
    "host": "host",
}
CLASS_FIELD = "class"  # --where class=NAME: the class of ncclguard classes (and Slurm's feature)
_INT_COLUMNS = {"net_abi", "rdma_ports_up", "rdma_ports_total", "error_count"}

NODE_TABLE: list[out.Column] = [
    ("host", "HOST"), ("nccl", "NCCL"), ("plugin_cell", "PLUGIN"), ("abi_cell", "ABI"),
    ("adds_cell", "ADDS"), ("transport_cell", "TRANSPORT"), ("rdma", "RDMA"),
    ("driver", "DRIVER"),
    ("heartbeat", "LAST HEARTBEAT"), ("age", "AGE"), ("error_count", "ERRORS"),
    ("class", "CLASS"), ("status", "STATUS"),
]
#: Left out, in this order, while the table does not fit without --wide (AGE says when the
#: last heartbeat was; STATUS says "errors")
NODE_NARROW_DROPS = ("heartbeat", "error_count")
NODE_CSV: list[out.Column] = [
    ("host", "host"), ("nccl_version", "nccl_version"), ("nccl_versions", "nccl_versions"),
    ("net_plugin", "net_plugin"), ("net_plugin_name", "net_plugin_name"),
    ("net_abi", "net_abi"), ("adds", "adds"), ("transport", "transport"),
    ("rdma_ports_up", "rdma_ports_up"),
    ("rdma_ports_total", "rdma_ports_total"), ("driver", "driver"),
    ("last_heartbeat", "last_heartbeat"), ("age_s", "age_s"), ("error_count", "error_count"),
    ("class", "class"), ("status", "status"), ("held", "held"),
]
#: shown while a node of the view is held by the canary (docs/canary.md): its state; the
#: lines under the table say why, for the first SHOWN_HELD of them
CANARY_COLUMN: out.Column = ("canary_cell", "CANARY")
SHOWN_HELD = 20


def parse_where(items: Sequence[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` filters for ``Inventory.nodes``: aliases, ``none``, lists, ints."""
    from ncclguard.store.rows import NODE_COLUMNS as STORE_COLUMNS

    where: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            fail(f"--where {item!r}: expected FIELD=VALUE")
        column = WHERE_ALIASES.get(name, name)
        if column not in STORE_COLUMNS and column not in ("has_nccl", CLASS_FIELD):
            known = ", ".join([*WHERE_ALIASES, CLASS_FIELD, *(
                c for c in STORE_COLUMNS if c not in WHERE_ALIASES.values())])
            fail(f"--where {item!r}: unknown field {name!r} (known: {known})")
        values: list[Any] = []
        for v in value.split(","):
            v = v.strip()
            if v.lower() in ("none", "null", "-"):
                values.append(None)
            elif column in _INT_COLUMNS:
                try:
                    values.append(int(v))
                except ValueError:
                    fail(f"--where {item!r}: {name} takes an integer, got {v!r}")
            else:
                values.append(v)
        if column in where:
            prev = where[column]
            values = [*(prev if isinstance(prev, list) else [prev]), *values]
        if None in values and len(values) > 1:
            fail(f"--where {item!r}: 'none' cannot be combined with other values")
        where[column] = values[0] if len(values) == 1 else values
    return where


def _compat(r: dict[str, Any]) -> dict[str, Any]:
    """The row's stored compatibility values (a damaged one: none)."""
    import json

    try:
        got = json.loads(r.get("compat_values") or "{}")
    except (TypeError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def _node_row(r: dict[str, Any], now: float, ttl: float) -> dict[str, Any]:
    """The store's row (ours to change) with the derived cells added."""
    hb = r.get("last_heartbeat")
    age = None if hb is None else now - hb
    state = heartbeat_state(hb, now, ttl)
    stale = state != "ok"
    versions = r.get("nccl_versions") or []
    nccl = r.get("nccl_version")
    values = _compat(r)
    hostless = values.get("nccl") == out.NONE  # read: no libnccl (NULL: that, or unknown)
    shown = nccl or (out.NONE if hostless else out.UNKNOWN)
    if len(versions) > 1 or (versions and versions[0] != nccl):
        others = [v for v in versions if v != nccl]
        shown += f" (+{','.join(others)})" if others else ""
    when = out.iso(hb)
    r["last_heartbeat"] = when
    r["age_s"] = None if age is None else round(age, 1)
    r["stale"] = stale
    # "future": a heartbeat dated ahead of this clock (the node's clock is ahead)
    r["status"] = state if stale else ("errors" if r.get("error_count") else "ok")
    r["adds"] = values.get("adds")
    # table-only cells: none, unknown, or "-" where nothing applies (docs/cli.md)
    r["nccl"] = shown
    if nccl is None and r.get("net_abi") == 0:
        r["net_abi"] = None  # no libnccl: no ABI in force (ADDS: what the node offers)
    # the plugin and ABI the host's libnccl uses: on a node without one, nothing is in
    # force (not the plugin file's name); otherwise its name, "none", or unknown
    r["plugin_cell"] = NO_HOST_NCCL if hostless else out.known(
        r.get("net_plugin_name") or values.get("net_plugin"))
    r["abi_cell"] = NO_HOST_NCCL if hostless else out.known(r.get("net_abi"))
    r["adds_cell"] = out.known(r["adds"])
    r["transport_cell"] = out.known(r.get("transport"))
    up, total = r.get("rdma_ports_up"), r.get("rdma_ports_total")
    r["rdma"] = f"{'?' if up is None else up}/{'?' if total is None else total}"
    r["heartbeat"] = when
    r["age"] = out.age(age)
    return r


def _missing_row(host: str) -> dict[str, Any]:
    return {"host": host, "nccl_versions": [], "stale": True, "status": "missing",
            "last_heartbeat": None, "age_s": None, "error_count": None, "nccl": None,
            "rdma": None, "heartbeat": None, "age": None}


@click.command()
@click.option("--partition", "-p", default=None, help="Only nodes of this Slurm partition.")
@click.option("--nodes", "nodes_opt", metavar="HOSTLIST", default=None,
              help="Only these nodes (no Slurm needed).")
@click.option("--where", "-w", "where", multiple=True, metavar="FIELD=VALUE",
              help="Filter (repeatable; VALUE may be a comma list; 'none' matches unset). "
                   "FIELD: nccl, nccl_any, plugin, plugin_path, abi, transport, driver, "
                   "host, class, or a store column.")
@click.option("--stale", is_flag=True, help="Only nodes whose heartbeat is stale or missing.")
@click.option("--errors", is_flag=True, help="Only nodes with probe errors.")
@format_options
def nodes(partition: str | None, nodes_opt: str | None, where: tuple[str, ...], stale: bool,
          errors: bool, as_json: bool, as_csv: bool) -> None:
    """One row per node: NCCL, net plugin and ABI, transport, RDMA ports, driver, heartbeat."""
    c = get_ctx(as_json, as_csv)
    filters = parse_where(where)
    by_class = filters.pop(CLASS_FIELD, None)
    sets = resolve_sets(c, partition, nodes_opt)
    rows = c.inv("nodes", filters or None)
    names = c.class_names()
    now, ttl = c.now, c.stale_after
    result = [_node_row(r, now, ttl) | {"class": names.get(r["host"])} for r in rows]
    if by_class is not None:
        wanted = set(by_class) if isinstance(by_class, list) else {by_class}
        result = [r for r in result if r["class"] in wanted]
        filters[CLASS_FIELD] = by_class
    node_set = sets[0] if sets else None
    if node_set is not None:
        members = set(node_set.hosts)
        result = [r for r in result if r["host"] in members]
        if not filters and not errors:  # a node not in the inventory is a row of its own
            have = {r["host"] for r in result}
            result += [_missing_row(h) for h in node_set.hosts if h not in have]
            result.sort(key=lambda r: r["host"])
    if stale:
        result = [r for r in result if r["stale"]]
    if errors:
        result = [r for r in result if r.get("error_count")]
    held = holds(c, [r["host"] for r in result])
    for r in result:
        row = held.get(r["host"])
        r["held"], r["canary"] = held_text(row), held_doc(row)
        r["canary_cell"] = row["state"] if row else ""
    note = c.writer_note()

    def doc() -> dict[str, Any]:  # built only for --json
        return {
            "node_set": node_set.to_dict() if node_set else None,
            "filters": {"where": filters, "stale": stale, "errors": errors},
            "inventory": note,
            "count": len(result),
            "nodes": [{k: r.get(k) for k, _ in NODE_CSV}
                      | {"stale": r["stale"], "canary": r["canary"]} for r in result],
        }

    columns = [*NODE_TABLE, CANARY_COLUMN] if held else NODE_TABLE
    text = None
    if c.fmt == "table":
        head = f"{node_set.describe()}\n" if node_set else ""
        text = head + out.table(result, columns, c.width, optional=NODE_NARROW_DROPS,
                                keep=("host", "class", "canary_cell"),
                                wrap=("nccl", "adds_cell"))
        text += f"{count(len(result), 'node')}\n"
        text += _held_lines([r for r in result if r["held"]], c.width)
        if note:
            text += f"NOTE: {out.cell(note)}\n"
    c.emit(doc, rows=result, columns=columns, text=text, csv_columns=NODE_CSV)


def _held_lines(rows: list[dict[str, Any]], width: int | None) -> str:
    """``HOST: held by canary (STATE) since T: REASON`` under the table, for the first
    :data:`SHOWN_HELD` held nodes (``ncclguard canary status`` lists them all)."""
    text = "".join(out.wrap(f"{r['host']}: {r['held']}", width) + "\n"
                   for r in rows[:SHOWN_HELD])
    if len(rows) > SHOWN_HELD:
        text += (f"... and {count(len(rows) - SHOWN_HELD, 'more node')} held: "
                 "ncclguard canary status\n")
    return text


CLASS_COLUMNS: list[out.Column] = [
    ("baseline_mark", " "), ("class", "CLASS"), ("count", "NODES"), ("share_pct", "SHARE"),
    ("nccl", "NCCL"), ("net_plugin", "PLUGIN"), ("net_abi", "ABI"), ("adds", "ADDS"),
    ("transport", "TRANSPORT"), ("stale", "STALE"), ("hosts", "HOSTS"),
]
#: Left out without --wide while the table does not fit: NODES says the size
CLASS_NARROW_DROPS = ("share_pct",)
#: a column shown when the configured refuse-level rules tell classes apart on more than
#: the four above (an env plugin, or a rule an admin set to refuse: gpu-driver)
ALSO_COLUMN: out.Column = ("also", "ALSO DIFFERS")
CLASS_CSV: list[out.Column] = [
    ("class", "class"), ("class_key", "class_key"), ("count", "count"), ("share", "share"),
    ("nccl", "nccl"), ("net_plugin", "net_plugin"), ("net_abi", "net_abi"), ("adds", "adds"),
    ("transport", "transport"), ("stale", "stale"), ("baseline", "baseline"),
    ("hosts", "hosts"),
]
_SHOWN = ("nccl", "net_plugin", "net_abi", "adds", "transport")
#: PLUGIN and ABI say what the host's libnccl does with the node's plugin: on a node
#: without one, nothing applies ("-"); ADDS says what the node offers a job's own NCCL
#: (issue 39)
NO_HOST_NCCL = out.NOT_APPLICABLE


@click.command()
@click.option("--partition", "-p", default=None, help="Only nodes of this Slurm partition.")
@click.option("--nodes", "nodes_opt", metavar="HOSTLIST", default=None,
              help="Only these nodes (no Slurm needed).")
@format_options
def classes(partition: str | None, nodes_opt: str | None, as_json: bool, as_csv: bool) -> None:
    """The classes: what the configured refuse-level rules tell apart. Each is named by
    its Slurm feature; the baseline is marked."""
    c = get_ctx(as_json, as_csv)
    sets = resolve_sets(c, partition, nodes_opt)
    node_set = sets[0] if sets else None
    view = c.classes(node_set.hosts if node_set else None)
    cls = view.classes
    stale = set(c.inv("stale", c.now, c.stale_after, HEARTBEAT_SKEW_S))
    total = sum(len(k.hosts) for k in cls)
    fresh = {k.key: sum(1 for h in k.hosts if h not in stale) for k in cls}
    base, why = choose_baseline(fresh, {k.key: k.values for k in cls}, c.config)[:2]
    rules = _refuse_values(c, cls)
    also = _also_differs(rules)
    rows = []
    for k in cls:
        v = k.values
        rows.append({
            "class": view.name(k.key), "class_key": k.key, "values": v,
            "differs": {f: vals for f, vals in k.spread.items()},
            "rules": rules.get(k.key, {}), "also": also.get(k.key, ""),
            "count": len(k.hosts),
            "share": round(len(k.hosts) / total, 4) if total else 0.0,
            "share_pct": f"{len(k.hosts) / total:.0%}" if total else "-",
            **{f: _cell(v.get(f), k.spread.get(f)) for f in _SHOWN},
            **({"net_plugin": NO_HOST_NCCL, "net_abi": NO_HOST_NCCL}
               if v.get("nccl") == "none" and not k.spread.get("nccl") else {}),
            "stale": sum(1 for h in k.hosts if h in stale),
            "baseline": k.key == base, "baseline_mark": "*" if k.key == base else "",
            "hosts": compress(k.hosts),
        })
    missing: list[str] = []
    if node_set is not None:
        have = {h for k in cls for h in k.hosts}
        missing = [h for h in node_set.hosts if h not in have]
    oldest = c.inv("oldest_heartbeat", node_set.hosts if node_set else None)
    n_stale = sum(r["stale"] for r in rows)
    note = c.writer_note()
    other_policy = _other_policy(c)
    freshness = {"stale": n_stale, "stale_after_s": c.stale_after,
                 "oldest_heartbeat": out.iso(oldest),
                 "oldest_age_s": None if oldest is None else round(c.now - oldest, 1),
                 "inventory": note}
    in_force = _class_in_force(c, {h: k.key for k in cls for h in k.hosts})
    base_name = view.name(base) if base else None
    doc = {
        "node_set": node_set.to_dict() if node_set else None,
        "total": total,
        "freshness": freshness,
        "baseline": {"class": base_name, "class_key": base, "why": why},
        "classes": [{**{k: r[k] for k in ("class", "class_key", "values", "differs", "rules",
                                           "count", "share", "stale", "baseline", "hosts")},
                     "in_force": in_force.get(r["class_key"], {})} for r in rows],
        "missing": {"count": len(missing), "hosts": compress(missing) if missing else ""},
        "collector_policy_differs": other_policy,
    }
    text = None
    if c.fmt == "table":
        lines = [node_set.describe()] if node_set else []
        lines.append(f"{count(total, 'node')} in {count(len(cls), 'class', 'classes')}; baseline: "
                     + out.cell(f"{base_name} ({why})" if base else why))
        columns = ([*CLASS_COLUMNS[:-2], ALSO_COLUMN, *CLASS_COLUMNS[-2:]] if also
                   else CLASS_COLUMNS)
        text = "\n".join(lines) + "\n" + out.table(rows, columns, c.width,
                                                   optional=CLASS_NARROW_DROPS,
                                                   keep=("class",),
                                                   wrap=("adds", "also", "hosts"))
        if oldest is not None:
            text += (f"freshness: {n_stale} of {count(total, 'node')} stale (no heartbeat for "
                     f"{c.stale_after:.0f} s, or dated ahead); oldest heartbeat "
                     f"{out.iso(oldest)} ({out.age(c.now - oldest)} ago)\n")
        if note:
            text += f"freshness: {out.cell(note)}\n"
        if missing:
            text += (f"not in the inventory: {count(len(missing), 'node')}: "
                     f"{out.cell(compress(missing))}\n")
        if other_policy:
            text += ("note: the collector stored these classes under other severities than "
                     f"{c.config.source}'s; shown are this config's (reload the collector "
                     "where the config changed: systemctl reload ncclguard-collector)\n")
    c.emit(doc, rows=rows, columns=CLASS_COLUMNS, text=text, csv_columns=CLASS_CSV)


def _other_policy(c: Ctx) -> bool:
    """Whether the collector derived the stored classes under another policy than this
    config's (one of the two configs changed and the collector was not reloaded)."""
    from ncclguard.policy.schedule import class_policy

    stored = c.inv("stored_class_policy")
    return stored is not None and stored != class_policy(c.config.policy)


def _cell(value: Any, spread: list[Any] | None) -> Any:
    """A class's value (unknown: :data:`out.UNKNOWN`); where its nodes differ (a rule at
    warn), every value seen."""
    if spread:
        return "|".join(str(out.known(v)) for v in spread)
    return out.known(value)


def _refuse_values(c: Ctx, cls: list[Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per class: what the refuse-level rules read of it (one node stands for its class:
    the rules read the same of every node of a class)."""
    from ncclguard.policy.schedule import refuse_values

    reps = {k.key: k.hosts[0] for k in cls}
    records = c.inv("load_values", list(reps.values()))
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for key, host in reps.items():
        rec = records.get(host)
        found[key] = refuse_values(rec[0], c.config.policy) if rec is not None else {}
    return found


def _also_differs(rules: dict[str, dict[str, dict[str, Any]]]) -> dict[str, str]:
    """Per class, the refuse-level values (other than the shown columns' rules) on which
    the classes in view differ: ``gpu-driver=550.54.15``. Empty when there are none."""
    from ncclguard.policy.schedule import SHOWN_ASPECTS, SHOWN_RULES

    varying: set[tuple[str, str]] = set()
    items = list(rules.values())
    for rule_values in items:
        for rule, aspects in rule_values.items():
            if rule in SHOWN_RULES:
                continue
            for aspect, value in aspects.items():
                if (rule, aspect) in SHOWN_ASPECTS:
                    continue
                if any(other.get(rule, {}).get(aspect) != value for other in items):
                    varying.add((rule, aspect))
    if not varying:
        return {}
    single = {rule for rule, _ in varying
              if all(len(rv.get(rule, {})) <= 1 for rv in items)}  # a rule of one aspect
    shown_by_key: dict[str, str] = {}
    from ncclguard.policy.rules import BY_NAME
    from ncclguard.policy.rules.base import PLAIN_LABEL

    def shown(rule: str, aspect: str, value: Any) -> str:
        """``rule.aspect=value``; a rule with labels of its own (node-adds: a few words,
        not its release-by-release key) as its findings label the value."""
        r = BY_NAME.get(rule)
        plain = r is None or r.label is PLAIN_LABEL
        if value is None and not plain:  # as the gate's findings say it
            return f"{rule}: {aspect} {out.UNKNOWN}"
        if r is None or plain or not isinstance(value, str):
            return f"{rule}{'' if rule in single else '.' + aspect}={out.known(value)}"
        return f"{rule}: {r.label(aspect, value)}"

    for key, rule_values in rules.items():
        parts = [shown(rule, aspect, rule_values.get(rule, {}).get(aspect))
                 for rule, aspect in sorted(varying)]
        shown_by_key[key] = " ".join(parts)
    return shown_by_key


def _class_in_force(c: Ctx, key_of: dict[str, str]) -> dict[str, dict[str, dict[str, int]]]:
    """Per class key: ``{kind: {"NAME vN" | "none" | "unknown": nodes}}`` for the plugins
    other than net (the store's v4 columns). A class is grouped on the refuse-level values
    only, so its nodes may differ here (a tuner, a GIN plugin: warn-level rules)."""
    from ncclguard.fingerprint.model import EFFECTIVE_KINDS

    if not key_of:
        return {}
    per_class: dict[str, dict[str, dict[str, int]]] = {}
    for row in c.inv("nodes", {"host": sorted(key_of)}):
        per = per_class.setdefault(key_of[row["host"]], {k: {} for k in EFFECTIVE_KINDS})
        for kind in EFFECTIVE_KINDS:
            name, abi = row.get(f"{kind}_plugin"), row.get(f"{kind}_abi")
            value = ("unknown" if name is None else name if name == "none" or not abi
                     else f"{name} v{abi}")
            if name not in (None, "none") and not abi:
                value = f"{name} (ignored: no common ABI)"
            per[kind][value] = per[kind].get(value, 0) + 1
    return per_class
