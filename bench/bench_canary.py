"""What one pass of ``ncclguard-inventoryd canary`` costs the controller (issue 43,
docs/canary.md), on an inventory of ``--nodes`` nodes (16,384) in 32 classes, against its
own floor: the read of every node's class (:meth:`~ncclguard.store.Inventory.class_keys`),
which any pass needs.

- ``quiet``: a pass with no node held (what the service does every 15 s nearly always);
- ``burst``: a pass with ``--held`` nodes (64) waiting, which plans their canaries
  (Slurm modelled as in tests/helpers/canary.py: every node idle, jobs accepted at once; its
  calls are not what is timed here);
- ``floor``: ``class_keys()`` alone.

Rounds interleave, in this process. Prints milliseconds and ratios to the floor; never
asserts a time.

    .venv/bin/python bench/bench_canary.py [--nodes 16384] [--held 64] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from helpers.canary import FakeSlurm  # noqa: E402
from helpers.fingerprints import fingerprint  # noqa: E402

from inventoryd.controller.canary import CanaryService  # noqa: E402
from ncclguard.config import CanaryConfig, Config, InventoryConfig, PolicyConfig  # noqa: E402
from ncclguard.policy.schedule import class_values  # noqa: E402
from ncclguard.spool import record_name  # noqa: E402
from ncclguard.store import Inventory  # noqa: E402
from ncclguard.store.inventory import Published  # noqa: E402

NCCL = [f"2.{18 + i // 8}.{i % 8 + 1}" for i in range(32)]


def store(db: Path, fps: list[dict], now: float) -> None:
    """Write records as the collector's ingest does: in batches, one transaction each."""
    values = class_values(PolicyConfig())
    with Inventory(db, values=values) as inv:
        for i in range(0, len(fps), 2000):
            inv.ingest([Published(fp, now, record_name(fp["host"]["hostname"]), "", "", "",
                                  os.getuid()) for fp in fps[i:i + 2000]], now=now)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=16384)
    ap.add_argument("--held", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-canary-"))
    db = tmp / "inventory.db"
    hosts = [f"n{i:05d}" for i in range(a.nodes)]
    now = time.time()
    values = class_values(PolicyConfig())
    store(db, [fingerprint(h, nccl=NCCL[i % 32]) for i, h in enumerate(hosts)], now)
    cfg = Config(inventory=InventoryConfig(db=str(db)),
                 canary=CanaryConfig(enabled=True, command=("true",), settle_s=0.0,
                                     max_running=4, max_nodes=4))
    clock = [now]
    slurm = FakeSlurm(hosts, lambda: clock[0])
    svc = CanaryService(cfg, slurm, clock=lambda: clock[0])  # type: ignore[arg-type]
    svc.apply()  # the first pass: every node vetted
    times: dict[str, list[float]] = {"floor": [], "quiet": [], "burst": []}
    for r in range(a.rounds):
        t = time.perf_counter()
        with Inventory(db, readonly=True, values=values) as inv:
            inv.class_keys()
        times["floor"].append(time.perf_counter() - t)
        clock[0] += 15
        t = time.perf_counter()
        svc.apply()
        times["quiet"].append(time.perf_counter() - t)
        # the burst: --held nodes move to the next release's class; a pass holds them,
        # the timed pass plans their canaries
        moved = range(r * a.held, (r + 1) * a.held)
        store(db, [fingerprint(hosts[i], nccl=NCCL[(i + 1) % 32]) for i in moved], clock[0])
        clock[0] += 15
        svc.apply()
        slurm.jobs.clear()
        clock[0] += 15
        t = time.perf_counter()
        svc.apply()
        times["burst"].append(time.perf_counter() - t)
    floor = statistics.median(times["floor"])
    print(f"{a.nodes} nodes, 32 classes, {a.held} held in the burst, {a.rounds} rounds")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"  {k:6s} median {m * 1000:8.1f} ms   x{m / floor:5.2f} of the floor")


if __name__ == "__main__":
    main()
