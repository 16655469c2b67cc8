"""Decisions that several commands need, each made in one place and used by every caller:
the baseline class, the tie-break for odd nodes and the count of active RDMA ports (the
time parser: test_timeparse.py and test_cli_commands.py). Each had drifted apart before."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import helpers.fingerprints as pf
import pytest
from click.testing import Result
from helpers.cli import run_cli
from helpers.inventory import NodeSpec, base_fingerprint, build

from ncclguard.config import Config, DrainConfig, PolicyConfig
from ncclguard.fingerprint.fields import active_ports
from ncclguard.policy import break_tie, evaluate
from ncclguard.policy.baseline import choose_baseline, pin_diffs
from ncclguard.policy.drain import NodeFacts, recommend, values_judge
from ncclguard.policy.fpdiff import diff

# --------------------------------------------------------------------------- baseline


def _config(pin: dict[str, str] | None = None, majority: float = 0.5) -> Config:
    return Config(baseline=pin or {}, drain=DrainConfig(majority=majority))


VALUES = {"a": {"nccl": "2.21.5", "transport": "IB"},
          "b": {"nccl": "2.21.5", "transport": "Socket"},
          "c": {"nccl": "2.18.3", "transport": "IB"}}


def test_baseline_pinned_largest_matching_class_ties_by_key() -> None:
    cfg = _config({"nccl": "2.21.5"})
    assert choose_baseline({"a": 2, "b": 2, "c": 5}, VALUES, cfg).key == "a"
    assert choose_baseline({"b": 2, "a": 2, "c": 5}, VALUES, cfg).key == "a"  # any order
    assert choose_baseline({"a": 2, "b": 3, "c": 5}, VALUES, cfg).key == "b"
    none = choose_baseline({"c": 5}, VALUES, cfg)
    assert none.key is None and none.why == "pinned in [baseline]: no class matches"
    # a class whose nodes are all stale (no count) is no candidate
    assert choose_baseline({"a": 0, "b": 1, "c": 5}, VALUES, cfg).key == "b"


def test_baseline_majority_needs_more_than_the_share_and_ties_by_key() -> None:
    half = choose_baseline({"a": 2, "b": 2}, VALUES, _config())
    assert half.key is None
    assert half.why.startswith("no clear majority: the largest class holds 50%")
    assert choose_baseline({"b": 2, "a": 2}, VALUES, _config(majority=0.4)).key == "a"
    won = choose_baseline({"a": 1, "c": 3}, VALUES, _config())
    assert (won.key, won.why, won.size, won.total) == ("c", "majority (75%)", 3, 4)
    assert choose_baseline({}, VALUES, _config()).why == "no nodes"


def test_pin_diffs_counts_refuse_rules_only_and_never_unknown() -> None:
    pin = {"nccl": "2.21.5", "transport": "IB"}
    assert pin_diffs({"nccl": "2.18.3", "transport": None}, pin) == [
        ("nccl-version", "nccl 2.18.3 (pinned 2.21.5)")]
    lenient = Config(baseline=pin, policy=PolicyConfig(severity={"nccl-version": "warn"}))
    assert pin_diffs({"nccl": "2.18.3", "transport": "IB"}, pin, lenient) == []


def _cli(db: Path, tmp_path: Path, config: str, *args: str) -> Result:
    cfg = tmp_path / "config.toml"
    cfg.write_text(config)
    return run_cli("--json", *args, db=db, config=cfg)


@pytest.mark.parametrize(
    "config", ['[baseline]\nnccl = "2.21.5"\n', "[drain]\nmajority = 0.4\nmax_share = 1.0\n"]
)
def test_classes_and_drain_recommend_name_the_same_baseline(tmp_path: Path, config: str) -> None:
    """Two equal classes that both qualify (both match the pin; or each holds 50%, more
    than drain.majority): ``classes`` used to mark one and ``drain-recommend`` the other."""
    specs = {"n1": NodeSpec(), "n2": NodeSpec(),
             "n3": NodeSpec(plugin=False), "n4": NodeSpec(plugin=False)}
    db = build(tmp_path / "inv.db", specs)
    classes = json.loads(_cli(db, tmp_path, config, "classes").stdout)
    plan = json.loads(_cli(db, tmp_path, config, "drain-recommend", "--nodes", "n[1-4]").stdout)
    names = sorted(c["class"] for c in classes["classes"])
    assert len(names) == 2
    assert classes["baseline"]["class"] == names[0]
    assert plan["node_sets"][0]["baseline"]["class"] == names[0]


# --------------------------------------------------------------------------- tie-break


def _tie() -> dict[str, Any]:
    return {"n3": pf.fingerprint("n3", nccl="2.18.3"), "n4": pf.fingerprint("n4")}


def test_break_tie_keeps_the_partitions_majority_else_the_inventorys() -> None:
    fps, cfg = _tie(), PolicyConfig()
    verdict = evaluate(fps, cfg, partition="a,b")
    assert verdict.odd_tie and verdict.odd_nodes == ["n4"]  # by name
    asked: list[Any] = []

    def classes(among: list[str] | None) -> list[list[str]]:
        asked.append(among)
        return [["n4", "n5", "n6"], ["n3"]]

    def again(prefer: Any) -> Any:
        return evaluate(fps, cfg, partition="a,b", prefer=prefer)

    kept, why = break_tie(verdict, again, classes, lambda names: ["n3", "n4", "n5", "n6"]
                          if names == {"a", "b"} else [])
    assert kept.odd_nodes == ["n3"] and kept.decision == "refuse"
    assert why == "majority class of partition a,b (3 nodes)"
    assert asked == [["n3", "n4", "n5", "n6"]]
    _, why = break_tie(verdict, again, classes, lambda names: [])
    assert why == "majority class of the inventory (3 nodes)" and asked[-1] is None
    _, why = break_tie(verdict, again, lambda among: [["n3"], ["n4"]])
    assert why == "none (no single largest class in the inventory)"


def test_break_tie_without_a_tie_reads_nothing() -> None:
    fps = {**_tie(), "n5": pf.fingerprint("n5")}
    verdict = evaluate(fps, PolicyConfig())
    assert not verdict.odd_tie

    def never(among: list[str] | None) -> list[list[str]]:
        raise AssertionError("no tie: no look-up")

    assert break_tie(verdict, lambda prefer: verdict, never) == (verdict, None)


def test_check_and_diagnose_break_a_tie_alike(tmp_path: Path) -> None:
    """n3 (2.18.3) with n4: a tie that the inventory's majority class (n4..n6) decides."""
    specs = {"n3": NodeSpec(nccl="2.18.3"), "n4": NodeSpec(), "n5": NodeSpec(), "n6": NodeSpec()}
    db = build(tmp_path / "inv.db", specs)
    r = _cli(db, tmp_path, "", "check", "n[3-4]")
    assert r.exit_code == 2 and json.loads(r.stdout)["odd_nodes"] == "n3"
    log = Path(__file__).parent / "diagnose_logs" / "clean-4-hosts.log"
    r = _cli(db, tmp_path, "", "diagnose", str(log), "--nodes", "n[3-4]", "--at", "0s")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["inventory"]["verdict"]["odd_nodes"] == "n3"


