"""What the features daemon holds back, in a file beside the file of classes.

``<classes_file>.status``, JSON, rewritten atomically by ``ncclguard-inventoryd features``
when it changes::

    {"time": 1764523456.1,
     "failing": [{"host": "n7", "error": "...", "since": ..., "attempts": 3,
                  "next_try": ...}],
     "held": [{"host": "n9", "until": ...}]}

``failing``: node updates Slurm refused, tried again with back-off; ``held``: nodes whose
class changed again within ``[features] settle_s``, kept without a class until they
settle. ``ncclguard features check`` and the collector's metrics read it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ncclguard.audit import check_dir
from ncclguard.config import Config
from ncclguard.sched import classfile
from ncclguard.spool import atomic_write

__all__ = ["path", "read", "write"]


def path(config: Config) -> Path:
    return Path(f"{config.features.classes_file}.status")


def read(config: Config) -> dict[str, Any] | None:
    """The status, or None when there is none or it is not one (a regular file only, read
    without blocking, at most as large as the file of classes may be)."""
    try:
        data = json.loads(classfile.read_bytes(path(config)))
    except (classfile.ClassFileError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    for key in ("failing", "held"):
        if not isinstance(data.get(key), list) or not all(
                isinstance(e, dict) and isinstance(e.get("host"), str) for e in data[key]):
            return None
    return data


def write(config: Config, doc: dict[str, Any]) -> None:
    """Replace the status (``OSError`` on failure)."""
    target = path(config)
    check_dir(target.parent, "the features status")
    atomic_write(target, json.dumps(doc, sort_keys=True).encode(), classfile.FILE_MODE)
