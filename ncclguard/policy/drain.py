"""Drain recommendations: which nodes to take out of service, why, and the two safety rails.

:func:`recommend` is a pure function. It takes, per node, the few facts it needs
(:class:`NodeFacts`: its class, last heartbeat, active RDMA ports), the node sets
to judge (Slurm partitions, or a hostlist given by hand), a ``judge`` that says which
refuse-level rules separate two classes (built on the gate's own policy by
:func:`policy_judge`), and the config. It returns a :class:`Plan`: per node set, the
baseline, the recommendations grouped by reason, and whether a rail stopped them.

For each node set:

- nodes whose inventory is missing or stale: ``ncclguard: no heartbeat since …``;
- the baseline of the fresh nodes (:func:`ncclguard.policy.baseline.choose_baseline`, as
  ``ncclguard classes`` marks it): the config's pinned ``[baseline]`` if there is one,
  else the largest class if it holds more than ``drain.majority`` of them.
  With no clear majority (a rolling upgrade, a 50/50 split) nothing is recommended
  against a baseline, and the plan says so;
- nodes outside the baseline on a refuse-level rule, with the differing values;
- nodes with RDMA ports down that are active on the baseline's nodes;
- the cap: more than ``drain.max_share`` of the set is withheld unless ``force``.

:func:`apply` and :func:`resume` carry a plan out through the Slurm adapter. Both only
ever touch drains whose reason starts with ``ncclguard:``, both are idempotent, and both
return the list of what they did (and did not do, and why).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ncclguard.config import Config
from ncclguard.policy.baseline import choose_baseline, pin_diffs
from ncclguard.policy.freshness import is_stale
from ncclguard.policy.settings import BASELINE_KEYS, severity_of
from ncclguard.slurm import clean_text
from ncclguard.timeparse import iso_utc

REASON_PREFIX = "ncclguard:"
REASON_MAX = 250  # the adapter cuts drain reasons to this length

KIND_MISSING = "missing"
KIND_STALE = "stale"
KIND_CLASS = "class"
KIND_PORTS = "ports"


@dataclass(frozen=True)
class NodeFacts:
    """What the recommendation needs to know about one node in the inventory."""

    host: str
    klass: str | None  # its class's name (ncclguard/sched/classes.py), as Slurm's feature
    values: Mapping[str, Any]  # what the class's nodes share (store.NodeClass.values)
    last_heartbeat: float | None
    ports_up: int | None = None  # ACTIVE RDMA ports; None: unknown (a port state unreadable)
    ports_total: int | None = None


@dataclass(frozen=True)
class Recommendation:
    host: str
    kind: str  # missing | stale | class | ports
    reason: str  # the Slurm drain reason, starting with "ncclguard:"


@dataclass
class SetPlan:
    """The verdict for one node set (a partition, or the hostlist given with --nodes)."""

    name: str
    hosts: list[str]
    baseline: dict[str, Any] | None = None  # class, values, count, share, pinned
    note: str | None = None  # why there is no baseline, or what a rail did
    recommendations: list[Recommendation] = field(default_factory=list)
    cap: int = 0  # most nodes that may be recommended without force
    capped: bool = False  # recommendations withheld by the cap
    no_majority: bool = False

    @property
    def effective(self) -> list[Recommendation]:
        """The recommendations that stand (none when the cap withheld them)."""
        return [] if self.capped else self.recommendations

    def groups(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for r in self.recommendations:
            out.setdefault(r.reason, []).append(r.host)
        return out

    def to_dict(self, compress: Callable[[Iterable[str]], str]) -> dict[str, Any]:
        kinds = {r.reason: r.kind for r in self.recommendations}
        return {
            "name": self.name,
            "size": len(self.hosts),
            "baseline": self.baseline,
            "no_majority": self.no_majority,
            "cap": self.cap,
            "capped": self.capped,
            "note": self.note,
            "groups": [
                {"reason": reason, "kind": kinds[reason], "count": len(hosts),
                 "hosts": compress(hosts)}
                for reason, hosts in self.groups().items()
            ],
            "recommended": sorted(r.host for r in self.effective),
            "withheld": sorted(r.host for r in self.recommendations) if self.capped else [],
        }


@dataclass
class Plan:
    sets: list[SetPlan]
    force: bool = False

    def drains(self) -> dict[str, str]:
        """``{host: reason}`` of every recommendation that stands (first set wins)."""
        out: dict[str, str] = {}
        for s in self.sets:
            for r in s.effective:
                out.setdefault(r.host, r.reason)
        return out

    def causes(self) -> set[str]:
        """Every host with a cause for draining, withheld ones included."""
        return {r.host for s in self.sets for r in s.recommendations}

    def conclusive(self, host: str) -> bool:
        """Whether every set holding ``host`` had a baseline to judge it against."""
        return all(s.baseline is not None for s in self.sets if host in s.hosts)


#: judge(baseline_key, other_key) -> [(rule, message)] of refuse-level differences.
Judge = Callable[[str, str], list[tuple[str, str]]]


def _fmt(v: Any) -> str:
    return "unknown" if v is None else str(v)


def _value_diffs(values: Mapping[str, Any], base: Mapping[str, Any]) -> list[str]:
    out = []
    for k in sorted(set(values) | set(base)):
        if values.get(k) != base.get(k):
            out.append(f"{k} {_fmt(values.get(k))} (baseline {_fmt(base.get(k))})")
    return out


def _class_reason(rules: Sequence[str], texts: Sequence[str]) -> str:
    names = ",".join(dict.fromkeys(rules))
    return f"{REASON_PREFIX} {names}: {'; '.join(texts)}"


def recommend(
    node_sets: Mapping[str, Sequence[str]],
    facts: Mapping[str, NodeFacts],
    judge: Judge,
    config: Config,
    *,
    now: float,
    force: bool = False,
) -> Plan:
    """Recommendations for each node set. Pure: no I/O, no clock (``now`` is given)."""
    ttl = float(config.inventory.stale_after_s)
    pin = dict(config.baseline)
    plan = Plan(sets=[], force=force)
    judged: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for name, members in node_sets.items():
        hosts = list(dict.fromkeys(members))
        sp = SetPlan(name=name, hosts=hosts)
        sp.cap = math.floor(config.drain.max_share * len(hosts) + 1e-9)
        recs: dict[str, Recommendation] = {}
        fresh: list[NodeFacts] = []
        for h in hosts:
            f = facts.get(h)
            if f is None:
                recs[h] = Recommendation(h, KIND_MISSING,
                                         f"{REASON_PREFIX} no heartbeat (not in the inventory)")
            elif is_stale(f.last_heartbeat, now, ttl):
                since = iso_utc(f.last_heartbeat) if f.last_heartbeat is not None else "ever"
                recs[h] = Recommendation(h, KIND_STALE,
                                         f"{REASON_PREFIX} no heartbeat since {since}")
            else:
                fresh.append(f)

        by_class: dict[str | None, list[NodeFacts]] = {}
        for f in fresh:
            by_class.setdefault(f.klass, []).append(f)
        base = choose_baseline(
            {k: len(fs) for k, fs in by_class.items() if k is not None},
            {k: fs[0].values for k, fs in by_class.items() if k is not None},
            config,
        )
        base_key = base.key
        if base.pinned or base_key is not None:  # a pin with no matching class is kept too
            sp.baseline = {
                "pinned": base.pinned, "class": base_key,
                "values": dict(by_class[base_key][0].values) if base_key else None,
                "count": base.size, "share": round(base.share, 4),
            }
            if base.pinned:
                sp.baseline["pin"] = pin
        elif base.total:
            sp.no_majority = True
            sp.note = (
                f"no clear majority: the largest class holds {base.size} of {base.total} "
                f"fresh nodes ({base.share:.0%}, needs more than "
                f"{config.drain.majority:.0%}); a rolling upgrade or a split "
                f"cluster: no drain recommended against a baseline"
            )

        if sp.baseline is not None:
            base_values = sp.baseline["values"] or {}
            for key, fs in by_class.items():
                if key == base_key or key is None:
                    continue
                reason: str | None = None
                found = pin_diffs(fs[0].values, pin, config) if pin else []
                if found:
                    reason = _class_reason([r for r, _ in found], [t for _, t in found])
                elif base_key is not None:
                    pair = (base_key, key)
                    if pair not in judged:
                        judged[pair] = judge(base_key, key)
                    found = judged[pair]
                    if found:
                        texts = _value_diffs(fs[0].values, base_values)
                        texts = texts or [m for _, m in found if m]
                        reason = _class_reason([r for r, _ in found], texts)
                if reason:
                    for f in fs:
                        recs.setdefault(f.host, Recommendation(f.host, KIND_CLASS, reason))

            if base_key is not None:
                ups = Counter(f.ports_up for f in by_class[base_key] if f.ports_up is not None)
                base_up = ups.most_common(1)[0][0] if ups else 0
                for f in fresh:
                    if f.host in recs or f.ports_up is None or f.ports_up >= base_up:
                        continue
                    total = f.ports_total if f.ports_total is not None else "?"
                    recs[f.host] = Recommendation(
                        f.host, KIND_PORTS,
                        f"{REASON_PREFIX} RDMA ports down: {f.ports_up}/{total} active, "
                        f"baseline {base_up} active",
                    )

        sp.recommendations = [recs[h] for h in hosts if h in recs]
        if len(sp.recommendations) > sp.cap and not force:
            sp.capped = True
            cap_note = (
                f"cap: {len(sp.recommendations)} of {len(hosts)} nodes "
                f"({len(sp.recommendations) / max(1, len(hosts)):.0%}) would be drained, more "
                f"than drain.max_share {config.drain.max_share:.0%} ({sp.cap} nodes); "
                f"nothing recommended, rerun with --force to override"
            )
            sp.note = f"{sp.note}; {cap_note}" if sp.note else cap_note
        plan.sets.append(sp)
    return plan


# --- judging two classes with the gate's policy ------------------------------------------


def policy_judge(representatives: Mapping[str, Mapping[str, Any]], config: Config) -> Judge:
    """A judge that runs the gate's policy on one node of each class, as a two-node job.

    ``representatives`` maps each class to one fingerprint of it. The refuse
    findings are the rules that would stop a job spanning both classes.
    """
    from ncclguard.policy import evaluate

    # judge every pair, whatever the guarded partitions and min_nodes say about jobs
    policy = config.policy.replace(partitions=(), min_nodes=2)

    def judge(base_key: str, other_key: str) -> list[tuple[str, str]]:
        fps = {"baseline": dict(representatives[base_key]),
               "candidate": dict(representatives[other_key])}
        verdict = evaluate(fps, policy)
        return [(str(f.rule), str(f.message)) for f in verdict.findings
                if f.severity == "refuse"]

    return judge


def values_judge(values: Mapping[str, Mapping[str, Any]], config: Config) -> Judge:
    """A judge on the classes' defining values alone (used where no fingerprint is at hand)."""

    def judge(base_key: str, other_key: str) -> list[tuple[str, str]]:
        a, b = values[base_key], values[other_key]
        out = []
        for k in sorted(set(a) | set(b)):
            if a.get(k) is None or b.get(k) is None or a.get(k) == b.get(k):
                continue
            rule = BASELINE_KEYS.get(k)
            if rule and severity_of(config.policy, rule) == "refuse":
                out.append((rule, f"{k} {b.get(k)} (baseline {a.get(k)})"))
        return out

    return judge


