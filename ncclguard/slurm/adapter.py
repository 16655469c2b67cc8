"""The one place ncclguard talks to Slurm: the prolog gate, its steering and the CLI.

Queries use ``sinfo --json`` / ``squeue --json`` (Slurm 21.08+), updates use ``scontrol``.
Every call is an argument list (never a shell) with a timeout, run with a clean
environment: only ``PATH``, ``LANG`` and ``SLURM_CONF``, so that a job's ``SQUEUE_FORMAT``
or ``SLURM_TIME_FORMAT`` cannot change what we parse. A future pyslurm backend replaces
this class and nothing else.

An optional ``deadline`` (a ``time.monotonic()`` value) caps every call's timeout, so a
caller with a hard budget (the prolog) can never overrun it in here.

This module is imported by the prolog only on paths that call Slurm: standard library only.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_BIN_DIRS = ("/usr/bin", "/usr/local/bin", "/opt/slurm/bin")
_MAX_TEXT = 1000  # longest AdminComment / notify text we send


class SlurmError(Exception):
    """A Slurm command failed. ``argv``, ``returncode`` and ``stderr`` say how."""

    def __init__(
        self,
        message: str,
        argv: Sequence[str] = (),
        returncode: int | None = None,
        stderr: str = "",
    ) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(message)


class SlurmTimeout(SlurmError):
    """A Slurm command ran past its timeout (or the caller's deadline) and was killed."""


class SlurmNotFound(SlurmError):
    """The Slurm command is not installed where we looked."""


@dataclass(frozen=True)
class NodeInfo:
    name: str
    state: str  # "idle", "allocated", "mixed", "down", ...
    flags: tuple[str, ...] = ()  # "DRAIN", "NOT_RESPONDING", ...
    reason: str = ""
    partitions: tuple[str, ...] = ()
    features: tuple[str, ...] = ()
    cpus: int = 0

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.flags or self.state.startswith("drain")


@dataclass(frozen=True)
class JobInfo:
    job_id: int
    state: str  # "PENDING", "RUNNING", "COMPLETED", ...
    user: str = ""
    user_id: int | None = None  # the job's uid (squeue --json "user_id")
    partition: str = ""
    nodes: str = ""  # allocated hostlist ("" while pending)
    node_count: int = 0
    required_nodes: str = ""  # -w / --nodelist
    excluded_nodes: str = ""  # -x / --exclude
    state_reason: str = ""
    restart_count: int = 0
    batch: bool = False
    admin_comment: str = ""
    comment: str = ""
    priority: int = 0
    name: str = ""
    start_time: float | None = None  # epoch seconds; None while pending (Slurm says 0)
    end_time: float | None = None  # epoch; running: the expected end (start + time limit)
    work_dir: str = ""
    batch_host: str = ""  # the node that runs the batch script ("" while pending)
    array_job_id: int = 0  # 0: not an array job
    array_task_id: int | None = None
    std_out: str = ""  # the StdOut file (output_path: %j etc. expanded, %N left)
    std_err: str = ""  # the StdErr file, the same way (StdOut's file when not given)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


def clean_text(text: str, limit: int = _MAX_TEXT) -> str:
    """One line of printable text, at most ``limit`` characters (for AdminComment/notify)."""
    line = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _node_list(nodes: str | Iterable[str]) -> str:
    text = nodes if isinstance(nodes, str) else ",".join(nodes)
    if not text or any(c.isspace() for c in text) or text.startswith("-"):
        raise SlurmError(f"not a node list: {text!r}")
    return text


def _job_id(job_id: int | str) -> str:
    s = str(job_id)
    if not s.isdigit():
        raise SlurmError(f"not a job id: {job_id!r}")
    return s


class Slurm:
    """Slurm through its commands. ``bin_dir``: where they live (default: PATH, then /usr/bin)."""

    def __init__(
        self,
        bin_dir: str | os.PathLike[str] | None = None,
        *,
        conf: str | None = None,
        timeout: float = 10.0,
        deadline: float | None = None,
    ) -> None:
        self.bin_dir = Path(bin_dir) if bin_dir else None
        self.conf = conf if conf is not None else os.environ.get("SLURM_CONF")
        self.timeout = timeout
        self.deadline = deadline

    @classmethod
    def from_config(
        cls, gate: Any, *, timeout: float = 10.0, deadline: float | None = None
    ) -> Slurm:
        """From a :class:`ncclguard.config.GateConfig` (``slurm_bin_dir``, ``slurm_conf``)."""
        return cls(
            getattr(gate, "slurm_bin_dir", "") or None,
            conf=getattr(gate, "slurm_conf", "") or None,
            timeout=timeout,
            deadline=deadline,
        )

    # ------------------------------------------------------------------ plumbing
    def program(self, name: str) -> str:
        dirs: list[str] = []
        if self.bin_dir is not None:
            dirs = [str(self.bin_dir)]
        else:
            dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d]
            dirs += [d for d in DEFAULT_BIN_DIRS if d not in dirs]
        for d in dirs:
            p = os.path.join(d, name)
            if os.access(p, os.X_OK) and not os.path.isdir(p):
                return p
        raise SlurmNotFound(f"{name}: not found in {os.pathsep.join(dirs)}", [name])

    def env(self) -> dict[str, str]:
        bin_dir = str(self.bin_dir) if self.bin_dir else "/usr/bin"
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "LANG": "C", "LC_ALL": "C"}
        if self.conf:
            env["SLURM_CONF"] = self.conf
        return env

    def run(self, name: str, args: Sequence[str], *, timeout: float | None = None) -> str:
        """Run one Slurm command; its stdout, or :class:`SlurmError`."""
        argv = [self.program(name), *args]
        limit = self.timeout if timeout is None else timeout
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0.05:
                raise SlurmTimeout(f"{name}: no time left before the deadline", argv)
            limit = min(limit, left)
        try:
            r = subprocess.run(
                argv,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=limit,
                close_fds=True,
            )
        except subprocess.TimeoutExpired:
            raise SlurmTimeout(f"{' '.join(argv)}: timed out after {limit:.1f}s", argv) from None
        except OSError as e:
            raise SlurmError(f"{argv[0]}: cannot run: {e.strerror or e}", argv) from None
        if r.returncode != 0:
            err = r.stderr.strip() or r.stdout.strip()
            raise SlurmError(
                f"{' '.join(argv[:3])}: exit {r.returncode}: {err[:500]}", argv, r.returncode, err
            )
        return r.stdout

    def _json(self, name: str, args: Sequence[str]) -> dict[str, Any]:
        out = self.run(name, [*args, "--json"])
        try:
            data = json.loads(out)
        except ValueError as e:
            raise SlurmError(f"{name} --json: not JSON ({e}): {out[:200]!r}", [name]) from None
        if not isinstance(data, dict):
            raise SlurmError(f"{name} --json: expected an object, got {type(data).__name__}")
        errors = [e for e in data.get("errors") or [] if e]
        if errors:
            raise SlurmError(f"{name} --json: {errors}", [name])
        return data

    # ------------------------------------------------------------------- queries
    def nodes(self, nodes: str | Iterable[str] | None = None) -> list[NodeInfo]:
        """Nodes with state, flags, reason and partitions (``sinfo --json``)."""
        wanted: set[str] | None = None
        if nodes is not None:  # sinfo --json ignores -n (22.05): filter here
            from ncclguard.hostlist import expand

            wanted = set(expand(_node_list(nodes)))
        data = self._json("sinfo", [])
        out = []
        for n in data.get("nodes") or []:
            if wanted is not None and n.get("name") not in wanted:
                continue
            state = str(n.get("state") or "").lower()
            out.append(
                NodeInfo(
                    name=str(n.get("name") or n.get("hostname") or ""),
                    state=state,
                    flags=tuple(str(f) for f in n.get("state_flags") or ()),
                    reason=str(n.get("reason") or ""),
                    partitions=tuple(str(p) for p in n.get("partitions") or ()),
                    features=tuple(f for f in str(n.get("features") or "").split(",") if f),
                    cpus=int(n.get("cpus") or 0),
                )
            )
        return out

    def partition_nodes(self, partition: str) -> list[str]:
        """The names of the nodes in ``partition`` (any state)."""
        return [n.name for n in self.nodes() if partition in n.partitions]

    def job(self, job_id: int | str) -> JobInfo | None:
        """One job (``squeue --json``), or None when Slurm no longer knows it.

        22.05: ``squeue --json`` ignores ``-j`` (we pick the job out), and lists finished
        jobs until ``MinJobAge`` after their end, as ``scontrol show job`` does; its times
        are epoch seconds, where ``scontrol`` prints local time without a zone.
        """
        try:
            data = self._json("squeue", ["-j", _job_id(job_id)])
        except SlurmError as e:
            if "Invalid job id" in str(e) or "Invalid job id" in e.stderr:
                return None
            raise
        for j in data.get("jobs") or []:
            if str(j.get("job_id")) == str(job_id):
                return _job_info(j)
        return None

    def job_state(self, job_id: int | str) -> str | None:
        """The job's state (``squeue -h -o %T``, the cheapest query), None if unknown."""
        try:
            out = self.run("squeue", ["-h", "-j", _job_id(job_id), "-o", "%T"])
        except SlurmError as e:
            if "Invalid job id" in e.stderr:
                return None
            raise
        return out.strip() or None

    def hostnames(self, hostlist: str) -> list[str]:
        """``scontrol show hostnames`` (the reference; the gate expands in-process)."""
        return self.run("scontrol", ["show", "hostnames", hostlist]).split()

    # ------------------------------------------------------------------- updates
    def update_job(self, job_id: int | str, **fields: str) -> None:
        """``scontrol update jobid=J Key=Value ...`` (keys as Slurm spells them)."""
        if not fields:
            return
        args = ["update", f"jobid={_job_id(job_id)}"]
        for key, value in fields.items():
            if not key.isalnum():
                raise SlurmError(f"not a job field: {key!r}")
            args.append(f"{key}={value}")
        self.run("scontrol", args)

    def set_admin_comment(self, job_id: int | str, text: str) -> None:
        self.update_job(job_id, AdminComment=clean_text(text))

    def notify(self, job_id: int | str, text: str) -> None:
        """``scontrol notify``: reaches the terminal of salloc/srun."""
        self.run("scontrol", ["notify", _job_id(job_id), clean_text(text)])

    def hold(self, job_id: int | str) -> None:
        self.run("scontrol", ["hold", _job_id(job_id)])

    def release(self, job_id: int | str) -> None:
        self.run("scontrol", ["release", _job_id(job_id)])

    def requeue_hold(self, job_id: int | str) -> None:
        self.run("scontrol", ["requeuehold", _job_id(job_id)])

    def drain(self, nodes: str | Iterable[str], reason: str) -> None:
        """Drain nodes with a reason (ncclguard reasons start with ``ncclguard:``)."""
        self.run(
            "scontrol",
            [
                "update",
                f"NodeName={_node_list(nodes)}",
                "State=DRAIN",
                f"Reason={clean_text(reason, 250)}",
            ],
        )

    def resume(self, nodes: str | Iterable[str]) -> None:
        self.run("scontrol", ["update", f"NodeName={_node_list(nodes)}", "State=RESUME"])


