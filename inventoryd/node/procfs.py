"""Reading ``/proc`` for the job steps' processes (issue 42, docs/runtime.md): which
step a process is (its cgroup as Slurm lays it out, or its slurmstepd's title), its
``stat`` and uids, and the libraries of interest in its ``maps``. The facts, per Slurm
release and kernel, with their evidence: docs/runtime.md, "Which processes are a job's"
and "What the kernel lets the scanner read". :mod:`inventoryd.node.jobmaps` scans with it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ncclguard.fingerprint.loaded import MAX_PATH
from ncclguard.fingerprint.loading import PREFIXES

__all__ = [
    "CHUNK", "Mapping", "Proc", "lib_kind", "parse_maps_line", "proc_stat", "proc_uid",
    "read_maps", "read_proc", "root_in_all", "step_dir_of_cgroup", "step_of_cgroup",
    "step_of_title",
]

CHUNK = 1 << 20

#: cgroup v1 (``/slurm/uid_U/job_J/step_S``, ``/slurm_NODE/...`` with several slurmd on
#: one host) and cgroup v2 (``/system.slice/slurmstepd.scope/job_J/step_S``,
#: ``NODE_slurmstepd.scope``; from 26.05 the job's directory is its SLUID, ``s`` and 13
#: Crockford base-32 characters, unless cgroup.conf says ``CgroupJobIdPaths=yes``):
#: docs/runtime.md, "Which processes are a job's". Anchored: Slurm's own directory at the
#: top, or under systemd's slices only (a user's delegated subtree is below a .service).
_CGROUP = re.compile(
    r"(?:/[^/]+\.slice)*/(?:slurm(?:_(?P<n1>[^/]+))?/uid_\d+|(?:(?P<n2>[^/]+)_)?slurmstepd\.scope)"
    r"/(?:job_(?P<job>\d+)|(?P<sluid>s[0-9A-HJKMNP-TV-Z]{13}))"
    r"/step_(?P<step>[a-z]+|\d+(?:\+\d+)?)(?=/|$)")
#: the process title of a step's slurmstepd: ``slurmstepd: [J.S]`` (cut at the length of
#: its original argv: ``[1.batch]`` can read ``[1.bat``; from 24.11 `` stepmgr`` may follow
#: the step inside the brackets)
_TITLE = re.compile(rb"slurmstepd: \[(\d+)\.([a-z]+|\d+(?:\+\d+)?)")
_STEP_NAMES = {"bat": "batch", "ext": "extern", "int": "interactive"}


def step_dir_of_cgroup(text: str, node: str | None = None
                       ) -> tuple[str, str | None, str] | None:
    """``(the step's cgroup directory, job or None, step)`` of a ``/proc/PID/cgroup`` text
    when a line is a cgroup Slurm made for a step (of node ``node`` when the path names
    one), else None. The job is None where the directory holds a SLUID (cgroup v2 from
    26.05): the step's slurmstepd, in that directory too, names it. Lines end at "\\n"
    only: the kernel refuses it in a cgroup's name, but prints the name's other line
    separators (``\\x1e``, ``\\x0b``, ``\\r``, ...) as they are, which ``splitlines`` takes
    for the start of a line of Slurm's own making."""
    for line in text.split("\n"):
        m = _CGROUP.match(line.split(":", 2)[-1])
        if m is None:
            continue
        named = m.group("n1") or m.group("n2")
        if named and node is not None and named != node:
            continue
        return m.group(0), m.group("job"), m.group("step")
    return None


def step_of_cgroup(text: str, node: str | None = None) -> tuple[str, str] | None:
    """``(job, step)`` of a ``/proc/PID/cgroup`` text whose path names the job (cgroup
    v1, and v2 with ``job_J``), else None."""
    got = step_dir_of_cgroup(text, node)
    return (got[1], got[2]) if got is not None and got[1] is not None else None


def step_of_title(cmdline: bytes) -> tuple[str, str] | None:
    """``(job, step)`` of a slurmstepd's process title, else None."""
    m = _TITLE.match(cmdline)
    if m is None:
        return None
    step = m.group(2).decode()
    return m.group(1).decode(), _STEP_NAMES.get(step, step)


def lib_kind(path: str) -> str | None:
    """"nccl" for a libnccl, the plugin kind (``net``, ``tuner``, ...) for a
    ``libnccl-<kind>`` library, "ibverbs" for libibverbs, else None."""
    base = path.rsplit("/", 1)[-1]
    if base == "libnccl.so" or base.startswith("libnccl.so."):
        return "nccl"
    if base.startswith("libnccl-") and ".so" in base:
        for kind, prefix in PREFIXES.items():
            if base.startswith(prefix):
                return kind
        return None
    if base.startswith("libibverbs.so"):
        return "ibverbs"
    return None


@dataclass(frozen=True)
class Mapping:
    path: str  # as the kernel wrote it, " (deleted)" removed
    dev: tuple[int, int]
    ino: int
    deleted: bool


def parse_maps_line(line: bytes) -> Mapping | None:
    """The file of one ``maps`` line, when it is a library of :func:`lib_kind`."""
    parts = line.split(None, 5)
    if len(parts) < 6 or not parts[5].startswith(b"/"):
        return None
    try:
        major, minor = (int(x, 16) for x in parts[3].split(b":"))
        ino = int(parts[4])
    except ValueError:
        return None
    raw = parts[5].rstrip(b"\n")
    deleted = raw.endswith(b" (deleted)")
    if deleted:
        raw = raw[: -len(b" (deleted)")]
    path = raw.decode("utf-8", "backslashreplace")
    if ino == 0 or lib_kind(path) is None:
        return None
    return Mapping(path[:MAX_PATH], (major, minor), ino, deleted)


@dataclass
class Proc:
    pid: int
    ppid: int
    uid: int  # -1: not read
    start: int  # clock ticks after boot: a pid reused is another process
    comm: bytes = b""  # the kernel's name of it: the executable's (not the title)


def proc_stat(pid: int, proc: Path) -> Proc | None:
    """Process ``pid``'s parent, start and name (``comm``), from ``/proc/PID/stat``; its
    uid is read later, for the processes of a step only."""
    try:
        data = read_proc(f"{proc}/{pid}/stat", 4096)
    except OSError:
        return None
    end = data.rfind(b")")
    fields = data[end + 2:].split()  # the name may hold spaces and ")"
    try:
        return Proc(pid, int(fields[1]), -1, int(fields[19]),
                    data[data.find(b"(") + 1:end])
    except (IndexError, ValueError):
        return None


def proc_uid(pid: int, proc: Path) -> int | None:
    try:
        return os.stat(proc / str(pid)).st_uid
    except OSError:
        return None


def root_in_all(pid: int, proc: Path) -> bool:
    """Whether process ``pid`` is root in its real, effective, saved and fs uid: the owner
    of ``/proc/PID`` is its effective uid only, root for a set-user-ID program a user ran
    (under a title of the user's choosing)."""
    try:
        status = read_proc(proc / str(pid) / "status", 4096)
    except OSError:
        return False
    for line in status.split(b"\n"):
        if line.startswith(b"Uid:"):
            uids = line.split()[1:]
            return len(uids) == 4 and all(u == b"0" for u in uids)
    return False


def read_proc(path: Path | str, limit: int) -> bytes:
    """At most ``limit`` bytes of a /proc file (one ``read`` for the small ones: os-level,
    a scan does this for every process)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, limit)
        while len(data) < limit:
            more = os.read(fd, limit - len(data))
            if not more:
                break
            data += more
        return data
    finally:
        os.close(fd)


def _lines_naming(data: bytes) -> list[bytes]:
    """The lines of ``data`` that hold ``libnccl`` or ``libibverbs`` (each once), found
    with ``bytes.find`` at C speed: most of a process's maps is other libraries."""
    out = []
    for word in (b"libnccl", b"libibverbs"):
        at = data.find(word)
        while at >= 0:
            start = data.rfind(b"\n", 0, at) + 1
            end = data.find(b"\n", at)
            end = len(data) if end < 0 else end
            out.append(data[start:end])
            at = data.find(word, end)
    return out


def read_maps(path: Path | str, limit: int) -> tuple[list[Mapping], int, bool]:
    """The library mappings of one ``maps`` file: ``(mappings, bytes read, cut)``. Read in
    chunks of whole lines; only the lines naming a library of interest are parsed, one
    entry per file."""
    out: dict[tuple[tuple[int, int], int, str], Mapping] = {}
    done = 0
    cut = False
    rest = b""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        while True:
            want = min(CHUNK, limit - done)
            if want <= 0:
                cut = bool(os.read(fd, 1))
                break
            chunk = os.read(fd, want)
            if not chunk:
                break
            done += len(chunk)
            data = rest + chunk
            last = data.rfind(b"\n")
            rest, data = (data[last + 1:], data[: last + 1]) if last >= 0 else (data, b"")
            if len(rest) > 2 * CHUNK:
                rest = b""  # a line longer than any the kernel writes: not one of ours
            for line in _lines_naming(data):
                m = parse_maps_line(line)
                if m is not None:
                    out.setdefault((m.dev, m.ino, m.path), m)
        for line in _lines_naming(rest):
            m = parse_maps_line(line)
            if m is not None:
                out.setdefault((m.dev, m.ino, m.path), m)
    finally:
        os.close(fd)
    return list(out.values()), done, cut
