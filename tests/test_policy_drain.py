"""The drain recommendation as a pure function: baseline, reasons, and the two safety rails."""

from __future__ import annotations

from ncclguard import config as configmod
from ncclguard.hostlist import compress
from ncclguard.policy.drain import (
    NodeFacts,
    outcome,
    plan_apply,
    plan_resume,
    recommend,
    values_judge,
)
from ncclguard.slurm import NodeInfo

NOW = 1_800_000_000.0

V_NEW = {"nccl": "2.21.5", "net_plugin": "IBext_v8", "net_abi": 8, "transport": "IB"}
V_OLD = {**V_NEW, "nccl": "2.18.3"}
V_SOCK = {**V_NEW, "transport": "Socket"}
CLASSES = {"new": V_NEW, "old": V_OLD, "sock": V_SOCK}


def facts(spec: dict[str, str], ports: dict[str, int | None] | None = None,
          beat: dict[str, float | None] | None = None) -> dict[str, NodeFacts]:
    ports = ports or {}
    beat = beat or {}
    return {
        h: NodeFacts(host=h, klass=k, values=CLASSES[k],
                     last_heartbeat=beat.get(h, NOW - 10), ports_up=ports.get(h, 8),
                     ports_total=8)
        for h, k in spec.items()
    }


def cfg(**drain: float) -> configmod.Config:
    return configmod.from_dict({"drain": drain} if drain else {})


def run(spec: dict[str, str], config: configmod.Config | None = None, force: bool = False,
        node_set: list[str] | None = None, **kw: object):
    config = config or cfg(max_share=0.5)
    f = facts(spec, **kw)  # type: ignore[arg-type]
    return recommend({"p": node_set or list(spec)}, f, values_judge(CLASSES, config), config,
                     now=NOW, force=force)


def nodes(n: int, start: int = 1) -> list[str]:
    return [f"n{i:02d}" for i in range(start, start + n)]


def test_odd_class_is_recommended_with_values_in_reason() -> None:
    spec = {h: "new" for h in nodes(9)} | {"n10": "old"}
    plan = run(spec)
    sp = plan.sets[0]
    assert sp.baseline and sp.baseline["values"]["nccl"] == "2.21.5"
    assert sp.baseline["count"] == 9 and not sp.baseline["pinned"]
    assert [r.host for r in sp.effective] == ["n10"]
    reason = sp.effective[0].reason
    assert reason.startswith("ncclguard: nccl-version")
    assert "2.18.3" in reason and "2.21.5" in reason
    assert plan.drains() == {"n10": reason}


def test_warn_level_difference_is_not_drained() -> None:
    config = configmod.from_dict({"drain": {"max_share": 0.5},
                                  "policy": {"severity": {"nccl-version": "warn"}}})
    spec = {h: "new" for h in nodes(9)} | {"n10": "old"}
    plan = run(spec, config=config)
    assert plan.drains() == {}


def test_rolling_upgrade_50_50_recommends_nothing_and_says_so() -> None:
    spec = {h: "new" for h in nodes(8)} | {h: "old" for h in nodes(8, start=9)}
    sp = run(spec, config=cfg(max_share=1.0)).sets[0]
    assert sp.no_majority and sp.baseline is None
    assert sp.recommendations == []
    assert sp.note and "no clear majority" in sp.note and "8 of 16" in sp.note


def test_three_way_split_without_majority() -> None:
    spec = ({h: "new" for h in nodes(5)} | {h: "old" for h in nodes(4, start=6)}
            | {h: "sock" for h in nodes(3, start=10)})
    sp = run(spec, config=cfg(max_share=1.0)).sets[0]
    assert sp.no_majority and sp.recommendations == []


def test_cap_withholds_and_force_overrides() -> None:
    spec = {h: "new" for h in nodes(17)} | {h: "old" for h in nodes(3, start=18)}
    sp = run(spec, config=cfg()).sets[0]  # default 10% of 20 = 2 nodes
    assert sp.cap == 2
    assert sp.capped and sp.effective == []
    assert len(sp.recommendations) == 3  # still shown, as withheld
    assert "--force" in (sp.note or "")
    forced = run(spec, config=cfg(), force=True).sets[0]
    assert not forced.capped
    assert sorted(r.host for r in forced.effective) == ["n18", "n19", "n20"]


def test_cap_allows_exactly_the_share() -> None:
    spec = {h: "new" for h in nodes(18)} | {h: "old" for h in nodes(2, start=19)}
    sp = run(spec, config=cfg()).sets[0]
    assert not sp.capped and len(sp.effective) == 2


def test_stale_and_missing_nodes() -> None:
    spec = {h: "new" for h in nodes(9)}
    plan = run(spec, beat={"n03": NOW - 3600}, node_set=[*nodes(9), "n42"])
    reasons = plan.drains()
    assert reasons["n03"].startswith("ncclguard: no heartbeat since 2027-01-15T")
    assert reasons["n42"].startswith("ncclguard: no heartbeat")
    assert "inventory" in reasons["n42"]
    assert set(reasons) == {"n03", "n42"}


