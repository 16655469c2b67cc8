"""The one place ncclguard talks to Slurm: the prolog gate, its steering and the CLI.

Every call is an argument list (never a shell) with a timeout, run with a clean
environment: only ``PATH``, ``LANG`` and ``SLURM_CONF``, so that a job's ``SQUEUE_FORMAT``
or ``SLURM_TIME_FORMAT`` cannot change what we parse. A future pyslurm backend replaces
this class and nothing else.

Slurm 22.05 to 25.11 (docs/slurm-versions.md). The release, from ``scontrol --version``
(asked once, and only by the calls that choose a command by it), picks the best query:
``sinfo --json`` on 22.05 and ``scontrol show nodes --json`` from 23.02 for nodes,
``squeue --json -j J -t all`` for a job, and from 23.11 the data parser too
(``--json=v0.0.42`` on 24.11; ``v0.0.44`` past 25.11).
Answers are read by their own ``meta`` block (:mod:`ncclguard.slurm.schema`), never by
the release we expected.

An optional ``deadline`` (a ``time.monotonic()`` value) caps every call's timeout, so a
caller with a hard budget (the prolog) can never overrun it in here.

This module is imported by the prolog only on paths that call Slurm: standard library only.

Over 500 lines: the one module that runs a Slurm command (docs/development.md): every
call, its arguments, its time limit and its reading live together, so that no other
module runs one.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ncclguard.slurm.model import (
    JobInfo,
    NodeInfo,
    Release,
    SlurmError,
    SlurmNotFound,
    SlurmSchemaError,
    SlurmTimeout,
    clean_text,
)
from ncclguard.slurm.schema import parse_jobs, parse_nodes, parser_for

DEFAULT_BIN_DIRS = ("/usr/bin", "/usr/local/bin", "/opt/slurm/bin")
SCONTROL_JSON_FROM = Release(23, 2)  # scontrol --json (22.05: "unrecognized option")
_RELEASES: dict[tuple[str, str], Release] = {}  # (scontrol, slurm.conf) -> its release


def _node_list(nodes: str | Iterable[str]) -> str:
    text = nodes if isinstance(nodes, str) else ",".join(nodes)
    if not text or any(c.isspace() for c in text) or text.startswith("-"):
        raise SlurmError(f"not a node list: {text!r}")
    return text


#: The longest hostlist put in one argument, in bytes. Linux refuses to run a command with
#: an argument over 128 KiB (``MAX_ARG_STRLEN``: "Argument list too long"); a node update
#: naming more is compressed and split (:func:`ncclguard.hostlist.compress_within`), one
#: ``scontrol update`` per part.
HOSTLIST_ARG_MAX = 64 * 1024


def _node_lists(nodes: str | Iterable[str]) -> list[str]:
    """``nodes`` as compressed hostlists (``gpu[00001-16384]``, as Slurm reads them), each
    at most :data:`HOSTLIST_ARG_MAX` bytes: one, unless the names do not compress."""
    from ncclguard.hostlist import HostlistError, compress_within, expand

    try:
        if isinstance(nodes, str):
            text = _node_list(nodes)
            if len(text.encode()) <= HOSTLIST_ARG_MAX:
                return [text]
            names = expand(text)
        else:
            names = list(nodes)
        if not names or any(not n or n.startswith("-") or any(c.isspace() for c in n)
                            for n in names):
            raise SlurmError(f"not a node list: {','.join(names)[:200]!r}")
        return compress_within(names, HOSTLIST_ARG_MAX)
    except HostlistError as e:
        raise SlurmError(f"not a node list: {e}") from None


def _job_id(job_id: int | str) -> str:
    s = str(job_id)
    if not s.isdigit():
        raise SlurmError(f"not a job id: {job_id!r}")
    return s


def _unknown_job(e: SlurmError) -> bool:
    """Whether squeue said it does not know the job (not a time-out or another failure)."""
    return type(e) is SlurmError and "Invalid job id" in f"{e} {e.stderr}"


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
        self._version: Release | None = None

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

    def _limit(self, name: str, argv: Sequence[str], timeout: float | None) -> float:
        limit = self.timeout if timeout is None else timeout
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0.05:
                raise SlurmTimeout(f"{name}: no time left before the deadline", argv)
            limit = min(limit, left)
        return limit

    def run(self, name: str, args: Sequence[str], *, timeout: float | None = None) -> str:
        """Run one Slurm command; its stdout, or :class:`SlurmError`.

        Messages name the command by its name, not its path, and quote what Slurm said
        without the ``/usr/bin/scontrol: `` prefix that 24.11 adds, so that they read the
        same on every release."""
        return self.run_all([(name, args)], timeout=timeout)[0]

    def run_all(self, calls: Sequence[tuple[str, Sequence[str]]], *,
                timeout: float | None = None) -> list[str]:
        """Run Slurm commands at the same time, under one limit (the timeout, capped by
        the deadline); their stdouts in order, or the first :class:`SlurmError` (the
        others are then killed). Two narrow reads that each wait for slurmctld's locks
        (a backfill cycle holds them up to ``bf_yield_interval``, 2 s) wait once."""
        procs: list[tuple[str, list[str], subprocess.Popen[str]]] = []
        try:
            limit = 0.0
            for name, args in calls:
                argv = [self.program(name), *args]
                limit = self._limit(name, argv, timeout)
                try:
                    p = subprocess.Popen(
                        argv, env=self.env(), stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        errors="replace", close_fds=True,
                    )
                except OSError as e:
                    raise SlurmError(f"{name}: cannot run {argv[0]}: {e.strerror or e}",
                                     argv) from None
                procs.append((name, argv, p))
            end = time.monotonic() + limit
            outs = []
            for name, argv, p in procs:
                shown = " ".join([name, *argv[1:3]])
                try:
                    out, err = p.communicate(timeout=max(end - time.monotonic(), 0.001))
                except subprocess.TimeoutExpired:
                    raise SlurmTimeout(f"{shown}: timed out after {limit:.1f}s", argv) from None
                if p.returncode != 0:
                    text = _without_program(err.strip() or out.strip(), argv[0], name)
                    raise SlurmError(f"{shown}: exit {p.returncode}: {text[:500]}", argv,
                                     p.returncode, text)
                outs.append(out)
            return outs
        finally:
            for _, _, p in procs:  # as subprocess.run does on a timeout: kill and reap (a
                if p.poll() is None:  # child it left holding the pipes is not waited for)
                    p.kill()
                p.wait()
                for f in (p.stdout, p.stderr):
                    if f is not None:
                        f.close()

    def ping(self) -> bool:
        """Whether the controller answers (``scontrol ping``: ``is UP``); False when it
        does not, within this call's timeout."""
        try:
            return " is UP" in self.run("scontrol", ["ping"])
        except SlurmError:
            return False

    def version(self) -> Release:
        """The release of the Slurm commands (``scontrol --version``), asked once per
        process for each scontrol and slurm.conf (the gate makes several ``Slurm``)."""
        if self._version is None:
            key = (self.program("scontrol"), self.conf or "")
            if key not in _RELEASES:
                _RELEASES[key] = Release.parse(self.run("scontrol", ["--version"]))
            self._version = _RELEASES[key]
        return self._version

    def _json_args(self) -> list[str]:
        """``--json=<parser>`` where the release can select one (23.11+: its own newest,
        v0.0.44 past 25.11), else ``--json``."""
        parser = parser_for(self.version())
        return [f"--json={parser}"] if parser else ["--json"]

    def _json(self, name: str, args: Sequence[str], json_args: Sequence[str]) -> dict[str, Any]:
        out = self.run(name, [*args, *json_args])
        what = " ".join([name, *args])
        try:
            data = json.loads(out)
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
            raise SlurmSchemaError(f"{what} --json: not JSON ({e}): {out[:200]!r}") from None
        if not isinstance(data, dict):
            raise SlurmSchemaError(f"{what} --json: expected an object, got {type(data).__name__}")
        errors = data.get("errors") or []
        if not isinstance(errors, list):
            raise SlurmSchemaError(f"{what} --json: 'errors' is {type(errors).__name__}")
        errors = [e for e in errors if e]
        if errors:
            raise SlurmError(f"{what} --json: {_error_texts(errors)}", [name])
        return data

    # ------------------------------------------------------------------- queries
    def nodes(self, nodes: str | Iterable[str] | None = None) -> list[NodeInfo]:
        """Nodes with state, flags, reason, partitions and features: ``sinfo --json`` on
        22.05, ``scontrol show nodes --json`` from 23.02 (one record per node there;
        23.02+'s ``sinfo --json`` groups nodes)."""
        wanted: set[str] | None = None
        if nodes is not None:  # 22.05's sinfo --json ignores -n: filter here, the same way
            from ncclguard.hostlist import expand

            wanted = set(expand(_node_list(nodes)))
        if self.version() >= SCONTROL_JSON_FROM:
            data = self._json("scontrol", ["show", "nodes"], self._json_args())
            found = parse_nodes(data, "scontrol show nodes --json")
        else:
            found = parse_nodes(self._json("sinfo", [], ["--json"]), "sinfo --json")
        return [n for n in found if wanted is None or n.name in wanted]

    def partitions(self) -> dict[str, str]:
        """Every partition (hidden ones too) and its nodes as Slurm's compressed hostlist
        (``gpu[00001-16384]``; "" for none): ``scontrol -a -o show partition``, the same
        text on every release. Its size grows with the partitions, not with the nodes:
        a few hundred bytes at 16,384 nodes, where the node list is 21 MB of JSON on
        22.05 (docs/perf.md). slurmctld answers it under its partition read lock alone,
        which a backfill cycle does not hold against it (docs/slurm-versions.md)."""
        out = self.run("scontrol", ["-a", "-o", "show", "partition"])
        parts: dict[str, str] = {}
        for line in out.splitlines():
            words = line.split()
            if not words or not words[0].startswith("PartitionName="):
                continue  # "No partitions in the system"
            name = words[0].partition("=")[2]
            nodes = [w.partition("=")[2] for w in words if w.startswith("Nodes=")]
            if not name or len(nodes) != 1:
                raise SlurmSchemaError(f"scontrol show partition: a line without one "
                                       f"PartitionName and one Nodes: {line[:200]!r}")
            parts[name] = "" if nodes[0] == "(null)" else nodes[0]
        return parts

    def partition_nodes(self, partition: str) -> list[str]:
        """The names of the nodes in ``partition`` (any state; [] for an unknown one),
        from :meth:`partitions`."""
        from ncclguard.hostlist import HostlistError, expand

        text = self.partitions().get(partition, "")
        try:
            return expand(text) if text else []
        except HostlistError as e:
            raise SlurmSchemaError(f"scontrol show partition {partition}: Nodes={text[:200]!r}: "
                                   f"{e}") from None

    def feature_groups(self) -> list[tuple[str, bool, str, tuple[str, ...]]]:
        """``(partition, is the default, hostlist, active features)`` for each group of a
        partition's nodes with the same active features, as ``sinfo -a -h -o "%P|%N|%b"``
        groups them (the same text on every release): 32 classes in one partition of
        16,384 nodes make 32 lines, where the node list is 21 MB of JSON on 22.05. Nodes
        of no partition are not listed. Partition names and hostlists never hold ``|``; a
        node's features never hold a comma."""
        out = self.run("sinfo", ["-a", "-h", "-o", "%P|%N|%b"])
        groups: list[tuple[str, bool, str, tuple[str, ...]]] = []
        for line in out.splitlines():
            if not line.strip():
                continue
            part, hosts, features = [*line.split("|", 2), "", ""][:3]
            if not part or not hosts or any(c.isspace() for c in part + hosts) \
                    or line.count("|") < 2:
                raise SlurmSchemaError(f"sinfo -o %P|%N|%b: not a partition, a hostlist and "
                                       f"features: {line[:200]!r}")
            feats = () if features in ("", "(null)") else tuple(
                f for f in features.split(",") if f)
            default = part.endswith("*")
            groups.append((part[:-1] if default else part, default, hosts, feats))
        return groups

    def default_partition(self) -> str | None:
        """The partition Slurm gives a job that names none (``sinfo %P`` marks it ``*``)."""
        for line in self.run("sinfo", ["-h", "-o", "%P"]).split():
            if line.endswith("*"):
                return line[:-1]
        return None

    def pending_features(self) -> list[tuple[str, str, str, int]]:
        """``(job id, constraint, partition, nodes)`` of every pending job: ``squeue -o``
        (the same text on every release). An array's pending tasks come as one record,
        its id before ``_``."""
        out = self.run("squeue", ["-h", "-t", "PENDING", "-o", "%i %f %P %D"])
        jobs = []
        for line in out.splitlines():
            words = line.split()
            if len(words) != 4 or not words[3].isdigit():
                continue
            job = words[0].split("_", 1)[0]
            if job.isdigit():
                jobs.append((job, "" if words[1] == "(null)" else words[1], words[2],
                             int(words[3])))
        return jobs

    def job(self, job_id: int | str) -> JobInfo | None:
        """One job, or None when Slurm no longer knows it: ``squeue --json -j J -t all``
        on every release (22.05 ignores ``-j``: we pick the job out; from 24.05.1 finished
        jobs need ``-t all``; they are listed until ``MinJobAge`` after their end).

        Not ``scontrol show job J --json`` (23.02+): it answers ``"jobs": []`` with exit 0
        both for an unknown job and when the controller cannot be reached, where squeue
        fails and says why."""
        jid = _job_id(job_id)
        try:
            data = self._json("squeue", ["-j", jid, "-t", "all"], self._json_args())
        except SlurmError as e:
            if _unknown_job(e):
                return None
            raise
        for j in parse_jobs(data, "squeue --json"):
            if j.job_id == int(jid):
                return j
        return None

    def job_brief(self, job_id: int | str, *, admin_comment: bool = True) -> JobInfo | None:
        """One job's placement, for the gate and its follow-up: its state, partition,
        required (``-w``) and excluded (``-x``) nodes and, with ``admin_comment``, its
        AdminComment; None when Slurm no longer knows it.

        ``squeue -h -t all -j J`` in text asks slurmctld for that one job on every
        release (``slurm_load_job``), where 22.05's ``squeue --json`` lists every job
        (31 MB with 10,000 queued: docs/perf.md). Two calls run at once
        (:meth:`run_all`): ``-o "%A|%T|%P|%n|%x"`` (the same letters from 22.05 to
        26.05) and ``-O "JobId:0|,admin_comment:0"``: ``-o`` has no letter for the
        AdminComment, and ``-O`` has no ``ExcNodes`` before 24.05
        (docs/slurm-versions.md). Width 0 prints a field whole. The AdminComment comes
        last, ended by :data:`RECORD_END`: it may hold ``|`` and line breaks (only an
        operator sets it); the other fields are a job id, a state, partition names and
        hostlists, which never hold ``|``."""
        jid = _job_id(job_id)
        base = ["-h", "-t", "all", "-j", jid]
        calls = [("squeue", [*base, "-o", "%A|%T|%P|%n|%x"])]
        if admin_comment:
            calls.append(("squeue", [*base, "-O", f"JobId:0|,admin_comment:0{RECORD_END}"]))
        try:
            outs = self.run_all(calls)
        except SlurmError as e:
            if _unknown_job(e):
                return None
            raise
        placed = None
        for line in outs[0].splitlines():
            fields = line.split("|")
            if len(fields) != 5 or not fields[0].isdigit():
                raise SlurmSchemaError(f"squeue -j {jid} -o %A|%T|%P|%n|%x: not five fields: "
                                       f"{line[:200]!r}")
            if fields[0] == jid:
                placed = fields
        if placed is None:
            return None
        comment = _admin_comments(outs[1]).get(jid, "") if admin_comment else ""
        unset = ("", "(null)")
        return JobInfo(
            job_id=int(jid),
            state=placed[1],
            partition=placed[2],
            required_nodes="" if placed[3] in unset else placed[3],
            excluded_nodes="" if placed[4] in unset else placed[4],
            admin_comment="" if comment == "(null)" else comment,
        )

    def job_owner(self, job_id: int | str) -> JobInfo | None:
        """One job's state, owner (uid) and allocated nodes, for the collector's check of
        a container record (docs/containers.md); None when Slurm no longer knows it.
        ``squeue -h -t all -j J -o "%A|%T|%U|%N"`` in text: slurmctld is asked for that
        job alone on every release, as :meth:`job_brief` does (22.05's ``squeue --json``
        lists every job: 1.7 to 2.1 s with 10,000 queued, each time)."""
        jid = _job_id(job_id)
        try:
            out = self.run("squeue", ["-h", "-t", "all", "-j", jid, "-o", "%A|%T|%U|%N"])
        except SlurmError as e:
            if _unknown_job(e):
                return None
            raise
        for line in out.splitlines():
            fields = line.split("|")
            if len(fields) != 4 or not fields[0].isdigit() or not fields[2].isdigit():
                raise SlurmSchemaError(f"squeue -j {jid} -o %A|%T|%U|%N: not a job id, a "
                                       f"state, a uid and nodes: {line[:200]!r}")
            if fields[0] == jid:
                nodes = "" if fields[3] in ("", "(null)") else fields[3]
                return JobInfo(job_id=int(jid), state=fields[1], user_id=int(fields[2]),
                               nodes=nodes)
        return None

    def job_progress(self, job_id: int | str) -> JobInfo | None:
        """One job's state, the reason Slurm gives for it, its priority (0: held), start
        time, uid and name, for the canary service; None when Slurm no longer knows it.
        ``squeue -h -t all -j J -o "%A|%T|%r|%Q|%S|%U|%j"`` in text, which asks for that
        job alone on every release (as :meth:`job_owner`); the name, which its owner
        chose, last (it may hold a ``|``)."""
        jid = _job_id(job_id)
        fmt = "%A|%T|%r|%Q|%S|%U|%j"
        try:
            out = self.run("squeue", ["-h", "-t", "all", "-j", jid, "-o", fmt])
        except SlurmError as e:
            if _unknown_job(e):
                return None
            raise
        for line in out.splitlines():
            fields = line.split("|", 6)
            if len(fields) != 7 or not _number(fields[0]) or not _number(fields[5]):
                raise SlurmSchemaError(f"squeue -j {jid} -o {fmt}: not a job id, a state, a "
                                       f"reason, a priority, a time, a uid and a name: "
                                       f"{line[:200]!r}")
            if fields[0] == jid:
                return JobInfo(job_id=int(jid), state=fields[1], state_reason=fields[2],
                               priority=int(fields[3]) if _number(fields[3]) else 0,
                               start_time=_squeue_time(fields[4]), user_id=int(fields[5]),
                               name=fields[6])
        return None

    def own_jobs(self, name: str) -> list[JobInfo]:
        """This process's user's live jobs named ``name`` (their id, state and priority):
        the canary service's view of what it submitted, whatever its rows say. ``squeue -h
        -u UID -n NAME -o "%A|%T|%Q"`` (numeric uids are taken by every release)."""
        fmt = "%A|%T|%Q"
        out = self.run("squeue", ["-h", "-u", str(os.geteuid()), "-n", name, "-o", fmt])
        jobs = []
        for line in out.splitlines():
            fields = line.split("|")
            if len(fields) != 3 or not _number(fields[0]):
                raise SlurmSchemaError(f"squeue -n {name} -o {fmt}: not a job id, a state and "
                                       f"a priority: {line[:200]!r}")
            jobs.append(JobInfo(job_id=int(fields[0]), state=fields[1], name=name,
                                user_id=os.geteuid(),
                                priority=int(fields[2]) if _number(fields[2]) else 0))
        return jobs

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
        """``scontrol show hostnames`` (the reference; the gate expands in-process).

        For a malformed list every release prints ``Invalid hostlist`` to stderr and
        still exits 0: an empty answer is an error here."""
        argv_list = _node_list(hostlist)
        out = self.run("scontrol", ["show", "hostnames", argv_list])
        if not out.strip():
            raise SlurmError(f"scontrol show hostnames: not a hostlist: {hostlist!r}")
        return out.split()

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

    def submit(self, args: Sequence[str], script: str) -> int:
        """``sbatch --parsable ARGS FILE`` with ``script`` in a private file of our own
        (``mkstemp``: mode 0600, created here; sbatch copies it to slurmctld); the job id.
        The arguments are a list (never a shell); the script is ours."""
        import tempfile

        fd, path = tempfile.mkstemp(prefix="ncclguard-job-", suffix=".sh")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(script)
            out = self.run("sbatch", ["--parsable", *args, path]).strip()
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        jid = out.split(";", 1)[0]
        if not _number(jid):
            raise SlurmSchemaError(f"sbatch --parsable: not a job id: {out[:200]!r}")
        return int(jid)

    def cancel(self, job_id: int | str) -> None:
        """``scancel J``."""
        self.run("scancel", [_job_id(job_id)])

    def requeue_hold(self, job_id: int | str) -> None:
        self.run("scontrol", ["requeuehold", _job_id(job_id)])

    def drain(self, nodes: str | Iterable[str], reason: str) -> None:
        """Drain nodes with a reason (ncclguard reasons start with ``ncclguard:``)."""
        self.update_nodes(nodes, "State=DRAIN", f"Reason={clean_text(reason, 250)}")

    def set_features(self, nodes: str | Iterable[str], available: Iterable[str],
                     active: Iterable[str] | None = None) -> None:
        """Set the available and active features of ``nodes`` (``active``: the same as
        ``available`` when not given). Each replaces the nodes' whole list
        (docs/slurm.md: merge a node's own features back in). Needs root, SlurmUser or
        a Slurm admin.

        A node's own features go back as Slurm reported them: Slurm takes any text but a
        comma in a feature (``gpu:a100``, ``x=y``, ``a&b``, spaces: seen on 22.05.8), and
        the list is one argument, never a shell word."""
        avail = list(available)
        act = avail if active is None else list(active)
        bad = [f for f in (*avail, *act) if not f or "," in f or "\0" in f]
        if bad:
            raise SlurmError(f"not a feature name: {bad[0]!r}")
        self.update_nodes(nodes, f"AvailableFeatures={','.join(avail)}",
                          f"ActiveFeatures={','.join(act)}")

    def active_features(self, node: str) -> tuple[str, ...] | None:
        """One node's active features, asking slurmctld for that node only (``scontrol
        show node -o NAME``, the same text on every release); None: no such node."""
        try:
            out = self.run("scontrol", ["show", "node", "-o", node])
        except SlurmError as e:
            if "not found" in (e.stderr or str(e)).lower():
                return None
            raise
        for word in out.split():
            if word.startswith("ActiveFeatures="):
                value = word.partition("=")[2]
                return () if value in ("", "(null)") else tuple(v for v in value.split(",") if v)
        raise SlurmError(f"scontrol show node {node}: no ActiveFeatures in {out[:200]!r}")

    def resume(self, nodes: str | Iterable[str]) -> None:
        self.update_nodes(nodes, "State=RESUME")

    def update_nodes(self, nodes: str | Iterable[str], *fields: str) -> None:
        """``scontrol update NodeName=<hostlist> FIELDS``, the hostlist compressed and, when
        it would not fit in one argument, split: one call per part (the same fields each),
        the first failure raised (the parts before it are applied; each update sets, so
        a retry of the whole is harmless)."""
        for part in _node_lists(nodes):
            self.run("scontrol", ["update", f"NodeName={part}", *fields])


