"""The scale rig (issues 31 and 32): a real slurmctld with N nodes defined, an inventory of
the same N in K classes, and what ncclguard asks of it at that size.

For each N of ``--nodes`` (1,024, 4,096 and 16,384): a DevCluster with 2 running slurmd
(n1, n2) and N more nodes defined (``gpu00001``...) that never register, all in partition
``debug``, ``job_submit.lua`` and the features hook installed; N + 2 fingerprints in K
classes (``--classes``, 32: contiguous blocks, class k on NCCL 2.22.k), written as the
collector writes them. Then, each part a ratio to a baseline run in the same process:

- ``gate``: the real ``ncclguard-prolog`` (``python -I -m prolog.gate`` with a
  PrologSlurmctld environment) refusing a 4-node batch allocation of a held job (3 nodes
  of class 0 and 1 of class 1: steered away from that one), each run's peak
  memory taken by ``wait4`` (the gate and every Slurm command it waited for;
  not the detached follow-up). First alone, ``--runs`` times with nothing shared (its
  shared directory emptied), interleaved with ``python -I -c pass`` (the baseline);
  then bursts of ``--burst`` refusals started at once (fresh jobs), each burst with the
  shared directory emptied first. Steered: the follow-up's audit record says ``done``;
  AdminComment: the job's comment starts ``ncclguard: refuse``.
- ``queue``: ``--queue`` more held jobs submitted (10,000), then the same refusals.
- ``sync``: ``ncclguard features sync`` twice (a first pass that sets K features, then one
  with nothing to change), against ``ncclguard --version``.
- ``daemon`` (at the largest N only, unless ``--daemon-at``): slurmctld's CPU over
  ``--daemon-s`` s without the features daemon, then the daemon's own CPU (with the
  Slurm commands it ran) and slurmctld's over the same time with it, after its first
  pass: the steady state, ``verify_s`` 60 s.
- ``lua``: ``sbatch --hold -N2`` (job_submit.lua adds the class group) against
  ``sbatch --hold -N1`` (none), interleaved, ``--runs`` x 3 each.
- ``cli``: ``ncclguard classes``, ``nodes --stale``, ``check`` and ``drain-recommend``,
  each ``--partition debug``, and ``drain-recommend --partition debug --apply`` (it
  reads every node's state; here, with no majority class, it drains nothing), against
  ``ncclguard --version``, with the peak memory of each.
- ``backfill`` (its own cluster: ``--bf-nodes`` running slurmd, busy with one exclusive
  job, and N defined in all): slurmctld's mean backfill cycle (``sdiag``) with 200
  pending two-node jobs whose constraint offers 0, 1, 8 or 32 classes; then, with
  ``--queue`` pending jobs offering 32 classes (backfill busy, holding slurmctld's locks
  up to ``bf_yield_interval`` at a time), bursts of refusals as above.

``--before DIR``: another checkout with its own ``.venv`` (``git archive main`` and
``pip install -e .``): its gate (and follow-up) runs interleaved with this one's, run for
run and burst for burst, and its features daemon after this one's, so that the machine's
load hits both alike; the cluster, the inventory, the sync, the lua and the CLI are this
checkout's.

    .venv/bin/python bench/bench_scale.py                      # every part, 3 sizes
    .venv/bin/python bench/bench_scale.py --nodes 16384 --only gate queue
    scripts/slurm-root.sh run .venv/bin/python bench/bench_scale.py --nodes 16384

Not run by CI (minutes per size). Prints figures and ratios, never asserts a time;
``--json FILE`` keeps them.

Over 500 lines: one rig (a slurmctld with N nodes, an inventory of N in K classes) whose
parts (the gate, the sync, the lua, the CLI, backfill) share its setup and its
baselines, at each N; each part is a function.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from helpers.fingerprints import fingerprint  # noqa: E402

from devtools.devcluster import DevCluster  # noqa: E402
from ncclguard import audit  # noqa: E402
from ncclguard.hostlist import compress  # noqa: E402

PARTS = ("gate", "queue", "sync", "daemon", "lua", "cli", "backfill")
#: Runs a command and prints its peak RSS (``ru_maxrss`` from ``wait4``: the process and
#: every child it waited for) last on stderr, in KiB. A small process of its own forks it:
#: a child's high-water mark starts at its parent's (this bench's would hide the gate's).
LAUNCH = """import os, sys
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[1], sys.argv[1:])
    finally:
        os._exit(127)
