"""GPU driver, GPU models and GPUDirect RDMA module, from /proc/driver/nvidia and /sys/module."""

from __future__ import annotations

from pathlib import Path

import pytest

from inventoryd.nodefs import ErrorLog, NodeFS
from inventoryd.probes import gpu

PROPRIETARY = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  "
               "Tue Mar  5 22:23:56 UTC 2024\n"
               "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
OPEN = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  "
        "(dvs-builder@U22-I3-B17-02-5)  Tue Sep 23 09:55:41 UTC 2025\nGCC version:  gcc\n")
INFO = ("Model: \t\t {model}\nIRQ:   \t\t 42\n"
        "GPU UUID: \t GPU-82523fd8-3897-f599-d088-ccd04ae45ec1\n"
        "Bus Location: \t {bus}\nDevice Minor: \t 3\nGPU Excluded: \t No\n")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (PROPRIETARY, "550.54.15"),
        (OPEN, "580.95.05"),
        ("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  570.86.15  Release Build\n",
         "570.86.15"),
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.135  Fri Jan 10 2025\n", "550.135"),
        ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64 595.71.05\n", "595.71.05"),
        ("GCC version: gcc\n", None),
        ("", None),
    ],
)
def test_parse_nvrm_version(text: str, expected: str | None) -> None:
    assert gpu.parse_nvrm_version(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (INFO.format(model="NVIDIA H100 80GB HBM3", bus="0000:18:00.0"), "NVIDIA H100 80GB HBM3"),
        ("Model: \t\t NVIDIA A10G\n", "NVIDIA A10G"),
        ("IRQ: 42\n", None),
        ("Model:\n", None),
    ],
)
def test_parse_model(text: str, expected: str | None) -> None:
    assert gpu.parse_model(text) == expected


def _write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def test_probe_full(tmp_path: Path) -> None:
    _write(tmp_path, "proc/driver/nvidia/version", PROPRIETARY)
    for i, model in enumerate(["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"]):
        bus = f"0000:{0x18 + i:02x}:00.0"
        _write(tmp_path, f"proc/driver/nvidia/gpus/{bus}/information",
               INFO.format(model=model, bus=bus))
    (tmp_path / "sys/module/nvidia_peermem").mkdir(parents=True)
    errors = ErrorLog()
    assert gpu.probe(NodeFS(tmp_path), errors) == {
        "driver_version": "550.54.15", "count": 2,
        "models": ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"], "peermem": "nvidia_peermem",
    }
    assert errors.entries == []


def test_no_driver_is_not_an_error(tmp_path: Path) -> None:
    errors = ErrorLog()
    assert gpu.probe(NodeFS(tmp_path), errors) == {
        "driver_version": None, "count": 0, "models": [], "peermem": None}
    assert errors.entries == []


def test_sys_module_fallback_and_old_peer_mem(tmp_path: Path) -> None:
    _write(tmp_path, "sys/module/nvidia/version", "535.161.08\n")
    (tmp_path / "sys/module/nv_peer_mem").mkdir(parents=True)
    out = gpu.probe(NodeFS(tmp_path), ErrorLog())
    assert (out["driver_version"], out["peermem"]) == ("535.161.08", "nv_peer_mem")


def test_garbled_version_and_unreadable_gpu(tmp_path: Path) -> None:
    _write(tmp_path, "proc/driver/nvidia/version", "garbage\n")
    _write(tmp_path, "sys/module/nvidia/version", "550.54.15\n")
    _write(tmp_path, "proc/driver/nvidia/gpus/0000:18:00.0/information",
           INFO.format(model="NVIDIA H100 80GB HBM3", bus="0000:18:00.0"))
    (tmp_path / "proc/driver/nvidia/gpus/0000:19:00.0/information").mkdir(parents=True)
    errors = ErrorLog()
    out = gpu.probe(NodeFS(tmp_path), errors)
    assert out["driver_version"] == "550.54.15"
    assert out["count"] == 2 and out["models"] == ["NVIDIA H100 80GB HBM3"]
    assert [(e["path"], e["error"][:20]) for e in errors.entries] == [
        ("/proc/driver/nvidia/version", "no 'NVRM version: .."),
        ("/proc/driver/nvidia/gpus/0000:19:00.0/information", "[Errno 21] Is a dire"),
    ]
