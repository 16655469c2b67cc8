"""Scheduling classes (ncclguard.policy.schedule), the lua's file of classes
(ncclguard.sched.classfile) and the sync plan (ncclguard.sched.sync), without Slurm.
The real slurmctld with the shipped job_submit.lua: tests/test_sched_slurm.py; the
file's image lines: tests/test_sched_images.py."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
from helpers.fingerprints import fingerprint
from helpers.properties import CONFIGS, allocations, kind_fingerprint
from hypothesis import given, settings
from hypothesis import strategies as st

from ncclguard.config import Config, FeaturesConfig, PolicyConfig
from ncclguard.policy import evaluate_values, node_values
from ncclguard.policy.schedule import (
    FEATURE_PREFIX,
    MAX_ALTERNATIVES,
    UNKNOWN_FEATURE,
    ClassCount,
    feature_names,
    rank_classes,
    scheduling_classes,
)
from ncclguard.sched import classfile, group, sync
from ncclguard.sched.sync import Plan, SyncResult, Update, class_table, plan
from ncclguard.slurm import NodeInfo, SlurmError, SlurmTimeout
from prolog.job import Job


def _values(fps: dict) -> dict:
    return {h: (node_values(fp) if fp is not None else None) for h, fp in fps.items()}


# ----------------------------------------------------------------- classes
def test_one_feature_per_refuse_level_class() -> None:
    fps = {
        "n1": fingerprint("n1", nccl="2.21.5"),
        "n2": fingerprint("n2", nccl="2.21.5", driver="535.1"),  # gpu-driver: warn only
        "n3": fingerprint("n3", nccl="2.18.3"),  # nccl-version: refuse
        "n4": None,
    }
    cls = scheduling_classes(_values(fps), PolicyConfig())
    assert cls["n1"] == cls["n2"] and cls["n1"] != cls["n3"]
    assert re.fullmatch(r"nc_[0-9a-f]{8}", cls["n1"] or "")
    assert cls["n4"] == UNKNOWN_FEATURE  # unknown-node is warn by default
    strict = PolicyConfig(severity={"unknown-node": "refuse", "gpu-driver": "refuse"})
    cls = scheduling_classes(_values(fps), strict, stale=["n2"])
    assert cls["n4"] is None and cls["n2"] is None  # refuse: no class, never scheduled
    # the feature is a digest of what the rules read, not of the host: stable per class
    again = scheduling_classes(_values({"x": fingerprint("x", nccl="2.18.3")}), PolicyConfig())
    assert again["x"] == scheduling_classes(_values(fps), PolicyConfig())["n3"]


def test_a_stale_node_keeps_the_class_of_its_last_record_when_unknown_node_warns() -> None:
    fps = {"n1": fingerprint("n1"), "n2": fingerprint("n2", nccl="2.18.3")}
    cls = scheduling_classes(_values(fps), PolicyConfig(), stale=["n1", "n2"])
    assert cls["n1"] != cls["n2"] and None not in cls.values()


@settings(max_examples=200, deadline=None)
@given(allocations, st.sampled_from(sorted(CONFIGS)), st.sets(st.sampled_from(["n1", "n2"])))
def test_nodes_that_share_a_feature_are_never_refused_by_the_gate(
    nodes: dict, config_name: str, stale: set[str]
) -> None:
    """The invariant prevention rests on: any set of nodes with one class feature passes
    the gate's own evaluation without a refuse-level finding."""
    config = CONFIGS[config_name]
    fps = {h: (kind_fingerprint(k) if k is not None else None) for h, k in nodes.items()}
    values = _values(fps)
    stale &= set(fps)
    cls = scheduling_classes(values, config, stale)
    for feature in {f for f in cls.values() if f}:
        members = {h: values[h] for h, f in cls.items() if f == feature}
        v = evaluate_values(members, config, stale & set(members))
        assert not [f for f in v.findings if f.severity == "refuse"], (feature, members)


# warn-level differences too (gpu-driver, nccl-conf's algo) and a refuse-level one
# (nccl-version): a class must split on the second kind only
_DRIVER = st.sampled_from(["550.54.15", "535.104.05", None])
_NODE = st.one_of(st.none(), st.tuples(st.sampled_from(["2.21.5", "2.18.3"]), _DRIVER,
                                       st.sampled_from([None, "Ring", "Tree"])))


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from([f"n{i}" for i in range(1, 9)]), _NODE, min_size=1,
                       max_size=8),
       st.sampled_from(sorted(CONFIGS)))
