"""The canary's rules and its service against a model of Slurm (issue 43, docs/canary.md).

The real-Slurm tests (tests/test_canary_slurm.py) show each step on Slurm itself; here a
small scheduler on a virtual clock (:class:`FakeSlurm`: idle nodes, held and released
jobs, a time per job) drives the service through what a real cluster takes hours to
show: a rolling upgrade of 64 nodes, jobs that pend, fail, vanish, and Slurm going away.
The inventory is a real one, written as the collector writes it.

Over 500 lines: every test drives the one model of Slurm and the one cluster on its
virtual clock defined here (the hostile cases of docs/threat-model.md among them), and
its model of Slurm and cluster are in tests/helpers/canary.py.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from helpers.canary import Cluster, failing, history, two_classes
from helpers.inventory import NodeSpec

from ncclguard.config import PolicyConfig
from ncclguard.hostlist import compress, expand
from ncclguard.policy import GATE_VALUES
from ncclguard.policy.canary import gate_holds
from ncclguard.policy.schedule import class_values
from ncclguard.policy.verdict import Verdict
from ncclguard.slurm import SlurmError
from ncclguard.store import Inventory


def test_the_first_pass_takes_every_node_as_vetted_and_holds_none(tmp_path: Path) -> None:
    c = Cluster(tmp_path, two_classes())
    assert c.notes[0] == "first pass: 4 nodes taken as vetted in their classes"
    assert {r["state"] for r in c.rows().values()} == {"ok"}
    assert all(c.classes().values())
    c.passes(600)
    assert c.slurm.calls == []


def test_a_changed_node_is_held_canaried_with_a_peer_and_rejoins(tmp_path: Path) -> None:
    c = Cluster(tmp_path, two_classes())
    before = c.classes()
    c.change("n4", NodeSpec(nccl="2.21.5"))  # upgraded: leaves 2.18.3's class for 2.21.5's
    c.passes(15)
    assert c.state("n4") == "settling"
    assert c.classes()["n4"] is None  # no class feature: no multi-node job is offered it
    assert "its stack changed" in c.rows()["n4"]["reason"]
    c.passes(60)  # settled, submitted
    submits = [a for k, a in c.slurm.calls if k == "submit"]
    assert len(submits) == 1
    args = submits[0]
    nodes = expand(args[args.index("-w") + 1])
    assert "n4" in nodes and len(nodes) == 2 and ({"n1", "n2"} & set(nodes))
    job = max(c.slurm.jobs)
    assert "exec nccl-check --quick" in c.slurm.jobs[job]["script"]
    assert c.state("n4") == "running" and c.rows()["n4"]["job_id"] == job
    c.passes(90)  # the job runs 60 s
    assert c.state("n4") == "ok"
    after = c.classes()
    assert after["n4"] == before["n1"] == after["n1"]
    events = [e["event"] for e in history(c, "n4")]
    assert events == ["passed", "submitted", "held"]


def test_a_failing_canary_keeps_the_node_out_with_its_job_and_output(tmp_path: Path) -> None:
    c, out = failing(tmp_path)
    c.passes(90)
    job = max(c.slurm.jobs)
    (out / f"ncclguard-canary-{job}.out").write_text(
        "# nccl-tests\nn4: NCCL WARN NET/IB : No device found.\n\x1b[31mbusbw 0.00\n")
    c.passes(90)
    r = c.rows()["n4"]
    assert r["state"] == "failed"
    assert f"its canary job {job} ended FAILED" in r["reason"]
    assert "No device found" in r["reason"] and "\x1b" not in r["reason"]
    assert c.classes()["n4"] is None
    c.passes(3600)  # it stays out: no canary again until its stack moves or an admin asks
    assert c.state("n4") == "failed"
    assert sum(1 for k, _ in c.slurm.calls if k == "submit") == 1


def test_an_output_file_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("the munge key\n")
    c, out = failing(tmp_path)
    c.passes(90)
    job = max(c.slurm.jobs)
    (out / f"ncclguard-canary-{job}.out").symlink_to(secret)
    c.passes(90)
    reason = c.rows()["n4"]["reason"]
    assert "munge key" not in reason and "a link" in reason


def test_a_node_the_admin_drained_waits_and_its_drain_is_never_touched(
        tmp_path: Path) -> None:
    c = Cluster(tmp_path, two_classes())
    c.slurm.drained["n4"] = "replacing the HCA (jane)"
    c.change("n4", NodeSpec(nccl="2.21.5"))
    c.passes(300)
    r = c.rows()["n4"]
    assert r["state"] == "waiting"
    assert "drained (replacing the HCA (jane)), left as the admin set it" in r["reason"]
    assert not [k for k, _ in c.slurm.calls if k == "submit"]
    del c.slurm.drained["n4"]  # the admin resumes it
    c.passes(120)
    assert c.state("n4") == "ok"


def test_no_idle_peer_waits_and_says_so(tmp_path: Path) -> None:
    c = Cluster(tmp_path, two_classes())
    c.slurm.busy = {"n1", "n2"}
    c.change("n4", NodeSpec(nccl="2.21.5"))
    c.passes(300)
    r = c.rows()["n4"]
    assert r["state"] == "waiting" and "no idle known-good peer" in r["reason"]
    c.slurm.busy = set()
    c.passes(120)
    assert c.state("n4") == "ok"


def test_a_canary_pending_too_long_is_cancelled_and_tried_again(tmp_path: Path) -> None:
    c = Cluster(tmp_path, two_classes(), pending_timeout_s=120.0)
    c.change("n4", NodeSpec(nccl="2.21.5"))
    c.passes(75)
    first = max(c.slurm.jobs)
    c.slurm.busy = {"n1", "n2", "n4"}  # taken after the service saw them idle
    c.passes(150)
    assert ("cancel", first) in c.slurm.calls
    assert c.state("n4") == "waiting"
    assert [e["event"] for e in history(c, "n4")][:1] == ["retry"]
    c.slurm.busy = set()
    c.passes(150)
    assert c.state("n4") == "ok" and max(c.slurm.jobs) > first


def test_a_changed_node_is_held_from_the_collectors_write_before_the_next_pass(
        tmp_path: Path) -> None:
    """Between the collector's write and the service's next pass (up to interval_s), the
    features sync and the gate hold the node already: before, the sync gave it its new
    class and the gate let it into multi-node jobs (found on the real cluster,
    tests/test_canary_slurm.py)."""
    c = Cluster(tmp_path, two_classes())
    c.change("n4", NodeSpec(nccl="2.21.5"))  # collected; the service has not looked yet
    assert c.state("n4") == "ok"
    assert c.classes()["n4"] is None
    c.change("n5", NodeSpec(nccl="2.21.5"))  # first seen after the first pass
    with Inventory(c.db, readonly=True, values=GATE_VALUES) as inv:
        holds = inv.canary_holds(["n1", "n4", "n5"])
        assert inv.canary_held() == {"n4", "n5"}
    assert sorted(holds) == ["n4", "n5"]
    assert holds["n4"]["state"] == holds["n5"]["state"] == "settling"
    assert "its stack changed" in holds["n4"]["reason"]
    assert holds["n5"]["reason"].startswith("first seen")
    v, canary = gate_holds(Verdict("accept", nodes=["n1", "n4"]), holds, 1)
    assert (v.decision, canary, v.odd_nodes) == ("refuse", False, ["n4", "n5"])
    c.change("n4", NodeSpec(nccl="2.18.3"))  # rolled back before any pass: not held
    assert c.classes()["n4"] == c.classes()["n3"]
    c.passes(15)  # the service's pass writes what the readers said
    assert c.state("n4") == "ok" and c.state("n5") == "settling"


def test_a_rolled_back_node_is_let_go_without_a_canary(tmp_path: Path) -> None:
    c = Cluster(tmp_path, two_classes())
    c.change("n4", NodeSpec(nccl="2.21.5"))
    c.passes(15)
    c.change("n4", NodeSpec(nccl="2.18.3"))
    c.passes(15)
    assert c.state("n4") == "ok" and c.classes()["n4"] == c.classes()["n3"]
    assert not c.slurm.calls


def test_a_stack_that_moves_while_its_canary_runs_cancels_it(tmp_path: Path) -> None:
    c = Cluster(tmp_path, two_classes())
    c.change("n4", NodeSpec(nccl="2.21.5"))
    c.passes(90)
    job = max(c.slurm.jobs)
    assert c.state("n4") == "running"
    c.change("n4", NodeSpec(nccl="2.23.4"))  # another change mid-canary
    c.passes(15)
    assert ("cancel", job) in c.slurm.calls
    assert c.state("n4") == "settling"


def test_a_new_class_pairs_two_changed_nodes_and_a_lone_one_waits_for_an_admin(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = Cluster(tmp_path, two_classes(6))
    c.change("n1", NodeSpec(nccl="2.23.4"))  # a combination no node has run
    c.passes(120)
    r = c.rows()["n1"]
    assert r["state"] == "approval" and "no node has run" in r["reason"]
    c.change("n2", NodeSpec(nccl="2.23.4"))  # a second node of it: they pair
    c.passes(90)
    job = max(c.slurm.jobs)
    assert sorted(c.slurm.jobs[job]["nodes"]) == ["n1", "n2"]
    c.passes(90)
    assert c.state("n1") == c.state("n2") == "ok"
    # a lone node of yet another class: an admin approves it, recorded with the name
    c.change("n6", NodeSpec(nccl="2.24.3"))
    c.passes(120)
    assert c.state("n6") == "approval"
    from click.testing import CliRunner

    from ncclguard.cli import main

    monkeypatch.setenv("SUDO_USER", "jane")
    res = CliRunner().invoke(main, ["--db", str(c.db), "canary", "approve", "n6",
                                    "--reason", "vendor-certified image"])
    assert res.exit_code == 0, res.output
    assert c.state("n6") == "ok"
    e = history(c, "n6")[0]
    assert (e["event"], e["by"]) == ("approved", "jane")
    assert "vendor-certified image" in e["detail"]
    c.passes(60)
    assert c.state("n6") == "ok"


def test_slurm_not_answering_submits_nothing_and_the_pass_fails(tmp_path: Path) -> None:
    c = Cluster(tmp_path, two_classes())
    c.change("n4", NodeSpec(nccl="2.21.5"))
    c.passes(30)
    c.slurm.up = False
    c.clock.t += 60
    with pytest.raises(SlurmError):
        c.svc.apply()
    assert not [k for k, _ in c.slurm.calls if k == "submit"]
    assert c.state("n4") == "waiting"
    c.slurm.up = True
    c.passes(120)
    assert c.state("n4") == "ok"


def test_an_admin_run_holds_a_vetted_node_and_its_canary_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from ncclguard.cli import main

    c = Cluster(tmp_path, two_classes())
    monkeypatch.setenv("SUDO_USER", "root-on-behalf-of-bob")
    res = CliRunner().invoke(main, ["--db", str(c.db), "canary", "run", "n2"])
    assert res.exit_code == 0, res.output
    assert c.state("n2") == "waiting" and c.classes()["n2"] is None
    c.passes(15)
    job = max(c.slurm.jobs)
    assert sorted(c.slurm.jobs[job]["nodes"]) == ["n1", "n2"]
    c.passes(90)
    assert c.state("n2") == "ok"
    res = CliRunner().invoke(main, ["--db", str(c.db), "canary", "status", "--history",
                                    "--json"])
    assert res.exit_code == 0 and '"run"' in res.output and "bob" in res.output


@pytest.mark.parametrize(("max_running", "max_nodes"), [(4, 4), (2, 1)])
def test_a_rolling_upgrade_of_64_nodes_is_canaried_in_waves(
        tmp_path: Path, max_running: int, max_nodes: int) -> None:
    """64 of 80 nodes upgraded at once: at most ``max_running`` canaries at a time, each
    node back within waves x (its canary's time + the service's overhead)."""
    specs = {f"n{i:02d}": NodeSpec(nccl="2.21.5" if i <= 16 else "2.18.3")
             for i in range(1, 81)}
    c = Cluster(tmp_path, specs, max_running=max_running, max_nodes=max_nodes, peers=1)
    t0 = c.clock()
    changed = [f"n{i:02d}" for i in range(17, 81)]
    for h in changed:
        c.change(h, NodeSpec(nccl="2.21.5"))
    back: dict[str, float] = {}
    most = 0
    while len(back) < 64 and c.clock() < t0 + 86400:
        c.passes(15)
        most = max(most, c.slurm.running())
        rows = c.rows()
        back.update({h: c.clock() for h in changed if rows[h]["state"] == "ok"
                     and h not in back})
    assert len(back) == 64
    assert most <= max_running
    waves = math.ceil(64 / (max_running * max_nodes))
    interval = c.cfg.canary.interval_s
    # a wave: submitted at a pass, started by Slurm, ended after the job's time, seen at
    # the next pass: job time + 2 passes; before the first: settle + 2 passes
    bound = c.cfg.canary.settle_s + 2 * interval + waves * (c.slurm.duration + 2 * interval)
    assert max(back.values()) - t0 <= bound
    jobs = [j for j in c.slurm.jobs.values()]
    assert len(jobs) == waves * max_running
    assert all(len([n for n in j["nodes"] if n in changed]) <= max_nodes for j in jobs)


def test_the_gate_refuses_a_held_node_unless_the_job_is_its_canary() -> None:
    accept = Verdict("accept", nodes=["n1", "n4"])
    held = {"n4": {"state": "running", "job_id": 812, "reason": "its canary job 812 runs"}}
    v, canary = gate_holds(accept, held, 812)
    assert (v.decision, canary) == ("accept", True)
    v, canary = gate_holds(accept, held, 813)
    assert (v.decision, canary) == ("refuse", False)
    assert v.odd_nodes == ["n4"] and v.findings[0].rule == "canary-hold"
    waiting = {"n4": dict(held["n4"], state="waiting", job_id=None)}
    assert gate_holds(accept, waiting, 812)[0].decision == "refuse"
    # a canary job cannot vouch for a held node it is not the canary of
    other = {**held, "n3": {"state": "running", "job_id": 700, "reason": "x"}}
    assert gate_holds(accept, other, 812)[0].decision == "refuse"
    assert gate_holds(accept, {}, 1) == (accept, False)


def test_hostlists_shown_are_compressed() -> None:  # what describe() prints
    from ncclguard.policy.canary import Launch, describe

    text = describe(Launch(("n3", "n4"), ("n1",), "ab" * 32))
    assert text == "n[3-4] with peer n1 (class ababababab)"
    assert re.fullmatch(r"n\[3-4\] \(a new class: no known-good peer\) \(class \w{10}\)",
                        describe(Launch(("n3", "n4"), (), "cd" * 32)))
    assert compress(["n1"]) == "n1"


def test_ncclguard_check_refuses_a_held_node_as_the_gate_does(tmp_path: Path) -> None:
    import json

    from click.testing import CliRunner

    from ncclguard.cli import main

    c = Cluster(tmp_path, two_classes())
    c.change("n4", NodeSpec(nccl="2.21.5"))
    c.passes(15)
    conf = tmp_path / "config.toml"
    conf.write_text(f'[inventory]\ndb = "{c.db}"\nstale_after_s = 1000000000\n'
                    '[canary]\nenabled = true\ncommand = ["true"]\n')
    res = CliRunner().invoke(main, ["--config", str(conf), "check", "n[1,4]", "--json"])
    assert res.exit_code == 2, res.output
    doc = json.loads(res.output)
    assert doc["decision"] == "refuse" and doc["odd_nodes"] == "n4"
    assert doc["findings"][0]["rule"] == "canary-hold"
    # the same nodes once n4's canary passed: accepted
    c.passes(150)
    res = CliRunner().invoke(main, ["--config", str(conf), "check", "n[1,4]", "--json"])
    doc = json.loads(res.output)  # warn: the virtual clock's records are old by the real one
    assert doc["decision"] != "refuse" and not doc["odd_nodes"], res.output


def test_the_features_daemon_gives_a_node_its_class_back_as_its_canary_passes(
        tmp_path: Path) -> None:
    """The daemon damps nodes whose class flaps ([features] settle_s); a canary's hold and
    its end are not a flap: before, a canary that passed within settle_s of the hold left
    the node without a class for another settle_s."""
    from inventoryd.controller.features import FeatureKeeper
    from ncclguard.config import FeaturesConfig

    c = Cluster(tmp_path, two_classes(), settle_s=0.0)
    cfg = c.cfg.replace(features=FeaturesConfig(settle_s=3600.0))
    keeper = FeatureKeeper(cfg, slurm=c.slurm, clock=c.clock)  # type: ignore[arg-type]
    first = keeper.classes(c.slurm.hosts, c.clock())
    c.change("n4", NodeSpec(nccl="2.21.5"))
    c.passes(15)
    assert keeper.classes(c.slurm.hosts, c.clock())["n4"] is None
    c.passes(90)
    assert c.state("n4") == "ok"
    assert keeper.classes(c.slurm.hosts, c.clock())["n4"] == first["n1"]


def test_an_output_file_not_the_services_own_is_not_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/threat-model.md: the output is read only from a regular file of the service's
    own user (the job runs as it): a FIFO someone put there is not waited on, and a file of
    another owner (here: the service's uid seen as another's) is not read."""
    import os

    import inventoryd.controller.canary as service

    c, out = failing(tmp_path)
    c.passes(90)
    job = max(c.slurm.jobs)
    os.mkfifo(out / f"ncclguard-canary-{job}.out")
    c.passes(90)
    reason = c.rows()["n4"]["reason"]
    assert "not a file of this service's user" in reason
    (out / f"ncclguard-canary-{job}.out").unlink()
    (out / f"ncclguard-canary-{job}.out").write_text("planted: all good\n")
    monkeypatch.setattr(service.os, "geteuid", lambda: os.getuid() + 1)
    assert "planted" not in c.svc._tail(job)
    assert "not a file of this service's user" in c.svc._tail(job)


