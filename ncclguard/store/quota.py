"""What one node may store, and how often it may change (issue 25, docs/collector.md).

The collector hands a :class:`Quota` to :meth:`~ncclguard.store.Inventory.ingest`; a
change (a new fingerprint, not a heartbeat) that would pass it is not written, and comes
back as an ``over-quota`` or ``change-rate`` status that the collector turns into a
rejection. The counts are the inventory's own (``history.bytes`` and
``history.stored_at``, read through the covering index ``idx_history_usage``), so that
a restarted collector, or a second one, bounds the same way.
"""

from __future__ import annotations

import sqlite3
from typing import NamedTuple

__all__ = ["NOT_KEPT", "RATE_WINDOW_S", "Quota", "history_row_bytes", "refusal"]

RATE_WINDOW_S = 3600.0
#: the diff stored for a change written under disk pressure (its fingerprint is not kept)
NOT_KEPT = "(change not kept: disk pressure)"


class Quota(NamedTuple):
    """``node_bytes``: what one node may store, its current record and its history
    (0: no bound); ``changes_per_hour``: its changes accepted within the last hour, by
    the writer's clock (0: no bound); ``keep_history``: False under disk pressure: a
    change is written to the node's row, and its history row keeps only when and from
    which hash to which (no copy of the fingerprint, no diff)."""

    node_bytes: int = 0
    changes_per_hour: int = 0
    keep_history: bool = True


def history_row_bytes(fp_json: str, diff_json: str) -> int:
    """What a history row is counted as: its fingerprint and its diff, in bytes."""
    return len(fp_json.encode()) + len(diff_json.encode())


def refusal(conn: sqlite3.Connection, host: str, record_bytes: int | None, row_bytes: int,
            now: float, quota: Quota) -> str | None:
    """``"change-rate: ..."`` or ``"over-quota: ..."`` when a change of ``host`` (its new
    record of ``record_bytes``, and a history row of ``row_bytes``) would pass ``quota``;
    None when it may be written. ``record_bytes`` None: the rate alone (asked first, so
    that a node over its rate costs no diff)."""
    if not quota.node_bytes and not quota.changes_per_hour:
        return None
    stored, recent = conn.execute(
        "SELECT coalesce(sum(bytes), 0), coalesce(sum(stored_at > ?), 0) FROM history "
        "WHERE host = ?", (now - RATE_WINDOW_S, host)).fetchone()
    if quota.changes_per_hour and recent >= quota.changes_per_hour:
        return (f"change-rate: {recent} changes of {host} accepted within the last hour "
                f"(collector.max_changes_per_hour = {quota.changes_per_hour}); its next "
                "record once the hour has room is accepted")
    if record_bytes is None:
        return None
    total = record_bytes + stored + row_bytes
    if quota.node_bytes and total > quota.node_bytes:
        return (f"over-quota: {host} would store {_mib(total)} (its record {_mib(record_bytes)}"
                f", history {_mib(stored + row_bytes)}; collector.node_quota_bytes = "
                f"{_mib(quota.node_bytes)}); its history shrinks as it passes "
                "inventory.history_days, or raise the quota")
    return None


def _mib(n: int) -> str:
    return f"{n / 1048576:.2f} MiB" if n >= 1048576 else f"{n / 1024:.1f} KiB"
