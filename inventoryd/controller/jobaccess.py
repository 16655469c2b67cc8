"""Whether a job's uid could load a library, judged by the collector (issue 40).

The collector resolves a job's environment (``inventoryd/controller/jobenv_index.py``)
with :func:`ncclguard.fingerprint.jobenv.locate`; its file test is
:meth:`Access.is_file`: true only for a regular file that the job's uid may read AND that
this collector (unprivileged) may read. For the job's uid, each directory on the way
(the path as written and where its links lead) must let it search (x) and the file let it
read (r), by the permission bits that apply to that uid: the owner's when the file's
owner is that uid, the group's when its group is one of the uid's groups
(``os.getgrouplist`` of the uid's passwd entry), else the others'. Where the owner
cannot be known (``ncclguard/fileowner.py``: the overflow uid under systemd's
PrivateUsers) and for an unknown uid (null), only the others' bits count. ACLs and
capabilities are not read: a file an ACL opens to the job alone is not used.

A path that leads (through links) into /proc, /sys or /dev is refused as ``locate``
refuses one spelled so. Each refusal of a file that exists is named (at most
:data:`MAX_NAMED`); a path where nothing is is not (most ``LD_LIBRARY_PATH`` entries).
"""

from __future__ import annotations

import functools
import os
import pwd
import stat

from ncclguard.fileowner import hidden, kind
from ncclguard.fingerprint.jobenv import NotKnown

__all__ = ["MAX_NAMED", "Access", "permitted"]

MAX_NAMED = 8  # refusals named per resolution; the rest counted
_R, _X = 4, 1


def permitted(st: os.stat_result, uid: int | None, groups: frozenset[int] | None,
              want: int, *, owner_known: bool = True) -> bool:
    """Whether ``uid`` (None: unknown) with ``groups`` (None: unknown) gets ``want``
    (4 read, 1 search) on a file of this ``st`` by its permission bits."""
    mode = st.st_mode
    if uid is None or not owner_known:
        bits = mode & 0o7
    elif st.st_uid == uid:
        bits = (mode >> 6) & 0o7
    elif groups is not None and st.st_gid in groups:
        bits = (mode >> 3) & 0o7
    else:
        bits = mode & 0o7
    return bits & want == want


@functools.lru_cache(maxsize=256)
def _groups(uid: int) -> frozenset[int] | None:
    try:
        pw = pwd.getpwuid(uid)
        return frozenset(os.getgrouplist(pw.pw_name, pw.pw_gid))
    except (KeyError, OSError):
        return None  # not a user this host knows: the owner's or the others' bits only


def _outside(path: str) -> bool:
    parts = [p for p in path.split("/") if p]
    return bool(parts) and parts[0] in ("proc", "sys", "dev")


def _dirs(path: str) -> list[str]:
    """Every directory above ``path``: "/", "/a", "/a/b" for "/a/b/f"."""
    parts = [p for p in path.split("/") if p][:-1]
    return ["/"] + ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


class Access:
    """The file test of one resolution, for one job uid (None: unknown); stats cached
    for that resolution (the entries of a list share their directories)."""

    def __init__(self, uid: int | None) -> None:
        self.uid = uid
        self.groups = _groups(uid) if uid is not None else None
        self.refused: list[str] = []
        self.more = 0  # refusals past MAX_NAMED
        self._stats: dict[str, os.stat_result | None] = {}

    def named(self) -> list[str]:
        return self.refused + ([f"{self.more} more file(s) refused"] if self.more else [])

    def _refuse(self, text: str) -> bool:
        if len(self.refused) < MAX_NAMED:
            self.refused.append(text[:500])
        else:
            self.more += 1
        return False

    def _stat(self, path: str) -> os.stat_result | None:
        """The file at ``path``, None when nothing is there (ENOENT, ENOTDIR: ld.so
        passes over it too); :class:`NotKnown` when this process may not look (EACCES
        on a directory of the user's: the job's uid may see a file there)."""
        if path not in self._stats:
            try:
                self._stats[path] = os.stat(path)
            except (FileNotFoundError, NotADirectoryError):
                self._stats[path] = None
            except (OSError, ValueError) as e:
                raise NotKnown(f"{path}: the collector cannot look "
                               f"({getattr(e, 'strerror', None) or e})") from None
        return self._stats[path]

    def _may(self, st: os.stat_result, want: int) -> bool:
        return permitted(st, self.uid, self.groups, want, owner_known=not hidden(st.st_uid))

    def _job_refusal(self, path: str, real: str, st: os.stat_result) -> str | None:
        """Why the job's uid may not load the file at ``path`` (``real`` where its links
        lead, ``st`` its stat), None when it may: each directory on the way searchable,
        the file readable, by the bits that apply to that uid."""
        who = f"uid {self.uid}" if self.uid is not None else "an unknown uid (others' bits)"
        for d in dict.fromkeys(_dirs(path) + _dirs(real)):
            dst = self._stat(d)
            if dst is None or not stat.S_ISDIR(dst.st_mode) or not self._may(dst, _X):
                return f"{path}: {who} may not enter {d}: not read"
        if not self._may(st, _R):
            return (f"{path}: {who} may not read it (mode {stat.S_IMODE(st.st_mode):04o}, "
                    f"owner uid {st.st_uid}): not read")
        return None

    def is_file(self, path: str) -> bool:
        """A regular file both the job's uid and this process may read (module doc)."""
        st = self._stat(path)
        if st is None:
            return False  # nothing there (a directory this process may not look into
            #               raised NotKnown in _stat)
        real = os.path.realpath(path)
        if _outside(real):
            return self._refuse(f"{path}: leads to {real}, into /proc, /sys or /dev: "
                                "not read")
        if not stat.S_ISREG(st.st_mode):
            return self._refuse(f"{path}: {kind(st.st_mode)}, not a library: not read")
        job_refusal = self._job_refusal(path, real, st)  # NotKnown where it cannot look
        if not os.access(path, os.R_OK):
            # the job's uid may read it where this process may not: the job may load it,
            # and the search must not go on past it
            if job_refusal is None:
                raise NotKnown(f"{path}: the job's uid may read it, the collector (uid "
                               f"{os.getuid()}) may not")
            return self._refuse(f"{path}: the collector (uid {os.getuid()}) may not read "
                                "it: not read")
        if job_refusal is not None:
            return self._refuse(job_refusal)
        return True
