"""A user's own squashfs image against the image reader (issue 48): images built with the
real ``mksquashfs``, ELF files from gcc, each reproduction of the issue scaled down to a
few seconds and each failing before its fix (docs/threat-model.md, "Container images").

Over 500 lines: one test per reproduction of the issue and of its hostile review, each
with the images it builds; split, they would share nothing but this module's helpers."""

from __future__ import annotations

import io
import os
import struct
import time
import tracemalloc
import types
from pathlib import Path

import pytest
from helpers.parts import build_shared_lib, unavailable

from devtools import images
from devtools.ncclwheels import PartUnavailable
from inventoryd.controller.images import fingerprint
from inventoryd.controller.images.fingerprint import read_tree, scan_image
from inventoryd.controller.images.squashfs import ImageError, SquashImage


def _pack(tree: Path, out: Path) -> Path:
    try:
        return images.pack(tree, out)
    except PartUnavailable as e:
        unavailable(str(e))


def _files(d: Path, names: list[str], data: bytes = b"") -> None:
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        (d / n).write_bytes(data)


def _spellings(n: int) -> list[str]:
    """``n`` distinct spellings of ``/p`` that only the image's tree resolves
    (``/p/../q/../p``...): ``..`` may cross a symlink, so no spelling is simplified."""
    out = []
    for i in range(n):
        parts = []
        while i:
            parts.append("/q/.." if i & 1 else "/p/..")
            i >>= 1
        out.append("".join(parts) + "//./p")
    return out