def _text(v: Any) -> str:
    return "" if v is None else str(v)


def _int(v: Any) -> int:
    if isinstance(v, dict):  # v0.0.39+: {"set": true, "number": 5}
        v = v.get("number")
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def _epoch(v: Any) -> float | None:
    if isinstance(v, dict):  # v0.0.39+: {"set": true, "number": 5}
        if v.get("set") is False:
            return None
        v = v.get("number")
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f > 0 else None


def output_path(
    pattern: str,
    *,
    job_id: int,
    name: str = "",
    user: str = "",
    array_job_id: int = 0,
    array_task_id: int | None = None,
    work_dir: str = "",
    batch: bool = True,
) -> str:
    """The file a batch job writes for the ``--output``/``--error`` ``pattern``.

    ``pattern`` "" is Slurm's default, ``slurm-%j.out`` (``slurm-%A_%a.out`` for an array
    task) in the working directory; interactive jobs have none. A relative pattern is
    taken from ``work_dir``. ``%A %a %j %J %u %x`` are expanded, with a width
    (``%5j``: zero-padded) and ``%%`` as ``%``, as the node does when it opens the file
    (``scontrol show job`` on 22.05 expands the same letters but leaves widths and ``%%``
    as written). ``%N`` (and the step-level ``%n %s %t``) stay: only the node knows them,
    and ``%N`` there is its short host name, not always the node name.
    """
    in_array = array_task_id is not None and array_job_id > 0
    if not pattern:
        if not batch:
            return ""
        pattern = "slurm-%A_%a.out" if in_array else "slurm-%j.out"
    subs = {
        "A": str(array_job_id if in_array else job_id),
        "a": str(array_task_id if in_array else 4294967294),  # NO_VAL, as Slurm prints it
        "j": str(job_id),
        "J": str(job_id),
        "u": user,
        "x": name,
    }
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "%" and i + 1 < len(pattern):
            if pattern[i + 1] == "%":
                out.append("%")
                i += 2
                continue
            j = i + 1
            while j < len(pattern) and pattern[j].isdigit():
                j += 1
            key = pattern[j] if j < len(pattern) else ""
            if key in subs:
                width = min(int(pattern[i + 1 : j] or 0), 10)
                val = subs[key]
                out.append(val.zfill(width) if key in "AajJ" and width else val)
                i = j + 1
                continue
        out.append(c)
        i += 1
    path = "".join(out)
    if work_dir and not path.startswith("/"):
        path = os.path.join(work_dir, path)
    return path


