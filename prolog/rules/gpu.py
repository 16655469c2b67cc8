"""gpu-driver, gpudirect: the NVIDIA driver version, and GPUDirect RDMA
(``nvidia_peermem``) loaded on some nodes only.

NCCL fact (docs/nccl-facts.md, "sysfs for RDMA devices"): the driver version is in
``/proc/driver/nvidia/version``; GPUDirect RDMA needs ``nvidia_peermem`` (or the older
``nv_peer_mem``). Without it NCCL stages through host memory on that node, so the job runs
but every collective waits for it: a warning.
"""

from __future__ import annotations

from collections.abc import Mapping

from prolog.fields import ABSENT, errored
from prolog.rules.base import Rule, Values, check_rule
from prolog.verdict import Finding


def _gpu_field(fp: dict, key: str) -> str | None:
    gpu = fp.get("gpu")
    if gpu is None:
        return None
    value = gpu.get(key)
    if value is None:
        return None if errored(fp, f"gpu.{key}") else ABSENT
    return str(value)


def driver_values(fp: dict) -> Values:
    return {"driver": _gpu_field(fp, "driver_version")}


def gpudirect_values(fp: dict) -> Values:
    return {"peermem": _gpu_field(fp, "peermem")}


DRIVER = Rule(
    "gpu-driver", driver_values, lambda _: "NVIDIA driver versions differ between nodes"
)
GPUDIRECT = Rule(
    "gpudirect",
    gpudirect_values,
    lambda _: "GPUDirect RDMA (nvidia_peermem) is loaded on some nodes only",
)


def check_driver(fingerprints: Mapping[str, dict], severity: str = "warn") -> list[Finding]:
    return check_rule(DRIVER, fingerprints, severity)


def check_gpudirect(fingerprints: Mapping[str, dict], severity: str = "warn") -> list[Finding]:
    return check_rule(GPUDIRECT, fingerprints, severity)
