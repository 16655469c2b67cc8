"""Issue 44: no stack verdict without a difference between hosts.

A stack family stands only when the log shows the job's nodes differ (or the inventory
does); a fault every host shows alike is no node difference and says so, with a fix that
is not draining a node; a log of only some hosts says what it cannot tell."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.fingerprints import fingerprint

from ncclguard.diagnose import load_catalog, run
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory

NO_DEVICE = "{h}:{pid}:{pid} [0] NCCL INFO NET/IB : No device found.\n"
OPEN = "{h}:{pid}:{pid} [0] net_ib.cc:205 NCCL WARN NET/IB : Unable to open device mlx5_1\n"
BANNER = "{h}:{pid}:{pid} [0] NCCL INFO NCCL version 2.21.5+cuda12.4\n"


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def _log(tmp_path: Path, *parts: tuple[str, str]) -> Path:
    log = tmp_path / "slurm-9.out"
    log.write_text("".join(t.format(h=h, pid=100 + int(h[1:])) for t, h in parts))
    return log


def test_a_fault_every_host_shows_alike_is_no_node_difference(catalog, tmp_path):
    log = _log(tmp_path, *((t, h) for h in ("n1", "n2", "n3") for t in (BANNER, NO_DEVICE)))
    (d,) = run([log], catalog=catalog).diagnoses
    assert (d.signature.id, d.verdict, d.family) == ("ib-no-device", "not-stack",
                                                     "no-node-difference")
    assert "all 3 hosts of the job printed it alike" in d.summary and not d.odd_nodes
    assert d.fix == d.signature.alike and "NCCL_IB_HCA" in d.fix  # the entry's own text
    text = run([log], catalog=catalog).text()
    assert "verdict: not a node-stack problem" in text and "ncclguard diff" not in text


def test_the_same_fault_on_some_hosts_only_stays_a_stack_cause(catalog, tmp_path):
    log = _log(tmp_path, (BANNER, "n1"), (BANNER, "n2"), (BANNER, "n3"), (NO_DEVICE, "n3"))
    (d,) = run([log], catalog=catalog).diagnoses
    assert (d.verdict, d.family, d.odd_nodes) == ("stack", "transport", ["n3"])


def test_one_host_in_the_log_cannot_tell(catalog, tmp_path):
    log = _log(tmp_path, (BANNER, "n1"), (OPEN, "n1"))
    (d,) = run([log], catalog=catalog).diagnoses
    assert (d.signature.id, d.verdict, d.family) == ("ib-device-open", "neutral",
                                                     "ib-device-open")
    assert "cannot be told: the log shows one host (n1)" in d.summary


def test_a_log_of_some_of_the_jobs_nodes_cannot_call_them_alike(catalog, tmp_path):
    log = _log(tmp_path, (OPEN, "n1"), (OPEN, "n2"))
    alike = run([log], catalog=catalog).diagnoses[0]
    assert alike.verdict == "not-stack"  # the log is taken as the whole job
    (d,) = run([log], catalog=catalog, nodes=["n1", "n2", "n3", "n4"]).diagnoses
    assert d.verdict == "neutral"
    assert "the log shows 2 of the job's 4 nodes (not n[3-4])" in d.summary


def test_ranks_missing_from_the_log_keep_it_from_calling_hosts_alike(catalog, tmp_path):
    init = "{h}:{pid}:{pid} [0] NCCL INFO comm 0x5 rank {r} nranks 8 cudaDev 0 - Init COMPLETE\n"
    log = tmp_path / "slurm-9.out"
    log.write_text("".join(init.format(h=h, pid=p, r=r) + OPEN.format(h=h, pid=p)
                           for h, p, r in (("n1", 1, 0), ("n2", 2, 4))))
    (d,) = run([log], catalog=catalog).diagnoses
    assert d.verdict == "neutral" and "the log shows 2 of 8 ranks" in d.summary


def test_the_inventory_restores_a_stack_verdict_the_log_could_not_support(catalog,
                                                                          tmp_path):
    log = _log(tmp_path, (BANNER, "n1"), (OPEN, "n1"))
    db = tmp_path / "inv.db"
    inv = Inventory(db, values=GATE_VALUES)
    inv.upsert(fingerprint(host="n1", hcas=2, ports_up=1), now=1000.0)
    inv.upsert(fingerprint(host="n2", hcas=2), now=1000.0)
    from ncclguard.config import PolicyConfig

    report = run([log], catalog=catalog, nodes=["n1", "n2"], when=2000.0,
                 open_inventory=lambda: Inventory(db, readonly=True),
                 policy_config=PolicyConfig())
    d = report.diagnoses[0]
    assert d.signature.id == "ib-device-open" and d.confirmed is True
    assert d.verdict == "stack" and "The inventory shows the job's nodes differ" in d.summary


TRUNCATED = ("{h}:{pid}:{pid} [0] bootstrap.cc:77 NCCL WARN Message truncated : received 256 "
             "bytes instead of 4\n")


def test_one_release_on_every_host_of_the_log_is_a_release_bug(catalog, tmp_path):
    log = _log(tmp_path, *((t, h) for h in ("n1", "n2") for t in (BANNER, TRUNCATED)))
    (d,) = run([log], catalog=catalog, nodes=["n1", "n2"]).diagnoses
    assert (d.verdict, d.family) == ("not-stack", "nccl-release-bug")


@pytest.mark.parametrize("nodes", [["n1", "n2"], None])
def test_one_release_in_a_log_of_some_hosts_is_no_release_bug(catalog, tmp_path, nodes):
    """The version split's own symptom, in a log of only the batch host (a job's output
    per node, '-o slurm-%N.out': the Epilog reads the batch host's file): 'Not a version
    split: every host of the log (n1) printed NCCL 2.21.5', verdict not-stack, when n2
    (not in the log) may run another release."""
    log = _log(tmp_path, (BANNER, "n1"), (TRUNCATED, "n1"))
    (d,) = run([log], catalog=catalog, nodes=nodes).diagnoses
    assert d.signature.id == "bootstrap-message-truncated"
    assert d.verdict == "neutral" and d.family != "nccl-release-bug"
    assert "Not a version split" not in d.summary


def test_ranks_of_smaller_communicators_do_not_hide_the_jobs_ranks(catalog, tmp_path):
    """Every rank of a 4-host job prints its world communicator's Init line, then a
    2-rank group's (PyTorch's new_group, FSDP's shards): ranks_seen counted the last rank
    each process printed, its rank in the group (0 or 1), and a whole job's log said
    'the log shows 2 of 8 ranks' and would not call a fault every host shows alike."""
    init = ("{h}:{pid}:{pid} [0] NCCL INFO comm 0x{pid}{c} rank {r} nranks {n} cudaDev 0 "
            "- Init COMPLETE\n")
    rows = []
    for i, h in enumerate(("n1", "n2", "n3", "n4")):
        for g in range(2):
            r = 2 * i + g
            pid = 1000 + r
            rows += [init.format(h=h, pid=pid, c=0, r=r, n=8),
                     init.format(h=h, pid=pid, c=1, r=g, n=2), OPEN.format(h=h, pid=pid)]
    log = tmp_path / "slurm-9.out"
    log.write_text("".join(rows))
    report = run([log], catalog=catalog)
    assert (report.evidence.nranks, report.evidence.ranks_seen) == (8, 8)
    d = report.diagnoses[0]
    assert (d.verdict, d.family) == ("not-stack", "no-node-difference")
    assert report.evidence.resolve(report.evidence.states["ib-device-open"].samples[2]).rank == 2


def test_the_epilogs_record_keeps_the_fix_and_verdict_of_the_diagnosis(catalog, tmp_path):
    """The audit record took the signature's own fix ('... or exclude the odd nodes'),
    not the diagnosis's: a fault every host showed alike was recorded with the advice to
    drain nodes, and without the verdict that says no node differs."""
    from prolog import epilog

    log = _log(tmp_path, *((t, h) for h in ("n1", "n2", "n3") for t in (BANNER, NO_DEVICE)))
    report = run([log], catalog=catalog)
    (d,) = report.diagnoses
    (rec,) = epilog.record(report, "9", 1)["diagnoses"]
    assert rec["fix"] == d.fix == d.signature.alike != d.signature.fix
    assert (rec["verdict"], rec["family"]) == ("not-stack", "no-node-difference")


def test_one_host_on_lo_while_the_others_are_not_is_a_node_difference(catalog, tmp_path):
    """From the hostile review: a hang with no trail where n3 chose lo (NCCL falls back
    to it only when it finds no other interface) and n1, n2 chose ib0 was reported first
    as 'not a node-stack problem', and the interface difference as 'the log shows no two
    hosts that differ'."""
    boot = "{h}:{pid}:{pid} [0] NCCL INFO Bootstrap : Using {i}<0>\n"
    log = tmp_path / "slurm-9.out"
    log.write_text("".join(boot.format(h=h, pid=p, i=i) for h, p, i in (
        ("n1", 1, "ib0:10.1.0.1"), ("n2", 2, "ib0:10.1.0.2"), ("n3", 3, "lo:127.0.0.1"))))
    first = run([log], catalog=catalog).diagnoses[0]
    assert (first.signature.id, first.verdict, first.odd_nodes) == (
        "bootstrap-interface-differs", "stack", ["n3"])


