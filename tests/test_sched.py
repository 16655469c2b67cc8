"""Scheduling classes (ncclguard.policy.schedule), the lua's file of classes
(ncclguard.sched.classfile) and the sync plan (ncclguard.sched.sync), without Slurm.
The real slurmctld with the shipped job_submit.lua: tests/test_sched_slurm.py."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import replace
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
    ("ncclguard-classes 3\nend\n", "line 2"),
    ("ncclguard-classes 3\nmin_nodes 2\nverified 1\nend\n", "line 2"),
    ("ncclguard-classes 3\nverified 1\nmin_nodes 2\nmax_alternatives 64\nopt_out 1\n"
     "required_nodes refuse\nguarded *\n", "no 'end'"),
    ("ncclguard-classes 3\nverified x\nend\n", "line 2"),
    ("ncclguard-classes 3\nverified 1\nverified 2\nend\n", "line 3"),
    ("ncclguard-classes 3\nverified 1\nmin_nodes 2\nmax_alternatives 65\nopt_out 1\n"
     "required_nodes refuse\nguarded *\nend\n", "max_alternatives 65"),
    ("ncclguard-classes 3\nverified 1\nmin_nodes 2\nmax_alternatives 64\nopt_out 1\n"
     "guarded *\npartition * nc_x]:3\nend\n", "not a class"),
    ("ncclguard-classes 3\nverified 1\nmin_nodes 2\nmax_alternatives 64\nopt_out 1\n"
     "guarded *\npartition a;b nc_0123abcd:3\nend\n", "partition"),
    ("ncclguard-classes 3\nverified 1\nmin_nodes 2\nmax_alternatives 64\nopt_out 1\n"
     "guarded *\nend\nmore\n", "after 'end'"),
    ("ncclguard-classes 3\nverified 1\nend\n", "missing min_nodes"),
    ("ncclguard-classes 3\nverified \u00b2\nend\n", "line 2"),  # isdigit() says yes
    ("ncclguard-classes 3\nverified 1\nmin_nodes 2\nmax_alternatives 64\nopt_out 1\n"
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


def test_image_lines_round_trip_and_stay_within_the_files_bounds() -> None:
    img = {"nvcr.io/nvidia/pytorch:25.01-py3": classfile.ImageGroup(1_700_003_600,
                                                                     ("nc_0123abcd",)),
           "/images/old.sqsh": classfile.ImageGroup(0, ())}
    cf = _cf(images=img)
    text = classfile.render(cf).decode()
    assert "image /images/old.sqsh 0\n" in text
    assert classfile.parse(text) == cf
    # a key the lua could not match is left out, not written
    odd = _cf(images={**img, "/a b.sqsh": classfile.ImageGroup(0, ()),
                      "/x\x01": classfile.ImageGroup(0, ())})
    assert classfile.parse(classfile.render(odd).decode()).images == img
    # at most MAX_IMAGES lines, and never past MAX_BYTES: the rest stay the gate's
    many = {f"/i/{n:04d}.sqsh": classfile.ImageGroup(0, ()) for n in range(400)}
    assert len(classfile.parse(classfile.render(_cf(images=many)).decode()).images) == \
        classfile.MAX_IMAGES
    wide = {f"/i/{n:04d}/" + "x" * 1000: classfile.ImageGroup(0, ("nc_0123abcd",) * 400)
            for n in range(256)}
    data = classfile.render(_cf(images=wide))
    assert len(data) <= classfile.MAX_BYTES and data.endswith(b"\nend\n")
    assert 0 < len(classfile.parse(data.decode()).images) < 256


def test_write_images_replaces_only_the_image_lines(tmp_path: Path) -> None:
    path = tmp_path / "features" / "classes"
    cfg = Config(features=FeaturesConfig(classes_file=str(path)))
    first = {"/a.sqsh": classfile.ImageGroup(0, ("nc_0123abcd",))}
    assert not sync.write_images(cfg, first, now=1_700_000_100)  # no file: a full sync writes it
    cf = _cf(members={"nc_0123abcd": "n[1-4]"}, images=first)
    classfile.write(path, cf)
    second = {"/b.sqsh": classfile.ImageGroup(0, ()),
              "h:5000/ml/train:v1": classfile.ImageGroup(1_700_003_700, ("nc_unknown",))}
    assert sync.write_images(cfg, second, now=1_700_000_100)
    got = classfile.parse(path.read_text())
    assert got == replace(cf, verified=1_700_000_100, images=second)
    assert sync.write_images(cfg, {}, now=1_700_000_200)
    assert classfile.parse(path.read_text()) == replace(cf, verified=1_700_000_200, images={})
    path.write_text("ncclguard-classes 2\nverified 1\nend\n")  # not ours to change
    assert not sync.write_images(cfg, second)


def _image_record(version: str, abis: list[int]) -> dict:
    return {"libnccl": [{"default": True, "version": version, "path": "/usr/lib/libnccl.so.2",
                         "abis": {"net": abis}}], "plugins": [], "net_plugin": None}


NOW = 1_800_000_000.0


def _image_inventory(tmp_path: Path) -> tuple[Config, dict[str, str | None]]:
    """A real Inventory: n[1-2] inject a v6..v5 plugin, n[3-4] (another host libnccl: a
    class of their own) a v10..v9 one; squashfs images of NCCL 2.18.3 (net v6..v4) and
    2.26.2 (v10..v6), and a registry tag of 2.18.3 resolved 100 s before NOW. The config
    (registry on, max_age_s 600) and each host's class."""
    from helpers.inventory import NodeSpec, build

    from ncclguard.config import InventoryConfig, RegistryConfig
    from ncclguard.policy.schedule import class_values
    from ncclguard.store import Inventory

    def inject(abis: list[int], name: str, **kw: object) -> NodeSpec:
        return NodeSpec(plugin=False, extra={"containers": {"net_plugin": {  # type: ignore[arg-type]
            "name": name, "abis": abis, "path": "/opt/p.so", "target": "/usr/lib/p.so"}}}, **kw)

    specs = {"n1": inject([6, 5], "A"), "n2": inject([6, 5], "A"),
             "n3": inject([10, 9], "B", nccl="2.18.3"), "n4": inject([10, 9], "B", nccl="2.18.3")}
    db = build(tmp_path / "inv.db", specs, now=NOW)
    cfg = Config(inventory=InventoryConfig(db=str(db)),
                 features=FeaturesConfig(classes_file=str(tmp_path / "features" / "classes")),
                 registry=RegistryConfig(enabled=True, registries=("h:5000",), max_age_s=600))
    with Inventory(db, values=class_values(cfg.policy)) as inv:
        inv.write_images([{"path": "/img/old.sqsh", "inode": 1, "size": 1, "mtime_ns": 1,
                           "record": _image_record("2.18.3", [6, 5, 4])},
                          {"path": "/img/new.sqsh", "inode": 2, "size": 1, "mtime_ns": 1,
                           "record": _image_record("2.26.2", [10, 9, 8, 7, 6])}], now=NOW)
        inv.write_registry([{"ref": "h:5000/ml/train:v1", "digest": "sha256:" + "1" * 64,
                             "state": "ok", "source": "config"}],
                           [{"digest": "sha256:" + "1" * 64, "platform": "linux/amd64",
                             "record": _image_record("2.18.3", [6, 5, 4])}], now=NOW - 100)
        classes = sync.desired(cfg, list(specs), NOW, inv)
    return cfg, classes


