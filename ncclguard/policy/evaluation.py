"""The compatibility policy: fingerprints of an allocation's nodes -> :class:`Verdict`.

:func:`evaluate` is pure: no clock, no files, no Slurm. It is what the prolog gate and
``ncclguard check`` both call.

1. Scope: a partition that is not guarded, or fewer nodes than ``min_nodes``: accept,
   with a note.
2. Nodes without a record are *unknown*: the ``unknown-node`` rule names them and the
   other rules skip them. Nodes with a stale heartbeat (``stale``, decided by the caller)
   are compared by their last known record, and ``unknown-node`` names them too.
3. Nodes are grouped into classes first by fingerprint object (the store may hand one
   dict to all nodes of a class), then by the values each rule reads, so that N
   identical nodes cost one comparison.
4. Each rule's findings get the configured severity; the decision is the worst of them.
5. ``odd_nodes``: the fewest nodes whose removal leaves no refuse-level finding
   (:func:`odd_nodes`); among several such sets, the one that keeps most of ``prefer``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

from ncclguard.config import PolicyConfig
from ncclguard.fingerprint.compat import VALUES_VERSION
from ncclguard.policy.rules import COMPARISONS, unknown_node
from ncclguard.policy.rules.base import ANY, Rule, Values, aspects, compare, value_of
from ncclguard.policy.settings import severity_of
from ncclguard.policy.verdict import SEVERITY_RANK, Finding, Verdict

__all__ = [
    "GATE_VALUES",
    "NODE_VALUES",
    "StoredValues",
    "evaluate",
    "evaluate_values",
    "in_scope",
    "node_values",
    "odd_nodes",
    "partitions_of",
    "valid_values",
]

#: The marker (and format version) of a :func:`node_values` record.
NODE_VALUES = "ncclguard_node_values"


def node_values(fp: dict) -> dict:
    """Everything the rules read from one fingerprint, as a small JSON-ready record.

    ``{"ncclguard_node_values": 1, "rules": {rule: {aspect: value}}}``.
    :func:`evaluate_values` takes it in place of the fingerprint and gives the same
    verdict. Computed where the fingerprint is written (inventoryd / the store), it takes
    the per-node work off the gate's path: nodes with equal records (equal
    :func:`json.dumps` with sorted keys) can share one decoded object, and then cost one
    comparison together.
    """
    from ncclguard.fingerprint.offers import offered
    from ncclguard.fingerprint.transport import transport_inputs

    values = _rule_values(fp, COMPARISONS)
    return {NODE_VALUES: 1, "rules": {r.name: v for r, v in zip(COMPARISONS, values, strict=True)},
            "container": container_values(fp),
            "job": {"net": offered(fp, "net"), "inputs": transport_inputs(fp)}}


def container_values(fp: dict) -> dict[str, str | None]:
    """What a job in a container meets on this node (issue 15, docs/containers.md): the
    net plugin the node injects (``injected``: ``"name|v8,v7"``; ``""``: none; None: not
    known: a daemon before issue 15, or the part's ``unknown`` says why) and the transport
    NCCL's own code gives this node (``internal``; None: unknown)."""
    from ncclguard.fingerprint.transport import effective_transport

    part = fp.get("containers")
    injected: str | None = None
    if isinstance(part, dict) and not part.get("unknown"):
        net = part.get("net_plugin")
        if isinstance(net, dict):
            abis = [a for a in net.get("abis") or [] if type(a) is int]
            injected = f"{net.get('name') or net.get('target') or 'plugin'}|" + ",".join(
                str(a) for a in sorted(abis, reverse=True))
        else:
            injected = ""
    try:
        internal = effective_transport(fp, with_plugin=False)
    except (TypeError, ValueError, AttributeError, KeyError):
        internal = None
    return {"injected": injected, "internal": internal}


def valid_values(record: Any) -> bool:
    """Whether ``record`` has the shape and types of a :func:`node_values` record:
    ``{marker: 1, "rules": {rule: {aspect: str | None}}}`` with every comparison rule.
    The gate reads such records from the inventory; one that is not (a damaged or
    poisoned row: ``"driver": ["x"]`` crashed the comparison, which hashes the values;
    ``"rules": {}`` or ``{rule: {}}`` made every rule unknown, so never different) is
    computed again from the fingerprint."""
    if not isinstance(record, dict):
        return False
    marker = record.get(NODE_VALUES)
    rules = record.get("rules")
    if type(marker) is not int or marker != 1 or not isinstance(rules, dict):
        return False
    if not rules.keys() >= _RULE_NAMES:
        return False
    for part in ("container", "job"):  # {name: str | None}, where present
        got = record.get(part)
        if got is not None and (not isinstance(got, dict) or not all(
                isinstance(k, str) and (v is None or isinstance(v, str))
                for k, v in got.items())):
            return False
    for name, values in rules.items():
        if not isinstance(name, str) or not isinstance(values, dict) or not values:
            return False  # node_values gives every rule at least one aspect
        for aspect, value in values.items():
            if not isinstance(aspect, str) or not (value is None or isinstance(value, str)):
                return False
    return True


_RULE_NAMES = frozenset(r.name for r in COMPARISONS)


class StoredValues(NamedTuple):
    """What the store keeps for the gate (``ncclguard.store.GateValues``): the records of
    :func:`node_values`, their marker, the version they were computed by, and the check
    of a decoded record; with the classes of a policy
    (:func:`ncclguard.policy.schedule.class_values`), each record's class key and what
    the keys were derived under."""

    version: int
    marker: str
    compute: Callable[[dict[str, Any]], dict[str, Any]]
    check: Callable[[Any], bool] = valid_values
    classify: Callable[[dict[str, Any]], str] | None = None
    class_policy: str | None = None


#: Handed to every :class:`~ncclguard.store.Inventory` that writes the gate's tables or
#: reads them (the daemon, the gate): the store itself never imports the policy. A change
#: of meaning in a rule's values bumps ``VALUES_VERSION`` (ncclguard/fingerprint/compat.py).
GATE_VALUES = StoredValues(VALUES_VERSION, NODE_VALUES, node_values)


def partitions_of(partition: str | None) -> set[str]:
    """The partitions of a job's partition value: Slurm gives a job submitted to several
    (``-p a,b``) the comma-separated list until it runs."""
    return {p for p in (partition or "").split(",") if p}


def in_scope(config: PolicyConfig, partition: str | None, node_count: int) -> str | None:
    """``None`` when the allocation is to be checked, else the note saying why not.

    A multi-partition value (``a,b``) is guarded when any of its partitions is. An unknown
    partition (``None``) is checked.
    """
    if (
        config.partitions
        and partition is not None
        and not partitions_of(partition) & set(config.partitions)
    ):
        return f"partition {partition} is not guarded"
    if node_count < config.min_nodes:
        return f"{node_count} node(s), fewer than min_nodes={config.min_nodes}: not checked"
    return None


def _rule_values(fp: dict, rules: Sequence[Rule]) -> list[Values]:
    """Each rule's values for one fingerprint; a shared source is read once."""
    shared: dict[object, Values] = {}
    out: list[Values] = []
    for rule in rules:
        if rule.source is None:
            out.append(rule.values(fp))
            continue
        src = shared.get(rule.source)
        if src is None:
            src = shared[rule.source] = rule.source(fp)
        out.append(rule.project(src, computed=True))
    return out


def _record_values(record: dict, rules: Sequence[Rule]) -> list[Values]:
    """Each rule's values from a :func:`node_values` record (a rule it lacks: unknown)."""
    known = record["rules"]
    return [known.get(rule.name) or {ANY: None} for rule in rules]


#: How :func:`_evaluate` reads a node: a fingerprint, or a :func:`node_values` record.
Reader = Callable[[dict, Sequence[Rule]], list[Values]]


def _classes(
    nodes: Mapping[str, dict], rules: Sequence[Rule], read: Reader
) -> list[tuple[list[Values], list[str]]]:
    """``(values per rule, hosts)`` for each distinct combination of rule values."""
    by_object: dict[int, tuple[dict, list[str]]] = {}
    for host, node in nodes.items():
        by_object.setdefault(id(node), (node, []))[1].append(host)
    merged: dict[tuple, tuple[list[Values], list[str]]] = {}
    for node, hosts in by_object.values():
        per_rule = read(node, rules)
        key = tuple(tuple(sorted(v.items())) for v in per_rule)
        entry = merged.get(key)
        if entry is None:
            merged[key] = (per_rule, hosts)
        else:
            entry[1].extend(hosts)
    return list(merged.values())


def odd_nodes(
    signatures: Sequence[tuple[Sequence[str | None], Sequence[str]]],
    prefer: Collection[str] = (),
) -> list[str]:
    """The fewest hosts whose removal leaves the rest agreeing on every position.

    ``signatures`` are ``(values, hosts)`` classes; ``values`` has one entry per compared
    aspect, ``None`` for unknown (agrees with anything). The kept set must have at most
    one known value per position, so the search branches only where classes disagree:
    at the first disagreeing position, keep each value in turn (with the unknowns) and
    recurse; a branch that cannot beat the best kept count is cut. With no unknowns this
    is "keep the largest class".

    Ties (several minimum odd sets): the kept set with the most hosts in ``prefer`` wins
    (the gate passes the nodes of the partition's majority class), then the one whose
    sorted host names come first, so the answer does not depend on input order.
    """
    return _odd_search(signatures, prefer)[0]


def _odd_search(
    signatures: Sequence[tuple[Sequence[str | None], Sequence[str]]],
    prefer: Collection[str] = (),
) -> tuple[list[str], bool]:
    """:func:`odd_nodes`, and whether several minimum odd sets existed (a tie)."""
    weights = [len(set(hosts)) for _, hosts in signatures]
    preferred = set(prefer)
    liked = [len(preferred.intersection(hosts)) for _, hosts in signatures] if preferred else []
    width = len(signatures[0][0]) if signatures else 0
    # best: (kept weight, kept preferred hosts, kept host names, kept class indexes)
    best: list[tuple[int, int, list[str], frozenset[int]] | None] = [None]
    tie = [False]

    def consider(weight: int, cands: list[int]) -> None:
        current = best[0]
        if current is not None and weight < current[0]:
            return
        idx = frozenset(cands)
        if current is not None and weight == current[0]:
            if idx == current[3]:
                return
            tie[0] = True
        else:
            tie[0] = False
        score = sum(liked[c] for c in cands) if liked else 0
        if current is not None and weight == current[0]:
            if score < current[1]:
                return
            if score == current[1]:
                hosts = _kept_hosts(signatures, cands)
                if hosts >= current[2]:
                    return
                best[0] = (weight, score, hosts, idx)
                return
        best[0] = (weight, score, _kept_hosts(signatures, cands), idx)

    def search(cands: list[int], start: int) -> None:
        weight = sum(weights[c] for c in cands)
        if best[0] is not None and weight < best[0][0]:
            return
        for pos in range(start, width):
            known = {signatures[c][0][pos] for c in cands} - {None}
            if len(known) > 1:
                for value in sorted(known):  # type: ignore[type-var]
                    search([c for c in cands if signatures[c][0][pos] in (value, None)], pos + 1)
                return
        consider(weight, cands)

    search(list(range(len(signatures))), 0)
    kept = set(best[0][2]) if best[0] is not None else set()
    return sorted({h for _, hosts in signatures for h in hosts} - kept), tie[0]


def _kept_hosts(
    signatures: Sequence[tuple[Sequence[str | None], Sequence[str]]], idx: list[int]
) -> list[str]:
    return sorted({h for c in idx for h in signatures[c][1]})


def _refuse_signatures(
    rules: Sequence[Rule],
    severities: Sequence[str],
    classes: Sequence[tuple[list[Values], list[str]]],
) -> list[tuple[list[str | None], list[str]]]:
    """Project classes onto the aspects of refuse-level rules that show a difference."""
    columns: list[tuple[int, str]] = []
    for i, (rule, sev) in enumerate(zip(rules, severities, strict=True)):
        if sev != "refuse":
            continue
        per_rule = [(values[i], hosts) for values, hosts in classes]
        for aspect in aspects(per_rule):
            if aspect in rule.warn_only:
                continue
            seen = {value_of(values[i], aspect) for values, _ in classes} - {None}
            if len(seen) > 1:
                columns.append((i, aspect))
    return [
        ([value_of(values[i], aspect) for i, aspect in columns], hosts)
        for values, hosts in classes
    ]


def evaluate(
    fingerprints: Mapping[str, dict | None],
    config: PolicyConfig,
    stale: Collection[str] = (),
    partition: str | None = None,
    prefer: Collection[str] = (),
) -> Verdict:
    """The verdict for one allocation. ``fingerprints[host] is None``: no record.

    ``prefer``: hosts to keep when several minimum odd sets exist (:func:`odd_nodes`);
    ``Verdict.odd_tie`` says whether there was such a choice.
    """
    return _evaluate(fingerprints, _rule_values, config, stale, partition, prefer)


def evaluate_values(
    records: Mapping[str, dict | None],
    config: PolicyConfig,
    stale: Collection[str] = (),
    partition: str | None = None,
    prefer: Collection[str] = (),
) -> Verdict:
    """:func:`evaluate` over :func:`node_values` records instead of fingerprints (what the
    store keeps for the gate): the same verdict, without reading a fingerprint."""
    return _evaluate(records, _record_values, config, stale, partition, prefer)


def _evaluate(
    fingerprints: Mapping[str, dict | None],
    read: Reader,
    config: PolicyConfig,
    stale: Collection[str],
    partition: str | None,
    prefer: Collection[str],
) -> Verdict:
    nodes = list(fingerprints)
    note = in_scope(config, partition, len(nodes))
    if note is not None:
        return Verdict("accept", nodes=nodes, notes=[note], partition=partition)

    stale_set = set(stale)
    # a stale node's last known record is the best evidence there is: it is compared
    known = {h: fp for h, fp in fingerprints.items() if fp is not None}
    rules = [r for r in COMPARISONS if severity_of(config, r.name) != "ignore"]
    severities = [severity_of(config, r.name) for r in rules]
    classes = _classes(known, rules, read)

    findings: list[Finding] = []
    for i, (rule, sev) in enumerate(zip(rules, severities, strict=True)):
        findings.extend(compare(rule, sev, [(values[i], hosts) for values, hosts in classes]))
    unknown_sev = severity_of(config, unknown_node.NAME)
    forced_odd: list[str] = []
    if unknown_sev != "ignore":
        found = unknown_node.check(fingerprints, stale, unknown_sev)
        findings.extend(found)
        if found and unknown_sev == "refuse":
            missing, old = unknown_node.unknown_hosts(fingerprints, stale_set)
            forced_odd = missing + old

    order = {r.name: i for i, r in enumerate(COMPARISONS)}
    findings.sort(key=lambda f: (-SEVERITY_RANK[f.severity], order.get(f.rule, len(order))))
    worst = max((SEVERITY_RANK[f.severity] for f in findings), default=0)
    decision = ("accept", "warn", "refuse")[worst]

    odd: list[str] = []
    tie = False
    if decision == "refuse":
        # nodes the unknown-node rule refuses are odd already: search among the others
        forced = set(forced_odd)
        rest = [(v, [h for h in hosts if h not in forced]) for v, hosts in classes]
        rest = [(v, hosts) for v, hosts in rest if hosts]
        found_odd, tie = _odd_search(_refuse_signatures(rules, severities, rest), prefer)
        odd = forced_odd + found_odd
    return Verdict(decision, findings, odd, nodes, partition=partition, odd_tie=tie)
