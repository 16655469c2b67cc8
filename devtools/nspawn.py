"""A Debian system booted with systemd as PID 1 in systemd-nspawn, driven from outside.

The install test (tests/test_install_systemd.py) copies a cached root
(scripts/systemd-root.sh), boots it and runs the install guide's commands in it::

    box = Machine(root, "nc1", log=tmp / "boot.log")
    box.boot()                                   # until systemctl is-system-running
    box.sh("systemctl enable --now munge")       # bash -euo pipefail, as root, cwd /root
    box.sh("ncclguard nodes", user="alice")      # as another user (runuser)
    box.reboot()                                 # a real reboot: shutdown, boot again
    box.poweroff()

How it boots (it works where PID 1 is not systemd, and beside other tests): ``--register=no
--keep-unit`` (no machined, no scope unit), ``--private-network`` (its own loopback: its
daemons' ports and 127.x addresses meet nothing of this machine's), the host name given.
Commands enter all its namespaces with ``nsenter -t <its init pid>`` and a clean
environment. A reboot ends systemd-nspawn with exit status 133, as for
systemd-nspawn@.service (``RestartForceExitStatus=133``); :meth:`reboot` starts it again
on the same root.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# ``unified=True`` gives the container the unified cgroup hierarchy (cgroup v2) where this
# machine mounts the hybrid one: systemd 258 and later refuse to boot on cgroup v1
# ("Detected unsupported legacy cgroup hierarchy, refusing execution", seen with Debian
# forky's systemd 262 under this machine's systemd-nspawn 252). Not the default: Slurm
# 22.05's slurmd then stops ("fatal: Hybrid mode is not supported": /proc/self/cgroup
# still lists the machine's v1 hierarchies).
UNIFIED = {"SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"}
REBOOT_STATUS = 133  # systemd-nspawn's exit status when the container rebooted


CGROUP_ROOTS = ("/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified")  # hybrid: both


def own_cgroups(name: str) -> list[Path]:
    """Cgroups of its own for one systemd-nspawn, where this machine's PID 1 is not systemd.

    With ``--keep-unit`` systemd-nspawn puts the container in ``payload/`` and itself in
    ``supervisor/`` beneath its own cgroup; every process here is in the root cgroup, so two
    containers (two runs at once, or one left behind) would share them, and the second
    one's units fail at its reboot (``Failed to kill control group ...: Input/output
    error``, seen). Under a systemd PID 1 the caller's unit is its own already: none."""
    try:
        if Path("/proc/1/comm").read_text().strip() == "systemd":
            return []
    except OSError:
        return []
    out = []
    for base in CGROUP_ROOTS:
        if Path(base, "cgroup.procs").exists():
            out.append(Path(base) / f"ncclguard-nspawn-{name}-{os.getpid()}")
    if not out and Path("/sys/fs/cgroup/cgroup.procs").exists():  # cgroup v2 only
        out.append(Path("/sys/fs/cgroup") / f"ncclguard-nspawn-{name}-{os.getpid()}")
    return out


def remove_cgroups(dirs: list[Path]) -> None:
    """Remove cgroups left empty (the deepest first); one still in use stays."""
    for top in dirs:
        if not top.is_dir():
            continue
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


class MachineError(RuntimeError):
    """The container did not boot, stop, or run a command as asked (the message says)."""


def missing_tools() -> list[str]:
    """The host programs this needs that are not installed."""
    return [t for t in ("systemd-nspawn", "nsenter") if shutil.which(t) is None]