_, status, ru = os.wait4(pid, 0)
cpu = ru.ru_utime + ru.ru_stime
sys.stderr.write(f"\\nncg-cpu {cpu:.4f}\\nncg-maxrss {ru.ru_maxrss}\\n")
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""
RESULTS: dict[str, Any] = {}
SIZE = {"n": 0}  # the N being measured: each size's figures are kept under it


def _record(key: str, value: Any) -> None:
    RESULTS.setdefault(str(SIZE["n"]), {})[key] = value


def _wait(pred: Callable[[], object], timeout: float, what: str, every: float = 0.2) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise SystemExit(f"bench_scale: timed out waiting for {what}")
        time.sleep(every)


def _timed(argv: Sequence[str], env: dict[str, str], ok: Sequence[int] = (0,),
           timeout: float = 600) -> tuple[float, float, str]:
    """(wall s, peak RSS in MB of the process and the children it waited for, stderr)."""
    t = time.perf_counter()
    r = subprocess.run([*_measured(), *argv], env=env, capture_output=True, text=True,
                       timeout=timeout)
    dt = time.perf_counter() - t
    if r.returncode not in ok:
        raise SystemExit(f"{argv} -> {r.returncode}: {r.stderr[-2000:]}")
    return dt, _rss(r.stderr), r.stderr


