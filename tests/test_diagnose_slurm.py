"""``ncclguard diagnose --job ID`` against the real test cluster: no LOGFILE, Slurm names
the job's nodes, start time and output files (typed fields of ``Slurm.job``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.fingerprints import fingerprint

from devtools.devcluster import DevCluster
from ncclguard import audit
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory
from prolog import epilog

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# what two ranks of a job on n3 (NCCL 2.18.3) and n4 (2.21.5) print, one per stream
SCRIPT = """#!/bin/sh
echo "n3:4047:4047 [0] NCCL INFO Bootstrap : Using eth0:192.0.2.3<0>"
echo "n3:4047:4047 [0] NCCL INFO NCCL version 2.18.3+cuda12.2"
echo "n4:4051:4051 [0] NCCL INFO NCCL version 2.21.5+cuda12.4" >&2
echo "n4:4051:4051 [0] NCCL INFO Bootstrap : Using eth0:192.0.2.4<0>" >&2
exit 1
"""


def diagnose(cluster: DevCluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **cluster.env,
        "NCCLGUARD_CONFIG": str(cluster.config_path),
        "NCCLGUARD_DB": str(cluster.db),
    }
    return subprocess.run(
        [sys.executable, "-m", "ncclguard.cli", "diagnose", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cluster.root,
    )


def test_diagnose_job_finds_its_output_through_slurm(
    cluster: DevCluster, tmp_path: Path
) -> None:
    c = cluster
    c.remove_inventory()
    with Inventory(c.db, values=GATE_VALUES) as inv:
        for host in c.node_names:
            inv.upsert(fingerprint(host, nccl="2.18.3" if host == "n3" else "2.21.5"))
    script = c.root / "tmp" / "mixed.sh"
    script.write_text(SCRIPT)
    # the user opted out of the gate, so the job ran on the mixed pair and failed;
    # relative paths (from the working directory), %x and %j, and %N, which the node
    # expands to its host name: Slurm must say where the files are
    job = int(
        c.run(
            ["sbatch", "--parsable", "-N2", "-w", "n[3-4]", "-J", "mixed",
             "--comment", "ncclguard=off",
             "-o", "diag-%x-%j-%N.out", "-e", "diag-%j.err", str(script)]
        ).stdout
    )  # fmt: skip
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 60) == "FAILED"
    time.sleep(0.2)

    r = diagnose(c, "--job", str(job), "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["result"] == "found"
    first = report["diagnoses"][0]
    assert first["id"] == "nccl-version-differs"
    assert first["odd_nodes"] == ""  # one host each: the log alone cannot say which
    # found through Slurm: both streams, the node's %N, the job's nodes and start
    files = report["job"]["files"]
    out = next(c.root.joinpath("tmp").glob(f"diag-mixed-{job}-*.out"))
    assert files == [str(out), str(c.root / "tmp" / f"diag-{job}.err")]
    assert report["job"]["nodes"] == "n[3-4]" and report["job"]["state"] == "FAILED"
    start = c.slurm().job(job).start_time  # type: ignore[union-attr]
    assert report["job"]["start_time"] == start and start is not None
    where = {(e["file"], e["host"]) for e in first["evidence"]}
    assert where == {(str(out), "n3"), (files[1], "n4")}
    # the inventory as of the job's start agrees, and its majority (2.21.5) makes n3 odd
    assert first["confirmed"] is True, r.stdout
    assert report["inventory"]["nodes"] == "n[3-4]"
    assert report["inventory"]["verdict"]["odd_nodes"] == "n3"

    text = diagnose(c, "--job", str(job))
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith(f"job {job}: ")
    assert "n3 printed NCCL version 2.18.3" in text.stdout

    # the Epilog hook, given only the job id and its exit code, asks Slurm the same way
    trail = tmp_path / "decisions.jsonl"
    conf = tmp_path / "epilog.toml"
    conf.write_text(
        f'[gate]\naudit_log = "{trail}"\nslurm_conf = "{c.conf}"\n'
        f'[inventory]\ndb = "{c.db}"\n'
    )
    env = {"SLURM_JOB_ID": str(job), "SLURM_JOB_EXIT_CODE": "256"}
    assert epilog.main(["--config", str(conf)], env=env) == 0
    (rec,) = audit.read(trail, job=job)
    assert rec["action"] == "diagnose" and rec["diagnoses"][0]["id"] == "nccl-version-differs"
    assert rec["files"] == files and rec["nodes"] == "n[3-4]"
    assert rec["verdict"].startswith("ncclguard: refuse, odd n3:")


def test_diagnose_unknown_job_without_files_says_so(cluster: DevCluster) -> None:
    r = diagnose(cluster, "--job", "999999")
    assert r.returncode == 3
    assert "job 999999: Slurm no longer knows this job; name its log files" in r.stderr


@pytest.mark.parametrize("swap", ["fifo", "dev-zero", "root-only", "other-owner"])
def test_diagnose_job_reads_only_the_users_own_regular_files(
        cluster: DevCluster, tmp_path: Path, swap: str) -> None:
    """The job's StdOut is a path its user chose; ``diagnose --job`` runs as root. Once the
    job has ended, its file is swapped for a FIFO (a plain open hung for good), a link to
    ``/dev/zero`` (it spun), a link to a file only root may read (its matching lines were
    printed to the admin), or a file another user owns: each is refused, named, and
    nothing of it is read (issue 47). The jobs of the test cluster run as root, so the
    owner check is shown with a file of another uid."""
    c = cluster
    script = c.root / "tmp" / "fails.sh"
    script.write_text(SCRIPT)
    out = c.root / "tmp" / f"swap-{swap}.out"
    job = int(c.run(["sbatch", "--parsable", "-N1", "-w", "n3", "-o", str(out),
                     str(script)]).stdout)
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 60) == "FAILED"
    time.sleep(0.2)
    out.unlink()
    secret = tmp_path / "secret"
    secret.write_text("n3:1:1 [0] NCCL INFO NCCL version 9.9.9+cuda99\n")
    secret.chmod(0o600)
    if swap == "fifo":
        os.mkfifo(out)
    elif swap == "dev-zero":
        out.symlink_to("/dev/zero")
    elif swap == "root-only":
        out.symlink_to(secret)
    else:
        out.write_text(SCRIPT)
        os.chown(out, 1000, 1000)
    r = diagnose(c, "--job", str(job), "--no-inventory")
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert str(out) in r.stderr and "not read" in r.stderr, r.stderr
    assert "9.9.9" not in r.stdout + r.stderr
    # named by the admin, a FIFO or a device is still refused (the admin's own file is read)
    if swap in ("fifo", "dev-zero"):
        r = diagnose(c, str(out), "--no-inventory")
        assert r.returncode == 3 and "not a regular file" in r.stderr, r.stderr
