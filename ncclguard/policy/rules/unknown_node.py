"""unknown-node: a node with no record, or whose heartbeat is not current.

A node with **no record** was not checked: nothing is known about its NCCL stack, so it is
never *different*. A node with a **stale** heartbeat (older than the TTL, or dated in the
future) is still compared by its last known record, the best evidence there is: a
refuse-level difference in it still refuses (issue 12: an outage of the inventory path
longer than the TTL turned the gate into a warning for the whole cluster). This rule
names both kinds, the stale ones with the age of the oldest heartbeat; by default it is a
warning, and it can be set to refuse. Whether a heartbeat is stale is decided by the
caller (``ncclguard.policy.freshness``), keeping the policy free of clocks: ``stale`` may
map each host to its heartbeat's age in seconds.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ncclguard.policy.rules.base import Rule, Values
from ncclguard.policy.verdict import Finding

NAME = "unknown-node"
MESSAGE = ("nodes without a current inventory record: with none they were not checked, "
           "with a stale one they were compared by their last known record")


def _no_values(fp: dict) -> Values:
    return {}  # not a comparison: check() judges whether a current record exists


#: Its name and default severity, as every rule carries them (not in ``COMPARISONS``).
RULE = Rule(NAME, _no_values, lambda _: MESSAGE)


def unknown_hosts(
    fingerprints: Mapping[str, dict | None], stale: Collection[str] = ()
) -> tuple[list[str], list[str]]:
    """``(hosts without a record, hosts with a stale heartbeat)``, each sorted."""
    missing = sorted(h for h, fp in fingerprints.items() if fp is None)
    old = sorted(h for h in set(stale) if fingerprints.get(h) is not None)
    return missing, old


def age_text(seconds: float) -> str:
    """``45 s``, ``20 min``, ``3 h``, ``2 d``; ``in the future`` for a negative age."""
    if seconds < 0:
        return "in the future"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def check(
    fingerprints: Mapping[str, dict | None],
    stale: Collection[str] | Mapping[str, float] = (),
    severity: str = RULE.severity,
) -> list[Finding]:
    """One finding naming the nodes without a current record, or none."""
    missing, old = unknown_hosts(fingerprints, stale)
    if not missing and not old:
        return []
    groups = []
    if missing:
        groups.append(("no record", missing))
    if old:
        label = "stale heartbeat"
        if isinstance(stale, Mapping):
            ages = [stale[h] for h in old]
            if any(a < 0 for a in ages):
                label += ", some dated in the future"
            if any(a >= 0 for a in ages):
                label += f", oldest {age_text(max(ages))} old"
        groups.append((label, old))
    return [
        Finding.from_hosts(NAME, severity, MESSAGE, groups)
    ]
