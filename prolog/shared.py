"""Work that concurrent gate runs share: one computes, the others read what it wrote.

A burst of refusals (the moment after a partial upgrade, when many jobs land on mixed
sets at once) asks the same question of Slurm and of the inventory many times over: which
nodes the partition holds, and in which classes. :func:`shared` answers it once for all
runs of a few seconds: the first run takes a lock, computes, and writes the answer to a
file; runs that meet the lock wait for that file (at most ``wait_s``), and runs that come
later read it while it is younger than ``max_age_s``. A run that cannot get the lock in
time, or whose holder failed (a Slurm call timed out), computes the answer itself: one
slow run never costs the others theirs.

What the gate trusts, and why (docs/gate.md, "Shared work"):

- the directory is ours: created with mode 0700, and used only when it is a directory
  (not a link) that we own and no group or other may write; its parent must hold the same
  (``ncclguard.audit.check_dir``, as for the audit trail: the gate runs as SlurmUser);
- each file is a regular file of ours, written by no one else (owner, no group or other
  write bit, one link), at most :data:`MAX_BYTES`, and written atomically (a new file
  renamed over the old: a reader sees one or the other, never a part);
- its age is the time written inside it (``t``), never the file's mtime, and a time in the
  future is refused; its ``key`` must be the one asked for.

A file that fails any check is ignored (and replaced), never trusted: the answer is
computed again. Hot path: the standard library only, imported on the refusal path alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_BYTES = 8 * 1024 * 1024  # 16,384 names that do not compress, as hostlists: ~200 KB
POLL_S = 0.01
DIR_MODE = 0o700
FILE_MODE = 0o600


class SharedError(OSError):
    """The directory for shared work cannot be used (the message names it and why)."""


def ensure_dir(d: Path) -> None:
    """Create ``d`` (mode 0700) unless it is there, then check it is ours alone."""
    from ncclguard.audit import AuditError, check_dir

    try:
        check_dir(d.parent, "shared gate work")
    except FileNotFoundError:
        raise SharedError(f"{d.parent}: no such directory") from None
    except AuditError as e:
        raise SharedError(str(e)) from None
    with contextlib.suppress(FileExistsError):
        os.mkdir(d, DIR_MODE)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise SharedError(f"{d}: not a directory")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise SharedError(f"{d}: not a directory of ours alone (owner uid {st.st_uid}, "
                          f"mode {stat.S_IMODE(st.st_mode):04o})")


def read(path: Path, key: str, max_age_s: float, now: float | None = None
         ) -> dict[str, Any] | None:
    """The answer in ``path`` when it can be trusted and is young enough, else None."""
    now = time.time() if now is None else now
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                or st.st_mode & 0o022 or st.st_nlink != 1 or st.st_size > MAX_BYTES):
            return None
        data = os.read(fd, MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("key") != key:
        return None
    t = doc.get("t")
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= now - t <= max_age_s:
        return None
    return doc


def write(path: Path, doc: dict[str, Any]) -> None:
    """Replace ``path`` with ``doc`` atomically (a new file beside it, renamed over it).
    Not fsynced: the answer is a cache that any run can compute again."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    data = json.dumps(doc, separators=(",", ":")).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 FILE_MODE)
    try:
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _lock(path: Path, wait_s: float) -> int | None:
    """An fd holding ``flock(LOCK_EX)`` on ``path``, or None when another run held it for
    ``wait_s``. Raises ``OSError`` when the lock file cannot be opened as ours."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                 FILE_MODE)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise SharedError(f"{path}: not a regular file of ours")
    end = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= end:
                os.close(fd)
                return None
            time.sleep(POLL_S)


def shared(directory: Path, name: str, key: str, max_age_s: float, wait_s: float,
           compute: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """``(answer, how)``: the answer to ``key``, as another run wrote it in
    ``directory/name`` within ``max_age_s`` (``how`` = ``"shared"``), or as ``compute()``
    gives it (``"computed"``; then written there for the others). Runs that meet the lock
    wait for it at most ``wait_s``, then compute themselves (``"computed, lock busy"``).
    ``compute``'s exceptions propagate (nothing is written); a directory that cannot be
    used raises :class:`SharedError` before anything is computed."""
    ensure_dir(directory)
    path = directory / name
    doc = read(path, key, max_age_s)
    if doc is not None:
        return doc, "shared"
    fd = _lock(directory / f"{name}.lock", wait_s)
    try:
        if fd is not None:
            doc = read(path, key, max_age_s)  # written while we waited
            if doc is not None:
                return doc, "shared"
        doc = {**compute(), "key": key, "t": time.time()}
        write(path, doc)
        return doc, "computed" if fd is not None else "computed, lock busy"
    finally:
        if fd is not None:
            os.close(fd)  # the lock goes with it
