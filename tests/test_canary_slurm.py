"""The canary on a real cluster (issue 43, docs/canary.md): a node whose NCCL changed
leaves its class until a canary job, placed by Slurm on it and a known-good peer and let
in by the gate (PrologSlurmctld) as the recorded canary, passes.

Nodes: real node trees (devtools/nodetree.py) with the real ``libnccl.so.2`` of the
nvidia-nccl wheels, 2.21.5 on n[1-2] (class A) and 2.18.3 on n[3-4] (class B), each
fingerprinted by the node probes and published signed by the node's own munged; one
collector scan writes the inventory. n4 is then upgraded to 2.21.5: it moves from class B
to class A, and is held from the collector's write on.

- held, it has no class feature after a features sync, and an ordinary job pinned to it
  is refused by the gate; an admin's drain keeps its canary waiting, drain and reason
  untouched; resumed, its canary runs, passes, and a sync puts it in class A;
- a failing canary keeps it out, its job id and the last lines of its output in its
  reason (``ncclguard canary status --json``), and no second canary is started.

The canary's command is the tests' own program (:data:`CANARY`): it prints a few lines and
then does what its control file says (``pass``, ``fail``, or wait). The service runs in
the test's process (:class:`~inventoryd.controller.canary.CanaryService`, one
``apply()`` a pass, with the config the gate reads) and once as the controller runs it
(``ncclguard-inventoryd canary --once``); each wait is a :func:`~helpers.wait.wait_until`
that makes one pass per try. The features syncs are :func:`ncclguard.sched.sync.sync`
in the test's process (what ``ncclguard features sync`` and the daemon run).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.slurm import class_features
from helpers.wait import wait_until

from devtools.devcluster import DevCluster
from devtools.nodetree import build_node
from inventoryd.controller.canary import JOB_NAME, CanaryService
from inventoryd.node.fingerprint import collect
from ncclguard import audit
from ncclguard.policy import load_config
from ncclguard.policy.schedule import class_values
from ncclguard.sched.sync import sync
from ncclguard.store import Inventory

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

OLD, NEW = "2.18.3", "2.21.5"
VERSIONS = {"n1": NEW, "n2": NEW, "n3": OLD, "n4": OLD}
DRAIN_REASON = "replacing the HCA (jane)"

#: the canary: a few lines out, then what the control file ($1) says; waits while it
#: says neither (the test's hold on a running canary), within the job's time limit
CANARY = """#!/bin/sh
echo "ncclguard test canary: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST"
echo "# all_reduce_perf -b 8 -e 128M -g 1"
while :; do
  case "$(cat "$1")" in
    pass) echo "# Avg bus bandwidth    : 42.17 ok"; exit 0 ;;
    fail) echo "n4: NCCL WARN NET/IB : No device found."
          echo "# Avg bus bandwidth    : 0.00 FAILED"; exit 1 ;;
  esac
  sleep 0.1
done
"""


def _tree(base: Path, host: str, version: str, lib: Callable[[str], Path]) -> dict[str, Any]:
    """The fingerprint of ``host``'s node tree with the real libnccl ``version``."""
    root = build_node(base / f"{host}-{version}", hostname=host, libnccl=lib(version))
    fp = dict(collect(str(root), host))
    assert {x.get("version") for x in fp["libnccl"]} == {version} and fp["errors"] == []
    return fp