def test_a_node_flipping_its_stack_gets_no_canary_and_holds_only_itself(
        tmp_path: Path) -> None:
    """docs/threat-model.md: a node (or its publisher) that changes its fingerprint every
    pass holds itself out, submits nothing (its stack never settles), and moves no other
    node; back in its vetted class it is let go, as a rollback is."""
    c = Cluster(tmp_path, two_classes())
    for i in range(40):  # 10 minutes, a change every pass
        c.change("n4", NodeSpec(nccl="2.21.5" if i % 2 == 0 else "2.23.4"))
        c.passes(15)
        assert c.state("n4") == "settling"
    assert not c.slurm.calls
    assert {h: r["state"] for h, r in c.rows().items() if h != "n4"} == dict.fromkeys(
        ("n1", "n2", "n3"), "ok")
    c.change("n4", NodeSpec(nccl="2.18.3"))
    c.passes(15)
    assert c.state("n4") == "ok" and not c.slurm.calls


def test_only_a_writer_of_the_inventory_can_approve(tmp_path: Path) -> None:
    """docs/threat-model.md: ``ncclguard canary approve`` writes the inventory, which is
    ``ncclguard``'s (0644): any other user is refused by the file's mode, and nothing is
    written. The name it records (``SUDO_USER``) is for the history, not a credential."""
    import multiprocessing as mp
    import os
    import tempfile

    c = Cluster(tmp_path, two_classes())
    c.change("n4", NodeSpec(nccl="2.21.5"))
    c.passes(15)
    assert c.state("n4") == "settling"
    public = Path(tempfile.mkdtemp(prefix="ncclguard-canary-"))
    try:
        public.chmod(0o755)
        db = public / "inventory.db"
        db.write_bytes(c.db.read_bytes())
        db.chmod(0o644)

        def approve() -> None:  # in a child: an unprivileged user (root ignores modes)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            from click.testing import CliRunner

            from ncclguard.cli import main

            res = CliRunner().invoke(main, ["--db", str(db), "canary", "approve", "n4"],
                                     env={"SUDO_USER": "mallory"})
            os._exit(res.exit_code)

        if os.geteuid() != 0:
            db.chmod(0o444)
        child = mp.get_context("fork").Process(target=approve)
        child.start()
        child.join(60)
        assert child.exitcode == 3
        with Inventory(db, readonly=True, values=class_values(PolicyConfig())) as inv:
            assert inv.canary_nodes()["n4"]["state"] == "settling"
            assert not [e for e in inv.canary_history("n4") if e["by"] == "mallory"]
    finally:
        import shutil

        shutil.rmtree(public, ignore_errors=True)


