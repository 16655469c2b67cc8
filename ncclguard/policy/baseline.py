"""The baseline: the compatibility class that a node set is expected to be.

``ncclguard classes`` marks it and ``drain-recommend`` judges every other class against
it; both call :func:`choose_baseline`, so that they always name the same class.

- With ``[baseline]`` pinned in the config: the largest class whose values break no pinned
  key at refuse level (:func:`pin_diffs`; an unknown value never breaks one).
- Otherwise: the largest class, if it holds more than ``drain.majority`` of the nodes
  counted (a rolling upgrade or a 50/50 split has no baseline).

Only nodes with a current heartbeat count: the caller passes those counts. Two classes
of the same size: the one whose compatibility key sorts first, so that the answer never
depends on the order of the input.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from ncclguard.config import Config
from ncclguard.policy.settings import BASELINE_KEYS, severity_of

__all__ = ["Baseline", "choose_baseline", "pin_diffs"]


class Baseline(NamedTuple):
    """The chosen class (``key`` None: there is none) and why."""

    key: str | None
    why: str  # "pinned in [baseline]", "majority (57%)", "no clear majority: ..."
    pinned: bool
    size: int  # nodes of the chosen class that were counted
    total: int  # all nodes counted
    share: float  # count / total (0.0 without nodes)


def pin_diffs(
    values: Mapping[str, Any], pin: Mapping[str, str], config: Config | None = None
) -> list[tuple[str, str]]:
    """``(rule, text)`` for each pinned key that a class with ``values`` breaks.

    With ``config``, only keys whose rule has severity ``refuse`` there count; without
    it, every pinned key counts (choosing the baseline itself).
    """
    out = []
    for key, want in pin.items():
        got = values.get(key)
        if got is None or str(got) == want:  # unknown is never different
            continue
        rule = BASELINE_KEYS.get(key, key)
        if config is None or severity_of(config.policy, rule) == "refuse":
            out.append((rule, f"{key} {got} (pinned {want})"))
    return out


def _largest(keys: list[str], counts: Mapping[str, int]) -> str:
    return min(keys, key=lambda k: (-counts[k], k))


def choose_baseline(
    counts: Mapping[str, int], values: Mapping[str, Mapping[str, Any]], config: Config
) -> Baseline:
    """The baseline among classes with ``counts[class]`` counted nodes each (classes
    with none are not candidates) and defining ``values[class]``."""
    candidates = [k for k, n in counts.items() if n > 0]
    total = sum(counts[k] for k in candidates)
    pin = dict(config.baseline)
    if pin:
        matching = [k for k in candidates if not pin_diffs(values.get(k) or {}, pin)]
        if not matching:
            return Baseline(None, "pinned in [baseline]: no class matches", True, 0, total, 0.0)
        key = _largest(matching, counts)
        return Baseline(key, "pinned in [baseline]", True, counts[key], total,
                        counts[key] / total)
    if not candidates:
        return Baseline(None, "no nodes", False, 0, 0, 0.0)
    key = _largest(candidates, counts)
    share = counts[key] / total
    if share > config.drain.majority:
        return Baseline(key, f"majority ({share:.0%})", False, counts[key], total, share)
    why = (f"no clear majority: the largest class holds {share:.0%} "
           f"(needs more than {config.drain.majority:.0%})")
    return Baseline(None, why, False, counts[key], total, share)