def test_warn_level_differences_never_split_a_class(nodes: dict, config_name: str) -> None:
    config = CONFIGS[config_name]
    fps = {h: (fingerprint(h, nccl=k[0], driver=k[1], conf={"NCCL_ALGO": k[2]} if k[2] else {})
               if k is not None else None) for h, k in nodes.items()}
    values = _values(fps)
    cls = scheduling_classes(values, config)

    def refused(k: tuple) -> tuple:  # what refuse-level rules see ("strict": nccl-conf too)
        return (k[0], k[2]) if config_name == "strict" else (k[0],)

    known = {h: k for h, k in nodes.items() if k is not None}
    for h, k in known.items():
        for g, j in known.items():  # one class exactly when the refuse-level values agree
            assert (cls[h] == cls[g]) == (refused(k) == refused(j)), (h, k, g, j)
    for feature in {f for f in cls.values() if f}:
        members = {h: values[h] for h, f in cls.items() if f == feature}
        v = evaluate_values(members, config)
        assert not [f for f in v.findings if f.severity == "refuse"]


def test_feature_names_grow_until_unique() -> None:
    a, b, c = "abcdef0123" + "0" * 54, "abcdef0124" + "0" * 54, "ffffffff" + "1" * 56
    names = feature_names([a, b, c])
    assert names[a] == FEATURE_PREFIX + "abcdef0123" and names[b] == FEATURE_PREFIX + "abcdef0124"
    assert names[c] == FEATURE_PREFIX + "ffffffff"


def test_rank_largest_first_unknown_last_small_dropped_and_capped() -> None:
    features = {f"h{i}": "nc_aaaaaaaa" for i in range(3)}
    features |= {f"k{i}": "nc_bbbbbbbb" for i in range(5)}
    features |= {f"u{i}": UNKNOWN_FEATURE for i in range(9)}
    features |= {"lonely": "nc_cccccccc", "none": None}
    assert rank_classes(features) == [ClassCount("nc_bbbbbbbb", 5), ClassCount("nc_aaaaaaaa", 3),
                                      ClassCount(UNKNOWN_FEATURE, 9)]
    assert rank_classes(features, ["h0", "h1", "k0"]) == [ClassCount("nc_aaaaaaaa", 2)]
    many = {f"n{i}{j}": f"nc_{i:08x}" for i in range(70) for j in range(2)}
    assert len(rank_classes(many)) == MAX_ALTERNATIVES
    assert len(rank_classes(many, limit=5)) == 5


# --------------------------------------------------------------- the file
def _cf(**kw: object) -> classfile.ClassFile:
    base: dict = dict(verified=1_700_000_000, partitions={
        "*": (ClassCount("nc_0123abcd", 4), ClassCount("nc_unknown", 2)),
        "gpu": (ClassCount("nc_0123abcd", 4),)})
    return classfile.ClassFile(**(base | kw))  # type: ignore[arg-type]


def test_file_round_trip() -> None:
    cf = _cf(guarded=("gpu", "a100"), opt_out=False, max_alternatives=8, default="gpu")
    assert classfile.parse(classfile.render(cf).decode()) == cf
    with pytest.raises(classfile.ClassFileError, match="not a partition name"):
        classfile.render(_cf(guarded=("gpu+a100",)))  # the lua could never match it


