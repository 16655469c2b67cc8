"""A batch job's environment as slurmctld saved it at submit (issue 40).

slurmctld writes each batch job's environment to
``<StateSaveLocation>/hash.<id % 10>/job.<id>/environment`` when the job is submitted,
``id`` being the job's, or for an array task its array master's (``SLURM_ARRAY_JOB_ID``).
The file is SlurmUser's, mode 0600, and holds a native-endian 32-bit count, then that many
NUL-terminated ``NAME=value`` strings (docs/slurm.md, "A batch job's saved environment",
with the evidence). PrologSlurmctld runs as SlurmUser and can read it; ``salloc`` and
``srun`` jobs have none.

The file is slurmctld's, but what is in it is the job owner's: :func:`read` keeps only
the variables asked for, reads at most :data:`MAX_BYTES`, and turns every oddity of the
content into a named problem, never an exception. Values are decoded as UTF-8 with
``surrogateescape`` (as :func:`os.fsdecode` does on Linux): they are paths, and
:func:`os.fsencode` gives their bytes back.

Standard library only; no Slurm command is run.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from collections.abc import Iterable
from typing import NamedTuple

from ncclguard.fileowner import kind, owner

__all__ = ["CHUNK", "MAX_BYTES", "SavedEnv", "environment_path", "read"]

#: At most this many bytes of the file are read. A whole sbatch environment fits: Linux
#: gives a program at most 2 MiB of arguments and environment together (``ARG_MAX``, a
#: quarter of the 8 MiB stack), and sbatch drops any variable of 256 KiB or more
#: (``ENV_BUFSIZE``, docs/slurm.md); twice that leaves room for what sbatch adds.
MAX_BYTES = 4 << 20
#: Read in pieces of this size; only the named variables are kept between them.
CHUNK = 64 << 10
_COUNT = struct.Struct("=I")  # native byte order, as slurmctld wrote it


class SavedEnv(NamedTuple):
    """What :func:`read` found: ``values`` (the requested variables present, each at most
    ``max_value`` bytes), ``problems`` (what was not read, and why; each names the file),
    ``path``, and ``missing``: no such file (not a batch job, or the job is purged),
    which is no problem."""

    values: dict[str, str]
    problems: tuple[str, ...]
    path: str
    missing: bool = False
    twice: tuple[str, ...] = ()  # requested names present more than once


def environment_path(state_dir: str, job_id: int, array_job_id: int | None = None) -> str:
    """The saved environment of job ``job_id`` (of array ``array_job_id``, when it is an
    array task: the file is the array master's) under ``state_dir``, slurm.conf's
    ``StateSaveLocation``."""
    use = array_job_id if array_job_id else job_id
    if isinstance(use, bool) or not isinstance(use, int) or not 0 < use < 1 << 32:
        raise ValueError(f"not a Slurm job id: {use!r}")
    return os.path.join(state_dir, f"hash.{use % 10}", f"job.{use}", "environment")


class _Scan:
    """The entries of a stream of NUL-terminated ``NAME=value`` strings, fed in pieces,
    keeping only the wanted names: at most the longest wanted name's length plus one
    byte of any other entry, and ``max_value`` plus one of a wanted value."""

    def __init__(self, names: Iterable[str], max_value: int, count: int, path: str) -> None:
        self.wanted = {n.encode(): n for n in names if n and "=" not in n and "\0" not in n}
        self.head_max = max((len(k) for k in self.wanted), default=0) + 1
        self.max_value = max_value
        self.count = count
        self.path = path
        self.entries = 0
        self.open = False  # bytes since the last NUL
        self.skip = False
        self.name: bytes | None = None
        self.cur = bytearray()
        self.seen: set[bytes] = set()
        self.twice: dict[str, None] = {}
        self.values: dict[str, str] = {}
        self.problems: list[str] = []

    def feed(self, data: bytes) -> None:
        start, size = 0, len(data)
        while start < size:
            nul = data.find(b"\0", start)
            end = size if nul < 0 else nul
            if end > start:
                self.open = True
                self._add(data, start, end)
            if nul < 0:
                return
            self._finish()
            start = nul + 1

    def _add(self, data: bytes, start: int, end: int) -> None:
        if self.skip:
            return
        if self.name is None:
            take = min(end, start + self.head_max - len(self.cur))
            self.cur += data[start:take]
            eq = self.cur.find(b"=")
            if eq < 0:
                self.skip = len(self.cur) >= self.head_max
                return
            name = bytes(self.cur[:eq])
            if name not in self.wanted:
                self.skip = True
                return
            self.name = name
            del self.cur[: eq + 1]
            start = take
        room = self.max_value + 1 - len(self.cur)
        if room > 0:
            self.cur += data[start:min(end, start + room)]

    def _finish(self) -> None:
        index, name, value = self.entries, self.name, bytes(self.cur)
        self.entries += 1
        self.open, self.skip, self.name = False, False, None
        self.cur.clear()
        if name is None or index >= self.count:
            return
        text = self.wanted[name]
        if name in self.seen:
            self.twice[text] = None
            self.problems.append(f"{self.path}: {text} appears more than once: the first "
                                 "kept")
            return
        self.seen.add(name)
        if len(value) > self.max_value:
            self.problems.append(f"{self.path}: {text} is longer than {self.max_value} "
                                 "bytes: not read")
            return
        self.values[text] = value.decode("utf-8", "surrogateescape")

    def end(self, cut: bool) -> None:
        """The stream is over; ``cut``: by the byte cap, not at the file's end."""
        if self.open:
            if cut:
                self.problems.append(f"{self.path}: the entry at the cap is not read")
            else:
                self.problems.append(f"{self.path}: ends inside an entry (no NUL after "
                                     "its last bytes): that entry is not read")
        if cut:
            return
        if self.entries < self.count:
            self.problems.append(f"{self.path}: says {self.count} entries, holds "
                                 f"{self.entries}: truncated, the rest are not known")
        elif self.entries > self.count:
            self.problems.append(f"{self.path}: says {self.count} entries, holds "
                                 f"{self.entries}: those past {self.count} are not read "
                                 "(slurmctld reads no further)")


def _open(path: str) -> tuple[int | None, SavedEnv | None]:
    """The file's descriptor, or the outcome when it is not to be read."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None, SavedEnv({}, (), path, missing=True)
    except OSError as e:
        why = e.strerror or str(e)
        if e.errno == errno.ELOOP:
            why += " (a symbolic link: not followed)"
        return None, SavedEnv({}, (f"{path}: cannot open: {why}",), path)
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        return None, SavedEnv({}, (f"{path}: cannot stat: {e.strerror or e}",), path)
    cause = ""
    if not stat.S_ISREG(st.st_mode):
        what = "a directory" if stat.S_ISDIR(st.st_mode) else kind(st.st_mode)
        cause = what if what == "not a regular file" else f"{what}, not a regular file"
    elif st.st_uid != os.geteuid():
        cause = f"owned by {owner(st.st_uid)}, not by this process's uid {os.geteuid()}"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        cause = f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    if cause:
        os.close(fd)
        return None, SavedEnv({}, (f"{path}: {cause}: not read",), path)
    return fd, None


def read(path: str, names: Iterable[str], *, max_value: int,
         max_bytes: int = MAX_BYTES) -> SavedEnv:
    """The variables ``names`` of the saved environment at ``path``.

    ``max_value``: a longer value is dropped with a problem (the gate passes
    ``jobenv.MAX_VALUE``; this layer does not import the fingerprint's). At most
    ``max_bytes`` of the file are read. The file must be a regular file, not a symbolic
    link, of this process's user, not writable by group or others; otherwise nothing is
    read. A requested name present twice (sbatch never sends one twice): the first is
    kept, and the second named in a problem.
    """
    fd, outcome = _open(path)
    if outcome is not None:
        return outcome
    assert fd is not None
    problems: list[str] = []
    try:
        head = b""
        while len(head) < _COUNT.size:
            got = os.read(fd, _COUNT.size - len(head))
            if not got:
                break
            head += got
        if len(head) < _COUNT.size:
            return SavedEnv({}, (f"{path}: {len(head)} bytes, shorter than its "
                                 f"{_COUNT.size}-byte count: not read",), path)
        (count,) = _COUNT.unpack(head)
        scan = _Scan(names, max_value, count, path)
        left = max(max_bytes - _COUNT.size, 0)
        while left > 0:
            got = os.read(fd, min(CHUNK, left))
            if not got:
                break
            left -= len(got)
            scan.feed(got)
        cut = left <= 0 and bool(os.read(fd, 1))
        if cut:
            problems.append(f"{path}: larger than {max_bytes} bytes: only the first "
                            f"{max_bytes} read, the variables after them are not known")
        scan.end(cut)
        return SavedEnv(scan.values, (*problems, *scan.problems), path,
                        twice=tuple(scan.twice))
    except OSError as e:
        return SavedEnv({}, (f"{path}: cannot read: {e.strerror or e}",), path)
    finally:
        os.close(fd)
