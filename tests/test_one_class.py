"""One class everywhere (issue 27): with a severity other than the default, ``ncclguard
classes``, ``drain-recommend``, the collector's metrics, Slurm's features, the lua's file of
classes and the gate name the same classes, and a severity change derives every node's
class again, once.

A real slurmctld with n1..n4 (the session cluster): n1..n3 on one driver, n4 on another,
the same NCCL stack otherwise. ``gpu-driver`` warns by default, so all four are one class;
set to ``refuse``, n4 is a class of its own, and everything says so.
"""

from __future__ import annotations

import json
import sqlite3

import pytest
from helpers.fingerprints import fingerprint
from helpers.wait import wait_until
from prometheus_client.parser import text_string_to_metric_families

from devtools.devcluster import DevCluster
from ncclguard import audit
from ncclguard.hostlist import expand
from ncclguard.sched import classfile

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

DRIVERS = {"n1": "550.54.15", "n2": "550.54.15", "n3": "550.54.15", "n4": "535.104.05"}


def _config(c: DevCluster, severity: str) -> None:
    c.write_gate_config(f'[gate]\naudit_log = "{c.audit_path}"\n'
                        f'[features]\nclasses_file = "{c.classes_file}"\n'
                        f"{severity}")


def _classes(c: DevCluster) -> dict[str, list[str]]:
    doc = json.loads(c.ncclguard("classes", "--json").stdout)
    return {k["class"]: expand(k["hosts"]) for k in doc["classes"]}


def _metrics(c: DevCluster) -> dict[str, float]:
    r = c._inventoryd(["metrics", "--no-slurm"], c.config_path)
    assert r.returncode == 0, r.stderr
    return {s.labels["class"]: s.value for fam in text_string_to_metric_families(r.stdout)
            if fam.name == "ncclguard_class_nodes" for s in fam.samples}


def _stored_policy(c: DevCluster) -> str:
    conn = sqlite3.connect(f"file:{c.db}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT value FROM collector_state "
                           "WHERE name = 'class_policy'").fetchone()
    finally:
        conn.close()
    return str(row[0])


def test_a_severity_change_moves_every_view_of_the_classes_together(
        cluster: DevCluster) -> None:
    c = cluster
    before = {n.name: (n.features, n.active_features) for n in c.slurm().nodes()}
    _config(c, "")
    for host, driver in DRIVERS.items():
        c.publish_fingerprint(host, fingerprint(host, driver=driver))
    c.collect()
    default_policy = _stored_policy(c)
    (one,) = _classes(c).values()
    assert one == ["n1", "n2", "n3", "n4"]  # a driver difference only warns

    _config(c, '[policy.severity]\n"gpu-driver" = "refuse"\n')
    # the collector reloads the config (here: its next run), and derives every class again
    r = c.collect()
    assert _stored_policy(c) != default_policy, r.stderr
    try:
        classes = _classes(c)
        assert sorted(classes.values()) == [["n1", "n2", "n3"], ["n4"]]
        big = next(name for name, hosts in classes.items() if len(hosts) == 3)
        odd = next(name for name, hosts in classes.items() if hosts == ["n4"])
        text = c.ncclguard("classes").stdout
        assert "ALSO DIFFERS" in text and "gpu-driver=535.104.05" in text, text
        # the drain advice judges against the same baseline class, and names n4 for its driver
        plan = json.loads(c.ncclguard("drain-recommend", "--nodes", "n[1-4]", "--force",
                                       "--json").stdout)
        (node_set,) = plan["node_sets"]
        assert node_set["baseline"]["class"] == big
        assert plan["drain"] == {"n4": plan["drain"]["n4"]} and "gpu-driver" in str(
            node_set["groups"]), node_set
        # the collector's metrics count the same classes by the same names
        assert _metrics(c) == {big: 3.0, odd: 1.0}
        # and Slurm's features are those names
        c.features("sync")
        feats = {h: [f for f in fs if f.startswith("nc_")] for h, fs in c.node_features().items()}
        assert feats == {"n1": [big], "n2": [big], "n3": [big], "n4": [odd]}
        # the lua's file of classes names them too
        cf = classfile.read(c.classes_file)
        assert cf.members == {big: "n[1-3]", odd: "n4"}, cf.members
        # and the gate (PrologSlurmctld) judges by them: four nodes span two classes
        r = c.run(["sbatch", "-N4", "--wrap", "true"], check=False)
        assert r.returncode == 0, r.stderr
        job = int(r.stdout.split()[-1])
        wait_until(lambda: audit.read(c.audit_path, job=job), 60, "the gate's record")
        rec = audit.read(c.audit_path, job=job)[0]
        assert rec["decision"] == "refuse" and "gpu-driver" in json.dumps(rec), rec
        assert "n4" in json.dumps(rec.get("odd_nodes") or rec), rec
        c.run(["scancel", str(job)], check=False)
        # nodes --where class=NAME finds them, and show names the class
        doc = json.loads(c.ncclguard("nodes", "--where", f"class={odd}", "--json").stdout)
        assert [n["host"] for n in doc["nodes"]] == ["n4"]
        assert json.loads(c.ncclguard("show", "n4", "--json").stdout)["class"] == odd
        _config(c, "")  # back: the collector derives the classes of the default again
        c.collect()
        assert _stored_policy(c) == default_policy
        assert list(_classes(c).values()) == [["n1", "n2", "n3", "n4"]]
        # at the default a driver difference only warns: the same job runs
        job = int(c.run(["sbatch", "-N4", "--wrap", "true"]).stdout.split()[-1])
        assert c.wait_job(job, {"COMPLETED", "FAILED"}, 90) == "COMPLETED"
        assert audit.read(c.audit_path, job=job)[-1]["decision"] in ("accept", "warn")
    finally:  # the next test of this cluster starts with the nodes' features as they were
        for host, (available, active) in before.items():
            c.slurm().set_features(host, available, active)
