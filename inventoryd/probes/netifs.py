"""Network interfaces and their IP addresses (fingerprint ``netifs``).

NCCL's IB transport needs at least one IP interface (``NET/IB : No IP interface
found.``). The data is kept plain: every interface that has an address, ``lo``
included; :func:`nccl_ip_interfaces` is the "has an IP for NCCL" view (up, not ``lo``).

Two sources, one shape (``{"name", "up", "addresses"}``, sorted by name, addresses
sorted, IPv6 without the ``%scope`` suffix):

- the real node (root ``/``): psutil (``net_if_addrs``, ``net_if_stats().isup``);
- another root: psutil cannot read it, so the kernel's own text formats are read there:
  ``/proc/net/if_inet6`` (IPv6, one line per address with the interface name);
  ``/proc/net/fib_trie`` for the IPv4 addresses (leaves marked ``/32 host LOCAL``),
  each assigned to an interface through the connected (gateway-less) routes of
  ``/proc/net/route``, longest prefix first, and ``127.0.0.0/8`` to ``lo``;
  ``up`` from ``/sys/class/net/<if>/flags`` (IFF_UP) and ``operstate`` (``up``, or
  ``unknown`` as ``lo`` and some virtual drivers report), which is what psutil's
  ``isup`` ("up and running") means. An IPv4 address that no connected route covers
  cannot be placed; it is left out with an error naming it.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

from inventoryd.nodefs import ErrorLog, NodeFS

PROBE = "netifs"
IFF_UP = 0x1
RTF_GATEWAY = 0x2
IF_INET6 = "/proc/net/if_inet6"
FIB_TRIE = "/proc/net/fib_trie"
ROUTE = "/proc/net/route"


def nccl_ip_interfaces(netifs: list[dict[str, Any]]) -> list[str]:
    """Names of the interfaces NCCL could bootstrap on: up, with an address, not ``lo``."""
    return [n["name"] for n in netifs if n["name"] != "lo" and n["up"] and n["addresses"]]


def probe(fs: NodeFS, errors: ErrorLog) -> list[dict[str, Any]]:
    if str(fs.root) == "/":
        return _from_psutil()
    return _from_procfs(fs, errors)


def _strip_scope(addr: str) -> str:
    return addr.split("%", 1)[0]


def _shape(addrs: dict[str, set[str]], up: dict[str, bool]) -> list[dict[str, Any]]:
    return [
        {"name": name, "up": up.get(name, False), "addresses": sorted(addrs[name])}
        for name in sorted(addrs)
        if addrs[name]
    ]


def _from_psutil() -> list[dict[str, Any]]:
    import psutil

    addrs: dict[str, set[str]] = {}
    for name, entries in psutil.net_if_addrs().items():
        ips = {_strip_scope(a.address) for a in entries
               if a.family in (socket.AF_INET, socket.AF_INET6)}
        addrs[name] = ips
    up = {name: s.isup for name, s in psutil.net_if_stats().items()}
    return _shape(addrs, up)


def parse_if_inet6(text: str) -> list[tuple[str, str]]:
    """``/proc/net/if_inet6`` -> ``[(ifname, address)]``.

    Each line: 32 hex digits, ifindex, prefix length, scope, flags (hex), name.
    Lines that do not have this form are skipped.
    """
    out: list[tuple[str, str]] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 6 or len(parts[0]) != 32:
            continue
        try:
            addr = ipaddress.IPv6Address(bytes.fromhex(parts[0]))
        except ValueError:
            continue
        out.append((parts[5], str(addr)))
    return out


def parse_fib_trie_local(text: str) -> list[str]:
    """The node's own IPv4 addresses: the ``|-- A.B.C.D`` leaves of ``/proc/net/fib_trie``
    followed by a ``/32 host LOCAL`` line (the trie lists each twice, Main and Local)."""
    found: list[str] = []
    leaf: str | None = None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("|-- "):
            leaf = s[4:].strip()
        elif leaf and s.startswith("/32 host LOCAL"):
            if leaf not in found:
                found.append(leaf)
        elif not s.startswith("/"):
            leaf = None
    return found


def parse_route(text: str) -> list[tuple[str, ipaddress.IPv4Network]]:
    """Connected routes of ``/proc/net/route`` -> ``[(ifname, network)]``.

    Destination and Mask are little-endian hex (``000200C0`` is 192.0.2.0); routes
    through a gateway are skipped, as are malformed lines.
    """
    out: list[tuple[str, ipaddress.IPv4Network]] = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 8:
            continue
        try:
            dest = int.from_bytes(bytes.fromhex(parts[1]), "little")
            flags = int(parts[3], 16)
            mask = int.from_bytes(bytes.fromhex(parts[7]), "little")
            net = ipaddress.IPv4Network((dest, bin(mask).count("1")), strict=False)
        except ValueError:
            continue
        if not flags & RTF_GATEWAY:
            out.append((parts[0], net))
    return out


def _from_procfs(fs: NodeFS, errors: ErrorLog) -> list[dict[str, Any]]:
    addrs: dict[str, set[str]] = {}
    text = fs.read_text(IF_INET6, errors, PROBE, "netifs")
    for name, addr in parse_if_inet6(text or ""):
        addrs.setdefault(name, set()).add(addr)
    trie = fs.read_text(FIB_TRIE, errors, PROBE, "netifs")
    routes = parse_route(fs.read_text(ROUTE, errors, PROBE, "netifs") or "")
    routes.sort(key=lambda r: r[1].prefixlen, reverse=True)
    for ip in parse_fib_trie_local(trie or ""):
        try:
            v4 = ipaddress.IPv4Address(ip)
        except ValueError:
            continue
        if v4.is_loopback:
            owner: str | None = "lo"
        else:
            owner = next((name for name, net in routes if v4 in net), None)
        if owner is None:
            errors.add(PROBE, f"netifs.{ip}", ROUTE,
                       f"IPv4 address {ip} is covered by no connected route: interface unknown")
            continue
        addrs.setdefault(owner, set()).add(ip)
    up = {name: _is_up(fs, errors, name) for name in addrs}
    return _shape(addrs, up)


def _is_up(fs: NodeFS, errors: ErrorLog, name: str) -> bool:
    base = f"/sys/class/net/{name}"
    flags = fs.read_text(f"{base}/flags", errors, PROBE, f"netifs.{name}.up")
    oper = fs.read_text(f"{base}/operstate", errors, PROBE, f"netifs.{name}.up")
    try:
        is_up = flags is not None and bool(int(flags, 16) & IFF_UP)
    except ValueError:
        errors.add(PROBE, f"netifs.{name}.up", f"{base}/flags", f"not hex flags: {flags!r}")
        is_up = False
    return is_up and (oper or "").strip() in ("up", "unknown")
