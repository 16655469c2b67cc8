"""The gate end to end: a real slurmctld + 4 slurmd + munged, the gate as PrologSlurmctld,
and the collector in the loop: each node's record is signed by the node's own munged
(from its NodeAddr), published to the spool and collected into the gate's inventory.

Inventory for most tests: n1, n2, n4 on NCCL 2.21.5, n3 on 2.18.3 (refuse-level).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.cli import run_cli
from helpers.fingerprints import fingerprint
from helpers.wait import wait_until

from devtools.devcluster import DevCluster
from ncclguard import audit
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory
from prolog import steer

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ODD = {"n3": "2.18.3"}


def make_inventory(
    cluster: DevCluster, versions: dict[str, str] | None = None, stale: tuple[str, ...] = ()
) -> None:
    """Each node publishes its signed record; one collector scan writes the inventory.
    ``stale``: nodes whose heartbeat is then aged by a day (a credential cannot be
    signed in the past)."""
    versions = versions or {}
    cluster.remove_inventory()
    cluster.remove_records()
    for host in cluster.node_names:
        cluster.publish_fingerprint(host, fingerprint(host, nccl=versions.get(host, "2.21.5")))
    r = cluster.collect()
    assert f"{len(cluster.node_names)} accepted, 0 rejected" in r.stderr, r.stderr
    if stale:
        with Inventory(cluster.db, values=GATE_VALUES) as inv:
            for host in stale:
                inv.heartbeat(host, now=time.time() - 100_000)


def gate_config(cluster: DevCluster, extra: str = "", policy: str = "") -> None:
    text = f'[gate]\naudit_log = "{cluster.audit_path}"\nsteer_wait_s = 30\n{extra}\n'
    if policy:
        text += f"[policy]\n{policy}\n"
    cluster.write_gate_config(text)


def records(cluster: DevCluster, job: int) -> list[dict]:
    return audit.read(cluster.audit_path, job=job)


def admin_comment(cluster: DevCluster, job: int) -> str:
    info = cluster.slurm().job(job)
    assert info is not None, f"job {job} unknown to squeue"
    return info.admin_comment


@pytest.fixture
def odd_cluster(cluster: DevCluster) -> DevCluster:
    make_inventory(cluster, ODD)
    gate_config(cluster)
    return cluster


def test_compatible_batch_job_runs(odd_cluster: DevCluster) -> None:
    c = odd_cluster
    job = c.sbatch(["-N2", "-w", "n[1-2]", "--wrap", "true"])
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 60) == "COMPLETED"
    (rec,) = records(c, job)
    assert rec["decision"] == "accept" and rec["nodes"] == "n[1-2]" and rec["user"] == "root"
    assert admin_comment(c, job) == ""


def test_incompatible_batch_job_is_steered_and_completes(odd_cluster: DevCluster) -> None:
    c = odd_cluster
    # three nodes: the scheduler's first pick is n[1-3], which holds the odd n3
    job = c.sbatch(["-N3", "--wrap", "hostname"])
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 90) == "COMPLETED"
    recs = records(c, job)
    refusal = next(r for r in recs if r.get("decision") == "refuse")
    assert refusal["nodes"] == "n[1-3]" and refusal["odd_nodes"] == ["n3"]
    assert refusal["action"] == "steer"
    assert refusal["findings"][0]["rule"] == "nccl-version"
    followup = next(r for r in recs if r.get("decision") == "followup")
    assert followup["result"] == "done" and followup["excluded"] == "n3"
    assert recs[-1]["decision"] == "accept" and recs[-1]["nodes"] == "n[1-2,4]"
    comment = admin_comment(c, job)
    assert comment.startswith("ncclguard: refuse, odd n3: nccl-version")
    assert "requeued without n3" in comment
    assert c.job_field(job, "ExcNodeList") == "n3"
    assert c.job_field(job, "NodeList") == "n[1-2,4]"


def test_tie_steers_away_from_the_odd_node_not_the_good_one(odd_cluster: DevCluster) -> None:
    """A 2-node job on n3 (2.18.3) + n4 (2.21.5): removing either leaves one node, so both
    are minimum odd sets. The partition's majority (2.21.5) keeps n4, and n3 goes."""
    c = odd_cluster
    blocker = c.sbatch(["-N2", "-w", "n[1-2]", "--exclusive", "--wrap", "sleep 120"])
    assert c.wait_job(blocker, {"RUNNING"}, 60) == "RUNNING"
    job = c.sbatch(["-N2", "--wrap", "hostname"])  # only n3 and n4 are free
    wait_until(
        lambda: any(r.get("decision") == "followup" for r in records(c, job)), 60, "the follow-up"
    )
    recs = records(c, job)
    refusal = next(r for r in recs if r.get("decision") == "refuse")
    assert refusal["nodes"] == "n[3-4]" and refusal["odd_nodes"] == ["n3"]
    assert refusal["tie_break"] == "majority class of partition debug (3 nodes)"
    assert refusal["action"] == "steer"
    followup = next(r for r in recs if r.get("decision") == "followup")
    assert followup["result"] == "done" and followup["excluded"] == "n3"
    assert c.job_field(job, "ExcNodeList") == "n3"
    assert "requeued without n3" in admin_comment(c, job)
    c.run(["scancel", str(blocker)])
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 90) == "COMPLETED"
    assert "n3" not in c.slurm().hostnames(c.job_field(job, "NodeList"))
    assert records(c, job)[-1]["decision"] == "accept"


