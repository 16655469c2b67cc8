"""Collector benchmarks: cold ingest and heartbeats of N signed node records, and the
gate's latency while the collector writes.

Real MUNGE throughout: four private munged (one key, origins 127.42.0.1-4) sign the
nodes' records, a fifth (the controller's) decodes them for the collector, and a sixth
decodes them for the baselines (its own replay cache, so that both see fresh
credentials). Fingerprints are ``fingerprint(host, plugin_abi=8, offers=True)`` of
``tests/helpers/fingerprints.py`` (4.2 KB of JSON; 2.6 KB before issue 39's offers
part); every node's address is its signing munged's origin in
``[collector.addresses]``. Records are
signed before anything is timed (signing is the nodes' cost, not the collector's) into
a staging directory and published by one ``rename`` each, as ``spool.write`` ends, but
without its fsyncs (the nodes write a shared filesystem, not this disk).

The machine is shared and noisy, so every figure is printed with a ratio against a
baseline measured in the same run:

1. Cold ingest: one ``Collector.scan()`` of N new records into an empty inventory, wall
   and CPU (``time.process_time()`` of this process; the controller munged's CPU from
   psutil; bytes passed to write(2), ``wchar`` of /proc/self/io). Baseline: a bare loop
   over the same files: read, bare ``munge.decode``, ``json.loads`` of the payload,
   INSERT of the fingerprint JSON into a bare sqlite3 table, one transaction, WAL, same
   directory. Target: the scan within 60 s for 16,384 records.
2. Heartbeats: every node republishes the same fingerprint (new credentials); one
   ``scan()``, per record. Baseline: bare read + ``munge.decode`` of the same files.
   Also one scan of an unchanged spool (what an idle collector pays per
   ``scan_interval_s``), and, for comparison, one scan of N changed fingerprints.
3. Gate latency while the collector ingests. The gate is timed two ways, both the real
   code: (a) the program Slurm runs, ``python -I -m prolog.gate`` with a PrologSlurmctld
   environment, one process per run (as ``bench_prolog.py``; the accept path asks Slurm
   nothing, so no Slurm is needed); (b) its decision, ``prolog.gate.main(env)`` (config,
   ``Inventory(readonly=True, values=GATE_VALUES).load_values(hosts)``,
   ``evaluate_values``, the audit line), called in a warm long-lived process, without
   interpreter start-up, so that what the inventory read itself suffers shows. Each for
   an allocation of 1,024 and of N nodes, median and p95 of ``--runs``, interleaved,
   (idle) while a collector process has nothing to ingest (it scans the unchanged spool
   every ``scan_interval_s`` = 2 s, as the service does), then (busy) while a feeder
   process publishes pre-signed *changed* fingerprints (a new ``boot_id``: the policy's
   values do not change, so the gate still accepts) a few thousand records ahead of
   what the collector has accepted, and the collector rescans 0.05 s after each scan
   that found work, so that it always has a batch to write. The collector process is
   the real ``Collector``; the bench only wraps ``Inventory.ingest`` to log each write
   transaction's start and end (CLOCK_MONOTONIC, shared by all processes) and counts
   the timed gate runs that overlapped one. Done with the collector at nice 0 and at
   nice 10 (a systemd unit's ``Nice=10``); the CPU shares of the collector, the feeder
   (an artifact of the bench) and the controller's munged are printed. Target:
   busy/idle within 1.2x. A control follows, without a collector: the same gate runs
   alone and beside a process that only burns one CPU (nice 0, nice 10), to tell what
   any CPU load does to the gate on this machine from what the collector's writes do.

    .venv/bin/python bench/bench_collector.py [--dir DIR] [--nodes 16384] [--runs 25]
    .venv/bin/python bench/bench_collector.py --quick        # 2,048 nodes, 8 runs
    .venv/bin/python bench/bench_collector.py --no-gate --profile --nodes 4096

Prints figures and ratios; never asserts a time (timed tests are not tests).

Over 500 lines: one rig (16,384 records signed by real munged, the collector, the gate
beside it) whose parts share its setup and its baselines; each part is a function.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import math
import multiprocessing as mp
import os
import pstats
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # devtools/ is not installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.fingerprints import fingerprint

from devtools.devcluster import Munged, write_munge_key
from inventoryd.controller.addresses import Addresses
from inventoryd.controller.collector import Collector, ScanResult
from ncclguard import munge, spool
from ncclguard.config import Config, from_dict

NODE_ORIGINS = ("127.42.0.1", "127.42.0.2", "127.42.0.3", "127.42.0.4")
CONTROLLER_ORIGIN = "127.42.255.254"
BASELINE_ORIGIN = "127.42.255.253"
TTL_S = 3600
IDLE_SCAN_S = 2.0  # the service's default scan_interval_s
BUSY_SCAN_S = 0.05  # rescan this soon after a scan that found work: continuous writes


def node_name(i: int) -> str:
    return f"n{i:05d}"


def node_fp(i: int, variant: int) -> dict[str, Any]:
    """Node ``i``'s fingerprint; ``variant`` > 0 is a changed one (a reboot: a new
    ``boot_id``, which the policy does not compare)."""
    try:  # what a current daemon sends: with the offers part of issue 39
        fp = fingerprint(node_name(i), plugin_abi=8, offers=True)
    except TypeError:  # run from a checkout before issue 39 (bench/ copied into it)
        fp = fingerprint(node_name(i), plugin_abi=8)
    if variant:
        fp["host"]["boot_id"] = f"{variant:08x}"
    return fp


# ---------------------------------------------------------------------- signing, spool


def _sign_chunk(args: tuple[Path, list[int], int, list[str]]) -> None:
    stage, indexes, variant, sockets = args
    for i in indexes:
        cred = munge.encode(spool.payload(node_fp(i, variant)),
                            socket_path=sockets[i % len(sockets)], ttl=TTL_S)
        (stage / spool.record_name(node_name(i))).write_bytes(cred + b"\n")


def sign(stage: Path, nodes: int, variants: Sequence[int], sockets: list[str]) -> list[Path]:
    """For each variant, a directory under ``stage`` holding every node's record file,
    signed by node ``i``'s munged (``sockets[i % len]``); in variant order, so that
    their encode times never go back. Four processes: munged answers in parallel."""
    out = []
    with mp.get_context("fork").Pool(4) as pool:
        for v in variants:
            d = stage / f"v{v}"
            d.mkdir(parents=True)
            idx = list(range(1, nodes + 1))
            pool.map(_sign_chunk, [(d, idx[k : k + 256], v, sockets)
                                   for k in range(0, nodes, 256)])
            out.append(d)
    return out


def publish(stage: Path, spool_dir: Path, host: str) -> None:
    """A staged record into the spool, as ``spool.write`` ends: its mtime set to now (a
    record the collector sees soon after it was written is "racily clean" to it, and
    read once more at a later scan) and one atomic rename (without ``spool.write``'s
    fsyncs: the nodes' writes to a shared filesystem are not this disk's)."""
    name = spool.record_name(host)
    os.utime(stage / name)
    os.rename(stage / name, spool_dir / name)


def publish_round(stage: Path, spool_dir: Path, nodes: int) -> None:
    for i in range(1, nodes + 1):
        publish(stage, spool_dir, node_name(i))
    stage.rmdir()


# ---------------------------------------------------------------------- measuring


@dataclass
class Cost:
    wall: float = 0.0
    cpu: float = 0.0  # this process
    munged_cpu: float = 0.0  # the decoding munged
    written: int = 0  # bytes this process passed to write(2) and friends (/proc/self/io)


def _wchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


@contextlib.contextmanager
def measured(munged: Munged) -> Iterator[Cost]:
    assert munged.proc is not None
    proc = psutil.Process(munged.proc.pid)

    def munged_cpu() -> float:
        t = proc.cpu_times()
        return t.user + t.system

    cost = Cost()
    gc.collect()
    b0, m0, c0, w0 = _wchar(), munged_cpu(), time.process_time(), time.perf_counter()
    yield cost
    cost.wall = time.perf_counter() - w0
    cost.cpu = time.process_time() - c0
    cost.munged_cpu = munged_cpu() - m0
    cost.written = _wchar() - b0


def record_files(spool_dir: Path) -> list[str]:
    return [e.path for e in os.scandir(spool_dir) if e.name.endswith(spool.SUFFIX)
            and not e.name.startswith(".")]


def baseline_ingest(spool_dir: Path, db: Path, munged: Munged) -> tuple[Cost, int]:
    """Read, bare decode, json.loads, INSERT of each record: one transaction, WAL."""
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode = wal")
    conn.execute("CREATE TABLE IF NOT EXISTS t (host TEXT PRIMARY KEY, fp TEXT)")
    sock = str(munged.socket)
    n = 0
    with measured(munged) as cost:
        conn.execute("BEGIN IMMEDIATE")
        for path in record_files(spool_dir):
            with open(path, "rb") as f:
                data = f.read()
            doc = json.loads(munge.decode(data.strip(), socket_path=sock).payload)
            conn.execute("INSERT OR REPLACE INTO t VALUES (?, ?)",
                         (doc["host"], json.dumps(doc["fingerprint"])))
            n += 1
        conn.execute("COMMIT")
    conn.close()
    return cost, n


def baseline_decode(spool_dir: Path, munged: Munged) -> tuple[Cost, int]:
    """Read and bare decode of each record."""
    sock = str(munged.socket)
    n = 0
    with measured(munged) as cost:
        for path in record_files(spool_dir):
            with open(path, "rb") as f:
                data = f.read()
            munge.decode(data.strip(), socket_path=sock)
            n += 1
    return cost, n


def timed_scan(c: Collector, munged: Munged, profile: bool) -> tuple[Cost, ScanResult]:
    prof = cProfile.Profile() if profile else None
    with measured(munged) as cost:
        if prof is not None:
            prof.enable()
        res = c.scan()
        if prof is not None:
            prof.disable()
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        print("   cProfile of that scan, by own time:")
        print("\n".join("     " + line for line in s.getvalue().splitlines()[4:]))
    return cost, res


def pct(xs: list[float], p: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[p - 1] if len(xs) > 1 else xs[0]


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


# ---------------------------------------------------------------------- processes


@dataclass
class CollectorRun:
    txns: list[tuple[float, float, int]] = field(default_factory=list)  # write transactions
    scans: list[tuple[float, float, int, int, int]] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)


def collector_worker(
    cfg: Config, db: Path, spool_dir: Path, nice: int, stop: Any, caught_up: Any,
    accepted: Any, q: Any,
) -> None:
    """The real Collector in a process of its own, scanning until ``stop``."""
    os.nice(nice)
    c = Collector(cfg, db=db, spool_dir=spool_dir, addresses=bench_addresses(cfg))
    run = CollectorRun()
    ingest = c.inv.ingest

    def logged_ingest(records: Any, *args: Any, **kwargs: Any) -> list[str]:
        t0 = time.monotonic()
        out = ingest(records, *args, **kwargs)
        run.txns.append((t0, time.monotonic(), len(records)))
        with accepted.get_lock():
            accepted.value += len(records)
        return out

    c.inv.ingest = logged_ingest  # type: ignore[method-assign]
    try:
        while not stop.is_set():
            t0 = time.monotonic()
            res = c.scan(stop.is_set)  # stops between records; what was judged is written
            if stop.is_set():
                break
            run.scans.append((t0, time.monotonic(), res.read, len(res.accepted),
                              len(res.rejected)))
            run.statuses.update(res.accepted.values())
            run.statuses.update(f"rejected: {v}" for v in res.rejected.values())
            if res.read == 0 and res.deferred == 0:
                caught_up.set()
            stop.wait(BUSY_SCAN_S if res.read else IDLE_SCAN_S)
    finally:
        c.close()
    q.put(run)


def feeder_worker(spool_dir: Path, rounds: list[Path], nodes: int, rate: float, backlog: int,
                  accepted: Any, stop: Any, q: Any) -> None:
    """Publish staged changed records, round after round (each in its own random order),
    about ``backlog`` records ahead of what the collector has accepted (so that it always
    has work and records are seldom overwritten unread), at most ``rate`` per second."""
    rng = random.Random(42)
    t0 = time.monotonic()
    written = 0
    start = accepted.value
    for stage in rounds:
        order = list(range(1, nodes + 1))
        rng.shuffle(order)
        for i in order:
            while written - (accepted.value - start) >= backlog and not stop.is_set():
                time.sleep(0.005)
            if stop.is_set():
                q.put((written, False))
                return
            publish(stage, spool_dir, node_name(i))
            written += 1
            ahead = t0 + written / rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
    q.put((written, True))  # ran dry: every pre-signed record was written


def gate_worker(conn: Connection, environ: dict[str, str]) -> None:
    """``prolog.gate.main(env)`` on request, timed, in a warm process (no start-up)."""
    os.environ.update(environ)
    import prolog.gate

    gc.disable()  # as run_as_program
    while True:
        env = conn.recv()
        if env is None:
            return
        old, sys.stderr = sys.stderr, io.StringIO()
        try:
            t0 = time.monotonic()
            rc = prolog.gate.main(env)
            t1 = time.monotonic()
            err = sys.stderr.getvalue()
        finally:
            sys.stderr = old
        conn.send((t0, t1, rc, err))
        gc.collect()


# ---------------------------------------------------------------------- the gate


@dataclass
class Gate:
    argv: list[str]
    envs: dict[int, dict[str, str]]  # allocation size -> the program's environment
    conn: Connection

    def program(self, size: int) -> tuple[float, float]:
        t0 = time.monotonic()
        r = subprocess.run(self.argv, env=self.envs[size], capture_output=True, timeout=60)
        t1 = time.monotonic()
        _check_gate(r.returncode, r.stderr.decode(errors="replace"))
        return t0, t1

    def decision(self, size: int) -> tuple[float, float]:
        self.conn.send(self.envs[size])
        t0, t1, rc, err = self.conn.recv()
        _check_gate(rc, err)
        return t0, t1


def _check_gate(rc: int, err: str) -> None:
    # a gate that failed open is fast, and measures nothing
    if rc != 0 or "ERROR" in err or " accept " not in err:
        raise SystemExit(f"the gate did not accept cleanly (exit {rc}): {err[-2000:]}")


Samples = dict[tuple[str, int], list[tuple[float, float]]]


def gate_block(gate: Gate, sizes: list[int], runs: int) -> Samples:
    """``runs`` timed runs of each kind and size, interleaved, after one untimed each."""
    kinds: dict[str, Callable[[int], tuple[float, float]]] = {
        "program": gate.program, "decision": gate.decision,
    }
    for fn in kinds.values():
        for size in sizes:
            fn(size)
    out: Samples = {(k, s): [] for k in kinds for s in sizes}
    for _ in range(runs):
        for k, fn in kinds.items():
            for size in sizes:
                out[k, size].append(fn(size))
                time.sleep(0.01)
    return out


def overlaps(t0: float, t1: float, txns: list[tuple[float, float, int]]) -> bool:
    """Whether ``[t0, t1]`` overlaps a write transaction that wrote records."""
    return any(s < t1 and e > t0 and n for s, e, n in txns)


def gate_env(work: Path, db: Path, size: int) -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin", "LANG": "C",
        "NCCLGUARD_CONFIG": str(work / "gate.toml"), "NCCLGUARD_DB": str(db),
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": f"n[00001-{size:05d}]",
        "SLURM_JOB_NUM_NODES": str(size), "SLURM_JOB_PARTITION": "debug",
        "SLURM_JOB_USER": "bench", "SLURM_JOB_UID": "1000",
        "SLURM_SCRIPT_CONTEXT": "prolog_slurmctld",
    }


@dataclass
class Phase:
    nice: int
    idle: Samples
    busy: Samples
    run: CollectorRun
    busy_window: tuple[float, float]
    accepted_in_window: int
    fed: int
    ran_dry: bool
    cpu_share: dict[str, float]  # of one core, during the busy block: collector, ...
    signed: int
    sign_s: float


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def gate_phase(
    cfg: Config, db: Path, spool_dir: Path, gate: Gate, nodes: int, sizes: list[int],
    runs: int, nice: int, sign_rounds: Callable[[int], list[Path]], rate: float, backlog: int,
    capacity: float, controller: Munged,
) -> Phase:
    """A collector process at ``nice``: the gate timed while it is idle, then while it
    ingests the changed records that a feeder process puts into the spool."""
    ctx = mp.get_context("fork")
    stop, caught_up, feed_stop = ctx.Event(), ctx.Event(), ctx.Event()
    accepted = ctx.Value("q", 0)
    cq: Any = ctx.Queue()
    fq: Any = ctx.Queue()
    collector = ctx.Process(target=collector_worker, args=(
        cfg, db, spool_dir, nice, stop, caught_up, accepted, cq))
    collector.start()
    feeder: Any = None
    try:
        if not caught_up.wait(600):
            raise SystemExit("the collector did not catch up with the spool in 600 s")
        t = time.monotonic()
        idle = gate_block(gate, sizes, runs)
        # signed now (the collector idle, nothing timed), enough for a busy block of
        # twice the idle one plus 10 s at the collector's rate for changed records
        t1 = time.monotonic()
        rounds = sign_rounds(math.ceil(capacity * (2 * (t1 - t) + 10)))
        sign_s = time.monotonic() - t1
        signed = len(rounds) * nodes
        feeder = ctx.Process(target=feeder_worker, args=(
            spool_dir, rounds, nodes, rate, backlog, accepted, feed_stop, fq))
        feeder.start()
        start = accepted.value
        deadline = time.monotonic() + 60
        while accepted.value == start and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # a few transactions in: a steady state
        assert collector.pid is not None
        procs = {"collector": psutil.Process(collector.pid),
                 "feeder": psutil.Process(feeder.pid),
                 "controller munged": psutil.Process(controller.proc.pid)}  # type: ignore[union-attr]
        cpu0 = {k: _cpu(p) for k, p in procs.items()}
        w0, a0 = time.monotonic(), accepted.value
        busy = gate_block(gate, sizes, runs)
        w1, a1 = time.monotonic(), accepted.value
        share = {k: (_cpu(p) - cpu0[k]) / (w1 - w0) for k, p in procs.items()}
    finally:
        feed_stop.set()
        stop.set()
    fed, dry = fq.get(timeout=60)
    run: CollectorRun = cq.get(timeout=600)
    feeder.join(timeout=60)
    collector.join(timeout=60)
    return Phase(nice, idle, busy, run, (w0, w1), a1 - a0, fed, dry, share, signed, sign_s)


def report_phases(phases: list[Phase], sizes: list[int], runs: int) -> None:
    for ph in phases:
        w0, w1 = ph.busy_window
        txns = [t for t in ph.run.txns if t[2] and t[0] < w1 and t[1] > w0]
        in_txn = sum(min(e, w1) - max(s, w0) for s, e, _ in txns)
        cpu = ", ".join(f"{k} {v:.0%}" for k, v in ph.cpu_share.items())
        print(f"\n   collector at nice {ph.nice} (signed {ph.signed} changed records in "
              f"{ph.sign_s:.1f} s after the idle block, not timed; the feeder wrote {ph.fed}"
              f"{', and RAN DRY' if ph.ran_dry else ''}):")
        print(f"   busy window {w1 - w0:.1f} s: {ph.accepted_in_window} records accepted "
              f"({ph.accepted_in_window / (w1 - w0):.0f}/s) in {len(txns)} write transactions, "
              f"inside one {in_txn / (w1 - w0):.0%} of the window; CPU (share of one core): "
              f"{cpu}; collector statuses: {dict(ph.run.statuses)}")
        print(f"   {'gate':<9} {'nodes':>6}  {'idle median':>11} {'p95':>8}  "
              f"{'busy median':>11} {'p95':>8}  {'busy/idle median':>16} {'p95':>6}  "
              f"overlapped a write (their median/idle)")
        for kind in ("program", "decision"):
            for size in sizes:
                idle = [e - s for s, e in ph.idle[kind, size]]
                busy = [e - s for s, e in ph.busy[kind, size]]
                over = [e - s for s, e in ph.busy[kind, size] if overlaps(s, e, ph.run.txns)]
                mi, pi = statistics.median(idle), pct(idle, 95)
                mb, pb = statistics.median(busy), pct(busy, 95)
                verdict = "OK" if mb / mi <= 1.2 else "OVER"
                mo = ratio(statistics.median(over), mi) if over else "-"
                print(f"   {kind:<9} {size:>6}  {mi * 1e3:8.1f} ms {pi * 1e3:5.1f} ms  "
                      f"{mb * 1e3:8.1f} ms {pb * 1e3:5.1f} ms  {ratio(mb, mi):>11} {verdict:<4} "
                      f"{ratio(pb, pi):>6}  {len(over):>3}/{runs} ({mo})")


def burn(nice: int) -> None:
    """A process that only burns one CPU (the control for part 3)."""
    os.nice(nice)
    while True:
        pass


def control(gate: Gate, sizes: list[int], runs: int) -> dict[str, Samples]:
    """The gate alone, then beside a process that only burns one CPU, at nice 0 and 10:
    how much of part 3's slowdown any CPU load on this machine causes."""
    ctx = mp.get_context("fork")
    out = {"idle": gate_block(gate, sizes, runs)}
    for nice in (0, 10):
        p = ctx.Process(target=burn, args=(nice,), daemon=True)
        p.start()
        try:
            time.sleep(0.3)
            out[f"nice {nice}"] = gate_block(gate, sizes, runs)
        finally:
            p.terminate()
            p.join()
    return out


