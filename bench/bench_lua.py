"""What job_submit.lua costs slurmctld per submission (docs/perf.md, "job_submit.lua").

Three real clusters side by side, each a slurmctld with 2 slurmd and 126 nodes defined
without one (so that the file of classes offers a job 64 classes, the lua's worst case):

- ``none``: no job_submit plugin;
- ``trivial``: ``JobSubmitPlugins=lua`` with a script that returns at once (Slurm's own
  cost of calling a lua: it builds the job's tables);
- ``fixed``: a lua that sets the same 64-class group ncclguard's lua gives, as a constant
  (the nodes carry the features: Slurm's own cost of a job with that constraint);
- ``ncclguard``: the shipped slurm/job_submit.lua, its file kept by the features daemon.

``ncclguard`` against ``fixed`` is what the lua's own logic costs; against ``none``, what a
submission costs with prevention (the group included).

Interleaved, in a new random order each round: one ``sbatch --hold -N2`` (gets the group
of 64 classes from ncclguard's lua) and one hostile ``sbatch`` whose ``#SBATCH
--constraint=`` line is 10 MB (Slurm refuses it after the plugin), on each cluster. The
client's wall time of each is taken (process start included, the same for all).

Printed: median and p95 per cluster and kind, and the ratios to ``none`` and ``trivial``.

    .venv/bin/python bench/bench_lua.py [--rounds 60] [--dir DIR]

Prints figures and ratios; never asserts a time.
"""

from __future__ import annotations

import argparse
import random
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

EXTRA = [f"x{i}" for i in range(1, 127)]  # 63 classes, and n[1-2] one more
FIXED = """\
function slurm_job_submit(job_desc, part_list, submit_uid)
  if job_desc.min_nodes ~= nil and job_desc.min_nodes >= 2 and job_desc.min_nodes < 4294967294
  then job_desc.features = GROUP end
  return slurm.SUCCESS
end
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid) return slurm.SUCCESS end
return slurm.SUCCESS
"""
TRIVIAL = """\
function slurm_job_submit(job_desc, part_list, submit_uid) return slurm.SUCCESS end
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid) return slurm.SUCCESS end
return slurm.SUCCESS
"""


def _cluster(root: Path, kind: str) -> DevCluster:
    c = DevCluster(root / kind, nodes=2, prolog=False, job_submit=kind != "none",
                   extra_nodes=EXTRA)
    c.start()
    if kind == "trivial":
        (c.root / "job_submit.lua").write_text(TRIVIAL)
    if kind in ("ncclguard", "fixed"):
        c.write_gate_config(f'[features]\nclasses_file = "{c.classes_file}"\n'
                            "interval_s = 1.0\n")
        for h in c.node_names:
            c.publish_fingerprint(h, fingerprint(h))
        c.collect()
        c.store_fingerprints(fingerprint(h, nccl=f"2.22.{i // 2}")
                             for i, h in enumerate(EXTRA))
        c.start_features_daemon()

        def grouped() -> bool:
            r = c.run(["sbatch", "--hold", "-N2", "--wrap", "true"], check=False)
            if r.returncode:
                return False
            job = r.stdout.split()[-1]
            feats = c.job_field(int(job), "Features")
            c.run(["scancel", job], check=False)
            return feats.count("|") == 63

        wait_until(grouped, 120, "the lua's group of 64 classes")
        if kind == "fixed":
            r = c.run(["sbatch", "--hold", "-N2", "--wrap", "true"])
            job = r.stdout.split()[-1]
            group = c.job_field(int(job), "Features")
            c.run(["scancel", job], check=False)
            (c.root / "job_submit.lua").write_text(FIXED.replace("GROUP", f'"{group}"'))
    return c


def _time(c: DevCluster, argv: list[str]) -> float:
    t0 = time.perf_counter()
    c.run(argv, check=False, timeout=120)
    return time.perf_counter() - t0


def _stats(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, int(0.95 * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="ncclguard-bench-lua-"))
    kinds = ("none", "trivial", "fixed", "ncclguard")
    clusters = {}
    try:
        for k in kinds:
            clusters[k] = _cluster(root, k)
        huge = root / "huge.sh"
        huge.write_text("#!/bin/sh\n#SBATCH --constraint=" + "a&" * (5 << 20) + "\ntrue\n")
        jobs = {
            "submit -N2": ["sbatch", "--hold", "-N2", "--wrap", "true"],
            "10 MB constraint": ["sbatch", "--hold", "-N2", str(huge)],
        }
        times: dict[tuple[str, str], list[float]] = {(k, j): [] for k in kinds for j in jobs}
        rng = random.Random(24)
        for r in range(args.rounds):
            order = [(k, j) for k in kinds for j in jobs]
            rng.shuffle(order)
            for k, j in order:
                times[(k, j)].append(_time(clusters[k], jobs[j]))
            if r % 20 == 19:
                for c in clusters.values():
                    c.cancel_all()
        release = clusters["none"].slurm().version()
        print(f"Slurm {release}, {args.rounds} rounds interleaved; client wall time per "
              "sbatch (ms)")
        print(f"{'job':18} {'cluster':10} {'median':>8} {'p95':>8} {'/none':>7} "
              f"{'/trivial':>9} {'/fixed':>7}")
        for j in jobs:
            base, triv, fixed = (_stats(times[(k, j)])[0] for k in ("none", "trivial", "fixed"))
            for k in kinds:
                med, p95 = _stats(times[(k, j)])
                print(f"{j:18} {k:10} {med * 1e3:8.1f} {p95 * 1e3:8.1f} {med / base:7.2f} "
                      f"{med / triv:9.2f} {med / fixed:7.2f}")
    finally:
        for c in clusters.values():
            c.stop_features_daemon()
            c.stop()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