def test_a_write_of_rows_an_admin_changed_meanwhile_is_refused(tmp_path: Path) -> None:
    """docs/threat-model.md: the service writes only rows that still have the state and
    job id it read; an admin's ``approve`` in between wins, and nothing of the service's
    write (its history rows included) goes in."""
    from ncclguard.policy.canary import held_row, ok_row

    c = Cluster(tmp_path, two_classes())
    c.change("n4", NodeSpec(nccl="2.21.5"))
    c.passes(15)
    read = c.rows()["n4"]  # what the service read: settling
    with Inventory(c.db, values=class_values(PolicyConfig())) as inv:
        inv.canary_write([ok_row("n4", read["class_key"], c.clock())],
                         [{"at": c.clock(), "host": "n4", "event": "approved", "by": "jane",
                           "detail": "approved by jane"}])  # the admin, meanwhile
        late = dict(read, state="waiting", reason="settled")
        assert not inv.canary_write(
            [late], [{"at": c.clock(), "host": "n4", "event": "held", "detail": "x"}],
            expect={"n4": (read["state"], read["job_id"])})
        assert inv.canary_write([held_row("n9", None, "k", c.clock(), "new")],
                                expect={"n9": ("", None)})  # a row not there yet
    assert c.state("n4") == "ok"
    assert [e["event"] for e in history(c, "n4")][:1] == ["approved"]


