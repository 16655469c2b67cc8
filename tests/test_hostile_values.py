"""Issue 12, found by trying: what the gate reads of the inventory cannot make it accept a
job whose nodes really differ, and `ncclguard check` answers as the gate does.

The gate runs as a real process (``python -I -m prolog.gate``), on a real inventory whose
rows are then damaged as a hostile writer would damage them. Each test failed before the
fix it names.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest
from helpers.cli import run_cli
from helpers.fingerprints import fingerprint
from helpers.gate import inventory, last, run_gate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ncclguard.config import HEARTBEAT_SKEW_S
from ncclguard.policy import GATE_VALUES, heartbeat_state, node_values, valid_values
from ncclguard.store import Inventory
from ncclguard.store.schema import record_key

ODD = {"n3": "2.18.3"}  # n3 really runs another NCCL: every job on n[1-3] must be refused


def _poison(db: Path, host: str, text: str, *, rekey: bool) -> None:
    """Replace ``host``'s stored policy values by ``text``; with ``rekey``, under a key
    that names the new text (a writer who knows the key scheme)."""
    conn = sqlite3.connect(db, isolation_level=None)
    (key,) = conn.execute("SELECT policy_key FROM gate_nodes WHERE host = ?", (host,)).fetchone()
    new = record_key(GATE_VALUES.version, text) if rekey else key
    conn.execute("INSERT OR REPLACE INTO policy_values VALUES (?, ?)", (new, text))
    conn.execute("UPDATE gate_nodes SET policy_key = ? WHERE host = ?", (new, host))
    conn.close()


def _check(tmp_path: Path, hostlist: str) -> tuple[int, str]:
    r = run_cli("check", hostlist, db=tmp_path / "inventory.db")
    return r.exit_code, r.output


def test_values_of_the_wrong_type_are_not_read_as_accept(tmp_path: Path) -> None:
    """``"driver": ["x"]`` made the comparison raise (unhashable list): internal error,
    accept. The record is now refused as a record; the node's fingerprint says 2.18.3."""
    inventory(tmp_path, ODD)
    values = node_values(fingerprint("n3", nccl="2.18.3"))
    values["rules"]["gpu-driver"] = {"driver": ["x"]}
    _poison(tmp_path / "inventory.db", "n3", json.dumps(values, sort_keys=True), rekey=True)
    r, _ = run_gate(tmp_path)  # no Slurm here: the refusal's notify fails, and is logged
    assert r.returncode == 1 and "internal error" not in r.stderr, r.stderr
    rec = last(tmp_path)
    assert rec["decision"] == "refuse" and rec["odd_nodes"] == ["n3"], rec
    assert _check(tmp_path, "n[1-3]")[0] == 2  # check: refuse, as the gate


def test_values_under_another_key_are_not_trusted(tmp_path: Path) -> None:
    """n3's row made to hold the baseline's values under n3's own key: the key no longer
    names the text, so the gate computes n3's values again from its fingerprint."""
    inventory(tmp_path, ODD)
    good = json.dumps(node_values(fingerprint("n1", nccl="2.21.5")), sort_keys=True,
                      separators=(",", ":"))
    _poison(tmp_path / "inventory.db", "n3", good, rekey=False)
    r, _ = run_gate(tmp_path)
    rec = last(tmp_path)
    assert rec["decision"] == "refuse" and rec["odd_nodes"] == ["n3"], (rec, r.stderr)


def test_a_node_whose_values_and_fingerprint_are_both_bad_is_unknown(tmp_path: Path) -> None:
    inventory(tmp_path, ODD)
    db = tmp_path / "inventory.db"
    _poison(db, "n3", '{"ncclguard_node_values": 1, "rules": {"x": 5}}', rekey=True)
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("UPDATE nodes SET fingerprint = '[1, 2' WHERE host = 'n3'")
    conn.close()
    r, _ = run_gate(tmp_path)
    rec = last(tmp_path)
    assert "internal error" not in r.stderr
    assert rec["decision"] == "warn", rec  # unknown-node: warn by default, never accept
    assert any(f["rule"] == "unknown-node" and "n3" in json.dumps(f) for f in rec["findings"])


