"""A job from a pip venv on a real cluster (issue 40): slurmctld saves the ``sbatch``
environment, the gate (PrologSlurmctld) reads it, the collector resolves the venv's real
nvidia-nccl wheel, and the next job from that venv is judged by its own NCCL on each node.

Nodes: host libnccl 2.21.5 on n[1-2] and 2.18.3 on n[3-4] (a job of the host's NCCL is
refused across them); the net plugin IBext offers v8 on every node, or v10 only on n4.
The venv holds NCCL 2.23.4 (pip's nvidia-nccl-cu12), which looks for v8..v5.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.fingerprints import fingerprint
from helpers.wait import wait_until

from devtools.devcluster import DevCluster
from ncclguard import audit

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

HOST = {"n1": "2.21.5", "n2": "2.21.5", "n3": "2.18.3", "n4": "2.18.3"}


def _inventory(c: DevCluster, plugin: dict[str, int]) -> None:
    """Each node publishes its signed record (host libnccl ``HOST``, a net plugin of one
    ABI ``plugin[host]``, what it offers a job's own NCCL); one collector scan."""
    for host in c.node_names:
        c.publish_fingerprint(host, fingerprint(host, nccl=HOST[host],
                                                plugin_abi=plugin.get(host, 8), offers=True))
    r = c.collect()
    assert f"{len(c.node_names)} accepted, 0 rejected" in r.stderr, r.stderr


def _sbatch(c: DevCluster, venv: Path, *args: str, **env: str) -> int:
    r = c.run(["sbatch", "--parsable", *args], env={"VIRTUAL_ENV": str(venv), **env})
    return int(r.stdout.strip().split(";")[0])


def _records(c: DevCluster, job: int) -> list[dict]:
    return audit.read(c.audit_path, job=job)


@pytest.fixture
def own(cluster: DevCluster, venv: Callable[[str], Path]) -> tuple[DevCluster, Path]:
    """The cluster with the inventory above, the gate steering, and a venv whose
    environment the collector has resolved (a first job from it, on n[1-2])."""
    c = cluster
    c.write_gate_config(f'[gate]\naudit_log = "{c.audit_path}"\nsteer_wait_s = 30\n')
    c.remove_inventory()
    c.remove_records()
    _inventory(c, {})
    env = venv("2.23.4")
    first = _sbatch(c, env, "-N2", "-w", "n[1-2]", "--wrap", "true")
    assert c.wait_job(first, {"COMPLETED", "FAILED"}, 60) == "COMPLETED"
    (rec,) = _records(c, first)
    assert rec["job_env"]["vars"] == {"VIRTUAL_ENV": str(env)}, rec
    # the first job from it is judged as any job (on n[1-2] the hosts agree), unless the
    # collector read the venv already (an earlier test's job named it in the audit trail)
    assert rec["decision"] == "accept" and any(
        "is not read yet" in n or "judged by it on each node" in n for n in rec["notes"]), rec
    c.collect()  # its one pass of the job environments the audit trail names
    return c, env


def test_a_venv_job_runs_across_nodes_whose_host_nccl_differ(
    own: tuple[DevCluster, Path],
) -> None:
    c, env = own
    assert c.ncclguard("check", "n[1-4]", check=False).returncode == 2  # the host's NCCL
    job = _sbatch(c, env, "-N4", "--wrap", "hostname")
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 60) == "COMPLETED"
    (rec,) = _records(c, job)
    assert rec["decision"] == "accept" and rec["nodes"] == "n[1-4]", rec
    assert rec["job_nccl"]["source"] == "VIRTUAL_ENV"
    assert rec["job_nccl"]["nccl_version"] == "2.23.4"
    assert rec["job_nccl"]["path"].startswith(f"{env}/lib/python3.")
    assert c.job_field(job, "Restarts") == "0"


