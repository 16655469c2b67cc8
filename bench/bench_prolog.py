"""What the gate costs: the prolog process against bare Python, and jobs through Slurm.

1. Process cost. A 16,384-node inventory is built once (cached under --work). Then,
   alternating in one run so that machine noise hits both alike, we time
   ``python -I -c pass`` (the baseline) and the real gate process
   (``python -I -m prolog.gate`` with a PrologSlurmctld-like environment) for an
   allocation of 1,024 and of 16,384 nodes. Targets: <= 2.5x and <= 5x the baseline.
2. Refusal cost. The same gate process refusing a 4-node batch allocation of a held job
   on the real dev cluster: the path that asks Slurm (the release, the partition's nodes,
   the job) and writes the AdminComment, against the same baseline. The calls differ by
   Slurm release (docs/slurm-versions.md), so run it on each.
3. Cluster cost. The time to push N short two-node batch jobs through the real dev
   cluster (munged + slurmctld + 4 slurmd) without and with the gate as PrologSlurmctld.

    .venv/bin/python bench/bench_prolog.py             # all three parts
    .venv/bin/python bench/bench_prolog.py --no-cluster --runs 15
    .venv/bin/python bench/bench_prolog.py --no-cluster --no-refusal --against ../old
        # part 1 of another checkout (its own .venv) interleaved too: before/after a change
    scripts/slurm-root.sh run .venv/bin/python bench/bench_prolog.py   # on Slurm 24.11

Prints ratios; never asserts (timed tests are not tests).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # devtools/ is not installed
sys.path.insert(0, str(ROOT / "tests"))

INVENTORY_NODES = 16384


def build_inventory(db: Path, n: int) -> None:
    from helpers.fingerprints import fingerprint

    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    if db.exists() and time.time() - db.stat().st_mtime > 600:
        db.unlink()  # its heartbeats would be stale: the gate would warn and call Slurm
    if db.exists():
        # a writer: migrates a cached inventory of an older schema
        with Inventory(db, values=GATE_VALUES) as inv:
            if len(inv.hosts()) == n:
                return
        db.unlink()
    t = time.perf_counter()
    now = time.time()
    with Inventory(db, values=GATE_VALUES) as inv:
        # the writer's own code path, in one transaction (one fsync, not 16,384)
        inv._retrying = lambda conn, body, doing: body(conn)  # type: ignore[method-assign]
        inv._conn.execute("BEGIN IMMEDIATE")
        for i in range(1, n + 1):
            # the record a current daemon sends (issue 39: with its offers part)
            inv.upsert(fingerprint(f"n{i:05d}", plugin_abi=8, offers=True), now=now)
        inv._conn.execute("COMMIT")
    print(f"built a {n}-node inventory in {time.perf_counter() - t:.1f}s: {db}")


def timed(argv: list[str], env: dict[str, str]) -> float:
    t = time.perf_counter()
    r = subprocess.run(argv, env=env, capture_output=True, timeout=60)
    dt = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{argv} -> {r.returncode}: {r.stderr.decode()[-2000:]}")
    if b"ERROR" in r.stderr:  # a gate that failed open is fast, and measures nothing
        raise SystemExit(f"{argv}: the gate reported an error: {r.stderr.decode()[-2000:]}")
    return dt


#: builds an inventory with another checkout's own code (its .venv): only what every
#: version of the store has (Inventory, GATE_VALUES, upsert, the test fingerprints)
_BUILD_ELSEWHERE = """
import sys, time
root, db, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path[:0] = [root, root + "/tests"]
try:
    from helpers.fingerprints import fingerprint
except ImportError:  # a checkout from before tests/helpers/
    from policy_fingerprints import fingerprint
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory
with Inventory(db, values=GATE_VALUES) as inv:
    inv._retrying = lambda conn, body, doing: body(conn)
    inv._conn.execute("BEGIN IMMEDIATE")
    for i in range(1, n + 1):
        try:
            fp = fingerprint(f"n{i:05d}", plugin_abi=8, offers=True)
        except TypeError:  # a checkout before issue 39: its daemon sent no offers part
            fp = fingerprint(f"n{i:05d}", plugin_abi=8)
        inv.upsert(fp, now=time.time())
    inv._conn.execute("COMMIT")
