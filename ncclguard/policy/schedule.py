"""Scheduling classes: the node feature that keeps Slurm from picking a mixed set.

Slurm's matching-OR constraint ``--constraint="[nc_a|nc_b]"`` gives a job nodes that all
carry the same one of the listed features (docs/slurm.md, "Matching OR").
Each node carries one class feature, so a job with the group never spans two classes.

A node's class is the digest of what the **refuse-level** rules read from it (their
aspects that can refuse: ``warn_only`` aspects are left out), taken from the same
:func:`~ncclguard.policy.evaluation.node_values` records the gate compares. Two nodes
of one class therefore agree on every aspect that could make the gate refuse: a set of
nodes that share a feature is never refused by the gate (tests/test_sched.py checks
this against :func:`~ncclguard.policy.evaluate_values`). The converse does not hold:
a value that is unknown to the gate (``None``, agrees with anything) is a value of its
own here, so such nodes form a class apart. Warn-level differences do not split classes:
the gate lets them run, and so does the scheduler.

Nodes the gate cannot vouch for follow the ``unknown-node`` rule, as the gate does:

- ``refuse``: nodes without a record, and stale ones, get **no** class feature, so that
  no job with the group is placed on them (the gate would refuse them);
- ``warn`` (the default) or ``ignore``: nodes without a record share the feature
  :data:`UNKNOWN_FEATURE`, a class of their own, schedulable together but never mixed
  with a known class; a stale node keeps the class of its last record, by which the gate
  compares it (a feature apart for all stale nodes would let two stale nodes with
  different records share it, and the gate would refuse that set).

Pure: no clock, no Slurm, no files.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from ncclguard.config import PolicyConfig
from ncclguard.fingerprint.compat import VALUES_VERSION
from ncclguard.policy.evaluation import GATE_VALUES, StoredValues, _record_values
from ncclguard.policy.rules import COMPARISONS, unknown_node
from ncclguard.policy.settings import severity_of

__all__ = [
    "ADDS_PREFIX",
    "CLASS_VERSION",
    "FEATURE_PREFIX",
    "MAX_ALTERNATIVES",
    "SHOWN_ASPECTS",
    "SHOWN_RULES",
    "UNKNOWN_FEATURE",
    "ClassCount",
    "adds_features",
    "adds_key",
    "class_features",
    "class_key",
    "class_policy",
    "class_values",
    "feature_names",
    "is_class_feature",
    "is_host_class",
    "rank_classes",
    "refuse_values",
    "scheduling_classes",
]

#: Every feature ncclguard sets starts with this; a node's other features are its own.
FEATURE_PREFIX = "nc_"
#: The class of the nodes without a current record, where ``unknown-node`` lets them run.
UNKNOWN_FEATURE = FEATURE_PREFIX + "unknown"
#: The second family (issue 40, ``[features] own_nccl``): classes by what a node gives a
#: job that brings its own NCCL (:func:`adds_key`). ``j`` is no hex digit: no class of the
#: first family starts so.
ADDS_PREFIX = FEATURE_PREFIX + "j"
#: Slurm's bitmaps for matching-OR features hold 64 positions (``MAX_FEATURES`` in
#: src/slurmctld/node_scheduler.c, 22.05 to master), one per term of the whole
#: constraint, with no check: past 64 slurmctld 22.05 crashed (docs/slurm.md, "Constraints").
MAX_ALTERNATIVES = 64
_DIGITS = 8  # hex digits of a class feature; more where two classes would share them
#: bump when :func:`class_key` changes its derivation (the store derives every class again)
CLASS_VERSION = 1


def is_class_feature(name: str) -> bool:
    """A feature that ncclguard owns (and may replace); anything else is the node's own."""
    return name.startswith(FEATURE_PREFIX)


def is_host_class(name: str) -> bool:
    """A class of the first family (the host's stack, :func:`class_key`), not of
    :data:`ADDS_PREFIX`'s."""
    return name.startswith(FEATURE_PREFIX) and not name.startswith(ADDS_PREFIX)


def _refuse_rules(config: PolicyConfig) -> list[Any]:
    return [r for r in COMPARISONS if severity_of(config, r.name) == "refuse"]