# --- carrying a plan out through Slurm ----------------------------------------------------


class SlurmNodeLike(Protocol):
    """What apply/resume read of a Slurm node (:class:`ncclguard.slurm.NodeInfo`)."""

    @property
    def name(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def drained(self) -> bool: ...


class SlurmLike(Protocol):
    def drain(self, nodes: Sequence[str], reason: str) -> Any: ...
    def resume(self, nodes: Sequence[str]) -> Any: ...


@dataclass(frozen=True)
class Action:
    host: str
    action: str  # drain | redrain | resume | skip
    reason: str | None
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "action": self.action, "reason": self.reason,
                "detail": self.detail}


def ours(reason: str | None) -> bool:
    return bool(reason) and str(reason).startswith(REASON_PREFIX)


def plan_apply(plan: Plan, slurm_nodes: Mapping[str, SlurmNodeLike]) -> list[Action]:
    """What ``--apply`` would do now: drain, re-drain with a new reason, or leave alone."""
    out: list[Action] = []
    for host, reason in plan.drains().items():
        node = slurm_nodes.get(host)
        if node is None:
            out.append(Action(host, "skip", reason, "not a Slurm node"))
        elif node.drained:
            if not ours(node.reason):
                out.append(Action(host, "skip", reason,
                                  f"drained by someone else ({node.reason or 'no reason'}): "
                                  "left alone"))
            elif node.reason == clean_text(reason, REASON_MAX):
                out.append(Action(host, "skip", reason, "already drained by ncclguard"))
            else:
                out.append(Action(host, "redrain", reason,
                                  f"drained by ncclguard for another cause ({node.reason})"))
        else:
            out.append(Action(host, "drain", reason, "not drained"))
    return out


