"""Which addresses each node's records may be signed from: Slurm's ``NodeAddr`` and
``NodeHostname`` of the node, resolved (or the static ``[collector.addresses]``), and the
publisher's uid. The collector (:mod:`inventoryd.controller.collector`) and the container
records (:mod:`inventoryd.controller.container_records`) judge origins by them
(:mod:`inventoryd.controller.verify`)."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import pwd
import socket
import time
from collections.abc import Callable, Iterable

from ncclguard import config as configmod

__all__ = ["ADDRESS_RETRY_S", "Addresses", "publisher_uid", "resolve"]

log = logging.getLogger("ncclguard.collector")

ADDRESS_RETRY_S = 30.0  # Slurm is asked again at most this often when it failed, or
                        # when a record names a node it did not list


def publisher_uid(name: str) -> int:
    """The uid of ``[collector] publisher`` (a user name or a number)."""
    if name.isdigit():
        return int(name)
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        raise configmod.ConfigError(
            f"collector.publisher = {name!r}: no such user on this host"
        ) from None


def resolve(names: Iterable[str]) -> frozenset[str]:
    """The IPv4 addresses of host names and address literals (MUNGE encodes IPv4).

    A name that resolves to a loopback address counts for nothing: munged's default
    origin is the address of its own host name, which many images map to 127.0.1.1 or
    127.0.0.1, so a loopback address from a lookup would let every such node sign as
    this one. A loopback *literal* (an admin's explicit NodeAddr) is kept.
    ``0.0.0.0`` (munged's origin when it cannot find one) never counts."""
    out: set[str] = set()
    for name in names:
        if not name:
            continue
        try:
            ip = ipaddress.ip_address(name)
        except ValueError:
            pass
        else:
            if ip.version == 4 and not ip.is_unspecified:
                out.add(str(ip))
            continue
        with contextlib.suppress(OSError, UnicodeError):
            for info in socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM):
                found = ipaddress.ip_address(info[4][0])
                if not (found.is_loopback or found.is_unspecified):
                    out.add(str(found))
    return frozenset(out)


class Addresses:
    """Node name -> the addresses its records may be signed from.

    From the static map when ``[collector.addresses]`` is set; otherwise from Slurm
    (``NodeAddr`` and ``NodeHostname`` of every node, resolved), asked again after
    ``address_refresh_s``, and at most every ``ADDRESS_RETRY_S`` when it failed or when
    a record names a node it did not list. When Slurm cannot be asked, the last answer
    is kept. An address that several nodes share proves nothing about which one signed:
    it is dropped from all of them (``shared`` lists them).
    """

    def __init__(
        self,
        config: configmod.CollectorConfig,
        slurm_nodes: Callable[[], Iterable[tuple[str, str, str]]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.slurm_nodes = slurm_nodes
        self.clock = clock
        self._map: dict[str, frozenset[str]] | None = None
        self._at: float | None = None
        self.error: str | None = None
        self.shared: dict[str, list[str]] = {}  # address -> the nodes that share it
        if config.addresses:
            self._map = self._unshared({n: resolve(a) for n, a in config.addresses.items()})

    def _unshared(self, m: dict[str, frozenset[str]]) -> dict[str, frozenset[str]]:
        owners: dict[str, list[str]] = {}
        for node, addrs in m.items():
            for a in addrs:
                owners.setdefault(a, []).append(node)
        self.shared = {a: sorted(n) for a, n in owners.items() if len(n) > 1}
        if not self.shared:
            return m
        return {node: addrs - self.shared.keys() for node, addrs in m.items()}

    def _refresh(self) -> None:
        if self.config.addresses or self.slurm_nodes is None:
            return
        self._at = self.clock()
        try:
            nodes = list(self.slurm_nodes())
        except Exception as e:  # a Slurm call: any failure keeps the previous map
            self.error = f"{type(e).__name__}: {e}"
            return
        self.error = None
        self._map = self._unshared({name: resolve((addr, host)) for name, addr, host in nodes})

    def of(self, node: str) -> frozenset[str] | None:
        """The node's addresses, or None when the node is unknown."""
        age = None if self._at is None else self.clock() - self._at
        if (
            age is None
            or age >= self.config.address_refresh_s
            or ((self._map is None or node not in self._map) and age >= ADDRESS_RETRY_S)
        ):
            self._refresh()
        return None if self._map is None else self._map.get(node)

    def listed(self, node: str) -> bool | None:
        """Whether ``node`` is a known node (asked of Slurm as :meth:`of` asks); None
        while no map is known at all."""
        addrs = self.of(node)
        if addrs is None and not self.known:
            return None
        return addrs is not None

    @property
    def known(self) -> bool:
        return self._map is not None
