"""Many real writer processes on one database, and a writer killed inside its transaction."""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.fingerprints import fingerprint

from ncclguard.config import InventoryConfig
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory, InventoryLocked

REPO = Path(__file__).resolve().parents[1]
WRITERS = 64
OPS = 200  # per writer: alternately a fingerprint change and a heartbeat
BASE = 1_700_000_000.0


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """tmpfs when there is one: the test is about locking, not about the disk's fsync."""
    parent = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    d = Path(tempfile.mkdtemp(prefix="ncclguard-conc-", dir=parent))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        for p in sorted(d.rglob("*"), reverse=True):
            p.unlink() if not p.is_dir() else p.rmdir()
        d.rmdir()


def _writer(db: str, i: int, out: str) -> None:
    result: dict[str, object] = {"counts": {}, "error": None}
    try:
        inv = Inventory(db, values=GATE_VALUES, config=InventoryConfig(), heartbeat_s=300)
        counts: dict[str, int] = {}
        host = f"w{i:02d}"
        fp = fingerprint(host, plugin_abi=8)
        for j in range(OPS):
            if j % 2 == 0:
                fp = fingerprint(host, conf=f"NCCL_DEBUG=WARN{j}", plugin_abi=8)
            status = inv.upsert(fp, now=BASE + j * 1000)
            counts[status] = counts.get(status, 0) + 1
        inv.close()
        result["counts"] = counts
    except BaseException as e:  # reported to the parent, which fails the test
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    Path(out).write_text(json.dumps(result))


@pytest.mark.slow
def test_64_writers_lose_nothing_and_never_leak_locked(shm_dir: Path) -> None:
    db = shm_dir / "inv" / "inventory.db"
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(target=_writer, args=(str(db), i, str(shm_dir / f"r{i}.json")))
        for i in range(WRITERS)
    ]
    for p in procs:  # all start on a fresh file: the schema is created exactly once
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    errors = []
    for i in range(WRITERS):
        r = json.loads((shm_dir / f"r{i}.json").read_text())
        if r["error"]:
            errors.append(r["error"])
            continue
        assert r["counts"] == {"inserted": 1, "changed": OPS // 2 - 1, "heartbeat": OPS // 2}
    assert not errors, errors[0]
    with Inventory(db, readonly=True) as inv:
        assert inv.integrity_check() == "ok"
        assert inv.schema_version() >= 1
        recs = inv.load([f"w{i:02d}" for i in range(WRITERS)])
        for host, rec in recs.items():
            assert rec is not None, host
            assert rec.fingerprint["nccl_conf"]["raw"] == f"NCCL_DEBUG=WARN{OPS - 2}"
            assert rec.last_heartbeat == BASE + (OPS - 1) * 1000
            hist = inv.history(host)
            assert len(hist) == OPS // 2
            assert [h["at"] for h in hist] == [BASE + j * 1000 for j in range(0, OPS, 2)]
            # the chain of hashes is unbroken: no change was lost or doubled
            assert all(b["old_hash"] == a["new_hash"] for a, b in itertools.pairwise(hist))
        assert len(inv.history()) == WRITERS * OPS // 2


_KILLED_WRITER = r"""
import os, sys, time
sys.path.insert(0, {tests!r})
from helpers.fingerprints import fingerprint
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory, InventoryLocked
inv = Inventory({db!r}, values=GATE_VALUES)
inv.upsert(fingerprint("n1", "2.21.5", plugin_abi=8), now=1000)
# a tiny page cache makes SQLite spill changed pages into the database file before
# COMMIT, so the kill leaves a half-written file and a hot journal behind
inv._conn.execute("PRAGMA cache_size = 2")
def stop(conn):
    print("in-transaction", flush=True)
    time.sleep(60)
inv._before_commit = stop
big = fingerprint("n1", "2.23.4", conf={{"X": "X" * 200000}}, plugin_abi=8)
inv.upsert(big, now=2000)
"""


def test_writer_killed_inside_its_transaction_leaves_the_previous_record(tmp_path: Path) -> None:
    db = tmp_path / "inv" / "inventory.db"
    code = _KILLED_WRITER.format(tests=str(REPO / "tests"), db=str(db))
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "in-transaction"
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(timeout=10) == -signal.SIGKILL
    journal = db.with_name(db.name + "-journal")
    assert journal.exists() and journal.stat().st_size > 0  # a hot journal was left behind

    # a read-only reader (the gate) cannot roll it back: a defined, named error
    with pytest.raises(InventoryLocked, match="hot journal"):
        Inventory(db, readonly=True, config=InventoryConfig(busy_timeout_ms=100))

    # the next writer rolls the hot journal back and finds the old record
    with Inventory(db, values=GATE_VALUES) as inv:
        assert inv.integrity_check() == "ok"
        rec = inv.load(["n1"])["n1"]
        assert rec is not None
        assert rec.fingerprint["libnccl"][0]["version"] == "2.21.5"
        assert rec.last_heartbeat == 1000
        assert [h["at"] for h in inv.history("n1")] == [1000]
        assert inv.upsert(fingerprint("n1", "2.23.4", plugin_abi=8), now=3000) == "changed"
    raw = sqlite3.connect(db)
    assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    raw.close()
