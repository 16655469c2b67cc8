#!/usr/bin/env python3
"""The Epilog on a hostile job log: peak memory and time within its budget (issue 47).

A failed job's output is its user's file, and ``ncclguard-epilog`` (EpilogSlurmctld)
reads it on the controller. Before issue 47 the scanner kept a match per distinct host
and value with no cap: a 108 MB log of distinct hosts and NCCL versions held 752 MB and
ran 29 s against its 20 s budget. This generates two logs of ``--size`` (default 1 GiB):

  honest    a 16-node job with NCCL_DEBUG=INFO (bench_diagnose.py's generator)
  hostile   every line a new host name (and long), a new NCCL version, a new net plugin
            name: from the job's 16 nodes and from hosts that are not the job's

and runs the real Epilog (``prolog.epilog.main``, its default 20 s budget, the job's
nodes and uid as Slurm gives them) on each in a child process, interleaved honest /
hostile, ``--rounds`` times; it prints each run's wall time and peak RSS (``wait4``), the
medians, the hostile/honest ratios, and the stated bounds: peak RSS at most
:data:`RSS_BOUND_MB`, wall time at most the budget plus :data:`OVER_BUDGET_S`.

    .venv/bin/python bench/bench_epilog_hostile.py                 # 1 GiB each
    .venv/bin/python bench/bench_epilog_hostile.py --size 200M --rounds 1

Prints figures; never asserts.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

RSS_BOUND_MB = 100.0
BUDGET_S = 20.0  # the Epilog's default --budget
OVER_BUDGET_S = 2.0  # what the end of a diagnosis may add past the budget


def hostile(path: Path, size: int) -> None:
    """Lines a user can print: the job's nodes with ever new versions and plugin names,
    and ever new hosts (long names) that are not the job's."""
    pad = "x" * 40
    i = 0
    with open(path, "w") as f:
        written = 0
        while written < size:
            out = []
            for _ in range(5000):
                i += 1
                own = f"n{i % 16 + 1}"
                out.append(f"{own}:{i}:{i} [0] NCCL INFO NCCL version 2.{i % 99991}.{i}+cuda12.4")
                out.append(f"host{i}.{pad}:{i}:{i} [0] NCCL INFO NCCL version 2.{i}.{i}+cuda12")
                out.append(f"host{i}.{pad}:{i}:{i} [0] NCCL INFO NET/Plugin: Loaded net plugin "
                           f"p{i} (v8)")
                out.append(f"{own}:{i}:{i} [0] NCCL INFO comm 0x{i:x} rank {i} nranks {i + 1} "
                           f"cudaDev 0 busId 0 - Init COMPLETE")
            text = "\n".join(out) + "\n"
            f.write(text)
            written += len(text)


def child(log: str, work: str) -> int:
    from prolog import epilog

    conf = Path(work) / "epilog.toml"
    trail = Path(work) / "decisions.jsonl"
    conf.write_text(f'[gate]\naudit_log = "{trail}"\n[inventory]\ndb = "{work}/no.db"\n')
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_EXIT_CODE": "256", "SLURM_JOB_STDOUT": log,
           "SLURM_JOB_NODELIST": "n[1-16]", "SLURM_JOB_START_TIME": "2000",
           "SLURM_JOB_UID": str(os.getuid())}
    rc = epilog.main(["--config", str(conf)], env=env)
    rec = [json.loads(line) for line in trail.read_text().splitlines()][-1]
    print(json.dumps({"rc": rc, "diagnoses": [d["id"] for d in rec.get("diagnoses", [])],
                      "problems": rec.get("problems", [])}))
    return 0


def measure(log: Path, work: Path) -> tuple[float, float, dict]:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child",
                             str(log), str(work)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT)
    _, status, rusage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - t0
    out = proc.stdout.read().decode() if proc.stdout else ""
    err = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"child failed: {err.strip()}")
    return elapsed, rusage.ru_maxrss / 1024.0, json.loads(out)


def main() -> int:
    from bench_diagnose import generate, parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1G", help="each log's size (1G, 200M, ...)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(*a.child)
    size = parse_size(a.size)
    with tempfile.TemporaryDirectory(prefix="ncclguard-bench-") as tmp:
        work = Path(tmp)
        logs = {"honest": work / "honest.log", "hostile": work / "hostile.log"}
        generate(logs["honest"], size)
        hostile(logs["hostile"], size)
        for name, p in logs.items():
            os.chown(p, os.getuid(), os.getgid())
            print(f"{name}: {p.stat().st_size / (1 << 20):.0f} MiB")
        runs: dict[str, list[tuple[float, float]]] = {"honest": [], "hostile": []}
        for r in range(max(a.rounds, 1)):
            order = ["honest", "hostile"] if r % 2 == 0 else ["hostile", "honest"]
            for name in order:
                sec, rss, doc = measure(logs[name], work)
                runs[name].append((sec, rss))
                cut = [p for p in doc["problems"] if "time limit" in p or p.startswith("cut")]
                print(f"  round {r + 1} {name:8s} {sec:6.2f} s  peak RSS {rss:6.1f} MB  "
                      f"{','.join(doc['diagnoses']) or '-'}  {'; '.join(cut)[:160]}")
        med = {n: (statistics.median(s for s, _ in v), max(m for _, m in v))
               for n, v in runs.items()}
        for n, (s, m) in med.items():
            print(f"{n:8s} median {s:6.2f} s, peak RSS {m:6.1f} MB")
        print(f"hostile/honest: time {med['hostile'][0] / med['honest'][0]:.2f}x, peak RSS "
              f"{med['hostile'][1] / med['honest'][1]:.2f}x")
        ok_mem = med["hostile"][1] <= RSS_BOUND_MB
        ok_time = max(s for s, _ in runs["hostile"]) <= BUDGET_S + OVER_BUDGET_S
        print(f"bounds: peak RSS <= {RSS_BOUND_MB:.0f} MB: {'yes' if ok_mem else 'NO'}; "
              f"wall <= {BUDGET_S + OVER_BUDGET_S:.0f} s: {'yes' if ok_time else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