def _refuse_key(record: dict, rules: Sequence[Any]) -> str:
    """What the refuse-level ``rules`` read from one node, as one canonical string."""
    values = _record_values(record, rules)
    key = [
        [rule.name, sorted((a, v) for a, v in vals.items() if a not in rule.warn_only)]
        for rule, vals in zip(rules, values, strict=True)
    ]
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def refuse_values(record: dict, config: PolicyConfig) -> dict[str, dict[str, Any]]:
    """``{rule: {aspect: value}}``: what the refuse-level rules read from one gate record,
    the values a class is made of (``ncclguard classes --json``, its "rules")."""
    rules = _refuse_rules(config)
    values = _record_values(record, rules)
    return {rule.name: {a: v for a, v in sorted(vals.items()) if a not in rule.warn_only}
            for rule, vals in zip(rules, values, strict=True)}


#: the rules whose values ``ncclguard classes`` shows in columns of their own (NCCL,
#: PLUGIN, ABI, TRANSPORT); any other refuse-level rule that tells classes apart is
#: shown beside them
SHOWN_RULES = frozenset({"nccl-version", "net-plugin", "transport"})
#: rule aspects shown in a column of their own (ADDS: node-adds' net plugin, issue 39)
SHOWN_ASPECTS = frozenset({("node-adds", "net plugin")})


def class_key(record: dict, config: PolicyConfig) -> str:
    """The class of one node: the SHA-256 (64 hex digits) of what the refuse-level rules
    read from its gate record (:func:`~ncclguard.policy.evaluation.node_values`). The one
    identity of a class: ``ncclguard classes``, the baseline, drains, the metrics and
    Slurm's feature (:func:`feature_names`) all name a class by it."""
    return hashlib.sha256(_refuse_key(record, _refuse_rules(config)).encode()).hexdigest()