class World:
    """The cluster with the canary on: its config (the gate's), the service, the
    control file of the canary's program, and the output directory."""

    def __init__(self, c: DevCluster, tmp: Path, lib: Callable[[str], Path]) -> None:
        self.c, self.tmp, self.lib = c, tmp, lib
        self.ctl = tmp / "canary.ctl"
        self.ctl.write_text("wait\n")
        program = tmp / "canary.sh"
        program.write_text(CANARY)
        program.chmod(0o755)
        self.out = tmp / "canary-out"
        self.out.mkdir(mode=0o700)
        c.write_gate_config(
            f'[gate]\naudit_log = "{c.audit_path}"\nsteer_wait_s = 30\n'
            f'[inventory]\ndb = "{c.db}"\n'  # the test's process has no NCCLGUARD_DB
            "[canary]\nenabled = true\n"
            f'command = ["/bin/sh", "{program}", "{self.ctl}"]\n'
            "settle_s = 0\ninterval_s = 1\npending_timeout_s = 60\ntime_limit_s = 60\n"
            f'output_dir = "{self.out}"\n')
        c.remove_inventory()
        c.remove_records()
        for host, version in VERSIONS.items():
            c.publish_fingerprint(host, _tree(tmp, host, version, lib))
        r = c.collect()
        assert "4 accepted, 0 rejected" in r.stderr, r.stderr
        self.cfg = load_config(str(c.config_path))
        self.svc = CanaryService(self.cfg, slurm=c.slurm())
        self.notes: list[str] = []
        self.earlier = set(self._listed())  # an earlier test's, still listed (MinJobAge)

    def upgrade(self, host: str, version: str) -> None:
        """``host``'s NCCL replaced by ``version``: its record as published, collected."""
        self.c.publish_fingerprint(host, _tree(self.tmp, host, version, self.lib))
        r = self.c.collect()
        assert "1 accepted, 0 rejected" in r.stderr, r.stderr

    def apply(self) -> str:
        self.notes.append(self.svc.apply())
        return self.notes[-1]

    def row(self, host: str) -> dict[str, Any]:
        with Inventory(self.c.db, readonly=True, values=class_values(self.cfg.policy)) as inv:
            return inv.canary_nodes()[host]

    def until(self, host: str, state: str, timeout: float = 30) -> dict[str, Any]:
        """Passes until ``host``'s row is in ``state``; the row."""
        def reached() -> dict[str, Any] | None:
            self.apply()
            row = self.row(host)
            return row if row["state"] == state else None

        return wait_until(reached, timeout, f"{host}'s canary row to be {state}", interval=0.3,
                          detail=lambda: f"row {self.row(host)}\npasses {self.notes[-5:]}\n"
                          f"{self.c.run(['squeue', '-a', '-t', 'all'], check=False).stdout}")

    def history(self, host: str) -> list[str]:
        with Inventory(self.c.db, readonly=True, values=class_values(self.cfg.policy)) as inv:
            return [e["event"] for e in inv.canary_history(host)]

    def _listed(self) -> list[int]:
        r = self.c.run(["squeue", "-h", "-a", "-t", "all", "-n", JOB_NAME, "-o", "%A"])
        return sorted(int(j) for j in r.stdout.split())

    def canary_jobs(self) -> list[int]:
        """This test's canary jobs, as Slurm lists them (finished ones too)."""
        return [j for j in self._listed() if j not in self.earlier]

    def synced(self) -> dict[str, str]:
        """One features sync (:func:`ncclguard.sched.sync.sync`, what ``ncclguard features
        sync`` and the daemon run, in this process); each node's class feature in Slurm."""
        got = sync(self.cfg, self.c.slurm())
        assert not got.failed and not got.errors, (got.failed, got.errors)
        return class_features(self.c)


def _node(c: DevCluster, host: str) -> dict[str, str]:
    """``scontrol show node``: its State and Reason (Reason runs to the line's end)."""
    r = c.run(["scontrol", "show", "node", host])
    out = {}
    for line in r.stdout.splitlines():
        line = line.strip()
        if line.startswith("Reason="):
            out["Reason"] = line[len("Reason="):].rsplit(" [", 1)[0]
        for tok in line.split():
            if tok.startswith("State="):
                out["State"] = tok[len("State="):]
    return out


def _canary_record(c: DevCluster, job: int) -> dict[str, Any]:
    """The gate's one record of the canary job: accepted as n4's canary."""
    (rec,) = wait_until(lambda: audit.read(c.audit_path, job=job), 30,
                        f"the gate's record of canary job {job}")
    assert (rec["decision"], rec.get("canary"), rec["canary_held"]) == ("accept", True, ["n4"])
    assert rec["nodes"] == "n[1,4]", rec
    return rec


@pytest.fixture
def world(cluster: DevCluster, tmp_path: Path, nccl_lib: Callable[[str], Path]
          ) -> Iterator[World]:
    """The World on the session's cluster, the service's first pass made; after, the
    cluster as the next test expects it: n4 not drained, each node's features as before
    (the syncs gave them classes)."""
    c = cluster
    features = c.node_features()
    w = World(c, tmp_path, nccl_lib)
    try:
        assert w.apply() == "first pass: 4 nodes taken as vetted in their classes"
        yield w
    finally:
        c.run(["scontrol", "update", "nodename=n4", "state=resume"], check=False)
        s = c.slurm()
        for host, own in features.items():
            s.set_features(host, own)


