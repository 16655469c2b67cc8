"""NVIDIA driver version, GPU count and models, GPUDirect RDMA module (fingerprint ``gpu``).

- driver: ``/proc/driver/nvidia/version`` (``NVRM version: NVIDIA UNIX x86_64 Kernel
  Module  550.54.15  ...`` or ``... Open Kernel Module for x86_64  550.54.15  Release
  Build ...``), else ``/sys/module/nvidia/version`` (``550.54.15``).
- GPUs: one directory per GPU in ``/proc/driver/nvidia/gpus/``, whose ``information``
  file has a ``Model: \\t\\t NVIDIA H100 80GB HBM3`` line.
- peermem: ``/sys/module/nvidia_peermem`` (driver 470+), else the older Mellanox
  ``/sys/module/nv_peer_mem``.

No driver loaded is ``driver_version: null``, ``count: 0`` without an error.
"""

from __future__ import annotations

import re
from typing import Any

from inventoryd.nodefs import ErrorLog, NodeFS

PROBE = "gpu"
PROC_VERSION = "/proc/driver/nvidia/version"
SYS_VERSION = "/sys/module/nvidia/version"
GPUS_DIR = "/proc/driver/nvidia/gpus"
PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")

_NVRM = re.compile(r"^NVRM version:.*?Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)\b")
_VERSION = re.compile(r"^\d+(?:\.\d+)+$")


def parse_nvrm_version(text: str) -> str | None:
    """The driver version in ``/proc/driver/nvidia/version`` text, or ``None``."""
    for line in text.splitlines():
        m = _NVRM.match(line)
        if m:
            return m.group(1)
    return None


def parse_model(information: str) -> str | None:
    """The ``Model:`` value of a ``gpus/<bus>/information`` file, or ``None``."""
    for line in information.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "Model":
            return value.strip() or None
    return None


def probe(fs: NodeFS, errors: ErrorLog) -> dict[str, Any]:
    return {
        "driver_version": _driver(fs, errors),
        **_gpus(fs, errors),
        "peermem": next((m for m in PEERMEM_MODULES if fs.is_dir(f"/sys/module/{m}")), None),
    }


def _driver(fs: NodeFS, errors: ErrorLog) -> str | None:
    text = fs.read_text(PROC_VERSION, errors, PROBE, "gpu.driver_version")
    if text is not None:
        version = parse_nvrm_version(text)
        if version:
            return version
        errors.add(PROBE, "gpu.driver_version", PROC_VERSION,
                   f"no 'NVRM version: ... Kernel Module <version>' line in {text[:80]!r}")
    text = fs.read_text(SYS_VERSION, errors, PROBE, "gpu.driver_version")
    if text is None:
        return None
    if _VERSION.match(text.strip()):
        return text.strip()
    errors.add(PROBE, "gpu.driver_version", SYS_VERSION, f"not a version: {text[:80]!r}")
    return None


def _gpus(fs: NodeFS, errors: ErrorLog) -> dict[str, Any]:
    names = fs.list_dir(GPUS_DIR, errors, PROBE, "gpu.count")
    if names is None:
        return {"count": 0, "models": []}
    models: list[str] = []
    for bus in names:
        path = f"{GPUS_DIR}/{bus}/information"
        text = fs.read_text(path, errors, PROBE, f"gpu.models.{bus}", missing_ok=False)
        if text is None:
            continue
        model = parse_model(text)
        if model is None:
            errors.add(PROBE, f"gpu.models.{bus}", path, "no 'Model:' line")
            continue
        models.append(model)
    return {"count": len(names), "models": sorted(models)}
