"""What serving the cluster's metrics costs the collector, at 16,384 nodes.

A 16,384-node inventory (varied: some nodes on another NCCL, some stale), five partitions
(four of 4,096 nodes and one of all), and a 16 MiB audit trail are built once (cached under
--work). A child process then serves, each on its own loopback port:

- ``bare``: a plain prometheus_client registry holding as many constant samples as
  ncclguard's endpoint serves, on prometheus_client's own HTTP server (the baseline: what
  serving that text costs at all);
- ``ncclguard``: the exporter with ``metrics_cache_s = 0`` (every scrape reads the
  inventory and the audit trail again: the worst case);
- ``cached``: the exporter with the default ``metrics_cache_s`` (10 s), scraped faster
  than that (a second Prometheus, or a short scrape_interval).

``ncclguard`` and ``cached`` are served by the collector's own bounded server
(inventoryd/controller/metrics_server.py). Each is scraped --runs times in turn (interleaved, so
that machine noise hits all alike); the scrape's wall time is measured here, the serving
process's CPU from /proc/<pid>/stat around each scrape. Prints medians and ratios to
``bare``.

Then, under load (``--load``, default on): a client process holds 2,000 idle and 200
slow connections (as tests/test_metrics_load.py) on the ``cached`` endpoint; ``cached``
is scraped --runs times, interleaved with ``bare`` (unloaded), and the serving process's
threads and descriptors are counted: the ratio says what the load costs a scrape.

    .venv/bin/python bench/bench_metrics.py [--runs 15] [--nodes 16384]

Prints figures; never asserts (timed tests are not tests).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

TICK = os.sysconf("SC_CLK_TCK")


def build(work: Path, n: int) -> tuple[Path, Path]:
    from helpers.fingerprints import fingerprint

    from ncclguard import audit
    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    work.mkdir(parents=True, exist_ok=True)
    db = work / f"metrics-{n}.db"
    trail = work / "log" / "decisions.jsonl"
    if not db.exists():
        t = time.perf_counter()
        now = time.time()
        with Inventory(db, values=GATE_VALUES) as inv:
            inv._retrying = lambda conn, body, doing: body(conn)  # type: ignore[method-assign]
            inv._conn.execute("BEGIN IMMEDIATE")
            for i in range(n):
                nccl = "2.18.3" if i % 97 == 0 else "2.19.3" if i % 131 == 0 else "2.21.5"
                inv.upsert(fingerprint(f"n{i:05d}", nccl=nccl), now=now)
            inv._conn.execute("COMMIT")
        print(f"built a {n}-node inventory in {time.perf_counter() - t:.1f}s: {db}")
    with Inventory(db, values=GATE_VALUES) as inv:  # fresh heartbeats, 1 % stale
        now = time.time()
        inv._conn.execute("UPDATE nodes SET last_heartbeat = ?", (now,))
        inv._conn.execute("UPDATE gate_nodes SET last_heartbeat = ?", (now,))
        inv._conn.execute("UPDATE nodes SET last_heartbeat = ? WHERE rowid % 100 = 0",
                          (now - 100_000,))
        inv._conn.commit()
    if not trail.exists():
        trail.parent.mkdir(mode=0o750, exist_ok=True)
        rec = {"job": 1, "decision": "refuse", "action": "steer", "partition": "p0",
               "findings": [{"rule": "nccl-version", "severity": "refuse"}],
               "summary": "ncclguard: refuse, odd n00097: nccl-version [...]" + "x" * 400}
        line = json.dumps(rec) + "\n"
        with open(trail, "w") as f:
            f.write(line * (16 * 1024 * 1024 // len(line)))
        audit.append(trail, {"job": 2, "decision": "accept", "action": "none"})
    return db, trail


SERVER = r"""
import sys, time, json
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from prometheus_client import CollectorRegistry, Gauge, generate_latest, start_http_server
from inventoryd.controller.exporter import Exporter, Partitions, Served
from inventoryd.controller.metrics_server import BoundedServer
from ncclguard import config as configmod