def test_ports_down_against_baseline() -> None:
    spec = {h: "new" for h in nodes(10)}
    plan = run(spec, ports={"n04": 7, "n05": None})  # n05: port state unknown
    assert list(plan.drains()) == ["n04"]
    reason = plan.drains()["n04"]
    assert reason.startswith("ncclguard: RDMA ports down") and "7/8" in reason


def test_pinned_baseline_overrides_the_majority() -> None:
    config = configmod.from_dict({"baseline": {"nccl": "2.21.5"}, "drain": {"max_share": 1.0}})
    spec = {h: "old" for h in nodes(7)} | {h: "new" for h in nodes(3, start=8)}
    sp = run(spec, config=config).sets[0]
    assert sp.baseline and sp.baseline["pinned"] and sp.baseline["values"]["nccl"] == "2.21.5"
    assert sorted(r.host for r in sp.effective) == nodes(7)
    assert "pinned 2.21.5" in sp.effective[0].reason


def test_pinned_baseline_in_a_split_still_judges() -> None:
    config = configmod.from_dict({"baseline": {"nccl": "2.21.5"}, "drain": {"max_share": 0.5}})
    spec = {h: "old" for h in nodes(5)} | {h: "new" for h in nodes(5, start=6)}
    sp = run(spec, config=config).sets[0]
    assert not sp.no_majority and len(sp.effective) == 5


def test_groups_compress() -> None:
    spec = {h: "new" for h in nodes(17)} | {h: "old" for h in nodes(3, start=18)}
    sp = run(spec, config=cfg(), force=True).sets[0]
    d = sp.to_dict(compress)
    assert d["groups"][0]["hosts"] == "n[18-20]" and d["groups"][0]["count"] == 3
    assert d["recommended"] == ["n18", "n19", "n20"] and d["withheld"] == []


def SNode(name: str, state: str, reason: str = "") -> NodeInfo:
    flags = ("DRAIN",) if "DRAIN" in state else ()
    return NodeInfo(name=name, state=state.split("+")[0].lower(), flags=flags, reason=reason)


def test_apply_and_resume_plans_respect_foreign_drains() -> None:
    spec = {h: "new" for h in nodes(8)} | {"n09": "old", "n10": "old"}
    plan = run(spec)
    reason = plan.drains()["n09"]
    slurm = {
        "n09": SNode("n09", "IDLE"),
        "n10": SNode("n10", "IDLE+DRAIN", "bad dimm, ticket 42"),
        "n01": SNode("n01", "IDLE+DRAIN", "ncclguard: no heartbeat since x"),
        "n02": SNode("n02", "IDLE+DRAIN", "maintenance"),
    }
    acts = {a.host: a for a in plan_apply(plan, slurm)}
    assert acts["n09"].action == "drain" and acts["n09"].reason == reason
    assert acts["n10"].action == "skip" and "someone else" in acts["n10"].detail
    res = {a.host: a for a in plan_resume(plan, slurm, list(spec))}
    assert res["n01"].action == "resume"
    assert res["n02"].action == "skip"
    assert "n09" not in res
    # idempotent: once drained with the same reason, nothing more to do
    slurm["n09"] = SNode("n09", "IDLE+DRAIN", reason)
    acts = {a.host: a for a in plan_apply(plan, slurm)}
    assert acts["n09"].action == "skip" and "already" in acts["n09"].detail
    res = {a.host: a for a in plan_resume(plan, slurm, list(spec))}
    assert res["n09"].action == "skip" and "cause still present" in res["n09"].detail


def test_no_resume_without_a_baseline() -> None:
    spec = {h: "new" for h in nodes(5)} | {h: "old" for h in nodes(5, start=6)}
    plan = run(spec)
    slurm = {"n06": SNode("n06", "IDLE+DRAIN", "ncclguard: nccl-version: nccl 2.18.3")}
    res = plan_resume(plan, slurm, list(spec))
    assert [(a.host, a.action) for a in res] == [("n06", "skip")]
    assert "no baseline" in res[0].detail


def test_the_report_after_an_action_is_what_slurm_shows() -> None:
    """Issue 46: after --apply the report said "not drained" for the nodes just drained
    (their state from before); it says what Slurm shows once the actions ran."""
    spec = {h: "new" for h in nodes(8)} | {"n09": "old", "n10": "old"}
    plan = run(spec)
    reason = plan.drains()["n09"]
    before = {"n09": SNode("n09", "IDLE"), "n10": SNode("n10", "IDLE"),
              "n01": SNode("n01", "IDLE+DRAIN", "ncclguard: no heartbeat since x")}
    acts = plan_apply(plan, before) + plan_resume(plan, before, list(spec))
    after = {"n09": SNode("n09", "IDLE+DRAIN", reason), "n10": SNode("n10", "IDLE"),
             "n01": SNode("n01", "IDLE+DRAIN", "ncclguard: no heartbeat since x")}
    got = {a.host: a.detail for a in outcome(acts, after)}
    assert got["n09"] == "drained now"
    assert got["n10"] == "asked to drain, but Slurm shows it not drained"
    assert got["n01"] == "asked to resume, but Slurm shows it still drained"
