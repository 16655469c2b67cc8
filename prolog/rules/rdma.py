"""rdma-rate, rdma-port-count, rdma-firmware: RDMA asymmetry that works, but slows every
collective down to the slowest node.

NCCL fact (docs/nccl-facts.md, "Which transport a node ends up on" and "sysfs for RDMA
devices"): NCCL uses the ports that are ACTIVE, have link layer InfiniBand or Ethernet and
are selected by ``NCCL_IB_HCA``. A ring or tree runs at the pace of its slowest link, so
fewer or slower ports on one node, or another firmware, is a warning, not a refusal.
Only those ports count (:func:`prolog.transport.nccl_ib_ports`); an unreadable rate or
firmware version is unknown, not different.
"""

from __future__ import annotations

from collections.abc import Mapping

from prolog.rules.base import Rule, Values, check_rule
from prolog.transport import nccl_ib_ports
from prolog.verdict import Finding


def _ports(fp: dict) -> list[dict] | None:
    return nccl_ib_ports(fp)


def rate_values(fp: dict) -> Values:
    ports = _ports(fp)
    if ports is None:
        return {"rate": None}
    rates = [p.get("rate_gbps") for p in ports]
    if any(r is None for r in rates):
        return {"rate": None}
    distinct = sorted({float(r) for r in rates})  # type: ignore[arg-type]
    if not distinct:
        return {"rate": "none"}
    return {"rate": ",".join(f"{r:g}" for r in distinct) + " Gb/s"}


def port_count_values(fp: dict) -> Values:
    ports = _ports(fp)
    return {"ports": None if ports is None else str(len(ports))}


def firmware_values(fp: dict) -> Values:
    ports = _ports(fp)
    if ports is None:
        return {"firmware": None}
    used = {p["device"] for p in ports}
    versions: set[str] = set()
    for dev in (fp.get("rdma") or {}).get("devices") or ():
        if dev.get("name") in used:
            fw = dev.get("fw_ver")
            if fw is None:
                return {"firmware": None}
            versions.add(fw)
    return {"firmware": ",".join(sorted(versions)) or "none"}


RATE = Rule(
    "rdma-rate",
    rate_values,
    lambda _: "RDMA port rates differ: collectives run at the slowest node's rate",
)
PORT_COUNT = Rule(
    "rdma-port-count",
    port_count_values,
    lambda _: "nodes have different numbers of usable RDMA ports: less bandwidth on some",
)
FIRMWARE = Rule(
    "rdma-firmware",
    firmware_values,
    lambda _: "RDMA adapters run different firmware versions",
)


def check_rate(fingerprints: Mapping[str, dict], severity: str = "warn") -> list[Finding]:
    return check_rule(RATE, fingerprints, severity)


def check_port_count(fingerprints: Mapping[str, dict], severity: str = "warn") -> list[Finding]:
    return check_rule(PORT_COUNT, fingerprints, severity)


def check_firmware(fingerprints: Mapping[str, dict], severity: str = "warn") -> list[Finding]:
    return check_rule(FIRMWARE, fingerprints, severity)
