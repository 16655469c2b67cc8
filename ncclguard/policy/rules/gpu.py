"""gpu-driver, gpudirect: the NVIDIA driver version, and GPUDirect RDMA
(``nvidia_peermem``) loaded on some nodes only.

NCCL fact (docs/nccl.md, "GPUs, RDMA devices and GPUDirect"): the driver version is in
``/proc/driver/nvidia/version``; GPUDirect RDMA needs ``nvidia_peermem`` (or the older
``nv_peer_mem``), or DMA-BUF, which the fingerprint does not see. Without it NCCL stages
through host memory on that node, so the job runs but every collective waits for it: a
warning.
"""

from __future__ import annotations

from collections.abc import Mapping

from ncclguard.fingerprint.fields import ABSENT, errored, part
from ncclguard.policy.rules.base import Rule, Values, check_rule
from ncclguard.policy.verdict import Finding


def _gpu_field(fp: dict, key: str) -> str | None:
    gpu = part(fp, "gpu")
    if gpu is None:
        return None
    value = gpu.get(key)
    if value is None:
        return None if errored(fp, f"gpu.{key}") else ABSENT
    return str(value)


def gpu_values(fp: dict) -> Values:
    """``driver`` (NVIDIA driver version) and ``peermem`` (the GPUDirect RDMA module)."""
    return {"driver": _gpu_field(fp, "driver_version"), "peermem": _gpu_field(fp, "peermem")}


DRIVER = Rule(
    "gpu-driver",
    None,
    lambda _: "NVIDIA driver versions differ between nodes",
    source=gpu_values,
    pick=("driver",),
    fields=(r"^gpu\.driver_version$",),
)
GPUDIRECT = Rule(
    "gpudirect",
    None,
    lambda _: "GPUDirect RDMA (nvidia_peermem) is loaded on some nodes only",
    source=gpu_values,
    pick=("peermem",),
    fields=(r"^gpu\.peermem$",),
)


def check_driver(
    fingerprints: Mapping[str, dict], severity: str = DRIVER.severity
) -> list[Finding]:
    return check_rule(DRIVER, fingerprints, severity)


def check_gpudirect(
    fingerprints: Mapping[str, dict], severity: str = GPUDIRECT.severity
) -> list[Finding]:
    return check_rule(GPUDIRECT, fingerprints, severity)
