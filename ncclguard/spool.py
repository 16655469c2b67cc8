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

Over 500 lines: the signed record's format, node records and container records alike:
its writer, its bounded reader and its shape checks in one place, so that the node, the
enroot hook and the collector cannot disagree on it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from ncclguard.fingerprint.model import SCHEMA
from ncclguard.fingerprint.shape import bounds_problem

__all__ = [
    "CAUSES",
    "CONTAINER_RECORD_VERSION",
    "CONTAINER_SUBDIR",
    "MAX_CONTAINER_RECORD_BYTES",
    "RECORD_VERSION",
    "SUFFIX",
    "ContainerView",
    "FileState",
    "Record",
    "RecordError",
    "SpoolError",
    "atomic_write",
    "check_dir",
    "check_values",
    "container_record_name",
    "container_view",
    "host_of",
    "parse_container_record",
    "parse_container_record_name",
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
    "too-deep": "nested deeper, or holding more values, than every reader is sure to "
                "handle (ncclguard.fingerprint.shape.bounds_problem)",
    "over-quota": "the node's stored bytes (current record and history) would pass "
                  "collector.node_quota_bytes",
    "change-rate": "the node changed its fingerprint more often than "
                   "collector.max_changes_per_hour",
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


def payload(fingerprint: dict[str, Any], seq: int | None = None,
            loaded: dict[str, Any] | None = None) -> bytes:
    """The bytes a node signs: its canonical record (``seq``: default, the clock in ns;
    ``loaded``: what its running job steps loaded, :mod:`ncclguard.fingerprint.loaded`,
    beside the fingerprint and never part of its hash)."""
    import time

    from ncclguard.fingerprint.canonical import canonical_json
    from ncclguard.fingerprint.model import hostname

    host = hostname(fingerprint)
    record_name(host)
    doc = {"ncclguard_record": RECORD_VERSION, "host": host,
           "seq": time.time_ns() if seq is None else seq, "fingerprint": fingerprint}
    if loaded is not None:
        doc["loaded"] = loaded
    return canonical_json(doc).encode()


_INT64 = (-(2**63), 2**63 - 1)


def _storable(values: list[Any]) -> str | None:
    """Why one of ``values`` (keys and scalars) cannot be stored as it is, or None: a
    string that is not valid UTF-8 (a lone surrogate from a ``\\ud800`` escape), an
    integer SQLite cannot hold, or a number that is not finite (``NaN``, ``Infinity``:
    not JSON, though Python reads them). Each kind checked in one go."""
    strs = [v for v in values if type(v) is str]
    try:
        "".join(strs).encode()
    except UnicodeEncodeError:
        for text in strs:
            try:
                text.encode()
            except UnicodeEncodeError:
                return f"a string that is not valid UTF-8: {text[:40]!r}"
    ints = [v for v in values if type(v) is int]
    if ints and (min(ints) < _INT64[0] or max(ints) > _INT64[1]):
        big = next(v for v in ints if not _INT64[0] <= v <= _INT64[1])
        return f"an integer outside 64 bits: {str(big)[:40]}"
    bad = next((v for v in values if type(v) is float and not math.isfinite(v)), None)
    if bad is not None:
        return f"a number that is not finite: {bad}"
    return None


#: What in a JSON text can read as a value :func:`_storable` refuses: a number (after
#: ``:``, ``,`` or ``[``: a number is a value, never in a string) of 20 digits or more, or
#: of 19 from 9 on (an integer past 64 bits, 2**63 - 1 being 9,223,372,036,854,775,807; a
#: float past a double), or with an exponent; ``NaN`` and
#: ``Infinity``, Python's literals; a ``\\uD800``-``\\uDFFF`` escape, or a surrogate's
#: raw UTF-8 bytes ``ED A0``-``ED BF`` (``json.loads`` reads bytes with
#: ``surrogatepass``): a lone surrogate; a NUL byte (UTF-16 or UTF-32, which it reads too).
#: Text with none of these holds no such value, so its values are not looked at one by
#: one (a third of a heartbeat's walk, docs/perf.md). A string that merely looks like one
#: (``"NaN"``, ``"a:1e5"``) only makes the look run.
_MAYBE_UNSTORABLE = re.compile(
    rb"[:,\[]\s*-?[0-9]+(?:\.[0-9]*)?[eE]|[:,\[]\s*-?(?:9[0-9]{18}|[0-9]{20})|NaN|Infinity"
    rb"|\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]|\x00")


def check_values(doc: Any, what: str, text: bytes | None = None) -> None:
    """:class:`RecordError` ("too-deep" or "malformed") when ``doc`` cannot be stored
    and read back by every reader: past the bounds of
    :func:`ncclguard.fingerprint.shape.bounds_problem`, or holding a value SQLite cannot
    hold (:func:`_storable`). One walk. ``text``: the JSON ``doc`` was read from, when
    known; the values are looked at one by one only when it may hold such a value
    (:data:`_MAYBE_UNSTORABLE`)."""
    scalars: list[Any] | None = (
        [] if text is None or _MAYBE_UNSTORABLE.search(text) else None)
    deep = bounds_problem(doc, scalars)
    if deep:
        raise RecordError("too-deep", f"{what} holds {deep}")
    why = None if scalars is None else _storable(scalars)
    if why:
        raise RecordError("malformed", f"{what} holds {why}")


#: top-level parts of a fingerprint and the JSON type each must have
_PARTS: dict[str, type] = {
    "host": dict, "libnccl": list, "plugins": list, "net": dict, "rdma": dict,
    "netifs": list, "nccl_conf": dict, "gpu": dict, "errors": list,
}  # fmt: skip


#: lists whose items every reader takes as objects (docs/fingerprint.md)
_OBJECT_LISTS = ("libnccl", "plugins", "netifs", "errors")


def _items_problem(fp: dict[str, Any]) -> str | None:
    """Why an item of a list of objects is not one (``"errors": [5]``), or None."""
    lists: list[tuple[str, Any]] = [(p, fp.get(p)) for p in _OBJECT_LISTS]
    rdma = fp.get("rdma")
    devices = rdma.get("devices") if isinstance(rdma, dict) else None
    if devices is not None:
        lists.append(("rdma.devices", devices))
        if isinstance(devices, list):
            lists += [(f"rdma.devices[{i}].ports", d.get("ports"))
                      for i, d in enumerate(devices) if isinstance(d, dict) and d.get("ports")]
    for name, items in lists:
        if items is None:
            continue
        if not isinstance(items, list):
            return f"fingerprint part {name!r} is {type(items).__name__}, not a list"
        for x in items:
            if not isinstance(x, dict):
                return f"an item of {name!r} is {type(x).__name__}, not an object"
    return None


class Record(NamedTuple):
    host: str
    seq: int
    fingerprint: dict[str, Any]
    #: what the node's running job steps loaded (None: the record carries none, or
    #: ``loaded_error`` says why it was left out: the fingerprint is kept all the same)
    loaded: dict[str, Any] | None = None
    loaded_error: str | None = None


def _versioned(data: bytes, max_bytes: int, key: str, version: int, what: str
               ) -> dict[str, Any]:
    """The JSON object of a decoded payload of this ``version`` (``key``), or
    :class:`RecordError` ("oversized", "malformed")."""
    if len(data) > max_bytes:
        raise RecordError("oversized", f"payload of {len(data)} bytes (limit {max_bytes})")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise RecordError("malformed", f"payload is not JSON: {str(e)[:100]}") from None
    if not isinstance(doc, dict):
        raise RecordError("malformed", "payload is not a JSON object")
    got = doc.get(key)
    if type(got) is not int or got != version:  # True == 1 in Python
        raise RecordError("malformed", f"{what} version {repr(got)[:20]}, expected {version}")
    return doc


def parse_payload(data: bytes, *, max_bytes: int) -> Record:
    """The record in a decoded payload, or :class:`RecordError` ("oversized",
    "malformed", "name-mismatch")."""
    doc = _versioned(data, max_bytes, "ncclguard_record", RECORD_VERSION, "record")
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
    why = _items_problem(fp)
    if why:
        raise RecordError("malformed", why)
    fp_host = fp.get("host", {}).get("hostname")
    if fp_host != host:
        raise RecordError(
            "name-mismatch", f"record for {host!r} holds the fingerprint of {str(fp_host)[:80]!r}"
        )
    check_values(fp, "the fingerprint", data)
    loaded, why = doc.get("loaded"), None
    if loaded is not None:
        from ncclguard.fingerprint.loaded import loaded_problem

        why = loaded_problem(loaded, host)
        if why is None:
            try:
                check_values(loaded, "the loaded part")
            except RecordError as e:
                why = e.detail
        if why is not None:
            loaded = None
    return Record(host, seq, fp, loaded, why)


# ------------------------------------------------------------------ container records

CONTAINER_RECORD_VERSION = 1
#: where container records are, under the spool (docs/containers.md)
CONTAINER_SUBDIR = "containers"
_CONTAINER_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_CONTAINER_RECORD_BYTES = 256 * 1024


def container_record_name(host: str, job: str, step: str) -> str:
    """``<host>+<job>+<step>.rec``; ValueError for a part that is not a plain name."""
    for part in (host, job, step):
        if not _CONTAINER_PART.fullmatch(part) or ".." in part:
            raise ValueError(f"{part!r}: not a node, job or step name")
    return f"{host}+{job}+{step}.rec"


def parse_container_record_name(name: str) -> tuple[str, str, str] | None:
    """``(host, job, step)`` of a container record's file name; None: not one."""
    if not name.endswith(".rec"):
        return None
    parts = name[:-4].split("+")
    if len(parts) != 3 or not all(_CONTAINER_PART.fullmatch(p) for p in parts):
        return None
    return parts[0], parts[1], parts[2]


#: what a container record (docs/containers.md) may hold: each part and its JSON types
_OPT_STR = (str, type(None))
_CONTAINER_LIB: dict[str, tuple[type, ...]] = {
    "path": (str,), "realpath": _OPT_STR, "version": _OPT_STR, "sha256": _OPT_STR,
    "default": (bool, type(None))}
_CONTAINER_NET: dict[str, tuple[type, ...]] = {
    "plugin": _OPT_STR, "name": _OPT_STR, "abi": (int, type(None)), "reason": _OPT_STR}
MAX_CONTAINER_LIBS = 64
MAX_CONTAINER_ERRORS = 32


class ContainerView(NamedTuple):
    """What the CLI shows of one container record: the libnccl its job loads (path,
    version) and the net plugin in force (name, ABI)."""

    nccl_version: str | None
    libnccl: str | None
    net_name: str | None
    net_abi: int | None
    sha256: str | None = None  # of that libnccl


def _typed(d: Any, spec: dict[str, tuple[type, ...]]) -> bool:
    return isinstance(d, dict) and all(
        isinstance(d.get(k), types) and not (isinstance(d.get(k), bool) and bool not in types)
        for k, types in spec.items())


def container_view(rec: Any) -> ContainerView | None:
    """The shown parts of a stored container record, or None when its shape is not a
    container record's (every reader goes through this: an odd record is "unreadable",
    never an error of the command)."""
    if not isinstance(rec, dict):
        return None
    libs, net = rec.get("libnccl"), rec.get("net")
    if not (isinstance(libs, list) and len(libs) <= MAX_CONTAINER_LIBS
            and all(_typed(x, _CONTAINER_LIB) for x in libs) and _typed(net, _CONTAINER_NET)):
        return None
    lib = next((x for x in libs if x.get("default")), None)
    assert isinstance(net, dict)
    return ContainerView(lib.get("version") if lib else None, lib.get("path") if lib else None,
                         net.get("name"), net.get("abi"), lib.get("sha256") if lib else None)


def parse_container_record(data: bytes, *, host: str, job: str, step: str,
                           max_bytes: int) -> dict[str, Any]:
    """The container record in a decoded payload, checked before anything is written:
    this version, naming ``host``, ``job`` and ``step`` (the file's name), of the shape
    :func:`container_view` reads, with storable values within the depth and count
    bounds. :class:`RecordError` ("oversized", "malformed", "name-mismatch",
    "too-deep") otherwise."""
    rec = _versioned(data, max_bytes, "ncclguard_container_record", CONTAINER_RECORD_VERSION,
                     "container record")
    check_values(rec, "the container record")
    named = (rec.get("host"), rec.get("job"), rec.get("step"))
    if named != (host, job, step):
        raise RecordError("name-mismatch", f"the file names {host}, job {job}, step {step}; "
                          f"the record {repr(named)[:120]}")
    if container_view(rec) is None:
        raise RecordError("malformed", "libnccl or net is not of a container record's shape "
                          f"(at most {MAX_CONTAINER_LIBS} libraries of path, realpath, "
                          "version, sha256, default; net of plugin, name, abi, reason)")
    conf, errors = rec.get("nccl_conf"), rec.get("errors")
    if conf is not None and not (isinstance(conf, dict)
                                 and all(isinstance(v, str) for v in conf.values())):
        raise RecordError("malformed", "nccl_conf is not a table of strings")
    if not (isinstance(errors, list) and len(errors) <= MAX_CONTAINER_ERRORS):
        raise RecordError("malformed", f"errors is not a list of at most "
                          f"{MAX_CONTAINER_ERRORS} items")
    return rec


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