def test_one_directory_named_many_ways_is_listed_once(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 48, item 1: ``ld.so.conf.d`` naming one directory of many files under 2,000
    spellings. Before: the directory was listed (and sorted) once per spelling, 42 s for
    100,000 files; now the search directories are resolved inside the image and each
    real directory is searched once, at most ``MAX_SEARCH_DIRS`` named."""
    tree = tmp_path / "t"
    _files(tree / "p", [f"libnccl-x{i}" for i in range(2000)])
    (tree / "q").mkdir()
    spell = _spellings(2000)
    assert len(set(spell)) == 2000
    (tree / "etc" / "ld.so.conf.d").mkdir(parents=True)
    for k in range(4):
        (tree / "etc" / "ld.so.conf.d" / f"{k}.conf").write_text(
            "\n".join(spell[k::4]) + "\n")
    img = _pack(tree, tmp_path / "s.sqsh")
    listed: list[str] = []
    real = SquashImage.children

    def spy(self: SquashImage, d: str) -> list[str]:
        listed.append(d if self.entry(d) is None else self.resolve(d))
        return real(self, d)

    monkeypatch.setattr(SquashImage, "children", spy)
    t = time.monotonic()
    rec = scan_image(str(img))
    took = time.monotonic() - t
    assert listed.count("/p") == 1, listed.count("/p")
    assert took < 3.0, took
    assert any("search directories" in e["error"] for e in rec["errors"]), rec["errors"]


def test_every_loop_of_the_tree_reader_is_under_the_deadline(tmp_path: Path) -> None:
    """Issue 48, item 1: the loops over the search directories and their names ran with
    no deadline check (a pure-Python loop of 10 min 42 s): with nothing to stream out,
    a deadline already past was never noticed. Now it is, in every loop."""
    tree = tmp_path / "t"
    _files(tree / "usr" / "lib", [f"libnccl-x{i}" for i in range(3000)])
    img = _pack(tree, tmp_path / "d.sqsh")
    im = SquashImage(str(img))
    im.deadline = time.monotonic() - 1
    with pytest.raises(ImageError, match="time limit reached"):
        read_tree(im)


def test_the_plugin_list_stops_at_its_cap_while_it_is_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 48, item 3: 10 directories of 1,000 ``libnccl-net-*.so`` with long names,
    each on ``LD_LIBRARY_PATH``: before, every one was listed as a plugin and the list cut
    to ``MAX_PLUGINS`` only after (6.2 GB for 400,000 files named 328 ways); now the list
    stops at its cap (4 here, 64 in use: fewer files to stream out), with an error that
    says so."""
    monkeypatch.setattr(fingerprint, "MAX_PLUGINS", 4)
    tree = tmp_path / "t"
    pad = "x" * 180
    dirs = [f"/d{j:02d}" for j in range(10)]
    for d in dirs:
        _files(tree / d.lstrip("/"), [f"libnccl-net-{pad}{i:04d}.so" for i in range(1000)])
    (tree / "etc").mkdir()
    (tree / "etc" / "environment").write_text("LD_LIBRARY_PATH=" + ":".join(dirs) + "\n")
    img = _pack(tree, tmp_path / "m.sqsh")
    read_tree(SquashImage(str(img)))  # once first: what a first read compiles or caches
    im = SquashImage(str(img))
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        rec = read_tree(im)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert len(rec["plugins"]) == 4
    assert any(e["field"] == "plugins" and "more than 4 plugin files" in e["error"]
               for e in rec["errors"]), rec["errors"]
    assert peak < 5_000_000, peak  # before: 6.7 MB; after: 3.6 MB, mostly 1 MiB read buffers


def test_many_distinct_conf_directories_are_capped_in_linear_time(tmp_path: Path) -> None:
    """Issue 48, item 4: ``ld.so.conf.d`` files of 64 KiB of distinct directories. Before:
    kept in lists searched by membership (quadratic: 63 s a pass for 64 such files) and
    all searched; now the named directories are deduplicated with a set and capped."""
    tree = tmp_path / "t"
    conf = tree / "etc" / "ld.so.conf.d"
    conf.mkdir(parents=True)
    for f in range(2):
        lines = [f"/d{f}/{i:06d}" for i in range(6500)]
        (conf / f"{f}.conf").write_text("\n".join(lines)[: 64 * 1024 - 1] + "\n")
    img = _pack(tree, tmp_path / "c.sqsh")
    t = time.monotonic()
    rec = scan_image(str(img))
    assert time.monotonic() - t < 3.0
    assert any(e["field"] == "linker" and "search directories" in e["error"]
               for e in rec["errors"]), rec["errors"]


def _section_bomb(src: Path, out: Path, count: int) -> Path:
    """``src`` (a real ELF64 LE file) with its section header table replaced by one of
    ``count`` entries in ELF's extended numbering: ``e_shnum`` 0, the count in the
    ``sh_size`` of section 0; the original sections keep their indexes."""
    data = bytearray(src.read_bytes())
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    assert shentsize == 64
    table = bytearray(data[shoff : shoff + shnum * 64])
    struct.pack_into("<Q", table, 32, count)  # sh_size of section 0
    table += bytes(64 * (count - shnum))
    data += bytes(-len(data) % 8)
    struct.pack_into("<Q", data, 0x28, len(data))
    struct.pack_into("<H", data, 0x3C, 0)  # e_shnum 0: the count is in section 0
    out.write_bytes(bytes(data + table))
    return out


def test_an_elf_section_bomb_is_refused_before_its_sections_are_read(tmp_path: Path) -> None:
    """Issue 48, item 2: a real shared object (gcc) whose section header table holds
    60,000 entries in extended numbering passed the header check (``e_shnum`` 0) and
    every entry was read (4M sections: 232 s and 347 MB for one image). Now the count is
    read from section 0 and bounded before any section is."""
    from inventoryd.elf import MAX_SECTIONS, ElfError, ElfReader
    from inventoryd.probes import nccl

    so = build_shared_lib(tmp_path / "libx.so", "libnccl.so.2",
                          'const char *v = "NCCL version 2.21.5+cuda12.4";\n')
    bomb = _section_bomb(so, tmp_path / "libnccl.so.2", 60_000)
    assert MAX_SECTIONS < 60_000
    t = time.monotonic()
    with open(bomb, "rb") as f:
        facts = nccl.analyze(f, str(bomb))
    assert time.monotonic() - t < 2.0
    assert facts["version"] is None
    assert f"more than {MAX_SECTIONS} section headers" in facts["version_error"]
    with open(bomb, "rb") as f, pytest.raises(ElfError, match=r"libnccl\.so\.2: .*60000"):
        ElfReader(f, str(bomb))
    # the same file under the bound: read as before, its banner found
    small = _section_bomb(so, tmp_path / "ok.so", 100)
    with open(small, "rb") as f:
        assert nccl.analyze(f, str(small))["version"] == "2.21.5"


def test_the_elf_analysis_is_under_the_image_deadline(tmp_path: Path) -> None:
    """Issue 48, item 2: no deadline was checked inside the ELF analysis (the section
    and symbol loops): now they call the reader's progress callback, which an image's
    analysis sets to check its deadline, and its ``TimeLimit`` is not taken for a
    malformed file."""
    from inventoryd.nodefs import TimeLimit, progress
    from inventoryd.probes import nccl

    so = build_shared_lib(tmp_path / "libx.so", "libnccl.so.2")
    many = _section_bomb(so, tmp_path / "libnccl.so.2", 3000)  # under the bound

    def late() -> None:
        raise TimeLimit("late")

    token = progress.set(late)
    try:
        with open(many, "rb") as f, pytest.raises(TimeLimit):
            nccl.analyze(f, str(many))
    finally:
        progress.reset(token)


def test_the_skipped_ranges_are_merged_and_found_by_bisection() -> None:
    """Issue 48, item 2: ``scan`` tested every skipped range for every 1 MiB chunk (4M
    ranges: a linear search per chunk). The ranges are merged, then found by bisection;
    what is skipped is the same."""
    from inventoryd.probes import nccl

    chunk = nccl.CHUNK
    data = bytearray(4 * chunk)
    data[10:40] = b"NCCL version 2.18.3+cuda12.2\0"
    data[chunk + 10 : chunk + 40] = b"NCCL version 9.9.9+cuda99.9\0"
    ranges = [(chunk + i, chunk + i + 1000) for i in range(0, chunk, 500)]  # overlapping
    ranges += [(0, 5)] * 1000
    last = max(range(0, chunk, 500))
    assert nccl.merge_ranges(ranges) == [(0, 5), (chunk, chunk + last + 1000)]
    s = nccl.scan(io.BytesIO(bytes(data)), ranges)
    assert s["banner"] == (2, 18, 3, 12, 2)
    data[10:40] = bytes(30)
    s = nccl.scan(io.BytesIO(bytes(data)), ranges)
    assert s["banner"] is None  # the second chunk lies wholly in a skipped range


def test_a_sparse_image_file_gets_the_read_bound_of_what_it_holds(tmp_path: Path) -> None:
    """Issue 48, item 5: an image file made 4 GiB with ``truncate``: the read bound was
    64x its ``st_size`` (2 GiB streamed out and written to the controller's tmp each
    pass for 64 GiB); now 64x the smaller of the blocks it has on disk and the squashfs
    superblock's ``bytes_used``."""
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(48 << 20)  # zeros: a few KB in the image
    tree = tmp_path / "t"
    (tree / "usr" / "lib").mkdir(parents=True)
    os.link(big, tree / "usr" / "lib" / "libnccl.so.2")
    img = _pack(tree, tmp_path / "sp.sqsh")
    used = img.stat().st_size
    os.truncate(img, 4 << 30)
    if img.stat().st_blocks * 512 >= 1 << 30:
        pytest.skip("this file system does not keep files sparse")
    im = SquashImage(str(img))
    assert im.read_left <= 64 * used + (1 << 20), (im.read_left, used)
    rec = read_tree(im)
    (lib,) = rec["libnccl"]
    assert lib["sha256"] is None and "read budget" in lib["version_error"]


def _count_scandir(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType) -> list[int]:
    """``[n]``: how many directory entries ``module``'s ``os.scandir`` pulled from now."""
    pulled = [0]
    real = os.scandir

    class Counting:
        def __init__(self, path: str) -> None:
            self.it = real(path)

        def __enter__(self) -> Counting:
            return self

        def __exit__(self, *a: object) -> None:
            self.it.close()

        def __iter__(self) -> Counting:
            return self

        def __next__(self) -> os.DirEntry[str]:
            e = next(self.it)
            pulled[0] += 1
            return e

        def close(self) -> None:
            self.it.close()

    monkeypatch.setattr(module.os, "scandir", Counting)  # type: ignore[attr-defined]
    return pulled


def test_the_walk_reads_a_huge_directory_lazily_and_goes_on_to_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 48, items 6 and 10: a user's directory of many entries under a root, met
    first. Before: listed and sorted whole before the walk's bound applied (1M hard links
    with long names: 835 MB), and it spent the whole bound, so another user's image next
    to it was never found. Now each directory is read lazily, at most
    what is left of the walk less ``max_images``, and the walk goes on to the next."""
    from inventoryd.controller.images import index
    from ncclguard.config import ImagesConfig

    root = tmp_path / "r"
    _files(root / "a-flood", [f"{i:05d}-{'y' * 100}" for i in range(600)])
    (root / "b").mkdir()
    (root / "b" / "good.sqsh").write_bytes(b"x")
    pulled = _count_scandir(monkeypatch, index)
    cfg = ImagesConfig(roots=(str(root),), max_images=20)  # 200 entries a walk
    found, complete = index.find_images(cfg)
    assert [p for p, _ in found] == [str(root / "b" / "good.sqsh")]
    assert not complete  # the flood was not read whole: its images may be missed
    assert pulled[0] <= index.SEEN_PER_IMAGE * cfg.max_images, pulled  # before: all 600


def test_sigterm_stops_the_image_reader_whatever_it_reads(tmp_path: Path) -> None:
    """Issue 48: SIGTERM was not looked at while an image was read (10 min 42 s in a
    pure-Python loop with SIGTERM ignored, and the watchdog fired). Now the collector's
    stop flag is checked wherever the image's deadline is: a read is given up, nothing
    is stored for the image, and the pass ends; the image is read after the restart."""
    import signal

    from inventoryd.controller.images.index import update_index
    from inventoryd.controller.images.tree import ImageStopped
    from inventoryd.loop import Signals
    from ncclguard.config import ImagesConfig
    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    tree = tmp_path / "t"
    _files(tree / "usr" / "lib", [f"libnccl-x{i}" for i in range(3000)])
    root = tmp_path / "r"
    root.mkdir()
    img = _pack(tree, root / "a.sqsh")
    calls = 0

    def soon() -> bool:  # asked to stop from the 5th look on (inside the tree reader)
        nonlocal calls
        calls += 1
        return calls >= 5

    with pytest.raises(ImageStopped, match="the collector is stopping"):
        scan_image(str(img), stop=soon)
    cfg = ImagesConfig(roots=(str(root),))
    with Inventory(tmp_path / "inv.db", values=GATE_VALUES) as inv, Signals() as s:
        os.kill(os.getpid(), signal.SIGTERM)  # the collector's own handler takes it
        assert s.stop
        res = update_index(inv, cfg, should_stop=lambda: s.stop)
        assert res.scanned == [] and res.failed == {} and res.left == 1
        assert inv.images() == []  # not stored as unreadable: read after the restart
        res = update_index(inv, cfg)
        assert res.scanned == [str(img)]


def test_a_stray_pip_libnccl_is_not_the_default_over_the_system_one(tmp_path: Path) -> None:
    """Issue 48, item 11: any ``site-packages/nvidia/nccl/lib/libnccl.so.2`` anywhere in
    an image was taken as what a job loads, over the system's. PyTorch, JAX and CuPy load
    pip's copy from the ``site-packages`` they are installed in: only such a copy is the
    default; a stray one is listed, and the linker's ``libnccl.so.2`` is the default."""
    sp = "/home/u/junk/lib/python3.10/site-packages"
    files = {"/usr/lib/libnccl.so.2": b"\x7fELF system",
             f"{sp}/nvidia/nccl/lib/libnccl.so.2": b"\x7fELF stray"}
    try:
        stray = images.build_image(tmp_path / "stray.sqsh", files)
        loaded = images.build_image(tmp_path / "torch.sqsh",
                                    {**files, f"{sp}/torch/__init__.py": b""})
    except PartUnavailable as e:
        unavailable(str(e))
    rec = scan_image(str(stray))
    assert {r["path"]: r["default"] for r in rec["libnccl"]} == {
        "/usr/lib/libnccl.so.2": True, f"{sp}/nvidia/nccl/lib/libnccl.so.2": False}
    rec = scan_image(str(loaded))  # torch beside it loads it (RPATH, _load_global_deps)
    assert {r["path"]: r["default"] for r in rec["libnccl"]} == {
        "/usr/lib/libnccl.so.2": False, f"{sp}/nvidia/nccl/lib/libnccl.so.2": True}


