"""Readers leave nothing beside the inventory (issue 46: read-only commands left ``-wal`` and
``-shm`` files beside a copied database), and still see every write (docs/store.md,
"Readers leave no -wal or -shm").

A WAL database that no connection has open is read ``immutable=1``; a writer that comes
while it is read is noticed at the next read, which then goes through a plain ``mode=ro``
connection. The collector's live inventory (its ``-wal`` there) is read as before.
"""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path

import helpers.fingerprints as pf
import pytest
from helpers.cli import ok, run_cli
from helpers.collector import as_nobody
from helpers.inventory import build

from ncclguard.config import InventoryConfig
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory


def beside(db: Path) -> list[str]:
    """What lies beside ``db`` (its -wal, -shm, -journal)."""
    return sorted(p.name for p in db.parent.iterdir() if p.name != db.name)


def wal_copy(src: Path, dest: Path) -> Path:
    """``src`` switched to WAL and closed (its header says WAL; no -wal, no -shm), then
    copied to ``dest``: a copy of the collector's inventory, as an admin makes one."""
    c = sqlite3.connect(src)
    assert c.execute("PRAGMA journal_mode = wal").fetchone()[0] == "wal"
    c.close()
    assert not Path(f"{src}-wal").exists()
    shutil.copyfile(src, dest)
    return dest


@pytest.fixture
def copy(tmp_path: Path) -> Iterator[Path]:
    """A WAL copy of a two-node inventory, alone in a directory (0755, as an admin's)."""
    from helpers.inventory import NodeSpec

    built = build(tmp_path / "inv.db", {"n1": NodeSpec(), "n2": NodeSpec(nccl="2.18.3")})
    d = Path(tempfile.mkdtemp(prefix="ncclguard-copy-"))
    d.chmod(0o755)
    try:
        yield wal_copy(built, d / "copy.db")
    finally:
        shutil.rmtree(d)


def test_read_only_commands_leave_no_wal_or_shm_beside_a_copy(copy: Path,
                                                              tmp_path: Path) -> None:
    """Before: ``ncclguard nodes --db COPY`` left COPY-wal and COPY-shm (SQLite creates
    them for a WAL database and a ``mode=ro`` reader cannot delete them)."""
    cfg = tmp_path / "config.toml"
    cfg.write_text("")
    for cmd in (("nodes",), ("classes",), ("show", "n1"), ("diff", "n1", "n2"),
                ("check", "n[1-2]")):
        r = run_cli(*cmd, db=copy, config=cfg)
        assert r.exit_code in (0, 2), (cmd, r.output)
        assert "n1" in r.stdout and beside(copy) == [], (cmd, beside(copy))
    with Inventory(copy, readonly=True, values=GATE_VALUES) as ro:  # the gate's open
        assert sorted(h for h, v in ro.load_values(["n1", "n2"]).items() if v) == ["n1", "n2"]
    assert beside(copy) == []
    assert "2.18.3" in ok(run_cli("nodes", db=copy, config=cfg)).stdout


@pytest.mark.parametrize("writer", ["still open", "closed", "back to delete"])
def test_a_writer_that_comes_while_it_is_read_is_seen(copy: Path, writer: str) -> None:
    """A reader that opened the copy ``immutable=1`` (no writer then) reads what a writer
    wrote since: the writer's -wal while it has the file open, else the file's new size
    and mtime (it has checkpointed and gone, back to a rollback journal or not) make it
    read the file again as it is now."""
    ro = Inventory(copy, readonly=True, values=GATE_VALUES)
    w = None
    try:
        assert ro.load(["n1"])["n1"] is not None and ro.load(["n3"])["n3"] is None
        assert beside(copy) == []  # read immutable: nothing created
        w = Inventory(copy, values=GATE_VALUES, config=InventoryConfig(journal_mode="wal"))
        w.upsert(pf.fingerprint("n3", nccl="2.21.5"))
        if writer == "back to delete":
            w.set_journal_mode("delete")  # the collector's clean stop: no -wal again
        if writer != "still open":
            w.close()
        assert ro.load(["n3"])["n3"] is not None  # the write, seen
        assert sorted(ro.hosts()) == ["n1", "n2", "n3"]
    finally:
        ro.close()
        if w is not None:
            w.close()  # the last connection of a WAL writer removes its -wal and -shm
    assert beside(copy) == []  # nothing left beside it


def test_the_live_inventory_is_read_as_before(copy: Path) -> None:
    """With a writer in WAL mode (the collector running: its -wal and -shm there), a reader
    opens ``mode=ro`` as before and sees the writer's uncheckpointed rows."""
    w = Inventory(copy, values=GATE_VALUES, config=InventoryConfig(journal_mode="wal"))
    try:
        w.upsert(pf.fingerprint("n3", nccl="2.21.5"))
        assert Path(f"{copy}-wal").exists()
        with Inventory(copy, readonly=True, values=GATE_VALUES) as ro:
            assert ro._frozen is None  # not immutable: a writer has it open
            assert ro.load(["n3"])["n3"] is not None
    finally:
        w.close()


def test_a_user_who_cannot_write_the_directory_reads_a_copy(copy: Path) -> None:
    """The gate's case (SlurmUser, who cannot write the inventory's directory): a WAL
    database no writer has open could not be read at all (SQLite had to create its -shm
    there: "attempt to write a readonly database"). Read immutable, it can."""
    r = as_nobody(copy, "read")
    assert r.returncode == 0 and r.stdout.strip() == "['n1', 'n2']", r.stderr
    assert beside(copy) == []


def test_a_read_in_the_writers_process_keeps_the_writers_locks(copy: Path) -> None:
    """A WAL writer's process that also reads the inventory (the collector's metrics do,
    in the collector's process) keeps its locks: the reader does not open the file itself
    while the writer's -wal is there (closing any descriptor of a file drops every POSIX
    lock the process holds on it, SQLite's among them). Before (issue 43), another
    process's writer with the default ``journal_mode = "delete"`` (the canary service)
    then switched the running collector's file out of WAL and removed its -wal and -shm."""
    import subprocess
    import sys

    code = ("import sys\nfrom ncclguard.config import InventoryConfig\n"
            "from ncclguard.policy import GATE_VALUES\nfrom ncclguard.store import Inventory\n"
            "w = Inventory(sys.argv[1], values=GATE_VALUES, heartbeat_s=0, "
            "config=InventoryConfig(journal_mode='wal'))\nw.heartbeat('n1')\n"
            "with Inventory(sys.argv[1], readonly=True) as r:\n    r.hosts()\n"
            "print('open', flush=True)\nsys.stdin.readline()\n")
    repo = Path(__file__).resolve().parents[1]
    writer = subprocess.Popen([sys.executable, "-c", code, str(copy)], cwd=repo, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "open\n"
        with Inventory(copy, values=GATE_VALUES) as other:  # journal_mode "delete"
            assert other._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        with open(copy, "rb") as f:
            assert f.read(20)[18] == 2  # still WAL for every new connection
        assert beside(copy) == ["copy.db-shm", "copy.db-wal"]
    finally:
        writer.kill()
        writer.wait(30)