def _job_info(j: dict[str, Any]) -> JobInfo:
    state = j.get("job_state")
    if isinstance(state, list):  # v0.0.39+
        state = state[0] if state else ""
    task = j.get("array_task_id")
    if isinstance(task, dict):  # v0.0.39+
        task = task.get("number") if task.get("set") else None
    array_task = None if task is None or _int(task) >= 4294967294 else _int(task)
    # the fields output_path() needs are JobInfo fields too: read them once
    where: dict[str, Any] = {
        "job_id": _int(j.get("job_id")),
        "name": _text(j.get("name")),
        "user": _text(j.get("user_name")),
        "array_job_id": _int(j.get("array_job_id")),
        "array_task_id": array_task,
        "work_dir": _text(j.get("current_working_directory")),
        "batch": bool(j.get("batch_flag")),
    }
    return JobInfo(
        **where,
        state=_text(state).upper(),
        user_id=_int(j["user_id"]) if isinstance(j.get("user_id"), int) else None,
        partition=_text(j.get("partition")),
        nodes=_text(j.get("nodes")),
        node_count=_int(j.get("node_count")),
        required_nodes=_text(j.get("required_nodes")),
        excluded_nodes=_text(j.get("excluded_nodes")),
        state_reason=_text(j.get("state_reason")),
        restart_count=_int(j.get("restart_cnt")),
        admin_comment=_text(
            j.get("admin_comment") or (j.get("comment") or {}).get("administrator")
            if isinstance(j.get("comment"), dict)
            else j.get("admin_comment")
        ),
        comment=_text(
            (j.get("comment") or {}).get("job")
            if isinstance(j.get("comment"), dict)
            else j.get("comment")
        ),
        priority=_int(j.get("priority")),
        start_time=_epoch(j.get("start_time")),
        end_time=_epoch(j.get("end_time")),
        batch_host=_text(j.get("batch_host")),
        std_out=output_path(_text(j.get("standard_output")), **where),
        # no --error: the same file as StdOut
        std_err=output_path(
            _text(j.get("standard_error")) or _text(j.get("standard_output")), **where
        ),
        raw=j,
    )
