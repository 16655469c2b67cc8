"""The shape of what a node saw its running job steps load (issue 42, docs/runtime.md):
the document ``ncclguard-inventoryd jobmaps`` writes and the node's record carries under
``loaded``, its bounds (its own quota inside the record), and its check.

    {"ncclguard_loaded": 1, "host": "n1", "scanned_at": 1796000000.0, "complete": true,
     "steps": [{"job": "42", "step": "0", "uid": 1000, "procs": 4, "since": 1796...,
                "cut": false,
                "libs": [{"kind": "nccl", "path": "<venv>/nvidia/nccl/lib/libnccl.so.2",
                          "dev": "fd:1", "ino": 1234, "size": 2.3e8, "sha256": "...",
                          "version": "2.21.5", "abis": [8, 7], "name": null,
                          "error": null}]}]}

``kind``: "nccl", a plugin kind of :data:`ncclguard.fingerprint.loading.PREFIXES`, or
"ibverbs" (NCCL's own IB transport has started: the net is chosen). ``abis``: for a
libnccl, the net plugin ABIs it looks for; for a plugin, those of its kind it exports.
``error``: why the file has no identity (then it is never called different).

Standard library only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

__all__ = [
    "LIBS_PER_STEP", "LOADED_VERSION", "MAX_LOADED_BYTES", "MAX_PATH", "MAX_STEPS", "SCAN_S",
    "loaded_problem", "step_problem",
]

LOADED_VERSION = 1
SCAN_S = 15.0  # the scanner's default interval
MAX_STEPS = 256  # steps per node in one document
LIBS_PER_STEP = 16  # libraries kept per step
MAX_PATH = 512  # characters of a path
MAX_TEXT = 300  # characters of an error or a name
MAX_LOADED_BYTES = 192 * 1024  # the document's quota inside the node's record

_KINDS = frozenset({"nccl", "ibverbs", "net", "gin", "rma", "tuner", "profiler", "env"})
_JOB = re.compile(r"[0-9]{1,12}")
_STEP = re.compile(r"[a-z]{1,16}|[0-9]{1,10}(?:\+[0-9]{1,10})?")
_DEV = re.compile(r"[0-9a-f]{1,8}:[0-9a-f]{1,8}")
_SHA = re.compile(r"[0-9a-f]{64}")
_VERSION = re.compile(r"[0-9]{1,4}\.[0-9]{1,4}\.[0-9]{1,4}")


def _int(v: Any, hi: int = 2**63 - 1) -> bool:
    return type(v) is int and 0 <= v <= hi


def _num(v: Any) -> bool:
    return type(v) in (int, float) and 0 <= v < 2**63


def _text(v: Any, n: int, *, null: bool = True) -> bool:
    return (v is None and null) or (type(v) is str and len(v) <= n)


def _lib_problem(lib: Any) -> str | None:
    if not isinstance(lib, dict):
        return "a library that is not an object"
    if lib.get("kind") not in _KINDS:
        return f"a library of kind {str(lib.get('kind'))[:20]!r}"
    checks = (
        ("path", _text(lib.get("path"), MAX_PATH, null=False)),
        ("dev", type(lib.get("dev")) is str and _DEV.fullmatch(lib["dev"]) is not None),
        ("ino", _int(lib.get("ino"))),
        ("size", lib.get("size") is None or _int(lib.get("size"))),
        ("sha256", lib.get("sha256") is None
         or (type(lib["sha256"]) is str and _SHA.fullmatch(lib["sha256"]) is not None)),
        ("version", lib.get("version") is None
         or (type(lib["version"]) is str and _VERSION.fullmatch(lib["version"]) is not None)),
        ("abis", isinstance(lib.get("abis"), list) and len(lib["abis"]) <= 16
         and all(_int(a, 1 << 16) for a in lib["abis"])),
        ("name", _text(lib.get("name"), MAX_TEXT)),
        ("error", _text(lib.get("error"), MAX_TEXT)),
    )
    bad = next((k for k, ok in checks if not ok), None)
    return f"a library whose {bad!r} is not valid" if bad else None


def step_problem(s: Any) -> str | None:
    if not isinstance(s, dict):
        return "a step that is not an object"
    if not (type(s.get("job")) is str and _JOB.fullmatch(s["job"])):
        return f"a step of job {str(s.get('job'))[:20]!r}"
    if not (type(s.get("step")) is str and _STEP.fullmatch(s["step"])):
        return f"job {s['job']}: step {str(s.get('step'))[:20]!r}"
    if not (_int(s.get("uid"), 2**32) and _int(s.get("procs"), 1 << 22)
            and (s.get("since") is None or _num(s.get("since")))
            and type(s.get("cut")) is bool):
        return f"job {s['job']}.{s['step']}: uid, procs, since or cut not valid"
    why = _each(s.get("libs"), LIBS_PER_STEP, "libs", _lib_problem)
    return f"job {s['job']}.{s['step']}: {why}" if why else None


def _each(items: Any, most: int, what: str, problem: Callable[[Any], str | None]
          ) -> str | None:
    """The first problem of a list of at most ``most`` items, or None."""
    if not isinstance(items, list) or len(items) > most:
        return f"{what} not a list of at most {most}"
    return next((why for why in map(problem, items) if why), None)


def loaded_problem(doc: Any, host: str | None = None) -> str | None:
    """Why ``doc`` is not a loaded document within its quota (of node ``host``), or None."""
    if not isinstance(doc, dict):
        return "not an object"
    if type(doc.get("ncclguard_loaded")) is not int or doc["ncclguard_loaded"] != LOADED_VERSION:
        return f"version {str(doc.get('ncclguard_loaded'))[:20]!r}, expected {LOADED_VERSION}"
    if host is not None and doc.get("host") != host:
        return f"of host {str(doc.get('host'))[:80]!r}, not {host!r}"
    if not (_num(doc.get("scanned_at")) and type(doc.get("complete")) is bool):
        return "scanned_at or complete not valid"
    why = _each(doc.get("steps"), MAX_STEPS, "steps", step_problem)
    if why:
        return why
    size = len(json.dumps(doc, separators=(",", ":")))
    if size > MAX_LOADED_BYTES:
        return f"{size} bytes, over its quota of {MAX_LOADED_BYTES}"
    return None
