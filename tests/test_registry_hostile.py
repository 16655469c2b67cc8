"""Registry images under attack (issue 41): each case a reproduction of the hostile review,
scaled down to run in seconds, that failed before its fix. Layers are real tar streams;
the cases that need a registry use the real one on loopback (tests/helpers/registry.py).
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import time
from pathlib import Path

import pytest

from inventoryd.controller.images.layers import (
    MAX_KEPT,
    MAX_NAME_BYTES,
    LayeredImage,
    read_layer,
)
from inventoryd.controller.images.squashfs import MAX_DEPTH
from inventoryd.controller.images.tree import ImageError

TAR = "application/vnd.oci.image.layer.v1.tar"


def _dirs(paths: list[str]) -> bytes:
    """A plain tar of directory entries (pax: any path length)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for p in paths:
            info = tarfile.TarInfo(p)
            info.type = tarfile.DIRTYPE
            t.addfile(info)
    return buf.getvalue()


def _summary(blob: bytes) -> dict:
    return read_layer(io.BytesIO(blob), digest="sha256:" + hashlib.sha256(blob).hexdigest(),
                      size=len(blob), media_type=TAR, deadline=time.monotonic() + 30,
                      max_bytes=1 << 30, max_unpacked=1 << 30, max_read_bytes=1 << 30)


# ---- 1. memory: the parents a member implies


def test_a_path_deeper_than_the_squashfs_bound_is_refused() -> None:
    """One member 800 levels deep (the review's): refused, as a squashfs image that deep is."""
    with pytest.raises(ImageError, match=rf"deeper than {MAX_DEPTH} levels"):
        _summary(_dirs(["/".join(["d"] * 800)]))


def test_implied_directories_count_against_the_name_bound() -> None:
    """Members 60 levels deep with 4 KB paths: their own names are 0.7 MB, the parents
    they imply 17 MB: the review's 195 MB from an 18 KB layer, scaled down."""
    part = "x" * 64
    paths = [f"{i:05d}/" + "/".join([part] * 59) for i in range(180)]
    assert sum(len(p) for p in paths) < MAX_NAME_BYTES // 16
    with pytest.raises(ImageError, match="bytes of paths the fingerprint keeps"):
        _summary(_dirs(paths))


def test_implied_directories_count_against_the_entry_bound() -> None:
    """Each member of distinct parents 60 deep implies 59 entries: MAX_KEPT / 59 + 1
    members are over the bound of entries kept, whatever they name."""
    n = MAX_KEPT // 59 + 2
    paths = [f"{i}/" + "/".join(["d"] * 59) for i in range(n)]
    with pytest.raises(ImageError, match=f"more than {MAX_KEPT} entries"):
        _summary(_dirs(paths))


def test_a_deep_but_legal_layer_still_reads() -> None:
    """64 levels (the bound) is read, its parents made as tar makes them."""
    deep = "/".join(["d"] * MAX_DEPTH)
    image = LayeredImage("t", [_summary(_dirs([deep]))])
    assert image.entries["/" + deep].kind == "d"
    assert image.entries["/d/d"].kind == "d"


def test_the_collectors_unit_bounds_its_memory_and_tasks() -> None:
    """The collector reads what users push to registries: its unit caps memory above the
    worst image the bounds let through (bench/bench_registry_hostile.py: 325 MB) and
    the squashfs reader's child (1 GiB of address space), and its tasks."""
    unit = Path(__file__).resolve().parents[1] / "systemd" / "ncclguard-collector.service"
    lines = [x.strip() for x in unit.read_text().splitlines()
             if x.strip() and not x.startswith("#")]
    assert "MemoryMax=2G" in lines and "TasksMax=64" in lines
