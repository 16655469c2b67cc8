"""Streaming job-log reader and NCCL log-prefix parser.

Logs are read as bytes, one line at a time, plain or gzip (detected by the magic
bytes, not the file name), and never loaded whole: memory stays bounded by
:data:`MAX_LINE` whatever the file's size. A longer line is cut at
:data:`MAX_LINE` bytes and the rest of it skipped.

NCCL's debug prefix (``src/debug.cc``; formats read from the strings of real
``libnccl.so.2`` files 2.18.3, 2.21.5 and 2.26.2)::

    host:pid:tid [dev] NCCL INFO <message>
    host:pid:tid [dev] file.cc:123 NCCL WARN <message>
    [2026-11-30 02:18:45] host:pid:tid [dev] file.cc:217 NCCL WARN <message>   (2.26+)

The number in brackets is the process's **CUDA device**, not its rank (before
the device is set, it is -1, 0 or an uninitialised value). The global rank comes
from a launcher's tag (``srun -l``: ``3: ``; torchrun: ``[rank3]:``; Open MPI
``--tag-output``: ``[1,3]<stderr>:``) or from NCCL's own
``comm 0x… rank 3 nranks 16 … - Init COMPLETE`` line for that host and pid.
"""

from __future__ import annotations

import errno
import gzip
import io
import os
import re
import stat
import time
import zlib
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ncclguard.fileowner import kind, owner

MAX_LINE = 64 * 1024  # bytes kept of one line
GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 20

# A launcher's timestamp (Open MPI --timestamp-output: "2019-06-02T16:13:44.884Z: "),
# launcher tags, then NCCL's optional timestamp, then NCCL's prefix. The tags: srun -l
# ("12: "), torchrun ("[rank12]:"), Open MPI --tag-output ("[1,12]<stderr>:") and pdsh,
# which DeepSpeed's launcher uses ("node01: ": a name, a colon and a space, which a host
# name in NCCL's "host:pid:tid" never has).
_LEAD = rb"(?:\d{4}-\d\d-\d\dT[\d:.,]+(?:Z|[+-]\d\d:?\d\d)?:? )?"
_TAG = (
    rb"(?:\s*(?P<task>\d{1,9}): "
    rb"|\[rank(?P<rrank>\d{1,9})\]:\s?"
    rb"|\[\d{1,9},(?P<mrank>\d{1,9})\]<std(?:out|err)>:\s?"
    rb"|[A-Za-z][\w.\-]*: )"
)
_NCCL_TS = rb"(?:\[\d{4}-\d\d-\d\d[ T][\d:.,]+\] )?"
# From 2.30.6 a WARN names its function after file:line: "[0] misc/socket.cc:123
# (ncclSocketConnect) NCCL WARN ..." (src/debug.cc, v2.30.7-1; docs/diagnose.md)
_FUNC = rb"(?:\([\w:~<>]{1,128}\) )?"
_PREFIX = re.compile(
    rb"^" + _LEAD + _TAG + rb"?" + _NCCL_TS
    + rb"(?P<host>[A-Za-z0-9_.\-]+):(?P<pid>\d{1,10}):(?P<tid>\d{1,10}) \[(?P<dev>-?\d{1,10})\] "
    rb"(?:[\d.]+ )?(?:(?P<src>[\w./+\-]+:\d+) " + _FUNC + rb")?"
    rb"NCCL (?P<level>INFO|WARN|TRACE) ?(?P<msg>[^\r\n]*)",
)
# An NCCL line whose "host:pid:tid" a paste or a tool lost: "include/shm.h:28 NCCL WARN
# ...", "[3] NCCL INFO ...", "NCCL WARN NET/IB : ...". Its host is the launcher tag's,
# else the nearest NCCL-prefixed line's above it (scanner.py).
_BARE = re.compile(
    rb"^" + _LEAD + _TAG + rb"?" + _NCCL_TS
    + rb"(?:\[-?\d+\] )?(?:(?P<src>[\w./+\-]+:\d+) " + _FUNC + rb")?"
    rb"NCCL (?P<level>INFO|WARN|TRACE) ?(?P<msg>[^\r\n]*)",
)
_TAG_ONLY = re.compile(rb"^" + _LEAD + _TAG)


class LogError(Exception):
    """A log that cannot be read at all. The message names the file and the cause."""


@dataclass(frozen=True)
class NcclLine:
    """One line carrying NCCL's debug prefix."""

    host: str
    pid: int
    tid: int
    dev: int  # CUDA device as NCCL printed it (not the rank)
    level: str  # INFO | WARN | TRACE
    src: str | None  # "misc/socket.cc:537" on WARN lines
    message: str
    rank: int | None  # from a launcher tag, if any


def _tag_rank(m: re.Match[bytes]) -> int | None:
    for g in ("task", "rrank", "mrank"):
        v = m.group(g)
        if v is not None:
            return int(v)
    return None


