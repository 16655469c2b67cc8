"""A fingerprint as one value: its canonical JSON, its hash, and the field-level diff of two.

The store keeps the hash to tell a changed fingerprint from a heartbeat, and the diff in
its history; ``ncclguard diff`` and ``history`` show the same field names
(``rdma.devices[mlx5_0].ports[1].rate_gbps``: lists of objects keyed by path, name or port).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["canonical_json", "errors_hash", "fingerprint_diff", "fingerprint_hash"]

# fields that change on every collection and so are not part of the fingerprint hash
_VOLATILE = (("host", "collected_at"),)
# the probes' error list: a transient error (one read that failed once) is not a change of
# the node's stack; each node alternating between two hashes added a history row per
# flap (issue 12). The store keeps the latest errors all the same (``errors_hash``).
_UNHASHED = ("errors",)


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _without_volatile(fp: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in fp.items() if k not in _UNHASHED}
    for section, key in _VOLATILE:
        sub = out.get(section)
        if isinstance(sub, dict) and key in sub:
            out[section] = {k: v for k, v in sub.items() if k != key}
    return out


def fingerprint_hash(fp: dict[str, Any]) -> str:
    """sha256 of the canonical JSON, without the fields that change every collection and
    without the probes' error list."""
    import hashlib  # writers only: the gate's read path does not pay for OpenSSL

    return hashlib.sha256(canonical_json(_without_volatile(fp)).encode()).hexdigest()


def errors_hash(fp: dict[str, Any]) -> str:
    """sha256 of the probes' error list alone: the store rewrites a node's stored
    fingerprint when only its errors changed, without a history row."""
    import hashlib

    return hashlib.sha256(canonical_json(fp.get("errors") or []).encode()).hexdigest()


_LIST_KEYS = ("path", "name", "port")


def _list_key(items: list[Any]) -> str | None:
    if not items or not all(isinstance(i, dict) for i in items):
        return None
    for k in _LIST_KEYS:
        keys = [i.get(k) for i in items]
        if all(v is not None for v in keys) and len(set(map(str, keys))) == len(keys):
            return k
    return None


def fingerprint_diff(old: Any, new: Any, prefix: str = "") -> list[dict[str, Any]]:
    """Field-level diff: ``[{"field": "libnccl[/usr/lib/libnccl.so.2].version", "old", "new"}]``.

    Lists of objects are matched by their ``path``/``name``/``port``; other lists are
    compared as one value. ``host.collected_at`` is ignored.
    """
    if prefix == "" and isinstance(old, dict) and isinstance(new, dict):
        old, new = _without_volatile(old), _without_volatile(new)
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[dict[str, Any]] = []
        for k in sorted(set(old) | set(new), key=str):
            p = f"{prefix}.{k}" if prefix else str(k)
            if k not in old:
                out.append({"field": p, "old": None, "new": new[k]})
            elif k not in new:
                out.append({"field": p, "old": old[k], "new": None})
            elif old[k] != new[k]:  # an equal part has no difference: not walked (a reboot
                out.extend(fingerprint_diff(old[k], new[k], p))  # changes one field)
        return out
    if isinstance(old, list) and isinstance(new, list):
        ko, kn = _list_key(old), _list_key(new)
        if ko is not None and ko == kn:
            om = {str(i[ko]): i for i in old}
            nm = {str(i[ko]): i for i in new}
            out = []
            for k in sorted(set(om) | set(nm)):
                p = f"{prefix}[{k}]"
                out.extend(fingerprint_diff(om.get(k), nm.get(k), p))
            return out
    if old != new:
        return [{"field": prefix, "old": old, "new": new}]
    return []
