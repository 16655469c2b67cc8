"""What the tests of the controller's exporter share (a plugin of tests/conftest.py): an
inventory of eight nodes in two partitions (``exporter_inventory``), the exporter over it,
and reading its text exposition."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from helpers.fingerprints import fingerprint

if TYPE_CHECKING:
    from inventoryd.controller.exporter import Exporter

# A plugin is loaded by every session: what it imports from the product is imported where
# it is used, so that a module broken by work under way fails the tests that use it, not
# every test.


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, from the text exposition format."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, tuple(sorted(labels.items()))))


def series(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {lab: v for (n, lab), v in samples(text).items() if n == name}


@pytest.fixture
def exporter_inventory(tmp_path: Path) -> Iterator[Path]:
    """gpu partition: g1..g6 (g5 on 2.18.3, g6 without the plugin; g4 stale);
    cpu partition: c1, c2 (alike); g7 in Slurm's gpu partition but not in the inventory."""
    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    db = tmp_path / "inventory.db"
    now = time.time()
    with Inventory(db, values=GATE_VALUES, heartbeat_s=0) as inv:
        for h in ("g1", "g2", "g3", "g4", "c1", "c2"):
            inv.upsert(fingerprint(h, plugin_abi=8), now=now)
        # g5: apart by its NCCL version alone (a libnccl that offers the plugin's net ABI 8)
        inv.upsert(fingerprint("g5", nccl="2.18.3", net_abis=[8, 7, 6, 5], plugin_abi=8),
                   now=now)
        inv.upsert(fingerprint("g6"), now=now)
        inv.heartbeat("g4", now=now - 100_000)
    yield db


#: Slurm's partitions of ``exporter_inventory``'s nodes
PARTS = {"gpu": ["g1", "g2", "g3", "g4", "g5", "g6", "g7"], "cpu": ["c1", "c2"]}


def exporter(db: Path, tmp_path: Path, parts: dict | None = PARTS, **kw: Any) -> Exporter:
    """The exporter over ``db`` with Slurm's partitions ``parts`` and an audit trail under
    ``tmp_path/log``; no cache unless ``cache_s``; the defaults' config unless ``config``."""
    from inventoryd.controller.exporter import Exporter, Partitions
    from ncclguard import config as configmod

    cfg = kw.pop("config", None) or configmod.Config()
    p = Partitions((lambda: parts) if parts is not None else None, refresh_s=600)
    p.refresh()
    audit_dir = tmp_path / "log"
    audit_dir.mkdir(exist_ok=True, mode=0o750)
    return Exporter(cfg, db=db, partitions=p, audit_path=audit_dir / "decisions.jsonl",
                    cache_s=kw.pop("cache_s", 0), **kw)
