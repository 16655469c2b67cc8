"""The canary's boundaries driven as an attacker would (issue 43, docs/canary.md).

Who: a user who can submit jobs (any name, any ``-w``; ids that Slurm reuses), a node
(its record says whatever it likes about its stack, as often as the collector lets it),
Slurm answering late or in garbage, the canary's output directory, and an admin's
``ncclguard canary`` racing the service. Each test is one attack and the outcome the
project promises: the gate never accepts a held node for a job that is not its canary;
the service's work and Slurm calls stay bounded, its rows consistent, and every message
names the cause. The service runs against the model of Slurm of tests/test_canary.py.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.canary import Cluster, FakeSlurm, failing, history, two_classes
from helpers.gate import inventory as gate_inventory
from helpers.gate import last, run_gate
from helpers.inventory import NodeSpec

import inventoryd.controller.canary as service
from inventoryd.controller.canary import JOB_NAME
from ncclguard.config import CanaryConfig, PolicyConfig
from ncclguard.policy import GATE_VALUES
from ncclguard.policy.canary import held_row, plan
from ncclguard.policy.schedule import class_policy, class_values
from ncclguard.slurm import Slurm, SlurmError
from ncclguard.slurm.model import JobInfo, SlurmSchemaError, SlurmTimeout
from ncclguard.store import Inventory, InventoryError


def _until(c: Cluster, state: str, host: str = "n4", limit: float = 600) -> None:
    end = c.clock() + limit
    while c.state(host) != state:
        assert c.clock() < end, f"{host} never {state}: {c.rows()[host]}"
        c.passes(15)


# ------------------------------------------------------------------- a user's job


def _gate_with_a_held_node(tmp_path: Path, job: int) -> str:
    """n1..n4 in one class, n2 held with its row naming canary job ``job``; the gate's
    config with the canary on and no Slurm commands."""
    gate_inventory(tmp_path)
    now = time.time()
    row = held_row("n2", "a" * 64, "b" * 64, now, f"its canary job {job} runs",
                   state="running")
    row.update(job_id=job, job_nodes="n[1-2]", submitted_at=now - 30)
    with Inventory(tmp_path / "inventory.db", values=GATE_VALUES) as inv:
        inv.canary_write([row])
    empty = tmp_path / "bin"
    empty.mkdir()
    return f'slurm_bin_dir = "{empty}"\n[canary]\nenabled = true\ncommand = ["true"]\n'


def test_a_user_job_under_the_id_a_stale_canary_row_names_is_refused(
        tmp_path: Path) -> None:
    """A canary row still says running with job 77 (the service was down when that job
    ended; Slurm's ids went round, or restarted with a new state). A user's job 77 on the
    held node, even named like the canary, is refused; the service's own job 77 is not."""
    config = _gate_with_a_held_node(tmp_path, 77)
    stranger = str(os.getuid() + 1)
    r, _ = run_gate(tmp_path, config, {"SLURM_JOB_UID": stranger, "SLURM_JOB_NAME": JOB_NAME,
                                       "SLURM_JOB_NODELIST": "n[1-2]",
                                       "SLURM_JOB_NUM_NODES": "2"})
    rec = last(tmp_path)
    assert rec["decision"] == "refuse", r.stderr
    assert rec["canary_held"] == ["n2"] and "canary" not in rec
    assert any(f["rule"] == "canary-hold" for f in rec["findings"])
    # the canary itself: the inventory owner's job of that name
    r, _ = run_gate(tmp_path, config, {"SLURM_JOB_UID": str(os.getuid()),
                                       "SLURM_JOB_NAME": JOB_NAME,
                                       "SLURM_JOB_NODELIST": "n[1-2]",
                                       "SLURM_JOB_NUM_NODES": "2"})
    rec = last(tmp_path)
    assert rec["decision"] == "accept" and rec["canary"] is True, r.stderr
    # the owner's job under another name is not the canary either
    run_gate(tmp_path, config, {"SLURM_JOB_UID": str(os.getuid()), "SLURM_JOB_NAME": "x",
                                "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2"})
    assert last(tmp_path)["decision"] == "refuse"


def test_an_inventory_before_the_canary_schema_fails_open_naming_it(tmp_path: Path) -> None:
    """A gate of this release over an inventory still at schema 10 (no collector of this
    release has migrated it): the configured error outcome, with the cause."""
    config = _gate_with_a_held_node(tmp_path, 77)
    conn = sqlite3.connect(tmp_path / "inventory.db")
    conn.executescript("DROP TABLE canary_nodes; DROP TABLE canary_history; "
                       "PRAGMA user_version = 10;")
    conn.close()
    r, t = run_gate(tmp_path, config)
    assert r.returncode == 0 and t < 10
    assert "schema version 10 is older than" in r.stderr
    assert "-> accept (gate.on_error = accept)" in r.stderr


def test_a_job_that_took_a_canarys_id_does_not_pass_its_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The service asks Slurm about its canary by id; a job under that id that is not its
    (another user's, another name) is not its result: the canary is lost, tried again."""
    c = Cluster(tmp_path, two_classes())
    c.change("n4", NodeSpec(nccl="2.21.5"))
    _until(c, "running")
    job = c.rows()["n4"]["job_id"]
    real = c.slurm.job_progress

    def reused(j: int) -> JobInfo | None:
        if j == job:
            return JobInfo(job_id=j, state="COMPLETED", user_id=os.geteuid() + 1,
                           name="my-own-job")
        return real(j)

    monkeypatch.setattr(c.slurm, "job_progress", reused)
    c.slurm.jobs[job]["state"] = "CANCELLED"  # the canary itself is gone
    c.passes(15)
    r = c.rows()["n4"]
    assert r["state"] != "ok" and r["job_id"] != job  # not passed: tried again
    e = next(e for e in history(c, "n4") if e["event"] != "submitted")
    assert e["event"] == "lost" and "another job" in e["detail"] and "uid" in e["detail"]


def test_job_progress_reads_the_uid_and_a_name_holding_the_separator(
        monkeypatch: pytest.MonkeyPatch) -> None:
    s = Slurm()
    monkeypatch.setattr(s, "run", lambda name, args, **k: "12|COMPLETED|None|0|N/A|1001|a|b\n")
    info = s.job_progress(12)
    assert info is not None
    assert (info.state, info.user_id, info.name, info.start_time) == (
        "COMPLETED", 1001, "a|b", None)
    monkeypatch.setattr(s, "run", lambda name, args, **k: "12|RUNNING|None|²|N/A|1001|x\n")
    info = s.job_progress(12)
    assert info is not None and info.priority == 0
    monkeypatch.setattr(s, "run", lambda name, args, **k: "12|RUNNING|None|1|N/A|²|x\n")
    with pytest.raises(SlurmSchemaError, match="not a job id"):
        s.job_progress(12)


@pytest.mark.parametrize("answer", ["²", "Submitted batch job 12", "", "12;c;x\x1b[2J"])
def test_sbatch_printing_no_job_id_is_a_slurm_error(
        monkeypatch: pytest.MonkeyPatch, answer: str) -> None:
    """sbatch's answer is not a job id: a SlurmError (the pass fails, logged), never a
    ValueError (``"²".isdigit()`` is true, ``int("²")`` fails)."""
    s = Slurm()
    monkeypatch.setattr(s, "run", lambda name, args, **k: answer)
    if answer.startswith("12;"):
        assert s.submit(["-J", "x"], "#!/bin/sh\n") == 12
        return
    with pytest.raises(SlurmSchemaError, match="not a job id"):
        s.submit(["-J", "x"], "#!/bin/sh\n")


# ------------------------------------------------------------------- Slurm late


class LateSbatch(FakeSlurm):
    """slurmctld takes the job, but sbatch's answer never comes back (its time-out)."""

    def submit(self, args: list[str], script: str) -> int:
        super().submit(args, script)
        raise SlurmTimeout("sbatch: timed out after 10s", ["sbatch"])


def test_sbatch_that_times_out_after_queueing_leaves_no_pile_of_held_jobs(
        tmp_path: Path) -> None:
    c = Cluster(tmp_path, two_classes())
    c.slurm.__class__ = LateSbatch
    c.change("n4", NodeSpec(nccl="2.21.5"))
    failed = 0
    for _ in range(40):  # ten minutes of passes
        c.clock.t += 15
        c.slurm.tick()
        try:
            c.svc.apply()
        except SlurmError:
            failed += 1
    live = [j for j, v in c.slurm.jobs.items() if v["state"] == "PENDING"]
    assert failed >= 1
    assert len(live) <= 1, f"{len(live)} held canary jobs left queued"
    submits = sum(1 for k, _ in c.slurm.calls if k == "submit")
    assert submits <= 21  # at most one every other pass
    cancels = {j for k, j in c.slurm.calls if k == "cancel"}
    assert set(c.slurm.jobs) - set(live) <= cancels
    assert c.state("n4") == "waiting"  # never running under a job it does not know


def test_a_rows_write_that_fails_after_the_submit_cancels_the_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = Cluster(tmp_path, two_classes())
    c.change("n4", NodeSpec(nccl="2.21.5"))
    c.passes(60)
    assert c.state("n4") in ("settling", "waiting") and not c.slurm.jobs
    real = Inventory.canary_write

    def full(self: Inventory, rows: Any, *a: Any, **k: Any) -> bool:
        if any(r.get("state") == "running" for r in rows):
            raise InventoryError(self.path, "database or disk is full")
        return real(self, rows, *a, **k)

    monkeypatch.setattr(Inventory, "canary_write", full)
    with pytest.raises(InventoryError):
        c.passes(15)
    assert c.slurm.jobs, "no canary was submitted"
    assert all(j["state"] == "CANCELLED" for j in c.slurm.jobs.values())
    assert c.state("n4") == "waiting"


# ------------------------------------------------------------------- a node


@pytest.mark.parametrize("ended", [False, True])
def test_a_peer_that_changes_under_a_canary_does_not_fail_the_changed_node(
        tmp_path: Path, ended: bool) -> None:
    """n1, the canary's peer, moves its stack while the canary of n4 runs (a node that
    flaps its fingerprint to keep others held): the gate refuses the canary (``ended``)
    or it is still running. n4 is not failed for it: the canary is stopped and tried
    again with another peer, and n4 rejoins its class."""
    c = Cluster(tmp_path, two_classes())
    c.change("n4", NodeSpec(nccl="2.21.5"))
    _until(c, "running")
    job = c.rows()["n4"]["job_id"]
    peers = [h for h in c.slurm.jobs[job]["nodes"] if h != "n4"]
    assert peers == ["n1"]
    c.change("n1", NodeSpec(nccl="2.23.4"))
    if ended:
        c.slurm.jobs[job]["state"] = "FAILED"  # the gate refused it at its start
    c.passes(15)
    r = c.rows()["n4"]
    assert r["state"] != "failed", r["reason"]
    assert "n1, of its nodes, changed under it" in r["reason"] or r["state"] == "running"
    if not ended:
        assert ("cancel", job) in c.slurm.calls
    c.change("n1", NodeSpec(nccl="2.21.5"))  # and back: released, no canary needed
    _until(c, "ok")
    assert c.state("n1") == "ok"
    assert [e["event"] for e in history(c, "n4")][-3:] == ["retry", "submitted", "held"]


def test_a_node_that_flaps_under_a_shared_canary_does_not_fail_the_others(
        tmp_path: Path) -> None:
    """n3 and n4 changed alike and share a canary; n3 moves again while it runs (its
    canary is cancelled for it). n4 is tried again, not failed with it."""
    c = Cluster(tmp_path, two_classes(6))
    c.change("n4", NodeSpec(nccl="2.21.5"))
    c.change("n5", NodeSpec(nccl="2.21.5"))
    _until(c, "running")
    job = c.rows()["n4"]["job_id"]
    assert c.rows()["n5"]["job_id"] == job
    c.change("n5", NodeSpec(nccl="2.23.4"))
    c.passes(15)
    assert ("cancel", job) in c.slurm.calls
    c.passes(15)
    assert c.state("n4") != "failed", c.rows()["n4"]["reason"]
    _until(c, "ok")
    assert c.state("n5") in ("settling", "waiting", "approval")


def test_the_history_of_a_flapping_node_is_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node that moves its stack every pass writes an event each time; the service
    keeps each node's newest events and none older than ``inventory.history_days``."""
    monkeypatch.setattr(service, "HISTORY_PER_HOST", 10)
    monkeypatch.setattr(service, "PRUNE_EVERY_S", 60.0)
    c = Cluster(tmp_path, two_classes())
    for i in range(40):
        c.change("n4", NodeSpec(nccl="2.21.5" if i % 2 else "2.23.4"))
        c.passes(15)
    with Inventory(c.db, readonly=True, values=GATE_VALUES) as inv:
        n = len(inv.canary_history("n4", 1000))
    assert n <= 15, n
    c.clock.t += (c.cfg.inventory.history_days + 1) * 86400
    c.passes(15)
    with Inventory(c.db, readonly=True, values=GATE_VALUES) as inv:
        left = inv.canary_history("n4", 1000)
    assert left and all(e["at"] >= c.clock() - 60 for e in left)  # this pass's only


def test_a_pass_over_thousands_of_held_nodes_in_as_many_classes_is_linear() -> None:
    """12,000 nodes, each publishing a class of its own: one plan in well under a pass
    (it was quadratic: every class scanned every row, 37 s for 20,000)."""
    rows, keys = {}, {}
    for i in range(12000):
        h, k = f"n{i}", f"{i:064x}"
        rows[h] = held_row(h, None, k, 0.0, "x", state="waiting")
        keys[h] = k
    cfg = CanaryConfig(enabled=True, command=("x",))
    t = time.monotonic()
    p = plan(rows, keys, set(rows), {}, 0, cfg, 1.0)
    assert time.monotonic() - t < 3.0
    assert not p.launches and len(p.rows) == 12000
    assert all(r["state"] == "approval" for r in p.rows.values())


def test_a_policy_change_holds_no_node(tmp_path: Path) -> None:
    """An admin makes a rule refuse-level: every class key moves, no stack did. No node
    is held for it (before, the whole cluster left multi-node placement until each node's
    canary ran, max_running at a time)."""
    c = Cluster(tmp_path, two_classes())
    cfg = c.cfg.replace(policy=PolicyConfig(severity={"nccl-conf": "refuse"}))
    # the collector re-derives every key under the new policy before the service's pass:
    # the gate and the features sync must not take every node as changed meanwhile
    with Inventory(c.db, values=class_values(cfg.policy)) as inv:
        inv.derive_classes()
        assert inv.stored_class_policy() == class_policy(cfg.policy)
        assert inv.canary_held() == set()
        assert inv.canary_holds(["n1", "n2", "n3", "n4"]) == {}
    c.cfg = cfg
    c.svc = service.CanaryService(cfg, c.slurm, clock=c.clock)  # type: ignore[arg-type]
    c.passes(120)
    assert {r["state"] for r in c.rows().values()} == {"ok"}
    assert all(c.classes().values())
    assert not c.slurm.calls
    c.change("n4", NodeSpec(nccl="2.21.5"))  # a real change after it is still held
    c.passes(15)
    assert c.state("n4") == "settling"


# ------------------------------------------------------------------- its output


def test_an_output_directory_others_can_write_gets_no_output(tmp_path: Path) -> None:
    """Anyone may write the output directory: a link planted under the next job's output
    name would have the job (as the service's user) write through it. The job's output
    goes to /dev/null, and the service says why."""
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)
    c = Cluster(tmp_path, two_classes(), output_dir=str(out))
    c.slurm.outcome = lambda nodes: "FAILED"
    c.change("n4", NodeSpec(nccl="2.21.5"))
    _until(c, "running")
    args = next(a for k, a in c.slurm.calls if k == "submit")
    assert args[args.index("-o") + 1] == "/dev/null"
    _until(c, "failed")
    assert "writable by everyone" in c.rows()["n4"]["reason"]


def test_an_output_file_with_a_second_name_is_not_read(tmp_path: Path) -> None:
    """The output file is a hard link to another file of the service's user: its lines
    are not shown."""
    secret = tmp_path / "secret"
    secret.write_text("a token of the service's user\n")
    c, out = failing(tmp_path)
    _until(c, "running")
    job = c.rows()["n4"]["job_id"]
    os.link(secret, out / f"ncclguard-canary-{job}.out")
    _until(c, "failed")
    reason = c.rows()["n4"]["reason"]
    assert "token" not in reason and "hard link" in reason


@pytest.mark.parametrize("kind", ["fifo", "huge", "garbage"])
def test_an_odd_output_file_neither_hangs_nor_leaks(tmp_path: Path, kind: str) -> None:
    c, out = failing(tmp_path)
    _until(c, "running")
    path = out / f"ncclguard-canary-{c.rows()['n4']['job_id']}.out"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(1 << 40)  # sparse: 1 TiB
            tail = b"\nearlier\nlast line\n"
            f.seek(-len(tail), os.SEEK_END)
            f.write(tail)
    else:
        path.write_bytes(b"\xff\xfe bad utf-8 \x1b]0;title\x07\x1b[2J\r\n\x00ok\n")
    t = time.monotonic()
    _until(c, "failed")
    assert time.monotonic() - t < 10
    reason = c.rows()["n4"]["reason"]
    assert not any(ch in reason for ch in "\x1b\x07\x00\r\n")
    if kind == "fifo":
        assert "not a file of this service's user" in reason
    elif kind == "huge":
        assert reason.endswith("earlier | last line")  # a long line crowds out none


# ------------------------------------------------------------------- an admin


def test_canary_run_racing_the_service_does_not_orphan_its_canary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ncclguard canary run n4`` reads n4 waiting; before it writes, the service submits
    n4's canary (job 555). The admin's write must not put n4 back to waiting under the
    service's feet (its canary left running with no row naming it, and a second one
    submitted): it is refused, and says why."""
    from click.testing import CliRunner

    from ncclguard.cli import main

    c = Cluster(tmp_path, two_classes())
    c.slurm.busy = {"n1", "n2"}
    c.change("n4", NodeSpec(nccl="2.21.5"))
    c.passes(90)
    assert c.state("n4") == "waiting"
    real = Inventory.class_keys

    def meanwhile(self: Inventory, hosts: Any = None) -> Any:
        with Inventory(c.db, values=GATE_VALUES) as inv:
            row = dict(inv.canary_nodes()["n4"], state="running", job_id=555,
                       job_nodes="n[1,4]")
            inv.canary_write([row])
        return real(self, hosts)

    monkeypatch.setattr(Inventory, "class_keys", meanwhile)
    res = CliRunner().invoke(main, ["--db", str(c.db), "canary", "run", "n4"])
    assert res.exit_code != 0
    assert "changed these nodes' rows meanwhile" in res.output
    r = c.rows()["n4"]
    assert (r["state"], r["job_id"]) == ("running", 555)
