"""How a message names the owner of a file, also inside a user namespace.

Every ncclguard unit runs with systemd's ``PrivateUsers=yes``: a user namespace that maps
only root and the unit's own user and group. The kernel reports the owner of any other
file as the overflow uid (``/proc/sys/kernel/overflowuid``, 65534), and the real owner
cannot be read from inside. "owned by uid 65534" would name the wrong owner (seen under
systemd: a file of uid 1000 was reported as uid 65534), so :func:`owner` says what is
known instead: a user this process cannot see.
"""

from __future__ import annotations

import functools
import stat
from pathlib import Path

UID_MAP = Path("/proc/self/uid_map")
OVERFLOW_UID = Path("/proc/sys/kernel/overflowuid")  # hidden under ProcSubset=pid
DEFAULT_OVERFLOW_UID = 65534


def parse_uid_map(text: str) -> tuple[tuple[int, int, int], ...]:
    """The ranges of ``/proc/<pid>/uid_map``: (first uid inside, outside, count)."""
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 3 and all(f.isdigit() for f in fields):
            out.append((int(fields[0]), int(fields[1]), int(fields[2])))
    return tuple(out)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeError):
        return None


@functools.cache
def _namespace() -> tuple[tuple[tuple[int, int, int], ...] | None, int]:
    """This process's uid map (None: unknown) and the overflow uid (a process's user
    namespace is fixed once it runs)."""
    text = _read(UID_MAP)
    overflow = _read(OVERFLOW_UID)
    return (None if text is None else parse_uid_map(text),
            int(overflow) if overflow and overflow.strip().isdigit() else DEFAULT_OVERFLOW_UID)


def hidden(uid: int, *, uid_map: tuple[tuple[int, int, int], ...] | None = None,
           overflow_uid: int | None = None) -> bool:
    """Whether a file's owner ``uid`` is the overflow uid that this process's user
    namespace does not map: the real owner cannot be known (the module doc). The
    collector then judges who may read a file by its "other" bits only
    (``inventoryd/controller/jobenv_index.py``)."""
    ranges, overflow = _namespace()
    if uid_map is not None:
        ranges = uid_map
    if overflow_uid is not None:
        overflow = overflow_uid
    return uid == overflow and ranges is not None and not any(
        inside <= uid < inside + count for inside, _, count in ranges)


def owner(uid: int, *, uid_map: tuple[tuple[int, int, int], ...] | None = None,
          overflow_uid: int | None = None) -> str:
    """``"uid N"``; for the overflow uid where this process's user namespace does not map
    it, the words for an owner the process cannot see. ``uid_map`` and ``overflow_uid``
    default to this process's own."""
    if hidden(uid, uid_map=uid_map, overflow_uid=overflow_uid):
        overflow = _namespace()[1] if overflow_uid is None else overflow_uid
        return (f"a user outside this process's user namespace (systemd's PrivateUsers= "
                f"maps only root and the unit's user; the kernel shows every other owner "
                f"as uid {overflow})")
    return f"uid {uid}"


_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def kind(mode: int) -> str:
    """What a file that is not a regular one is, for a message that refuses it (``a
    FIFO``, ``a character device``): the node daemon's reads and diagnose's alike."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")
