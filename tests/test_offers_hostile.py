"""The ``offers`` part and the node-adds rule, driven as a hostile node would drive them
(review of issue 39). Each test failed at 264916c (the part's first layout; the tests
were moved to the compact one of 1263197, and fail without the fixes there too).

A plugin's ``name`` is read from the file (any UTF-8 of up to 256 bytes from a real probe;
anything at all in a record a node crafts), and a node's record reaches the gate, whose
failures and deadline fail open by default (``gate.on_error = "accept"``). So a name
must neither make two nodes that give a job's NCCL different plugins compare equal, nor
make the gate raise, nor make it run past its deadline.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.fingerprints import fingerprint
from helpers.gate import last, run_gate
from helpers.parts import build_plugin

from devtools.nodetree import LIBDIR, build_node
from inventoryd.node.fingerprint import collect
from ncclguard import spool
from ncclguard.config import InventorydConfig, PolicyConfig
from ncclguard.fingerprint import offers
from ncclguard.fingerprint.releases import RELEASES
from ncclguard.policy import GATE_VALUES, evaluate, evaluate_values, node_values
from ncclguard.policy.rules import node_adds
from ncclguard.store import Inventory

KINDS = offers.KINDS


def _adds(v: Any) -> Any:
    return next((f for f in v.findings if f.rule == node_adds.NAME), None)


def _offers(name: str, top: bool = True) -> dict[str, Any]:
    """An ``offers`` part as the probe lays it out: one file ``/p`` named ``name`` for
    every kind, used by each release at its newest ABI (``top``), or by none."""
    rows: dict[str, dict[str, Any]] = {
        r.label: {k: [0, r.abis[k][0] if top else None] for k in r.loads} for r in RELEASES}
    return offers.pack(rows, [{"path": "/p", "names": dict.fromkeys(KINDS, name),
                               "abis": {k: list(range(1, 17)) for k in KINDS}}])


def _no_plugins() -> dict[str, Any]:
    return offers.pack({r.label: {} for r in RELEASES}, [])


def _fp(host: str, nccl: str, part: dict[str, Any]) -> dict[str, Any]:
    fp = fingerprint(host, nccl=nccl)
    fp["offers"] = part
    return fp


def _gate_on(tmp_path: Path, fps: dict[str, dict[str, Any]]) -> tuple[Any, float]:
    """The real gate (job on n[1-3]) over an inventory of these fingerprints."""
    with Inventory(tmp_path / "inventory.db", values=GATE_VALUES) as inv:
        for fp in fps.values():
            inv.upsert(fp)
    return run_gate(tmp_path)


# ---- (3) a name that holds the signature's separators ---------------------------------


@pytest.fixture
def node(tmp_path: Path, cache_dir: Path) -> Callable[..., dict[str, Any]]:
    count = iter(range(1 << 20))

    def make(host: str, files: dict[str, Path], conf: str | None = None) -> dict[str, Any]:
        root = build_node(tmp_path / f"{host}-{next(count)}", hostname=host, nccl_conf=conf,
                          extra_files=files)
        return dict(collect(str(root), host, InventorydConfig()))

    return make


def test_a_plugin_name_cannot_make_two_different_stacks_compare_equal(
        node: Callable[..., dict[str, Any]], tmp_path: Path) -> None:
    """Both nodes: ``NCCL_NET_PLUGIN=foo``. ``honest`` has libnccl-net.so (``Old``, v4), which
    only 2.10.3 opens, and libnccl-net-foo.so (``Foo``, v4), which 2.11.4 to 2.18.3 open
    and use. ``evil`` has only libnccl-net.so, whose struct name is
    ``Old v4; 2.11.4 to 2.18.3: Foo``: a job of NCCL 2.11 to 2.18 loads Foo on one node
    and no plugin on the other. At 264916c both signatures were the same string
    (``2.10.3: Old v4; 2.11.4 to 2.18.3: Foo v4``): one class, no finding, accepted."""
    old = build_plugin(tmp_path / "old", net_abis=[4], name="Old")
    foo = build_plugin(tmp_path / "foo", net_abis=[4], name="Foo", filename="libnccl-net-foo.so")
    evil = build_plugin(tmp_path / "evil", net_abis=[4], name="Old v4; 2.11.4 to 2.18.3: Foo")
    conf = "NCCL_NET_PLUGIN=foo\n"
    fps = {"honest": node("honest", {f"{LIBDIR}/libnccl-net.so": old,
                                     f"{LIBDIR}/libnccl-net-foo.so": foo}, conf),
           "evil": node("evil", {f"{LIBDIR}/libnccl-net.so": evil}, conf)}
    honest_sel = dict(offers.selections(fps["honest"], "net") or [])
    evil_sel = dict(offers.selections(fps["evil"], "net") or [])
    assert honest_sel["2.12.12"] == "Foo v4" and evil_sel["2.12.12"] == "none"  # really differ
    assert offers.signature(fps["honest"], "net") != offers.signature(fps["evil"], "net")
    f = _adds(evaluate(fps, PolicyConfig()))
    assert f is not None and f.severity == "refuse"


def test_no_two_distinct_selections_share_a_signature() -> None:
    """The signature is a one-to-one image of what each release gets: names holding
    ``; ``, ``: ``, ``, ``, `` to ``, `` v`` or ``%`` included."""
    labels = [r.label for r in RELEASES if r.abis.get("net")]
    names = ["A", "B", "A; B", "A v4; 2.11.4 to 2.32.3: B", "A%3B B", "A%25", "A: B",
             "2.10.3, 2.11.4", "A v4", "A to B", "A;", "%", None]  # None: no plugin
    seen: dict[str, Any] = {}
    for first in names[:-1]:
        for second in names:
            for cut in (1, 2, 5):
                rows: dict[str, dict[str, Any]] = {}
                for j, label in enumerate(labels):
                    entry = [0, 4] if j < cut else [1, 4] if second is not None else None
                    rows[label] = {"net": entry} if entry else {}
                fp = {"offers": offers.pack(rows, [{"path": "/a", "names": {"net": first}},
                                                   {"path": "/b", "names": {"net": second}}])}
                sel = tuple(offers.selections(fp, "net") or ())
                sig = offers.signature(fp, "net")
                assert sig is not None
                assert seen.setdefault(sig, sel) == sel, (sig, sel, seen[sig])


# ---- (1, 3) a name or a stored value that made the gate raise: fail open ---------------


@pytest.mark.parametrize("value", [
    "2.18.3: X v\u00b2",                        # str.isdigit, but not int()'s
    "2.18.3: X v" + "9" * 5000,                 # past int()'s 4,300 digits
])
def test_a_stored_value_int_cannot_read_does_not_raise(value: str) -> None:
    base = node_values(_fp("n1", "2.21.5", _no_plugins()))
    evil = json.loads(json.dumps(base))
    evil["rules"][node_adds.NAME]["net plugin"] = value
    v = evaluate_values({"n1": base, "n3": evil}, PolicyConfig())  # raised ValueError
    assert v.decision == "refuse"


def test_a_crafted_plugin_name_does_not_make_the_gate_accept_a_mixed_job(tmp_path: Path
                                                                        ) -> None:
    """n2 really runs NCCL 2.18.3 (a refusal). n3's plugin is named
    ``X v²; 2.10.3: Y``: at 264916c its label's summary raised ValueError in the gate
    (int("²")), which failed open: "internal error", the job accepted."""
    fps = {"n1": _fp("n1", "2.21.5", _no_plugins()), "n2": _fp("n2", "2.18.3", _no_plugins()),
           "n3": _fp("n3", "2.21.5", _offers("X v\u00b2; 2.10.3: Y"))}
    spool.check_values(fps["n3"], "the fingerprint")  # the spool takes it
    r, _ = _gate_on(tmp_path, fps)
    assert "internal error" not in r.stderr, r.stderr
    rec = last(tmp_path)
    assert rec["decision"] == "refuse" and "n2" in rec["odd_nodes"], rec


# ---- (2) size: the gate's deadline ----------------------------------------------------


def test_a_long_crafted_name_keeps_the_gate_within_its_deadline(tmp_path: Path) -> None:
    """A 3 MB net-plugin name of ``2.10.3 to 2.32.3, `` runs, behind a ``; ``: within the
    spool's bounds (8 MiB decoded, and it compresses to a few KB). Each of the 8 runs of
    the signature repeated it (a 24 MB value), and the gate parsed that value three
    times, each run expanded to 15 releases: past the 5 s deadline, which failed open
    (n2 really runs 2.18.3). Now a value is parsed no further than a signature can go,
    and a name longer than any a probe reads is kept short."""
    name = "X v1; " + "2.10.3 to 2.32.3, " * (3_000_000 // 18) + "2.10.3: Y"
    part = _offers(name)
    part["files"][0]["names"] = {"net": name}
    fps = {"n1": _fp("n1", "2.21.5", _no_plugins()), "n2": _fp("n2", "2.18.3", _no_plugins()),
           "n3": _fp("n3", "2.21.5", part)}
    spool.check_values(fps["n3"], "the fingerprint")
    assert len(json.dumps(fps["n3"]).encode()) < 8 << 20  # spool.parse_payload's bound
    r, took = _gate_on(tmp_path, fps)
    rec = last(tmp_path)
    assert rec["decision"] == "refuse" and "n2" in rec["odd_nodes"], (rec, r.stderr)
    assert took < 4, took
    assert len(json.dumps(node_values(fps["n3"]))) < 64 << 10  # was 24 MB


def test_huge_stored_values_are_compared_quickly() -> None:
    """A writer of the inventory's records (tests/test_hostile_values.py) puts a 4 MB value
    in each of the six kinds: 6.8 s of parsing at 264916c."""
    base = node_values(_fp("n1", "2.21.5", _no_plugins()))
    evil = json.loads(json.dumps(base))
    for value in ("2.10.3 to 2.32.3, " * (4_000_000 // 18) + "2.10.3: X v1",
                  "; ".join(["2.10.3 to 2.32.3: X v1"] * (4_000_000 // 24))):
        for kind in KINDS:
            evil["rules"][node_adds.NAME][f"{kind} plugin"] = value
        t = time.perf_counter()
        v = evaluate_values({"n1": base, "n3": evil}, PolicyConfig())
        assert time.perf_counter() - t < 1.0
        assert v.decision == "refuse"


# ---- (1) a damaged part: unknown, never an exception where values are computed ----------


def test_an_abi_list_that_is_not_a_list_is_unknown_not_an_exception() -> None:
    """``files[p].abis.net = 5`` on a plugin no release uses: ``unused`` iterated the int
    (TypeError). In the collector that refused the record; in the gate's recomputation
    (a record of another values version) it made the node unknown, which only warns."""
    part = _offers("X", top=False)
    part["files"][0]["abis"] = {"net": 5}
    got = node_adds.values(_fp("n3", "2.21.5", part))
    assert all(v is None or isinstance(v, str) for v in got.values())
    node_values(_fp("n3", "2.21.5", part))