"""


def saved_environment(state: Path, job_id: int) -> None:
    """A batch job's environment as slurmctld saves it (docs/slurm.md): a login shell's
    60 variables, a venv activated, a module's LD_LIBRARY_PATH."""
    import struct

    env = [f"VAR{i}=" + "x" * 40 for i in range(56)]
    env += ["VIRTUAL_ENV=/shared/venvs/torch", "PATH=/shared/venvs/torch/bin:/usr/bin",
            "LD_LIBRARY_PATH=" + ":".join(f"/opt/m{i}/lib" for i in range(12)),
            "NCCL_IB_HCA=mlx5_0"]
    d = state / f"hash.{job_id % 10}" / f"job.{job_id}"
    d.mkdir(parents=True, exist_ok=True)
    data = struct.pack("=I", len(env)) + b"".join(e.encode() + b"\0" for e in env)
    f = d / "environment"
    f.write_bytes(data)
    f.chmod(0o600)


def process_cost(work: Path, runs: int, against: Path | None = None,
                 batch: bool = False) -> None:
    db = work / "inventory.db"
    build_inventory(db, INVENTORY_NODES)
    conf = work / "bench.toml"
    conf.write_text(f'[gate]\naudit_log = "{work / "decisions.jsonl"}"\n'
                    f'state_save_location = "{work / "state"}"\n')
    saved_environment(work / "state", 4242)
    py = sys.executable
    gates = {"gate": ([py, "-I", "-m", "prolog.gate"], conf, db)}
    if against is not None:  # the other checkout's gate, on an inventory its code wrote
        other = work / "against"
        other.mkdir(exist_ok=True)
        odb, oconf = other / "inventory.db", other / "bench.toml"
        odb.unlink(missing_ok=True)
        other_py = str(against / ".venv" / "bin" / "python")
        subprocess.run([other_py, "-c", _BUILD_ELSEWHERE, str(against), str(odb),
                        str(INVENTORY_NODES)], check=True, timeout=1800)
        oconf.write_text(f'[gate]\naudit_log = "{other / "decisions.jsonl"}"\n')
        gates["against"] = ([other_py, "-I", "-m", "prolog.gate"], oconf, odb)
        print(f"against: {against} (its own .venv and inventory)")
    base_env = {"PATH": "/usr/bin:/bin", "LANG": "C"}
    baseline_argv = [py, "-I", "-c", "pass"]
    print(f"\nprocess cost, median of {runs} (interleaved), python {sys.version.split()[0]}"
          f"{', a batch job with a saved environment' if batch else ''}")
    for size, target in ((1024, 2.5), (16384, 5.0)):
        envs = {
            name: {
                **base_env,
                "NCCLGUARD_CONFIG": str(cfg),
                "NCCLGUARD_DB": str(inv),
                "SLURM_JOB_ID": "4242",
                "SLURM_JOB_NODELIST": f"n[00001-{size:05d}]",
                "SLURM_JOB_NUM_NODES": str(size),
                "SLURM_JOB_PARTITION": "debug",
                "SLURM_JOB_USER": "bench",
                "SLURM_JOB_UID": "1000",
                "SLURM_SCRIPT_CONTEXT": "prolog_slurmctld",
                # a batch job: the gate reads its saved environment (issue 40)
                **({"SLURM_JOB_STDIN": "/dev/null"} if batch else {}),
            }
            for name, (_, cfg, inv) in gates.items()
        }
        for name, (argv, _, _) in gates.items():
            timed(argv, envs[name])  # warm the page cache and the .pyc files
        base: list[float] = []
        times: dict[str, list[float]] = {name: [] for name in gates}
        for _ in range(runs):
            base.append(timed(baseline_argv, base_env))
            for name, (argv, _, _) in gates.items():
                times[name].append(timed(argv, envs[name]))
        b = statistics.median(base)
        for name, ts in times.items():
            g = statistics.median(ts)
            verdict = "OK" if g / b <= target else "OVER"
            print(
                f"  {size:>6} nodes: baseline {b * 1000:6.1f} ms, {name} {g * 1000:6.1f} ms, "
                f"ratio {g / b:4.2f}x (target <= {target}x) {verdict}"
            )


