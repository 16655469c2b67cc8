"""evaluate(): scope, severities, unknown nodes, decision and odd nodes; Verdict output."""

from __future__ import annotations

import copy
import json

from helpers.fingerprints import error, fingerprint, libnccl, plugin

from ncclguard.config import PolicyConfig, from_dict
from ncclguard.policy import DEFAULT_SEVERITY, evaluate, odd_nodes
from ncclguard.policy.verdict import SUMMARY_MAX, Verdict

DEFAULT = PolicyConfig()


def severity(**changes: str) -> PolicyConfig:
    sev = dict(DEFAULT_SEVERITY)
    sev.update({k.replace("_", "-"): v for k, v in changes.items()})
    return PolicyConfig(severity=sev)


def same(hosts: str, **kw: object) -> dict[str, dict]:
    return {h: fingerprint(h, **kw) for h in hosts.split()}


def test_identical_nodes_accept() -> None:
    v = evaluate(same("n1 n2 n3 n4"), DEFAULT)
    assert v.decision == "accept"
    assert v.findings == [] and v.odd_nodes == []
    assert v.nodes == ["n1", "n2", "n3", "n4"]
    assert v.summary() == "ncclguard: accept: 4 nodes compatible"


def test_version_mismatch_refuses_and_names_the_odd_node() -> None:
    fps = same("n1 n2 n4") | {"n3": fingerprint("n3", nccl="2.18.3")}
    v = evaluate(fps, DEFAULT)
    assert v.decision == "refuse"
    assert v.odd_nodes == ["n3"]
    assert v.summary() == (
        "ncclguard: refuse, odd n3: nccl-version [nccl 2.18.3: n3 | nccl 2.21.5: n[1-2,4]]"
    )


def test_warn_only_differences_warn_without_odd_nodes() -> None:
    fps = same("n1 n2") | {"n3": fingerprint("n3", driver="535.104.05")}
    v = evaluate(fps, DEFAULT)
    assert v.decision == "warn"
    assert [f.rule for f in v.findings] == ["gpu-driver"]
    assert v.odd_nodes == []
    assert v.accepted


def test_severity_changes_and_ignore() -> None:
    fps = same("n1 n2") | {"n3": fingerprint("n3", driver="535.104.05")}
    v = evaluate(fps, severity(gpu_driver="refuse"))
    assert v.decision == "refuse" and v.odd_nodes == ["n3"]
    v = evaluate(fps, severity(gpu_driver="ignore"))
    assert v.decision == "accept" and v.findings == []
    mismatch = same("n1 n2") | {"n3": fingerprint("n3", nccl="2.18.3")}
    assert evaluate(mismatch, severity(nccl_version="warn")).decision == "warn"


def test_scope_partitions_and_min_nodes() -> None:
    bad = same("n1") | {"n2": fingerprint("n2", nccl="2.18.3")}
    guarded = PolicyConfig(partitions=("gpu",))
    v = evaluate(bad, guarded, partition="debug")
    assert v.decision == "accept" and v.notes == ["partition debug is not guarded"]
    assert v.summary() == "ncclguard: accept: partition debug is not guarded"
    assert evaluate(bad, guarded, partition="gpu").decision == "refuse"
    assert evaluate(bad, guarded, partition="debug,gpu").decision == "refuse"
    assert evaluate(bad, guarded).decision == "refuse"  # unknown partition: checked
    v = evaluate(bad, PolicyConfig(min_nodes=3))
    assert v.decision == "accept" and "min_nodes=3" in v.notes[0]
    assert evaluate(same("n1"), DEFAULT).decision == "accept"


def test_unknown_nodes_warn_by_default_and_can_refuse() -> None:
    fps: dict[str, dict | None] = {**same("n1 n2"), "n3": None}
    v = evaluate(fps, DEFAULT)
    assert v.decision == "warn" and v.odd_nodes == []
    assert v.findings[0].groups_text() == "no record: n3"
    v = evaluate(fps, severity(unknown_node="refuse"))
    assert v.decision == "refuse" and v.odd_nodes == ["n3"]


def test_stale_nodes_are_compared_by_their_last_record() -> None:
    """Issue 12: a stale node's last known stack is the best evidence there is; it was
    left out, and a refuse-level difference in it became a warning."""
    fps = same("n1 n2") | {"n3": fingerprint("n3", nccl="2.18.3")}
    v = evaluate(fps, DEFAULT, stale={"n3": 1200.0})
    assert v.decision == "refuse" and v.odd_nodes == ["n3"]
    assert [(f.rule, f.groups_text()) for f in v.findings] == [
        ("nccl-version", "nccl 2.18.3: n3 | nccl 2.21.5: n[1-2]"),
        ("unknown-node", "stale heartbeat, oldest 20 min old: n3"),
    ]
    assert "oldest 20 min old" in v.summary()
    # a stale node that agrees: warned about, never refused for being stale alone
    v = evaluate(same("n1 n2 n3"), DEFAULT, stale={"n3": 1200.0})
    assert v.decision == "warn" and v.odd_nodes == []
    v = evaluate(fps, severity(unknown_node="refuse"), stale=["n3"])
    assert v.odd_nodes == ["n3"]
    # no record at all stays unknown, not compared
    v = evaluate(same("n1 n2") | {"n3": None}, DEFAULT)
    assert v.decision == "warn" and [f.rule for f in v.findings] == ["unknown-node"]