def test_a_venv_whose_nccl_cannot_use_one_nodes_plugin_is_refused_steered_and_completes(
    own: tuple[DevCluster, Path],
) -> None:
    c, env = own
    _inventory(c, {"n4": 10})  # n4's plugin now offers v10 only: 2.23.4 cannot use it
    blocker = c.sbatch(["-N1", "-w", "n1", "--exclusive", "--wrap", "sleep 300"])
    assert c.wait_job(blocker, {"RUNNING"}, 60) == "RUNNING"
    job = _sbatch(c, env, "-N3", "--wrap", "hostname")  # only n[2-4] are free
    wait_until(lambda: any(r["decision"] == "followup" for r in _records(c, job)), 60,
               "the gate's refusal and its follow-up", detail=lambda: str(_records(c, job)))
    recs = _records(c, job)
    refusal = next(r for r in recs if r["decision"] == "refuse")
    assert (refusal["nodes"], refusal["odd_nodes"], refusal["action"]) == (
        "n[2-4]", ["n4"], "steer"), refusal
    refusing = [f for f in refusal["findings"] if f["severity"] == "refuse"]
    assert [f["rule"] for f in refusing] == ["job-stack"], refusal["findings"]
    assert "the job's own NCCL 2.23.4 (VIRTUAL_ENV" in refusing[0]["message"]
    followup = next(r for r in recs if r["decision"] == "followup")
    assert (followup["result"], followup["excluded"]) == ("done", "n4")
    c.run(["scancel", str(blocker)])
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 90) == "COMPLETED"
    assert c.job_field(job, "NodeList") == "n[1-3]"
    assert _records(c, job)[-1]["decision"] == "accept"


def test_export_none_hands_nothing_on_and_the_job_is_judged_as_any(
    own: tuple[DevCluster, Path],
) -> None:
    """``sbatch --export=NONE``: slurmctld saves only Slurm's variables: no VIRTUAL_ENV,
    so the job is judged by the hosts' NCCL (refused across n[1-2] and n[3-4])."""
    c, env = own
    r = c.run(["sbatch", "--parsable", "--export=NONE", "-N2", "-w", "n[2-3]", "--wrap",
               "true"], env={"VIRTUAL_ENV": str(env)})
    job = int(r.stdout.strip().split(";")[0])
    wait_until(lambda: any(x["decision"] == "refuse" for x in _records(c, job)), 60,
               "the gate's refusal", detail=lambda: str(_records(c, job)))
    rec = next(x for x in _records(c, job) if x["decision"] == "refuse")
    assert "job_env" not in rec and "job_nccl" not in rec
    refusing = [f["rule"] for f in rec["findings"] if f["severity"] == "refuse"]
    assert "nccl-version" in refusing and "job-stack" not in refusing, rec["findings"]
    c.run(["scancel", str(job)], check=False)


def test_a_venv_job_with_nccl_net_ib_is_judged_by_ib_on_every_node_and_runs(
    own: tuple[DevCluster, Path],
) -> None:
    """n4's plugin offers v10 only, which NCCL 2.23.4 cannot use (the test above refuses
    the job). The same job submitted with NCCL_NET=IB takes NCCL's own IB on every node,
    whatever plugin a node has: slurmctld saves the variable, the gate applies it to each
    node and accepts the job on n[1-4], and it completes."""
    c, env = own
    _inventory(c, {"n4": 10})
    job = _sbatch(c, env, "-N4", "--wrap", "hostname", NCCL_NET="IB")
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 60) == "COMPLETED"
    (rec,) = _records(c, job)
    assert (rec["decision"], rec["nodes"]) == ("accept", "n[1-4]"), rec
    assert rec["job_nccl_vars"] == {"NCCL_NET": "IB"}
    assert rec["job_env"]["vars"] == {"VIRTUAL_ENV": str(env)}  # what the collector gets
    assert rec["job_nccl"]["nccl_version"] == "2.23.4"
    assert any("NCCL_NET applied on each node" in n for n in rec["notes"]), rec["notes"]
    assert c.job_field(job, "Restarts") == "0"
