"""Read a job's own libnccl in a child process (issue 40): one home for how
``ncclguard check --env`` and the collector's job-environment index
(``inventoryd/controller/jobenv_index.py``) run ``ncclguard-inventoryd read-nccl PATH``
(``inventoryd/controller/jobnccl.py``) and turn what it prints into what
:func:`ncclguard.policy.evaluate_nccl` wants (``{"nccl_version", "net_abis", "path",
"source"}``).

The library is never opened in the caller's process: the child opens it without
blocking, reads only a regular file, within the reader's bounds, and is killed after
``timeout_s``. ``-P`` and cwd "/": ``-m`` would put the working directory first on
``sys.path``, and an admin may run ``check`` in a user's directory (or /tmp): their
``inventoryd/`` would run as the admin and say what the library is.

Standard library only.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["READ_TIMEOUT_S", "job_library", "read_library"]

#: One read at most (a library of a few hundred MB is hashed in seconds).
READ_TIMEOUT_S = 120.0
_MAX_OUTPUT = 64 << 10  # read-nccl prints a few hundred bytes; more is not its answer


def job_library(got: Mapping[str, Any], path: str, source: str
                ) -> tuple[dict[str, Any] | None, str | None]:
    """``(the library as evaluate_nccl wants it, None)`` or ``(None, why not)`` from
    read-nccl's JSON object ``got`` for the file at ``path`` found by rule ``source``."""
    if got.get("error"):
        return None, str(got["error"])[:1000]
    version = got.get("version")
    if not isinstance(version, str) or not version:
        return None, f"{path}: no NCCL version found in it"
    abis = got.get("abis") if isinstance(got.get("abis"), dict) else {}
    net = abis.get("net") if isinstance(abis, dict) else None
    net = [a for a in net if isinstance(a, int) and not isinstance(a, bool)] \
        if isinstance(net, list) else []
    return {"nccl_version": version, "net_abis": net, "path": path, "source": source}, None


def read_library(path: str, source: str, *, timeout_s: float = READ_TIMEOUT_S
                 ) -> tuple[dict[str, Any] | None, str | None]:
    """Run ``read-nccl path`` in a child (this interpreter, as this user) and convert its
    answer (:func:`job_library`); every failure is ``(None, why)``, naming the path."""
    try:
        r = subprocess.run([sys.executable, "-P", "-m", "inventoryd.main", "read-nccl", path],
                           capture_output=True, text=True, timeout=timeout_s, check=False,
                           cwd="/", stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, f"{path}: not read within {timeout_s:g} s (the reader was killed)"
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{path}: the reader could not run ({e})"
    try:
        got = json.loads(r.stdout[:_MAX_OUTPUT])
    except ValueError:
        got = None
    if not isinstance(got, dict):
        tail = (r.stderr or "").strip()[-300:]
        return None, f"{path}: not read (exit {r.returncode}: {tail or 'no answer'})"
    return job_library(got, path, source)