def refusal_cost(work: Path, runs: int) -> None:
    from helpers.fingerprints import fingerprint

    from devtools.devcluster import DevCluster
    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    root = Path(tempfile.mkdtemp(prefix="bench-refuse-", dir=work))
    with DevCluster(root, prolog=False) as c:
        with Inventory(c.db, values=GATE_VALUES) as inv:
            for host in c.node_names:
                inv.upsert(fingerprint(host, nccl="2.18.3" if host == "n1" else "2.21.5"))
        c.write_gate_config(f'slurm_conf = "{c.conf}"\nsteer_wait_s = 1\n')
        release = c.slurm().version()
        job = c.sbatch(["-N4", "--hold", "--wrap", "true"])
        py = sys.executable
        base_env = {"PATH": "/usr/bin:/bin", "LANG": "C"}
        env = {
            **base_env,
            "NCCLGUARD_CONFIG": str(c.config_path),
            "NCCLGUARD_DB": str(c.db),
            "SLURM_JOB_ID": str(job),
            "SLURM_JOB_NODELIST": "n[1-4]",
            "SLURM_JOB_NUM_NODES": "4",
            "SLURM_JOB_PARTITION": "debug",
            "SLURM_JOB_USER": "bench",
            "SLURM_JOB_UID": "1000",
            "SLURM_JOB_STDIN": "/dev/null",
            "SLURM_JOB_RESTART_COUNT": "0",
            "SLURM_SCRIPT_CONTEXT": "prolog_slurmctld",
        }
        argv = [py, "-I", "-m", "prolog.gate"]
        print(f"\nrefusal cost, median of {runs} (interleaved), Slurm {release}, "
              f"python {sys.version.split()[0]}")  # fmt: skip

        def refuse() -> float:
            t = time.perf_counter()
            r = subprocess.run(argv, env=env, capture_output=True, timeout=60)
            dt = time.perf_counter() - t
            if r.returncode != 1 or b"refuse" not in r.stderr or b"ERROR" in r.stderr:
                raise SystemExit(f"the gate did not refuse cleanly: {r.stderr.decode()[-2000:]}")
            return dt

        refuse()
        base, gate = [], []
        for _ in range(runs):
            base.append(timed([py, "-I", "-c", "pass"], base_env))
            gate.append(refuse())
        b, g = statistics.median(base), statistics.median(gate)
        print(f"  4 nodes, refused: baseline {b * 1000:6.1f} ms, gate {g * 1000:6.1f} ms, "
              f"ratio {g / b:4.2f}x")  # fmt: skip
        c.run(["scancel", str(job)], check=False)


def cluster_cost(work: Path, jobs: int) -> None:
    from helpers.fingerprints import fingerprint
    from helpers.wait import wait_until

    from devtools.devcluster import DevCluster
    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    print(f"\ncluster cost: {jobs} two-node batch jobs (sbatch -N2 --wrap true), 4 slurmd")
    results = {}
    for with_gate in (False, True):
        root = Path(tempfile.mkdtemp(prefix="bench-cluster-", dir=work))
        c = DevCluster(root, prolog=with_gate)
        with Inventory(c.db, values=GATE_VALUES) as inv:
            for host in c.node_names:
                inv.upsert(fingerprint(host))
        c.write_gate_config("")
        with c:
            t = time.perf_counter()
            ids = [c.sbatch(["-N2", "--wrap", "true"]) for _ in range(jobs)]

            def done(c: DevCluster = c) -> bool:
                r = c.run(["squeue", "-h", "-o", "%i"], check=False)
                return not r.stdout.strip()

            wait_until(done, 1800, "all jobs to finish", interval=0.5)
            dt = time.perf_counter() - t
            bad = [j for j in ids[-5:] if c.job_field(j, "JobState") != "COMPLETED"]
            if bad:
                print(f"  warning: jobs not COMPLETED: {bad}")
        results[with_gate] = dt
        print(f"  {'with' if with_gate else 'without'} the gate: {dt:6.1f} s")
    print(f"  ratio with/without: {results[True] / results[False]:4.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ncclguard-bench")
    p.add_argument("--runs", type=int, default=21)
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--no-cluster", action="store_true")
    p.add_argument("--no-process", action="store_true")
    p.add_argument("--no-refusal", action="store_true")
    p.add_argument("--batch", action="store_true",
                   help="part 1 as a batch job: the gate reads its saved environment")
    p.add_argument("--against", type=Path, default=None, metavar="CHECKOUT",
                   help="also time CHECKOUT's gate (its .venv), interleaved: before/after")
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    os.chdir(a.work)
    if not a.no_process:
        process_cost(a.work, a.runs, a.against.resolve() if a.against else None, a.batch)
    if not a.no_refusal:
        refusal_cost(a.work, a.runs)
    if not a.no_cluster:
        cluster_cost(a.work, a.jobs)


if __name__ == "__main__":
    main()