def test_hosts_that_differ_without_a_failure_say_so(catalog, tmp_path):
    boot = "{h}:{pid}:{pid} [0] NCCL INFO Bootstrap : Using {i}<0>\n"
    log = tmp_path / "slurm-9.out"
    log.write_text("".join(boot.format(h=h, pid=p, i=i) for h, p, i in (
        ("n1", 1, "ib0:10.1.0.1"), ("n2", 2, "eth0:192.168.0.2"))))
    (d,) = run([log], catalog=catalog).diagnoses
    assert d.verdict == "neutral"
    assert "the hosts differ, but none of" in d.summary and "no two hosts" not in d.summary


def test_a_value_is_cut_at_200_characters(catalog, tmp_path):
    """From the hostile review: 'Using network (?P<net>.*\\S)' put up to 64 KiB of one
    line into a value, the summary and the Epilog's record."""
    net = "{h}:{pid}:{pid} [0] NCCL INFO Using network {n}\n"
    log = tmp_path / "slurm-9.out"
    log.write_text(net.format(h="n1", pid=1, n="IB") + net.format(h="n2", pid=2, n="x" * 60000))
    (d,) = run([log], catalog=catalog).diagnoses
    assert d.signature.id == "net-transport-differs"
    assert max(len(v) for v in d.values) == 200 and len(d.summary) < 1000
