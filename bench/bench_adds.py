"""What the second family of class features (``[features] own_nccl``, issue 40) costs the
features daemon at scale (docs/perf.md, "The second family at scale").

An inventory of ``--nodes`` nodes (16,384) in ``--classes`` host classes (32: class k on
NCCL 2.22.k, the same v8 plugin everywhere, so that the second family is one class),
written as the collector ingests them; 256 resolved job environments (``job_envs``).
Then, interleaved ``--runs`` times in a new random order each round, in one process:

- ``host``: :func:`ncclguard.sched.sync.desired`, each node's host class (what the daemon
  asks at every pass: the baseline);
- ``adds``: :func:`ncclguard.sched.sync.desired_adds`, each node's second-family class
  (every node's record read: asked at a full sync and every ``verify_s``);
- ``envs``: :func:`ncclguard.sched.envlines.env_groups`, the file's env lines (at a full
  sync, and when the collector resolved an environment).

Printed: the median wall time of each and its ratio to ``host``. Never asserts a time.

    .venv/bin/python bench/bench_adds.py [--nodes 16384] [--classes 32] [--runs 7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from helpers.fingerprints import fingerprint, offers_part, plugin  # noqa: E402

from ncclguard.config import Config, FeaturesConfig, InventoryConfig  # noqa: E402
from ncclguard.fingerprint.jobenv import env_key  # noqa: E402
from ncclguard.policy import GATE_VALUES  # noqa: E402
from ncclguard.policy.schedule import class_values  # noqa: E402
from ncclguard.sched import envlines, sync  # noqa: E402
from ncclguard.spool import record_name  # noqa: E402
from ncclguard.store import Inventory  # noqa: E402
from ncclguard.store.inventory import Published  # noqa: E402


def build(db: Path, n: int, k: int, now: float) -> list[str]:
    hosts = [f"gpu{i:05d}" for i in range(1, n + 1)]
    net = plugin("IBext", abis=[8, 7, 6, 5])
    made: dict[int, dict] = {}
    cfg = Config()
    with Inventory(db, values=class_values(cfg.policy)) as inv:
        batch = []
        for i, h in enumerate(hosts):
            c = i * k // n
            if c not in made:
                made[c] = fingerprint("x", nccl=f"2.22.{c}", plugins=[net], offers=True)
            fp = {**made[c], "host": {**made[c]["host"], "hostname": h}}
            batch.append(Published(fp, now, record_name(h), "", "", "", 0))
            if len(batch) == 2000 or i == n - 1:
                inv.ingest(batch, now=now)
                batch = []
        rows = []
        for u in range(256):
            variables = {"VIRTUAL_ENV": f"/home/u{u:03d}/venv"}
            rows.append({"key": env_key(variables), "vars": variables, "uid": 1000 + u,
                         "source": "VIRTUAL_ENV", "path": f"/home/u{u:03d}/libnccl.so.2",
                         "why": "", "problems": [], "error": None, "ident": (1, 1, 1),
                         "library": {"nccl_version": "2.23.4", "net_abis": [8, 7, 6, 5]},
                         "used_at": now})
        inv.write_job_envs(rows, now=now)
    _ = offers_part  # the fingerprints' offers part comes from it (offers=True)
    return hosts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=16384)
    ap.add_argument("--classes", type=int, default=32)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--seed", type=int, default=50)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "inv.db"
        now = time.time()
        t = time.perf_counter()
        hosts = build(db, args.nodes, args.classes, now)
        print(f"inventory of {args.nodes:,} nodes in {args.classes} host classes and 256 "
              f"job environments in {time.perf_counter() - t:.0f} s")
        cfg = Config(inventory=InventoryConfig(db=str(db)),
                     features=FeaturesConfig(own_nccl=True))
        times: dict[str, list[float]] = {"host": [], "adds": [], "envs": []}
        with Inventory(db, readonly=True, values=class_values(cfg.policy)) as inv_c, \
                Inventory(db, readonly=True, values=GATE_VALUES) as inv_g:
            adds = sync.desired_adds(cfg, hosts, now, inv_g)
            print(f"host classes {len(set(sync.desired(cfg, hosts, now, inv_c).values()))}, "
                  f"second family {len(set(adds.values()))}, env lines "
                  f"{len(envlines.env_groups(cfg, inv_g, adds))}")
            kinds = {
                "host": lambda: sync.desired(cfg, hosts, now, inv_c),
                "adds": lambda: sync.desired_adds(cfg, hosts, now, inv_g),
                "envs": lambda: envlines.env_groups(cfg, inv_g, adds),
            }
            rng = random.Random(args.seed)
            for _ in range(args.runs):
                order = list(kinds)
                rng.shuffle(order)
                for name in order:
                    t = time.perf_counter()
                    kinds[name]()
                    times[name].append(time.perf_counter() - t)
    base = statistics.median(times["host"])
    print(f"\n{args.runs} runs each, interleaved; median wall time")
    for name, xs in times.items():
        med = statistics.median(xs)
        print(f"{name:5s} {med * 1e3:9.1f} ms  {med / base:6.2f}x host")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