def test_a_directory_swapped_for_a_symlink_after_the_walk_indexes_no_decoy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 48, item 8: the user's directory swapped for a symlink to a decoy between
    the walk's ``lstat`` and the read. Before: the decoy's content was stored under the
    user's path, with the walk's identity, for good. Now the image is opened from the
    root one component at a time with ``O_NOFOLLOW``, checked against the walk's
    identity, and unsquashfs reads that descriptor."""
    from inventoryd.controller.images import index
    from ncclguard.config import ImagesConfig
    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    root = tmp_path / "r"
    (root / "u").mkdir(parents=True)
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    try:
        img = images.build_image(root / "u" / "a.sqsh", {"/etc/rc": "mine\n"})
        images.build_image(decoy / "a.sqsh", {"/etc/rc": "decoy\n"})
    except PartUnavailable as e:
        unavailable(str(e))
    walk = index.find_images

    def swap_after_walk(cfg: ImagesConfig) -> tuple[list, bool]:
        out = walk(cfg)
        os.rename(root / "u", tmp_path / "u-moved")
        os.symlink(decoy, root / "u")
        return out

    monkeypatch.setattr(index, "find_images", swap_after_walk)
    with Inventory(tmp_path / "inv.db", values=GATE_VALUES) as inv:
        res = index.update_index(inv, ImagesConfig(roots=(str(root),)))
        assert res.scanned == [] and list(res.failed) == [str(img)]
        assert "symlink" in res.failed[str(img)], res.failed
        row = inv.image(str(img))
        assert row is not None and row["record"] is None  # no decoy's content stored
    # the same file read by descriptor: its record is its own
    rec = scan_image(str(tmp_path / "u-moved" / "a.sqsh"))
    assert rec["rc"] == "mine\n"


def test_an_owner_who_filled_the_index_first_leaves_a_waiting_owner_a_share(
        tmp_path: Path) -> None:
    """Issue 48, item 9: images already indexed kept their room for ever, so a user who
    filled ``max_images`` first kept every later user's image out. Now each file owner
    has a fair share of ``max_images`` (max-min: what an owner does not need goes to the
    others); an owner over it gives up its last images (by path) to an owner waiting."""
    from inventoryd.controller.images.index import update_index
    from ncclguard.config import ImagesConfig
    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    root = tmp_path / "r"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    try:
        first = images.build_image(tmp_path / "x.sqsh", {"/etc/rc": "x\n"})
    except PartUnavailable as e:
        unavailable(str(e))
    data = first.read_bytes()
    for i in range(4):
        p = root / "a" / f"{i}.sqsh"
        p.write_bytes(data)
        os.chown(p, 65534, 65534)
    cfg = ImagesConfig(roots=(str(root),), max_images=4)
    with Inventory(tmp_path / "inv.db", values=GATE_VALUES) as inv:
        assert len(update_index(inv, cfg).scanned) == 4  # user a fills the index
        late = root / "b" / "mine.sqsh"
        late.write_bytes(data)  # another owner's (the test's uid)
        res = update_index(inv, cfg)
        assert res.scanned == [str(late)], res.scanned
        assert res.gone == [str(root / "a" / "3.sqsh")]  # a's last, over its share of 3
        assert sorted(r["path"] for r in inv.images()) == sorted(
            [*(str(root / "a" / f"{i}.sqsh") for i in range(3)), str(late)])
        again = update_index(inv, cfg)  # stable: nobody's share changed
        assert again.scanned == [] and again.gone == []


def test_an_indexed_image_the_walk_did_not_reach_is_checked_again(tmp_path: Path) -> None:
    """Issue 48, item 7: after a walk cut short, the images it did not reach kept their
    record without a check: one replaced meanwhile was judged by the old file's NCCL.
    Now each indexed image the walk missed is looked at by its path (``lstat``, no link
    followed at the end) and read again when its identity changed."""
    from inventoryd.controller.images.index import find_images, update_index
    from ncclguard.config import ImagesConfig
    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    root = tmp_path / "r"
    (root / "z").mkdir(parents=True)
    try:
        img = images.build_image(root / "z" / "a.sqsh", {"/etc/rc": "old\n"})
        images.build_image(tmp_path / "new.sqsh", {"/etc/rc": "new\n"})
    except PartUnavailable as e:
        unavailable(str(e))
    cfg = ImagesConfig(roots=(str(root),), max_images=2)  # 20 entries a walk
    with Inventory(tmp_path / "inv.db", values=GATE_VALUES) as inv:
        assert update_index(inv, cfg).scanned == [str(img)]
        for d in range(17):  # the root's 18 entries, listed, leave 2 for 18 directories
            _files(root / f"{d:02d}flood", [f"{i:03d}" for i in range(40)])
        os.replace(tmp_path / "new.sqsh", img)
        found, complete = find_images(cfg)
        assert found == [] and not complete  # z/ was not read
        res = update_index(inv, cfg)
        assert res.scanned == [str(img)] and res.gone == [], (res.scanned, res.gone)
        row = inv.image(str(img))
        assert row is not None and row["record"]["rc"] == "new\n"


def test_the_gate_reads_a_replaced_image_as_unknown(tmp_path: Path) -> None:
    """Issue 48, item 7: the gate read an image's values by its path only: an image
    replaced since it was indexed was judged by the old file's NCCL until the collector
    read it again. Now the gate's read (``check_file``, also ``ncclguard check``)
    compares the file's identity with the indexed one: a mismatch is unreadable for the
    moment, so the job is ``image-unknown``."""
    from inventoryd.controller.images.index import update_index
    from ncclguard.config import ImagesConfig
    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    root = tmp_path / "r"
    root.mkdir()
    try:
        img = images.build_image(root / "a.sqsh", {"/etc/rc": "old\n"})
        images.build_image(tmp_path / "new.sqsh", {"/etc/rc": "new\n"})
    except PartUnavailable as e:
        unavailable(str(e))
    with Inventory(tmp_path / "inv.db", values=GATE_VALUES) as inv:
        assert update_index(inv, ImagesConfig(roots=(str(root),))).scanned == [str(img)]
    with Inventory(tmp_path / "inv.db", readonly=True, values=GATE_VALUES) as ro:
        assert ro.load_image_values(str(img), check_file=True) == ro.load_image_values(
            str(img))
        os.replace(tmp_path / "new.sqsh", img)  # not read again yet
        values, why = ro.load_image_values(str(img), check_file=True)
        assert values is None and "changed since it was indexed" in str(why)
        img.unlink()
        values, why = ro.load_image_values(str(img), check_file=True)
        assert values is None and "cannot be looked at" in str(why)


def test_an_image_rewritten_under_a_future_mtime_is_no_longer_the_indexed_one(
        tmp_path: Path) -> None:
    """Issue 48's hostile review: the identity took the later of mtime and ctime, so an
    image whose mtime was set to 2100 and then rewritten in place (same inode, same size,
    another NCCL; the mtime set to 2100 again) kept its identity: the index never read it
    again and the gate judged it by the old NCCL. The identity takes the ctime alone."""
    from inventoryd.controller.images.index import update_index
    from ncclguard.config import ImagesConfig
    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    root = tmp_path / "r"
    root.mkdir()
    try:
        img = images.build_image(root / "a.sqsh", {"/etc/rc": "old\n"})
    except PartUnavailable as e:
        unavailable(str(e))
    future = 4102444800 * 10**9  # 2100-01-01
    os.utime(img, ns=(future, future))
    with Inventory(tmp_path / "inv.db", values=GATE_VALUES) as inv:
        assert update_index(inv, ImagesConfig(roots=(str(root),))).scanned == [str(img)]
    time.sleep(0.01)
    with open(img, "r+b") as f:  # rewritten in place: the same inode and size
        f.seek(-1, os.SEEK_END)
        f.write(b"\x01")
    os.utime(img, ns=(future, future))
    with Inventory(tmp_path / "inv.db", readonly=True, values=GATE_VALUES) as ro:
        values, why = ro.load_image_values(str(img), check_file=True)
        assert values is None and "changed since it was indexed" in str(why)
    with Inventory(tmp_path / "inv.db", values=GATE_VALUES) as inv:
        assert update_index(inv, ImagesConfig(roots=(str(root),))).scanned == [str(img)]



def test_one_users_deep_tree_leaves_another_users_directory_its_share_of_the_walk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 48, found after its fix: a user's deep tree under a root, met first. Before:
    the walk went depth first and each directory could take all but ``max_images`` (or
    half) of what was left, so alice's 10 directories of 10 directories of 10 files used
    up the walk's 40 entries and bob's directory beside hers was never listed: his new
    image was never found. Now a directory's share is split among its subdirectories in
    turn, by owner (each gets what is left over those still to go, and what one does not
    use goes to the next): bob's directory gets at least half of the root's."""
    from inventoryd.controller.images import index
    from ncclguard.config import ImagesConfig
    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    root = tmp_path / "r"
    alice = root / "alice"
    for i in range(10):
        for j in range(10):
            _files(alice / f"d{i}" / f"e{j}", [f"f{k}" for k in range(10)])
    for d, dirs, files in os.walk(alice):
        for n in [d, *(os.path.join(d, f) for f in dirs + files)]:
            os.chown(n, 65534, 65534)
    (root / "bob").mkdir()
    try:
        bob = images.build_image(root / "bob" / "new.sqsh", {"/etc/rc": "bob\n"})
    except PartUnavailable as e:
        unavailable(str(e))
    pulled = _count_scandir(monkeypatch, index)
    cfg = ImagesConfig(roots=(str(root),), max_images=4)  # 40 entries a walk
    found, complete = index.find_images(cfg)
    assert [p for p, _ in found] == [str(bob)], found  # before: []
    assert not complete  # alice's tree was not read whole
    assert pulled[0] <= index.SEEN_PER_IMAGE * cfg.max_images, pulled
    with Inventory(tmp_path / "inv.db", values=GATE_VALUES) as inv:
        assert index.update_index(inv, cfg).scanned == [str(bob)]