def test_probe_error_is_unknown_not_different() -> None:
    broken = fingerprint("n3", errors=[error("libnccl", probe="nccl")])
    broken["libnccl"] = None
    v = evaluate(same("n1 n2") | {"n3": broken}, DEFAULT)
    # n3's libnccl is unknown: no version finding; the plugin ABI is unknown too
    assert v.decision == "accept", v.format_text()


def test_odd_nodes_across_rules_is_a_minimum_not_a_union() -> None:
    # per rule, the minority differs: n5 (version) and n6 (transport). Together: {n5, n6}.
    fps = same("n1 n2 n3 n4")
    fps["n5"] = fingerprint("n5", nccl="2.18.3")
    fps["n6"] = fingerprint("n6", conf={"NCCL_IB_DISABLE": "1"})
    assert evaluate(fps, DEFAULT).odd_nodes == ["n5", "n6"]
    # one node odd on two rules counts once
    fps = same("n1 n2 n3") | {"n4": fingerprint("n4", nccl="2.18.3", plugins=[plugin()])}
    v = evaluate(fps, DEFAULT)
    assert {f.rule for f in v.findings} >= {"nccl-version", "net-plugin"}
    assert v.odd_nodes == ["n4"]


def test_odd_nodes_with_unknown_values() -> None:
    # a: version X, transport unknown; b: version unknown, transport Socket.
    # Keeping {a, b} and the IB node c is impossible if c's version differs from a...
    sig = [
        (["2.21.5", None], ["a1", "a2"]),
        ([None, "Socket"], ["b1", "b2"]),
        (["2.18.3", "IB"], ["c1", "c2", "c3"]),
    ]
    # keep {a, b} (4 nodes, agree: 2.21.5 / Socket) rather than {c, ...} (c+? b is Socket)
    assert odd_nodes(sig) == ["c1", "c2", "c3"]
    # with c bigger than a+b the answer flips
    sig[2] = (["2.18.3", "IB"], ["c1", "c2", "c3", "c4", "c5"])
    assert odd_nodes(sig) == ["a1", "a2", "b1", "b2"]


def test_ties_break_by_host_names() -> None:
    fps = {"b1": fingerprint("b1", nccl="2.18.3"), "a1": fingerprint("a1")}
    assert evaluate(fps, DEFAULT).odd_nodes == ["b1"]  # keep the set that sorts first
    fps = {"b1": fingerprint("b1"), "a1": fingerprint("a1", nccl="2.18.3")}
    assert evaluate(fps, DEFAULT).odd_nodes == ["b1"]


def test_shared_fingerprint_objects_give_the_same_verdict() -> None:
    shared = fingerprint("x")
    odd = fingerprint("y", nccl="2.18.3")
    by_object = {f"n{i}": shared for i in range(1, 9)} | {"n9": odd}
    by_copy = {f"n{i}": copy.deepcopy(shared) for i in range(1, 9)} | {"n9": odd}
    assert evaluate(by_object, DEFAULT) == evaluate(by_copy, DEFAULT)


def test_config_from_toml_dict() -> None:
    cfg = from_dict({"policy": {"severity": {"unknown-node": "refuse"}, "min_nodes": 2}})
    v = evaluate({"n1": fingerprint("n1"), "n2": None}, cfg.policy)
    assert v.decision == "refuse"


def test_verdict_round_trip_and_formats() -> None:
    fps = same("n1 n2 n4") | {
        "n3": fingerprint("n3", libs=[libnccl("2.18.3")], driver="535.104.05"),
        "n5": None,
    }
    v = evaluate(fps, DEFAULT, partition="gpu")
    d = json.loads(json.dumps(v.to_dict()))
    assert Verdict.from_dict(d) == v
    assert d["odd_nodes"] == "n3" and d["nodes"] == "n[1-5]" and d["node_count"] == 5
    text = v.format_text()
    assert text.splitlines()[0] == "ncclguard: refuse (5 nodes: n[1-5]; partition gpu)"
    assert "      nccl 2.18.3: n3 (1)" in text
    assert "  warn unknown-node: " in text
    assert v.findings[0].hosts() == ["n1", "n2", "n3", "n4"]


def test_summary_is_capped() -> None:
    fps = {f"n{i}": fingerprint(f"n{i}", conf={f"NCCL_X{i}": "1"}) for i in range(1, 40, 2)}
    fps |= {f"n{i}": fingerprint(f"n{i}", nccl="2.18.3") for i in range(2, 40, 2)}
    s = evaluate(fps, DEFAULT).summary()
    assert s.startswith("ncclguard: refuse, odd ") and len(s) <= SUMMARY_MAX
    assert s.endswith("…")