def test_check_reads_what_the_gate_reads(tmp_path: Path) -> None:
    """A ``gate_nodes`` row pointing n3 at the baseline's (valid) record: the gate and
    check now read the same rows and give the same answer. (Before: the gate read
    ``gate_nodes``, check the fingerprints, and they disagreed.) That answer is accept:
    a valid record under its own key is the collector's word, and the gate reads no
    fingerprint for it; only the inventory file's permissions keep such a row out
    (docs/threat-model.md)."""
    inventory(tmp_path, ODD)
    db = tmp_path / "inventory.db"
    conn = sqlite3.connect(db, isolation_level=None)
    (k1,) = conn.execute("SELECT policy_key FROM gate_nodes WHERE host = 'n1'").fetchone()
    conn.execute("UPDATE gate_nodes SET policy_key = ? WHERE host = 'n3'", (k1,))
    conn.close()
    run_gate(tmp_path)
    code, out = _check(tmp_path, "n[1-3]")
    gate = last(tmp_path)["decision"]
    assert {"accept": 0, "warn": 1, "refuse": 2}[gate] == code, out


def test_a_heartbeat_in_the_future_is_stale(tmp_path: Path) -> None:
    """A node whose clock is 30 days ahead stayed fresh for 30 days after it died."""
    future = time.time() + 30 * 86400
    with Inventory(tmp_path / "inventory.db", values=GATE_VALUES) as inv:
        for h in ("n1", "n2", "n3"):
            inv.upsert(fingerprint(h), now=future if h == "n2" else None)
    run_gate(tmp_path)
    rec = last(tmp_path)
    assert rec["stale"] == ["n2"] and rec["decision"] == "warn", rec
    r = run_cli("nodes", "--json", db=tmp_path / "inventory.db")
    rows = {n["host"]: n for n in json.loads(r.output)["nodes"]}
    assert rows["n2"]["stale"] and rows["n2"]["status"] == "future"
    assert not rows["n1"]["stale"]
    now = time.time()
    assert heartbeat_state(now + HEARTBEAT_SKEW_S - 1, now, 900) == "ok"
    assert heartbeat_state(now + HEARTBEAT_SKEW_S + 1, now, 900) == "future"
    assert heartbeat_state(now - 901, now, 900) == "stale"
    assert heartbeat_state(None, now, 900) == "stale"


# ---- fuzz: no stored record makes the gate's read crash or accept a real difference

_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                     st.text(max_size=5))
_json = st.recursive(_scalars, lambda c: st.one_of(st.lists(c, max_size=3),
                                                  st.dictionaries(st.text(max_size=4), c,
                                                                  max_size=3)), max_leaves=8)


@given(record=st.one_of(_json, st.fixed_dictionaries(
    {"ncclguard_node_values": st.sampled_from([1, True, 1.0, "1"]),
     "rules": st.dictionaries(st.sampled_from(["nccl-version", "gpu-driver", "x"]),
                              st.dictionaries(st.text(max_size=4), _json, max_size=2),
                              max_size=3)})))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_valid_values_accepts_only_what_the_policy_can_compare(record: object) -> None:
    if valid_values(record):
        from ncclguard.config import PolicyConfig
        from ncclguard.policy import evaluate_values

        base = node_values(fingerprint("n1"))
        evaluate_values({"n1": base, "n2": record}, PolicyConfig())  # never raises
        assert isinstance(record, dict) and type(record["ncclguard_node_values"]) is int


@pytest.mark.parametrize("text", [
    '{"ncclguard_node_values": 1, "rules": {"nccl-version": {"nccl": ["2.21.5"]}}}',
    '{"ncclguard_node_values": true, "rules": {}}',
    '{"ncclguard_node_values": 1, "rules": []}',
    '[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[',
    "null",
])
def test_any_stored_record_is_judged_by_the_fingerprint_instead(tmp_path: Path, text: str
                                                                ) -> None:
    inventory(tmp_path, ODD)
    _poison(tmp_path / "inventory.db", "n3", text, rekey=True)
    with Inventory(tmp_path / "inventory.db", readonly=True, values=GATE_VALUES) as inv:
        got = inv.load_values(["n1", "n3"])
    assert got["n3"] is not None and got["n3"][0] == node_values(fingerprint("n3", "2.18.3"))


