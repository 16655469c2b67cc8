"""Scheduling classes: the node feature that keeps Slurm from picking a mixed set.

Slurm's matching-OR constraint ``--constraint="[nc_a|nc_b]"`` gives a job nodes that all
carry the same one of the listed features (slurm-facts.md, "Prevention at scheduling").
Each node carries one class feature, so a job with the group never spans two classes.

A node's class is the digest of what the **refuse-level** rules read from it (their
aspects that can refuse: ``warn_only`` aspects are left out), taken from the same
:func:`~ncclguard.policy.evaluation.node_values` records the gate compares. Two nodes
of one class therefore agree on every aspect that could make the gate refuse: a set of
nodes that share a feature is never refused by the gate (tests/test_schedule.py checks
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
from collections.abc import Collection, Iterable, Mapping
from typing import NamedTuple

from ncclguard.config import PolicyConfig
from ncclguard.policy.evaluation import _record_values
from ncclguard.policy.rules import COMPARISONS, unknown_node
from ncclguard.policy.settings import severity_of

__all__ = [
    "FEATURE_PREFIX",
    "MAX_ALTERNATIVES",
    "UNKNOWN_FEATURE",
    "ClassCount",
    "is_class_feature",
    "rank_classes",
    "scheduling_classes",
]

#: Every feature ncclguard sets starts with this; a node's other features are its own.
FEATURE_PREFIX = "nc_"
#: The class of the nodes without a current record, where ``unknown-node`` lets them run.
UNKNOWN_FEATURE = FEATURE_PREFIX + "unknown"
#: Slurm's bitmaps for matching-OR features hold 64 positions (``MAX_FEATURES`` in
#: src/slurmctld/node_scheduler.c, 22.05 to master), one per term of the whole
#: constraint, with no check: past 64 slurmctld 22.05 crashed (slurm-facts.md).
MAX_ALTERNATIVES = 64
_DIGITS = 8  # hex digits of a class feature; more where two classes would share them


def is_class_feature(name: str) -> bool:
    """A feature that ncclguard owns (and may replace); anything else is the node's own."""
    return name.startswith(FEATURE_PREFIX)


def _refuse_key(record: dict, config: PolicyConfig) -> str:
    """What the refuse-level rules read from one node, as one canonical string."""
    rules = [r for r in COMPARISONS if severity_of(config, r.name) == "refuse"]
    values = _record_values(record, rules)
    key = [
        [rule.name, sorted((a, v) for a, v in vals.items() if a not in rule.warn_only)]
        for rule, vals in zip(rules, values, strict=True)
    ]
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def scheduling_classes(
    records: Mapping[str, dict | None],
    config: PolicyConfig,
    stale: Collection[str] = (),
) -> dict[str, str | None]:
    """``{host: class feature}`` for every host of ``records`` (gate-style
    :func:`~ncclguard.policy.evaluation.node_values` records, ``None`` for no record);
    ``None`` for a host that gets no class (``unknown-node`` at refuse).

    The feature is :data:`FEATURE_PREFIX` and 8 hex digits of the class's digest; where two
    classes share 8 digits, both get as many more as it takes to tell them apart.
    """
    refuse_unknown = severity_of(config, unknown_node.NAME) == "refuse"
    stale_set = set(stale)
    digests: dict[str, str] = {}  # key -> full digest
    by_host: dict[str, str | None] = {}
    by_object: dict[int, str] = {}  # records shared between hosts: one key each
    for host, record in records.items():
        if record is None or (refuse_unknown and host in stale_set):
            by_host[host] = None if refuse_unknown else UNKNOWN_FEATURE
            continue
        key = by_object.get(id(record))
        if key is None:
            key = by_object[id(record)] = _refuse_key(record, config)
        if key not in digests:
            digests[key] = hashlib.sha256(key.encode()).hexdigest()
        by_host[host] = key
    names = _short_names(digests.values())
    return {h: (k if k is None or k == UNKNOWN_FEATURE else names[digests[k]])
            for h, k in by_host.items()}


def _short_names(digests: Iterable[str]) -> dict[str, str]:
    """Each digest's feature: the shortest prefix (8 hex digits or more) that no other
    digest shares."""
    unique = sorted(set(digests))
    out: dict[str, str] = {}
    for i, d in enumerate(unique):
        width = _DIGITS
        for other in (unique[i - 1] if i else "", unique[i + 1] if i + 1 < len(unique) else ""):
            while other and d[:width] == other[:width]:
                width += 1
        out[d] = FEATURE_PREFIX + d[:width]
    return out


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
