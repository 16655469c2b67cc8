"""Property tests: the odd-node set is minimal, and the verdict ignores node order."""

from __future__ import annotations

import itertools

from helpers.properties import CONFIGS, allocations, kind_fingerprint
from hypothesis import given, settings
from hypothesis import strategies as st

from ncclguard.config import PolicyConfig
from ncclguard.policy import evaluate, evaluate_values, majority, node_values


def _refuses(fps: dict, config: PolicyConfig, stale: set[str]) -> bool:
    v = evaluate(fps, config, stale=stale & set(fps))
    return any(f.severity == "refuse" for f in v.findings)


@settings(max_examples=150, deadline=None)
@given(allocations, st.sampled_from(sorted(CONFIGS)), st.sets(st.sampled_from(["n1", "n2"])))
def test_odd_nodes_are_a_minimum(nodes: dict, config_name: str, stale: set[str]) -> None:
    config = CONFIGS[config_name]
    fps = {h: (kind_fingerprint(k) if k is not None else None) for h, k in nodes.items()}
    verdict = evaluate(fps, config, stale=stale & set(fps))
    odd = set(verdict.odd_nodes)
    assert odd <= set(fps)
    if verdict.decision != "refuse":
        assert odd == set()
        return
    # removing them leaves no refuse-level finding
    rest = {h: fp for h, fp in fps.items() if h not in odd}
    assert not _refuses(rest, config, stale)
    # and no smaller set does
    for size in range(len(odd)):
        for removed in itertools.combinations(sorted(fps), size):
            keep = {h: fp for h, fp in fps.items() if h not in removed}
            assert _refuses(keep, config, stale), f"removing {removed} is enough, not {odd}"


@settings(max_examples=150, deadline=None)
@given(allocations.flatmap(lambda d: st.tuples(st.just(d), st.permutations(sorted(d)))),
       st.sampled_from(sorted(CONFIGS)))
def test_verdict_does_not_depend_on_node_order(case: tuple, config_name: str) -> None:
    nodes, order = case
    config = CONFIGS[config_name]
    fps = {h: (kind_fingerprint(k) if k is not None else None) for h, k in nodes.items()}
    shuffled = {h: fps[h] for h in order}
    a = evaluate(fps, config, stale={"n1"} & set(fps))
    b = evaluate(shuffled, config, stale={"n1"} & set(fps))
    assert a.to_dict() == b.to_dict()
    assert a.format_text() == b.format_text()
    # the precomputed per-node records give the same verdict
    records = {h: (node_values(fp) if fp is not None else None) for h, fp in shuffled.items()}
    c = evaluate_values(records, config, stale={"n1"} & set(fps))
    assert c.to_dict() == a.to_dict()


def _minimum_odd_sets(fps: dict, config: PolicyConfig, stale: set[str]) -> list[set[str]]:
    """Every smallest set of hosts whose removal leaves no refuse-level finding (brute force)."""
    if not _refuses(fps, config, stale):
        return [set()]
    for size in range(1, len(fps) + 1):
        found = [
            set(removed)
            for removed in itertools.combinations(sorted(fps), size)
            if not _refuses({h: fp for h, fp in fps.items() if h not in removed}, config, stale)
        ]
        if found:
            return found
    raise AssertionError("removing every node must leave nothing to refuse")


@settings(max_examples=150, deadline=None)
@given(
    allocations,
    st.sampled_from(sorted(CONFIGS)),
    st.sets(st.sampled_from(["n1", "n2"])),
    st.sets(st.sampled_from([f"n{i}" for i in range(1, 9)])),
)
def test_odd_nodes_keep_preferred_hosts_when_a_minimum_allows(
    nodes: dict, config_name: str, stale: set[str], prefer: set[str]
) -> None:
    config = CONFIGS[config_name]
    fps = {h: (kind_fingerprint(k) if k is not None else None) for h, k in nodes.items()}
    stale &= set(fps)
    verdict = evaluate(fps, config, stale=stale, prefer=prefer)
    odd = set(verdict.odd_nodes)
    if verdict.decision != "refuse":
        assert odd == set() and not verdict.odd_tie
        return
    minimum = _minimum_odd_sets(fps, config, stale)
    # still a minimum
    assert odd in minimum, f"{odd} is not one of the minimum odd sets {minimum}"
    # and among the minimum sets, none keeps more of the preferred hosts
    kept_preferred = len(prefer & (set(fps) - odd))
    assert kept_preferred == max(len(prefer & (set(fps) - m)) for m in minimum)
    # odd_tie says whether there was a choice
    assert verdict.odd_tie == (len(minimum) > 1)
    # without a preference the answer is the same set or another minimum one
    plain = evaluate(fps, config, stale=stale)
    assert set(plain.odd_nodes) in minimum and plain.odd_tie == verdict.odd_tie


def test_tie_break_keeps_the_preferred_node() -> None:
    """n3 (2.18.3) + n4 (2.21.5): either is a minimum; the partition's majority decides."""
    fps = {"n3": kind_fingerprint(("2.18.3", "0", None, None)),
           "n4": kind_fingerprint(("2.21.5", "0", None, None))}
    config = CONFIGS["default"]
    plain = evaluate(fps, config)
    assert plain.decision == "refuse" and plain.odd_tie
    assert plain.odd_nodes == ["n4"]  # name order alone keeps n3
    assert evaluate(fps, config, prefer={"n4", "n1"}).odd_nodes == ["n3"]
    assert evaluate(fps, config, prefer={"n3"}).odd_nodes == ["n4"]
    # no tie: the preference cannot make the odd set larger
    fps["n5"] = fps["n4"]
    v = evaluate(fps, config, prefer={"n3"})
    assert v.odd_nodes == ["n3"] and not v.odd_tie


def test_majority_is_the_one_largest_group() -> None:
    assert majority([["n1", "n2", "n4"], ["n3"]]) == {"n1", "n2", "n4"}
    assert majority([["n3"], ["n1", "n2"]]) == {"n1", "n2"}
    assert majority([["n1"], ["n2"], ["n3", "n4"], ["n5", "n6"]]) == set()  # a tie: none
    assert majority([]) == set()
