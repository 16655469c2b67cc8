"""The second family of class features (issue 40, ``[features] own_nccl``): classes by what
a node gives a job that brings its own NCCL (ncclguard.policy.schedule.adds_key), the
file's ``adds`` and ``env`` lines (ncclguard.sched.classfile, ncclguard.sched.envlines)
and the sync's plan; without Slurm. The lua's side: tests/test_lua_submit.py; the real
slurmctld: tests/test_sched_ownnccl_slurm.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from helpers.fingerprints import fingerprint, plugin
from helpers.properties import CONFIGS
from hypothesis import given, settings
from hypothesis import strategies as st

from ncclguard.config import Config, FeaturesConfig, InventoryConfig, PolicyConfig
from ncclguard.fingerprint.jobenv import env_key, submit_key
from ncclguard.fingerprint.releases import RELEASES
from ncclguard.policy import evaluate_nccl, node_values
from ncclguard.policy.rules import container, jobnccl
from ncclguard.policy.schedule import ClassCount, adds_features, scheduling_classes
from ncclguard.sched import classfile, envlines, imagelines, sync
from ncclguard.slurm import NodeInfo

NET = {r.label: list(r.abis["net"]) for r in RELEASES}


def _node(nccl: str | None = "2.21.5", abis: list[int] | None = (8, 7, 6, 5),  # type: ignore[assignment]
          up: int = 1, **kw: Any) -> dict:
    plugins = [plugin("IBext", abis=list(abis))] if abis else []
    fp = fingerprint("x", nccl=nccl or "2.21.5", plugins=plugins, ports_up=up, offers=True,
                     **kw)
    if nccl is None:
        fp["libnccl"] = []  # a node without a libnccl of its own (a pip cluster)
    return node_values(fp)


def _job(version: str) -> dict:
    return {"nccl_version": version, "net_abis": NET[version], "path": "/venv/libnccl.so.2",
            "source": "VIRTUAL_ENV"}


def test_nodes_that_differ_only_in_their_host_libnccl_share_a_second_family_class() -> None:
    """Two host classes (2.18.3, 2.21.5, and none), one class by what they give a job's
    own NCCL; a node whose plugin offers other ABIs, or whose IB port is down, is a class
    of its own."""
    records = {"n1": _node("2.18.3"), "n2": _node("2.18.3"), "n3": _node("2.21.5"),
               "n4": _node(None), "n5": _node("2.21.5", abis=[10]), "n6": _node(up=0),
               "n7": None}
    host = scheduling_classes(records, PolicyConfig())
    adds = adds_features(records, PolicyConfig())
    assert host["n1"] != host["n3"] != host["n4"]
    assert adds["n1"] == adds["n2"] == adds["n3"] == adds["n4"]
    assert adds["n1"] is not None and adds["n1"].startswith("nc_j") and len(adds["n1"]) == 12
    assert len({adds["n1"], adds["n5"], adds["n6"]}) == 3
    assert adds["n7"] is None  # no record: never offered to such a job
    # and the gate agrees: the four are not refused for a job's own 2.23.4
    four = {h: records[h] for h in ("n1", "n2", "n3", "n4")}
    assert evaluate_nccl(four, PolicyConfig(), _job("2.23.4")).decision == "accept"
    # stale nodes: no class where unknown-node refuses
    strict = PolicyConfig(severity={"unknown-node": "refuse"})
    assert adds_features(records, strict, stale=["n1"])["n1"] is None


_KIND = st.tuples(st.sampled_from(["2.18.3", "2.21.5", None]),
                  st.sampled_from([None, (6, 5), (8, 7, 6, 5), (10,), (12, 11)]),
                  st.sampled_from([0, 1]), st.sampled_from([None, "Ring"]))


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from([f"n{i}" for i in range(1, 9)]), _KIND, min_size=2,
                       max_size=8),
       st.sampled_from(sorted(CONFIGS)), st.sampled_from(["2.18.3", "2.23.4", "2.30.4"]))
def test_a_second_family_class_that_runs_a_jobs_nccl_is_never_refused_for_it(
        nodes: dict, config_name: str, version: str) -> None:
    """The invariant the lua's env groups rest on: for any NCCL a job brings, the classes
    that envlines finds running it (runnable_classes over job_records) are sets of nodes
    the gate accepts that job on, whatever host libnccl each has; and the classes it does
    not run are refused (no line may offer them)."""
    config = CONFIGS[config_name]
    records = {h: _node(k[0], list(k[1]) if k[1] else None, up=k[2],
                        conf={"NCCL_ALGO": k[3]} if k[3] else {}) for h, k in nodes.items()}
    adds = adds_features(records, config)
    job = _job(version)
    image = {"nccl_version": version, "net_abis": sorted(NET[version], reverse=True),
             "plugin": None}
    samples = container.class_samples(records, adds)
    from ncclguard.fingerprint.loading import parse_version
    from ncclguard.fingerprint.offers import release_for

    release = release_for(parse_version(version))  # type: ignore[arg-type]
    seen = {c: list(jobnccl.job_records({str(i): r for i, r in enumerate(recs)},
                                        release).values()) for c, recs in samples.items()}
    able = container.runnable_classes(image, seen)  # type: ignore[arg-type]
    assert able is not None  # one class: one stack, by construction
    for feature in set(adds.values()):
        members = {h: records[h] for h, f in adds.items() if f == feature}
        v = evaluate_nccl(members, config, job)
        refused = [f for f in v.findings if f.severity == "refuse"]
        if feature in able:
            assert not refused, (feature, version, nodes)


def _cf(**kw: Any) -> classfile.ClassFile:
    base: dict = dict(verified=1_700_000_000, partitions={
        "*": (ClassCount("nc_0123abcd", 4), ClassCount("nc_4567abcd", 2))})
    return classfile.ClassFile(**(base | kw))


def test_adds_and_env_lines_round_trip_within_the_files_bounds() -> None:
    adds = {"*": (ClassCount("nc_j0123abcd", 6),), "gpu": (ClassCount("nc_j0123abcd", 2),)}
    key = submit_key({"VIRTUAL_ENV": "/home/a/my venv;x%", "LD_PRELOAD": "/a.so",
                      "NCCL_NET": "IB"})
    assert key == "LD_PRELOAD=/a.so\0VIRTUAL_ENV=/home/a/my venv;x%"
    cf = _cf(adds=adds, envs={key: ("nc_j0123abcd",), "CONDA_PREFIX=/c": ()})
    text = classfile.render(cf).decode()
    written = "LD_PRELOAD=/a.so%00VIRTUAL_ENV=/home/a/my%20venv;x%25"
    assert f"env {written} nc_j0123abcd\n" in text and "adds gpu nc_j0123abcd:2\n" in text
    assert classfile.parse(text) == cf
    # the families stay apart: a host class in an adds or env line, an adds class in a
    # partition line, make the file unusable (as in the lua)
    for bad in (text.replace("adds gpu nc_j0123abcd", "adds gpu nc_0123abcd"),
                text.replace(" nc_j0123abcd\n", " nc_0123abcd\n"),
                text.replace("partition * nc_0123abcd", "partition * nc_j0123abcd"),
                text.replace(f"env {written}", f"env {written}\nenv {written}"),
                text.replace(f"env {written}", "env a%zz"), text.replace(f"env {written}",
                                                                      "env a%4a")):
        with pytest.raises(classfile.ClassFileError):
            classfile.parse(bad)
    # at most MAX_ENVS lines, never past MAX_BYTES, odd keys left out
    many = {f"VIRTUAL_ENV=/v/{n:05d}": ("nc_j0123abcd",) for n in range(400)}
    got = classfile.parse(classfile.render(_cf(adds=adds, envs={
        "caf\xe9": (), "x": ("nc_0123abcd",), **many})).decode()).envs
    assert len(got) == classfile.MAX_ENVS and set(got) <= set(many)
    wide = {f"VIRTUAL_ENV=/v/{n:05d}" + "x" * 4000: tuple(f"nc_j{i:08x}" for i in range(64))
            for n in range(256)}
    data = classfile.render(_cf(adds=adds, envs=wide))
    assert len(data) <= classfile.MAX_BYTES and data.endswith(b"\nend\n")
    assert 0 < len(classfile.parse(data.decode()).envs) < classfile.MAX_ENVS


def test_submit_key_is_none_where_the_lua_builds_none() -> None:
    assert submit_key({"NCCL_NET": "IB"}) is None  # the host's libnccl
    assert submit_key({"VIRTUAL_ENV": "", "PATH": "/bin"}) is None
    assert submit_key({"VIRTUAL_ENV": "/caf\xe9"}) is None
    assert submit_key({"LD_LIBRARY_PATH": "/p" * 2041}) is None  # 4,098 bytes
    assert submit_key({"LD_LIBRARY_PATH": "/p" * 2040}) is not None  # 4,096
    assert submit_key({"LD_PRELOAD": "/a.so", "CONDA_PREFIX": "/c", "NCCL_NET": "IB"}) == \
        "LD_PRELOAD=/a.so\0CONDA_PREFIX=/c"
    for key in ("x", "a b\0c%", "%41"):
        assert classfile.decode_key(classfile.encode_key(key) or "") == key


def _nodes(features: dict[str, tuple[str, ...]]) -> list[NodeInfo]:
    return [NodeInfo(h, "idle", partitions=("debug",), features=f, active_features=f)
            for h, f in features.items()]


def test_plan_gives_each_node_both_classes_and_keeps_its_own_features() -> None:
    nodes = _nodes({"n1": ("gpu", "nc_0123abcd"), "n2": ("gpu", "nc_0123abcd", "nc_j11111111"),
                    "n3": ()})
    classes = {"n1": "nc_0123abcd", "n2": "nc_0123abcd", "n3": "nc_4567abcd"}
    adds = {"n1": "nc_j11111111", "n2": "nc_j11111111", "n3": "nc_j11111111"}
    p = sync.plan(nodes, classes, adds)
    got = {h: u.active for u in p.updates for h in u.hosts}
    assert got == {"n1": ("gpu", "nc_0123abcd", "nc_j11111111"),
                   "n3": ("nc_4567abcd", "nc_j11111111")}  # n2 has them already
    assert p.adds == adds
    # Slurm's view: the host class is the first host-stack feature, whatever the order
    after = _nodes({"n1": ("nc_j11111111", "nc_0123abcd")})
    assert sync.in_slurm(after) == {"n1": "nc_0123abcd"}
    assert sync.adds_in_slurm(after) == {"n1": "nc_j11111111"}
    # own_nccl off: a node's second-family feature is taken away
    p = sync.plan(nodes, classes)
    assert {h: u.active for u in p.updates for h in u.hosts}["n2"] == ("gpu", "nc_0123abcd")


class _Pending:
    def __init__(self, jobs: list[tuple[str, str, str, int]]) -> None:
        self.jobs = jobs
        self.updated: dict[str, str] = {}

    def pending_features(self) -> list[tuple[str, str, str, int]]:
        return self.jobs

    def update_job(self, job: str, **fields: str) -> None:
        self.updated[job] = fields["Features"]


def test_pending_jobs_keep_to_their_family() -> None:
    """A pending job with a group of the second family keeps it while its classes exist
    and fit; one whose class is gone gets the host classes, as the lua gives a job without
    a line (found by review: regrouped over the second family, it could land on a class
    that does not run its NCCL, where the gate refuses it); with own_nccl turned off (no
    adds lines), the host classes too, not a wait for features that are gone."""
    cf = _cf(adds={"*": (ClassCount("nc_j22222222", 6),)})
    slurm = _Pending([("1", "[nc_j22222222]", "debug", 4), ("2", "[nc_j99999999]", "debug", 4),
                      ("3", "[nc_j22222222]", "debug", 7)])
    assert sync.regroup_pending(slurm, cf, []) == [  # type: ignore[arg-type]
        ("2", "[nc_j99999999]", "[nc_0123abcd]")]  # 3: nothing fits 7 nodes, it waits
    off = _Pending([("2", "[nc_j99999999]", "debug", 4)])
    assert sync.regroup_pending(off, _cf(), []) == [  # type: ignore[arg-type]
        ("2", "[nc_j99999999]", "[nc_0123abcd]")]


NOW = 1_800_000_000.0


def _env_row(variables: dict[str, str], version: str | None, **kw: Any) -> dict:
    lib = None if version is None else {"nccl_version": version, "net_abis": NET[version]}
    return {"key": env_key(variables), "vars": variables, "uid": 1000, "source": "VIRTUAL_ENV",
            "path": "/home/a/venv/libnccl.so.2", "why": "", "problems": [], "library": lib,
            "ident": (1, 1, 1), "error": None, "used_at": NOW, **kw}


def test_env_groups_from_a_real_inventory(tmp_path: Path) -> None:
    """n1..n4 (host libnccl 2.18.3 and 2.21.5, one v8..v5 plugin) are one class of the
    second family, n5,n6 (a v10-only plugin) another: a venv of NCCL 2.23.4 (v8..v5) runs
    on the first only, one of 2.30.4 (v12..v6) on both, but the same venv with another
    NCCL_* read as 2.23.4 makes its line the first only; an environment not read, the
    host's, stored cut, the lua builds no key for, or that shares its key with one not
    read has no line."""
    from helpers.fingerprints import offers_part
    from helpers.inventory import NodeSpec, build

    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    def spec(nccl: str, abis: list[int]) -> NodeSpec:
        return NodeSpec(nccl=nccl, plugin=False, extra={
            "plugins": [plugin("IBext", abis=abis)],
            "offers": offers_part(plugin("IBext", abis=abis))})

    specs = {"n1": spec("2.18.3", [8, 7, 6, 5]), "n2": spec("2.18.3", [8, 7, 6, 5]),
             "n3": spec("2.21.5", [8, 7, 6, 5]), "n4": spec("2.21.5", [8, 7, 6, 5]),
             "n5": spec("2.21.5", [10]), "n6": spec("2.21.5", [10])}
    db = build(tmp_path / "inv.db", specs, now=NOW)
    cfg = Config(inventory=InventoryConfig(db=str(db)),
                 features=FeaturesConfig(classes_file=str(tmp_path / "classes"), own_nccl=True))
    old, new = {"VIRTUAL_ENV": "/home/a/old"}, {"VIRTUAL_ENV": "/home/a/new", "NCCL_NET": "IB"}
    long = {"LD_LIBRARY_PATH": "/p" * 9000}
    third = {"VIRTUAL_ENV": "/home/a/third"}
    with Inventory(db, values=GATE_VALUES) as inv:
        inv.write_job_envs([
            _env_row(old, "2.23.4"), _env_row(new, "2.30.4"),
            _env_row({"VIRTUAL_ENV": "/home/a/broken"}, None, error="not read"),
            _env_row({"LD_LIBRARY_PATH": "/usr/local/cuda/lib64"}, None, source="host",
                     path=None),
            _env_row(long, "2.23.4"),
            # rows that differ only in NCCL_*: one key; the classes that run all of them,
            # none where one of them is not judged by its NCCL
            _env_row({"VIRTUAL_ENV": "/home/a/new"}, "2.23.4"),
            _env_row(third, "2.30.4"),
            _env_row({**third, "NCCL_IB_HCA": "mlx5_0"}, None, error="not read")], now=NOW)
        adds = sync.desired_adds(cfg, list(specs), NOW, inv)
        a, b = adds["n1"], adds["n5"]
        assert a is not None and b is not None
        assert adds["n2"] == adds["n3"] == adds["n4"] == a and adds["n6"] == b and a != b
        got = envlines.env_groups(cfg, inv, adds)
    k_old, k_new = submit_key(old), submit_key(new)
    assert k_old is not None and k_new is not None
    assert got == {k_old: (a,), k_new: (a,)}  # 2.30.4 runs on both, 2.23.4 on a only
    assert envlines.env_groups(cfg.replace(features=FeaturesConfig(own_nccl=False)),
                               Inventory(db, readonly=True, values=GATE_VALUES), adds) == {}
    # job-stack at warn: the gate lets such a job run on any class, so does the line
    warn = cfg.replace(policy=PolicyConfig(severity={"job-stack": "warn"}))
    with Inventory(db, readonly=True, values=GATE_VALUES) as inv:
        assert envlines.env_groups(warn, inv, adds)[k_old] == tuple(sorted((a, b)))


def test_one_users_many_environments_do_not_push_anothers_out() -> None:
    """User 1001 used 600 environments since user 1002 used its one: taken in turns by
    uid, 1002's is among the rows the file's lines come from (before: only the 512 most
    recent were looked at, all 1001's)."""
    from ncclguard.sched.envlines import in_turns

    rows = [{"key": f"k{i}", "uid": 1001} for i in range(600)] + [{"key": "mine", "uid": 1002}]
    got = in_turns(rows, 512)
    assert len(got) == 512 and got[:2] == [rows[0], rows[-1]]
    assert [r["key"] for r in got[2:4]] == ["k1", "k2"]
    assert in_turns(rows, 1) == [rows[0]] and in_turns([], 5) == []
    many = [{"key": f"u{u}-{i}", "uid": u} for i in range(3) for u in range(2000)]
    got = in_turns(many, 512)
    assert {r["uid"] for r in got} == set(range(512))  # each user's most recent first


def test_write_images_replaces_env_lines_only_when_given(tmp_path: Path) -> None:
    path = tmp_path / "classes"
    cfg = Config(features=FeaturesConfig(classes_file=str(path)))
    cf = _cf(adds={"*": (ClassCount("nc_j0123abcd", 6),)}, envs={"VIRTUAL_ENV=/a": ()})
    classfile.write(path, cf)
    assert imagelines.write_images(cfg, {}, now=1_700_000_100) is False  # env lines kept
    assert imagelines.write_images(cfg, {}, 1_700_000_100, {"VIRTUAL_ENV=/b": ("nc_j0123abcd",)})
    assert classfile.parse(path.read_text()) == replace(
        cf, verified=1_700_000_100, envs={"VIRTUAL_ENV=/b": ("nc_j0123abcd",)})


class _Groups:
    def __init__(self, groups: list[tuple[str, bool, str, tuple[str, ...]]]) -> None:
        self.groups = groups

    def feature_groups(self) -> list[tuple[str, bool, str, tuple[str, ...]]]:
        return self.groups


def test_the_daemons_check_reads_the_host_class_not_a_second_family_one() -> None:
    """The periodic check compares each node's host class with the one set: a node that
    the daemon holds without a host class (its stack keeps changing) keeps its nc_j
    feature, and a node may list nc_j first; neither is drift (else a full sync at every
    verify_s while the node is held)."""
    from inventoryd.controller.features import FeatureKeeper

    groups = [("debug", True, "n1", ("gpu", "nc_j11111111")),
              ("debug", True, "n2", ("nc_j11111111", "nc_0123abcd"))]
    keeper = FeatureKeeper(Config(features=FeaturesConfig(own_nccl=True)),
                           slurm=_Groups(groups))  # type: ignore[arg-type]
    keeper.expected = {("debug", "n1"): None, ("debug", "n2"): "nc_0123abcd"}
    assert keeper._drift() == ""
    keeper.expected[("debug", "n2")] = "nc_4567abcd"
    assert "n2" in keeper._drift()


def test_a_stale_second_family_group_is_not_regrouped_onto_a_class_no_env_line_offers() -> None:
    """The lua offers a job from a known environment only its env line's classes. A pending
    job whose nc_j class vanished (renamed: a new key shares its first 8 hex digits, or its
    nodes' plugin changed) must not be moved onto a class of the second family that no
    known environment runs: the gate refuses the job there."""
    a, b = "nc_j22222222", "nc_j33333333"
    cf = _cf(adds={"*": (ClassCount(a, 6), ClassCount(b, 6))},
             envs={"VIRTUAL_ENV=/home/a/venv": (b,)})
    slurm = _Pending([("1", "[nc_j99999999]", "debug", 4)])
    moved = sync.regroup_pending(slurm, cf, [])  # type: ignore[arg-type]
    assert all(a not in new for _, _, new in moved), moved