_HEARTBEAT_REASONS = (f"{REASON_PREFIX} no heartbeat",)


def plan_resume(plan: Plan, slurm_nodes: Mapping[str, SlurmNodeLike],
                scope: Iterable[str]) -> list[Action]:
    """Which of our drains in ``scope`` to lift: the cause must be gone.

    A node is resumed only if its drain reason starts with ``ncclguard:``, it has no
    cause now (withheld recommendations count as causes), and the verdict on it is
    conclusive: its set has a baseline, or the drain was for a missing heartbeat.
    """
    out: list[Action] = []
    causes = plan.causes()
    for host in dict.fromkeys(scope):
        node = slurm_nodes.get(host)
        if node is None or not node.drained:
            continue
        if not ours(node.reason):
            out.append(Action(host, "skip", node.reason,
                              "drained by someone else: left alone"))
            continue
        if host in causes:
            out.append(Action(host, "skip", node.reason, "cause still present"))
            continue
        heartbeat = str(node.reason).startswith(_HEARTBEAT_REASONS)
        if not plan.conclusive(host) and not heartbeat:
            out.append(Action(host, "skip", node.reason,
                              "no baseline to judge against: left drained"))
            continue
        out.append(Action(host, "resume", node.reason, "cause gone"))
    return out


def outcome(actions: Sequence[Action], after: Mapping[str, SlurmNodeLike]) -> list[Action]:
    """The actions as Slurm shows them once carried out (``after``: the nodes read back):
    a drain says ``drained now``, never the state from before it (issue 46: "not drained"
    was printed for the nodes just drained), and one Slurm did not take says so."""
    out: list[Action] = []
    for a in actions:
        node = after.get(a.host)
        if a.action in ("drain", "redrain"):
            if node is not None and node.drained and ours(node.reason):
                detail = "drained now" if a.action == "drain" else "drained now for this cause"
            else:
                seen = "not a Slurm node" if node is None else (
                    f"drained, reason {node.reason!r}" if node.drained else "not drained")
                detail = f"asked to drain, but Slurm shows it {seen}"
            out.append(Action(a.host, a.action, a.reason, detail))
        elif a.action == "resume":
            done = node is not None and not node.drained
            out.append(Action(a.host, a.action, a.reason, "resumed now (cause gone)" if done
                              else "asked to resume, but Slurm shows it still drained"))
        else:
            out.append(a)
    return out


def execute(actions: Sequence[Action], slurm: SlurmLike) -> None:
    """Run the drain/redrain/resume actions, grouped by reason (one scontrol per group)."""
    drains: dict[str, list[str]] = {}
    resumes: list[str] = []
    for a in actions:
        if a.action in ("drain", "redrain") and a.reason:
            drains.setdefault(a.reason, []).append(a.host)
        elif a.action == "resume":
            resumes.append(a.host)
    for reason, hosts in drains.items():
        slurm.drain(hosts, reason)
    if resumes:
        slurm.resume(resumes)
