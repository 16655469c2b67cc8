"""RDMA devices, ports, ABI files, libibverbs and its providers (fingerprint ``rdma``).

Reads ``/sys/class/infiniband/<dev>/`` (attributes and ``ports/<n>/``), the two
``abi_version`` class files, ``libibverbs.so.1`` in the usual library directories and
``/etc/libibverbs.d/*.driver``. Formats are those of the kernel's
``drivers/infiniband/core/sysfs.c``: ``state`` and ``phys_state`` are ``"%d: %s"``,
``rate`` is ``"%d%s Gb/sec (%dX%s)"`` (``"2.5 Gb/sec (1X SDR)"``; kernels before
the SDR label print ``"10 Gb/sec (4X)"``).

One unreadable file costs that one field (``null``, plus an entry in ``errors``), never
the port, the device or the node. A missing attribute (``hca_type`` on hfi1) is ``null``
without an error: drivers differ in what they expose.
"""

from __future__ import annotations

import re
from typing import Any

from inventoryd.nodefs import ErrorLog, NodeFS

PROBE = "rdma"
CLASS_DIR = "/sys/class/infiniband"
ABI_FILES = {
    "verbs": "/sys/class/infiniband_verbs/abi_version",
    "mad": "/sys/class/infiniband_mad/abi_version",
}
PROVIDERS_DIR = "/etc/libibverbs.d"
LIBIBVERBS = "libibverbs.so.1"
LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/lib64",
    "/usr/lib",
    "/lib/x86_64-linux-gnu",
    "/lib",
)
DEVICE_ATTRS = ("fw_ver", "hca_type", "board_id", "node_guid", "node_type")

_CODED = re.compile(r"^(\d+): (.+)$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?) G[bB]/sec(?: \(.*\))?$")


class ParseError(ValueError):
    """A sysfs value that is not in the kernel's format; the message quotes it."""


def parse_coded(text: str) -> tuple[int, str]:
    """``"4: ACTIVE"`` -> ``(4, "ACTIVE")``; the form of ``state``, ``phys_state``, ``node_type``.

    Raises :class:`ParseError` for anything else (``"N/A (no PMA)"``, ``""``, ``"ACTIVE"``).
    """
    m = _CODED.match(text.strip())
    if not m:
        raise ParseError(f"not in the form 'N: NAME': {text!r}")
    return int(m.group(1)), m.group(2).strip()


def parse_state(text: str) -> tuple[int, str]:
    """Port ``state``: ``"4: ACTIVE"`` -> ``(4, "ACTIVE")``."""
    return parse_coded(text)


def parse_phys_state(text: str) -> tuple[int, str]:
    """Port ``phys_state``: ``"5: LinkUp"`` -> ``(5, "LinkUp")``."""
    return parse_coded(text)


def parse_rate(text: str) -> float:
    """Port ``rate`` in Gb/s: ``"400 Gb/sec (4X NDR)"`` -> ``400.0``.

    Accepts ``"2.5 Gb/sec (1X SDR)"``, the label-less ``"10 Gb/sec (4X)"`` of old
    kernels and the ``"0 GB/sec"`` seen in the wild. Raises :class:`ParseError` for
    anything else (``"N/A (no PMA)"``, ``""``).
    """
    m = _RATE.match(text.strip())
    if not m:
        raise ParseError(f"not a rate like '400 Gb/sec (4X NDR)': {text!r}")
    return float(m.group(1))


def probe(fs: NodeFS, errors: ErrorLog) -> dict[str, Any]:
    return {
        "abi_version": {k: fs.read_text(p, errors, PROBE, f"rdma.abi_version.{k}")
                        for k, p in ABI_FILES.items()},
        "libibverbs": _libibverbs(fs, errors),
        "providers": _providers(fs, errors),
        "devices": _devices(fs, errors),
    }


def _libibverbs(fs: NodeFS, errors: ErrorLog) -> dict[str, Any] | None:
    """The first ``libibverbs.so.1`` in the usual directories, and the version its real
    file name carries (``libibverbs.so.1.14.50.0`` -> ``"1.14.50.0"``, i.e. ABI 1.14 of
    rdma-core 50.0). ``None`` if there is none: a node without verbs, not an error."""
    for d in LIB_DIRS:
        path = f"{d}/{LIBIBVERBS}"
        if not fs.exists(path):
            continue
        try:
            real = fs.resolve(path)
        except OSError as e:
            errors.add(PROBE, "rdma.libibverbs.version", path, e)
            return {"path": path, "version": None}
        name = real.rsplit("/", 1)[-1]
        prefix = "libibverbs.so."
        version = name[len(prefix):] if name.startswith(prefix) else None
        return {"path": path, "version": version or None}
    return None


def _providers(fs: NodeFS, errors: ErrorLog) -> list[str]:
    names = fs.list_dir(PROVIDERS_DIR, errors, PROBE, "rdma.providers") or []
    return sorted(n[: -len(".driver")] for n in names if n.endswith(".driver"))


def _devices(fs: NodeFS, errors: ErrorLog) -> list[dict[str, Any]]:
    names = fs.list_dir(CLASS_DIR, errors, PROBE, "rdma.devices") or []
    return [_device(fs, errors, name) for name in names]


def _device(fs: NodeFS, errors: ErrorLog, name: str) -> dict[str, Any]:
    base = f"{CLASS_DIR}/{name}"
    field = f"rdma.devices.{name}"
    dev: dict[str, Any] = {"name": name}
    if not fs.is_dir(base):  # a dangling class link, or a stray file
        kind = "a dangling link" if fs.host(base).is_symlink() else "not a directory"
        errors.add(PROBE, field, base, f"device entry is {kind}")
    for attr in DEVICE_ATTRS:
        dev[attr] = fs.read_text(f"{base}/{attr}", errors, PROBE, f"{field}.{attr}")
    ports = fs.list_dir(f"{base}/ports", errors, PROBE, f"{field}.ports") or []
    numbers = sorted(int(p) for p in ports if p.isdigit())
    dev["ports"] = [_port(fs, errors, f"{base}/ports/{n}", f"{field}.ports.{n}", n)
                    for n in numbers]
    return dev


def _port(fs: NodeFS, errors: ErrorLog, base: str, field: str, number: int) -> dict[str, Any]:
    port: dict[str, Any] = {"port": number}
    for attr in ("state", "phys_state"):
        raw = fs.read_text(f"{base}/{attr}", errors, PROBE, f"{field}.{attr}")
        port[attr], port[f"{attr}_code"] = raw, None
        if raw is not None:
            try:
                port[f"{attr}_code"], port[attr] = parse_coded(raw)
            except ParseError as e:
                errors.add(PROBE, f"{field}.{attr}", f"{base}/{attr}", e)
    raw = fs.read_text(f"{base}/rate", errors, PROBE, f"{field}.rate")
    port["rate"], port["rate_gbps"] = raw, None
    if raw is not None:
        try:
            port["rate_gbps"] = parse_rate(raw)
        except ParseError as e:
            errors.add(PROBE, f"{field}.rate_gbps", f"{base}/rate", e)
    port["link_layer"] = fs.read_text(f"{base}/link_layer", errors, PROBE, f"{field}.link_layer")
    return port
