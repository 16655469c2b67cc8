"""The spool: one signed record per node, on the shared filesystem, without locks.

A node's ``ncclguard-inventoryd run`` publishes its fingerprint as ``<spool>/<host>.rec``:
a MUNGE credential (:mod:`ncclguard.munge`) whose payload is the canonical JSON

    {"ncclguard_record": 1, "host": "n3", "seq": 1796054192123456789, "fingerprint": {...}}

``seq`` is the publisher's clock in nanoseconds when it signed: signed with the rest, it
orders two records of one node that munged encoded in the same second (encode times
are whole seconds), so that neither can be put back after the other.

written atomically (a temporary file in the same directory, ``fsync``, ``rename``, then
``fsync`` of the directory), so a reader sees the old record or the new one, never a
torn one, and needs no lock. The collector on the controller reads every record through
:func:`read` and :func:`parse_payload`, which bound what they read and turn every bad
input into a :class:`RecordError` whose ``cause`` is one of :data:`CAUSES`.

Nothing here trusts the spool: a file may be a symlink, a FIFO, huge, truncated or
garbage, and the directory may be missing (an unmounted share) or writable by others.

Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from ncclguard.fingerprint.model import SCHEMA

__all__ = [
    "CAUSES",
    "RECORD_VERSION",
    "SUFFIX",
    "FileState",
    "Record",
    "RecordError",
    "SpoolError",
    "atomic_write",
    "check_dir",
    "host_of",
    "parse_payload",
    "payload",
    "read",
    "record_name",
    "scan",
    "write",
]

RECORD_VERSION = 1
SUFFIX = ".rec"
DIR_MODE = 0o755
FILE_MODE = 0o644
#: a host name that can be a file name: Slurm node names in practice, never a path
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_TMP_PREFIX = "."

#: why a record was rejected: stable names for logs, the ``rejections`` table and metrics
CAUSES = {
    "unreadable": "the file could not be read",
    "not-a-file": "not a regular file (a symlink, a FIFO, a directory)",
    "oversized": "larger than spool.max_record_bytes",
    "undecodable": "not a credential munged can decode (truncated, garbage, another key)",
    "expired": "the credential's time to live has passed",
    "rewound": "encoded in the future (clock skew beyond munged's allowance)",
    "replayed": "not newer than the record already accepted for the node",
    "wrong-uid": "signed by a uid other than the configured publisher",
    "wrong-address": "signed from an address that is not the named node's",
    "unknown-node": "names a node whose addresses are unknown (not in Slurm or the map)",
    "name-mismatch": "the file name, the record's host and its fingerprint disagree",
    "malformed": "the payload is not a record of this version",
    "munge-unavailable": "the collector's munged could not be reached",
}


class SpoolError(Exception):
    """The spool directory cannot be used (missing, unsafe, not writable)."""


class RecordError(Exception):
    """One record cannot be accepted; ``cause`` is a key of :data:`CAUSES`."""

    def __init__(self, cause: str, detail: str) -> None:
        assert cause in CAUSES, cause
        self.cause = cause
        self.detail = detail
        super().__init__(f"{cause}: {detail}")


class FileState(NamedTuple):
    """What :func:`scan` saw of a file; a record is read again only when this changes."""

    ino: int
    size: int
    mtime_ns: int


def record_name(host: str) -> str:
    """``<host>.rec``; ``ValueError`` for a name that cannot be a node's file name."""
    if not isinstance(host, str) or not _HOST.fullmatch(host):
        raise ValueError(f"{host!r} is not a node name ncclguard can publish under")
    return host + SUFFIX


def host_of(filename: str) -> str | None:
    """The node a spool file name is for, or None for a name that is not a record's."""
    if not filename.endswith(SUFFIX):
        return None
    host = filename[: -len(SUFFIX)]
    return host if _HOST.fullmatch(host) else None