def _med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Rig:
    """One cluster of N defined nodes in K classes, and the python that runs ncclguard."""

    def __init__(self, root: Path, n: int, k: int, codes: dict[str, str], running: int = 2,
                 extra_conf: str = "", job_submit: bool = True) -> None:
        self.n, self.k, self.codes = n, k, codes
        self.python = next(iter(codes.values()))  # the sync, the lua's file, the CLI
        self.gpus = [f"gpu{i:05d}" for i in range(1, n + 1)]
        # no SlurmctldPrimaryOnProg: its sync at start would leave "features sync" nothing
        # to do (the lua, the daemon and the CLI are measured, not the hook)
        conf = "MaxJobCount=40000\nSlurmctldPrimaryOnProg=/bin/true\n" + extra_conf
        shutil.rmtree(root, ignore_errors=True)  # a new cluster each time (its own name)
        self.c = DevCluster(root, nodes=running, cpus=1 if running > 2 else 2, prolog=False,
                            job_submit=job_submit, extra_nodes=self.gpus, python=self.python,
                            extra_conf=conf)
        self.jobs: list[int] = []

    def cls(self, i: int) -> int:
        """The class of gpu i (1-based): contiguous blocks."""
        return (i - 1) * self.k // self.n

    def first_of(self, k: int) -> str:
        return next(h for i, h in enumerate(self.gpus, 1) if self.cls(i) == k)

    def start(self) -> None:
        c = self.c
        t = time.perf_counter()
        c.start(timeout=300)
        c.write_gate_config(f'[gate]\naudit_log = "{c.audit_path}"\nslurm_conf = "{c.conf}"\n'
                            f'steer_wait_s = 30\n[features]\nclasses_file = "{c.classes_file}"\n')
        fps = [fingerprint(h, nccl="2.22.0") for h in c.node_names]
        fps += [fingerprint(h, nccl=f"2.22.{self.cls(i)}") for i, h in enumerate(self.gpus, 1)]
        c.store_fingerprints(fps)
        print(f"  cluster of {self.n:,} + {len(c.node_names)} nodes in {self.k} classes ready "
              f"in {time.perf_counter() - t:.0f} s (Slurm {c.slurm().version()})", flush=True)

    def env(self, **extra: str) -> dict[str, str]:
        return {**self.c.env, "NCCLGUARD_CONFIG": str(self.c.config_path),
                "NCCLGUARD_DB": str(self.c.db), **extra}

    def held_jobs(self, count: int, name: str = "refuse") -> list[int]:
        return [self.c.sbatch(["--hold", "-N4", "-J", name, "--wrap", "true"])
                for _ in range(count)]

    def submit_many(self, count: int, args: Sequence[str], workers: int = 4) -> float:
        t = time.perf_counter()

        def one(_: int) -> None:
            for attempt in range(6):  # "Socket timed out" when the machine is loaded
                r = self.c.run(["sbatch", *args], timeout=120, check=False)
                if r.returncode == 0:
                    return
                time.sleep(2**attempt)
            raise SystemExit(f"sbatch {' '.join(args)}: {r.stderr.strip()}")

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, range(count)))
        return time.perf_counter() - t

    # ------------------------------------------------------------------ the gate
    def gate_env(self, job: int) -> dict[str, str]:
        nodes = [self.gpus[0], self.gpus[1], self.gpus[2], self.first_of(1)]  # odd: class 1
        return self.env(
            SLURM_JOB_ID=str(job), SLURM_JOB_NODELIST=compress(nodes), SLURM_JOB_NUM_NODES="4",
            SLURM_JOB_PARTITION="debug", SLURM_JOB_USER="bench", SLURM_JOB_UID="0",
            SLURM_JOB_STDIN="/dev/null", SLURM_JOB_RESTART_COUNT="0",
            SLURM_SCRIPT_CONTEXT="prolog_slurmctld")

    def clear_shared(self) -> None:
        shutil.rmtree(self.c.audit_path.parent / "gate-shared", ignore_errors=True)

    def outcome(self, jobs: Sequence[int], wait_s: float = 60) -> tuple[int, int, int]:
        """(steered, requeued/held without steering, AdminComment set) for ``jobs``."""
        def followups() -> dict[int, str]:
            out = {}
            for r in audit.read(self.c.audit_path):
                if r.get("job") in jobs and r.get("decision") == "followup":
                    out[r["job"]] = r.get("result", "")
            return out

        refusals = {r["job"]: r for r in audit.read(self.c.audit_path)
                    if r.get("job") in jobs and r.get("decision") == "refuse"}
        steering = [j for j, r in refusals.items() if r.get("action") == "steer"]
        _wait(lambda: set(steering) <= set(followups()), wait_s, "the follow-ups", every=0.5)
        done = followups()
        steered = sum(1 for j in steering if done.get(j) == "done")
        s = self.c.slurm()
        comments = 0
        for j in jobs:
            info = s.job_brief(j)
            comments += bool(info and info.admin_comment.startswith("ncclguard: refuse"))
        return steered, len(jobs) - steered, comments

    def burst(self, python: str, burst: Sequence[int]) -> dict[str, Any]:
        """``burst`` refusals started at once by ``python``'s gate; what each took."""
        c = self.c
        self.clear_shared()
        load = _load()
        argv = [python, "-I", "-m", "prolog.gate"]
        t0 = time.perf_counter()
        procs = [subprocess.Popen([*_measured(), *argv], env=self.gate_env(job),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for job in burst]
        ends: list[float] = [0.0] * len(burst)
        errs = [""] * len(burst)
        pending = set(range(len(burst)))
        while pending:
            for i in list(pending):
                if procs[i].poll() is not None:
                    ends[i] = time.perf_counter() - t0
                    stream = procs[i].stderr
                    errs[i] = stream.read() if stream is not None else ""
                    pending.discard(i)
            time.sleep(0.005)
        recs = [r for r in audit.read(c.audit_path)
                if r.get("job") in burst and r.get("decision") == "refuse"]
        own = [r.get("duration_ms", 0) / 1000 for r in recs]
        steered, _, comments = self.outcome(burst)
        return {"median_s": _med(ends), "max_s": max(ends), "own_median_s": _med(own),
                "own_max_s": max(own, default=0.0), "cpu_s": _med([_cpu(e) for e in errs]),
                "rss_max_mb": max(_rss(e) for e in errs), "steered": steered,
                "comments": comments, "n": len(burst), "load": load,
                "shared": sorted({str(r.get("shared", "-")) for r in recs}),
                "errors": sum("ERROR" in e for e in errs)}

    def refusals(self, label: str, runs: int, bursts: Sequence[int]) -> None:
        """Refusals alone and in bursts, by each code in turn (interleaved: the machine's
        load hits them alike)."""
        base_env = {"PATH": "/usr/bin:/bin", "LANG": "C"}
        codes = self.codes
        jobs = self.held_jobs(len(codes) * (runs + 1 + sum(bursts)))
        for python in codes.values():
            self.clear_shared()
            _timed([python, "-I", "-m", "prolog.gate"], self.gate_env(jobs.pop()), ok=(0, 1))
        single: dict[str, dict[str, list[float]]] = {
            name: {"wall": [], "base": [], "rss": [], "cpu": [], "errors": []} for name in codes}
        load = _load()
        for _ in range(runs):
            for name, python in codes.items():
                got = single[name]
                got["base"].append(_timed([python, "-I", "-c", "pass"], base_env)[0])
                self.clear_shared()
                dt, rss, err = _timed([python, "-I", "-m", "prolog.gate"],
                                      self.gate_env(jobs.pop()), ok=(0, 1))
                got["wall"].append(dt)
                got["rss"].append(rss)
                got["cpu"].append(_cpu(err))
                got["errors"].append(float("ERROR" in err))
        for name, got in single.items():
            w, b = got["wall"], _med(got["base"])
            print(f"  {label} [{name}]: one refusal alone, {runs} runs ({load}): median "
                  f"{_med(w):.2f} s (max {max(w):.2f} s) = {_med(w) / b:.1f}x python -I -c "
                  f"pass ({b * 1000:.0f} ms); CPU {_med(got['cpu']) * 1000:.0f} ms; peak RSS "
                  f"median {_med(got['rss']):.0f} MB (max {max(got['rss']):.0f}); "
                  f"{sum(got['errors']):.0f} with ERROR", flush=True)
            _record(f"{label}/{name}/single", {
                "median_s": _med(w), "max_s": max(w), "baseline_s": b,
                "rss_mb": _med(got["rss"]), "rss_max_mb": max(got["rss"]),
                "cpu_s": _med(got["cpu"]), "errors": sum(got["errors"]), "load": load})
        for size in bursts:
            for name, python in codes.items():
                r = self.burst(python, [jobs.pop() for _ in range(size)])
                print(f"  {label} [{name}]: {size} refusals at once ({r['load']}): wall "
                      f"median {r['median_s']:.2f} s, max {r['max_s']:.2f} s (the gate's "
                      f"own: median {r['own_median_s']:.2f} s, max {r['own_max_s']:.2f} s); "
                      f"CPU median {r['cpu_s'] * 1000:.0f} ms; steered {r['steered']} of "
                      f"{size}; AdminComment {r['comments']} of {size}; peak RSS max "
                      f"{r['rss_max_mb']:.0f} MB; {r['errors']} with ERROR; shared: "
                      f"{', '.join(r['shared'])}", flush=True)
                _record(f"{label}/{name}/burst{size}", r)

    # ------------------------------------------------------------- the features
    def sync(self) -> None:
        env = self.env()
        cli = [self.python, "-m", "ncclguard.cli"]
        base = _med([_timed([*cli, "--version"], env)[0] for _ in range(3)])
        said = []
        walls = []
        for _ in range(2):
            t = time.perf_counter()
            out = subprocess.run([*cli, "features", "sync"], env=env, capture_output=True,
                                 text=True, timeout=900).stdout
            walls.append(time.perf_counter() - t)
            said += [ln.strip() for ln in out.splitlines() if "nodes updated" in ln] or [out]
        first, second = walls
        print(f"  features sync: first pass {first:.2f} s ({said[0]}), again {second:.2f} s "
              f"({said[1]}); {second / base:.1f}x ncclguard --version ({base:.2f} s)",
              flush=True)
        _record("sync", {"first_s": first, "again_s": second, "baseline_s": base})

    def daemon(self, seconds: float) -> None:
        """Each code's features daemon over ``seconds`` after its first pass, one after
        the other (slurmctld's CPU in each window, and in one without a daemon)."""
        c = self.c
        ctld = c._procs["slurmctld"].pid
        idle = _cpu_over(ctld, None, seconds)[0]
        print(f"  features daemon, steady state (verify_s 60 s) over {seconds:.0f} s; "
              f"slurmctld without one: {idle * 100:.1f} % of a core ({_load()})", flush=True)
        _record("daemon/slurmctld_idle", idle)
        for name, python in self.codes.items():
            c.python = python
            log = c.root / "log" / "features.out"
            start = log.stat().st_size if log.exists() else 0
            c.start_features_daemon()
            pid = c._procs["features"].pid
            _wait(lambda log=log, start=start: b"first pass" in log.read_bytes()[start:],
                  600, "the first pass")
            time.sleep(2)
            load = _load()
            ctld_busy, own = _cpu_over(ctld, pid, seconds)
            c.stop_features_daemon()
            said = log.read_bytes()[start:].decode(errors="replace")
            syncs = said.count("nodes updated in") - 1
            print(f"    [{name}] {own * 100:.1f} % of a core (itself and its Slurm commands); "
                  f"slurmctld {ctld_busy * 100:.1f} %; {syncs} full syncs after the first "
                  f"({load})", flush=True)
            _record(f"daemon/{name}", {"own": own, "slurmctld": ctld_busy, "seconds": seconds,
                                       "full_syncs": syncs, "load": load})
        c.python = self.python

    # ----------------------------------------------------------- lua and CLI
    def lua(self, runs: int) -> None:
        group: list[float] = []
        plain: list[float] = []
        for _ in range(runs):
            for args, out in ((["-N2"], group), (["-N1"], plain)):
                t = time.perf_counter()
                self.c.run(["sbatch", "--hold", "-J", "lua", *args, "--wrap", "true"])
                out.append(time.perf_counter() - t)
        job = self.c.sbatch(["--hold", "-N2", "-J", "lua", "--wrap", "true"])
        feats = self.c.job_field(job, "Features")
        self.c.run(["scancel", "--name", "lua"], check=False)
        print(f"  job_submit.lua: sbatch -N2 (group of {feats.count('|') + 1} classes) median "
              f"{_med(group) * 1000:.1f} ms, -N1 (no group) {_med(plain) * 1000:.1f} ms: "
              f"{_med(group) / _med(plain):.2f}x", flush=True)
        _record("lua", {"group_ms": _med(group) * 1000, "plain_ms": _med(plain) * 1000,
                        "classes": feats.count("|") + 1})

    def cli(self, runs: int) -> None:
        env = self.env()
        cli = [self.python, "-m", "ncclguard.cli"]
        # a tie (one node of each of two classes): the tie-break asks for the partition
        two = compress([self.gpus[0], self.first_of(1)])
        commands = {
            "--version": ["--version"],
            "classes -p": ["classes", "--partition", "debug"],
            "nodes -p --stale": ["nodes", "--partition", "debug", "--stale"],
            "check -p (a tie)": ["check", two, "--partition", "debug"],
            "drain-recommend -p": ["drain-recommend", "--partition", "debug"],
            "drain-recommend -p --apply": ["drain-recommend", "--partition", "debug", "--apply"],
        }
        base = 0.0
        out = {}
        for name, args in commands.items():
            walls, rss = [], []
            for _ in range(runs):
                dt, rss_, _ = _timed([*cli, *args], env, ok=(0, 1, 2))
                walls.append(dt)
                rss.append(rss_)
            m = _med(walls)
            base = base or m
            out[name] = {"median_s": m, "rss_mb": max(rss)}
            print(f"  ncclguard {name:28s} {m:6.2f} s  {m / base:5.1f}x  peak RSS "
                  f"{max(rss):5.0f} MB", flush=True)
        _record("cli", out)


def _measured() -> list[str]:
    return [sys.executable, "-I", "-S", "-c", LAUNCH]


def _rss(err: str) -> float:
    """The peak RSS the launcher printed last, in MB."""
    for line in reversed(err.splitlines()):
        if line.startswith("ncg-maxrss "):
            return int(line.split()[-1]) / 1024
    return 0.0


def _cpu(err: str) -> float:
    """The CPU seconds (user + system, with the children it waited for) it printed."""
    for line in reversed(err.splitlines()):
        if line.startswith("ncg-cpu "):
            return float(line.split()[-1])
    return 0.0


def _load() -> str:
    return "load " + Path("/proc/loadavg").read_text().split()[0]


def _ticks(pid: int) -> tuple[int, int]:
    """(own utime+stime, waited-for children's) of ``pid``, in clock ticks."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12]), int(f[13]) + int(f[14])


def _cpu_over(ctld: int, pid: int | None, seconds: float) -> tuple[float, float]:
    """(slurmctld's share of a core, ``pid``'s with its children's) over ``seconds``."""
    hz = os.sysconf("SC_CLK_TCK")
    c0 = _ticks(ctld)[0]
    p0 = sum(_ticks(pid)) if pid else 0
    time.sleep(seconds)
    c1 = _ticks(ctld)[0]
    p1 = sum(_ticks(pid)) if pid else 0
    return (c1 - c0) / hz / seconds, (p1 - p0) / hz / seconds


def _sdiag(c: DevCluster) -> tuple[float, float, int]:
    """(mean backfill cycle, last cycle, cycles) since ``sdiag -r``, in microseconds."""
    bf = c.run(["sdiag"]).stdout.split("Backfilling stats", 1)[1]
    got = {k: re.search(rf"{k}:\s+(\d+)", bf) for k in ("Total cycles", "Mean cycle",
                                                         "Last cycle")}
    if not all(got.values()):
        return 0.0, 0.0, 0
    return (float(got["Mean cycle"][1]), float(got["Last cycle"][1]),  # type: ignore[index]
            int(got["Total cycles"][1]))  # type: ignore[index]


def backfill(root: Path, n: int, a: argparse.Namespace, codes: dict[str, str]) -> None:
    """Its own cluster (``--bf-nodes`` running, ``n`` defined in all)."""
    running = a.bf_nodes
    conf = ("SchedulerParameters=sched_min_interval=0,bf_interval=1,bf_continue,"
            "bf_max_job_test=20000\n")
    rig = Rig(root, n - running, 32, codes, running=running, extra_conf=conf,
              job_submit=False)
    rig.start()
    c = rig.c
    hold = c.sbatch(["-N", str(running), "--exclusive", "--wrap", "sleep 36000"])
    c.wait_job(hold, {"RUNNING"}, 300)
    if a.bf_classes:
        print(f"  backfill: {running} running nodes busy, {n:,} defined; mean cycle with 200 "
              "pending two-node jobs offering k classes:", flush=True)
    base = 0.0
    for k in a.bf_classes:
        c.run(["scancel", "--state=PENDING", "--user", "root"], check=False)
        # every defined node gets one of the k features: the running ones round robin,
        # the others in contiguous blocks (Slurm's feature bitmaps span every node)
        for i in range(k or 1):
            nodes = [h for j, h in enumerate(c.node_names) if not k or j % k == i]
            nodes += [h for j, h in enumerate(rig.gpus) if not k or j * k // len(rig.gpus) == i]
            feat = f"f{i}" if k else ""
            c.run(["scontrol", "update", f"NodeName={compress(nodes)}",
                   f"AvailableFeatures={feat}", f"ActiveFeatures={feat}"])
        constraint = ["-C", "[" + "|".join(f"f{i}" for i in range(k)) + "]"] if k else []
        rig.submit_many(200, ["-N2", *constraint, "--wrap", "true"], workers=4)
        c.run(["sdiag", "-r"])
        _wait(lambda: _sdiag(c)[2] >= a.cycles, 900, f"{a.cycles} backfill cycles", every=1)
        mean = _sdiag(c)[0]
        base = base or mean
        print(f"    {k:2d} classes: mean cycle {mean / 1000:8.1f} ms  {mean / base:.2f}x",
              flush=True)
        _record(f"backfill/k{k}", mean)
    if a.queue:
        c.run(["scancel", "--state=PENDING", "--user", "root"], check=False)
        for i in range(32):
            nodes = [h for j, h in enumerate(c.node_names) if j % 32 == i]
            nodes += [h for j, h in enumerate(rig.gpus) if j * 32 // len(rig.gpus) == i]
            c.run(["scontrol", "update", f"NodeName={compress(nodes)}",
                   f"AvailableFeatures=f{i}", f"ActiveFeatures=f{i}"])
        group = "[" + "|".join(f"f{i}" for i in range(32)) + "]"
        took = rig.submit_many(a.queue, ["-N2", "-C", group, "--wrap", "true"])
        c.run(["sdiag", "-r"])
        time.sleep(15)
        mean, last, cycles = _sdiag(c)
        print(f"  backfill: {a.queue:,} pending jobs offering 32 classes (submitted in "
              f"{took:.0f} s): {cycles} cycles in 15 s, mean {mean / 1e6:.2f} s, last "
              f"{last / 1e6:.2f} s", flush=True)
        _record("backfill/queue", {"mean_s": mean / 1e6, "last_s": last / 1e6})
        rig.refusals("during backfill", a.runs, a.burst)
    c.stop()


def one_size(base: Path, n: int, a: argparse.Namespace, codes: dict[str, str]) -> None:
    print(f"\n== N = {n:,} defined nodes, {a.classes} classes", flush=True)
    SIZE["n"] = n
    parts = set(a.only)
    if parts - {"backfill"}:
        rig = Rig(base / f"n{n}", n, a.classes, codes)
        rig.start()
        try:
            if "sync" in parts or "lua" in parts or "daemon" in parts:
                rig.sync()
            if "gate" in parts:
                rig.refusals("gate", a.runs, a.burst)
            if "lua" in parts:
                rig.lua(a.runs * 3)
            if "cli" in parts:
                rig.cli(max(a.runs // 2, 3))
            if "daemon" in parts and n in (a.daemon_at or [max(a.nodes)]):
                rig.daemon(a.daemon_s)
            if "queue" in parts and a.queue and n in (a.queue_at or [max(a.nodes)]):
                took = rig.submit_many(a.queue, ["--hold", "-J", "queued", "--wrap", "true"])
                print(f"  queue: {a.queue:,} held jobs submitted in {took:.0f} s", flush=True)
                rig.refusals(f"{a.queue} queued", a.runs, a.burst)
        finally:
            rig.c.stop()
    if "backfill" in parts and n == max(a.nodes):
        backfill(base / f"bf{n}", n, a, codes)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--classes", type=int, default=32)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--burst", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--queue", type=int, default=10000)
    p.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--queue-at", type=int, nargs="*", default=None,
                   help="the sizes with the queue part (default: the largest)")
    p.add_argument("--daemon-s", type=float, default=130.0)
    p.add_argument("--daemon-at", type=int, nargs="*", default=None)
    p.add_argument("--bf-nodes", type=int, default=64)
    p.add_argument("--bf-classes", type=int, nargs="*", default=[0, 1, 8, 32],
                   help="the classes offered in the backfill cycle part (none: skip it)")
    p.add_argument("--cycles", type=int, default=10)
    p.add_argument("--before", type=Path, default=None,
                   help="another checkout with its .venv: its gate and daemon measured too, "
                        "interleaved with this one's")
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    codes = {"this": sys.executable}
    if a.before:
        codes["before"] = str(a.before / ".venv" / "bin" / "python")
    base = a.dir or Path(tempfile.mkdtemp(prefix="bench-scale-"))
    who = f"this checkout and, interleaved, {a.before}" if a.before else "this checkout"
    print(f"bench_scale: {who}, python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"under {base}", flush=True)
    try:
        for n in a.nodes:
            one_size(base, n, a, codes)
    finally:
        if a.json:
            a.json.write_text(json.dumps(RESULTS, indent=1, sort_keys=True))
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
