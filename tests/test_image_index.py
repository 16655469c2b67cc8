"""The image index: found under the roots, scanned when new or changed, stored by the
inventory's writer (schema v5), read by the gate's narrow path."""

from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path

import pytest

from devtools import images
from devtools.ncclwheels import PartUnavailable
from inventoryd.images.index import update_index
from ncclguard.config import ImagesConfig
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory, InventoryCorrupt
from ncclguard.store.schema import SCHEMA_VERSION
from tests.conftest import build_plugin, unavailable

DATA = Path(__file__).parent / "data" / "store"


def _nccl_image(out: Path, lib: Path, version: str, **kw: object) -> Path:
    try:
        return images.nccl_image(out, lib, version=version, **kw)  # type: ignore[arg-type]
    except PartUnavailable as e:
        unavailable(str(e))


def test_migrates_a_real_v4_inventory(tmp_path: Path) -> None:
    """``inventory-v4.db`` was written by the v4 code (commit 3e38422;
    ``make_inventory_v4.py``). v4 -> v5 adds the empty ``images`` table; nodes are kept."""
    p = tmp_path / "inventory.db"
    shutil.copyfile(DATA / "inventory-v4.db", p)
    os.chmod(p, 0o644)
    with sqlite3.connect(p) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 4
    with pytest.raises(InventoryCorrupt, match="older"):
        Inventory(p, readonly=True)
    with Inventory(p, values=GATE_VALUES) as inv:
        assert inv.schema_version() == SCHEMA_VERSION == 5
        assert inv.images() == []
        assert sorted(inv.hosts()) == ["new", "old"]
        assert inv.heartbeats()["new"] == 1_800_000_600
    with Inventory(p, readonly=True, values=GATE_VALUES) as ro:
        assert ro.load_image_values("/x.sqsh") is None
        assert ro.load_values(["new"])["new"] is not None


def test_index_scans_new_and_changed_images_and_forgets_gone_ones(
        tmp_path: Path, nccl_lib) -> None:
    root = tmp_path / "images"
    (root / "team").mkdir(parents=True)
    plugin = build_plugin(tmp_path / "pl", [8, 7], name="IBext_v8")
    a = _nccl_image(root / "team" / "a.sqsh", nccl_lib("2.21.5"), "2.21.5",
                    plugins={"/usr/lib/x86_64-linux-gnu/libnccl-net.so": plugin})
    (root / "junk.sqsh").write_bytes(b"junk" * 1000)
    (root / "link.sqsh").symlink_to(a)  # never followed
    (root / "notes.txt").write_text("not an image")
    cfg = ImagesConfig(roots=(str(root),))
    db = tmp_path / "inv.db"
    with Inventory(db, values=GATE_VALUES) as inv:
        res = update_index(inv, cfg)
        assert res.scanned == [str(a)]
        assert list(res.failed) == [str(root / "junk.sqsh")]
        rows = {r["path"]: r for r in inv.images()}
        assert rows[str(a)]["nccl_version"] == "2.21.5"
        assert "unsquashfs failed" in rows[str(root / "junk.sqsh")]["error"]
        assert update_index(inv, cfg).scanned == []  # unchanged: not read again
        shown = inv.image(str(a))
        assert shown is not None and shown["record"]["net_plugin"].endswith("libnccl-net.so")
    with Inventory(db, readonly=True) as ro:
        got = ro.load_image_values(str(a))
        assert got is not None
        values, error = got
        assert error is None and values is not None
        assert values["nccl_version"] == "2.21.5" and values["net_abis"] == [8, 7, 6, 5]
        assert values["plugin"]["abis"] == [8, 7] and values["plugin"]["name"] == "IBext_v8"
        junk = ro.load_image_values(str(root / "junk.sqsh"))
        assert junk is not None and junk[0] is None
        assert "Can't find a valid SQUASHFS superblock" in str(junk[1])
    # replaced under the same path: scanned again; removed: forgotten
    _nccl_image(tmp_path / "b.sqsh", nccl_lib("2.18.3"), "2.18.3")
    os.replace(tmp_path / "b.sqsh", a)
    (root / "junk.sqsh").unlink()
    with Inventory(db, values=GATE_VALUES) as inv:
        res = update_index(inv, cfg)
        assert res.scanned == [str(a)] and res.gone == [str(root / "junk.sqsh")]
        assert [r["nccl_version"] for r in inv.images()] == ["2.18.3"]


