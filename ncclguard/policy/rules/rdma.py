"""rdma-rate, rdma-port-count, rdma-firmware: RDMA asymmetry that works, but slows every
collective down to the slowest node.

NCCL fact (docs/nccl.md, "Which transport a node ends up on", and "GPUs, RDMA devices
and GPUDirect"): NCCL uses the ports that are ACTIVE, have link layer InfiniBand or Ethernet and
are selected by ``NCCL_IB_HCA``. A ring or tree runs at the pace of its slowest link, so
fewer or slower ports on one node, or another firmware, is a warning, not a refusal.
Only those ports count (:func:`ncclguard.fingerprint.transport.nccl_ib_ports`);
``rdma-rate`` compares the set of distinct rates (how many ports is ``rdma-port-count``'s
business). An unreadable rate or firmware version is unknown, not different.
"""

from __future__ import annotations

from collections.abc import Mapping

from ncclguard.fingerprint.transport import nccl_ib_ports
from ncclguard.policy.rules.base import Rule, Values, check_rule
from ncclguard.policy.verdict import Finding


def rdma_values(fp: dict) -> Values:
    """``rate`` (distinct rates), ``ports`` (count) and ``firmware`` of the ports NCCL uses."""
    ports = nccl_ib_ports(fp)
    if ports is None:
        return {"rate": None, "ports": None, "firmware": None}
    out: Values = {"ports": str(len(ports))}
    rates = {p.get("rate_gbps") for p in ports}
    known = sorted(r for r in rates if r is not None)
    if len(known) < len(rates):
        out["rate"] = None
    elif not known:
        out["rate"] = "none"
    else:
        out["rate"] = ",".join(f"{r:g}" for r in known) + " Gb/s"
    used = {p["device"] for p in ports}
    versions: set[str] = set()
    for dev in (fp.get("rdma") or {}).get("devices") or ():
        if dev.get("name") in used:
            fw = dev.get("fw_ver")
            if fw is None:
                out["firmware"] = None
                return out
            versions.add(fw)
    out["firmware"] = ",".join(sorted(versions)) or "none"
    return out


RATE = Rule(
    "rdma-rate",
    None,
    lambda _: "RDMA port rates differ: collectives run at the slowest node's rate",
    source=rdma_values,
    pick=("rate",),
    fields=(r"^rdma\.devices\[[^\]]*\]\.ports\[[^\]]*\]\.(rate|rate_gbps)$",),
)
PORT_COUNT = Rule(
    "rdma-port-count",
    None,
    lambda _: "nodes have different numbers of usable RDMA ports: less bandwidth on some",
    source=rdma_values,
    pick=("ports",),
    fields=(
        r"^rdma\.active_ports$",
        r"^rdma\.devices\[[^\]]*\]\.ports\[[^\]]*\]\."
        r"(state|state_code|phys_state|phys_state_code)$",
        r"^rdma\.devices\[[^\]]*\](\.ports(\[[^\]]*\])?)?$",
    ),
)
FIRMWARE = Rule(
    "rdma-firmware",
    None,
    lambda _: "RDMA adapters run different firmware versions",
    source=rdma_values,
    pick=("firmware",),
    fields=(r"^rdma\.devices\[[^\]]*\]\.fw_ver$",),
)


def check_rate(fingerprints: Mapping[str, dict], severity: str = RATE.severity) -> list[Finding]:
    return check_rule(RATE, fingerprints, severity)


def check_port_count(
    fingerprints: Mapping[str, dict], severity: str = PORT_COUNT.severity
) -> list[Finding]:
    return check_rule(PORT_COUNT, fingerprints, severity)


def check_firmware(
    fingerprints: Mapping[str, dict], severity: str = FIRMWARE.severity
) -> list[Finding]:
    return check_rule(FIRMWARE, fingerprints, severity)
