"""The Inventory: schema, writes, queries, history, modes and refusals (real SQLite files).

Over 500 lines: the Inventory's contract, table family by family, on real SQLite files;
the concurrency and fault tests are in test_store_concurrency.py and
test_store_faults.py.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.cli import run_cli
from helpers.fingerprints import fingerprint

from ncclguard.config import InventoryConfig
from ncclguard.fingerprint.canonical import fingerprint_diff, fingerprint_hash
from ncclguard.fingerprint.compat import compat_key
from ncclguard.policy import GATE_VALUES
from ncclguard.store import (
    SCHEMA_VERSION,
    Inventory,
    InventoryCorrupt,
    InventoryMissing,
    InventoryReadOnly,
    InventoryUnsafe,
)
from ncclguard.store.rows import PLUGIN_COLUMNS
from ncclguard.store.schema import MIGRATIONS
from ncclguard.timeparse import parse_iso

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "inv" / "inventory.db"


def test_fresh_database_has_schema_version_and_safe_modes(db: Path) -> None:
    with Inventory(db, values=GATE_VALUES) as inv:
        assert inv.schema_version() == SCHEMA_VERSION
        assert inv.integrity_check() == "ok"
    assert stat.S_IMODE(db.stat().st_mode) == 0o644
    assert stat.S_IMODE(db.parent.stat().st_mode) == 0o755
    tables = {
        r[0]
        for r in sqlite3.connect(db).execute("SELECT name FROM sqlite_master WHERE type='table'")
    }
    assert {"nodes", "libraries", "plugins", "rdma_ports", "history"} <= tables


def test_upsert_outcomes_and_heartbeat_interval(db: Path) -> None:
    with Inventory(db, values=GATE_VALUES, heartbeat_s=300) as inv:
        fp = fingerprint("n1", plugin_abi=8)
        assert inv.upsert(fp, now=1000) == "inserted"
        assert inv.upsert(fp, now=1100) == "unchanged"
        # a new collection time alone is not a change
        fp2 = fingerprint("n1", collected_at="2026-11-30T03:00:00Z", plugin_abi=8)
        assert inv.upsert(fp2, now=1200) == "unchanged"
        assert inv.upsert(fp2, now=1300) == "heartbeat"
        assert inv.upsert(fingerprint("n1", "2.21.6", plugin_abi=8), now=1400) == "changed"
        rec = inv.load(["n1"])["n1"]
        assert rec is not None
        assert rec.first_seen == 1000
        assert rec.last_heartbeat == 1400
        assert rec.fingerprint["libnccl"][0]["version"] == "2.21.6"
        assert rec.fp_hash == fingerprint_hash(fingerprint("n1", "2.21.6", plugin_abi=8))
        assert inv.heartbeat("n1", now=1500) is True
        assert inv.heartbeat("nope", now=1500) is False
        assert inv.load(["n1"])["n1"].last_heartbeat == 1500  # type: ignore[union-attr]


def test_load_returns_none_for_unknown_hosts_and_reads_readonly(db: Path) -> None:
    with Inventory(db, values=GATE_VALUES) as inv:
        for i in range(5):
            inv.upsert(fingerprint(f"n{i}", plugin_abi=8), now=1000)
    with Inventory(db, readonly=True) as ro:
        got = ro.load(["n0", "n3", "ghost", "n0"])
        assert list(got) == ["n0", "n3", "ghost"]
        assert got["ghost"] is None
        rec = got["n3"]
        assert rec is not None and rec.host == "n3"
        assert rec.fingerprint == fingerprint("n3", plugin_abi=8)
        # the fingerprint's own key
        assert rec.compat_key == compat_key(fingerprint("n3", plugin_abi=8))
        assert rec.compat_key == got["n0"].compat_key  # type: ignore[union-attr]
        assert rec.collected_at == parse_iso("2026-11-30T02:13:28Z")  # host.collected_at
        with pytest.raises(InventoryReadOnly, match=str(db)):
            ro.upsert(fingerprint("n9", plugin_abi=8))


def test_history_records_each_change_with_a_field_diff(db: Path) -> None:
    with Inventory(db, values=GATE_VALUES) as inv:
        inv.upsert(fingerprint("n1", "2.21.5", hcas=2, plugin_abi=8), now=100)
        inv.upsert(fingerprint("n2", "2.21.5", hcas=2, plugin_abi=8), now=100)
        # a heartbeat: no history row
        inv.upsert(fingerprint("n1", "2.21.5", hcas=2, plugin_abi=8), now=500)
        inv.upsert(fingerprint("n1", "2.23.4", hcas=2, plugin_abi=8), now=1000)
        inv.upsert(fingerprint("n1", "2.23.4", hcas=2, ports_up=1, plugin_abi=8), now=2000)
        h = inv.history("n1")
        assert [r["at"] for r in h] == [100, 1000, 2000]
        assert h[0]["old_hash"] is None and h[0]["diff"] == []
        assert h[1]["old_hash"] == h[0]["new_hash"]
        fields = {d["field"]: d for d in h[1]["diff"]}
        key = "libnccl[/usr/lib/x86_64-linux-gnu/libnccl.so.2].version"
        assert fields[key]["old"] == "2.21.5" and fields[key]["new"] == "2.23.4"
        assert any(d["field"].startswith("rdma.devices[mlx5_1].ports[1].state")
                   for d in h[2]["diff"])
        # "which nodes changed NCCL since t"
        changed = {r["host"] for r in inv.history(since=500)
                   if any(d["field"].startswith("libnccl") for d in r["diff"])}
        assert changed == {"n1"}
        # "what did n1 have when job X started"
        assert inv.fingerprint_at("n1", 50) is None
        assert inv.fingerprint_at("n1", 999)["libnccl"][0]["version"] == "2.21.5"  # type: ignore[index]
        assert inv.fingerprint_at("n1", 1000)["libnccl"][0]["version"] == "2.23.4"  # type: ignore[index]


def _policy(**severity: str) -> Any:
    from ncclguard.config import PolicyConfig
    from ncclguard.policy.schedule import class_values

    return class_values(PolicyConfig(severity={k.replace("_", "-"): v
                                               for k, v in severity.items()}))


def test_classes_group_by_the_configured_refuse_rules(db: Path) -> None:
    """One class per set of refuse-level values: the drivers differ (a warn rule by
    default) and do not split a class; the versions do. A rule at warn (nccl-version)
    joins two versions in one class, and the class says its nodes differ there."""
    with Inventory(db, values=_policy()) as inv:
        for i in range(6):  # both versions offer the plugin's net ABI: only they differ
            inv.upsert(fingerprint(f"n{i}", "2.21.5" if i < 4 else "2.18.3", driver=str(i),
                                   net_abis=[8, 7, 6, 5], plugin_abi=8), now=1)
        classes = inv.classes()
        assert [c.hosts for c in classes] == [["n0", "n1", "n2", "n3"], ["n4", "n5"]]
        assert classes[0].values["nccl"] == "2.21.5" and not classes[0].spread
        assert classes[1].values["nccl"] == "2.18.3"
        assert all(re.fullmatch("[0-9a-f]{64}", c.key) for c in classes)
        sub = inv.classes(["n5", "n1", "nX"])
        assert sorted(c.hosts[0] for c in sub) == ["n1", "n5"]
        assert {c.key for c in sub} == {c.key for c in classes}
    with Inventory(db, readonly=True, values=_policy(nccl_version="warn")) as ro:
        (one,) = ro.classes()
        assert one.hosts == [f"n{i}" for i in range(6)]
        assert one.values["nccl"] is None and one.spread["nccl"] == ["2.18.3", "2.21.5"]
    with Inventory(db, readonly=True, values=_policy(gpu_driver="refuse")) as ro:
        assert sorted(len(c.hosts) for c in ro.classes()) == [1] * 6


def _stored_classes(db: Path) -> tuple[dict[str, str], str]:
    conn = sqlite3.connect(db)
    try:
        keys = dict(conn.execute("SELECT host, class_key FROM gate_nodes").fetchall())
        (policy,) = conn.execute(
            "SELECT value FROM collector_state WHERE name = 'class_policy'").fetchone()
    finally:
        conn.close()
    return keys, policy


def test_a_severity_change_derives_every_class_once(db: Path) -> None:
    """The writer stores each node's class under its policy; a writer with another
    severity derives them all again when it opens the file, and once only."""
    strict = _policy(gpu_driver="refuse")
    with Inventory(db, values=_policy()) as inv:
        for i in range(4):
            inv.upsert(fingerprint(f"n{i}", driver="550" if i < 3 else "535", plugin_abi=8), now=1)
    before, policy = _stored_classes(db)
    assert len(set(before.values())) == 1 and policy == _policy().class_policy
    with Inventory(db, values=strict) as inv:  # opening derives them
        assert inv.derive_classes() == 0  # ... once
        got = {h: inv.class_keys([h])[h] for h in before}
    after, policy = _stored_classes(db)
    assert policy == strict.class_policy != _policy().class_policy
    assert after == got and len(set(after.values())) == 2
    assert after["n0"] == after["n1"] == after["n2"] != after["n3"]
    with Inventory(db, values=_policy()) as inv:  # and back
        assert inv.derive_classes() == 0
    assert _stored_classes(db) == (before, _policy().class_policy)


def test_a_reader_of_another_policy_derives_the_classes_itself(db: Path) -> None:
    """A reader whose config says other severities than the collector's (not reloaded
    yet) gets the classes of its own config; a stored key it cannot trust (another
    policy's, or not a key at all) is derived again from the gate's values."""
    from ncclguard.policy import node_values

    fps = {f"n{i}": fingerprint(f"n{i}", driver="550" if i < 3 else "535", plugin_abi=8)
           for i in range(4)}
    with Inventory(db, values=_policy()) as inv:
        for fp in fps.values():
            inv.upsert(fp, now=1)
    strict = _policy(gpu_driver="refuse")
    assert strict.classify is not None
    with Inventory(db, readonly=True, values=strict) as ro:
        assert ro.class_keys() == {h: strict.classify(node_values(fp)) for h, fp in fps.items()}
    conn = sqlite3.connect(db)
    conn.execute("UPDATE gate_nodes SET class_key = 'nc_forged' WHERE host = 'n3'")
    conn.commit()
    conn.close()
    default = _policy()
    assert default.classify is not None
    with Inventory(db, readonly=True, values=default) as ro:
        assert ro.class_keys(["n3", "n9"]) == {"n3": default.classify(node_values(fps["n3"])),
                                               "n9": None}
    with Inventory(db, readonly=True, values=GATE_VALUES) as ro, \
            pytest.raises(ValueError, match="class_values"):
        ro.classes()
    with Inventory(db, readonly=True, values=GATE_VALUES) as ro:
        assert ro.stored_class_policy() == default.class_policy != strict.class_policy


def test_classes_says_when_the_collector_stored_another_policys_classes(db: Path,
                                                                      tmp_path: Path) -> None:
    """An admin edited the severities and the collector has not reloaded: ``classes``
    shows the classes of its own config, and says that the stored ones differ."""
    with Inventory(db, values=_policy()) as inv:
        for i in range(3):
            inv.upsert(fingerprint(f"n{i}", driver="550" if i < 2 else "535", plugin_abi=8), now=1)
    same, edited = tmp_path / "same.toml", tmp_path / "edited.toml"
    same.write_text("")
    edited.write_text('[policy.severity]\n"gpu-driver" = "refuse"\n')
    for cfg, classes, noted in ((same, 1, False), (edited, 2, True)):
        r = run_cli("classes", db=db, config=cfg)
        assert r.exit_code == 0, r.output
        assert f"3 nodes in {classes} class{'' if classes == 1 else 'es'};" in r.output
        assert ("note: the collector stored these classes under other severities"
                in r.output) is noted, r.output
        doc = json.loads(run_cli("classes", "--json", db=db, config=cfg).output)
        assert doc["collector_policy_differs"] is noted


def test_nodes_query_columns_and_filters(db: Path) -> None:
    with Inventory(db, values=GATE_VALUES) as inv:
        inv.upsert(fingerprint("a", "2.21.5", hcas=2, ports_up=2, plugin_abi=8), now=10)
        inv.upsert(fingerprint("b", "2.18.3", hcas=2, ports_up=1, driver="535"), now=20)
        rows = {r["host"]: r for r in inv.nodes()}
        assert rows["a"]["nccl_version"] == "2.21.5"
        assert rows["a"]["nccl_versions"] == ["2.21.5"]
        assert rows["a"]["net_plugin_name"] == "IBext_v8"
        assert rows["a"]["rdma_ports_up"] == 2 and rows["a"]["rdma_ports_total"] == 2
        assert rows["b"]["net_plugin"] is None and rows["b"]["rdma_ports_up"] == 1
        assert rows["b"]["driver"] == "535" and rows["b"]["last_heartbeat"] == 20
        assert rows["a"]["error_count"] == 0
        assert rows["a"]["transport"] == "IBext_v8" and rows["b"]["transport"] == "IB"
        assert [r["host"] for r in inv.nodes({"nccl_version": "2.18.3"})] == ["b"]
        assert [r["host"] for r in inv.nodes({"has_nccl": "2.21.5"})] == ["a"]
        assert [r["host"] for r in inv.nodes({"net_plugin": None})] == ["b"]
        assert [r["host"] for r in inv.nodes({"host": ["a", "b", "c"]})] == ["a", "b"]
        with pytest.raises(ValueError, match="unknown field 'x; DROP TABLE nodes'"):
            inv.nodes({"x; DROP TABLE nodes": 1})


def test_stale_and_hosts(db: Path) -> None:
    with Inventory(db, values=GATE_VALUES) as inv:
        inv.upsert(fingerprint("old", plugin_abi=8), now=100)
        inv.upsert(fingerprint("new", plugin_abi=8), now=1000)
        assert inv.stale(now=1100, ttl=500) == ["old"]
        assert inv.hosts() == ["new", "old"]


def test_fingerprint_diff_ignores_collection_time() -> None:
    a = fingerprint("n1", plugin_abi=8)
    b = copy.deepcopy(a)
    b["host"]["collected_at"] = "2030-01-01T00:00:00Z"
    assert fingerprint_diff(a, b) == []
    assert fingerprint_hash(a) == fingerprint_hash(b)


def test_upsert_rejects_a_fingerprint_without_hostname(db: Path) -> None:
    with Inventory(db, values=GATE_VALUES) as inv, pytest.raises(ValueError, match="hostname"):
        inv.upsert({"schema": 1, "host": {}})


# ---- refusals and the files


def test_readonly_missing_file_and_missing_directory(tmp_path: Path) -> None:
    want = re.escape(f"inventory at {tmp_path}/x.db: no such file")
    with pytest.raises(InventoryMissing, match=want):
        Inventory(tmp_path / "x.db", readonly=True)
    with pytest.raises(InventoryMissing, match=r"directory .* is missing"):
        Inventory(tmp_path / "nodir" / "x.db", readonly=True)


def test_readonly_refuses_an_empty_never_written_file(tmp_path: Path) -> None:
    p = tmp_path / "empty.db"
    p.touch(mode=0o644)
    with pytest.raises(InventoryMissing, match="empty database"):
        Inventory(p, readonly=True)


@pytest.mark.parametrize("readonly", [False, True])
def test_world_writable_file_is_refused(db: Path, readonly: bool) -> None:
    Inventory(db, values=GATE_VALUES).close()
    os.chmod(db, 0o666)
    with pytest.raises(InventoryUnsafe, match=f"world-writable inventory at {db}: refusing"):
        Inventory(db, values=GATE_VALUES, readonly=readonly)


@pytest.mark.parametrize("readonly", [False, True])
def test_world_writable_directory_is_refused(db: Path, readonly: bool) -> None:
    Inventory(db, values=GATE_VALUES).close()
    os.chmod(db.parent, 0o777)
    with pytest.raises(InventoryUnsafe, match=r"refusing .*its directory"):
        Inventory(db, values=GATE_VALUES, readonly=readonly)


@pytest.mark.parametrize("readonly", [False, True])
def test_a_link_into_a_world_writable_directory_is_refused(tmp_path: Path, readonly: bool
                                                           ) -> None:
    """Issue 12: a symlinked inventory path skipped the check for readers: the link sat
    in a safe directory, the file in one that anyone could replace it in."""
    unsafe = tmp_path / "tmp"
    unsafe.mkdir()
    Inventory(unsafe / "inventory.db", values=GATE_VALUES).close()
    os.chmod(unsafe, 0o777)
    safe = tmp_path / "etc"
    safe.mkdir()
    (safe / "inventory.db").symlink_to(unsafe / "inventory.db")
    with pytest.raises(InventoryUnsafe, match=r"refusing .*the directory it links into"):
        Inventory(safe / "inventory.db", values=GATE_VALUES, readonly=readonly)


@pytest.mark.parametrize("readonly", [False, True])
def test_corrupt_file_is_named(tmp_path: Path, readonly: bool) -> None:
    p = tmp_path / "inventory.db"
    p.write_bytes(b"this is not a database, it is a text file\n" * 200)
    os.chmod(p, 0o644)
    want = rf"corrupt inventory at {re.escape(str(p))}: .*not a database"
    with pytest.raises(InventoryCorrupt, match=want):
        Inventory(p, values=GATE_VALUES, readonly=readonly)


def test_a_directory_in_place_of_the_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "inventory.db").mkdir()
    with pytest.raises(InventoryCorrupt, match="not a regular file"):
        Inventory(tmp_path / "inventory.db", values=GATE_VALUES)


# ---- schema versions


def _database_at_version(path: Path, version: int) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN")
    for step in MIGRATIONS[:version]:
        step(conn, GATE_VALUES)
    conn.execute(f"PRAGMA user_version = {version}")
    conn.execute("COMMIT")
    conn.close()
    os.chmod(path, 0o644)


@pytest.mark.parametrize("version", range(SCHEMA_VERSION))
def test_migrates_from_every_earlier_version(tmp_path: Path, version: int) -> None:
    p = tmp_path / "inventory.db"
    _database_at_version(p, version)
    with pytest.raises(InventoryMissing if version == 0 else InventoryCorrupt):
        Inventory(p, readonly=True)  # readers never migrate
    with Inventory(p, values=GATE_VALUES) as inv:
        assert inv.schema_version() == SCHEMA_VERSION
        assert inv.upsert(fingerprint("n1", plugin_abi=8), now=1) == "inserted"
    with Inventory(p, values=GATE_VALUES) as inv:  # a second open runs nothing again
        assert inv.schema_version() == SCHEMA_VERSION
        assert inv.hosts() == ["n1"]


@pytest.mark.parametrize("readonly", [False, True])
def test_a_newer_schema_is_refused(db: Path, readonly: bool) -> None:
    Inventory(db, values=GATE_VALUES).close()
    conn = sqlite3.connect(db)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(InventoryCorrupt, match="newer than this ncclguard"):
        Inventory(db, values=GATE_VALUES, readonly=readonly)


# ---- paths


def test_ncclguard_db_overrides_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "env" / "inventory.db"
    monkeypatch.setenv("NCCLGUARD_DB", str(target))
    with Inventory(values=GATE_VALUES, config=InventoryConfig(db=str(tmp_path / "cfg.db"))) as inv:
        assert inv.path == target
    assert target.exists() and not (tmp_path / "cfg.db").exists()


def test_default_path_works_without_root_on_a_fresh_home(tmp_path: Path) -> None:
    """The embedded default (per-user state dir) is created with its parents."""
    env = {k: v for k, v in os.environ.items() if k not in ("NCCLGUARD_DB", "XDG_STATE_HOME")}
    env["HOME"] = str(tmp_path / "home")
    code = (
        "from ncclguard.config import SYSTEM_STATE_DIR\n"
        "import ncclguard.config as c\n"
        "c.SYSTEM_STATE_DIR = c.Path('/nonexistent-ncclguard')\n"
        "from ncclguard.policy import GATE_VALUES\n"
        "from ncclguard.store import Inventory\n"
        "inv = Inventory(values=GATE_VALUES); print(inv.path)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, check=True,
                         capture_output=True, text=True).stdout.strip()
    assert out == str(tmp_path / "home/.local/state/ncclguard/inventory.db")
    assert Path(out).is_file()


def test_the_gate_path_uses_plain_sqlite3_only(db: Path) -> None:
    with Inventory(db, values=GATE_VALUES) as inv:
        inv.upsert(fingerprint("n1", plugin_abi=8), now=1)
    code = (
        "import sys, json\n"
        "from ncclguard.store import Inventory\n"
        f"inv = Inventory({str(db)!r}, readonly=True)\n"
        "r = inv.load(['n1'])['n1']\n"
        "print(json.dumps([r.host, 'sqlite_utils' in sys.modules,"
        " any(m.startswith(('prolog', 'ncclguard.policy')) for m in sys.modules)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    assert json.loads(out) == ["n1", False, False]


def test_migration_to_v2_backfills_the_gate_values(tmp_path: Path) -> None:
    """v1 rows get ``policy_values``; the gate's read then matches the policy's own."""
    from ncclguard.config import PolicyConfig
    from ncclguard.policy import evaluate, evaluate_values, node_values

    p = tmp_path / "inventory.db"
    fps = {"n1": fingerprint("n1", plugin_abi=8), "n2": fingerprint("n2", plugin_abi=8),
           "n3": fingerprint("n3", nccl="2.18.3", plugin_abi=8)}
    with Inventory(p, values=GATE_VALUES) as inv:
        for fp in fps.values():
            inv.upsert(fp, now=1)
    conn = sqlite3.connect(p, isolation_level=None)  # take the file back to schema v1
    conn.execute("DROP TABLE gate_nodes")
    conn.execute("DROP TABLE policy_values")
    conn.execute("DROP TABLE publishers")  # v3's
    conn.execute("DROP TABLE rejections")
    conn.execute("ALTER TABLE nodes DROP COLUMN errors_hash")
    for col in PLUGIN_COLUMNS:  # v4's
        conn.execute(f"ALTER TABLE nodes DROP COLUMN {col}")
    conn.execute("DROP TABLE images")  # v5's
    conn.execute("DROP TABLE container_runs")
    conn.execute("DROP TABLE collector_state")  # v6's
    conn.execute("DROP INDEX idx_history_usage")
    conn.execute("ALTER TABLE history DROP COLUMN bytes")
    conn.execute("ALTER TABLE history DROP COLUMN stored_at")
    for table in ("registry_tags", "registry_images", "registry_layers"):  # v8's
        conn.execute(f"DROP TABLE {table}")
    conn.execute("DROP TABLE job_envs")  # v9's
    conn.execute("DROP TABLE job_loads")  # v10's
    conn.execute("DROP TABLE mixed_steps")
    conn.execute("DROP TABLE canary_nodes")  # v11's
    conn.execute("DROP TABLE canary_history")
    conn.execute("PRAGMA user_version = 1")
    conn.close()
    with Inventory(p, values=GATE_VALUES) as inv:
        assert inv.schema_version() == SCHEMA_VERSION
    with Inventory(p, readonly=True, values=GATE_VALUES) as inv:
        got = inv.load_values(["n1", "n2", "n3", "n9"])
    assert got["n9"] is None
    for host, fp in fps.items():
        values, heartbeat = got[host]  # type: ignore[misc]
        assert values == node_values(fp)
        assert heartbeat == 1
    assert got["n1"][0] is got["n2"][0]  # equal records are decoded once, shared
    # n3 joins the majority: its old record is dropped
    with Inventory(p, values=GATE_VALUES) as inv:
        inv.upsert(fingerprint("n3", plugin_abi=8), now=2)
        inv.heartbeat("n1", now=5)
    conn = sqlite3.connect(p)
    assert conn.execute("SELECT count(*) FROM policy_values").fetchone()[0] == 1
    conn.close()
    with Inventory(p, readonly=True, values=GATE_VALUES) as inv:
        again = inv.load_values(["n1", "n3"])
    assert again["n1"][1] == 5 and again["n3"][1] == 2  # type: ignore[index]
    values = {h: (r[0] if r else None) for h, r in got.items() if h != "n9"}
    from_values = evaluate_values(values, PolicyConfig())
    assert from_values.to_dict() == evaluate(fps, PolicyConfig()).to_dict()


def test_gate_values_never_trust_an_unreadable_or_older_record(db: Path) -> None:
    """Undecodable values, or values of another GATE_VALUES.version, are computed again from
    the fingerprint; a node whose fingerprint is unreadable too is unknown (None)."""
    from ncclguard.config import PolicyConfig
    from ncclguard.policy import evaluate_values, node_values

    VALUES_VERSION = GATE_VALUES.version

    fps = {"n1": fingerprint("n1", plugin_abi=8),
           "n2": fingerprint("n2", nccl="2.18.3", plugin_abi=8),
           "n3": fingerprint("n3", plugin_abi=8)}
    with Inventory(db, values=GATE_VALUES) as inv:
        for fp in fps.values():
            inv.upsert(fp, now=1)
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute(
        "UPDATE policy_values SET policy_values = '{not json' WHERE policy_key = "
        "(SELECT policy_key FROM gate_nodes WHERE host = 'n2')"
    )
    conn.execute("UPDATE gate_nodes SET values_version = ? WHERE host = 'n3'",
                 (VALUES_VERSION - 1,))
    conn.close()
    with Inventory(db, readonly=True, values=GATE_VALUES) as inv:
        got = inv.load_values(["n1", "n2", "n3"])
    assert got["n2"][0] == node_values(fps["n2"])  # type: ignore[index]
    assert got["n3"][0] == node_values(fps["n3"])  # type: ignore[index]
    verdict = evaluate_values({h: r[0] for h, r in got.items() if r}, PolicyConfig())
    assert verdict.decision == "refuse" and verdict.odd_nodes == ["n2"]

    # the next daemon cycle rewrites the older record, though the fingerprint is the same
    with Inventory(db, values=GATE_VALUES) as inv:
        assert inv.upsert(fps["n3"], now=2) == "heartbeat"
        assert inv.upsert(fps["n3"], now=3) == "unchanged"
    conn = sqlite3.connect(db, isolation_level=None)
    assert conn.execute(
        "SELECT values_version FROM gate_nodes WHERE host = 'n3'").fetchone()[0] == VALUES_VERSION
    conn.execute(
        "UPDATE nodes SET fingerprint = '{broken' WHERE host = 'n2'")
    conn.close()
    with Inventory(db, readonly=True, values=GATE_VALUES) as inv:
        assert inv.load_values(["n2"])["n2"] is None  # nothing readable: unknown


@pytest.mark.parametrize("readonly", [False, True])
@pytest.mark.parametrize(
    ("file_mode", "dir_mode", "refused"),
    [(0o646, 0o755, True), (0o664, 0o755, False), (0o644, 0o757, True), (0o644, 0o775, False),
     (0o644, 0o1757, True)],
    ids=["file-o+w", "file-g+w", "dir-o+w", "dir-g+w", "dir-sticky-o+w"],
)  # fmt: skip
def test_only_the_other_write_bit_refuses(
    db: Path, readonly: bool, file_mode: int, dir_mode: int, refused: bool
) -> None:
    """Others' write bit refuses the file or its directory; the group's does not (the
    modes 0o666/0o777 of the tests above have both, so a check of the wrong bit hid)."""
    Inventory(db, values=GATE_VALUES).close()
    os.chmod(db, file_mode)
    os.chmod(db.parent, dir_mode)
    try:
        if refused:
            with pytest.raises(InventoryUnsafe, match="refusing"):
                Inventory(db, values=GATE_VALUES, readonly=readonly)
        else:
            Inventory(db, values=GATE_VALUES, readonly=readonly).close()
    finally:
        os.chmod(db.parent, 0o755)


def test_a_transient_error_is_shown_but_is_not_a_change(db: Path) -> None:
    """Issue 12: errors were part of the fingerprint hash, so a node whose probe failed
    now and then alternated between two fingerprints, a history row each time (6 MB a
    simulated day). Now the errors are stored and shown, and only the stack is a change."""
    clean = fingerprint("n1", plugin_abi=8)
    flaky = fingerprint("n1", plugin_abi=8)
    flaky["errors"] = [{"probe": "rdma", "field": "rdma.devices[mlx5_0].fw_ver",
                        "path": "/sys/class/infiniband/mlx5_0/fw_ver", "error": "[Errno 5] EIO"}]
    with Inventory(db, values=GATE_VALUES, heartbeat_s=300) as inv:
        statuses = [inv.upsert(flaky if i % 2 else clean, now=1000 + i) for i in range(100)]
        assert statuses[0] == "inserted" and "changed" not in statuses
        assert len(inv.history("n1")) == 1
        rec = inv.load(["n1"])["n1"]
        assert rec is not None and rec.fingerprint["errors"] == flaky["errors"]  # the latest
        assert inv.nodes()[0]["error_count"] == 1
        assert inv.upsert(clean, now=2000) == "heartbeat"  # the errors went away: shown
        assert inv.load(["n1"])["n1"].fingerprint["errors"] == []  # type: ignore[union-attr]
        # the stack did
        assert inv.upsert(fingerprint("n1", "2.18.3", plugin_abi=8), now=3000) == "changed"
        assert len(inv.history("n1")) == 2


def test_history_is_kept_for_history_days(db: Path) -> None:
    """Issue 12: history had no bound; rows older than ``inventory.history_days`` go,
    except what each node had at the cutoff (``fingerprint_at`` inside the window must
    not change) and so its newest."""
    day = 86400.0
    with Inventory(db, values=GATE_VALUES) as inv:
        for i, v in enumerate(["2.18.3", "2.21.5", "2.23.4"]):
            inv.upsert(fingerprint("n1", v, plugin_abi=8), now=1000 + i * 100 * day)
        inv.upsert(fingerprint("n2", plugin_abi=8), now=1000)
        at80 = inv.fingerprint_at("n1", 1000 + 80 * day)
        assert inv.prune_history(1000 + 250 * day, keep_days=0) == 0
        assert inv.prune_history(1000 + 250 * day, keep_days=180) == 0  # day 0 is day 70's
        assert inv.fingerprint_at("n1", 1000 + 80 * day) == at80
        assert inv.prune_history(1000 + 900 * day, keep_days=180) == 2  # days 0 and 100
        assert [(h["host"], h["at"]) for h in inv.history()] == [
            ("n1", 1000 + 200 * day), ("n2", 1000)]
        assert inv.fingerprint_at("n2", 1000 + 900 * day) is not None


def test_a_new_hash_of_the_same_fingerprint_is_no_change(db: Path) -> None:
    """An upgrade that hashes otherwise (issue 12 left the errors out): the first record
    after it is a heartbeat, not a change with an empty diff."""
    fp = fingerprint("n1", plugin_abi=8)
    with Inventory(db, values=GATE_VALUES) as inv:
        inv.upsert(fp, now=1000)
        conn = inv._conn
        conn.execute("UPDATE nodes SET fp_hash = 'an-older-formula' WHERE host = 'n1'")
        assert inv.upsert(fp, now=2000) == "heartbeat"
        assert len(inv.history("n1")) == 1


def test_a_world_writable_ancestor_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    """Review of issue 12: only the file and its directory were checked. A directory
    above them that anyone may write, without the sticky bit (unlike /tmp), lets anyone
    swap the inventory's directory."""
    top = tmp_path / "shared"
    (top / "ncclguard").mkdir(parents=True)
    Inventory(top / "ncclguard" / "inventory.db", values=GATE_VALUES).close()
    os.chmod(top, 0o777)
    with pytest.raises(InventoryUnsafe, match=r"the directory .*shared above it has mode"):
        Inventory(top / "ncclguard" / "inventory.db", readonly=True)
    os.chmod(top, 0o1777)  # sticky, as /tmp: others cannot rename what is not theirs
    Inventory(top / "ncclguard" / "inventory.db", readonly=True).close()


def test_migrates_a_real_v3_inventory(tmp_path: Path) -> None:
    """``tests/data/store/inventory-v3.db`` was written by ncclguard before issue 13 (commit
    969d602; ``make_inventory_v3.py`` says how). The v3 -> v4 migration adds the plugin
    columns and fills them from each stored fingerprint: ``new`` (a daemon of issue 13
    behind an old collector) gets its values, ``old`` (no ``effective`` part) stays NULL,
    i.e. unknown, until it publishes again."""
    import shutil

    p = tmp_path / "inventory.db"
    shutil.copyfile(Path(__file__).parent / "data" / "store" / "inventory-v3.db", p)
    os.chmod(p, 0o644)
    conn = sqlite3.connect(p)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
    conn.close()
    with pytest.raises(InventoryCorrupt, match="older"):
        Inventory(p, readonly=True)  # a reader never migrates
    with Inventory(p, values=GATE_VALUES) as inv:
        assert inv.schema_version() == SCHEMA_VERSION == 11
        rows = {r["host"]: r for r in inv.nodes({})}
    new, old = rows["new"], rows["old"]
    assert (new["tuner_plugin"], new["tuner_abi"]) == ("PackedTuner", 6)
    assert (new["profiler_plugin"], new["profiler_abi"]) == ("testprof", 7)
    assert (new["gin_plugin"], new["gin_abi"]) == ("PackedGin", 14)
    assert (new["env_plugin"], new["env_abi"]) == ("SiteEnv", 2)
    assert (new["rma_plugin"], new["rma_abi"]) == ("none", 0)
    assert all(old[c] is None for c in PLUGIN_COLUMNS)
    assert old["net_abi"] == 11 and old["nccl_version"] == "2.28.9"  # v3's columns kept
    with Inventory(p, readonly=True, values=GATE_VALUES) as ro:  # v3 records: recomputed
        got = ro.load_values(["new", "old"])
    assert got["new"][0]["rules"]["env-plugin"]["env plugin"] == "SiteEnv v2"  # type: ignore[index]
    assert got["old"][0]["rules"]["env-plugin"]["env plugin"] is None  # type: ignore[index]
