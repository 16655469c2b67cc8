"""Build a whole node root tree (for ``--root``) from the sysfs fixture layouts.

Used by the policy tests, the gate tests and the demo: one call gives a directory
that ``ncclguard-inventoryd once --root DIR`` reads like a real node::

    build_node(tmp / "n1", rdma="mlx5-ib", nccl_conf="NCCL_IB_HCA=mlx5\\n",
               libnccl=nccl_lib("2.21.5"), extra_files={"/usr/lib/x86_64-linux-gnu/"
               "libnccl-net.so": plugin_path})

Every file is written in the kernel's own format (see the probes in
``inventoryd/probes``): ``/sys/class/infiniband`` from ``tests/fixtures/sysfs/<layout>``
(relative class links into ``/sys/devices``, as real sysfs), ``/proc/driver/nvidia``,
``/sys/module``, ``/proc/net/{if_inet6,fib_trie,route}``, ``/sys/class/net``,
``/proc/sys/kernel``. Bad arguments raise :class:`NodeTreeError` naming the cause.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

LAYOUTS = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "sysfs"
LIBDIR = "/usr/lib/x86_64-linux-gnu"
DEFAULT_NETIFS: Mapping[str, str | Sequence[str]] = {"ib0": "10.0.0.1/16"}
DEFAULT_GPU_MODEL = "NVIDIA H100 80GB HBM3"
IFF_UP, IFF_BROADCAST, IFF_LOOPBACK, IFF_MULTICAST = 0x1, 0x2, 0x8, 0x1000


class NodeTreeError(ValueError):
    """An argument that cannot make a node tree; the message names it."""


def layouts() -> list[str]:
    """The fixture layout names ``rdma=`` accepts."""
    return sorted(p.name for p in LAYOUTS.iterdir() if (p / "sys").is_dir())


def build_node(
    root: Path,
    *,
    rdma: str | Sequence[str] = "mlx5-ib",
    nccl_conf: str | bytes | None = None,
    driver: str | None = "550.54.15",
    gpus: int = 8,
    gpu_model: str | Sequence[str] = DEFAULT_GPU_MODEL,
    peermem: bool | str = True,
    netifs: Mapping[str, str | Sequence[str]] | None = DEFAULT_NETIFS,
    netifs_down: Sequence[str] = (),
    libnccl: Path | None = None,
    libibverbs: str | None = "1.14.50.0",
    extra_files: Mapping[str, Path | bytes] | None = None,
    hostname: str | None = None,
    kernel: str = "6.1.0-18-amd64",
) -> Path:
    """Compose a node root under ``root`` (created if needed) and return ``root``.

    - ``rdma``: one layout name or a list (``layouts()``); ``[]`` or ``""``: no RDMA.
      Two layouts with the same device name are refused.
    - ``nccl_conf``: the text of ``/etc/nccl.conf``; ``None``: no file.
    - ``driver``: NVIDIA driver version; ``None``: no driver (then no GPUs either).
    - ``gpus``, ``gpu_model``: the GPU count and one model for all, or one per GPU.
    - ``peermem``: ``True`` (``nvidia_peermem``), ``"nv_peer_mem"``, or ``False``.
    - ``netifs``: interface -> ``"addr/prefix"`` or a list of them (IPv4 and IPv6);
      ``lo`` (127.0.0.1, ::1) is always added. ``netifs_down``: interfaces that are down.
    - ``libnccl``: a real ``libnccl.so.2`` placed at ``/usr/lib/x86_64-linux-gnu/
      libnccl.so.2`` by hardlink (copy if refused), plus the ``libnccl.so`` link.
    - ``libibverbs``: the version in the real file name of ``libibverbs.so.1`` (a
      placeholder file: the probe reads only the name); ``None``: no libibverbs.
    - ``extra_files``: node path -> a file to place (hardlink/copy) or bytes to write.
    - ``hostname``: default ``root``'s directory name.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    names = [rdma] if isinstance(rdma, str) else list(rdma)
    names = [n for n in names if n]
    _rdma(root, names, libibverbs)
    if nccl_conf is not None:
        data = nccl_conf.encode() if isinstance(nccl_conf, str) else nccl_conf
        _write(root, "/etc/nccl.conf", data)
    _gpu(root, driver, gpus, gpu_model, peermem)
    _netifs(root, dict(netifs or {}), set(netifs_down))
    _host(root, hostname or root.name, kernel)
    if libnccl is not None:
        _place(root, f"{LIBDIR}/libnccl.so.2", Path(libnccl))
        _symlink(root, f"{LIBDIR}/libnccl.so", "libnccl.so.2")
    for node_path, src in (extra_files or {}).items():
        if isinstance(src, bytes):
            _write(root, node_path, src)
        else:
            _place(root, node_path, Path(src))
    return root