def test_steer_merges_the_users_exclusions(odd_cluster: DevCluster) -> None:
    c = odd_cluster
    job = c.sbatch(["-N2", "-x", "n4", "--hold", "--wrap", "true"])
    assert steer.steer(c.slurm(), job, ["n3"]) == "n[3-4]"
    assert c.job_field(job, "ExcNodeList") == "n[3-4]"


def test_users_exclusions_count_against_the_compatible_class(odd_cluster: DevCluster) -> None:
    c = odd_cluster
    job = c.sbatch(["-N3", "-x", "n1", "--wrap", "true"])  # lands on n[2-4], odd n3
    wait_until(lambda: c.job_field(job, "Reason").startswith("JobHeld"), 40, "the hold")
    comment = admin_comment(c, job)
    assert "without n3 has 2 nodes, the job needs 3" in comment


def test_pinned_job_on_incompatible_set_is_held(odd_cluster: DevCluster) -> None:
    c = odd_cluster
    job = c.sbatch(["-N2", "-w", "n[2-3]", "--wrap", "true"])
    wait_until(lambda: c.job_field(job, "Reason").startswith("JobHeld"), 40, "the hold")
    comment = admin_comment(c, job)
    assert comment.startswith("ncclguard: refuse")
    assert "held: pinned with -w to n3" in comment
    assert c.job_field(job, "JobState") == "PENDING"
    recs = records(c, job)
    assert recs[0]["action"] == "hold"
    assert any(r.get("decision") == "followup" and r["result"] == "done" for r in recs)


def test_job_larger_than_the_compatible_class_is_held(odd_cluster: DevCluster) -> None:
    c = odd_cluster
    job = c.sbatch(["-N4", "--wrap", "true"])
    wait_until(lambda: c.job_field(job, "Reason").startswith("JobHeld"), 40, "the hold")
    comment = admin_comment(c, job)
    assert "largest compatible class in partition debug without n3 has 3 nodes" in comment
    assert "needs 4" in comment