def test_image_groups_from_a_real_inventory(tmp_path: Path) -> None:
    """The lines the sync writes: a squashfs image and a registry tag holding NCCL 2.18.3
    (net v6..v4) run on the class that injects v6 only; 2.26.2 runs on both (no line); a
    tag resolved too long ago, a class whose nodes inject different plugins, and an
    image-stack that does not refuse give none; a max_age_s past the file's digits gives
    a line without an end."""
    from ncclguard.config import RegistryConfig
    from ncclguard.policy.schedule import class_values
    from ncclguard.store import Inventory

    cfg, classes = _image_inventory(tmp_path)
    a, b = classes["n1"], classes["n3"]
    assert a != b and classes["n2"] == a and classes["n4"] == b
    with Inventory(cfg.inventory.db, values=class_values(cfg.policy), readonly=True) as inv:
        got = sync.image_groups(cfg, inv, classes, NOW)
        assert got == {"h:5000/ml/train:v1": classfile.ImageGroup(int(NOW + 500), (a,)),
                       "/img/old.sqsh": classfile.ImageGroup(0, (a,))}
        assert next(iter(got)) == "h:5000/ml/train:v1"  # tags first (by use), then files
        # the tag's resolution too old for the gate: no line (the gate says image-unknown)
        assert set(sync.image_groups(cfg, inv, classes, NOW + 601)) == {"/img/old.sqsh"}
        # registry images not read: the squashfs file alone
        off = cfg.replace(registry=RegistryConfig(enabled=False))
        assert set(sync.image_groups(off, inv, classes, NOW)) == {"/img/old.sqsh"}
        warn = cfg.replace(policy=PolicyConfig(severity={"image-stack": "warn"}))
        assert sync.image_groups(warn, inv, classes, NOW) == {}
        # one class whose nodes inject different plugins: no line for what tells them apart
        one = dict.fromkeys(classes, a)
        assert sync.image_groups(cfg, inv, one, NOW) == {}
        huge = cfg.replace(registry=cfg.registry.replace(max_age_s=1e30))
        assert sync.image_groups(huge, inv, classes, NOW)["h:5000/ml/train:v1"].until == 0