def test_an_image_changed_with_its_mtime_set_back_is_scanned_again(
        tmp_path: Path, nccl_lib) -> None:
    root = tmp_path / "images"
    root.mkdir()
    a = _nccl_image(root / "a.sqsh", nccl_lib("2.21.5"), "2.21.5")
    cfg = ImagesConfig(roots=(str(root),))
    with Inventory(tmp_path / "inv.db", values=GATE_VALUES) as inv:
        assert update_index(inv, cfg).scanned == [str(a)]
        st = os.stat(a)
        data = bytearray(a.read_bytes())
        data[:4] = b"junk"  # same size
        a.write_bytes(bytes(data))
        os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))  # touch -d: mtime back
        assert os.stat(a).st_mtime_ns == st.st_mtime_ns and os.stat(a).st_size == st.st_size
        res = update_index(inv, cfg)
        assert list(res.failed) == [str(a)]  # read again (its ctime moved): now unreadable


def test_a_failure_that_is_not_about_the_image_is_tried_again(tmp_path: Path, nccl_lib) -> None:
    root = tmp_path / "images"
    root.mkdir()
    a = _nccl_image(root / "a.sqsh", nccl_lib("2.21.5"), "2.21.5")
    with Inventory(tmp_path / "inv.db", values=GATE_VALUES) as inv:
        missing = ImagesConfig(roots=(str(root),), unsquashfs=str(tmp_path / "no-unsquashfs"))
        res = update_index(inv, missing)
        assert list(res.failed) == [str(a)] and "cannot run" in res.failed[str(a)]
        # squashfs-tools installed since: read at the next pass, not "unreadable" for ever
        assert update_index(inv, ImagesConfig(roots=(str(root),))).scanned == [str(a)]


def test_a_stored_image_value_of_the_wrong_shape_is_recomputed(tmp_path: Path, nccl_lib) -> None:
    root = tmp_path / "r"
    root.mkdir()
    a = _nccl_image(root / "a.sqsh", nccl_lib("2.21.5"), "2.21.5")
    db = tmp_path / "inv.db"
    with Inventory(db, values=GATE_VALUES) as inv:
        update_index(inv, ImagesConfig(roots=(str(root),)))
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE images SET image_values = '{\"v\": 1, \"nccl_version\": 5}'")
    with Inventory(db, readonly=True) as ro:
        got = ro.load_image_values(str(a))
    assert got is not None and got[0] is not None and got[0]["nccl_version"] == "2.21.5"


def test_the_scan_budget_leaves_the_rest_for_the_next_pass(tmp_path: Path) -> None:
    root = tmp_path / "r"
    root.mkdir()
    for i in range(3):
        try:
            images.build_image(root / f"{i}.sqsh", {"/etc/rc": f"{i}\n"})
        except PartUnavailable as e:
            unavailable(str(e))
    with Inventory(tmp_path / "inv.db", values=GATE_VALUES) as inv:
        res = update_index(inv, ImagesConfig(roots=(str(root),)), budget_s=0)
        assert len(res.scanned) == 1 and res.left == 2
        res = update_index(inv, ImagesConfig(roots=(str(root),)))
        assert len(res.scanned) == 2 and res.left == 0


def test_a_bug_on_one_image_is_stored_as_its_error(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from inventoryd.images import index

    root = tmp_path / "r"
    root.mkdir()
    (root / "a.sqsh").write_bytes(b"x")

    def boom(*_: object, **__: object) -> dict:
        raise RuntimeError("a bug")

    monkeypatch.setattr(index, "scan_image", boom)
    with Inventory(tmp_path / "inv.db", values=GATE_VALUES) as inv:
        res = update_index(inv, ImagesConfig(roots=(str(root),)))
        assert "RuntimeError: a bug" in res.failed[str(root / "a.sqsh")]
        assert "internal error" in inv.images()[0]["error"]
