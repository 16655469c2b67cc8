"""A real, private Slurm cluster on one machine: munged, slurmctld and N slurmd.

Used by the tests (``tests/helpers/slurm.py``), the benchmark and the demo. Everything
lives under one directory: the munge key and socket, slurm.conf, state, spool, logs and
the ``PrologSlurmctld`` wrapper that runs the gate with this Python and this config.
Daemons run in the foreground as children of this process, each in its own session, and
:meth:`DevCluster.stop` ends exactly those processes.

    with DevCluster(Path("/tmp/c"), nodes=4, prolog=True) as c:
        job = c.sbatch(["-N2", "--wrap", "true"])
        c.wait_job(job, {"COMPLETED"})

Slurm facts this rests on: docs/slurm.md, "Running a real cluster on one machine".
Scripts that Slurm starts get neither ``PATH`` nor ``SLURM_CONF``, so the wrapper sets
both.

Over 500 lines: one class that runs a whole Slurm cluster (munged per node,
slurm.conf, slurmctld, slurmd, the features daemon, the inventory and spool); the demo,
the tests and the benchmarks need all of it together, through one object.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

from ncclguard.hostlist import compress
from ncclguard.slurm import Slurm

SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
#: The job_submit.lua the project ships (docs/scheduling.md).
JOB_SUBMIT_LUA = Path(__file__).resolve().parents[1] / "slurm" / "job_submit.lua"


CONTROLLER_ORIGIN = "127.42.255.254"


#: where the nodes that never run (``extra_nodes``) are said to be: nothing listens there
UNUSED_ADDR = "127.43.255.254"


class ClusterError(RuntimeError):
    """The cluster could not be started or did not reach the wanted state in time."""


def node_addr(index: int) -> str:
    """Node ``n<index>``'s own ``NodeAddr`` on the loopback range (127.42.x.y, all of
    which reach this host's lo): the address its munged signs records from."""
    return f"127.42.{(index - 1) // 250}.{(index - 1) % 250 + 1}"


def munged_argv(directory: Path, name: str, key: Path, origin: str) -> list[str]:
    """A munged of our own (``-F``: in the foreground) under ``directory``: socket
    ``<name>.socket``, signing from ``origin``."""
    return [
        find_program("munged") or "munged", "-F", "--force",
        f"--socket={directory / (name + '.socket')}", f"--key-file={key}",
        f"--pid-file={directory / (name + '.pid')}", f"--log-file={directory / (name + '.log')}",
        f"--seed-file={directory / (name + '.seed')}", f"--origin={origin}",
    ]