def parse_prefix(line: bytes | str) -> NcclLine | None:
    """Parse NCCL's debug prefix; ``None`` for a line without one."""
    raw = line.encode("utf-8", "replace") if isinstance(line, str) else line
    m = _PREFIX.match(raw)
    if m is None:
        return None
    return NcclLine(
        host=m.group("host").decode("ascii", "replace"),
        pid=int(m.group("pid")),
        tid=int(m.group("tid")),
        dev=int(m.group("dev")),
        level=m.group("level").decode("ascii"),
        src=m.group("src").decode("ascii", "replace") if m.group("src") else None,
        message=m.group("msg").decode("utf-8", "replace").rstrip(),
        rank=_tag_rank(m),
    )


def launcher_rank(line: bytes) -> int | None:
    """The rank in a launcher's tag at the start of a non-NCCL line, if any."""
    m = _TAG_ONLY.match(line)
    return _tag_rank(m) if m else None


def strip_tag(line: bytes) -> bytes:
    m = _TAG_ONLY.match(line)
    return line[m.end() :] if m else line


@dataclass
class ReadProblem:
    """A read that stopped early: the lines before ``line`` were diagnosed."""

    file: str
    line: int
    cause: str

    def __str__(self) -> str:
        return f"{self.file}: {self.cause} after line {self.line}; only lines 1-{self.line} read"


def _open_log(p: Path, uid: int | None) -> io.BufferedReader:
    """Open ``p`` for reading, never blocking: a regular file only (a FIFO would hang the
    reader for good, ``/dev/zero`` linked in would spin it). ``uid``: also owned by that
    user, and no final symlink (the job's own files, read by a more privileged reader:
    a link to a file only root may read must not print its lines)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if uid is not None else 0)
    try:
        fd = os.open(p, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and uid is not None:
            raise LogError(f"{p}: a symbolic link; the job's own file is not read through "
                           "one") from None
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        if not stat.S_ISREG(st.st_mode):
            raise LogError(f"{p}: not a regular file ({kind(st.st_mode)}); not read")
        if uid is not None and st.st_uid != uid:
            raise LogError(f"{p}: owned by {owner(st.st_uid)}, not by the job's user "
                           f"(uid {uid}); not read")
        fstype = fs_type(fd) if uid is not None else None
        if fstype is not None and fstype.startswith("fuse"):
            raise LogError(f"{p}: on a FUSE filesystem ({fstype}), which its owner can make "
                           "stall a read for good; not read")
        os.set_blocking(fd, True)
        return open(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise


def fs_type(fd: int) -> str | None:
    """The type of the filesystem an open file is on (``ext4``, ``fuse.sshfs``), from
    ``/proc/self/fdinfo`` (its ``mnt_id``) and ``/proc/self/mountinfo``; None when not
    known."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            mnt = next((ln.split()[1] for ln in f if ln.startswith("mnt_id:")), None)
        if mnt is None:
            return None
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] == mnt and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return None