db, trail, n = Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
hosts = [f"n{i:05d}" for i in range(n)]
parts = {f"p{k}": hosts[k * n // 4:(k + 1) * n // 4] for k in range(4)} | {"all": hosts}
ports = {}
for name, cache in (("ncclguard", 0.0), ("cached", 10.0)):
    p = Partitions(lambda: parts, refresh_s=600)
    p.refresh()
    ex = Exporter(configmod.Config(), db=db, partitions=p, audit_path=trail, cache_s=cache)
    s = Served(ex)  # its registry, on a port the kernel picks (Served takes a fixed one)
    t0, c0 = time.perf_counter(), time.process_time()
    text = s.text()
    first = (time.perf_counter() - t0, time.process_time() - c0)
    # the collector's own server (inventoryd/controller/metrics_server.py), with its defaults
    server = BoundedServer("127.0.0.1", 0, lambda s=s: generate_latest(s.registry))
    ports[name] = server.port
samples = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
bare = CollectorRegistry()
g = Gauge("bare_metric", "a constant", ["i"], registry=bare)
for i in range(samples):
    g.labels(i=str(i)).set(i)
server, _ = start_http_server(0, addr="127.0.0.1", registry=bare)
ports["bare"] = server.server_port
print(json.dumps({"ports": ports, "samples": samples, "bytes": len(text), "first": first}),
      flush=True)
while True:
    time.sleep(3600)
"""


def cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def scrape(port: int) -> tuple[float, int]:
    t = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        size = len(r.read())
    return time.perf_counter() - t, size


def _under_load(pid: int, ports: dict[str, int], runs: int) -> None:
    from helpers.load import CLIENT, IDLE, SLOW

    tasks = [len(os.listdir(f"/proc/{pid}/task"))]
    fds = [len(os.listdir(f"/proc/{pid}/fd"))]
    client = subprocess.Popen([sys.executable, "-c", CLIENT, str(ports["cached"]), str(IDLE),
                               str(SLOW), "600"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout is not None
        t0 = time.perf_counter()
        assert client.stdout.readline().strip() == "ready"
        opened = time.perf_counter() - t0
        loaded: list[float] = []
        bare: list[float] = []
        for _ in range(runs):
            bare.append(scrape(ports["bare"])[0])
            loaded.append(scrape(ports["cached"])[0])
            tasks.append(len(os.listdir(f"/proc/{pid}/task")))
            fds.append(len(os.listdir(f"/proc/{pid}/fd")))
            time.sleep(0.2)
    finally:
        client.kill()
        client.wait(timeout=30)
    b, x = statistics.median(bare), statistics.median(loaded)
    print(f"under {IDLE} idle + {SLOW} slow connections (opened in {opened:.1f} s): cached "
          f"scrape {x * 1000:.1f} ms, {x / b:.2f}x bare unloaded ({b * 1000:.1f} ms); "
          f"serving process at most {max(tasks)} threads, {max(fds)} descriptors "
          f"(before the load {tasks[0]}, {fds[0]}; three endpoints)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path,
                    default=Path(tempfile.gettempdir()) / "ncclguard-bench")
    ap.add_argument("--nodes", type=int, default=16384)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--no-load", dest="load", action="store_false",
                    help="skip the 2,000 idle + 200 slow connections")
    args = ap.parse_args()
    db, trail = build(args.work, args.nodes)
    child = subprocess.Popen([sys.executable, "-c", SERVER, str(ROOT), str(db), str(trail),
                              str(args.nodes)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        info = json.loads(child.stdout.readline())
        ports = info["ports"]
        print(f"{args.nodes} nodes, 5 partitions, a {trail.stat().st_size >> 20} MiB audit "
              f"trail; the endpoint serves {info['samples']} samples ({info['bytes']} bytes)")
        first_s, first_cpu = info["first"]
        print(f"first scrape after start (counts the audit trail's last 16 MiB): "
              f"{first_s * 1000:.0f} ms, {first_cpu * 1000:.0f} ms CPU")
        wall: dict[str, list[float]] = {k: [] for k in ports}
        cpus: dict[str, list[float]] = {k: [] for k in ports}
        sizes: dict[str, int] = {}
        for port in ports.values():  # one untimed warm-up each
            scrape(port)
        for _ in range(args.runs):
            for name, port in ports.items():
                c0 = cpu(child.pid)
                dt, sizes[name] = scrape(port)
                cpus[name].append(cpu(child.pid) - c0)
                wall[name].append(dt)
        base_w = statistics.median(wall["bare"])
        base_c = statistics.mean(cpus["bare"])
        print(f"{'endpoint':<12} {'bytes':>8} {'scrape ms':>10} {'x bare':>7} "
              f"{'CPU ms':>8} {'x bare':>7}")
        for name in ("bare", "ncclguard", "cached"):
            w = statistics.median(wall[name])
            c = statistics.mean(cpus[name])  # clock ticks: a mean, not a median
            print(f"{name:<12} {sizes[name]:>8} {w * 1000:>10.1f} {w / base_w:>7.2f} "
                  f"{c * 1000:>8.1f} {(c / base_c) if base_c else float('nan'):>7.2f}")
        if args.load:
            _under_load(child.pid, ports, args.runs)
    finally:
        child.terminate()
        child.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