def write_munge_key(path: Path) -> Path:
    """A fresh MUNGE key (1024 random bytes, mode 0400), unless one is there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_bytes(secrets.token_bytes(1024))
    os.chmod(path, 0o400)
    return path


class Munged:
    """One munged of our own, for tests without Slurm: ``with Munged(dir, "n1",
    key, "127.42.0.2") as m: m.socket``."""

    def __init__(self, directory: Path, name: str, key: Path, origin: str,
                 mode: int = 0o700) -> None:
        self.directory, self.name, self.mode = Path(directory), name, mode
        self.socket = self.directory / f"{name}.socket"
        self.argv = munged_argv(self.directory, name, key, origin)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> Munged:
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, self.mode)
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = self.directory / f"{self.name}.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                self.stop()
                raise ClusterError(f"munged {self.name} did not start:\n{tail}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def __enter__(self) -> Munged:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def find_program(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in SBIN:
        p = Path(d) / name
        if os.access(p, os.X_OK):
            return str(p)
    return None


def missing_programs() -> list[str]:
    """The programs a dev cluster needs that are not installed."""
    need = ["munged", "slurmctld", "slurmd", "scontrol", "sbatch", "squeue", "sinfo", "srun"]
    return [p for p in need if find_program(p) is None]


def port_range(count: int, local_range: str | None = None) -> tuple[int, int]:
    """Where to look for ``count`` free ports: outside the kernel's ephemeral range
    (``net.ipv4.ip_local_port_range``, 32768-60999 by default), from which any outgoing
    connection on the machine may take a port at any moment, after we checked it."""
    if local_range is None:
        try:
            local_range = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        except OSError:
            local_range = "32768 60999"
    lo, hi = (int(x) for x in local_range.split()[:2])
    if lo - 10000 >= 1000 + count:
        return 10000, lo - count  # below it (the default: 10000-32767)
    if 65535 - count - hi >= 100:
        return hi + 1, 65535 - count  # above it
    # (almost) every port is ephemeral: take any; start() tries again if one was taken
    return 1024, 65535 - count


def _free_port_block(count: int) -> int:
    """The first of ``count`` consecutive TCP ports that are free now on 127.0.0.1, outside
    the ephemeral range (:func:`port_range`). Free now is not free later: :meth:`DevCluster.
    start` tries again with other ports when a daemon cannot bind."""
    rng = secrets.SystemRandom()
    first, last = port_range(count)
    for _ in range(200):
        base = rng.randrange(first, last)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise ClusterError(f"no block of {count} free ports found")


class DevCluster:
    """munged + slurmctld + ``nodes`` slurmd (n1..nN) under ``root``.

    ``prolog``: install the gate as ``PrologSlurmctld`` (through a wrapper that sets
    ``NCCLGUARD_CONFIG``, ``NCCLGUARD_DB``, ``SLURM_CONF`` and ``PATH``).
    ``gate_config``: the TOML text the wrapper points ``NCCLGUARD_CONFIG`` at;
    ``db``: the inventory path for ``NCCLGUARD_DB`` (default ``root/inventory.db``).
    ``job_submit``: prevention at scheduling time (docs/scheduling.md): the project's
    ``slurm/job_submit.lua`` (``JobSubmitPlugins=lua``) reading this cluster's file of
    classes, and ``SlurmctldPrimaryOnProg`` running the features hook.
    ``job_submit_lua``: instead, this Lua file as the cluster's ``job_submit.lua``
    (``JobSubmitPlugins=lua``, copied as it is, no features hook): a probe of what Slurm's
    lua API shows (tests/test_lua_container_image.py).
    ``extra_nodes``: more node names defined in slurm.conf, in the first partition, for
    which no slurmd runs (they stay ``down*``): a large cluster's controller at the cost
    of a small one (tests/test_scale_slurm.py, tests/test_controller_safety.py,
    bench/bench_lua.py); :meth:`store_fingerprints` gives them records.
    """

    def __init__(
        self,
        root: Path,
        *,
        nodes: int = 4,
        cpus: int = 2,
        prolog: bool = True,
        gate_config: str = "",
        db: Path | None = None,
        python: str | None = None,
        partitions: Mapping[str, str] | None = None,
        prolog_timeout_s: int = 30,
        extra_conf: str = "",
        job_submit: bool = False,
        extra_nodes: Sequence[str] = (),
        job_submit_lua: Path | None = None,
    ) -> None:
        if job_submit and job_submit_lua is not None:
            raise ValueError("job_submit (the shipped lua) or job_submit_lua, not both")
        missing = missing_programs()
        if missing:
            raise ClusterError(
                f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge)"
            )
        self.root = Path(root).resolve()
        self.node_names = [f"n{i}" for i in range(1, nodes + 1)]
        self.extra_nodes = list(extra_nodes)
        self.cpus = cpus
        self.prolog = prolog
        self.db = Path(db) if db else self.root / "inventory.db"
        self.config_path = self.root / "ncclguard.toml"
        self.gate_config = gate_config
        self.initial_gate_config = gate_config
        self.audit_path = self.root / "decisions.jsonl"
        self.python = python or sys.executable
        self.partitions = dict(partitions or {"debug": f"n[1-{nodes}]"})
        if self.extra_nodes:
            first = next(iter(self.partitions))
            self.partitions[first] += "," + compress(self.extra_nodes)
        self.prolog_timeout_s = prolog_timeout_s
        self.extra_conf = extra_conf
        self.job_submit = job_submit
        self.job_submit_lua = Path(job_submit_lua) if job_submit_lua is not None else None
        self.classes_file = self.root / "features" / "classes"
        self.features_hook = self.root / "ncclguard-features.sh"
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munged.socket"
        self.records = self.root / "records"  # the spool nodes publish to
        self.node_addrs = {n: node_addr(i) for i, n in enumerate(self.node_names, start=1)}
        self.wrapper = self.root / "ncclguard-prolog.sh"
        self.gate_log = self.root / "gate.log"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env: dict[str, str] = {
            "SLURM_CONF": str(self.conf),
            "PATH": os.pathsep.join(["/usr/bin", "/bin", "/usr/sbin", "/sbin"]),
            "LANG": "C.UTF-8",
            "HOME": str(self.root),
        }

    # ----------------------------------------------------------------- setup
    def write_gate_config(self, text: str) -> None:
        """Replace the controller's config (the gate's and the collector's); the next
        prolog run reads it (no restart needed). ``[spool]`` and ``[collector]`` sections
        pointing at this cluster's spool and munged are added unless ``text`` has them."""
        self.gate_config = text
        if "audit_log" not in text and "[gate]" not in text:
            text = f'[gate]\naudit_log = "{self.audit_path}"\n' + text
        if "[spool]" not in text:
            text += (f'\n[spool]\ndir = "{self.records}"\n'
                     f'munge_socket = "{self.munge_socket}"\n')
        if "[collector]" not in text:
            text += f'\n[collector]\npublisher = "{os.getuid()}"\n'
        if "[features]" not in text:
            text += f'\n[features]\nclasses_file = "{self.classes_file}"\n'
        self.config_path.write_text(text)

    def node_config(self, node: str) -> Path:
        """Node ``node``'s own config: the spool, and its own munged."""
        path = self.root / f"node-{node}.toml"
        sock = self.root / "munge" / f"{node}.socket"
        # several slurmd on one machine: a job process is node X's when its environment
        # says SLURMD_NODENAME=X (ncclguard-inventoryd jobmaps, docs/runtime.md)
        path.write_text(f'[spool]\ndir = "{self.records}"\nmunge_socket = "{sock}"\n'
                        '[runtime]\nnode_from_env = true\n')
        return path

    def _write_files(self) -> None:
        for d in ("munge", "state", "spool", "log", "tmp", "records"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        os.chmod(self.root / "records", 0o755)  # noqa: S103 - the spool: readable, ours
        write_munge_key(self.root / "munge" / "munge.key")
        self.write_gate_config(self.gate_config)
        base = _free_port_block(len(self.node_names) + 1)
        self.ctld_port = base
        first, last = base + 1, base + len(self.node_names)
        lines = [
            f"ClusterName=ncg{base}",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={self.ctld_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}/%n",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'log'}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log'}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "SwitchType=switch/none",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_min_interval=0",
            "MinJobAge=600",
            "JobRequeue=1",
            "InactiveLimit=0",
            "KillWait=2",
            f"PrologEpilogTimeout={self.prolog_timeout_s}",
        ]
        if self.prolog:
            lines.append(f"PrologSlurmctld={self.wrapper}")
        if self.job_submit:
            lines += ["JobSubmitPlugins=lua", f"SlurmctldPrimaryOnProg={self.features_hook}"]
            self._write_job_submit()
        elif self.job_submit_lua is not None:
            lines.append("JobSubmitPlugins=lua")
            shutil.copyfile(self.job_submit_lua, self.root / "job_submit.lua")
        for port, name in enumerate(self.node_names, start=first):
            lines.append(
                f"NodeName={name} NodeHostname={name} NodeAddr={self.node_addrs[name]} "
                f"CPUs={self.cpus} RealMemory=1000 State=UNKNOWN Port={port}"
            )
        assert port == last
        if self.extra_nodes:
            # never started: an address and a port nothing listens on (slurmctld sends
            # them its pings and reconfigure messages; at its own port it would take
            # those for clients' requests)
            lines.append(f"NodeName={compress(self.extra_nodes)} NodeAddr={UNUSED_ADDR} "
                         f"CPUs={self.cpus} RealMemory=1000 State=UNKNOWN Port=1")
        for i, (name, nodes) in enumerate(self.partitions.items()):
            default = " Default=YES" if i == 0 else ""
            lines.append(f"PartitionName={name} Nodes={nodes}{default} MaxTime=INFINITE State=UP")
        if self.extra_conf:
            # a setting given there replaces ours (Slurm would keep the first); node and
            # partition lines add to ours
            keys = {ln.split("=", 1)[0] for ln in self.extra_conf.splitlines() if "=" in ln}
            keys -= {"NodeName", "PartitionName", "NodeSet", "Include"}
            lines = [ln for ln in lines if ln.split("=", 1)[0] not in keys]
            lines.append(self.extra_conf)
        self.conf.write_text("\n".join(lines) + "\n")
        # The wrapper Slurm starts: no PATH, no SLURM_CONF in its environment.
        self.wrapper.write_text(
            "#!/bin/sh\n"
            "# Written by devtools.devcluster: PrologSlurmctld for this dev cluster.\n"
            f"PATH={shlex.quote(self.env['PATH'])}\n"
            f"SLURM_CONF={shlex.quote(str(self.conf))}\n"
            f"NCCLGUARD_CONFIG={shlex.quote(str(self.config_path))}\n"
            f"NCCLGUARD_DB={shlex.quote(str(self.db))}\n"
            "export PATH SLURM_CONF NCCLGUARD_CONFIG NCCLGUARD_DB\n"
            f"exec {shlex.quote(self.python)} -I -m prolog.gate "
            f"2>>{shlex.quote(str(self.gate_log))}\n"
        )
        os.chmod(self.wrapper, 0o700)  # run by SlurmUser (root here) only

    def _write_job_submit(self) -> None:
        """The project's job_submit.lua beside slurm.conf (where Slurm looks for it),
        reading this cluster's file of classes; and the hook that restores the features
        (``SlurmctldPrimaryOnProg``, ``strigger --reconfig``)."""
        text = JOB_SUBMIT_LUA.read_text()
        line = 'ncclguard.CLASSES_FILE = "/var/lib/ncclguard-features/classes"'
        assert line in text, f"{JOB_SUBMIT_LUA}: no {line!r} to point at this cluster's file"
        (self.root / "job_submit.lua").write_text(
            text.replace(line, f"ncclguard.CLASSES_FILE = {json.dumps(str(self.classes_file))}"))
        self.classes_file.parent.mkdir(mode=0o755, exist_ok=True)
        self.features_hook.write_text(
            "#!/bin/sh\n"
            "# Written by devtools.devcluster: puts the class features back (docs/scheduling.md).\n"
            f"PATH={shlex.quote(self.env['PATH'])}\n"
            f"SLURM_CONF={shlex.quote(str(self.conf))}\n"
            f"NCCLGUARD_CONFIG={shlex.quote(str(self.config_path))}\n"
            f"NCCLGUARD_DB={shlex.quote(str(self.db))}\n"
            "export PATH SLURM_CONF NCCLGUARD_CONFIG NCCLGUARD_DB\n"
            f"exec {shlex.quote(self.python)} -I -m inventoryd.main features --hook --log "
            f"{shlex.quote(str(self.root / 'log' / 'features-hook.log'))}\n"
        )
        os.chmod(self.features_hook, 0o700)

    # ------------------------------------------------------------- lifecycle
    def _spawn(self, name: str, argv: Sequence[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - kept by the child
        try:
            self._procs[name] = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.root,
                start_new_session=True,
            )
        finally:
            log.close()

    def start(self, timeout: float = 60.0, attempts: int = 3) -> DevCluster:
        """Start the daemons; when one cannot bind its port (taken since we checked it),
        stop them all and try again with other ports, ``attempts`` times in all."""
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once(timeout)
            except ClusterError as e:
                if attempt == attempts or "Address already in use" not in str(e):
                    raise
                self.stop()
                # a new port is a new ClusterName: slurmctld refuses the old state's
                shutil.rmtree(self.root / "state", ignore_errors=True)
                for log in (self.root / "log").glob("*"):
                    log.unlink()
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> DevCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        self._write_files()
        m = self.root / "munge"
        key = m / "munge.key"
        # the controller's munged (Slurm's, and the collector's) signs from an address no
        # node has; each node's own munged signs from the node's NodeAddr
        self._spawn("munged", munged_argv(m, "munged", key, CONTROLLER_ORIGIN))
        for node, addr in self.node_addrs.items():
            self._spawn(f"munged-{node}", munged_argv(m, node, key, addr))
        sockets = [self.munge_socket, *(m / f"{node}.socket" for node in self.node_names)]
        self._wait(lambda: all(s.exists() for s in sockets), timeout, "munged sockets")
        self._spawn(
            "slurmctld",
            [find_program("slurmctld") or "slurmctld", "-D", "-i", "-f", str(self.conf)],
        )
        self._wait(self._ctld_up, timeout, "slurmctld to answer scontrol ping")
        for node in self.node_names:
            self._spawn(
                f"slurmd-{node}",
                [find_program("slurmd") or "slurmd", "-D", "-N", node, "-f", str(self.conf)],
            )
        self.wait_nodes_idle(timeout)
        return self

    def restart_slurmctld(self, timeout: float = 60.0) -> None:
        """Stop slurmctld (SIGTERM) and start it again the plain way: state recovered from
        StateSaveLocation, runtime node features lost (docs/slurm.md, "Node features")."""
        p = self._procs.pop("slurmctld")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=30)
        self._spawn(
            "slurmctld",
            [find_program("slurmctld") or "slurmctld", "-D", "-i", "-f", str(self.conf)],
        )
        self._wait(self._ctld_up, timeout, "slurmctld to answer scontrol ping")

    def _ctld_up(self) -> bool:
        self._check_alive()
        try:  # a port taken by another listener: the ping hangs there, slurmctld exits
            r = self.run(["scontrol", "ping"], check=False, timeout=10)
        except subprocess.TimeoutExpired:
            return False
        return "UP" in r.stdout

    def _check_alive(self) -> None:
        for name, p in self._procs.items():
            if p.poll() is not None:
                tail = self.log_tail(name)
                raise ClusterError(f"{name} exited with {p.returncode}:\n{tail}")

    def log_tail(self, name: str, lines: int = 30) -> str:
        out = []
        for f in (self.root / "log" / f"{name}.out", self.root / "log" / f"{name}.log"):
            if f.exists():
                out.append(
                    f"--- {f}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-lines:])
                )
        return "\n".join(out)

    def wait_nodes_idle(self, timeout: float = 60.0) -> None:
        def idle() -> bool:
            self._check_alive()
            # the running nodes only: sinfo -N of 16,384 defined nodes took over 10 s on
            # 2 busy cores (one record per node, each matched against the others); a busy
            # controller answers late: ask again
            try:
                r = self.run(["sinfo", "-h", "-N", "-n", compress(self.node_names), "-o",
                              "%N %T"], check=False, timeout=30)
            except subprocess.TimeoutExpired:
                return False
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            return all(states.get(n, "").rstrip("*") == "idle" for n in self.node_names)

        self._wait(idle, timeout, "all nodes idle")

    def stop(self) -> None:
        order = (["features"] + [n for n in self._procs if n.startswith("slurmd")]
                 + ["slurmctld"])
        for name in order + [n for n in self._procs if n.startswith("munged")]:
            p = self._procs.get(name)
            if p is None or p.poll() is not None:
                continue
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + 15
        for p in self._procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
        self._procs.clear()

    def __enter__(self) -> DevCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()  # a daemon that did start must not outlive a failed start
            raise

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # --------------------------------------------------------------- helpers
    @staticmethod
    def _wait(pred: object, timeout: float, what: str, interval: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if pred():  # type: ignore[operator]
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(interval)

    def run(
        self,
        argv: Sequence[str],
        *,
        check: bool = True,
        timeout: float = 30,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client with this cluster's environment (argument list, timeout)."""
        full_env = {**self.env, **(env or {})}
        r = subprocess.run(
            list(argv),
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
            cwd=self.root / "tmp",
        )
        if check and r.returncode != 0:
            raise ClusterError(f"{shlex.join(argv)} -> {r.returncode}: {r.stderr.strip()}")
        return r

    def slurm(self, timeout: float = 10.0) -> Slurm:
        """The ncclguard Slurm adapter, pointed at this cluster."""
        return Slurm(conf=str(self.conf), timeout=timeout)

    def sbatch(self, args: Iterable[str]) -> int:
        """Submit as a user would (no ``-o``: the output goes to ``tmp/slurm-%j.out``, the
        working directory). Slurm then gives PrologSlurmctld ``SLURM_JOB_STDIN`` but no
        ``SLURM_JOB_STDOUT``; the gate must still see a batch job."""
        r = self.run(["sbatch", "--parsable", *args])
        return int(r.stdout.strip().split(";")[0])

    def job_field(self, job_id: int, field: str) -> str:
        """One field of ``scontrol show job`` (``JobState``, ``NodeList``, ...)."""
        r = self.run(["scontrol", "-o", "show", "job", str(job_id)], check=False)
        for tok in r.stdout.split():
            key, _, value = tok.partition("=")
            if key == field:
                return value
        # AdminComment/Comment may hold spaces: take everything up to the next Key=
        text = r.stdout
        marker = f" {field}="
        if marker in text:
            rest = text.split(marker, 1)[1]
            return rest.split("=", 1)[0].rsplit(" ", 1)[0] if "=" in rest else rest.strip()
        return ""

    def show_job(self, job_id: int) -> str:
        return self.run(["scontrol", "show", "job", str(job_id)], check=False).stdout

    def wait_job(self, job_id: int, states: Iterable[str], timeout: float = 60.0) -> str:
        """Wait until the job's state is one of ``states``; return it."""
        want = set(states)
        seen = ""

        def reached() -> bool:
            nonlocal seen
            seen = self.job_field(job_id, "JobState")
            return seen in want

        try:
            self._wait(reached, timeout, f"job {job_id} to reach {sorted(want)}", interval=0.25)
        except ClusterError as e:
            raise ClusterError(f"{e} (last state {seen!r}):\n{self.show_job(job_id)}") from None
        return seen

    # ------------------------------------------------------- records, collector
    def _inventoryd(self, args: Sequence[str], config: Path, timeout: float = 120
                    ) -> subprocess.CompletedProcess[str]:
        env = {**self.env, "NCCLGUARD_CONFIG": str(config), "NCCLGUARD_DB": str(self.db)}
        return subprocess.run([self.python, "-m", "inventoryd.main", *args], env=env,
                              capture_output=True, text=True, timeout=timeout,
                              cwd=self.root / "tmp")

    def publish(self, node: str, root: Path, *, check: bool = True
                ) -> subprocess.CompletedProcess[str]:
        """Node ``node`` publishes the fingerprint of the tree under ``root``, signed by
        its own munged, as ``ncclguard-inventoryd once --publish`` does on a node."""
        r = self._inventoryd(["once", "--publish", "--root", str(root), "--hostname", node],
                             self.node_config(node))
        if check and r.returncode != 0:
            raise ClusterError(f"publishing {node} failed ({r.returncode}): {r.stderr}")
        return r

    def publish_fingerprint(self, node: str, fp: Mapping[str, object],
                            loaded: Mapping[str, object] | None = None) -> Path:
        """Publish a fingerprint built by a test, signed by ``node``'s own munged, as
        the node's publisher does (:class:`inventoryd.node.publish.Publisher`), with
        ``loaded``: what the node's running job steps loaded (:meth:`jobmaps`)."""
        from inventoryd.node.publish import Publisher
        from ncclguard.config import SpoolConfig

        cfg = SpoolConfig(dir=str(self.records),
                          munge_socket=str(self.root / "munge" / f"{node}.socket"))
        return Publisher(cfg, heartbeat_s=300).publish(fp, loaded=loaded)

    def jobmaps(self, node: str) -> dict[str, object] | None:
        """One scan of ``ncclguard-inventoryd jobmaps --once`` for node ``node`` (its
        processes told apart by SLURMD_NODENAME), read back as the node daemon reads it
        (:func:`inventoryd.node.jobmaps.read_loaded`)."""
        from inventoryd.node.jobmaps import read_loaded

        out = self.root / "jobmaps" / f"{node}.json"
        out.parent.mkdir(exist_ok=True)
        r = self._inventoryd(["jobmaps", "--once", "--hostname", node, "--out", str(out)],
                             self.node_config(node))
        if r.returncode != 0:
            raise ClusterError(f"jobmaps for {node} failed ({r.returncode}): {r.stderr}")
        doc, why = read_loaded(str(out), node, 600)
        if why is not None:
            raise ClusterError(f"jobmaps for {node}: {why}")
        return doc

    def store_fingerprints(self, fps: Iterable[Mapping[str, object]]) -> None:
        """Write fingerprints straight into this cluster's inventory, as the collector
        would after verifying them (for nodes without a munged: :attr:`extra_nodes`)."""
        from ncclguard.fingerprint.model import hostname
        from ncclguard.policy import load_config
        from ncclguard.policy.schedule import class_values
        from ncclguard.spool import record_name
        from ncclguard.store import Inventory
        from ncclguard.store.inventory import Published

        # in batches, one transaction each (the collector's ingest): 16,384 upserts, one
        # fsync-bound transaction each, took 7 minutes on this VM's disk
        now, uid = time.time(), os.getuid()
        policy = load_config(str(self.config_path)).policy
        with Inventory(self.db, values=class_values(policy)) as inv:
            batch: list[Published] = []
            for fp in [*fps, None]:
                if fp is not None:
                    batch.append(Published(fp, now, record_name(hostname(fp)), "", "", "", uid))
                if len(batch) >= 2000 or (fp is None and batch):
                    bad = [s for s in inv.ingest(batch, now=now) if s.startswith("invalid")]
                    if bad:
                        raise ClusterError(f"store_fingerprints: {bad[0]}")
                    batch = []

    def collect(self, *, check: bool = True) -> subprocess.CompletedProcess[str]:
        """One scan of the collector into this cluster's inventory (``collect --once``)."""
        r = self._inventoryd(["collect", "--once"], self.config_path)
        if check and r.returncode != 0:
            raise ClusterError(f"collect --once failed ({r.returncode}): {r.stderr}")
        return r

    def canary_once(self, *, check: bool = True) -> subprocess.CompletedProcess[str]:
        """One pass of the canary service (``ncclguard-inventoryd canary --once``) with
        this cluster's config (its ``[canary]``) and inventory."""
        r = self._inventoryd(["canary", "--once"], self.config_path)
        if check and r.returncode != 0:
            raise ClusterError(f"canary --once failed ({r.returncode}): {r.stderr}")
        return r

    # ------------------------------------------------------- class features
    def ncclguard(self, *args: str, check: bool = True, ok: Iterable[int] = (0,)
                  ) -> subprocess.CompletedProcess[str]:
        """``ncclguard ARGS`` (the admin CLI) against this cluster's config and inventory;
        with ``check``, an exit status outside ``ok`` is a ClusterError."""
        env = {**self.env, "NCCLGUARD_CONFIG": str(self.config_path),
               "NCCLGUARD_DB": str(self.db)}
        r = subprocess.run([self.python, "-m", "ncclguard.cli", *args], env=env,
                           capture_output=True, text=True, timeout=120, cwd=self.root / "tmp")
        if check and r.returncode not in tuple(ok):
            raise ClusterError(f"ncclguard {' '.join(args)} failed ({r.returncode}): "
                               f"{r.stdout}{r.stderr}")
        return r

    def features(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``ncclguard features ARGS`` against this cluster (``sync``, ``check``...)."""
        return self.ncclguard("features", *args, check=check)

    def start_features_daemon(self, env: Mapping[str, str] | None = None) -> None:
        """``ncclguard-inventoryd features``, the controller's service, until stop();
        ``env``: more of its environment (``NOTIFY_SOCKET``, say)."""
        env = {**self.env, "NCCLGUARD_CONFIG": str(self.config_path),
               "NCCLGUARD_DB": str(self.db), **(env or {})}
        saved, self.env = self.env, env
        try:
            self._spawn("features", [self.python, "-m", "inventoryd.main", "features",
                                     "--config", str(self.config_path)])
        finally:
            self.env = saved
        (self.root / "features.pid").write_text(f"{self._procs['features'].pid}\n")

    def stop_features_daemon(self) -> None:
        (self.root / "features.pid").unlink(missing_ok=True)
        p = self._procs.pop("features", None)
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=15)

    def set_reconfig_trigger(self) -> None:
        """The permanent trigger that runs the features hook after a reconfigure."""
        self.run(["strigger", "--set", "--reconfig", "--flags=PERM",
                  f"--program={self.features_hook}"])

    def node_features(self) -> dict[str, tuple[str, ...]]:
        """Each node's active features, as Slurm has them now (one line per distinct list,
        expanded here: ``sinfo -N`` costs seconds at 16,384 nodes)."""
        from ncclguard.hostlist import expand

        r = self.run(["sinfo", "-a", "-h", "-o", "%N|%b"], timeout=60)
        out: dict[str, tuple[str, ...]] = {}
        for line in r.stdout.splitlines():
            hosts, _, feats = line.strip().partition("|")
            for name in expand(hosts):
                out[name] = tuple(f for f in feats.split(",") if f and f != "(null)")
        return out

    def remove_records(self) -> None:
        """Empty the spool (the records of every node, and the collector's directory of
        container records)."""
        for f in self.records.iterdir():
            if f.is_dir() and not f.is_symlink():
                shutil.rmtree(f)
            else:
                f.unlink()

    def remove_inventory(self) -> None:
        """Delete the inventory file and SQLite's own files beside it (-wal, -shm,
        -journal), and nothing else."""
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{self.db}{suffix}").unlink(missing_ok=True)

    def reset_gate_state(self) -> None:
        """The gate's config and inventory as at start: the config given to the
        constructor, no inventory file (and no -wal/-shm), an empty gate log, and no
        partition view shared between gate runs (``gate-shared/`` beside the audit log,
        docs/gate.md "Shared work": one up to 10 s old served the next test the classes
        of the last one's inventory; CI, 24.11, shuffled). Tests that share one cluster
        call this between them, so none inherits another's."""
        self.write_gate_config(self.initial_gate_config)
        self.remove_inventory()
        self.remove_records()
        if self.gate_log.exists():
            self.gate_log.write_text("")
        shutil.rmtree(self.audit_path.parent / "gate-shared", ignore_errors=True)

    def cancel_all(self) -> None:
        self.run(["scancel", "--user", "root"], check=False)
        self.run(["scancel", "--user", str(os.getuid())], check=False)