def test_the_canarys_writes_leave_a_running_collectors_inventory_in_wal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/store.md: the collector keeps the inventory in WAL while it runs (readers never
    block its writes). The service and an admin's ``canary approve`` write beside it: they
    open it in WAL too. Found under systemd (docs/install.md, step 9): the service opened it
    with the default ``journal_mode = "delete"``, which switched the running collector's
    file to a rollback journal; the collector's next write (its reload) then waited 25 s
    for readers and failed ("derive the classes: still busy")."""
    import subprocess
    import sys

    from click.testing import CliRunner

    from ncclguard.cli import main

    c = Cluster(tmp_path, two_classes())
    # the collector, in a process of its own (SQLite's locks are per process): its
    # inventory open in WAL, as collector.py opens it, and read as its metrics read it
    code = ("import sys\nfrom ncclguard.config import InventoryConfig, PolicyConfig\n"
            "from ncclguard.policy.schedule import class_values\n"
            "from ncclguard.store import Inventory\n"
            "inv = Inventory(sys.argv[1], config=InventoryConfig(journal_mode='wal'), "
            "values=class_values(PolicyConfig()), heartbeat_s=0)\n"
            "inv.heartbeat('n1')\n"
            "with Inventory(sys.argv[1], readonly=True) as r:\n    r.hosts()\n"  # its metrics
            "print('open', flush=True)\nsys.stdin.readline()\n"
            "print(inv._conn.execute('PRAGMA journal_mode').fetchone()[0], flush=True)\n")
    repo = Path(__file__).resolve().parents[1]
    collector = subprocess.Popen([sys.executable, "-c", code, str(c.db)], cwd=repo, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert collector.stdout is not None and collector.stdin is not None
        assert collector.stdout.readline() == "open\n"
        assert _in_wal(c.db)
        c.change("n4", NodeSpec(nccl="2.21.5"))
        c.passes(15)  # the service's pass: opens, writes, closes
        assert c.state("n4") == "settling"
        assert _in_wal(c.db), "the service switched the collector's WAL off"
        monkeypatch.setenv("SUDO_USER", "jane")
        res = CliRunner().invoke(main, ["--db", str(c.db), "canary", "approve", "n4"])
        assert res.exit_code == 0, res.output
        assert _in_wal(c.db), "approve switched the collector's WAL off"
        collector.stdin.write("\n")
        collector.stdin.flush()
        assert collector.stdout.readline() == "wal\n"
    finally:
        collector.kill()
        collector.wait(30)


def _in_wal(db: Path) -> bool:
    """The file's header says WAL (its read and write versions, bytes 18 and 19, are 2;
    1: a rollback journal): what every new connection goes by."""
    with open(db, "rb") as f:
        return f.read(20)[18:20] == b"\x02\x02"


def test_the_event_totals_only_grow_when_the_history_is_pruned(tmp_path: Path) -> None:
    """The metrics' ncclguard_canary_events_total is a counter: the history it came from
    is pruned hourly, so the totals are kept beside it (before: counted from the history,
    a prune lowered them and Prometheus read a reset)."""
    c = Cluster(tmp_path, two_classes())
    c.change("n4", NodeSpec(nccl="2.21.5"))
    c.passes(180)
    with Inventory(c.db, values=class_values(PolicyConfig())) as inv:
        before = inv.canary_counts(c.clock())["events"]
        assert before == {"submitted": 1, "passed": 1}
        assert inv.prune_canary_history(c.clock() + 1) > 0
        assert inv.canary_history() == []
        assert inv.canary_counts(c.clock())["events"] == before
