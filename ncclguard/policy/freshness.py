"""Whether a node's heartbeat is current: one answer for the gate, ``check``, ``nodes``,
``show``, ``classes`` and ``drain-recommend``.

A heartbeat is stale when it is missing, older than ``inventory.stale_after_s``, or more
than :data:`~ncclguard.config.HEARTBEAT_SKEW_S` in the future (a node whose clock runs
ahead would otherwise stay fresh for as long as it is ahead, after it died). The clock is
the caller's: these functions are pure.

The inventory itself can go stale: when the collector cannot write it (a full disk, a
stopped collector), every record in it freezes. :func:`writer_note` says so, for the gate
and the CLI alike, from the collector's stamp (``Inventory.writer_state``: it marks the
inventory written at least every minute).
"""

from __future__ import annotations

from collections.abc import Mapping

from ncclguard.config import HEARTBEAT_SKEW_S

__all__ = ["WRITER_STALE_S", "heartbeat_state", "is_stale", "stale_hosts", "writer_note"]

#: the collector stamps the inventory at least every 60 s (inventoryd/controller/pressure.py,
#: STAMP_EVERY_S); a stamp older than this means it has not been written since
WRITER_STALE_S = 300.0


def heartbeat_state(heartbeat: float | None, now: float, stale_after_s: float) -> str:
    """``"ok"``, ``"stale"`` (none, or too old) or ``"future"`` (too far ahead)."""
    if heartbeat is None or now - heartbeat > stale_after_s:
        return "stale"
    if heartbeat - now > HEARTBEAT_SKEW_S:
        return "future"
    return "ok"


def is_stale(heartbeat: float | None, now: float, stale_after_s: float) -> bool:
    return heartbeat_state(heartbeat, now, stale_after_s) != "ok"


def stale_hosts(heartbeats: Mapping[str, float | None], now: float,
                stale_after_s: float) -> dict[str, float]:
    """The hosts of ``heartbeats`` (host -> heartbeat) that are not current, sorted, each
    with its heartbeat's age in seconds (negative: dated in the future; ``inf``: none)."""
    return {
        h: (float("inf") if hb is None else now - hb)
        for h, hb in sorted(heartbeats.items()) if is_stale(hb, now, stale_after_s)
    }


def writer_note(written_at: float | None, pressure: str | None, now: float) -> str | None:
    """One line on the inventory's own freshness, or None when it is being written: how
    long the collector has not written it (then every record in it is as of that time),
    or why it cannot grow. None too for an inventory no collector ever stamped."""
    if written_at is None:
        return None
    age = now - written_at
    if age > WRITER_STALE_S:
        from ncclguard.policy.rules.unknown_node import age_text

        return (f"the inventory has not been written for {age_text(age)} (collector "
                "stopped, or its disk full): every record in it is as of then"
                + (f"; last said: {pressure}" if pressure else ""))
    if pressure:
        return f"the inventory cannot grow: {pressure}"
    return None
