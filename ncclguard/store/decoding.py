"""Every stored JSON text is read through here (issue 25): a row that does not decode, or
that goes past the bounds every reader handles (``ncclguard.fingerprint.shape``: rows
written before the collector checked them, such as a fingerprint 900 levels deep),
reads as unreadable, never as an error of the command that reads it.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["decoded", "stored_fingerprint"]


def decoded(text: Any, unreadable: Any) -> Any:
    """A stored JSON text, or ``unreadable`` when it does not decode or goes past the
    bounds every reader handles (:func:`ncclguard.fingerprint.shape.bounds_problem`:
    rows written before the collector checked them)."""
    from ncclguard.fingerprint.shape import bounds_problem

    try:
        value = json.loads(text)
    except (TypeError, ValueError, RecursionError):
        return unreadable
    return unreadable if bounds_problem(value) else value


def stored_fingerprint(host: str, text: Any) -> dict[str, Any]:
    """A stored fingerprint; one that cannot be read is shown as a node with one error."""
    fp = decoded(text, None)
    if isinstance(fp, dict):
        return fp
    return {"host": {"hostname": host}, "errors": [{
        "probe": "store", "field": None, "path": None,
        "error": "the stored fingerprint cannot be read (not JSON, or past the bounds "
                 "every reader handles)"}]}