def test_hold_after_max_refusals_on_the_real_cluster(odd_cluster: DevCluster) -> None:
    """gate.max_refusals = 1: the first refusal of a job that could be steered (n[1-3]
    holds n3; n1, n2, n4 would do) holds it instead, through slurmctld itself."""
    c = odd_cluster
    gate_config(c, "max_refusals = 1")
    job = c.sbatch(["-N3", "--wrap", "true"])
    wait_until(lambda: c.job_field(job, "Reason").startswith("JobHeld"), 40, "the hold")
    assert "held: refused 1 times (gate.max_refusals = 1)" in admin_comment(c, job)
    assert c.job_field(job, "JobState") == "PENDING"
    rec = records(c, job)[0]
    assert (rec["decision"], rec["action"], rec["refusal"]) == ("refuse", "hold", 1)
    wait_until(lambda: any(r["decision"] == "followup" for r in records(c, job)), 30,
               "the follow-up's record")  # fmt: skip
    assert [r["action"] for r in records(c, job) if r["decision"] == "followup"] == ["hold"]


def test_srun_on_incompatible_set_is_killed_with_the_reason(odd_cluster: DevCluster) -> None:
    c = odd_cluster
    r = c.run(["srun", "-N3", "-w", "n[2-4]", "true"], check=False, timeout=60)
    assert r.returncode != 0
    assert "srun: ncclguard: refuse, odd n3: nccl-version" in r.stderr  # the user's terminal
    assert "PrologSlurmctld failed" in r.stderr
    rec = audit.read(c.audit_path, refused=True)[-1]
    assert rec["action"] == "kill" and rec["batch"] is False


def test_srun_on_compatible_set_runs(odd_cluster: DevCluster) -> None:
    r = odd_cluster.run(["srun", "-N2", "-w", "n[1-2]", "hostname"], check=False, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "ncclguard" not in r.stderr


def test_missing_inventory_fails_open_and_logs(odd_cluster: DevCluster) -> None:
    c = odd_cluster
    c.db.unlink()
    job = c.sbatch(["-N2", "-w", "n[3-4]", "--wrap", "true"])
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 60) == "COMPLETED"
    log = c.gate_log.read_text()
    assert f"[job {job}]: ERROR: inventory:" in log and "-> accept" in log
    (rec,) = records(c, job)
    assert rec["decision"] == "error" and rec["action"] == "accept"
    assert "inventory" in rec["error"]


def test_missing_inventory_fails_closed_when_configured(odd_cluster: DevCluster) -> None:
    c = odd_cluster
    c.db.unlink()
    gate_config(c, 'on_error = "refuse"')
    r = c.run(["srun", "-N2", "-w", "n[1-2]", "true"], check=False, timeout=60)
    assert r.returncode != 0
    assert "ncclguard: refused, gate error (inventory" in r.stderr


def test_corrupt_inventory_fails_open(odd_cluster: DevCluster) -> None:
    c = odd_cluster
    c.db.write_bytes(b"this is not a database" * 100)
    r = c.run(["srun", "-N2", "-w", "n[3-4]", "true"], check=False, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "ERROR: inventory:" in c.gate_log.read_text()


def test_broken_config_fails_open(odd_cluster: DevCluster) -> None:
    c = odd_cluster
    c.write_gate_config('[gate]\nsteering = "sideways"\n')
    r = c.run(["srun", "-N2", "-w", "n[3-4]", "true"], check=False, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "gate.steering = 'sideways'" in c.gate_log.read_text()


def test_stale_record_warns(odd_cluster: DevCluster) -> None:
    c = odd_cluster
    make_inventory(c, stale=("n2",))
    job = c.sbatch(["-N2", "-w", "n[1-2]", "--wrap", "true"])
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 60) == "COMPLETED"
    (rec,) = records(c, job)
    assert rec["decision"] == "warn" and rec["stale"] == ["n2"]
    assert admin_comment(c, job).startswith("ncclguard: warn")


def test_stale_record_refuses_when_configured(odd_cluster: DevCluster) -> None:
    c = odd_cluster
    make_inventory(c, stale=("n2",))
    gate_config(c, policy='severity = { "unknown-node" = "refuse" }')
    r = c.run(["srun", "-N2", "-w", "n[1-2]", "true"], check=False, timeout=60)
    assert r.returncode != 0
    assert "ncclguard: refuse" in r.stderr


def test_opt_out_by_comment(odd_cluster: DevCluster) -> None:
    c = odd_cluster
    job = c.sbatch(["-N2", "-w", "n[3-4]", "--comment", "ncclguard=off", "--wrap", "true"])
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 60) == "COMPLETED"
    (rec,) = records(c, job)
    assert rec["action"] == "opt-out" and rec["decision"] == "accept"