def class_policy(config: PolicyConfig) -> str:
    """What :func:`class_key` depends on besides the record: the meaning of the values
    (``VALUES_VERSION``) and the refuse-level rules with the aspects they leave out. The
    store keeps the classes it derived under it, and derives them again when it changes
    (an admin changed a severity)."""
    rules = [[r.name, sorted(r.warn_only)] for r in _refuse_rules(config)]
    text = json.dumps([CLASS_VERSION, VALUES_VERSION, rules], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def class_values(config: PolicyConfig) -> StoredValues:
    """:data:`~ncclguard.policy.evaluation.GATE_VALUES` with the classes of ``config``:
    handed to an :class:`~ncclguard.store.Inventory` that writes or reads classes, so that
    the store (which never imports the policy) keys each node by :func:`class_key`."""
    rules = _refuse_rules(config)

    def classify(record: dict) -> str:
        return hashlib.sha256(_refuse_key(record, rules).encode()).hexdigest()

    return GATE_VALUES._replace(classify=classify, class_policy=class_policy(config))


def scheduling_classes(
    records: Mapping[str, dict | None],
    config: PolicyConfig,
    stale: Collection[str] = (),
) -> dict[str, str | None]:
    """``{host: class feature}`` for every host of ``records`` (gate-style
    :func:`~ncclguard.policy.evaluation.node_values` records, ``None`` for no record):
    :func:`class_features` of their :func:`class_key`."""
    rules = _refuse_rules(config)
    keys: dict[str, str | None] = {}
    by_object: dict[int, str] = {}  # records shared between hosts: one key each
    for host, record in records.items():
        if record is None:
            keys[host] = None
            continue
        key = by_object.get(id(record))
        if key is None:
            text = _refuse_key(record, rules)
            key = by_object[id(record)] = hashlib.sha256(text.encode()).hexdigest()
        keys[host] = key
    return class_features(keys, config, stale)


def class_features(
    keys: Mapping[str, str | None],
    config: PolicyConfig,
    stale: Collection[str] = (),
    names: Mapping[str, str] | None = None,
) -> dict[str, str | None]:
    """``{host: class feature}`` for every host of ``keys`` (its :func:`class_key`, None
    for no record); ``None`` for a host that gets no class (``unknown-node`` at refuse).

    ``names``: each key's feature (:func:`feature_names` over every class of the
    inventory, so that a subset of nodes gets the names the whole cluster has); default:
    :func:`feature_names` of these keys."""
    refuse_unknown = severity_of(config, unknown_node.NAME) == "refuse"
    stale_set = set(stale)
    if names is None:
        names = feature_names(k for k in keys.values() if k is not None)
    out: dict[str, str | None] = {}
    for host, key in keys.items():
        if key is None or (refuse_unknown and host in stale_set):
            out[host] = None if refuse_unknown else UNKNOWN_FEATURE
        else:
            out[host] = names.get(key) or feature_names([key])[key]
    return out


def feature_names(keys: Iterable[str], prefix: str = FEATURE_PREFIX) -> dict[str, str]:
    """Each class key's feature (and the name ``ncclguard classes`` shows): ``prefix``
    (:data:`FEATURE_PREFIX`, or :data:`ADDS_PREFIX` for :func:`adds_key`) and the shortest
    run of its hex digits (8 or more) that no other key of ``keys`` shares."""
    unique = sorted(set(keys))
    out: dict[str, str] = {}
    for i, d in enumerate(unique):
        width = _DIGITS
        for other in (unique[i - 1] if i else "", unique[i + 1] if i + 1 < len(unique) else ""):
            while other and d[:width] == other[:width]:
                width += 1
        out[d] = prefix + d[:width]
    return out


def _adds_text(record: dict, rules: Sequence[Any]) -> str:
    job, container = record.get("job"), record.get("container")
    seen = [job.get("net") if isinstance(job, dict) else None,
            container.get("internal") if isinstance(container, dict) else None]
    return json.dumps([_refuse_key(record, rules), seen], separators=(",", ":"))


def _adds_rules(config: PolicyConfig) -> list[Any]:
    from ncclguard.policy.rules.jobnccl import HOST_RULES

    return [r for r in _refuse_rules(config) if r.name not in HOST_RULES]


def adds_key(record: dict, config: PolicyConfig) -> str:
    """A node's class of the second family (issue 40): the SHA-256 of what the gate reads
    from it for a job that brings its own NCCL (:func:`~ncclguard.policy.evaluate_nccl`):
    the refuse-level rules but the host-stack ones
    (:data:`~ncclguard.policy.rules.jobnccl.HOST_RULES`), and what ``job-stack`` reads, the
    net plugin each release opens there and the node's own transport
    (:func:`~ncclguard.policy.rules.jobnccl.job_records`). Nodes of one such class give any
    job's own NCCL the same stack: a set of them is never refused for a job whose NCCL is
    known (tests/test_sched_adds.py), whatever host libnccl each has."""
    return hashlib.sha256(_adds_text(record, _adds_rules(config)).encode()).hexdigest()


def adds_features(
    records: Mapping[str, dict | None],
    config: PolicyConfig,
    stale: Collection[str] = (),
) -> dict[str, str | None]:
    """``{host: feature of the second family}`` (:data:`ADDS_PREFIX`) over gate-style
    records. A node without a record, or stale where ``unknown-node`` refuses, has none:
    a job offered these classes is never placed on a node the gate cannot vouch for."""
    rules = _adds_rules(config)
    refuse_unknown = severity_of(config, unknown_node.NAME) == "refuse"
    stale_set = set(stale)
    keys: dict[str, str | None] = {}
    by_object: dict[int, str] = {}
    for host, record in records.items():
        if record is None or (refuse_unknown and host in stale_set):
            keys[host] = None
            continue
        key = by_object.get(id(record))
        if key is None:
            key = by_object[id(record)] = hashlib.sha256(
                _adds_text(record, rules).encode()).hexdigest()
        keys[host] = key
    names = feature_names((k for k in keys.values() if k is not None), ADDS_PREFIX)
    return {h: (None if k is None else names[k]) for h, k in keys.items()}


class ClassCount(NamedTuple):
    feature: str
    nodes: int


def rank_classes(
    features: Mapping[str, str | None],
    members: Iterable[str] | None = None,
    *,
    min_nodes: int = 2,
    limit: int = MAX_ALTERNATIVES,
) -> list[ClassCount]:
    """The classes of ``members`` (default: every host) in preference order, the largest
    first (then by name, so that the order is stable), without the classes of fewer than
    ``min_nodes`` nodes (no multi-node job fits them) and at most ``limit`` of them. The
    class of unknown nodes comes last whatever its size: the gate only warns there."""
    hosts = features if members is None else members
    counts = Counter(f for h in hosts if (f := features.get(h)) is not None)
    ranked = sorted(
        (ClassCount(f, n) for f, n in counts.items() if n >= min_nodes),
        key=lambda c: (c.feature == UNKNOWN_FEATURE, -c.nodes, c.feature),
    )
    return ranked[: max(0, limit)]
