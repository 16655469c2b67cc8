"""Read the libnccl a job names (issue 40): ``ncclguard-inventoryd read-nccl PATH``.

What ``ncclguard check --env`` (and, later, the collector) needs of a job's own
``libnccl.so.2``: its version and the plugin ABIs it looks for, read by the same code
that reads a node's libraries (:func:`inventoryd.probes.nccl.analyze`), with the same
bounds (a file larger than any library, or not ELF, is not read). The file is opened
without blocking (a FIFO never hangs the reader), must be a regular file once open, and
is read as whoever runs this: run it as the job's owner, or an unprivileged user, never
to read what the owner could not.
"""

from __future__ import annotations

import os
import stat
from typing import Any

__all__ = ["read"]


def read(path: str) -> dict[str, Any]:
    """``{"path", "realpath", "version", "abis", "sha256", "size", "error"}`` of the file
    at ``path``; ``error`` says why the rest is null."""
    out: dict[str, Any] = {"path": path, "realpath": None, "version": None, "abis": None,
                           "sha256": None, "size": None, "error": None}
    if not path.startswith("/"):
        out["error"] = f"{path}: not an absolute path"
        return out
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        out["error"] = f"{path}: cannot open: {e.strerror or e}"
        return out
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            out["error"] = f"{path}: not a regular file"
            return out
        from inventoryd.probes import nccl

        with os.fdopen(fd, "rb", closefd=False) as f:
            facts = nccl.analyze(f, path)
        out.update(realpath=os.path.realpath(path), version=facts.get("version"),
                   abis=facts.get("abis"), sha256=facts.get("sha256"),
                   size=facts.get("size"),
                   error=facts.get("version_error") if not facts.get("version") else None)
        return out
    except OSError as e:
        out["error"] = f"{path}: cannot read: {e.strerror or e}"
        return out
    finally:
        os.close(fd)