@pytest.mark.parametrize(("text", "cause"), [
    ("", "cut short"),
    ("\n", "line 1"),
    ("ncclguard-classes 1\nverified 1\nend\n", "line 1"),
    ("ncclguard-classes 4\nend\n", "line 2"),
    ("ncclguard-classes 4\nmin_nodes 2\nverified 1\nend\n", "line 2"),
    ("ncclguard-classes 4\nverified 1\nmin_nodes 2\nmax_alternatives 64\nopt_out 1\n"
     "required_nodes refuse\nguarded *\n", "no 'end'"),
    ("ncclguard-classes 4\nverified x\nend\n", "line 2"),
    ("ncclguard-classes 4\nverified 1\nverified 2\nend\n", "line 3"),
    ("ncclguard-classes 4\nverified 1\nmin_nodes 2\nmax_alternatives 65\nopt_out 1\n"
     "required_nodes refuse\nguarded *\nend\n", "max_alternatives 65"),
    ("ncclguard-classes 4\nverified 1\nmin_nodes 2\nmax_alternatives 64\nopt_out 1\n"
     "guarded *\npartition * nc_x]:3\nend\n", "not a class"),
    ("ncclguard-classes 4\nverified 1\nmin_nodes 2\nmax_alternatives 64\nopt_out 1\n"
     "guarded *\npartition a;b nc_0123abcd:3\nend\n", "partition"),
    ("ncclguard-classes 4\nverified 1\nmin_nodes 2\nmax_alternatives 64\nopt_out 1\n"
     "guarded *\nend\nmore\n", "after 'end'"),
    ("ncclguard-classes 4\nverified 1\nend\n", "missing min_nodes"),
    ("ncclguard-classes 4\nverified \u00b2\nend\n", "line 2"),  # isdigit() says yes
    ("ncclguard-classes 4\nverified 1\nmin_nodes 2\nmax_alternatives 64\nopt_out 1\n"
     "guarded *\nend", "cut short"),  # the lua needs the final newline too
])
def test_a_bad_file_is_refused_with_the_line(text: str, cause: str) -> None:
    with pytest.raises(classfile.ClassFileError, match=re.escape(cause)):
        classfile.parse(text, "f")


def test_write_is_atomic_and_refuses_a_directory_others_can_write(tmp_path: Path) -> None:
    target = tmp_path / "sched" / "classes"
    classfile.write(target, _cf())
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o644
    assert classfile.read(target) == _cf()
    assert sorted(p.name for p in target.parent.iterdir()) == ["classes"]
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(classfile.ClassFileError, match="writable by everyone"):
        classfile.write(open_dir / "classes", _cf())
    assert not (open_dir / "classes").exists()


def test_the_group_format_knows_the_class_feature_prefix() -> None:
    assert group.is_class_feature_name(FEATURE_PREFIX + "0123abcd")
    assert group.is_class_feature_name(UNKNOWN_FEATURE)


# ------------------------------------------------------------------ the plan
def _node(name: str, feats: tuple[str, ...] = (), parts: tuple[str, ...] = ("debug",),
          active: tuple[str, ...] | None = None) -> NodeInfo:
    return NodeInfo(name=name, state="idle", features=feats,
                    active_features=feats if active is None else active, partitions=parts)


def test_plan_merges_own_features_and_changes_only_what_differs() -> None:
    nodes = [
        _node("n1", ("gpu", "nc_aaaaaaaa")),  # right already
        _node("n2", ("gpu",)),  # lacks its class
        _node("n3", ("nc_bbbbbbbb",)),  # wrong class
        _node("n4", ("ssd", "nc_aaaaaaaa")),  # excluded now: loses the class, keeps ssd
        _node("n5", ("gpu", "nc_dddddddd"), active=("nc_dddddddd",)),  # gpu not active
    ]
    want = {"n1": "nc_aaaaaaaa", "n2": "nc_aaaaaaaa", "n3": "nc_aaaaaaaa", "n4": None,
            "n5": "nc_aaaaaaaa"}
    p = plan(nodes, want)
    calls = {u.hosts: (u.available, u.active) for u in p.updates}
    assert calls == {
        ("n2",): (("gpu", "nc_aaaaaaaa"), ("gpu", "nc_aaaaaaaa")),
        ("n3",): (("nc_aaaaaaaa",), ("nc_aaaaaaaa",)),
        ("n4",): (("ssd",), ("ssd",)),
        ("n5",): (("gpu", "nc_aaaaaaaa"), ("nc_aaaaaaaa",)),
    }
    assert p.changed_hosts == ["n2", "n3", "n4", "n5"]
    same = [_node(f"m{i}", ("nc_aaaaaaaa",)) for i in range(3)] + [_node("m9")]
    p = plan(same, {"m0": "nc_bbbbbbbb", "m1": "nc_bbbbbbbb", "m2": "nc_bbbbbbbb",
                    "m9": "nc_bbbbbbbb"})
    assert [u.hosts for u in p.updates] == [("m0", "m1", "m2", "m9")]  # one call per list


def test_class_table_per_partition() -> None:
    nodes = [_node(f"a{i}", parts=("gpu", "all")) for i in range(4)]
    nodes += [_node(f"b{i}", parts=("all",)) for i in range(3)]
    classes = {n.name: ("nc_aaaaaaaa" if n.name[0] == "a" else "nc_bbbbbbbb") for n in nodes}
    cfg = Config(policy=PolicyConfig(partitions=("gpu",), min_nodes=3))
    cf = class_table(cfg, nodes, classes, verified=5.0)
    assert cf.partitions["*"] == (ClassCount("nc_aaaaaaaa", 4), ClassCount("nc_bbbbbbbb", 3))
    assert cf.partitions["gpu"] == (ClassCount("nc_aaaaaaaa", 4),)
    assert cf.guarded == ("gpu",) and cf.min_nodes == 3 and cf.verified == 5


