"""How much of the prolog's budget the policy takes: ratios to a bare interpreter start.

The gate's whole process must stay within 2.5x ``python3 -I -c pass`` at 1,024 nodes.
This measures, in one run and against a baseline taken here and now:

- ``import ncclguard.policy`` in a fresh ``-I`` interpreter, after ``import
  ncclguard.config`` (which the gate loads anyway): the policy's own share;
- ``evaluate()`` on 1,024 nodes: all identical (one dict object per node, as JSON
  decoding gives), the same with the store's shared objects, and three classes with a
  refusal and odd nodes to find; 16,384 nodes as the upper bound; and the same on
  ``node_values()`` records (computed where fingerprints are written), shared by equal
  nodes, which is how the gate should feed it;
- a job that sets its own ``NCCL_*`` variables (``evaluate_env``: the transport derived
  again on each distinct record, issue 40) against the same records without them
  (``evaluate_values``), interleaved pair by pair.

Run: ``.venv/bin/python bench/bench_policy.py [--repeat N]``. It prints ratios; it asserts
nothing (timings belong in a bench, not in tests).
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from helpers.fingerprints import device, fingerprint, plugin  # noqa: E402

from ncclguard.config import PolicyConfig  # noqa: E402
from ncclguard.policy import (  # noqa: E402
    evaluate,
    evaluate_env,
    evaluate_values,
    node_values,
)


def wall(fn: Callable[[], object], repeat: int) -> float:
    """Fastest seconds of ``fn()`` over ``repeat`` runs (the least disturbed by other load
    on a shared machine; the baseline is measured the same way)."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def run_python(code: str, repeat: int) -> float:
    cmd = [sys.executable, "-I", "-c", code]
    return wall(lambda: subprocess.run(cmd, check=True, cwd="/"), repeat)


def node_fp(host: str, **kw: object) -> dict:
    devices = [device(f"mlx5_{i}") for i in range(8)]
    return fingerprint(host, devices=devices, plugins=[plugin()], **kw)  # type: ignore[arg-type]


def distinct_objects(n: int, template: dict) -> dict[str, dict]:
    """One decoded dict per node, as ``json.loads`` of each stored row gives."""
    text = json.dumps(template)
    return {f"n{i:05d}": json.loads(text) for i in range(n)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    r = args.repeat
    config = PolicyConfig()

    base = run_python("pass", r)
    cfg = run_python("import ncclguard.config", r)
    imp = run_python("import ncclguard.config, ncclguard.policy", r)
    print(f"baseline: python3 -I -c pass                {base * 1e3:8.2f} ms  (1.00)")
    print(f"import ncclguard.config                     {cfg * 1e3:8.2f} ms  ({cfg / base:.2f}x)")
    print(f"import ncclguard.config, ncclguard.policy    {imp * 1e3:8.2f} ms  ({imp / base:.2f}x;"
          f" policy alone +{(imp - cfg) / base:.2f}x)")

    template = node_fp("x")
    same = distinct_objects(1024, template)
    shared_obj = copy.deepcopy(template)
    shared = {h: shared_obj for h in same}
    mixed = distinct_objects(1024, template)
    for i, h in enumerate(list(mixed)):
        if i % 97 == 0:
            mixed[h] = node_fp(h, nccl="2.18.3")
        elif i % 89 == 0:
            mixed[h] = node_fp(h, conf={"NCCL_IB_DISABLE": "1"})
    big = distinct_objects(16384, template)
    # the store keeps node_values() per node; equal records decoded once and shared
    record = node_values(template)
    records = {h: record for h in same}
    records_mixed: dict[str, dict] = {}
    decoded: dict[str, dict] = {}
    for h, fp in mixed.items():
        text = json.dumps(node_values(fp), sort_keys=True)
        records_mixed[h] = decoded.setdefault(text, json.loads(text))

    cases: list[tuple[str, dict[str, dict]]] = [
        ("1024 identical, one dict per node", same),
        ("1024 identical, shared dict (store classes)", shared),
        ("1024 in 3 classes, refuse + odd nodes", mixed),
        ("16384 identical, one dict per node", big),
        ("1024 node_values records, shared", records),
        ("1024 node_values records, 3 classes, refuse", records_mixed),
        ("16384 node_values records, shared", {f"n{i:05d}": record for i in range(16384)}),
    ]
    for label, fps in cases:
        judge = evaluate_values if "node_values" in label else evaluate
        v = judge(fps, config)
        t = wall(lambda fps=fps, judge=judge: judge(fps, config), max(3, r // 3))
        print(f"evaluate: {label:44s} {t * 1e3:8.2f} ms  ({t / base:.2f}x of baseline)"
              f"  -> {v.decision}, odd {len(v.odd_nodes)}")

    # a job's own NCCL variables: each pair interleaved, the fastest of each side
    job = {"NCCL_IB_DISABLE": "1", "NCCL_IB_HCA": "mlx5_0"}
    for label, recs in [("1024 records, 3 classes", records_mixed),
                        ("16384 records, shared", {f"n{i:05d}": record for i in range(16384)}),
                        ("16384 records, 16384 distinct", {
                            f"n{i:05d}": json.loads(json.dumps(record)) for i in range(16384)})]:
        plain: list[float] = []
        with_vars: list[float] = []
        for _ in range(max(3, r // 3)):
            for out, fn in ((plain, lambda recs=recs: evaluate_values(recs, config)),
                            (with_vars, lambda recs=recs: evaluate_env(recs, config, job))):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        a, b = min(plain), min(with_vars)
        print(f"job vars: {label:36s} {a * 1e3:8.2f} -> {b * 1e3:8.2f} ms  ({b / a:.2f}x)")


if __name__ == "__main__":
    main()
