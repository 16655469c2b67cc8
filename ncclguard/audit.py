"""The gate's audit trail: one JSON object per line, one line per decision.

``append(path, record)`` is safe for many concurrent prolog runs: the file is opened
with ``O_APPEND | O_NOFOLLOW``, locked with ``flock`` for the single ``write`` of the
line, created mode 0640, and refused when it is not a regular file owned by us or sits
in a directory that others can write to (the prolog runs as SlurmUser: it must never be
led into writing somewhere a user chose). ``read`` filters by job, time and decision.

Record fields (all optional except ``time``/``ts``): ``job``, ``user``, ``partition``,
``nodes`` (compressed), ``num_nodes``, ``decision`` (accept | warn | refuse | error),
``action`` (none | steer | requeue | hold | kill | opt-out | skip), ``summary``,
``findings``, ``odd_nodes``, ``error``, ``restart_count``, ``duration_ms``.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ncclguard.fileowner import owner

FILE_MODE = 0o640
DIR_MODE = 0o755
MAX_LINE = 64 * 1024  # a record longer than this is cut to its summary fields


class AuditError(OSError):
    """The audit file cannot be written safely (the message names the path and why)."""


LOCK_TIMEOUT_S = 1.0  # another writer holding the lock longer than this: give up, loudly


def check_dir(d: Path, what: str = "the audit log") -> None:
    """Refuse to write ``what`` into ``d`` unless only we or root can write there:
    :class:`AuditError` (an ``OSError``) names the directory and why."""
    st = os.stat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise AuditError(f"{d}: not a directory")
    if st.st_mode & 0o002:  # sticky or not (/tmp): anyone could plant or pre-create the file
        raise AuditError(f"{d}: writable by everyone; refusing to write {what} there")
    if st.st_mode & 0o022 and st.st_uid not in (0, os.geteuid()):
        raise AuditError(f"{d}: owned by {owner(st.st_uid)} and group/world-writable")
    if st.st_uid not in (0, os.geteuid()):
        raise AuditError(f"{d}: owned by {owner(st.st_uid)}, not by us or root")


def _open_for_append(path: Path) -> int:
    d = path.parent
    if not d.exists():
        d.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    check_dir(d)
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError as e:
        raise AuditError(f"{path}: cannot open for append: {e.strerror or e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        os.close(fd)
        raise AuditError(f"{path}: not a regular file of ours (owned by {owner(st.st_uid)}); "
                         "not writing")
    return fd


def now_fields(ts: float | None = None) -> dict[str, Any]:
    t = time.time() if ts is None else ts
    iso = datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    return {"time": iso, "ts": round(t, 3)}


_ESSENTIAL = ("time", "ts", "job", "user", "partition", "num_nodes", "decision", "action",
              "error", "refusal", "duration_ms")
# (each of these cut to 1,000 characters: the last fallback always fits in MAX_LINE)


def _line(rec: dict[str, Any]) -> str:
    """One JSON line of at most MAX_LINE characters: fields are dropped, never text cut."""
    line = json.dumps(rec, separators=(",", ":"), sort_keys=False, default=str)
    if len(line) <= MAX_LINE:
        return line
    keep = {k: v for k, v in rec.items() if k not in ("findings", "diagnoses")}
    keep["truncated"] = True
    line = json.dumps(keep, separators=(",", ":"), default=str)
    if len(line) <= MAX_LINE:
        return line
    small: dict[str, Any] = {
        k: (v[:1000] if isinstance(v, str) else v if isinstance(v, int | float) else str(v)[:1000])
        for k in _ESSENTIAL
        if (v := rec.get(k)) is not None
    }
    small["summary"] = str(rec.get("summary", ""))[:1000]
    small["truncated"] = True
    return json.dumps(small, separators=(",", ":"), default=str)  # ~12 KiB at most


def lock(fd: int, path: Path, timeout: float, what: str = "record not written",
         poll_s: float = 0.01) -> None:
    """``flock(LOCK_EX)``, waiting at most ``timeout`` s, else :class:`AuditError` naming
    ``path`` and ``what`` did not happen: a stuck writer (or a stalled network filesystem)
    must never hold the prolog past its deadline."""
    import fcntl

    end = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= end:
                raise AuditError(
                    f"{path}: locked by another writer for more than {timeout:g} s; {what}"
                ) from None
            time.sleep(poll_s)


def append(
    path: str | os.PathLike[str], record: dict[str, Any], lock_timeout: float = LOCK_TIMEOUT_S
) -> None:
    """Append one record (``time``/``ts`` added when missing) as one JSON line."""
    rec = {**now_fields(), **record} if "ts" not in record else dict(record)
    data = (_line(rec) + "\n").encode()
    p = Path(path)
    fd = _open_for_append(p)
    try:
        lock(fd, p, lock_timeout)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data  # a torn last line (a writer killed mid-write) stays alone
        os.write(fd, data)
    finally:
        os.close(fd)


def iter_records(path: str | os.PathLike[str], *, missing_ok: bool = True,
                 skipped: list[int] | None = None) -> Iterator[dict[str, Any]]:
    """Every well-formed record; a torn or foreign line is skipped (and counted in
    ``skipped[0]`` when given). A missing file has no records, or raises
    FileNotFoundError with ``missing_ok=False`` (a mistyped path is not an empty trail)."""
    try:
        f = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115
    except FileNotFoundError:
        if not missing_ok:
            raise
        return
    with f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if isinstance(rec, dict):
                yield rec
            elif skipped is not None and line.strip():
                skipped[0] += 1


def _is_refusal(rec: dict[str, Any]) -> bool:
    """A refused job: by the policy, or by a gate error with ``on_error = "refuse"``."""
    return rec.get("decision") == "refuse" or (
        rec.get("decision") == "error" and rec.get("action") == "refuse"
    )


def read(
    path: str | os.PathLike[str],
    job: int | str | None = None,
    since: float | str | datetime | None = None,
    refused: bool = False,
    *,
    missing_ok: bool = True,
    skipped: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Records, oldest first, filtered by job id, time (any form of
    :func:`ncclguard.timeparse.parse_time`) and refusal; ``missing_ok`` and ``skipped``
    as for :func:`iter_records`."""
    from ncclguard.timeparse import parse_time  # readers only: not on the gate's path

    t0 = None if since is None else parse_time(since)
    out = []
    for rec in iter_records(path, missing_ok=missing_ok, skipped=skipped):
        if job is not None and str(rec.get("job")) != str(job):
            continue
        if t0 is not None and float(rec.get("ts") or 0) < t0:
            continue
        if refused and not _is_refusal(rec):
            continue
        out.append(rec)
    return out
