"""Generated inventories for the CLI and drain tests.

A node's fingerprint starts from the one factory (:mod:`helpers.fingerprints`) and is
varied per node: NCCL version, ports down, driver, a probe error. The inventory is a
real ``Inventory`` file written through ``upsert``, as the daemon writes it.
``tests/test_cli_inventory.py`` tests the generator itself (that what it wrote reads back
as intended).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helpers.fingerprints as pf
from ncclguard.config import PolicyConfig
from ncclguard.policy.schedule import class_values
from ncclguard.store import Inventory


@dataclass
class NodeSpec:
    nccl: str = "2.21.5"
    ports_up: int = 4  # of 4
    driver: str = "550.54.15"
    rate_error: bool = False  # a probe could not read mlx5_0/1's rate
    age_s: float = 5.0  # heartbeat age
    plugin: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def base_fingerprint(host: str, spec: NodeSpec) -> dict[str, Any]:
    devices = []
    for i in range(4):
        up = i < spec.ports_up
        rate = None if (spec.rate_error and i == 0) else 400.0
        devices.append(pf.device(f"mlx5_{i}", ports=[
            pf.port(1, state="ACTIVE" if up else "DOWN", rate_gbps=rate)]))
    errors = [pf.error("rdma.devices.mlx5_0.ports.1.rate",
                       "/sys/class/infiniband/mlx5_0/ports/1/rate")] if spec.rate_error else []
    plugins = [pf.plugin(abis=[8, 7, 6, 5])] if spec.plugin else []
    fp = pf.fingerprint(host, nccl=spec.nccl, plugins=plugins, devices=devices,
                        driver=spec.driver, errors=errors)
    fp.update(copy.deepcopy(spec.extra))
    return fp


def build(path: Path, specs: Mapping[str, NodeSpec], now: float | None = None,
          history: Mapping[str, list[NodeSpec]] | None = None) -> Path:
    """Write an inventory at ``path``: each host's ``history`` specs (older), then its spec."""
    now = time.time() if now is None else now
    inv = Inventory(path, values=class_values(PolicyConfig()))  # as the collector writes it
    try:
        for host, older in (history or {}).items():
            for i, spec in enumerate(older):
                inv.upsert(base_fingerprint(host, spec), now=now - 86400 * (len(older) - i))
        for host, spec in specs.items():
            inv.upsert(base_fingerprint(host, spec), now=now - spec.age_s)
    finally:
        inv.close()
    return path


def standard(n: int = 16) -> dict[str, NodeSpec]:
    """n01..n16: a baseline majority and one node of each kind of trouble.

    n12: older driver and an unreadable rate (warn-level, probe error)
    n14: NCCL 2.18.3 (refuse: nccl-version, net-plugin ABI)
    n15: one RDMA port down of 4
    n16: no heartbeat for an hour
    """
    specs = {f"n{i:02d}": NodeSpec() for i in range(1, n + 1)}
    specs["n12"] = NodeSpec(driver="535.104.05", rate_error=True)
    specs["n14"] = NodeSpec(nccl="2.18.3")
    specs["n15"] = NodeSpec(ports_up=3)
    specs["n16"] = NodeSpec(age_s=3600)
    return specs