def test_a_slow_image_renamed_before_every_pass_keeps_no_other_users_image_out(
        tmp_path: Path) -> None:
    """Issue 48, found after its fix: alice's image that reaches its time limit (an
    unsquashfs that hangs on it, here), renamed before each pass to a name that sorts
    first. Before: it was new each pass (no failure counted), first by path, and the
    first image of a pass may take the whole budget: bob's new image was never started
    (3 passes). Now the caller keeps the time each file owner's images took
    (``OwnerTime``, decaying) and the owner who used least goes first: bob's image is
    indexed in the second pass."""
    import shutil
    import stat as st

    from inventoryd.controller.images import index
    from ncclguard.config import ImagesConfig
    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    real = shutil.which("unsquashfs")
    if real is None:
        unavailable("unsquashfs is not installed")
    fake = tmp_path / "unsquashfs"
    fake.write_text('#!/bin/sh\nfor a; do last=$a; done\n'  # alice's images hang
                    f'case $(readlink "$last") in */alice/*) exec sleep 30;; esac\n'
                    f'exec {real} "$@"\n')
    fake.chmod(fake.stat().st_mode | st.S_IXUSR)
    root = tmp_path / "r"
    (root / "alice").mkdir(parents=True)
    (root / "bob").mkdir()
    try:
        slow = images.build_image(root / "alice" / "9.sqsh", {"/etc/rc": "slow\n"})
        bob = images.build_image(root / "bob" / "new.sqsh", {"/etc/rc": "bob\n"})
    except PartUnavailable as e:
        unavailable(str(e))
    os.chown(slow, 65534, 65534)
    cfg = ImagesConfig(roots=(str(root),), scan_budget_s=2.0, timeout_s=2.0,
                       unsquashfs=str(fake))
    owners = index.OwnerTime()
    passes = []
    with Inventory(tmp_path / "inv.db", values=GATE_VALUES) as inv:
        for n in range(3):
            renamed = root / "alice" / f"{8 - n}.sqsh"  # new, and first by path
            os.rename(slow, renamed)
            slow = renamed
            passes.append(index.update_index(inv, cfg, owners=owners))
        seen = [(res.scanned, list(res.failed), res.left) for res in passes]
        assert str(bob) in passes[0].scanned + passes[1].scanned, seen  # before: never
        assert [p for res in passes for p in res.scanned] == [str(bob)], seen
        # alice's had the first pass (first by path, nobody had used anything), and
        # what bob's left of the second
        assert list(passes[0].failed) == [str(root / "alice" / "8.sqsh")], seen
        row = inv.image(str(bob))
        assert row is not None and row["record"]["rc"] == "bob\n"


