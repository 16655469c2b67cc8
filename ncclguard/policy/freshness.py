"""Whether a node's heartbeat is current: one answer for the gate, ``check``, ``nodes``,
``show``, ``classes`` and ``drain-recommend``.

A heartbeat is stale when it is missing, older than ``inventory.stale_after_s``, or more
than :data:`~ncclguard.config.HEARTBEAT_SKEW_S` in the future (a node whose clock runs
ahead would otherwise stay fresh for as long as it is ahead, after it died). The clock is
the caller's: these functions are pure.
"""

from __future__ import annotations

from collections.abc import Mapping

from ncclguard.config import HEARTBEAT_SKEW_S

__all__ = ["heartbeat_state", "is_stale", "stale_hosts"]


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