def report_control(blocks: dict[str, Samples], sizes: list[int]) -> None:
    print("\n   control, no collector: the gate beside a process that only burns one CPU")
    print(f"   {'gate':<9} {'nodes':>6}  {'alone':>8}  " + "  ".join(
        f"{'burner at ' + k:>24}" for k in blocks if k != "idle"))
    for kind in ("program", "decision"):
        for size in sizes:
            alone = statistics.median(e - s for s, e in blocks["idle"][kind, size])
            cells = []
            for k, b in blocks.items():
                if k != "idle":
                    m = statistics.median(e - s for s, e in b[kind, size])
                    cells.append(f"{m * 1e3:8.1f} ms ({ratio(m, alone)})".rjust(24))
            print(f"   {kind:<9} {size:>6}  {alone * 1e3:5.1f} ms  " + "  ".join(cells))


# ---------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--dir", default=None,
                    help="where to make the work directory (default: /var/tmp)")
    ap.add_argument("--nodes", type=int, default=None, help="records (default 16384)")
    ap.add_argument("--runs", type=int, default=None, help="gate runs per figure (default 25)")
    ap.add_argument("--quick", action="store_true", help="2,048 nodes, 8 runs")
    ap.add_argument("--feed-rate", type=float, default=0.0,
                    help="most changed records/s in part 3 (default: 1.5x part 2's changed rate)")
    ap.add_argument("--nice", default="0,10", help="collector nice values for part 3")
    ap.add_argument("--no-gate", action="store_true", help="parts 1 and 2 only")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the timed scans (their figures then include the profiler)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    a = ap.parse_args()
    nodes = a.nodes or (2048 if a.quick else 16384)
    runs = a.runs or (8 if a.quick else 25)
    if not 1 <= nodes <= 99999:
        raise SystemExit("--nodes: 1 to 99999")
    sizes = sorted({s for s in (1024, 16384) if s < nodes} | {nodes})

    work = Path(tempfile.mkdtemp(prefix="ncclguard-bench-collector-", dir=a.dir or "/var/tmp"))
    os.chmod(work, 0o755)
    try:
        with contextlib.ExitStack() as stack:
            return run(a, work, stack, nodes, runs, sizes)
    finally:
        if a.keep:
            print(f"\nkept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def bench_addresses(cfg: Config) -> Addresses:
    """``[collector.addresses]`` as given, without the guard against an address that
    several nodes share: here four munged sign for all N nodes, where a cluster has one
    per node. The lookup per record (a set membership) costs the same."""
    a = Addresses(cfg.collector)
    a._map = {n: frozenset(v) for n, v in cfg.collector.addresses.items()}
    a.shared = {}
    return a


def run(a: argparse.Namespace, work: Path, stack: contextlib.ExitStack, nodes: int,
        runs: int, sizes: list[int]) -> int:
    mdir = work / "munge"
    key = write_munge_key(mdir / "munge.key")
    signers = [stack.enter_context(Munged(mdir, f"node{k}", key, origin))
               for k, origin in enumerate(NODE_ORIGINS)]
    controller = stack.enter_context(Munged(mdir, "controller", key, CONTROLLER_ORIGIN))
    bare = stack.enter_context(Munged(mdir, "baseline", key, BASELINE_ORIGIN))
    sockets = [str(m.socket) for m in signers]
    spool_dir, inv_dir = work / "spool", work / "inv"
    spool_dir.mkdir(mode=0o755)
    inv_dir.mkdir(mode=0o755)
    db = inv_dir / "inventory.db"
    addresses = {node_name(i): [NODE_ORIGINS[i % len(NODE_ORIGINS)]]
                 for i in range(1, nodes + 1)}
    cfg = from_dict({
        "inventory": {"db": str(db)},
        "spool": {"dir": str(spool_dir), "munge_socket": str(controller.socket)},
        # the byte quota is checked (its query is part of every change's cost); no change
        # rate: part 3's feeder changes each node more than 30 times an hour on purpose
        "collector": {"publisher": str(os.getuid()), "addresses": addresses,
                      "max_changes_per_hour": 0},
    }, source="bench")
    (work / "gate.toml").write_text(f'[gate]\naudit_log = "{work / "decisions.jsonl"}"\n')

    stage = work / "stage"
    t = time.perf_counter()
    (cold,) = sign(stage, nodes, [0], sockets)
    sign_s = time.perf_counter() - t
    cred_len = (cold / spool.record_name(node_name(1))).stat().st_size - 1
    publish_round(cold, spool_dir, nodes)
    payload_len = len(spool.payload(node_fp(1, 0)))
    print(f"# bench_collector: {nodes} nodes, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}, python "
          f"{sys.version.split()[0]}, sqlite {sqlite3.sqlite_version}, work dir {work}")
    print(f"# records: payload {payload_len} B, credential {cred_len} B; {nodes} signed "
          f"by {len(signers)} munged in {sign_s:.1f} s ({nodes / sign_s:.0f}/s, not timed)")

    # ---- 1. cold ingest
    print(f"\n1. cold ingest: one Collector.scan() of {nodes} new records, empty inventory")
    base, n = baseline_ingest(spool_dir, inv_dir / "baseline.db", bare)
    assert n == nodes, n
    c = Collector(cfg, db=db, spool_dir=spool_dir, addresses=bench_addresses(cfg))
    cost, res = timed_scan(c, controller, a.profile)
    st = Counter(res.accepted.values())
    if st != {"inserted": nodes} or res.rejected or res.deferred:
        raise SystemExit(f"cold scan: {st}, rejected {res.rejected}, deferred {res.deferred}")
    print(f"   baseline (read, munge.decode, json.loads, INSERT; one transaction, WAL): "
          f"wall {base.wall:.2f} s, CPU {base.cpu:.2f} s, munged CPU {base.munged_cpu:.2f} s, "
          f"written {base.written / nodes / 1024:.1f} KiB/record")
    verdict = "OK" if cost.wall <= 60 else "OVER"
    print(f"   collector scan(): wall {cost.wall:.2f} s ({ratio(cost.wall, base.wall)}), "
          f"CPU {cost.cpu:.2f} s ({ratio(cost.cpu, base.cpu)}), munged CPU "
          f"{cost.munged_cpu:.2f} s ({ratio(cost.munged_cpu, base.munged_cpu)}); "
          f"written {cost.written / nodes / 1024:.1f} KiB/record "
          f"({ratio(cost.written, base.written)}); {nodes / cost.wall:.0f} records/s, "
          f"{st['inserted']} inserted; target wall <= 60 s at 16,384: {verdict}")

    # ---- 2. heartbeats
    (hb,) = sign(stage, nodes, [0], sockets)
    publish_round(hb, spool_dir, nodes)
    print("\n2. heartbeats: every node republishes the same fingerprint, one scan()")
    base, n = baseline_decode(spool_dir, bare)
    cost, res = timed_scan(c, controller, a.profile)
    st = Counter(res.accepted.values())
    if st != {"heartbeat": nodes} or res.rejected or res.deferred:
        raise SystemExit(f"heartbeat scan: {st}, rejected {res.rejected}")
    per = 1e3 / nodes
    print(f"   baseline (read, munge.decode) per record: wall {base.wall * per:.3f} ms, "
          f"CPU {base.cpu * per:.3f} ms, munged CPU {base.munged_cpu * per:.3f} ms")
    print(f"   collector per record: wall {cost.wall * per:.3f} ms "
          f"({ratio(cost.wall, base.wall)}), CPU {cost.cpu * per:.3f} ms "
          f"({ratio(cost.cpu, base.cpu)}), munged CPU {cost.munged_cpu * per:.3f} ms, written "
          f"{cost.written / nodes / 1024:.1f} KiB; the scan: wall {cost.wall:.2f} s, "
          f"CPU {cost.cpu:.2f} s, {st['heartbeat']} heartbeats")
    # every changed file is read once more by the next scan (a hash: its digest is known)
    with measured(controller) as again:
        res = c.scan()
    print(f"   the next scan reads each of the {res.read} changed files once more (a hash, "
          f"no decode): wall {again.wall:.2f} s ({again.wall * per:.3f} ms/record), "
          f"CPU {again.cpu:.2f} s")
    with measured(controller) as idle:
        res = c.scan()
    if res.read:
        raise SystemExit(f"an unchanged spool: {res}")
    print(f"   an idle scan (nothing changed, {res.files} files listed): wall "
          f"{idle.wall * 1e3:.0f} ms, CPU {idle.cpu * 1e3:.0f} ms "
          f"({ratio(idle.wall, base.wall)} of the baseline's whole loop)")
    # for comparison, and for part 3: every node publishes a changed fingerprint
    (changed,) = sign(stage, nodes, [1], sockets)
    publish_round(changed, spool_dir, nodes)
    cost, res = timed_scan(c, controller, a.profile)
    st = Counter(res.accepted.values())
    if st != {"changed": nodes} or res.rejected or res.deferred:
        raise SystemExit(f"changed scan: {st}, rejected {res.rejected}")
    print(f"   for comparison, every node changed (a new boot_id), one scan(): wall "
          f"{cost.wall:.2f} s ({cost.wall * per:.3f} ms/record), CPU {cost.cpu:.2f} s, "
          f"written {cost.written / nodes / 1024:.1f} KiB/record; {nodes / cost.wall:.0f} "
          f"records/s, {st['changed']} changed")
    changed_rate = nodes / cost.wall
    c.close()
    if a.no_gate:
        return 0

    # ---- 3. the gate while the collector writes
    rate = a.feed_rate or max(200.0, 1.5 * changed_rate)
    backlog = max(1, min(2 * cfg.collector.batch_max, nodes // 4))
    nices = [int(x) for x in a.nice.split(",")]
    print(f"\n3. gate latency, allocations of {', '.join(map(str, sizes))} nodes, "
          f"{runs} runs each, interleaved; busy: changed records fed at most {rate:.0f}/s, "
          f"{backlog} ahead of the collector")
    variant = 2

    def sign_rounds(count: int) -> list[Path]:
        nonlocal variant
        n = max(1, math.ceil(count / nodes))
        rounds = sign(stage, nodes, range(variant, variant + n), sockets)
        variant += n
        return rounds

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    environ = {"NCCLGUARD_CONFIG": str(work / "gate.toml"), "NCCLGUARD_DB": str(db)}
    worker = ctx.Process(target=gate_worker, args=(child, environ))
    worker.start()
    gate = Gate([sys.executable, "-I", "-m", "prolog.gate"],
                {s: gate_env(work, db, s) for s in sizes}, parent)
    phases: list[Phase] = []
    try:
        for nice in nices:
            phases.append(gate_phase(cfg, db, spool_dir, gate, nodes, sizes, runs, nice,
                                     sign_rounds, rate, backlog, changed_rate, controller))
        burner = control(gate, sizes, runs)
    finally:
        parent.send(None)
        worker.join(timeout=30)
    print("   (program: python -I -m prolog.gate, one process per run; decision: "
          "prolog.gate.main(env) in a warm process)")
    report_phases(phases, sizes, runs)
    if len(phases) > 1:
        print("\n   busy/idle median by nice: " + "; ".join(
            f"{kind} {size}: " + ", ".join(
                f"nice {ph.nice} {ratio(*_medians(ph, kind, size))}" for ph in phases)
            for kind in ("program", "decision") for size in sizes))
    report_control(burner, sizes)
    return 0


def _medians(ph: Phase, kind: str, size: int) -> tuple[float, float]:
    busy = statistics.median(e - s for s, e in ph.busy[kind, size])
    idle = statistics.median(e - s for s, e in ph.idle[kind, size])
    return busy, idle


if __name__ == "__main__":
    sys.exit(main())