def test_a_listing_of_many_long_paths_is_parsed_as_it_streams(tmp_path: Path) -> None:
    """Issue 48: 34,000 files of 3.8 KB paths (15 directories of 250-byte names, each
    path within MAX_PATH), a 126 MiB listing, just under MAX_LISTING_BYTES. Before: the
    listing was collected whole, joined, copied and split before one line was read:
    398 MB traced (379 MB of RSS) to keep 16 directories. Now it is parsed line by line
    as unsquashfs prints it: what is held is one read (at most 1 MiB), one line and one
    entry (under 9 KB each) and the entries kept (16 directories, under 100 KB); 1.2 MB
    traced. The bound, 8 MB, is that with room for the interpreter's own, and 1/16 of
    the listing."""
    tree = tmp_path / "t"
    d = tree
    for j in range(15):
        d = d / (f"d{j:02d}" + "x" * 247)
    d.mkdir(parents=True)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(34_000):
            os.close(os.open(f"f{i:06d}" + "y" * 30, os.O_CREAT | os.O_WRONLY, 0o644,
                             dir_fd=fd))
    finally:
        os.close(fd)
    img = _pack(tree, tmp_path / "long.sqsh")
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        im = SquashImage(str(img))
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    deep = "/" + str(d.relative_to(tree))
    assert len(deep) + len("/f000000" + "y" * 30) == 3803
    assert im.listed == 34_000 + 16 and im.odd_names == 0 and im.deepest == 16
    assert im.is_dir(deep) and len(im.entries) == 16  # the files are counted, not kept
    assert peak < 8_000_000, peak  # before: 398 MB
    rec = scan_image(str(img))
    assert rec["image"]["entries"] == 34_016 and rec["errors"] == []


