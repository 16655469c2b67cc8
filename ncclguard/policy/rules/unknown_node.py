"""unknown-node: a node with no record, or whose heartbeat is older than the TTL.

Such a node was not checked: nothing is known about its NCCL stack, so it is never
*different*; by default it is a warning, and it can be set to refuse. Whether a heartbeat
is stale is decided by the caller (``inventory.stale_after_s``), keeping the policy free of
clocks.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ncclguard.policy.rules.base import Rule, Values
from ncclguard.policy.verdict import Finding

NAME = "unknown-node"
MESSAGE = "nodes without a current inventory record were not checked"


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


def check(
    fingerprints: Mapping[str, dict | None],
    stale: Collection[str] = (),
    severity: str = RULE.severity,
) -> list[Finding]:
    """One finding naming the unchecked nodes, or none."""
    missing, old = unknown_hosts(fingerprints, stale)
    if not missing and not old:
        return []
    groups = []
    if missing:
        groups.append(("no record", missing))
    if old:
        groups.append(("stale heartbeat", old))
    return [
        Finding.from_hosts(NAME, severity, MESSAGE, groups)
    ]
