"""Inventory benchmarks: write throughput and p99 latency with 1, 16 and 64 writers on
local disk, and the reads of a 16,384-node inventory (the gate's load, the classes).

The machine is shared and noisy, so every figure is printed as a ratio against a
baseline measured in the same run:
- writes: a bare sqlite3 ``BEGIN IMMEDIATE; INSERT; COMMIT`` of a row of the same size,
  one writer, same journal mode, same directory (the cost of one durable commit here);
- reads: a bare ``SELECT host, fingerprint FROM nodes`` of the same rows, no JSON parsing.

    .venv/bin/python bench/bench_store.py [--dir DIR] [--ops N] [--nodes N] [--journal delete|wal]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.fingerprints import fingerprint

from ncclguard.config import InventoryConfig, PolicyConfig
from ncclguard.fingerprint.canonical import canonical_json
from ncclguard.policy.schedule import class_values
from ncclguard.store import Inventory, InventoryLocked

CLASSES = class_values(PolicyConfig())  # as the collector writes: the default policy's classes


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98] if len(xs) >= 2 else xs[0]


def baseline_commits(d: Path, n: int, journal: str) -> tuple[float, float]:
    """Bare sqlite3 commits/s and p99 seconds, one writer."""
    p = d / "baseline.db"
    conn = sqlite3.connect(p, isolation_level=None)
    conn.execute(f"PRAGMA journal_mode = {journal}")
    conn.execute("CREATE TABLE t (host TEXT PRIMARY KEY, fp TEXT)")
    row = canonical_json(fingerprint("n0", plugin_abi=8))
    lat = []
    t0 = time.perf_counter()
    for i in range(n):
        s = time.perf_counter()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT OR REPLACE INTO t VALUES (?, ?)", (f"n{i % 64}", row + str(i)))
        conn.execute("COMMIT")
        lat.append(time.perf_counter() - s)
    wall = time.perf_counter() - t0
    conn.close()
    return n / wall, p99(lat)


def _writer(db: str, i: int, ops: int, journal: str, start: mp.Event, q: mp.Queue) -> None:  # type: ignore[type-arg]
    inv = Inventory(db, values=CLASSES, config=InventoryConfig(journal_mode=journal),
                    heartbeat_s=1e9)
    fps = [fingerprint(f"w{i:03d}", conf=f"NCCL_DEBUG=WARN{j}", plugin_abi=8)
           for j in range(ops)]
    start.wait()
    lat = []
    locked = 0
    for j, fp in enumerate(fps):
        s = time.perf_counter()
        try:
            status = inv.upsert(fp, now=1e9 + j)
        except InventoryLocked:  # the budget ran out: counted, reported, not hidden
            locked += 1
            continue
        lat.append(time.perf_counter() - s)
        assert status in ("inserted", "changed"), status
    inv.close()
    q.put((lat, locked))


def bench_writers(d: Path, writers: int, ops: int, journal: str) -> tuple[float, float, int]:
    db = d / f"w{writers}" / "inventory.db"
    # the schema first
    Inventory(db, values=CLASSES, config=InventoryConfig(journal_mode=journal)).close()
    ctx = mp.get_context("fork")
    start, q = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(db), i, ops, journal, start, q))
             for i in range(writers)]
    for p in procs:
        p.start()
    time.sleep(0.5 + writers * 0.02)  # let every writer build its fingerprints
    t0 = time.perf_counter()
    start.set()
    lats: list[float] = []
    locked = 0
    for _ in procs:
        lat, n = q.get(timeout=600)
        lats.extend(lat)
        locked += n
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
        assert p.exitcode == 0
    return len(lats) / wall, p99(lats), locked


def bench_reads(d: Path, nodes: int) -> dict[str, float]:
    db = d / "read" / "inventory.db"
    variants = [fingerprint("x", v, plugin_abi=8)
                for v in ("2.21.5", "2.21.5", "2.21.5", "2.18.3")]
    with Inventory(db, values=CLASSES) as inv:
        conn = inv._conn
        conn.execute("BEGIN")
        for i in range(nodes):  # the writer's code path, in one transaction for speed
            fp = json.loads(json.dumps(variants[i % len(variants)]))
            fp["host"]["hostname"] = f"n{i:05d}"
            fp["gpu"]["driver_version"] = str(i % 7)
            _orig_retrying = inv._retrying
            inv._retrying = lambda c, body, doing: body(c)  # type: ignore[method-assign]
            inv.upsert(fp, now=1e9)
            inv._retrying = _orig_retrying  # type: ignore[method-assign]
        conn.execute("COMMIT")
    hosts = [f"n{i:05d}" for i in range(nodes)]
    out: dict[str, float] = {}

    def best(fn: object, reps: int = 5) -> float:
        ts = []
        for _ in range(reps):
            s = time.perf_counter()
            fn()  # type: ignore[operator]
            ts.append(time.perf_counter() - s)
        return min(ts)

    def raw() -> None:
        c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        c.execute("SELECT host, fingerprint FROM nodes").fetchall()
        c.close()

    def full_load() -> None:
        with Inventory(db, readonly=True) as ro:
            got = ro.load(hosts)
            assert all(v is not None for v in got.values())

    def gate_load() -> None:
        with Inventory(db, readonly=True, values=CLASSES) as ro:
            got = ro.load_values(hosts)
            assert all(v is not None for v in got.values())

    def classes() -> None:
        with Inventory(db, readonly=True, values=CLASSES) as ro:
            assert len(ro.classes()) >= 2

    out["baseline_s"] = best(raw)
    out["full_load_s"] = best(full_load, reps=2)
    out["load_s"] = best(gate_load)
    out["classes_s"] = best(classes)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="a directory on the disk to measure "
                    "(default: a temporary one under /var/tmp)")
    ap.add_argument("--ops", type=int, default=40, help="writes per writer")
    ap.add_argument("--nodes", type=int, default=16384)
    ap.add_argument("--journal", default="delete", choices=("delete", "wal"))
    ap.add_argument("--writers", default="1,16,64")
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="ncclguard-bench-", dir=a.dir or "/var/tmp"))
    os.chmod(d, 0o755)
    try:
        base_rate, base_p99 = baseline_commits(d, 200, a.journal)
        print(f"# journal_mode={a.journal} dir={d} (local disk)")
        print(f"baseline bare commit: {base_rate:.0f}/s, p99 {base_p99 * 1e3:.2f} ms "
              "(absolute figures are for orientation only)")
        print("writers  writes/s(ratio to baseline)  p99 latency(ratio to baseline)")
        for n in (int(x) for x in a.writers.split(",")):
            rate, lat, locked = bench_writers(d, n, a.ops, a.journal)
            print(f"{n:7d}  {rate / base_rate:26.2f}x  {lat / base_p99:28.1f}x"
                  f"   ({rate:.0f}/s, {lat * 1e3:.1f} ms, {locked} of {n * a.ops} "
                  "gave up as InventoryLocked)")
        r = bench_reads(d, a.nodes)
        print(f"reads of {a.nodes} nodes (ratio to a bare SELECT of the fingerprints, "
              f"{r['baseline_s'] * 1e3:.0f} ms):")
        print(f"  gate load_values(all hosts): {r['load_s'] / r['baseline_s']:.2f}x"
              f"  ({r['load_s'] * 1e3:.0f} ms)")
        print(f"  load(all hosts), full fingerprints: {r['full_load_s'] / r['baseline_s']:.2f}x"
              f"  ({r['full_load_s'] * 1e3:.0f} ms)")
        print(f"  classes():            {r['classes_s'] / r['baseline_s']:.2f}x"
              f"  ({r['classes_s'] * 1e3:.0f} ms)")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