def test_the_streamed_listing_reads_the_same_entries_however_it_is_cut(
        tmp_path: Path) -> None:
    """The listing parsed as it streams (issue 48): a line split across reads, a name
    holding a newline (the rest of its entry, as before), the last line without its
    newline, and a line longer than ``LINE_CAP`` (a symlink target unsquashfs printed
    whole: cut and counted as an odd name, never held whole) read the same entries
    whether the listing comes in one read or byte by byte."""
    from inventoryd.controller.images import squashfs

    token = "/ncg" + "0" * 24
    head = "2024-01-01 00:00 " + token

    def line(kind: str, size: int, rest: str) -> bytes:
        return f"{kind}rwxr-xr-x 0/0 {size:>8} {head}{rest}".encode()

    long_target = "/t" * 40_000  # 80 KB: over LINE_CAP, under MAX_LISTING_BYTES
    listing = b"\n".join([
        b"some banner",  # before any entry: ignored
        line("d", 0, ""),
        line("d", 0, "/usr"),
        line("-", 5, "/usr/libnccl.so.2"),
        line("-", 1, "/usr/a") + b"\n" + line("-", 2, "/usr/forged")[:30],  # a newline
        line("l", len(long_target), "/usr/far -> " + long_target),
        line("l", 12, "/usr/libnccl.so -> libnccl.so.2"),
    ])
    def parse(step: int) -> list[tuple[bytes, bytes, bytes, bool]]:
        got: list[tuple[bytes, bytes, bytes, bool]] = []
        checks: list[int] = []
        parser = squashfs._Listing(token, lambda *a: got.append(a), lambda: checks.append(1))
        for k in range(0, len(listing), step):
            parser.feed(listing[k : k + step])
            assert len(parser.partial) <= squashfs.LINE_CAP
            if parser.current is not None:
                assert len(parser.current[2]) <= squashfs.LINE_CAP
        parser.close()
        assert checks == [1]  # once every 4,096 lines, from the first
        return got

    seen = [parse(step) for step in (len(listing), 4096, 7, 1)]
    assert all(got == seen[0] for got in seen)
    (root, usr, lib, odd, far, link) = seen[0]
    assert root == (b"d", b"0", b"", False) and usr == (b"d", b"0", b"/usr", False)
    assert lib == (b"-", b"5", b"/usr/libnccl.so.2", False)
    assert odd[2].startswith(b"/usr/a\n-rwx") and not odd[3]  # one entry, not "forged"
    assert far[0] == b"l" and far[3] and len(far[2]) <= squashfs.LINE_CAP  # cut
    assert link == (b"l", b"12", b"/usr/libnccl.so -> libnccl.so.2", False)

    tree = tmp_path / "t"
    tree.mkdir()
    im = SquashImage(str(_pack(tree, tmp_path / "e.sqsh")))  # only its root
    im.listed = 0
    for entry in seen[0][1:]:
        im._add(*entry)
    assert im.listed == 5 and im.odd_names == 2  # the newline name and the cut one
    assert im.resolve("/usr/libnccl.so") == "/usr/libnccl.so.2"
    assert "/usr/far" not in im.entries