# --------------------------------------------------------------------------- active ports


def _unknown_port_state(host: str) -> dict[str, Any]:
    """Four ports: two ACTIVE, one DOWN, and one whose state could not be read."""
    fp = base_fingerprint(host, NodeSpec(ports_up=3))
    port = fp["rdma"]["devices"][1]["ports"][0]
    port.update(state=None, state_code=None)
    fp["errors"].append(pf.error("rdma.devices.mlx5_1.ports.1.state"))
    return fp


def test_active_ports_counts_state_or_code_and_never_counts_unknown_as_down() -> None:
    fp = base_fingerprint("n1", NodeSpec(ports_up=3))
    assert active_ports(fp) == 3
    by_code = copy.deepcopy(fp)
    by_code["rdma"]["devices"][0]["ports"][0]["state"] = "4: ACTIVE"  # the code decides
    assert active_ports(by_code) == 3
    assert active_ports(_unknown_port_state("n1")) is None
    failed = copy.deepcopy(fp)
    failed["errors"].append(pf.error("rdma", probe="rdma"))
    assert active_ports(failed) is None  # the whole rdma probe failed
    assert active_ports({**fp, "rdma": {"devices": []}}) == 0


def test_store_diff_and_drain_read_one_active_port_count(tmp_path: Path) -> None:
    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    db = tmp_path / "inv.db"
    base = {f"n{i}": base_fingerprint(f"n{i}", NodeSpec()) for i in range(1, 5)}
    with Inventory(db, values=GATE_VALUES) as inv:
        for fp in [*base.values(), _unknown_port_state("n5")]:
            inv.upsert(fp)
        rows = {r["host"]: r for r in inv.nodes()}
    assert rows["n5"]["rdma_ports_up"] is None and rows["n1"]["rdma_ports_up"] == 4
    assert json.loads(_cli(db, tmp_path, "", "nodes").stdout)["nodes"][4]["rdma_ports_up"] is None
    cfg_path = tmp_path / "plain.toml"
    cfg_path.write_text("")
    text = run_cli("nodes", db=db, config=cfg_path).stdout
    row = next(ln for ln in text.splitlines() if ln.startswith("n5 ")).split()
    assert row[6] == "?/4", row  # HOST NCCL PLUGIN ABI ADDS TRANSPORT RDMA
    d = diff({"n1": base["n1"], "n5": _unknown_port_state("n5")})
    assert "rdma.active_ports" in {u.field for u in d.unknown}
    assert "rdma.active_ports" not in {x.field for x in d.differences}
    r = _cli(db, tmp_path, "", "drain-recommend", "--nodes", "n[1-5]")
    plan = json.loads(r.stdout)
    assert plan["drain"] == {}, plan  # unknown is not "ports down"
    # and the plan's pure function agrees, given the facts from the store's column
    facts = {h: NodeFacts(h, "k", {}, 1e12, rows[h]["rdma_ports_up"], 4) for h in rows}
    cfg = Config()
    plan2 = recommend({"s": list(rows)}, facts, values_judge({"k": {}}, cfg), cfg, now=1e12)
    assert plan2.drains() == {}
