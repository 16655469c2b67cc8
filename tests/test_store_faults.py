"""Fault tests: missing mount, read-only database and filesystem, corruption inside the
file, a lock held longer than the budget, a full disk, and writers with skewed clocks."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.fingerprints import fingerprint

from ncclguard.config import InventoryConfig
from ncclguard.policy import GATE_VALUES
from ncclguard.store import (
    Inventory,
    InventoryCorrupt,
    InventoryError,
    InventoryFull,
    InventoryLocked,
    InventoryMissing,
    InventoryReadOnly,
)

REPO = Path(__file__).resolve().parents[1]
IS_ROOT = os.geteuid() == 0


def test_missing_mount_is_not_papered_over(tmp_path: Path) -> None:
    """The parent of the inventory's directory is missing (an unmounted share): the writer
    must not create the tree under the mount point."""
    db = tmp_path / "mnt" / "shared" / "ncclguard" / "inventory.db"
    with pytest.raises(InventoryMissing, match=r"does not exist \(missing mount\?\)"):
        Inventory(db, values=GATE_VALUES)
    assert not (tmp_path / "mnt").exists()
    # only the last directory is created when its parent is there
    (tmp_path / "mnt" / "shared").mkdir(parents=True)
    with Inventory(db, values=GATE_VALUES) as inv:
        assert inv.upsert(fingerprint("n1", plugin_abi=8), now=1) == "inserted"


@contextlib.contextmanager
def _public_tmp() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ncclguard-ro-"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _write_as_nobody(db: str, out: str) -> None:
    """In a forked child: drop to nobody (root ignores mode bits), then try to write."""
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    try:
        Inventory(db, values=GATE_VALUES).upsert(fingerprint("n2", plugin_abi=8), now=5)
        result = "written"
    except InventoryError as e:
        result = f"{type(e).__name__} {e}"
    os.write(int(out), result.encode())


def test_read_only_database_is_a_named_error() -> None:
    with _public_tmp() as d:
        db = d / "inv" / "inventory.db"
        with Inventory(db, values=GATE_VALUES) as inv:
            inv.upsert(fingerprint("n1", plugin_abi=8), now=1)
        if IS_ROOT:  # root ignores mode bits: write as an unprivileged user instead
            r, w = os.pipe()
            child = mp.get_context("fork").Process(target=_write_as_nobody, args=(str(db), str(w)))
            child.start()
            child.join(30)
            os.close(w)
            got = os.read(r, 4096).decode()
            os.close(r)
            assert got.startswith("InventoryReadOnly read-only inventory at " + str(db)), got
        else:
            os.chmod(db, 0o444)
            with pytest.raises(InventoryReadOnly, match=str(db)):
                Inventory(db, values=GATE_VALUES).upsert(fingerprint("n2", plugin_abi=8), now=5)
        with Inventory(db, readonly=True) as ro:  # readers are not affected
            assert ro.hosts() == ["n1"]


def _mount(args: list[str]) -> bool:
    if not IS_ROOT or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ncclguard-full-"))
    # an empty inventory of schema 11 is 156 KiB: 256k left no room for its first write
    # and that write's rollback journal
    if not _mount(["-t", "tmpfs", "-o", "size=512k,mode=0755", "tmpfs", str(d)]):
        d.rmdir()
        pytest.skip("cannot mount a tmpfs here (needs root); the SQLITE_FULL test still runs")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)
        d.rmdir()


def test_read_only_filesystem(small_tmpfs: Path) -> None:
    db = small_tmpfs / "inv" / "inventory.db"
    with Inventory(db, values=GATE_VALUES) as inv:
        inv.upsert(fingerprint("n1", plugin_abi=8), now=1)
    assert _mount(["-o", "remount,ro", str(small_tmpfs)])
    with pytest.raises(InventoryReadOnly, match=str(db)), Inventory(db, values=GATE_VALUES) as inv:
        inv.upsert(fingerprint("n1", "2.23.4", plugin_abi=8), now=2)
    with Inventory(db, readonly=True) as ro:
        rec = ro.load(["n1"])["n1"]
        assert rec is not None and rec.fingerprint["libnccl"][0]["version"] == "2.21.5"


def _fill_until_full(inv: Inventory) -> tuple[int, InventoryError]:
    for i in range(10_000):
        try:
            inv.upsert(fingerprint(f"n{i}", conf={"X": "Y" * 4000}, plugin_abi=8), now=1)
        except InventoryError as e:
            return i, e
    raise AssertionError("never filled up")


def test_disk_full_on_a_small_tmpfs(small_tmpfs: Path) -> None:
    db = small_tmpfs / "inv" / "inventory.db"
    with Inventory(db, values=GATE_VALUES) as inv:
        written, err = _fill_until_full(inv)
        assert isinstance(err, InventoryFull), err
        assert str(db) in str(err) and "disk full" in str(err)
        assert written > 0
        assert inv.integrity_check() == "ok"
        assert len(inv.hosts()) == written  # the failed write left nothing behind


def test_disk_full_at_the_sqlite_limit(tmp_path: Path) -> None:
    """SQLITE_FULL without a small filesystem: the page limit makes SQLite hit it."""
    db = tmp_path / "inv" / "inventory.db"
    with Inventory(db, values=GATE_VALUES) as inv:
        inv._conn.execute("PRAGMA max_page_count = 40")
        written, err = _fill_until_full(inv)
        assert isinstance(err, InventoryFull), err
        assert str(db) in str(err)
        assert inv.integrity_check() == "ok"
        assert len(inv.hosts()) == written


def test_corruption_inside_a_database_is_named(tmp_path: Path) -> None:
    db = tmp_path / "inv" / "inventory.db"
    with Inventory(db, values=GATE_VALUES) as inv:
        for i in range(50):
            inv.upsert(fingerprint(f"n{i}", plugin_abi=8), now=1)
    data = bytearray(db.read_bytes())
    page = 4096
    for off in range(2 * page, len(data), page):  # keep the header page, trash the rest
        data[off : off + page] = b"\xa5" * page
    db.write_bytes(bytes(data))
    # named at open or at the first read, depending on which pages the open reads (the
    # v5 schema's tables reach past the header page)
    with pytest.raises(InventoryCorrupt, match=str(db)), Inventory(db, readonly=True) as ro:
        ro.load([f"n{i}" for i in range(50)])


_HOLDER = r"""
import sqlite3, sys, time
c = sqlite3.connect({db!r}, isolation_level=None)
c.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.readline()
c.execute("ROLLBACK")
"""


def test_lock_held_longer_than_the_budget(tmp_path: Path) -> None:
    db = tmp_path / "inv" / "inventory.db"
    with Inventory(db, values=GATE_VALUES) as inv:
        inv.upsert(fingerprint("n1", plugin_abi=8), now=1)
    cfg = InventoryConfig(busy_timeout_ms=100, write_retries=2)
    inv = Inventory(db, values=GATE_VALUES, config=cfg)  # the daemon's open connection
    ro = Inventory(db, readonly=True, config=cfg)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER.format(db=str(db))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdin is not None
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(InventoryLocked, match=str(db)):
            Inventory(db, values=GATE_VALUES, config=cfg)  # opening is bounded by the budget too
        with inv:
            t0 = time.monotonic()
            with pytest.raises(InventoryLocked, match=r"still busy after 3 tries") as ei:
                inv.upsert(fingerprint("n1", "2.23.4", plugin_abi=8), now=2)
            assert time.monotonic() - t0 < 5  # bounded by the budget
            assert str(db) in str(ei.value)
            with pytest.raises(InventoryLocked, match=str(db)):
                Inventory(db, readonly=True, config=cfg)  # the gate's open
            with pytest.raises(InventoryLocked, match=str(db)):
                ro.load(["n1"])  # the gate's read
            holder.stdin.write("\n")
            holder.stdin.flush()
            assert holder.wait(timeout=10) == 0
            # writes as soon as it can
            assert inv.upsert(fingerprint("n1", "2.23.4", plugin_abi=8), now=3) == "changed"
            ro.close()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_clock_skew_between_writers(tmp_path: Path) -> None:
    """Each writer's row carries its own clock; a clock that went back still heartbeats,
    and history is read in write order, so no change hides behind an older timestamp."""
    db = tmp_path / "inv" / "inventory.db"
    t = 1_700_000_000.0
    with Inventory(db, values=GATE_VALUES, heartbeat_s=300) as inv:
        inv.upsert(fingerprint("fast", plugin_abi=8), now=t + 3600)  # an hour ahead
        inv.upsert(fingerprint("slow", plugin_abi=8), now=t - 3600)  # an hour behind
        inv.upsert(fingerprint("ok", plugin_abi=8), now=t)
        # the controller's clock decides staleness; skew is within the admin's ttl or not
        assert inv.stale(now=t, ttl=900) == ["slow"]
        assert inv.stale(now=t, ttl=7200) == []
        # "fast" is corrected by NTP: its clock jumps back an hour
        assert inv.upsert(fingerprint("fast", plugin_abi=8), now=t + 10) == "heartbeat"
        assert inv.load(["fast"])["fast"].last_heartbeat == t + 10  # type: ignore[union-attr]
        assert inv.upsert(fingerprint("fast", "2.23.4", plugin_abi=8), now=t + 20) == "changed"
        hist = inv.history("fast")
        assert [h["at"] for h in hist] == [t + 3600, t + 20]
        # the newest change written at or before t+30 is the corrected one
        assert inv.fingerprint_at("fast", t + 30)["libnccl"][0]["version"] == "2.23.4"  # type: ignore[index]
        assert inv.fingerprint_at("fast", t) is None
        # another writer (for example `once --store` from an admin host) with a skewed clock
        assert inv.upsert(fingerprint("ok", plugin_abi=8), now=t - 50) == "heartbeat"
        assert inv.integrity_check() == "ok"
    raw = sqlite3.connect(db)
    assert raw.execute("SELECT count(*) FROM history").fetchone()[0] == 4
    raw.close()
