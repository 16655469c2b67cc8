"""The controller comes first: on a real slurmctld with the shipped job_submit.lua, the
features daemon and its hooks, hostile submitters never stall slurmctld, and a normal
user's submissions go through while the controller is reconfigured and restarted.

Bounded: two hostile loops and one normal user for ``WINDOW_S`` seconds, every Slurm
call with its own timeout; the hostile jobs are held and cancelled at the end.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers.fingerprints import fingerprint
from helpers.slurm import class_features as _classes
from helpers.slurm import require_slurm
from helpers.wait import wait_until

from devtools.devcluster import DevCluster
from ncclguard.sched import classfile
from ncclguard.slurm.model import Release

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

WINDOW_S = 45.0
#: nodes defined in slurm.conf with no slurmd, two per class: with n[1-2] and n[3-4] the
#: file offers 64 classes, the most a job is given (the lua's worst case)
EXTRA = [f"x{i}" for i in range(1, 125)]
RECONFIGURE_AT_S, RESTART_AT_S = 8.0, 24.0


def _versions(host: str) -> str:
    return "2.18.3" if host in ("n3", "n4") else "2.21.5"


@pytest.fixture(scope="module")
def safety_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    require_slurm()
    root = tmp_path_factory.mktemp("safety")
    with DevCluster(root, nodes=4, prolog=True, job_submit=True, extra_nodes=EXTRA) as c:
        c.write_gate_config(f'[gate]\naudit_log = "{c.audit_path}"\n[features]\n'
                            f'classes_file = "{c.classes_file}"\ninterval_s = 0.5\n')
        for host in c.node_names:
            c.publish_fingerprint(host, fingerprint(host, nccl=_versions(host)))
        c.collect()
        c.store_fingerprints(fingerprint(h, nccl=f"2.22.{i // 2}") for i, h in enumerate(EXTRA))
        c.set_reconfig_trigger()
        c.start_features_daemon()
        wait_until(lambda: all(_classes(c).values()), 60, "the class features")
        # the file as the sync leaves it: while the features move it names only the
        # classes Slurm had before and after (none, at the first sync), then all 64 (a
        # shuffled 24.11 run read it in between, 2026-12-03)
        wait_until(lambda: len(_offered(c)) == 64, 30, "the file of classes offering 64",
                   detail=lambda: str(_offered(c)))
        yield c
        c.stop_features_daemon()


def _offered(c: DevCluster) -> tuple:
    try:
        return classfile.read(c.classes_file).partitions.get("debug", ())
    except classfile.ClassFileError:
        return ()


@dataclass
class Calls:
    ok: int = 0
    failed: list[tuple[float, str]] = field(default_factory=list)  # (when, why)
    took: list[float] = field(default_factory=list)


def _script(directory: Path, name: str, lines: list[str]) -> Path:
    p = directory / name
    p.write_text("#!/bin/sh\n" + "".join(f"#SBATCH {ln}\n" for ln in lines) + "true\n")
    return p


def _hostile(c: DevCluster) -> list[list[str]]:
    """What an unprivileged user can send: Slurm refuses most of it after the lua."""
    d = c.root / "tmp"
    huge = _script(d, "huge.sh", ["--constraint=" + "a&" * (5 << 20)])  # 10 MB
    many = "[" + "|".join(f"t{i}" for i in range(65)) + "]"
    prefer = _script(d, "prefer.sh", ["--prefer=" + "p|" * (1 << 19)])  # 1 MB
    het = _script(d, "het.sh", ["-N1", "hetjob", "-N2"])
    return [
        ["sbatch", "--hold", "-N2", str(huge)],
        ["sbatch", "--hold", "-N2", str(prefer)],
        ["sbatch", "--hold", "-N2", "--comment=" + "c" * 100_000, "--wrap", "true"],
        ["sbatch", "--hold", "-N2", "-C", "a&", "--wrap", "true"],
        ["sbatch", "--hold", "-N2", "-C", "a|", "--wrap", "true"],
        ["sbatch", "--hold", "-N2", "-C", "(a|b)&c", "--wrap", "true"],
        ["sbatch", "--hold", "-N2", "-C", many, "--wrap", "true"],
        ["sbatch", "--hold", "-N2", "--array=0-3", "--wrap", "true"],
        ["sbatch", "--hold", str(het)],
        ["sbatch", "--hold", "-N2", "-w", "n1,n3", "--wrap", "true"],
        ["sbatch", "--hold", "-N2", "-w", "n" + ",n".join(map(str, range(1, 9000))),
         "--wrap", "true"],
    ]


def _loop(c: DevCluster, argvs: list[list[str]], until: float, calls: Calls,
          timeout: float = 30) -> None:
    i = 0
    while time.monotonic() < until:
        argv = argvs[i % len(argvs)]
        i += 1
        t0 = time.monotonic()
        try:
            r = c.run(argv, check=False, timeout=timeout)
            calls.ok += r.returncode == 0
        except subprocess.TimeoutExpired:
            calls.failed.append((t0, f"timed out: {argv[:3]}"))
        except OSError as e:  # the test's own mistake (an argument too long): counted
            calls.failed.append((t0, f"could not run {argv[:3]}: {e}"))
        calls.took.append(time.monotonic() - t0)


def test_hostile_submitters_leave_slurmctld_answering_through_reconfigure_and_restart(
    safety_cluster: DevCluster,
) -> None:
    c = safety_cluster
    before = _classes(c)
    start = time.monotonic()
    until = start + WINDOW_S
    hostile = [Calls(), Calls()]
    normal, pings = Calls(), Calls()
    gaps: list[tuple[float, float]] = []  # reconfigure, restart: slurmctld busy on purpose

    def normal_user() -> None:
        while time.monotonic() < until:
            t0 = time.monotonic()
            r = c.run(["sbatch", "--hold", "-N2", "-J", "normal", "--wrap", "true"],
                      check=False, timeout=30)
            normal.took.append(time.monotonic() - t0)
            if r.returncode == 0:
                normal.ok += 1
                c.run(["scancel", r.stdout.split()[-1]], check=False, timeout=30)
            else:
                normal.failed.append((t0, r.stderr.strip()))
            time.sleep(0.3)

    def pinger() -> None:
        while time.monotonic() < until:
            t0 = time.monotonic()
            try:
                r = c.run(["scontrol", "ping"], check=False, timeout=5)
                if " is UP" in r.stdout:
                    pings.ok += 1
                else:
                    pings.failed.append((t0, r.stdout.strip()))
            except subprocess.TimeoutExpired:
                pings.failed.append((t0, "no answer in 5 s"))
            pings.took.append(time.monotonic() - t0)
            time.sleep(0.5)

    def operator() -> None:
        time.sleep(RECONFIGURE_AT_S)
        t0 = time.monotonic()
        c.run(["scontrol", "reconfigure"], timeout=30)
        gaps.append((t0, time.monotonic()))
        time.sleep(RESTART_AT_S - RECONFIGURE_AT_S)
        t0 = time.monotonic()
        c.restart_slurmctld()
        gaps.append((t0, time.monotonic()))

    threads = [threading.Thread(target=_loop, args=(c, _hostile(c), until, h)) for h in hostile]
    threads += [threading.Thread(target=f) for f in (normal_user, pinger, operator)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WINDOW_S + 120)
    assert not any(t.is_alive() for t in threads)
    with contextlib.suppress(subprocess.SubprocessError):
        c.cancel_all()

    release = c.slurm().version()
    print(f"Slurm {release}: hostile {sum(h.ok for h in hostile)} accepted of "
          f"{sum(len(h.took) for h in hostile)}; normal {normal.ok} of {len(normal.took)}, "
          f"slowest {max(normal.took):.2f} s; pings {pings.ok} of {len(pings.took)}, "
          f"slowest {max(pings.took):.2f} s; reconfigure and restart took "
          f"{', '.join(f'{hi - lo:.1f} s' for lo, hi in gaps)}")
    assert not any(h.failed for h in hostile), [h.failed[:3] for h in hostile]
    # slurmctld answered throughout, but while it was reconfigured or restarted on purpose
    # (a ping in flight then may time out: slurmctld's own work, with or without the lua)
    assert len(gaps) == 2
    outside = [(t, why) for t, why in pings.failed
               if not any(lo - 5 <= t <= hi + 1 for lo, hi in gaps)]
    assert not outside, outside
    # every submission of the normal user went through (sbatch retries the controller
    # for MessageTimeout while it restarts), but for the documented gap of 22.05 to
    # 23.02: right after `scontrol reconfigure` the loaded lua still names the class
    # features Slurm just dropped, until the daemon's next pass (docs/scheduling.md)
    # A restart drops the connections in flight: 26.05's sbatch then says "Connection
    # reset by peer" (22.05's and 24.11's reconnect); 22.05's says "Zero Bytes were
    # transmitted or received" when a reconfigure closes one (CI saw it for a submission
    # sent 0.2 s before `scontrol reconfigure`), or "slurm_msg_sendto: ... Unexpected missing
    # socket error" (CI, issue 43's run: a submission sent 1.6 ms after the reconfigure
    # began). Only for a submission in flight then: sent at most one call's time before
    # the window.
    slowest = max(normal.took)
    dropped = [(t, why) for t, why in normal.failed
               if ("Connection reset by peer" in why
                   or "Zero Bytes were transmitted or received" in why
                   or "Unexpected missing socket error" in why)
               and any(lo - slowest <= t <= hi + 1 for lo, hi in gaps)]
    # The gap: a submission in flight while `scontrol reconfigure` runs (sent up to one
    # call's time before it) or sent before the daemon's next pass after it; on a loaded
    # machine that pass may come a few seconds late (CI saw 22.05 refuse until 1.1 s after
    # a reconfigure of 4.0 s; the bound leaves ten).
    lo, hi = gaps[0]
    refused = [(t - start, why) for t, why in normal.failed if (t, why) not in dropped]
    assert all("Invalid feature specification" in why
               and lo - start - slowest <= t <= hi - start + 10 for t, why in refused), (
        refused, (lo - start, hi - start))
    if release >= Release(23, 11):  # reconfigure restarts in place: the lua fails open
        assert not refused, refused
    assert len(dropped) <= 2, dropped
    assert len(normal.took) >= 20
    # and the class features are back after both, as the lua's file says
    wait_until(lambda: _classes(c) == before, 30, "the class features after the restart")
    cf = classfile.read(c.classes_file)
    assert time.time() - cf.verified < 10