class Machine:
    def __init__(self, root: Path, name: str, *, log: Path, unified: bool = False) -> None:
        self.root = Path(root)
        self.unified = unified
        self.name = name
        self.log = Path(log)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.boots = 0
        self.cgroups: list[Path] = []

    # ---- lifecycle

    def boot(self, timeout: float = 180) -> None:
        """Boot until systemd says running; a failed unit is an error."""
        if self.proc is not None and self.proc.poll() is None:
            raise MachineError(f"{self.name} is running already")
        self._log = open(self.log, "ab")  # noqa: SIM115 - kept while it runs
        self._log.write(f"\n==== boot {self.boots + 1}\n".encode())
        self._log.flush()
        cgroups = self.cgroups = own_cgroups(self.name)
        for d in cgroups:
            d.mkdir(exist_ok=True)

        def enter_cgroups() -> None:  # in the child, before systemd-nspawn runs
            for d in cgroups:
                (d / "cgroup.procs").write_text(f"{os.getpid()}\n")

        self.proc = subprocess.Popen(
            ["systemd-nspawn", "--quiet", "-D", str(self.root), "-b", "--register=no",
             "--keep-unit", "--private-network", f"--machine={self.name}",
             f"--hostname={self.name}", "--console=passive"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True, env={**os.environ, **(UNIFIED if self.unified else {})},
            preexec_fn=enter_cgroups,  # one write per cgroup, before exec
        )
        self.boots += 1
        end = time.monotonic() + timeout
        state = ""
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise MachineError(f"systemd-nspawn exited with {self.proc.returncode} while "
                                   f"booting:\n{self.tail()}")
            if self._init_pid() is not None:
                r = self.run(["systemctl", "is-system-running"], check=False, timeout=30)
                state = r.stdout.strip()
                if state == "degraded":
                    failed = self.run(["systemctl", "list-units", "--failed", "--plain",
                                       "--no-legend"], check=False).stdout
                    raise MachineError(f"{self.name} booted degraded: {failed}")
                if state == "running":
                    return
            time.sleep(0.5)
        raise MachineError(f"{self.name} did not finish booting in {timeout:.0f}s (state "
                           f"{state!r}):\n{self.tail()}")

    def _init_pid(self) -> int | None:
        """The container's PID 1 as this machine sees it: systemd-nspawn's child."""
        if self.proc is None:
            return None
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except OSError:
            return None
        for pid in children.split():
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                    return int(pid)
            except OSError:
                continue
        return None

    def wait_exit(self, timeout: float = 120) -> int:
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise MachineError(f"{self.name} did not stop in {timeout:.0f}s:\n"
                               f"{self.tail()}") from None
        if self._log is not None:
            self._log.close()
            self._log = None
        remove_cgroups(self.cgroups)
        return rc

    def reboot(self, timeout: float = 180) -> None:
        """``systemctl reboot`` inside: every unit stops, systemd-nspawn ends with 133, and
        the same root boots again."""
        self.run(["systemctl", "reboot"], check=False)
        rc = self.wait_exit(timeout)
        if rc != REBOOT_STATUS:
            raise MachineError(f"{self.name} ended with {rc}, not {REBOOT_STATUS} (reboot):\n"
                               f"{self.tail()}")
        self.boot(timeout)

    def cursor(self) -> str:
        """Where the journal is now (``journalctl --after-cursor`` reads what follows)."""
        out = self.run(["journalctl", "-q", "-n", "0", "--show-cursor"]).stdout
        return out.strip().rsplit("-- cursor: ", 1)[-1]

    def poweroff(self, timeout: float = 120) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        if self._init_pid() is not None:
            self.run(["systemctl", "poweroff"], check=False)
        try:
            self.wait_exit(timeout)
        except MachineError:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.wait_exit(30)
            raise

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # ---- commands

    def run(self, argv: list[str], *, user: str | None = None, check: bool = True,
            timeout: float = 120, input: str | None = None, cwd: str = "/root",
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``argv`` inside the container (as root, or as ``user`` through runuser), with a
        clean environment and ``cwd``."""
        pid = self._init_pid()
        if pid is None:
            raise MachineError(f"{self.name} is not running")
        home = "/root" if user is None else "/"
        envv = [f"PATH={PATH}", f"HOME={home}", "LANG=C.UTF-8", "TERM=dumb",
                *(f"{k}={v}" for k, v in (env or {}).items())]
        inner = ["env", "-i", f"--chdir={cwd if user is None else '/'}", *envv, *argv]
        if user is not None:
            inner = ["runuser", "-u", user, "--", *inner]
        full = ["nsenter", "-t", str(pid), "-a", *inner]
        r = subprocess.run(full, capture_output=True, text=True, timeout=timeout, input=input,
                           stdin=None if input is not None else subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise MachineError(f"{self.name}: {shlex.join(argv)}{f' (as {user})' if user else ''}"
                               f" -> {r.returncode}\n--- stdout\n{r.stdout[-4000:]}\n"
                               f"--- stderr\n{r.stderr[-4000:]}")
        return r

    def sh(self, script: str, **kw: object) -> subprocess.CompletedProcess[str]:
        """A shell script inside (``bash -euo pipefail``), as :meth:`run`."""
        return self.run(["bash", "-euo", "pipefail", "-c", script], **kw)  # type: ignore[arg-type]

    def path(self, node_path: str) -> Path:
        """Where a path of the container is on this machine."""
        return self.root / node_path.lstrip("/")
