"""Interfaces with IP addresses: psutil on the real root, kernel text formats under --root."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from inventoryd.nodefs import ErrorLog, NodeFS
from inventoryd.probes import netifs

# Formats as the kernel prints them (this machine's own /proc/net files, with addresses
# from the documentation ranges).
IF_INET6 = """\
fe8000000000000000fc00fffe000001 04 40 20 80     eth0
00000000000000000000000000000001 01 80 10 80       lo
fd000000000000000000000000000002 04 40 00 82     eth0
"""
ROUTE = """\
Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
ib0\t0000000A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
"""
FIB_TRIE = """\
Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 10.0.0.0/16 2 0 2
        |-- 10.0.0.0
           /16 link UNICAST
        |-- 10.0.3.7
           /32 host LOCAL
     +-- 127.0.0.0/8 2 0 2
        +-- 127.0.0.0/31 1 0 0
           |-- 127.0.0.0
              /8 host LOCAL
           |-- 127.0.0.1
              /32 host LOCAL
     +-- 192.0.2.0/24 2 0 2
        |-- 192.0.2.2
           /32 host LOCAL
        |-- 192.0.2.255
           /32 link BROADCAST
     |-- 198.51.100.9
        /32 host LOCAL
Local:
  +-- 0.0.0.0/0 3 0 5
     |-- 192.0.2.2
        /32 host LOCAL
"""


def test_parse_if_inet6() -> None:
    assert netifs.parse_if_inet6(IF_INET6 + "garbage line\n") == [
        ("eth0", "fe80::fc:ff:fe00:1"), ("lo", "::1"), ("eth0", "fd00::2")]


def test_parse_fib_trie_local() -> None:
    assert netifs.parse_fib_trie_local(FIB_TRIE) == [
        "10.0.3.7", "127.0.0.1", "192.0.2.2", "198.51.100.9"]


def test_parse_route() -> None:
    assert netifs.parse_route(ROUTE + "short line\n") == [
        ("eth0", ipaddress.IPv4Network("192.0.2.0/24")),
        ("ib0", ipaddress.IPv4Network("10.0.0.0/16")),
    ]


def _root(tmp_path: Path, ifaces: dict[str, tuple[str, str]]) -> Path:
    (tmp_path / "proc/net").mkdir(parents=True)
    (tmp_path / "proc/net/if_inet6").write_text(IF_INET6)
    (tmp_path / "proc/net/route").write_text(ROUTE)
    (tmp_path / "proc/net/fib_trie").write_text(FIB_TRIE)
    for name, (flags, oper) in ifaces.items():
        d = tmp_path / "sys/class/net" / name
        d.mkdir(parents=True)
        (d / "flags").write_text(flags + "\n")
        (d / "operstate").write_text(oper + "\n")
    return tmp_path


def test_probe_under_root(tmp_path: Path) -> None:
    root = _root(tmp_path, {"eth0": ("0x1003", "up"), "lo": ("0x9", "unknown"),
                            "ib0": ("0x1002", "down")})
    errors = ErrorLog()
    out = netifs.probe(NodeFS(root), errors)
    assert out == [
        {"name": "eth0", "up": True, "addresses": ["192.0.2.2", "fd00::2", "fe80::fc:ff:fe00:1"]},
        {"name": "ib0", "up": False, "addresses": ["10.0.3.7"]},
        {"name": "lo", "up": True, "addresses": ["127.0.0.1", "::1"]},
    ]
    assert netifs.nccl_ip_interfaces(out) == ["eth0"]
    # 198.51.100.9 has no connected route: left out, with an error naming it
    assert [(e["path"], e["error"]) for e in errors.entries] == [
        ("/proc/net/route", "IPv4 address 198.51.100.9 is covered by no connected route: "
                            "interface unknown")]


def test_only_loopback_means_no_nccl_interface(tmp_path: Path) -> None:
    (tmp_path / "proc/net").mkdir(parents=True)
    (tmp_path / "proc/net/if_inet6").write_text(
        "00000000000000000000000000000001 01 80 10 80       lo\n")
    out = netifs.probe(NodeFS(tmp_path), ErrorLog())
    assert [n["name"] for n in out] == ["lo"]
    assert netifs.nccl_ip_interfaces(out) == []


def test_nothing_readable(tmp_path: Path) -> None:
    errors = ErrorLog()
    assert netifs.probe(NodeFS(tmp_path), errors) == []
    assert errors.entries == []


@pytest.mark.skipif(not Path("/proc/net/fib_trie").exists(), reason="no /proc/net/fib_trie")
def test_procfs_reading_agrees_with_psutil_on_this_machine() -> None:
    """The --root reader, pointed at this machine's real /proc and /sys, sees what psutil sees."""
    errors = ErrorLog()
    from_procfs = netifs._from_procfs(NodeFS("/"), errors)
    assert from_procfs == netifs.probe(NodeFS("/"), ErrorLog())
    assert any(n["name"] == "lo" for n in from_procfs)