# ------------------------------------------------------------------- the gate
@pytest.mark.parametrize(("constraint", "group"), [
    ("[nc_0123abcd|nc_unknown]", True),
    ("(gpu)&[nc_0123abcd|nc_99aa00bb]", True),
    ("[a|b]", False),
    ("nc_0123abcd", False),
    ("", False),
    ("[nc_0123abcd|x]", False),
])
def test_the_gate_knows_a_class_group(constraint: str, group: bool) -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_JOB_CONSTRAINTS": constraint}
    assert Job.from_env(env).class_group is group


def test_the_gates_shortcut_knows_the_feature_prefix() -> None:
    """``Job.class_group`` skips the group's parser when no class feature is named (the
    gate's accept path): built from FEATURE_PREFIX, a group is still seen."""
    names = [f"{FEATURE_PREFIX}{h}" for h in ("0123abcd", "99aa00bb")]
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_JOB_CONSTRAINTS": f"[{'|'.join(names)}]"}
    assert Job.from_env(env).class_group is True


def test_a_fifo_at_the_sync_lock_is_refused_at_once(tmp_path: Path) -> None:
    from ncclguard.sched.sync import mark_verified

    classes = tmp_path / "features" / "classes"
    classes.parent.mkdir()
    os.mkfifo(f"{classes}.lock")
    cfg = Config(features=FeaturesConfig(classes_file=str(classes)))
    with pytest.raises(classfile.ClassFileError, match="lock: not a regular file"):
        mark_verified(cfg)


class _Refusing:
    """``set_features`` as Slurm answers it: refused for a call naming a bad node (what
    slurmctld says of a node it does not know), or timed out; every call recorded."""

    def __init__(self, bad: set[str], timeout: bool = False) -> None:
        self.bad, self.timeout = bad, timeout
        self.calls: list[tuple[str, ...]] = []

    def set_features(self, hosts: tuple[str, ...], available: tuple[str, ...],
                     active: tuple[str, ...]) -> None:
        self.calls.append(tuple(hosts))
        if self.timeout:
            raise SlurmTimeout("scontrol update NodeName=...: timed out after 10.0s")
        if self.bad & set(hosts):
            raise SlurmError("scontrol update NodeName=...: exit 1: ...", [], 1,
                             "slurm_update error: Invalid node name specified")


def _narrowed(bad: set[str], hosts: tuple[str, ...], timeout: bool = False
              ) -> tuple[_Refusing, SyncResult]:
    s = _Refusing(bad, timeout)
    res = SyncResult(Plan({}, [], []))
    sync._apply(s, Update(hosts, ("nc_1",), ("nc_1",)), res,  # type: ignore[arg-type]
                [sync.SPLIT_CALLS])
    return s, res


def test_a_refused_call_is_narrowed_down_in_halves_within_its_budget() -> None:
    """One node Slurm refuses among 16,384 of one call: found within the pass in 2 calls
    per halving (29 in all), every other node applied, the refusal in Slurm's words. A
    time-out is not narrowed down (one call). Many refused nodes: the calls stay within
    the pass's budget, and no refused node is counted as applied."""
    hosts = tuple(f"gpu{i:05d}" for i in range(1, 16385))
    s, res = _narrowed({"gpu07777"}, hosts)
    assert [(u.hosts, why) for u, why in res.failed] == [
        (("gpu07777",), "slurm_update error: Invalid node name specified")]
    assert sorted(h for u in res.applied for h in u.hosts) == [h for h in hosts if h != "gpu07777"]
    assert len(s.calls) == 1 + 2 * 14
    s, res = _narrowed(set(), hosts, timeout=True)
    assert len(s.calls) == 1 and [u.hosts for u, _ in res.failed] == [hosts]
    bad = set(hosts[::100])
    s, res = _narrowed(bad, hosts)
    assert len(s.calls) <= 1 + sync.SPLIT_CALLS
    assert bad <= {h for u, _ in res.failed for h in u.hosts}
    assert not bad & {h for u in res.applied for h in u.hosts}