def check_dir(path: Path, *, create: bool = False) -> None:
    """Refuse a spool that is missing (a missing mount) or writable by others.
    ``create``: make the last path component when its parent exists (the publisher)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if not create:
            raise SpoolError(f"spool {path} does not exist (missing mount?)") from None
        if not path.parent.is_dir():
            raise SpoolError(
                f"spool {path}: directory {path.parent} does not exist (missing mount?)"
            ) from None
        try:
            path.mkdir(mode=DIR_MODE)
            os.chmod(path, DIR_MODE)
        except FileExistsError:
            pass
        except OSError as e:
            raise SpoolError(f"spool {path}: cannot create: {e.strerror or e}") from None
        st = os.stat(path)
    except OSError as e:
        raise SpoolError(f"spool {path}: cannot stat: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SpoolError(f"spool {path} is not a directory")
    if st.st_mode & stat.S_IWOTH:
        raise SpoolError(
            f"spool {path} is writable by others (mode {stat.filemode(st.st_mode)}): refusing"
        )


# ------------------------------------------------------------------ the payload


def payload(fingerprint: dict[str, Any], seq: int | None = None) -> bytes:
    """The bytes a node signs: its canonical record (``seq``: default, the clock in ns)."""
    import time

    from ncclguard.fingerprint.canonical import canonical_json
    from ncclguard.fingerprint.model import hostname

    host = hostname(fingerprint)
    record_name(host)
    doc = {"ncclguard_record": RECORD_VERSION, "host": host,
           "seq": time.time_ns() if seq is None else seq, "fingerprint": fingerprint}
    return canonical_json(doc).encode()


_INT64 = (-(2**63), 2**63 - 1)


def _check_values(doc: Any) -> str | None:
    """Why ``doc`` cannot be stored as it is, or None: a string that is not valid UTF-8
    (a lone surrogate from a ``\\ud800`` escape), an integer SQLite cannot hold, or a
    number that is not finite (``NaN``, ``Infinity``: not JSON, though Python reads them)."""
    stack = [doc]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode()
            except UnicodeEncodeError:
                return f"a string that is not valid UTF-8: {x[:40]!r}"
        elif isinstance(x, bool) or x is None:
            continue
        elif isinstance(x, int):
            if not _INT64[0] <= x <= _INT64[1]:
                return f"an integer outside 64 bits: {str(x)[:40]}"
        elif isinstance(x, float):
            if x != x or x in (float("inf"), float("-inf")):
                return f"a number that is not finite: {x}"
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return None


#: top-level parts of a fingerprint and the JSON type each must have
_PARTS: dict[str, type] = {
    "host": dict, "libnccl": list, "plugins": list, "net": dict, "rdma": dict,
    "netifs": list, "nccl_conf": dict, "gpu": dict, "errors": list,
}  # fmt: skip


class Record(NamedTuple):
    host: str
    seq: int
    fingerprint: dict[str, Any]


def parse_payload(data: bytes, *, max_bytes: int) -> Record:
    """The record in a decoded payload, or :class:`RecordError` ("oversized",
    "malformed", "name-mismatch")."""
    if len(data) > max_bytes:
        raise RecordError("oversized", f"payload of {len(data)} bytes (limit {max_bytes})")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise RecordError("malformed", f"payload is not JSON: {str(e)[:100]}") from None
    if not isinstance(doc, dict):
        raise RecordError("malformed", "payload is not a JSON object")
    version = doc.get("ncclguard_record")
    if type(version) is not int or version != RECORD_VERSION:  # True == 1 in Python
        raise RecordError("malformed", f"record version {version!r}, expected {RECORD_VERSION}")
    host, fp, seq = doc.get("host"), doc.get("fingerprint"), doc.get("seq")
    if not isinstance(host, str) or not _HOST.fullmatch(host):
        raise RecordError("malformed", f"record host {str(host)[:80]!r} is not a node name")
    if type(seq) is not int or not 0 <= seq <= _INT64[1]:
        raise RecordError("malformed", f"record seq {repr(seq)[:40]} is not a count")
    if not isinstance(fp, dict):
        raise RecordError("malformed", "the record holds no fingerprint object")
    if type(fp.get("schema")) is not int or fp.get("schema") != SCHEMA:
        raise RecordError(
            "malformed", f"fingerprint schema {str(fp.get('schema'))[:20]!r}, expected {SCHEMA}"
        )
    for part, typ in _PARTS.items():
        if part in fp and not isinstance(fp[part], typ):
            raise RecordError(
                "malformed", f"fingerprint part {part!r} is {type(fp[part]).__name__}, "
                f"not {typ.__name__}"
            )
    fp_host = fp.get("host", {}).get("hostname")
    if fp_host != host:
        raise RecordError(
            "name-mismatch", f"record for {host!r} holds the fingerprint of {str(fp_host)[:80]!r}"
        )
    why = _check_values(fp)
    if why:
        raise RecordError("malformed", f"the fingerprint holds {why}")
    return Record(host, seq, fp)


# ------------------------------------------------------------------ files


def write(spool: Path, host: str, data: bytes) -> Path:
    """Publish ``data`` as ``<spool>/<host>.rec`` atomically. ``OSError`` on failure (the
    temporary file is removed)."""
    return atomic_write(spool / record_name(host), data, FILE_MODE)


def atomic_write(target: Path, data: bytes, mode: int) -> Path:
    """Replace ``target`` with ``data`` atomically: a new file beside it (never through a
    link), written, fsynced and renamed over it; then the directory is fsynced. A reader
    sees the old file or the new one, never a part. ``OSError`` on failure (the
    temporary file is removed)."""
    directory = target.parent
    tmp = directory / f"{_TMP_PREFIX}{target.name}.{secrets.token_hex(6)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tmp, flags, mode)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a crash
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return target


def clear_the_way(spool: Path, host: str) -> None:
    """A directory at the node's own record name (a rename cannot replace it) is moved
    aside as ``.<host>.rec.blocked.<random>``, where the collector never looks; a
    symlink or FIFO there is replaced by the rename itself."""
    target = spool / record_name(host)
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(target).st_mode):
            os.rename(target, spool / f"{_TMP_PREFIX}{target.name}.blocked.{secrets.token_hex(6)}")


def remove_leftovers(spool: Path, host: str, older_than_s: float, now: float) -> int:
    """Remove this host's temporary files left by a publisher that died mid-write."""
    prefix = f"{_TMP_PREFIX}{record_name(host)}."
    removed = 0
    with contextlib.suppress(OSError), os.scandir(spool) as it:
        for e in it:
            if e.name.startswith(prefix):
                with contextlib.suppress(OSError):
                    if now - e.stat(follow_symlinks=False).st_mtime > older_than_s:
                        os.unlink(e.path)
                        removed += 1
    return removed