def test_the_daemon_keeps_the_files_image_lines(tmp_path: Path) -> None:
    """FeatureKeeper's image pass (no Slurm call): the lines written when due, left when
    the file has them, put back after another writer took them out, and taken out while
    the inventory cannot be read (found by review: they stayed, and a path image's line
    kept refusing jobs the gate, failing open, would have let run)."""
    from inventoryd.controller.features import FeatureKeeper

    cfg, classes = _image_inventory(tmp_path)
    path = Path(cfg.features.classes_file)
    cf = _cf(members={}, partitions={"*": ()})
    classfile.write(path, cf)
    keeper = FeatureKeeper(cfg, slurm=object())  # type: ignore[arg-type]
    keeper.applied = dict(classes)
    assert keeper._refresh_images(NOW) == ("image groups: 2 images some class cannot run; "
                                           "changed: /img/old.sqsh, h:5000/ml/train:v1")
    assert len(classfile.read(path).images) == 2
    assert keeper._refresh_images(NOW + 1) is None  # not due: the index did not change
    classfile.write(path, cf)  # a hook's sync that could not read the images
    assert keeper._refresh_images(NOW + cfg.features.verify_s - 1) is None  # not due yet
    assert classfile.read(path).images == {}
    note = keeper._refresh_images(NOW + cfg.features.verify_s)
    assert note is not None and "the file had other lines" in note, note
    assert len(classfile.read(path).images) == 2
    Path(cfg.inventory.db).write_bytes(b"not a database")
    keeper.image_mark = None
    keeper._refresh_images(NOW + 3 * cfg.features.verify_s)
    assert classfile.read(path).images == {}
    path.unlink()
    assert keeper._refresh_images(NOW + 4 * cfg.features.verify_s) == ""  # a full sync next


def test_an_image_lines_end_moves_only_when_it_comes_near(tmp_path: Path) -> None:
    """A tag resolved again moves its line's end; each change of the file's body costs the
    lua a parse inside slurmctld, so an end stays until it is within 2 * (verify_s +
    interval_s) (124 s) of passing. The lines are written by key: the order in which jobs
    used the tags does not change the body (found by review: it did, at every
    resolution). Other classes, or a line the lua could not read: written at once."""
    path = tmp_path / "features" / "classes"
    cfg = Config(features=FeaturesConfig(classes_file=str(path)))
    assert sync.keep_s(cfg) == 124
    t0 = 1_800_000_000
    tag, other = "h:5000/ml/train:v1", "h:5000/ml/train:v2"
    classfile.write(path, _cf(images={tag: classfile.ImageGroup(t0 + 3600, ("nc_0123abcd",)),
                                      other: classfile.ImageGroup(t0 + 3600, ())}))

    def at(now: int, until: int, classes: tuple[str, ...] = ("nc_0123abcd",),
           first: str = tag) -> bool | None:
        lines = {tag: classfile.ImageGroup(until, classes),
                 other: classfile.ImageGroup(until, ())}
        order = [first, *(k for k in lines if k != first)]
        return sync.write_images(cfg, {k: lines[k] for k in order}, now=now)

    assert at(t0 + 300, t0 + 3900) is False  # resolved again: 3,300 s left, kept
    assert at(t0 + 600, t0 + 4200, first=other) is False  # used in another order: kept
    assert at(t0 + 3470, t0 + 7070) is False  # 130 s left
    assert classfile.read(path).images[tag].until == t0 + 3600
    assert at(t0 + 3480, t0 + 7080) is True  # 120 s left: moved, both together
    assert {g.until for g in classfile.read(path).images.values()} == {t0 + 7080}
    # tags resolved at other times: when the first end comes near, every end moves
    classfile.write(path, _cf(images={tag: classfile.ImageGroup(t0 + 7080, ("nc_0123abcd",)),
                                      other: classfile.ImageGroup(t0 + 5000, ())}))
    assert sync.write_images(cfg, {tag: classfile.ImageGroup(t0 + 7400, ("nc_0123abcd",)),
                                   other: classfile.ImageGroup(t0 + 8000, ())},
                             now=t0 + 4000) is False
    assert sync.write_images(cfg, {tag: classfile.ImageGroup(t0 + 7500, ("nc_0123abcd",)),
                                   other: classfile.ImageGroup(t0 + 8100, ())},
                             now=t0 + 4900) is True
    assert [g.until for g in classfile.read(path).images.values()] == [t0 + 7500, t0 + 8100]
    classfile.write(path, _cf(images={tag: classfile.ImageGroup(t0 + 7080, ("nc_0123abcd",)),
                                      other: classfile.ImageGroup(t0 + 7080, ())}))
    assert at(t0 + 3500, t0 + 7100, ()) is True  # the tag moved: no class runs it now
    assert classfile.read(path).images[tag] == classfile.ImageGroup(t0 + 7100, ())
    text = path.read_text()
    # a line the lua would refuse (found by review: int() took the first and raised on
    # the second, out of the daemon's pass): nothing carried from it, the lines rewritten
    for bad in ("1_800_007_100", f"{t0 + 7100}x"):
        path.write_text(text.replace(f"image {tag} {t0 + 7100}", f"image {tag} {bad}"))
        assert at(t0 + 3600, t0 + 7200, ()) is True
        assert classfile.read(path).images[tag] == classfile.ImageGroup(t0 + 7200, ())