def test_a_changed_node_is_refused_waits_out_a_drain_and_rejoins_after_its_canary(
        world: World) -> None:
    w, c = world, world.c
    before = w.synced()
    assert before["n1"] == before["n2"] != before["n3"] == before["n4"] != "", before
    w.upgrade("n4", NEW)  # 2.18.3 -> 2.21.5: class B's n4 now has class A's stack
    # held from the collector's write on, before the service's next pass: out of its
    # class, the others as they were
    assert w.synced() == {**before, "n4": ""}

    # held: an ordinary job pinned to it and a node of its new class is refused
    job = c.sbatch(["-N2", "-w", "n[1,4]", "--wrap", "true"])
    wait_until(lambda: c.job_field(job, "Reason").startswith("JobHeld"), 40, "the hold",
               detail=lambda: c.show_job(job))
    rec = next(r for r in audit.read(c.audit_path, job=job) if r["decision"] == "refuse")
    assert rec["findings"][0]["rule"] == "canary-hold" and rec["odd_nodes"] == ["n4"], rec
    assert rec["canary_held"] == ["n4"] and "canary" not in rec
    info = c.slurm().job(job)
    assert info is not None
    comment = info.admin_comment
    assert comment.startswith("ncclguard: refuse, odd n4: canary-hold"), comment
    assert "held: pinned with -w to n4" in comment
    c.run(["scancel", str(job)])
    assert "held n4" in w.apply()
    assert "its stack changed" in w.row("n4")["reason"]
    assert w.synced() == {**before, "n4": ""}

    # the admin drains it: its canary waits, says why, and the drain stays as set
    c.run(["scontrol", "update", "nodename=n4", "state=drain", f"reason={DRAIN_REASON}"])
    row = w.until("n4", "waiting")
    for _ in range(3):
        w.apply()
    row = w.row("n4")
    assert row["state"] == "waiting", row
    assert f"drained ({DRAIN_REASON}), left as the admin set it" in row["reason"], row
    assert w.canary_jobs() == []
    assert w.synced()["n4"] == ""
    node = _node(c, "n4")
    assert "DRAIN" in node["State"] and node["Reason"] == DRAIN_REASON, node

    # resumed by the admin: the canary runs on n4 and a known-good peer of class A
    c.run(["scontrol", "update", "nodename=n4", "state=resume"])
    row = w.until("n4", "running")
    (canary,) = w.canary_jobs()
    assert row["job_id"] == canary and row["job_nodes"] == "n[1,4]", row
    assert c.wait_job(canary, {"RUNNING"}, 30) == "RUNNING"
    assert c.job_field(canary, "NodeList") == "n[1,4]"
    _canary_record(c, canary)  # the gate let it in: the inventory names it n4's canary
    assert w.synced()["n4"] == ""  # still out while it runs
    w.ctl.write_text("pass\n")
    assert c.wait_job(canary, {"COMPLETED", "FAILED"}, 30) == "COMPLETED"
    row = w.until("n4", "ok")
    assert (row["accepted"], row["class_key"], row["reason"]) == (
        row["class_key"], row["class_key"], "")
    after = w.synced()
    assert after == {**before, "n4": before["n1"]}, after  # back, in class A now
    assert w.history("n4") == ["passed", "submitted", "held"]
    assert "42.17 ok" in (w.out / f"{JOB_NAME}-{canary}.out").read_text()
    assert "DRAIN" not in _node(c, "n4")["State"]


def test_a_failing_canary_keeps_the_node_out_with_its_job_and_last_lines(
        world: World) -> None:
    w, c = world, world.c
    before = w.synced()
    w.ctl.write_text("fail\n")
    w.upgrade("n4", NEW)
    # a pass as the controller runs it: ncclguard-inventoryd canary --once, same config
    r = c.canary_once()
    assert "held n4" in r.stderr, r.stderr
    row = w.until("n4", "failed")
    (canary,) = w.canary_jobs()
    assert c.job_field(canary, "JobState") == "FAILED"
    _canary_record(c, canary)
    doc = json.loads(c.ncclguard("canary", "status", "--json").stdout)
    (shown,) = doc["nodes"]
    assert (shown["host"], shown["state"], shown["job"]) == ("n4", "failed", canary), shown
    reason = shown["reason"]
    assert reason == row["reason"]
    assert reason.startswith(f"its canary job {canary} ended FAILED"), reason
    assert "on n[1,4]" in reason
    assert "n4: NCCL WARN NET/IB : No device found. | # Avg bus bandwidth    : 0.00 FAILED" \
        in reason, reason
    # it stays out: no class after a sync, and no second canary at the next passes
    for _ in range(3):
        w.apply()
    assert w.row("n4")["state"] == "failed" and w.canary_jobs() == [canary]
    assert w.synced() == {**before, "n4": ""}
    assert w.history("n4") == ["failed", "submitted", "held"]
