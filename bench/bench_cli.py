"""Wall time of ``ncclguard classes``, ``nodes --where`` and ``drain-recommend`` on a
16,384-node inventory (issue 5: each under 1 s).

The inventory is made the way production makes it: a few real collections
(``inventoryd.node.fingerprint.collect`` on node trees from ``devtools.nodetree``, with the real
``libnccl.so.2`` files when the test cache has them), then copies varied per node (host
name, NCCL version on a few, a port down, a stale heartbeat), written with
``Inventory.upsert``.

Each command runs as the admin runs it: a fresh ``ncclguard`` process (imports, config,
opening the database included). The baseline, run in the same process and the same way,
is ``ncclguard --version``: the fixed cost of starting the CLI. The script prints each
command's median wall time over a few runs and its ratio to that baseline.

    .venv/bin/python bench/bench_cli.py [--nodes 16384] [--runs 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devtools.nodetree import build_node  # noqa: E402
from inventoryd.node.fingerprint import collect  # noqa: E402
from ncclguard.config import (  # noqa: E402
    InventoryConfig,
    InventorydConfig,
    PolicyConfig,
)
from ncclguard.policy.schedule import class_values  # noqa: E402
from ncclguard.store import Inventory  # noqa: E402

CLASSES = class_values(PolicyConfig())  # as the collector writes: the default policy's classes

LIMIT_S = 1.0


def real_fingerprints(work: Path) -> dict[str, dict[str, Any]]:
    """A few real collections: one per NCCL version the cache holds (or none)."""
    libs: dict[str, Path | None] = {}
    try:
        from devtools.ncclwheels import nccl_path

        for v in ("2.21.5", "2.18.3"):
            p = nccl_path(v)
            if p.exists():
                libs[v] = p
    except Exception as e:  # the wheel cache is optional here
        print(f"(no real libnccl: {e})")
    if not libs:
        libs["none"] = None
    out = {}
    for v, lib in libs.items():
        root = build_node(work / f"node-{v}", rdma="mlx5-ib", libnccl=lib,
                          nccl_conf="NCCL_IB_HCA=mlx5\n")
        out[v] = collect(str(root), f"base-{v}", InventorydConfig())
    down = build_node(work / "node-down", rdma="mlx5-down",
                      libnccl=next(iter(libs.values())))
    out["down"] = collect(str(down), "base-down", InventorydConfig())
    return out


def generate(db: Path, n: int, work: Path) -> dict[str, int]:
    bases = real_fingerprints(work)
    main = bases.get("2.21.5") or next(iter(bases.values()))
    old = bases.get("2.18.3")
    now = time.time()
    counts = {"nodes": n, "old_nccl": 0, "ports_down": 0, "stale": 0}
    inv = Inventory(db, values=CLASSES, config=InventoryConfig(journal_mode="wal"))
    try:
        for i in range(n):
            host = f"gpu{i:05d}"
            if old is not None and i % 997 == 13:
                base, counts["old_nccl"] = old, counts["old_nccl"] + 1
            elif i % 1499 == 7:
                base, counts["ports_down"] = bases["down"], counts["ports_down"] + 1
            else:
                base = main
            fp = copy.deepcopy(base)
            fp["host"]["hostname"] = host
            fp["host"]["boot_id"] = f"{i:032x}"
            age = 3600.0 if i % 2003 == 5 else 10.0
            counts["stale"] += age > 900
            inv.upsert(fp, now=now - age)
    finally:
        inv.close()
    return counts


def wall(argv: list[str], env: dict[str, str], runs: int) -> tuple[float, str]:
    subprocess.run(argv, env=env, capture_output=True, timeout=120)  # warm-up, untimed
    times = []
    last = ""
    for _ in range(runs):
        t0 = time.perf_counter()
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        times.append(time.perf_counter() - t0)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} -> {r.returncode}: {r.stderr.strip()}")
        last = r.stdout
    return statistics.median(times), last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=16384)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None, help="keep the inventory here")
    args = ap.parse_args()
    tmp = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-cli-"))
    tmp.mkdir(parents=True, exist_ok=True)
    db = tmp / "inventory.db"
    if not db.exists():
        t0 = time.perf_counter()
        counts = generate(db, args.nodes, tmp)
        print(f"inventory: {counts} written in {time.perf_counter() - t0:.1f}s ({db})")
    cfg = tmp / "config.toml"
    cfg.write_text('[gate]\nslurm_bin_dir = "/nonexistent"\n')  # no Slurm: --nodes
    env = {**os.environ, "NCCLGUARD_CONFIG": str(cfg), "NCCLGUARD_DB": str(db)}
    # as installed: byte code cached (the first, untimed run of each command writes it)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    exe = [sys.executable, "-m", "ncclguard.cli"] if not (ROOT / ".venv/bin/ncclguard").exists() \
        else [str(ROOT / ".venv/bin/ncclguard")]
    hosts = f"gpu[00000-{args.nodes - 1:05d}]"
    base_t, _ = wall([*exe, "--version"], env, args.runs)
    cases = [
        ("classes", ["classes"]),
        ("classes --json", ["classes", "--json"]),
        ("nodes --where nccl=2.18.3", ["nodes", "--where", "nccl=2.18.3"]),
        ("nodes --where nccl=2.21.5 (~all rows)", ["nodes", "--where", "nccl=2.21.5"]),
        ("nodes --where nccl=2.21.5 --csv", ["nodes", "--where", "nccl=2.21.5", "--csv"]),
        ("nodes --stale", ["nodes", "--stale"]),
        ("drain-recommend --nodes ALL", ["drain-recommend", "--nodes", hosts, "--force"]),
        ("drain-recommend --json", ["drain-recommend", "--nodes", hosts, "--json"]),
    ]
    print(f"{'command':40s} {'median s':>9s} {'x baseline':>10s}  under {LIMIT_S:g}s")
    print(f"{'ncclguard --version (baseline)':40s} {base_t:9.3f} {1.0:10.2f}")
    worst = 0.0
    for name, argv in cases:
        t, _ = wall([*exe, *argv], env, args.runs)
        worst = max(worst, t)
        print(f"{name:40s} {t:9.3f} {t / base_t:10.2f}  {'yes' if t < LIMIT_S else 'NO'}")
    print(f"worst: {worst:.3f}s ({'within' if worst < LIMIT_S else 'OVER'} the {LIMIT_S:g}s limit)")
    return 0 if worst < LIMIT_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
