"""Nodes told apart by what they add to a job's NCCL (issue 39): the ``offers`` part, the
node-adds rule, the classes.

Real parts: plugins built by gcc that export only the ``ncclNetPlugin_vN`` (etc.) named,
node trees read by the real daemon's ``collect``, real ``libnccl.so.2`` from the wheels
where a node has one. The ABIs each release looks for are the wheels' own strings
(``FACTS`` of ``tests/helpers/ncclfacts.py``), which the product's table must agree with.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.ncclfacts import FACTS
from helpers.parts import build_plugin

from devtools.nodetree import LIBDIR, build_node
from inventoryd.node.fingerprint import collect
from ncclguard.config import InventorydConfig, PolicyConfig
from ncclguard.fingerprint import offers
from ncclguard.fingerprint.releases import RELEASES, by_label
from ncclguard.policy import evaluate, evaluate_values, node_values
from ncclguard.policy.rules import node_adds
from ncclguard.policy.schedule import scheduling_classes

NET = f"{LIBDIR}/libnccl-net.so"


def test_the_release_table_agrees_with_the_wheels_strings() -> None:
    """Every release of the table that the tests have a wheel of looks for exactly the ABIs
    that wheel's libnccl names; the table is in release order; and each release's
    ``loads`` are the kinds the loading rules give an external plugin."""
    from ncclguard.fingerprint import loading

    for release in RELEASES:
        rules = loading.rules_for(release.version)
        assert set(release.loads) == {k for k in release.abis if k in rules.kinds
                                      and rules.kinds[k].external}, release
    checked = 0
    for version, facts in FACTS.items():
        release = by_label(version)
        if release is None:
            continue
        for kind in ("net", "tuner", "profiler", "env", "gin", "rma"):
            assert list(release.abis.get(kind, ())) == facts[kind], (version, kind)
        checked += 1
    assert checked >= 10
    assert [r.version for r in RELEASES] == sorted(r.version for r in RELEASES)


@pytest.fixture
def node(tmp_path: Path, nccl_lib: Callable[[str], Path], cache_dir: Path
         ) -> Callable[..., dict[str, Any]]:
    """``node("c1", files={path: so}, nccl=None, conf=None)`` -> its fingerprint."""
    trees = iter(range(1 << 20))

    def make(host: str, files: dict[str, Path] | None = None, nccl: str | None = None,
             conf: str | None = None) -> dict[str, Any]:
        root = build_node(tmp_path / f"{host}-{next(trees)}", hostname=host,
                          libnccl=nccl_lib(nccl) if nccl else None, nccl_conf=conf,
                          extra_files=files or {})
        return dict(collect(str(root), host, InventorydConfig()))

    return make


@pytest.fixture(scope="module")
def so(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    memo: dict[str, Path] = {}
    base = tmp_path_factory.mktemp("offers")

    def get(key: str, **kw: Any) -> Path:
        if key not in memo:
            kw.setdefault("filename", "libnccl-net.so")
            memo[key] = build_plugin(base / key, **kw)
        return memo[key]

    return get


def adds(v: Any) -> Any:
    return next(f for f in v.findings if f.rule == node_adds.NAME)


def classes(fps: dict[str, dict]) -> dict[str, str | None]:
    return scheduling_classes({h: node_values(fp) for h, fp in fps.items()}, PolicyConfig())


# ---- the two four-node worlds: no system libnccl, an ACTIVE IB port each ------


@pytest.mark.parametrize("fourth", [None, "v10-v9"])
def test_a_plugin_on_some_nodes_only_is_refused_naming_the_odd_node(node, so, fourth) -> None:
    """Before: one class, ``NCCL none, PLUGIN none``; the first world a warning ("net
    plugin ignored by NCCL none"), the second accepted."""
    p68 = so("v8-v6", net_abis=[8, 7, 6], name="HoldoutNet")
    fps = {f"c{i}": node(f"c{i}", {NET: p68}) for i in (1, 2, 3)}
    fps["c4"] = node("c4", {NET: so("v10-v9", net_abis=[10, 9], name="HoldoutNet")}
                     if fourth else {})
    v = evaluate(fps, PolicyConfig())
    assert v.decision == "refuse" and v.odd_nodes == ["c4"]
    f = adds(v)
    assert f.severity == "refuse"
    groups = {hosts: label for label, hosts, _ in f.groups}
    assert groups["c[1-3]"] == "net plugin HoldoutNet v8..v6 (NCCL 2.18.3 to 2.32.3)"
    if fourth is None:
        assert groups["c4"] == "net plugin none"
        assert "would use a net plugin on some nodes only" in f.message
    else:
        assert groups["c4"] == "net plugin HoldoutNet v10 (NCCL 2.26.2 to 2.32.3)"
        assert "another net plugin or ABI" in f.message
    assert "2.18.3 to 2.32.3" in f.message  # a job of NCCL 2.18 to 2.32 meets the difference
    # the host's libnccl is absent everywhere: no message about a plugin "ignored by NCCL none"
    assert not any(f.rule == "net-plugin" for f in v.findings)
    got = classes(fps)
    assert len(set(got.values())) == 2 and got["c1"] == got["c2"] == got["c3"] != got["c4"]


def test_identical_nodes_without_libnccl_are_one_class_and_accepted(node, so) -> None:
    p68 = so("v8-v6", net_abis=[8, 7, 6], name="HoldoutNet")
    fps = {f"c{i}": node(f"c{i}", {NET: p68}) for i in (1, 2)}
    assert evaluate(fps, PolicyConfig()).decision == "accept"
    assert len(set(classes(fps).values())) == 1


def test_no_plugin_and_an_unusable_one_apart_from_a_used_one(node, so) -> None:
    """A plugin no release of the table can use (v99) is, for every job, no plugin: one
    class with the node that has none (a warning names it); a plugin some release uses is
    another class, and the message says which releases."""
    fps = {"a": node("a"), "b": node("b", {NET: so("v99", net_abis=[99], name="Future")})}
    v = evaluate(fps, PolicyConfig())
    assert v.decision == "warn"
    f = adds(v)
    assert f.severity == "warn" and "no NCCL release ncclguard knows can use" in f.message
    assert {g[0] for g in f.groups} == {"net plugin none",
                                        "net plugin libnccl-net.so (Future, offers v99)"}
    assert len(set(classes(fps).values())) == 1
    fps["c"] = node("c", {NET: so("v5", net_abis=[5], name="Old")})
    fps["d"] = node("d", {NET: so("v5", net_abis=[5], name="Old")})
    v = evaluate(fps, PolicyConfig())
    assert v.decision == "refuse" and adds(v).severity == "refuse"
    # v5 is looked for by 2.12.12 to 2.23.4 only (docs/nccl.md; the wheels' strings)
    assert "(2.12.12 to 2.23.4, of the releases" in adds(v).message
    got = classes(fps)
    assert got["a"] == got["b"] != got["c"] == got["d"]


def test_a_difference_only_an_old_release_sees_names_that_release(node, so) -> None:
    """v8..v5 against v8..v6: only NCCL 2.12.12 (which looks for v5, v4) tells them apart."""
    fps = {"a": node("a", {NET: so("v8-v5", net_abis=[8, 7, 6, 5], name="N")}),
           "b": node("b", {NET: so("v8-v6", net_abis=[8, 7, 6], name="HoldoutNet")})}
    v = evaluate(fps, PolicyConfig())
    assert "(2.12.12 to 2.32.3" in adds(v).message  # the name differs for every release
    fps["b"] = node("b", {NET: so("v8-v6n", net_abis=[8, 7, 6], name="N")})
    v = evaluate(fps, PolicyConfig())
    assert v.decision == "refuse" and "(2.12.12, of the releases" in adds(v).message


def test_nodes_with_a_host_libnccl_are_judged_for_the_jobs_own_nccl_too(node, so) -> None:
    """Host libnccl 2.18.3 everywhere; a plugin exporting v8 only on one node: the host's
    libnccl ignores it (a warning), but a pip job with NCCL 2.20 or later loads it there
    and not on the other node."""
    fps = {"a": node("a", nccl="2.18.3"),
           "b": node("b", {NET: so("v8", net_abis=[8], name="New")}, nccl="2.18.3")}
    v = evaluate(fps, PolicyConfig())
    assert v.decision == "refuse"
    assert "(2.20.5 to 2.32.3, of the releases" in adds(v).message
    assert {f.rule: f.severity for f in v.findings}["net-plugin"] == "warn"


def test_nccl_conf_names_the_plugin_for_the_releases_that_read_it(node, so) -> None:
    """NCCL_NET_PLUGIN=ofi in /etc/nccl.conf: 2.10.3 reads no variable (it opens
    libnccl-net.so, absent here), 2.11.4 on open libnccl-net-ofi.so."""
    ofi = so("ofi", net_abis=[8, 7, 6, 5, 4], name="AWS Libfabric",
             filename="libnccl-net-ofi.so")
    fp = node("a", {f"{LIBDIR}/libnccl-net-ofi.so": ofi}, conf="NCCL_NET_PLUGIN=ofi\n")
    sel = dict(offers.selections(fp, "net") or [])
    assert sel["2.10.3"] == "none" and sel["2.11.4"] == "AWS Libfabric v4"
    assert sel["2.12.12"] == "AWS Libfabric v5" and sel["2.32.3"] == "AWS Libfabric v8"


def test_the_jobs_executable_or_an_unreadable_plugin_is_unknown_never_none(node, so) -> None:
    """``NCCL_NET_PLUGIN=STATIC_PLUGIN``: from 2.22.3 NCCL looks in the job's own program,
    which the node cannot see: unknown, so no difference is claimed. A tuner library that
    is not an ELF file: unknown for the releases that open it (2.21.5 on), and nothing in
    the fingerprint's errors, since the host's libnccl (2.18.3) loads no tuner."""
    fp = node("a", conf="NCCL_NET_PLUGIN=STATIC_PLUGIN\n")
    assert offers.signature(fp, "net") is None
    v = evaluate({"a": fp, "b": node("c", {NET: so("v8-v6", net_abis=[8, 7, 6],
                                                      name="HoldoutNet")})}, PolicyConfig())
    assert not any(f.rule == node_adds.NAME and f.severity == "refuse" for f in v.findings)
    fp = node("t", {f"{LIBDIR}/libnccl-tuner.so": b"not an ELF file"}, nccl="2.18.3")
    assert offers.signature(fp, "tuner") is None
    assert not [e for e in fp["errors"] if e["field"].startswith("plugins")]
    assert fp["effective"]["tuner"]["abi"] is None


def test_a_record_without_offers_is_unknown_and_hostile_parts_never_crash(node) -> None:
    """A daemon before issue 39 sends no ``offers``: unknown (no difference). A node that
    sends a damaged part gets unknown too, never an exception in the collector or gate."""
    fp = node("a")
    old = {k: v for k, v in fp.items() if k != "offers"}
    assert node_adds.values(old)["net plugin"] is None
    table = offers.TABLE
    every = " ".join(r.label for r in RELEASES if "net" in r.loads)
    plain = [{"path": "/p", "names": {"net": "X"}, "abis": {"net": [8]}}]
    good = {"table": table, "uses": {"net": f"0 8: {every}"}, "files": plain}
    span = offers.span(every.split())
    assert node_adds.values({**fp, "offers": good})["net plugin"] == f"{span}: X v8"
    odd = {**good, "files": [{"path": "/p", "names": ["x"], "abis": {"net": 5}}]}
    # names not an object: the file's name, and no exception
    assert node_adds.values({**fp, "offers": odd})["net plugin"] == f"{span}: p v8"
    for bad in ([], {"uses": []}, {"table": table, "uses": {"net": []}, "files": []},
                {**good, "table": table.rsplit(" ", 1)[0]},         # another table
                {**good, "uses": {"net": f"7 x: {every}"}},
                {**good, "uses": {"net": f"?: {every}"}},          # unknown
                {**good, "files": [{"names": {}}]},
                {**good, "uses": {"net": f"-1 8: {every}"}},
                {**good, "uses": {"net": f"0 8: {every}; 0 7: 2.32.3"}},  # a release twice
                {**good, "uses": {"net": f"0 8: {every} 9.9.9"}},
                {**good, "uses": {"net": f"0 \u00b2: {every}"}},
                {**good, "uses": {"net": f"0 8: {every};"}},
                {**good, "uses": {"net": "; ".join(f"0 {i}: 2.32.3" for i in range(99))}},
                {**good, "uses": {"net": {"0 8": every}}},
                {**good, "uses": {"net": 5}}):
        got = node_adds.values({**fp, "offers": bad})
        assert got["net plugin"] is None, bad  # unknown, not an exception
    # a crafted value in a stored record reaches the gate's comparison: parsed, bounded
    rec = node_values(fp)
    evil = json.loads(json.dumps(rec))
    evil["rules"][node_adds.NAME]["net plugin"] = "; ".join(["x to y: : :"] * 5000)
    v = evaluate_values({"a": rec, "b": evil}, PolicyConfig())
    assert v.decision == "refuse" and adds(v).severity == "refuse"


def test_signature_round_trips_and_spans_are_the_tables_runs() -> None:
    labels = [r.label for r in RELEASES]
    assert offers.span(labels[3:6]) == f"{labels[3]} to {labels[5]}"
    assert offers.span([labels[0], labels[2]]) == f"{labels[0]}, {labels[2]}"
    value = f"{labels[3]}: X v6; {labels[4]} to {labels[-1]}: X v8"
    assert offers.parse(value) == {**{x: "X v8" for x in labels[4:]}, labels[3]: "X v6"}
    assert offers.differing([value, "none"]) == labels[3:]
    assert offers.summary(value) == "X v8,v6"


# ---- honest views: what the node offers, and what is in force only with a libnccl ------


def test_views_show_what_a_node_without_libnccl_offers(node, so, tmp_path: Path) -> None:
    """Before: ``classes`` said ``PLUGIN none, ABI 0`` for every node and one class; ``show``
    said ``net plugin none``. Now PLUGIN and ABI say "-" (no libnccl to use a plugin), ADDS
    what a job's own NCCL gets, and ``show`` has the table release by release."""
    import time

    from helpers.cli import ok, runner
    from prometheus_client import generate_latest

    from inventoryd.node.textfile import registry_for
    from ncclguard.policy.schedule import class_values
    from ncclguard.store import Inventory

    p68 = so("v8-v6", net_abis=[8, 7, 6], name="HoldoutNet")
    fps = {f"c{i}": node(f"c{i}", {NET: p68} if i < 4 else {}) for i in (1, 2, 3, 4)}
    db, cfg = tmp_path / "inv.db", tmp_path / "ncclguard.toml"
    cfg.write_text("")
    with Inventory(db, values=class_values(PolicyConfig())) as inv:
        for fp in fps.values():
            inv.upsert(fp, now=time.time())
    run = runner(db, cfg)
    doc = json.loads(ok(run("classes", "--json")).stdout)
    by_hosts = {k["hosts"]: k for k in doc["classes"]}
    assert set(by_hosts) == {"c[1-3]", "c4"}
    assert by_hosts["c[1-3]"]["values"]["adds"] == "HoldoutNet v8..v6"
    assert by_hosts["c4"]["values"]["adds"] == "none"
    text = ok(run("classes")).stdout
    row = next(line for line in text.splitlines() if line.endswith("c[1-3]"))
    assert row.split()[4:9] == ["none", "-", "-", "HoldoutNet", "v8..v6"], row
    assert "ALSO DIFFERS" not in text  # node-adds' net plugin is the ADDS column
    nodes = {r["host"]: r for r in json.loads(ok(run("nodes", "--json")).stdout)["nodes"]}
    assert nodes["c1"]["adds"] == "HoldoutNet v8..v6" and nodes["c4"]["adds"] == "none"
    assert nodes["c1"]["net_abi"] is None  # not 0: nothing is in force without a libnccl
    show = ok(run("show", "c1")).stdout
    assert "  net plugin      -\n" in show and "  adds            HoldoutNet v8..v6\n" in show
    table = show.split("by release (issue 39)\n", 1)[1]
    assert table.splitlines()[4].split()[:2] == ["2.18.3", "HoldoutNet"]
    assert table.splitlines()[1].split()[:2] == ["2.10.3", "none"]
    metrics = generate_latest(registry_for(fps["c1"], last_change=None, publish_ok=None,
                                           last_publish=None)).decode()
    assert ('ncclguard_plugin_adds_info{by_release="2.18.3: HoldoutNet v6; 2.19.3: '
            'HoldoutNet v7; 2.20.5 to 2.32.3: HoldoutNet v8",kind="net",'
            'plugin="HoldoutNet v8..v6"} 1.0') in metrics


def test_the_test_factorys_offers_part_is_what_the_probe_writes(node, so) -> None:
    """``helpers.fingerprints.offers_part`` (the benchmarks' and other tests' records)
    gives what the real probe gives a node with the same net plugin and nothing else."""
    from helpers.fingerprints import offers_part

    for fp in (node("a", {NET: so("v8-v6", net_abis=[8, 7, 6], name="HoldoutNet")}),
               node("b")):
        net = next((p for p in fp["plugins"] if p["kind"] == "net"), None)
        assert offers_part(net) == fp["offers"]


def test_a_part_seen_before_is_not_read_again(node, so, monkeypatch) -> None:
    """Most nodes send the same part: by_kind answers it from what it read last time (a
    changed record cost 7 reads of it); another part, a part with the plugin probe
    failed, and a caller changing the answer it got are each their own."""
    a = node("a", {NET: so("v8-v6", net_abis=[8, 7, 6], name="HoldoutNet")})
    b = node("b")
    reads = []
    real = offers.read
    monkeypatch.setattr(offers, "read", lambda fp: reads.append(1) or real(fp))
    monkeypatch.setattr(offers, "_cache", {})
    first = offers.by_kind(a)
    first["net"] = ("changed by a caller", None)
    assert offers.by_kind(json.loads(json.dumps(a)))["net"][0] == offers.signature(a, "net")
    assert len(reads) == 1
    assert offers.by_kind(b)["net"] == (offers.NONE, offers.NONE) and len(reads) == 2
    failed = {**a, "errors": [{"probe": "plugins", "field": "plugins", "error": "x"}]}
    assert offers.by_kind(failed)["net"] == (None, None)
    assert node_adds.values(a)["net plugin"] == offers.signature(a, "net")
