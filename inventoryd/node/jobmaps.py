"""What each running Slurm job step on this node has mapped: its ``libnccl`` and NCCL
plugin libraries, read from ``/proc/PID/maps`` (issue 42, docs/runtime.md).

``ncclguard-inventoryd jobmaps``: the one program of ncclguard that holds a capability,
``CAP_SYS_PTRACE``, which the kernel asks of a reader of another user's ``maps`` (and of
its ``/proc/PID/root``). It runs as its own unit (``systemd/ncclguard-jobmaps.service``),
reads ``/proc`` and the mapped library files, and writes what it found to one file
(:data:`DEFAULT_OUT`) that ``ncclguard-inventoryd run`` puts into the node's signed record.
It never writes anywhere else, never signs, never connects.

**Which processes are a job's** (:mod:`inventoryd.node.procfs`). A process belongs to step
``J.S`` when its cgroup is one Slurm made for that step (cgroup v1 ``/slurm[_NODE]/uid_U/
job_J/step_S/...``, cgroup v2 ``/system.slice/[NODE_]slurmstepd.scope/job_J/step_S/...``: paths
only root can create), or, where Slurm keeps no cgroup (``ProctrackType=proctrack/
linuxproc``), when it descends from a process the kernel names ``slurmstepd``, titled
``slurmstepd: [J.S]``, root in all its uids. A user cannot name a process into another job:
the cgroup path is anchored at Slurm's own directory, and the ancestor must be root's.

**Bounded whatever the jobs run.** Per scan at most :data:`MAX_PIDS` processes are looked
at; each process's ``maps`` is read to at most :data:`MAX_MAPS_BYTES` and all of them to
:data:`SCAN_BYTES`, the steps taken in turn from where the last scan stopped (one job of
100,000 mappings holds back no other); at most :data:`LIBS_PER_STEP` libraries are kept per
step and :data:`MAX_STEPS` steps per node; a library file is read (hashed) once per
(device, inode, size, mtime), at most :data:`HASH_BYTES` of new files per scan (the rest
next scan). What is cut says so (``cut``), and is never called different.

**Identity.** A library is identified as the node probe identifies files (size, sha256,
version, ABIs; :mod:`inventoryd.probes.nccl`, :mod:`inventoryd.probes.plugins`, their file
cache), read through ``/proc/PID/root`` so that a container's view is the one read. The
file read must be the one mapped: its device and inode must be the ``maps`` line's, or the
library is recorded without identity (``error``: replaced since it was mapped, deleted,
unreadable). Paths are kept as the kernel wrote them (``\\012`` for a newline), cut at
:data:`ncclguard.fingerprint.loaded.MAX_PATH` characters, and escaped by every view that shows them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inventoryd.loop import Outcome
from inventoryd.node.procfs import (
    Mapping,
    Proc,
    lib_kind,
    proc_stat,
    proc_uid,
    read_maps,
    read_proc,
    root_in_all,
    step_dir_of_cgroup,
    step_of_title,
)
from ncclguard.config import Config, RuntimeConfig
from ncclguard.fingerprint.loaded import (
    LIBS_PER_STEP,
    LOADED_VERSION,
    MAX_STEPS,
    MAX_TEXT,
    loaded_problem,
    step_problem,
)

__all__ = [
    "DEFAULT_OUT", "HASH_BYTES", "MAX_MAPS_BYTES", "MAX_PIDS", "SCAN_BYTES", "JobMaps",
    "Scanner", "main", "read_loaded", "write",
]

log = logging.getLogger("ncclguard.jobmaps")

DEFAULT_OUT = "/run/ncclguard-jobmaps/loaded.json"
MAX_PIDS = 131072  # processes looked at per scan (the kernel's default pid_max is 4 M)
MAX_MAPS_BYTES = 16 << 20  # of one process's maps: 100,000 mappings are about 10 MB
SCAN_BYTES = 256 << 20  # of all maps per scan
HASH_BYTES = 4 << 30  # of library files not yet known, read per scan
MAX_DEPTH = 64  # ancestors followed to a slurmstepd
CHUNK = 1 << 20

@dataclass
class Step:
    job: str
    step: str
    uid: int
    pids: list[int] = field(default_factory=list)
    starts: dict[int, int] = field(default_factory=dict)  # pid -> its start (clock ticks)


class Scanner:
    """One node's scans. ``node``: its name; ``node_from_env``: several slurmd on one
    machine (the dev cluster only): a process is this node's when its environment says
    ``SLURMD_NODENAME=<node>`` (a user's word: never on a real cluster)."""

    def __init__(self, node: str, *, proc: str = "/proc", cache: Any = None,
                 node_from_env: bool = False, hash_bytes: int = HASH_BYTES,
                 scan_bytes: int = SCAN_BYTES, maps_bytes: int = MAX_MAPS_BYTES) -> None:
        self.node = node
        self.proc = Path(proc)
        self.cache = cache
        self.node_from_env = node_from_env
        self.hash_bytes, self.scan_bytes, self.maps_bytes = hash_bytes, scan_bytes, maps_bytes
        self.since: dict[tuple[str, str], float] = {}  # step -> first scan with a libnccl
        self.turn = 0  # where the next scan starts in the list of steps
        #: (pid, start) -> the mappings of a process whose NCCL opened its net plugin
        self.settled: dict[tuple[int, int], list[Mapping]] = {}
        self.stats = {"procs": 0, "maps_bytes": 0, "hashed_bytes": 0}

    # ---- which processes are whose

    def _mine(self, pid: int) -> bool:
        if not self.node_from_env:
            return True
        try:
            env = read_proc(self.proc / str(pid) / "environ", 1 << 20)
        except OSError:
            return False
        return f"SLURMD_NODENAME={self.node}".encode() in env.split(b"\0")

    def steps(self) -> dict[tuple[str, str], Step]:
        procs: dict[int, Proc] = {}
        titles: dict[int, tuple[str, str]] = {}
        dirs: dict[int, tuple[str, str | None, str]] = {}  # pid -> its step's cgroup
        with os.scandir(self.proc) as it:
            for n, entry in enumerate(it):
                if n >= MAX_PIDS:
                    break
                if not entry.name.isdigit():
                    continue
                p = proc_stat(int(entry.name), self.proc)
                if p is None:
                    continue
                procs[p.pid] = p
                try:
                    cg = read_proc(f"{self.proc}/{entry.name}/cgroup", 1 << 16).decode(
                        "utf-8", "replace")
                except OSError:
                    cg = ""
                got = step_dir_of_cgroup(cg, None if self.node_from_env else self.node)
                if got is not None:
                    dirs[p.pid] = got
                # a step's slurmstepd: the kernel names it so (its title is in argv), and
                # it is root in all its uids (Slurm's find_ancestor() reads the same title)
                if p.comm == b"slurmstepd":
                    with contextlib.suppress(OSError):
                        t = step_of_title(read_proc(self.proc / entry.name / "cmdline", 64))
                        if t is not None and root_in_all(p.pid, self.proc):
                            titles[p.pid] = t
        # a step directory named by a SLUID: its job is the one its slurmstepd's title says
        named = {dirs[pid][0]: t for pid, t in titles.items() if pid in dirs}
        by_cgroup: dict[int, tuple[str, str]] = {}
        for pid, (where, job, step) in dirs.items():
            if job is not None:
                by_cgroup[pid] = (job, step)
            elif where in named:
                by_cgroup[pid] = (named[where][0], step)
        self.stats["procs"] = len(procs)
        memo: dict[int, tuple[str, str] | None] = {}

        def ancestry(pid: int) -> tuple[str, str] | None:
            chain = []
            cur: int | None = pid
            found = None
            for _ in range(MAX_DEPTH):
                if cur is None or cur in memo:
                    found = memo.get(cur) if cur is not None else None
                    break
                chain.append(cur)
                p = procs.get(cur)
                if p is None or p.ppid in (0, cur):
                    break
                cur = p.ppid
                if cur in titles:
                    found = titles[cur]
                    break
            for c in chain:
                memo[c] = found
            return found

        out: dict[tuple[str, str], Step] = {}
        for pid, p in procs.items():
            if pid in titles:
                continue  # the slurmstepd itself
            key = by_cgroup.get(pid) or (ancestry(pid) if titles else None)
            if key is None or not self._mine(pid):
                continue
            uid = proc_uid(pid, self.proc)
            if uid is None:
                continue  # gone
            s = out.get(key)
            if s is None:
                s = out[key] = Step(key[0], key[1], uid)
            s.pids.append(pid)
            s.starts[pid] = p.start
        return out

    # ---- one scan

    def _identify(self, pid: int, m: Mapping, budget: list[int]) -> dict[str, Any]:
        """One mapped library's record (:mod:`ncclguard.fingerprint.loaded`); its texts
        (an error naming a path, a name from an ELF string) cut to fit the shape."""
        rec = self._facts(pid, m, budget)
        for k in ("name", "error"):
            if isinstance(rec[k], str) and len(rec[k]) > MAX_TEXT:
                rec[k] = rec[k][: MAX_TEXT - 1] + "…"
            elif rec[k] is not None and not isinstance(rec[k], str):
                rec[k] = None
        return rec

    def _facts(self, pid: int, m: Mapping, budget: list[int]) -> dict[str, Any]:
        kind = lib_kind(m.path) or "?"
        rec: dict[str, Any] = {"kind": kind, "path": m.path,
                               "dev": f"{m.dev[0]:x}:{m.dev[1]:x}", "ino": m.ino,
                               "size": None, "sha256": None, "version": None, "abis": [],
                               "name": None, "error": None}
        if kind == "ibverbs":
            return rec
        if m.deleted:
            rec["error"] = "deleted since it was mapped"
            return rec
        from inventoryd.nodefs import NodeFS
        from inventoryd.probes import nccl, plugins
        from inventoryd.probes.linker import open_regular

        fs = NodeFS(self.proc / str(pid) / "root")
        try:
            f, st, _ = open_regular(fs, m.path)
        except FileNotFoundError as e:
            # the kernel writes a newline in a path as \012 (and a backslash as itself):
            # the path with newlines is tried too; the device and inode say which it was
            try:
                if "\\012" not in m.path:
                    raise
                f, st, _ = open_regular(fs, m.path.replace("\\012", "\n"))
            except (OSError, ValueError):
                rec["error"] = f"cannot read: {e.strerror or e}"
                return rec
        except (OSError, ValueError) as e:
            rec["error"] = f"cannot read: {getattr(e, 'strerror', None) or e}"
            return rec
        with f:
            if (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) != (*m.dev, m.ino):
                rec["error"] = "replaced since it was mapped"
                return rec
            analyze = nccl.analyze if kind == "nccl" else plugins.analyze
            ckind = nccl.KIND if kind == "nccl" else plugins.KIND
            facts = self.cache.get(ckind, m.path, st) if self.cache is not None else None
            if facts is None:
                if st.st_size > budget[0]:
                    rec["error"] = "not read yet (this scan's reading budget is spent)"
                    return rec
                budget[0] -= st.st_size
                self.stats["hashed_bytes"] += st.st_size
                facts = analyze(f, m.path)
                if self.cache is not None:
                    self.cache.put(ckind, m.path, st, facts)
        rec["size"], rec["sha256"] = facts.get("size"), facts.get("sha256")
        if kind == "nccl":
            rec["version"] = facts.get("version")
            rec["error"] = facts.get("version_error")
            abis = facts.get("abis") or {}
            rec["abis"] = sorted({int(a) for a in abis.get("net") or []
                                  if isinstance(a, int)})[:16]
        else:
            abis = facts.get("abis") or {}
            rec["abis"] = [int(a) for a in abis.get(kind) or [] if isinstance(a, int)][:16]
            rec["name"] = (facts.get("names") or {}).get(kind)
            rec["error"] = facts.get("error")
            if not rec["abis"] and not rec["error"]:  # a file with the name only
                rec["error"] = f"exports no NCCL {kind} plugin symbol"
        return rec

    def scan(self, now: float | None = None) -> dict[str, Any]:
        """One scan: the document :mod:`inventoryd.node.daemon` publishes."""
        now = time.time() if now is None else now
        steps = self.steps()
        order = sorted(steps)
        if order:
            k = self.turn % len(order)
            order = order[k:] + order[:k]
            self.turn = k + 1
        left = self.scan_bytes
        budget = [self.hash_bytes]
        files: dict[tuple[tuple[int, int], int, str], dict[str, Any]] = {}
        out: list[dict[str, Any]] = []
        complete = len(steps) <= MAX_STEPS
        self.stats["maps_bytes"] = 0
        seen: set[tuple[int, int]] = set()
        for key in order[:MAX_STEPS]:
            s = steps[key]
            found: dict[tuple[tuple[int, int], int, str], tuple[int, Mapping]] = {}
            cut = False
            for pid in s.pids:
                if left <= 0:
                    cut = True
                    break
                known = (pid, s.starts.get(pid, -1))
                seen.add(known)
                maps = self.settled.get(known)
                if maps is None:
                    try:
                        maps, used, over = read_maps(f"{self.proc}/{pid}/maps",
                                                     min(self.maps_bytes, left))
                    except OSError:
                        continue  # gone, or not ours to read
                    left -= used
                    self.stats["maps_bytes"] += used
                    again = proc_stat(pid, self.proc)
                    if again is None or again.start != known[1]:
                        continue  # the pid ended and was reused since: another's maps
                    cut |= over
                    # NCCL opened its net plugin: it opens nothing more that is judged,
                    # and unloads nothing while it runs; this process's maps are not read
                    # again (it is dropped when it ends: its pid and start)
                    if not over and {lib_kind(m.path) for m in maps} >= {"nccl", "net"}:
                        self.settled[known] = maps
                for m in maps:
                    found.setdefault((m.dev, m.ino, m.path), (pid, m))
            libs: list[dict[str, Any]] = []
            for k2, (pid, m) in sorted(found.items(), key=lambda kv: kv[1][1].path):
                if len(libs) >= LIBS_PER_STEP:
                    cut = True
                    break
                rec = files.get(k2)
                if rec is None or (rec.get("error") or "").startswith("not read yet"):
                    rec = files[k2] = self._identify(pid, m, budget)
                libs.append(rec)
            if not libs:
                continue  # a step that loaded no NCCL is not listed
            if any(lib["kind"] == "nccl" for lib in libs):
                self.since.setdefault(key, now)
            out.append({"job": s.job, "step": s.step, "uid": s.uid, "procs": len(s.pids),
                        "since": self.since.get(key), "libs": libs, "cut": cut})
        for gone in set(self.since) - set(steps):
            del self.since[gone]
        if len(order) <= MAX_STEPS:  # every step looked at: the processes not seen ended
            for ended in set(self.settled) - seen:
                del self.settled[ended]
        out.sort(key=lambda d: (int(d["job"]), d["step"]))
        if self.cache is not None:
            self.cache.save()
        return {"ncclguard_loaded": LOADED_VERSION, "host": self.node, "scanned_at": now,
                "complete": complete and left > 0, "steps": out}


def write(doc: dict[str, Any], out: Path) -> None:
    """Write ``doc`` to ``out`` atomically, mode 0644 (the node daemon reads it)."""
    why = loaded_problem(doc)
    if why:
        raise ValueError(f"not written: {why}")
    from ncclguard.spool import atomic_write

    atomic_write(out, json.dumps(doc, sort_keys=True, separators=(",", ":")).encode(), 0o644)


class JobMaps:
    """The ``ncclguard-jobmaps`` service (:class:`inventoryd.loop.Service`): one scan per
    step, written to ``out``."""

    what = "scan"

    def __init__(self, node: str, out: str, cfg: RuntimeConfig,
                 scanner: Scanner | None = None) -> None:
        from inventoryd.filecache import FileCache

        self.node, self.out, self.cfg = node, Path(out), cfg
        self.scanner = scanner or Scanner(
            node, cache=FileCache(self.out.with_name("filecache.json")),
            node_from_env=cfg.node_from_env)

    @property
    def label(self) -> str:
        return f"{self.node}: jobmaps:"

    def started(self) -> str:
        return f"writing {self.out} every {self.cfg.scan_interval_s:g} s"

    def step(self, should_stop: Callable[[], bool] = lambda: False) -> Outcome:
        doc = _fit(self.scanner.scan())
        write(doc, self.out)
        n = len(doc["steps"])
        return Outcome(ok=True, status=f"{n} step{'s' if n != 1 else ''} with NCCL loaded")

    def delay(self, ok: bool) -> float:
        return self.cfg.scan_interval_s

    def reloaded(self, config: Config) -> JobMaps:
        return JobMaps(self.node, str(self.out), config.runtime, self.scanner)

    def close(self, *, replaced: bool = False) -> None:
        pass


def main(hostname: str | None, out: str, cfg: RuntimeConfig, *, once: bool = False,
         config_path: str | None = None) -> int:
    """``ncclguard-inventoryd jobmaps``: scan until SIGTERM (``once``: one scan)."""
    from inventoryd.loop import log_to_stderr, serve

    log_to_stderr(log)
    node = hostname or socket.gethostname().split(".")[0]
    service = JobMaps(node, out, cfg)
    if once:
        try:
            service.step()
        except (OSError, ValueError) as e:
            log.error("%s %s", service.label, e)
            return 1
        return 0
    return serve(service, log, config_path=config_path)


def _fit(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` of the shape and within the quota of
    :func:`ncclguard.fingerprint.loaded.loaded_problem`: a step that does not fit the shape
    left out (never the whole document), then the last steps, ``complete`` false, until it
    fits."""
    steps = [s for s in doc["steps"] if step_problem(s) is None]
    if len(steps) < len(doc["steps"]):
        log.error("%s: %d step(s) left out of the document: not of its shape",
                  doc.get("host"), len(doc["steps"]) - len(steps))
        doc = {**doc, "steps": steps, "complete": False}
    while loaded_problem(doc) is not None and doc["steps"]:
        doc = {**doc, "steps": doc["steps"][: len(doc["steps"]) * 3 // 4], "complete": False}
    return doc


def read_loaded(path: str, host: str, max_age_s: float, now: float | None = None
                ) -> tuple[dict[str, Any] | None, str | None]:
    """The document at ``path`` for the node's record: ``(doc, None)``, or ``(None, why
    not)`` (no file: not watched; a file others can write, too large, not of this
    host's shape, or older than ``max_age_s``: the scanner has stopped)."""
    from ncclguard.fingerprint.loaded import MAX_LOADED_BYTES

    now = time.time() if now is None else now
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"{p}: cannot open: {e.strerror or e}"
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o022 or st.st_uid not in (
                0, os.geteuid()):
            return None, (f"{p}: not a regular file of this service's user or root that "
                          "no one else can write: not trusted")
        data = f.read(MAX_LOADED_BYTES + 1)
    if len(data) > MAX_LOADED_BYTES:
        return None, f"{p}: over {MAX_LOADED_BYTES} bytes"
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        return None, f"{p}: not JSON: {str(e)[:100]}"
    why = loaded_problem(doc, host)
    if why:
        return None, f"{p}: {why}"
    if now - float(doc["scanned_at"]) > max_age_s:
        return None, f"{p}: written {now - float(doc['scanned_at']):.0f} s ago (the scanner " \
            "has stopped?)"
    return doc, None