def scan(spool: Path) -> Iterator[tuple[str, FileState | None]]:
    """``(file name, state)`` of every entry that looks like a record; state None for an
    entry that is not a regular file (it is rejected when read)."""
    with os.scandir(spool) as it:
        for e in it:
            if e.name.startswith(_TMP_PREFIX) or not e.name.endswith(SUFFIX):
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue  # gone since the listing
            if not stat.S_ISREG(st.st_mode):
                yield e.name, None
                continue
            yield e.name, FileState(st.st_ino, st.st_size, st.st_mtime_ns)


def read(path: Path, *, max_bytes: int) -> bytes:
    """A record file's bytes, at most ``max_bytes``: never follows a symlink, never blocks
    on a FIFO, never reads more than the bound. :class:`RecordError` otherwise."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == 40:  # ELOOP: a symlink
            raise RecordError("not-a-file", f"{path} is a symlink") from None
        raise RecordError("unreadable", f"{path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RecordError("not-a-file", f"{path} is not a regular file")
        if st.st_size > max_bytes:
            raise RecordError("oversized", f"{path} is {st.st_size} bytes (limit {max_bytes})")
        chunks: list[bytes] = []
        left = max_bytes + 1
        while left > 0:
            b = os.read(fd, min(left, 1 << 16))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
    except OSError as e:
        raise RecordError("unreadable", f"{path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise RecordError("oversized", f"{path} grew past {max_bytes} bytes while read")
    return data.strip()