class LogReader:
    """Iterate ``(lineno, bytes)`` over a plain or gzip log, streaming.

    Opening problems (missing file, a directory, no permission) raise
    :class:`LogError` at construction. A problem mid-stream (a truncated or
    corrupt gzip member, an I/O error) ends the iteration and is kept in
    :attr:`problem`, so that the caller diagnoses what was read and says so.
    """

    def __init__(self, path: str | os.PathLike[str], owner_uid: int | None = None,
                 deadline: float | None = None) -> None:
        """Only a regular file is read (opened without blocking: a FIFO or a device is
        refused, named). ``owner_uid``: read it only if that user owns it, opened without
        following a final symlink (the Epilog, which runs as SlurmUser,
        reads paths that the job's user chose). ``deadline`` (``time.monotonic()``):
        stop reading there, after any chunk, and say so in :attr:`problem` (a 3 GiB line
        or a gzip bomb yields no line for a long time: the caller cannot check it)."""
        self.path = str(path)
        self.deadline = deadline
        self.problem: ReadProblem | None = None
        self.truncated_lines = 0  # lines longer than MAX_LINE
        self.bytes_read = 0
        self.lines = 0  # lines yielded so far
        p = Path(path)
        try:
            self._fh = _open_log(p, owner_uid)
        except LogError:
            raise
        except FileNotFoundError:
            raise LogError(f"{p}: log file not found") from None
        except IsADirectoryError:
            raise LogError(f"{p}: is a directory, not a log file") from None
        except PermissionError:
            raise LogError(f"{p}: permission denied") from None
        except OSError as e:
            raise LogError(f"{p}: cannot open: {e.strerror or e}") from None
        try:
            head = self._fh.peek(2)[:2] if hasattr(self._fh, "peek") else b""
        except OSError as e:
            self._fh.close()
            raise LogError(f"{p}: cannot read: {e.strerror or e}") from None
        self.compressed = head == GZIP_MAGIC
        # gzip reads the raw file under one read1() for as long as it finds only empty
        # members or a file-name field (byte by byte): the deadline is checked on each
        # raw read too (2,000,000 empty members ran 5.3 s past a 2 s budget)
        raw = _Deadlined(self._fh, deadline) if deadline is not None else self._fh
        self._stream = gzip.GzipFile(fileobj=raw, mode="rb") if self.compressed else self._fh

    def close(self) -> None:
        if self._stream is not self._fh:
            self._stream.close()
        self._fh.close()

    def __enter__(self) -> LogReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        """Lines without their end-of-line, numbered from 1; read in 1 MiB chunks."""
        for before, count, block in self.blocks():
            if count == 1:
                yield before + 1, block
            else:
                yield from enumerate(block.split(b"\n"), before + 1)

    def blocks(self) -> Generator[tuple[int, int, bytes], None, None]:
        """The log as runs of whole lines: ``(lines before it, lines in it, block)``.

        A block is one or more lines joined by ``\n`` (no final newline), each at most
        :data:`MAX_LINE` bytes: a longer line is cut and is a block of its own. A line is
        never split between blocks, so that a caller may search a whole block at once.
        """
        lineno = 0
        carry = b""
        skipping = False  # inside an over-long line: discard up to its newline
        # read1 on gzip: one decompression step per call, so that a stream that breaks
        # off loses only the step that failed, not a whole chunk of good lines
        read = self._stream.read1 if self.compressed else self._stream.read
        try:
            while True:
                try:
                    chunk = read(_CHUNK)
                except _TimeLimit:
                    self.problem = ReadProblem(self.path, lineno, "time limit reached")
                    break
                except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as e:
                    self.problem = ReadProblem(self.path, lineno, _describe(e, self.compressed))
                    break
                if not chunk:
                    break
                self.bytes_read += len(chunk)
                if self.deadline is not None and time.monotonic() > self.deadline:
                    self.problem = ReadProblem(self.path, lineno, "time limit reached")
                    break
                if skipping:
                    j = chunk.find(b"\n")
                    if j < 0:
                        continue
                    chunk = chunk[j + 1 :]
                    skipping = False
                if carry:
                    chunk = carry + chunk
                j = chunk.rfind(b"\n")
                if j < 0:
                    carry = chunk
                else:
                    carry = chunk[j + 1 :]
                    for count, block in self._bounded(chunk[:j]):
                        yield lineno, count, block
                        lineno += count
                        self.lines = lineno
                if len(carry) > MAX_LINE:
                    self.truncated_lines += 1
                    yield lineno, 1, carry[:MAX_LINE]
                    lineno += 1
                    carry = b""
                    skipping = True
                self.lines = lineno
            if carry and not skipping:
                yield lineno, 1, carry
                lineno += 1
        finally:
            self.lines = lineno
            self.close()

    def _bounded(self, data: bytes) -> Iterator[tuple[int, bytes]]:
        """``data`` (whole lines joined by ``\n``) as blocks whose lines fit MAX_LINE."""
        end = len(data)
        start = p = 0  # start of the pending run of short lines; start of the line at hand
        while end - p > MAX_LINE:  # only then can a line from p on be too long
            q = data.rfind(b"\n", p, p + MAX_LINE + 1)
            if q >= 0:
                p = q + 1  # every line in [p, q) fits
                continue
            if p > start:
                run = data[start : p - 1]
                yield run.count(b"\n") + 1, run
            self.truncated_lines += 1
            yield 1, data[p : p + MAX_LINE]
            q = data.find(b"\n", p + MAX_LINE)
            if q < 0:
                return
            start = p = q + 1
        run = data[start:] if start else data
        yield run.count(b"\n") + 1, run


class _TimeLimit(Exception):
    """The reading deadline passed inside a read."""


class _Deadlined:
    """A binary file whose every ``read`` first checks the deadline."""

    def __init__(self, fh: Any, deadline: float) -> None:
        self._fh, self._deadline = fh, deadline

    def read(self, n: int = -1) -> bytes:
        if time.monotonic() > self._deadline:
            raise _TimeLimit
        return bytes(self._fh.read(n))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)


def _describe(e: BaseException, compressed: bool) -> str:
    if isinstance(e, EOFError):
        return "truncated gzip data (the compressed stream ends early)"
    if isinstance(e, gzip.BadGzipFile | zlib.error):
        return f"corrupt gzip data ({e})"
    if isinstance(e, OSError):
        what = "gzip data" if compressed else "file"
        return f"cannot read {what} ({e.strerror or e})"
    return str(e)  # pragma: no cover


def iter_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, bytes]]:
    """Convenience: the lines of one log (problems are dropped; use LogReader to see them)."""
    yield from LogReader(path)
