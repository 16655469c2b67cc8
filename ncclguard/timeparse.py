"""The one parser for a point in time that a person types: ``--since`` and ``--at``.

Every command accepts the same forms:

- an age, counted back from now: ``45s``, ``30m``, ``2h``, ``7d``, ``1w`` (a decimal
  number is fine: ``1.5h``);
- epoch seconds: ``1700000000``, ``1700000000.25`` or ``@1700000000``;
- an ISO-8601 date or date-time: ``2026-11-30``, ``20261130``, ``2026-11-30T02:13:28Z``,
  ``2026-11-30 02:13:28+01:00``. Without a zone it is UTC, as every time ncclguard writes.
  Eight bare digits that make a date (``20261130``) are that date, not epoch seconds
  (which would be a time in 1970).

Standard library only.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime

__all__ = ["FORMS", "ISO_FORMAT", "iso_utc", "parse_iso", "parse_time"]

#: How ncclguard writes a time: UTC, whole seconds, a ``Z`` (the fingerprint's convention).
ISO_FORMAT = "%Y-%m-%dT%H:%M:%SZ"

#: What :func:`parse_time` accepts, for help texts and error messages.
FORMS = "an age (45s, 30m, 2h, 7d, 1w), epoch seconds (1700000000 or @1700000000) or an " \
    "ISO-8601 date or time (2026-11-30, 2026-11-30T02:13:28Z; UTC without a zone)"

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_AGE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$", re.IGNORECASE)
_EPOCH = re.compile(r"^@?\d+(?:\.\d+)?$")


def parse_time(text: str | float | datetime, now: float | None = None) -> float:
    """Epoch seconds for ``text`` (see the module doc). ``ValueError`` names the value.

    >>> parse_time("2h", now=10_000.0), parse_time("@1700000000"), parse_time("1970-01-02")
    (2800.0, 1700000000.0, 86400.0)
    """
    if isinstance(text, datetime):
        return (text if text.tzinfo else text.replace(tzinfo=UTC)).timestamp()
    if isinstance(text, int | float) and not isinstance(text, bool):
        return float(text)
    t = str(text).strip()
    m = _AGE.match(t)
    if m:
        base = time.time() if now is None else now
        return base - float(m.group(1)) * _UNITS[m.group(2).lower()]
    if _EPOCH.match(t) and not (len(t) == 8 and t.isdigit() and parse_iso(t) is not None):
        return float(t.lstrip("@"))
    parsed = parse_iso(t)
    if parsed is None:
        raise ValueError(f"{str(text)!r}: expected {FORMS}")
    return parsed


def iso_utc(epoch: float) -> str:
    """``epoch`` as ncclguard writes times: ``2026-11-30T02:13:28Z``."""
    return datetime.fromtimestamp(epoch, UTC).strftime(ISO_FORMAT)


def parse_iso(text: object) -> float | None:
    """Epoch seconds of an ISO-8601 text (UTC without a zone; ``Z`` accepted), else None."""
    if not isinstance(text, str):
        return None
    try:
        dt = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()