def test_an_outage_is_visible_and_a_stale_difference_still_refuses(tmp_path: Path) -> None:
    """Issue 12: records 20 minutes old on nodes that really mix NCCL 2.21.5 and 2.18.3
    ran with only a warning. Now the last known stack is compared (refuse), the gate's
    log counts the stale nodes, and ``classes`` says how old the oldest heartbeat is."""
    old = time.time() - 1200
    with Inventory(tmp_path / "inventory.db", values=GATE_VALUES) as inv:
        for h in ("n1", "n2", "n3", "n4"):
            inv.upsert(fingerprint(h, nccl=ODD.get(h, "2.21.5")), now=old)
    r, _ = run_gate(tmp_path)
    rec = last(tmp_path)
    assert rec["decision"] == "refuse" and rec["odd_nodes"] == ["n3"], rec
    assert rec["stale"] == ["n1", "n2", "n3"]
    assert "3 of 3 nodes stale, oldest heartbeat 20 min old" in r.stderr
    assert "stale heartbeat, oldest 20 min old: n[1-3]" in rec["summary"]
    out = run_cli("classes", db=tmp_path / "inventory.db").output
    assert "freshness: 4 of 4 nodes stale" in out and "(20m ago)" in out, out


@pytest.fixture(scope="module")
def mixed_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("mixed")
    inventory(d, ODD)
    return d / "inventory.db"


_RULES = sorted(node_values(fingerprint("n1"))["rules"])


def _mutated(change: tuple[str, str, object]) -> str:
    """A real record of the baseline's values with one aspect of one rule changed."""
    rule, aspect, value = change
    rec = node_values(fingerprint("n1"))
    rec["rules"].setdefault(rule, {})[aspect] = value
    return json.dumps(rec, sort_keys=True)


@given(text=st.one_of(
    _json.map(lambda v: json.dumps(v, sort_keys=True)),
    st.fixed_dictionaries({
        "ncclguard_node_values": st.just(1),
        "rules": st.dictionaries(st.sampled_from([*_RULES, "x"]),
                                 st.dictionaries(st.sampled_from(["nccl", "*", "x"]),
                                                 st.one_of(st.none(), st.text(max_size=6),
                                                           _json), max_size=3),
                                 min_size=len(_RULES) - 1, max_size=len(_RULES) + 1),
    }).map(lambda v: json.dumps(v, sort_keys=True)),
    st.tuples(st.sampled_from(_RULES), st.sampled_from(["nccl", "*", "net plugin", "x"]),
              st.one_of(st.none(), st.text(max_size=8), _json)).map(_mutated),
    st.text(max_size=40),
))
@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_no_stored_record_makes_a_real_difference_accepted(mixed_db: Path, text: str) -> None:
    """Fuzz of the gate's read: n3's stored record replaced by random JSON, by records of
    the policy's shape with random rules and values, and by the baseline's real record
    with one aspect changed, each under a key that names it. Whatever the record, the job
    on n[1-3], whose n3 really runs 2.18.3, is not accepted unless the record claims
    n3's NCCL is the baseline's or unknown: what a writer who knows the format can
    claim, and what the gate, reading no fingerprint for a trusted record, takes as the
    collector's word (docs/threat-model.md)."""
    from ncclguard.config import PolicyConfig
    from ncclguard.policy import evaluate_values

    _poison(mixed_db, "n3", text, rekey=True)
    with Inventory(mixed_db, readonly=True, values=GATE_VALUES) as inv:
        got = inv.load_values(["n1", "n2", "n3"])
    values = {h: (r[0] if r else None) for h, r in got.items()}
    verdict = evaluate_values(values, PolicyConfig())
    n3 = values["n3"]
    version = (n3 or {}).get("rules", {}).get("nccl-version", {})
    claimed = version["nccl"] if "nccl" in version else version.get("*")  # value_of
    if claimed in ("2.21.5", None) or n3 == values["n1"]:
        return  # a consistent claim: the collector's word (docs/threat-model.md)
    assert verdict.decision != "accept", (text, verdict.summary())
