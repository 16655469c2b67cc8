"""Record the ``--json`` answers of the Slurm installed here, for the adapter's tests.

    python -m devtools.record_slurm tests/data/slurm/real

starts a private cluster (:class:`devtools.devcluster.DevCluster`, four nodes, partition
``debug``), sets up the scene the recorded answers of every release share, and writes each
answer to ``<dir>/<release>/<name>.json`` (for example ``tests/data/slurm/real/24.11.5/``):

- n3 drained with the reason ``ncclguard: test drain``; n4 with the features ``ncclA,gpu``
- job 7: a held batch job, ``-J typed -N2 -x n4 --comment "x y"``, output
  ``/tmp/out-%j-%x-%N.log``, AdminComment ``ncclguard: hello``
- job 8: an interactive job (``srun -N2``) running on n[1-2]

The scene is also written, as data, to ``scene.json`` next to the answers, so that the tests
compare each release's answers with what was set up, not with each other. Answers from a
release that cannot run here are written by hand from Slurm's source (``tests/data/slurm/
recorded/``); these here come from the real commands.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from devtools.devcluster import DevCluster

SCENE = {
    "nodes": ["n1", "n2", "n3", "n4"],
    "partition": "debug",
    "drained": {"n3": "ncclguard: test drain"},
    "features": {"n4": ["ncclA", "gpu"]},
    "batch_job": {
        "job_id": 7,
        "name": "typed",
        "node_count": 2,
        "excluded_nodes": "n4",
        "comment": "x y",
        "admin_comment": "ncclguard: hello",
        "std_out": "/tmp/out-7-typed-%N.log",  # noqa: S108 (held: never written)
        "state": "PENDING",
        "state_reason": "JobHeldUser",
    },
    "interactive_job": {"job_id": 8, "state": "RUNNING", "nodes": "n[1-2]", "node_count": 2},
}


def record(out_dir: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="ncclguard-record-") as tmp:
        c = DevCluster(Path(tmp), nodes=4, prolog=False, extra_conf="FirstJobId=7")
        with c:
            release = c.run(["scontrol", "--version"]).stdout.split()[-1]
            where = out_dir / release
            where.mkdir(parents=True, exist_ok=True)
            c.run(["scontrol", "update", "NodeName=n3", "State=DRAIN",
                   "Reason=ncclguard: test drain"])  # fmt: skip
            c.run(["scontrol", "update", "NodeName=n4", "AvailableFeatures=ncclA,gpu",
                   "ActiveFeatures=ncclA,gpu"])  # fmt: skip
            job = c.sbatch(["-J", "typed", "-N2", "-x", "n4", "--comment", "x y",
                            "-o", "/tmp/out-%j-%x-%N.log",  # noqa: S108 (held: never written)
                            "--hold", "--wrap", "true"])  # fmt: skip
            c.run(["scontrol", "update", f"jobid={job}", "AdminComment=ncclguard: hello"])
            srun = subprocess.Popen(
                ["srun", "-N2", "-w", "n[1-2]", "sleep", "60"],
                env=c.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                c.wait_job(job + 1, {"RUNNING"}, 60)
                answers = {
                    "sinfo": ["sinfo", "--json"],
                    "squeue": ["squeue", "--json"],
                    "squeue_j7": ["squeue", "--json", "-j", str(job)],
                    "scontrol_show_nodes": ["scontrol", "show", "nodes", "--json"],
                    "scontrol_show_job_7": ["scontrol", "show", "job", str(job), "--json"],
                }
                for name, argv in answers.items():
                    r = c.run(argv, check=False)
                    if r.returncode == 0:
                        text = json.dumps(json.loads(r.stdout), indent=1, sort_keys=True)
                        (where / f"{name}.json").write_text(text + "\n")
                    else:
                        print(f"{release}: {' '.join(argv)}: exit {r.returncode}: "
                              f"{r.stderr.strip()[:200]}", file=sys.stderr)  # fmt: skip
            finally:
                srun.terminate()
                srun.wait(10)
            scene = dict(SCENE, release=release, recorded=time.strftime("%Y-%m-%d"))
            (where / "scene.json").write_text(json.dumps(scene, indent=1) + "\n")
    return where


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir", type=Path)
    where = record(p.parse_args(argv).out_dir)
    print(f"recorded into {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
