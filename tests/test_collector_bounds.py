"""One node cannot starve the collector or fill its disk (issue 25): per-node quotas
(bytes stored, changes an hour), disk pressure (a floor of free space, a full disk),
files that name no node, records nested too deep. Real munged daemons, real spool
files, real SQLite inventories (on a small tmpfs where a full disk is needed).

Before: a node publishing a changed 1 MB fingerprint every scan grew the inventory by
1.53 MB/s; on a full disk every batch failed and other nodes' changes were never
ingested; 100,000 junk files cost a 28 s scan; a fingerprint 500-900 levels deep was
accepted, and ``ncclguard history`` then failed with RecursionError."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.cli import run_cli
from helpers.collector import NODES, config, publish
from helpers.fingerprints import fingerprint
from helpers.munge import MungeSet
from helpers.parts import unavailable

from inventoryd.controller.collector import UNKNOWN_PER_SCAN, Collector
from ncclguard import config as configmod
from ncclguard import spool
from ncclguard.policy import GATE_VALUES
from ncclguard.policy.schedule import class_values
from ncclguard.store import Inventory
from ncclguard.store.quota import NOT_KEPT

SCANS = 300  # 10 minutes at the default scan_interval_s (2 s)
IS_ROOT = os.geteuid() == 0


def big_fp(host: str, i: int) -> dict[str, Any]:
    """A 1 MB fingerprint, another one each ``i``: 1,000,000 random hex characters as
    the raw /etc/nccl.conf (a real part; the credential stays under 1 MiB)."""
    fp = fingerprint(host, plugin_abi=8)
    fp["nccl_conf"]["raw"] = secrets.token_hex(500_000)
    fp["nccl_conf"]["present"] = True
    fp["host"]["collected_at"] = f"2026-11-30T02:{i // 60 % 60:02d}:{i % 60:02d}Z"
    return fp


def cfg_with(ms: MungeSet, d: Path, db: Path | None = None, **collector: Any
             ) -> configmod.Config:
    base = config(ms, d)
    data: dict[str, Any] = {
        "spool": {"dir": str(d), "munge_socket": str(ms.controller.socket)},
        "collector": {"publisher": base.collector.publisher,
                      "addresses": {n: list(a) for n, a in base.collector.addresses.items()},
                      **collector},
    }
    if db is not None:
        data["inventory"] = {"db": str(db)}
    return configmod.from_dict(data)


def stored_bytes(db: Path, host: str) -> int:
    with sqlite3.connect(db) as conn:
        (hist,) = conn.execute("SELECT coalesce(sum(bytes), 0) FROM history WHERE host = ?",
                               (host,)).fetchone()
        (cur,) = conn.execute("SELECT length(CAST(fingerprint AS BLOB)) FROM nodes "
                              "WHERE host = ?", (host,)).fetchone()
    return int(hist) + int(cur)


def test_a_node_changing_1mb_every_scan_is_stopped_by_its_quota_and_the_others_go_in(
        collector_env: Any) -> None:
    """n4 publishes a changed 1 MB record before every scan, 300 scans (10 minutes at
    the default interval): at most max_changes_per_hour of them are accepted, the rest
    are rejected as change-rate, counted; what n4 stores stays within its quota; every
    other node's change in that time is ingested by the scan that follows it."""
    ms, d, db = collector_env
    for h in NODES:
        publish(ms, d, h)
    cfg = cfg_with(ms, d)
    limit = cfg.collector.max_changes_per_hour
    c = Collector(cfg, db=db)
    accepted = 0
    causes: dict[str, int] = {}
    honest = 0
    try:
        assert set(c.scan().accepted.values()) == {"inserted"}
        for i in range(SCANS):
            publish(ms, d, "n4", big_fp("n4", i))
            mover = None
            if i % 10 == 5:  # an honest node's change now and then: a new libnccl
                mover = NODES[(i // 10) % 3]
                publish(ms, d, mover, fingerprint(mover, f"2.{18 + i // 10}.0", plugin_abi=8))
            res = c.scan()
            if res.accepted.get("n4") == "changed":
                accepted += 1
            if "n4.rec" in res.rejected:
                causes[res.rejected["n4.rec"]] = causes.get(res.rejected["n4.rec"], 0) + 1
            assert accepted <= limit, f"scan {i}: {accepted} changes of n4 accepted"
            if mover is not None:
                assert res.accepted.get(mover) == "changed", (i, mover, res)
                honest += 1
        # each change costs ~4 MB (its record, and a history row of its copy and a diff
        # of old and new): the 64 MiB quota stops it before the hour's 30 changes
        assert 0 < accepted <= limit and set(causes) <= {"change-rate", "over-quota"}, causes
        assert sum(causes.values()) == SCANS - accepted and honest == SCANS // 10
        assert sum(c.counts.get(k, 0) for k in causes) == SCANS - accepted
        assert stored_bytes(db, "n4") <= cfg.collector.node_quota_bytes
    finally:
        c.close()
    with Inventory(db, readonly=True, values=class_values(cfg.policy)) as inv:
        (row,) = [r for r in inv.rejections() if r["host"] == "n4"]
        assert row["cause"] in causes and "collector." in row["detail"]
        assert {r.hosts[0] for r in inv.classes() if r.values["nccl"] == "2.47.0"} == {"n3"}


def test_a_node_past_its_bytes_is_rejected_over_quota(collector_env: Any) -> None:
    """With no change rate, the bytes bound: n4's 1 MB changes (each a 1 MB record and a
    history row of ~3 MB: its copy and a diff of old and new) stop at
    node_quota_bytes; n1's change after that still goes in."""
    ms, d, db = collector_env
    for h in NODES:
        publish(ms, d, h)
    quota = 8 << 20
    c = Collector(cfg_with(ms, d, node_quota_bytes=quota, max_changes_per_hour=0), db=db)
    try:
        c.scan()
        seen = []
        for i in range(8):
            publish(ms, d, "n4", big_fp("n4", i))
            res = c.scan()
            seen.append(res.accepted.get("n4") or res.rejected.get("n4.rec"))
        assert seen[0] == "changed" and seen[-1] == "over-quota", seen
        assert stored_bytes(db, "n4") <= quota
        publish(ms, d, "n1", fingerprint("n1", "2.18.3", plugin_abi=8))
        assert c.scan().accepted == {"n1": "changed"}
    finally:
        c.close()
    with Inventory(db, readonly=True) as inv:
        row = next(r for r in inv.rejections() if r["host"] == "n4")
        assert "node_quota_bytes = 8.00 MiB" in row["detail"], row


def test_the_change_rate_window_slides(collector_env: Any) -> None:
    """The hour is the writer's clock (history.stored_at): once it has room, the node's
    next record is accepted. The hour is made to pass by dating its rows back."""
    ms, d, db = collector_env
    c = Collector(cfg_with(ms, d, max_changes_per_hour=2), db=db)
    try:
        for i, want in enumerate(["inserted", "changed", "change-rate"]):
            publish(ms, d, "n1", fingerprint("n1", f"2.{20 + i}.0", plugin_abi=8))
            res = c.scan()
            assert (res.accepted.get("n1") or res.rejected.get("n1.rec")) == want
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE history SET stored_at = stored_at - 3601")
        publish(ms, d, "n1", fingerprint("n1", "2.30.0", plugin_abi=8))
        assert c.scan().accepted == {"n1": "changed"}
    finally:
        c.close()


@contextlib.contextmanager
def small_tmpfs(size: str) -> Iterator[Path]:
    if not IS_ROOT or shutil.which("mount") is None:
        unavailable("mounting a tmpfs needs root (the suite runs as root)")
    d = Path(tempfile.mkdtemp(prefix="ncclguard-pressure-"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs",
                        str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        d.rmdir()
        pytest.fail(f"cannot mount a tmpfs: {r.stderr}")
    try:
        yield d
    finally:
        import gc

        gc.collect()  # the CLI's inventories (CliRunner keeps no process of its own)
        if subprocess.run(["umount", str(d)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(d)], check=False)
        d.rmdir()


def _cli(db: Path, *args: str) -> Any:
    return run_cli(*args, db=db)


def test_below_the_free_space_floor_records_are_still_written_without_history(
        collector_env: Any) -> None:
    """Free space below collector.min_free_bytes: a node's change still reaches the
    gate's tables (its history row keeps only when: NOT_KEPT), the CLI says the
    inventory cannot grow; above the floor again, history is kept again."""
    ms, d, _ = collector_env
    with small_tmpfs("64m") as fs:
        db = fs / "inventory.db"
        for h in NODES:
            publish(ms, d, h)
        c = Collector(cfg_with(ms, d, db, min_free_bytes=1 << 40), db=db)  # 1 TiB: always
        try:
            c.scan()
            publish(ms, d, "n2", fingerprint("n2", "2.18.3", plugin_abi=8))
            res = c.scan()
            assert res.accepted == {"n2": "changed"} and c.pressure is not None
        finally:
            c.close()
        with Inventory(db, readonly=True) as inv:
            assert inv.load(["n2"])["n2"].fingerprint["libnccl"][0]["version"] == "2.18.3"
            last = inv.history("n2")[-1]
            assert last["diff"][0]["new"] == NOT_KEPT
            assert inv.fingerprint_at("n2", time.time() + 10) is None  # not kept: unknown
            assert "min_free_bytes" in (inv.writer_state()[1] or "")
        out = _cli(db, "classes").output
        assert "freshness: the inventory cannot grow" in out, out
        assert NOT_KEPT in _cli(db, "history", "n2").output
        c = Collector(cfg_with(ms, d, db, min_free_bytes=0), db=db)
        try:
            c.scan()
            publish(ms, d, "n2", fingerprint("n2", "2.21.5", plugin_abi=8))
            assert c.scan().accepted == {"n2": "changed"} and c.pressure is None
        finally:
            c.close()
        with Inventory(db, readonly=True) as inv:
            assert inv.history("n2")[-1]["diff"][0]["field"] != ""
            assert inv.writer_state()[1] is None
        assert "cannot grow" not in _cli(db, "classes").output


def _fill(fs: Path) -> Path:
    """Fill ``fs`` with one file. Unbuffered: a buffered file keeps what the full disk
    refused and raises ENOSPC again when it is closed (Python 3.14 did, out of ``with``)."""
    filler = fs / "filler"
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while f.write(b"\0" * 65536):
            pass
    return filler


def test_on_a_full_disk_the_collector_judges_on_and_writes_when_it_can(collector_env: Any) -> None:
    """The inventory's disk full: no scan fails; every record is still judged; those
    that cannot be written are read again; once space is back the change goes in. The
    other nodes' judged records never stop (before: every batch failed)."""
    ms, d, _ = collector_env
    with small_tmpfs("8m") as fs:
        db = fs / "inventory.db"
        for h in NODES:
            publish(ms, d, h)
        c = Collector(cfg_with(ms, d, db, min_free_bytes=0), db=db)
        try:
            c.scan()
            filler = _fill(fs)
            publish(ms, d, "n2", big_fp("n2", 1))  # 1 MB more: it cannot fit
            publish(ms, d, "n3", fingerprint("n3", "2.18.3", plugin_abi=8))
            publish(ms, d, "n9", fingerprint("n9", plugin_abi=8))  # no such node: rejected, judged
            for _ in range(3):
                res = c.scan()  # no exception
                assert "n2" not in res.accepted and res.unwritten >= 1
            assert c.disk.write_failure is not None and c.pressure is not None
            filler.unlink()
            res = c.scan()
            assert res.accepted.get("n2") == "changed" and c.disk.write_failure is None
            assert res.accepted.get("n3") in ("changed", None)  # written when it fitted
        finally:
            c.close()
        with Inventory(db, readonly=True) as inv:
            got = inv.load(["n2", "n3"])
            assert got["n3"].fingerprint["libnccl"][0]["version"] == "2.18.3"
            assert len(got["n2"].fingerprint["nccl_conf"]["raw"]) == 1_000_000


def test_the_gate_and_the_cli_say_how_old_a_frozen_inventory_is(tmp_path: Path) -> None:
    """The collector's stamp 10 minutes old (it stopped, or could not write since):
    ``classes``, ``nodes`` and ``check`` say so, and so does the gate's log line."""
    from helpers.gate import run_gate

    db = tmp_path / "inventory.db"
    with Inventory(db, values=GATE_VALUES) as inv:
        for h in ("n1", "n2", "n3"):
            inv.upsert(fingerprint(h, plugin_abi=8))
        inv.stamp("writing the inventory failed: disk full", now=time.time() - 600)
    for args in (["classes"], ["nodes"], ["check", "n[1-3]"]):
        out = _cli(db, *args).output
        assert "has not been written for 10 min" in out and "disk full" in out, (args, out)
    r, _ = run_gate(tmp_path, "")
    assert "the inventory has not been written for 10 min" in r.stderr, r.stderr


def test_files_that_name_no_node_cost_a_bounded_share_of_each_scan(collector_env: Any) -> None:
    """20,000 junk files (each 2 MiB, past max_record_bytes) and one real change: the
    change goes in at the first scan; each scan judges at most UNKNOWN_PER_SCAN junk
    files, all as unknown-node, none of them read (read, they would be oversized)."""
    ms, d, db = collector_env
    for h in NODES:
        publish(ms, d, h)
    for i in range(20_000):
        with open(d / f"junk{i:05d}.rec", "wb") as f:
            f.truncate(2 << 20)
    c = Collector(config(ms, d), db=db)
    try:
        res = c.scan()
        assert set(res.accepted) == set(NODES)
        assert len(res.rejected) <= UNKNOWN_PER_SCAN and res.postponed > 19_000
        assert set(res.rejected.values()) == {"unknown-node"}
        publish(ms, d, "n2", fingerprint("n2", "2.18.3", plugin_abi=8))
        res = c.scan()
        assert res.accepted.get("n2") == "changed" and len(res.rejected) <= UNKNOWN_PER_SCAN
    finally:
        c.close()


def _nested(depth: int) -> dict[str, Any]:
    fp = fingerprint("n1", plugin_abi=8)
    x: dict[str, Any] = {}
    fp["gpu"]["extra"] = x
    for _ in range(depth):
        x["a"] = {}
        x = x["a"]
    return fp


def test_a_fingerprint_nested_too_deep_is_rejected_and_history_reads_every_record(
        collector_env: Any) -> None:
    """900 levels (Python's json reads it): rejected as too-deep before anything is
    written; one at the bound is accepted, and every command reads it."""
    ms, d, db = collector_env
    c = Collector(config(ms, d), db=db)
    try:
        publish(ms, d, "n1")
        c.scan()
        publish(ms, d, "n1", _nested(900))
        assert c.scan().rejected == {"n1.rec": "too-deep"}
        publish(ms, d, "n1", _nested(spool_depth_left()))
        assert c.scan().accepted == {"n1": "changed"}
    finally:
        c.close()
    for args in (["history"], ["history", "n1"], ["show", "n1"], ["nodes"], ["classes"]):
        r = _cli(db, *args)
        assert r.exit_code == 0, (args, r.output, r.exception)


def spool_depth_left() -> int:
    """How many more levels fit under fp["gpu"]["extra"] within MAX_DEPTH."""
    from ncclguard.fingerprint.shape import MAX_DEPTH

    return MAX_DEPTH - 4


def test_a_record_past_the_bounds_is_rejected_by_the_spool_reader() -> None:
    from ncclguard.fingerprint.shape import MAX_KEY, MAX_VALUES

    fp1 = fingerprint("n1", plugin_abi=8)
    for fp in (_nested(40), {**fp1, "gpu": {"models": [0] * (MAX_VALUES + 1)}},
               {**fp1, "gpu": {"k" * (MAX_KEY + 1): 1}}):
        with pytest.raises(spool.RecordError) as e:
            spool.parse_payload(spool.payload(fp), max_bytes=1 << 24)
        assert e.value.cause == "too-deep"
    long_keys: dict[str, Any] = {}
    x = long_keys
    for i in range(20):  # 20 keys of 250 characters above 10,000 values: 50 MB of names
        x[f"{i:03d}" + "k" * 247] = {}
        x = x[f"{i:03d}" + "k" * 247]
    x["v"] = list(range(10_000))
    with pytest.raises(spool.RecordError, match="field names"):
        spool.parse_payload(spool.payload({**fingerprint("n1", plugin_abi=8), "gpu": long_keys}),
                            max_bytes=1 << 24)