def test_opt_out_ignored_when_not_allowed(odd_cluster: DevCluster) -> None:
    c = odd_cluster
    gate_config(c, "allow_opt_out = false")
    r = c.run(
        ["srun", "-N2", "-w", "n[3-4]", "--comment", "ncclguard=off", "true"],
        check=False,
        timeout=60,
    )
    assert r.returncode != 0 and "ncclguard: refuse" in r.stderr


def test_steering_hold_mode(odd_cluster: DevCluster) -> None:
    c = odd_cluster
    gate_config(c, 'steering = "hold"')
    job = c.sbatch(["-N3", "--wrap", "true"])
    wait_until(lambda: c.job_field(job, "Reason").startswith("JobHeld"), 40, "the hold")
    assert "held: incompatible nodes (gate.steering = hold)" in admin_comment(c, job)


def test_audit_is_private_and_listable(odd_cluster: DevCluster, tmp_path: Path) -> None:
    c = odd_cluster
    before = {r["job"] for r in audit.read(c.audit_path)}
    start = time.time()
    r = c.run(["srun", "-N2", "-w", "n[1-2]", "true"], check=False, timeout=60)
    assert r.returncode == 0
    assert (c.audit_path.stat().st_mode & 0o777) == 0o640
    # this srun's record, read back by time: exactly one new job, accepted on n[1-2]
    recent = [x for x in audit.read(c.audit_path, since=start - 1) if x["job"] not in before]
    assert [(x["decision"], x["nodes"]) for x in recent] == [("accept", "n[1-2]")]


def test_a_forged_record_changes_nothing_and_is_listed(odd_cluster: DevCluster) -> None:
    """n1's publisher writes n2's file, claiming n2 runs 2.18.3 (to keep jobs off n2):
    signed from n1's NodeAddr, which Slurm says is not n2's. Rejected; jobs on n[1-2]
    still run; ``ncclguard rejections`` names it."""
    c = odd_cluster
    forged = fingerprint("n2", nccl="2.18.3")
    assert c.publish_fingerprint("n1", forged) == c.records / "n2.rec"  # by n1's munged
    r = c.collect()
    assert "1 rejected" in r.stderr and "rejected (wrong-address)" in r.stderr
    assert f"signed from {c.node_addrs['n1']}, which is not n2's ({c.node_addrs['n2']}" in r.stderr
    job = c.sbatch(["-N2", "-w", "n[1-2]", "--wrap", "true"])
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 60) == "COMPLETED"
    (rec,) = records(c, job)
    assert rec["decision"] == "accept"
    cli = run_cli("rejections", "--json", db=c.db, config=c.config_path)
    assert cli.exit_code == 0, cli.output
    (row,) = json.loads(cli.stdout)["rejections"]
    assert (row["file"], row["host"], row["cause"]) == ("n2.rec", "n2", "wrong-address")