def _host_path(root: Path, node_path: str) -> Path:
    if not node_path.startswith("/") or ".." in node_path.split("/"):
        raise NodeTreeError(f"node paths are absolute, without '..': {node_path!r}")
    return root / node_path.lstrip("/")


def _write(root: Path, node_path: str, data: bytes | str) -> None:
    p = _host_path(root, node_path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data.encode() if isinstance(data, str) else data)


def _symlink(root: Path, node_path: str, target: str) -> None:
    p = _host_path(root, node_path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.is_symlink() or p.exists():
        p.unlink()
    os.symlink(target, p)


def _place(root: Path, node_path: str, src: Path) -> None:
    if not src.is_file():
        raise NodeTreeError(f"{src}: not a file (for {node_path})")
    p = _host_path(root, node_path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.exists() or p.is_symlink():
        p.unlink()
    try:
        os.link(src, p)
    except OSError:  # another filesystem, or hardlinks refused
        shutil.copy2(src, p)


def _rdma(root: Path, names: list[str], libibverbs: str | None) -> None:
    seen: dict[str, str] = {}
    for name in names:
        src = LAYOUTS / name
        if not (src / "sys").is_dir():
            raise NodeTreeError(f"unknown rdma layout {name!r} (known: {', '.join(layouts())})")
        for dev in sorted(p.name for p in (src / "sys/class/infiniband").iterdir()):
            if dev in seen:
                raise NodeTreeError(
                    f"rdma layouts {seen[dev]!r} and {name!r} both have device {dev!r}")
            seen[dev] = name
        shutil.copytree(src, root, symlinks=True, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("README*"))
    if not names:
        return
    _write(root, "/sys/class/infiniband_verbs/abi_version", "6\n")
    _write(root, "/sys/class/infiniband_mad/abi_version", "5\n")
    if libibverbs:
        real = f"libibverbs.so.{libibverbs}"
        _write(root, f"{LIBDIR}/{real}", b"placeholder: the rdma probe reads the name only\n")
        _symlink(root, f"{LIBDIR}/libibverbs.so.1", real)


def _gpu(root: Path, driver: str | None, gpus: int, model: str | Sequence[str],
         peermem: bool | str) -> None:
    if driver is None:
        return
    if gpus < 0:
        raise NodeTreeError(f"gpus = {gpus}: must be >= 0")
    models = [model] * gpus if isinstance(model, str) else list(model)
    if len(models) != gpus:
        raise NodeTreeError(f"gpu_model has {len(models)} entries for gpus = {gpus}")
    _write(root, "/proc/driver/nvidia/version",
           f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {driver}  "
           "Tue Mar  5 22:23:56 UTC 2024\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    _write(root, "/sys/module/nvidia/version", f"{driver}\n")
    for i, m in enumerate(models):
        bus = f"0000:{0x18 + 0x10 * i:02x}:00.0"
        gpu_uuid = uuid.uuid5(uuid.NAMESPACE_URL, f"{root.name}/{bus}")
        _write(root, f"/proc/driver/nvidia/gpus/{bus}/information",
               f"Model: \t\t {m}\nIRQ:   \t\t {100 + i}\nGPU UUID: \t GPU-{gpu_uuid}\n"
               f"Video BIOS: \t 96.00.99.00.01\nBus Type: \t PCIe\nDMA Size: \t 52 bits\n"
               f"DMA Mask: \t 0xfffffffffffff\nBus Location: \t {bus}\nDevice Minor: \t {i}\n"
               f"GPU Excluded:\t No\n")
    if peermem:
        module = peermem if isinstance(peermem, str) else "nvidia_peermem"
        if module not in ("nvidia_peermem", "nv_peer_mem"):
            raise NodeTreeError(f"peermem = {peermem!r}: expected nvidia_peermem or nv_peer_mem")
        _write(root, f"/sys/module/{module}/initstate", "live\n")
        _write(root, f"/sys/module/{module}/refcnt", "0\n")


def _netifs(root: Path, netifs: dict[str, str | Sequence[str]], down: set[str]) -> None:
    ifaces: dict[str, list[ipaddress.IPv4Interface | ipaddress.IPv6Interface]] = {
        "lo": [ipaddress.ip_interface("127.0.0.1/8"), ipaddress.ip_interface("::1/128")]}
    for name, given in netifs.items():
        if name == "lo" or not name or "/" in name:
            raise NodeTreeError(f"netifs: bad interface name {name!r} (lo is always added)")
        items = [given] if isinstance(given, str) else list(given)
        try:
            ifaces[name] = [ipaddress.ip_interface(a) for a in items]
        except ValueError as e:
            raise NodeTreeError(f"netifs[{name!r}]: {e}") from None
    unknown = down - set(ifaces)
    if unknown:
        raise NodeTreeError(f"netifs_down names unknown interfaces: {sorted(unknown)}")
    inet6, route, local = [], ["Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\t"
                                "Mask\t\tMTU\tWindow\tIRTT"], []
    for index, (name, addrs) in enumerate(ifaces.items(), start=1):
        is_lo = name == "lo"
        flags = (IFF_LOOPBACK if is_lo else IFF_BROADCAST | IFF_MULTICAST)
        flags |= 0 if name in down else IFF_UP
        oper = "unknown" if is_lo else ("down" if name in down else "up")
        dev = "virtual/net" if is_lo else f"pci0000:00/0000:00:1f.{index % 8}/net"
        _write(root, f"/sys/devices/{dev}/{name}/flags", f"{flags:#x}\n")
        _write(root, f"/sys/devices/{dev}/{name}/operstate", f"{oper}\n")
        _symlink(root, f"/sys/class/net/{name}", f"../../devices/{dev}/{name}")
        for a in addrs:
            if a.version == 6:
                scope = 0x20 if a.ip.is_link_local else (0x10 if a.ip.is_loopback else 0)
                inet6.append(f"{a.ip.exploded.replace(':', '')} {index:02x} "
                             f"{a.network.prefixlen:02x} {scope:02x} 80 {name:>8}")
                continue
            local.append(str(a.ip))
            if not is_lo:
                net = a.network
                dest = int(net.network_address).to_bytes(4, "little").hex().upper()
                mask = int(net.netmask).to_bytes(4, "little").hex().upper()
                route.append(f"{name}\t{dest}\t00000000\t0001\t0\t0\t0\t{mask}\t0\t0\t0")
    trie = ["Main:", "  +-- 0.0.0.0/0 3 0 5"]
    for ip in local:
        trie += [f"     |-- {ip}", "        /32 host LOCAL"]
    trie_text = "\n".join(trie) + "\n"
    _write(root, "/proc/net/fib_trie", trie_text + trie_text.replace("Main:", "Local:"))
    _write(root, "/proc/net/route", "\n".join(route) + "\n")
    _write(root, "/proc/net/if_inet6", "\n".join(inet6) + "\n")


def _host(root: Path, hostname: str, kernel: str) -> None:
    _write(root, "/proc/sys/kernel/hostname", f"{hostname}\n")
    _write(root, "/proc/sys/kernel/osrelease", f"{kernel}\n")
    _write(root, "/proc/sys/kernel/random/boot_id",
           f"{uuid.uuid5(uuid.NAMESPACE_DNS, hostname)}\n")
