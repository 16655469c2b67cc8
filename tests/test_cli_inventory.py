"""The generated inventories of :mod:`helpers.inventory` (the CLI and drain tests'):
what the generator wrote reads back as intended."""

from __future__ import annotations

import time
from pathlib import Path

from helpers.inventory import build, standard

from ncclguard.config import PolicyConfig
from ncclguard.policy.schedule import class_values
from ncclguard.store import Inventory


def test_generated_inventory_reads_back(tmp_path: Path) -> None:
    db = build(tmp_path / "inv.db", standard())
    inv = Inventory(db, readonly=True, values=class_values(PolicyConfig()))
    rows = {r["host"]: r for r in inv.nodes()}
    assert len(rows) == 16
    assert rows["n14"]["nccl_version"] == "2.18.3"
    assert rows["n15"]["rdma_ports_up"] == 3 and rows["n15"]["rdma_ports_total"] == 4
    assert rows["n12"]["error_count"] == 1
    assert inv.stale(time.time(), 900) == ["n16"]
    classes = inv.classes()
    assert len(classes[0].hosts) == 15 and classes[1].hosts == ["n14"]