#: Ends each record of the AdminComment read (ASCII's record separator): a comment may
#: hold line breaks and ``|``, never this (``clean_text`` drops it from ours; an operator
#: who types one cuts their own comment there).
RECORD_END = "\x1e"


def _admin_comments(out: str) -> dict[str, str]:
    """``squeue -O "JobId:0|,admin_comment:0<RECORD_END>"``: job id -> its AdminComment."""
    found: dict[str, str] = {}
    for record in out.split(RECORD_END + "\n"):
        head, sep, comment = record.partition("|")
        if sep and head.isdigit():
            found[head] = comment.split(RECORD_END)[0].rstrip("\n")
    return found


def _without_program(text: str, path: str, name: str) -> str:
    """Slurm's message without the program's path (24.11 starts it with argv[0])."""
    lines = []
    for line in text.splitlines():
        for prefix in (f"{path}: ", f"{name}: "):
            if line.startswith(prefix):
                line = line[len(prefix) :]
                break
        lines.append(line)
    return "\n".join(lines)


def _error_texts(errors: list[Any]) -> str:
    """The ``errors`` of an answer: strings (22.05) or objects with a description."""
    out = []
    for e in errors:
        if isinstance(e, dict):
            out.append(str(e.get("description") or e.get("error") or e))
        else:
            out.append(str(e))
    return "; ".join(out)


def _number(text: str) -> bool:
    """Digits 0-9 only (``str.isdigit`` takes ``²`` and ``٣``: ``int()`` then fails or
    reads another number)."""
    return text.isascii() and text.isdigit()


def _squeue_time(text: str) -> float | None:
    """squeue's ``%S`` (``2026-12-07T18:50:00``, local time), or None (``N/A``, unknown)."""
    import datetime as dt

    try:
        return dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None
