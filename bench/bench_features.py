"""Prevention at scheduling time (docs/scheduling.md): what the class features cost and save,
on a real slurmctld with the shipped job_submit.lua and the gate as PrologSlurmctld.

1. Submit-to-start of a batch of two-node jobs. Eight nodes, two classes: n1 and n4 run
   NCCL 2.18.3 (refuse-level), the six others 2.21.5. ``--jobs`` two-node jobs are
   submitted at once; each records when it really started (``date +%s.%N`` in the job).
   With the features (the sync daemon running, the lua adding ``[A|B]``) against the
   gate alone (the file of classes removed: the lua adds nothing, Slurm picks the
   lowest-numbered idle nodes, and the gate refuses and steers the mixed sets),
   alternated ``--rounds`` times on the same cluster. Printed: the median and the
   worst submit-to-start of each, their ratio, and the gate's refusals.
2. The backfill cycle (``sdiag``) with 1, 8 and 32 classes against no constraint:
   ``--nodes`` nodes (64) all busy with one exclusive job, 200 pending two-node jobs,
   ``bf_interval=1``; the nodes' features ``f0..f{k-1}`` round robin; each pending job
   ``--constraint=[f0|...|f{k-1}]`` (none for the baseline). Printed: the mean backfill
   cycle over ``--cycles`` cycles (``sdiag -r`` between settings) and its ratio to no
   constraint.

    .venv/bin/python bench/bench_features.py [--dir DIR] [--jobs 16] [--rounds 2]
    .venv/bin/python bench/bench_features.py --quick       # 8 jobs, 1 round, 32 nodes

Prints figures and ratios; never asserts a time.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from helpers.fingerprints import fingerprint  # noqa: E402
from helpers.wait import wait_until  # noqa: E402

from devtools.devcluster import DevCluster  # noqa: E402
from ncclguard import audit  # noqa: E402

ODD = ("n1", "n4")


def _batch(c: DevCluster, jobs: int, tag: str, exclusive: bool) -> tuple[list[float], int]:
    """Submit ``jobs`` two-node jobs at once; their submit-to-start times, and how many
    refusals the gate wrote for them."""
    c.cancel_all()
    c.wait_nodes_idle(120)
    submitted: dict[int, float] = {}
    for i in range(jobs):
        t = time.time()
        job = c.sbatch(["-N2", "-J", f"{tag}{i}", "-o", f"{c.root}/tmp/{tag}-%j.out",
                        *(["--exclusive"] if exclusive else []),
                        "--wrap", "date +%s.%N; sleep 2"])
        submitted[job] = t

    def done() -> bool:
        out = c.run(["squeue", "-h", "-t", "all", "-o", "%i %T"]).stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(str(j)) in ("COMPLETED", "FAILED", "CANCELLED")
                   for j in submitted)

    wait_until(done, 900, f"the {tag} batch")
    waits = []
    for job, t in submitted.items():
        text = (c.root / "tmp" / f"{tag}-{job}.out").read_text().split()
        waits.append(float(text[0]) - t)
    refusals = sum(1 for job in submitted for r in audit.read(c.audit_path, job=job)
                   if r.get("decision") == "refuse")
    return waits, refusals


def submit_to_start(base: Path, jobs: int, rounds: int) -> None:
    root = base / "submit"
    with DevCluster(root, nodes=8, prolog=True, job_submit=True) as c:
        c.write_gate_config(f'[gate]\naudit_log = "{c.audit_path}"\nsteer_wait_s = 30\n'
                            f'[features]\nclasses_file = "{c.classes_file}"\n')
        for host in c.node_names:
            c.publish_fingerprint(host, fingerprint(host, nccl="2.18.3" if host in ODD
                                                    else "2.21.5"))
        c.collect()
        print(f"1. submit-to-start, {jobs} two-node jobs at once (each runs 2 s), 8 nodes of "
              f"2 CPUs (n1, n4 on another NCCL), {rounds} round(s) each:")
        for exclusive in (False, True):
            results: dict[str, list[float]] = {"features": [], "gate": []}
            refused = {"features": 0, "gate": 0}
            for r in range(rounds):
                for mode in ("features", "gate"):
                    if mode == "features":
                        c.start_features_daemon()
                        time.sleep(3)
                    else:
                        c.stop_features_daemon()
                        c.classes_file.unlink(missing_ok=True)
                        time.sleep(1.1)
                    waits, n = _batch(c, jobs, f"{mode}{r}{int(exclusive)}-", exclusive)
                    results[mode] += waits
                    refused[mode] += n
            c.stop_features_daemon()
            print("   " + ("--exclusive: jobs queue for nodes" if exclusive else
                          "shared nodes: every job fits at once"))
            for mode, waits in results.items():
                print(f"     {mode:9s} median {statistics.median(waits):6.2f} s  worst "
                      f"{max(waits):6.2f} s  gate refusals {refused[mode]}")
            f, g = results["features"], results["gate"]
            print(f"     ratio features/gate: median "
                  f"{statistics.median(f) / statistics.median(g):.2f}x, worst "
                  f"{max(f) / max(g):.2f}x")


def _sdiag_mean_us(c: DevCluster) -> tuple[float, int]:
    out = c.run(["sdiag"]).stdout
    bf = out.split("Backfilling stats", 1)[1]
    cycles = re.search(r"Total cycles:\s+(\d+)", bf)
    mean = re.search(r"Mean cycle:\s+(\d+)", bf)
    if not cycles or not mean:  # none yet since sdiag -r
        return 0.0, 0
    return float(mean[1]), int(cycles[1])


def backfill(base: Path, nodes: int, pending: int, cycles: int) -> None:
    root = base / "backfill"
    conf = "SchedulerParameters=sched_min_interval=0,bf_interval=1,bf_max_job_test=1000"
    with DevCluster(root, nodes=nodes, cpus=1, prolog=False, extra_conf=conf) as c:
        hold = c.sbatch(["-N", str(nodes), "--exclusive", "--wrap", "sleep 3600"])
        c.wait_job(hold, {"RUNNING"}, 120)
        base_mean = 0.0
        print(f"2. backfill cycle (sdiag 'Mean cycle'), {nodes} nodes busy, {pending} pending "
              "two-node jobs:")
        for k in (0, 1, 8, 32):
            c.run(["scancel", "--state=PENDING", "--user", "root"], check=False)
            for i, node in enumerate(c.node_names):
                feat = f"f{i % k}" if k else ""
                c.run(["scontrol", "update", f"NodeName={node}", f"AvailableFeatures={feat}",
                       f"ActiveFeatures={feat}"])
            constraint = ["-C", "[" + "|".join(f"f{i}" for i in range(k)) + "]"] if k else []
            for _ in range(pending):
                c.run(["sbatch", "-N2", *constraint, "--wrap", "true"])
            c.run(["sdiag", "-r"])
            wait_until(lambda: _sdiag_mean_us(c)[1] >= cycles, 600, f"{cycles} backfill cycles")
            mean, n = _sdiag_mean_us(c)
            if k == 0:
                base_mean = mean
                print(f"   no constraint  mean {mean / 1000:8.1f} ms over {n} cycles")
            else:
                print(f"   {k:2d} classes     mean {mean / 1000:8.1f} ms over {n} cycles  "
                      f"{mean / base_mean:.2f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--jobs", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--pending", type=int, default=200)
    p.add_argument("--cycles", type=int, default=10)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=("submit", "backfill"), default=None)
    a = p.parse_args()
    if a.quick:
        a.jobs, a.rounds, a.nodes, a.pending, a.cycles = 8, 1, 32, 100, 5
    base = a.dir or Path(tempfile.mkdtemp(prefix="bench-features-"))
    try:
        if a.only in (None, "submit"):
            submit_to_start(base, a.jobs, a.rounds)
        if a.only in (None, "backfill"):
            backfill(base, a.nodes, a.pending, a.cycles)
    finally:
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