def test_the_running_collector_brings_a_change_to_the_gate(odd_cluster: DevCluster) -> None:
    """The collector service keeps scanning; n4 moves to 2.18.3, like n3: a job on
    n[3-4], refused before, runs once the collector has seen the change."""
    c = odd_cluster
    r = c.run(["srun", "-N2", "-w", "n[3-4]", "true"], check=False, timeout=60)
    assert r.returncode != 0 and "ncclguard: refuse" in r.stderr
    conf = c.root / "collector.toml"
    conf.write_text(c.config_path.read_text().replace(
        "[collector]\n", "[collector]\nscan_interval_s = 0.2\n"))
    log = c.root / "log" / "collector.out"
    with open(log, "ab") as out:
        collector = subprocess.Popen(
            [c.python, "-m", "inventoryd.main", "collect", "--config", str(conf),
             "--db", str(c.db)], env={**c.env, "NCCLGUARD_CONFIG": str(conf)},
            stderr=out, cwd=c.root / "tmp")
    try:
        c.publish_fingerprint("n4", fingerprint("n4", nccl="2.18.3"))
        wait_until(lambda: "n4: fingerprint changed" in log.read_text(), 30, "the collector")
        r = c.run(["srun", "-N2", "-w", "n[3-4]", "true"], check=False, timeout=60)
        assert r.returncode == 0, r.stderr
        assert Path(f"{c.db}-wal").exists()  # WAL while it runs
        collector.send_signal(signal.SIGHUP)
        wait_until(lambda: "config reloaded from" in log.read_text(), 30, "the reload")
    finally:
        collector.terminate()
        rc = collector.wait(timeout=30)
    assert rc == 0 and "collector stopped" in log.read_text()
    assert not Path(f"{c.db}-wal").exists()  # a rollback journal again: readers need no -shm


def test_a_warning_keeps_an_admin_comment_someone_else_set(odd_cluster: DevCluster) -> None:
    """Issue 12: the warn path overwrote the AdminComment; what is not ours stays."""
    c = odd_cluster
    make_inventory(c, stale=("n2",))  # a stale node: warn
    job = c.sbatch(["-N2", "-w", "n[1-2]", "--hold", "--wrap", "true"])
    c.run(["scontrol", "update", f"jobid={job}", "AdminComment=site: chargeback 42"])
    c.run(["scontrol", "release", str(job)])
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 60) == "COMPLETED"
    comment = admin_comment(c, job)
    assert comment.startswith("site: chargeback 42 || ncclguard: warn"), comment


def test_merge_admin_comment() -> None:
    from prolog.gate import merge_admin_comment

    old = "ncclguard: refuse, odd n3: nccl-version [a: n3 | b: n[1-2]] | requeued (1/3)"
    assert merge_admin_comment("", "ncclguard: warn") == "ncclguard: warn"
    assert merge_admin_comment("site: x", "ncclguard: warn") == "site: x || ncclguard: warn"
    # a requeued job's earlier text of ours is replaced; theirs, before or after, kept
    assert merge_admin_comment(f"site: x || {old} || site: y", "ncclguard: new"
                               ) == "site: x || site: y || ncclguard: new"
    assert merge_admin_comment(old, "ncclguard: new") == "ncclguard: new"
    assert merge_admin_comment("site: a | b", "ncclguard: n") == "site: a | b || ncclguard: n"
    long = merge_admin_comment("s" * 5000, "ncclguard: " + "w" * 900, limit=1000)
    assert len(long) <= 1000 and long.endswith("w" * 900) and long.startswith("sss")


def test_the_steering_follow_up_keeps_an_admin_comment_too(odd_cluster: DevCluster) -> None:
    """The follow-up sets the comment again when it holds the job: the merged one."""
    c = odd_cluster
    gate_config(c, 'steering = "hold"')
    job = c.sbatch(["-N3", "--hold", "--wrap", "true"])
    c.run(["scontrol", "update", f"jobid={job}", "AdminComment=site: chargeback 42"])
    c.run(["scontrol", "release", str(job)])
    wait_until(lambda: c.job_field(job, "Reason").startswith("JobHeld"), 40, "the hold")
    comment = admin_comment(c, job)
    assert comment.startswith("site: chargeback 42 || ncclguard: refuse"), comment
    assert "held: incompatible nodes (gate.steering = hold)" in comment
