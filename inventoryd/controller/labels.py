"""Label values of the controller's metrics: short, printable, bounded in number
(docs/metrics.md, "Cardinality"). A label never takes a value from outside these rules."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MAX_SERIES = 64  # label sets per family at most; the rest are summed under "other"
OTHER = "other"
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+:/ -]{0,63}")
_SIGNATURE = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")

def _label(value: Any, unknown: str = "unknown") -> str:
    """A node-reported value as a label: short, printable, or ``unknown``."""
    if value is None or value == "":
        return unknown
    text = str(value)
    return text if _LABEL.fullmatch(text) else OTHER


def _capped(counts: Mapping[Any, float]) -> dict[Any, float]:
    """At most MAX_SERIES label sets: the largest; the rest summed under ("other", ...)."""
    if len(counts) <= MAX_SERIES:
        return dict(counts)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    keep = dict(ranked[: MAX_SERIES - 1])
    width = len(ranked[0][0])
    rest = (OTHER,) * width
    keep[rest] = keep.get(rest, 0) + sum(v for _, v in ranked[MAX_SERIES - 1 :])
    return keep
