"""What makes a signed file in the spool authentic, for node records and container records
alike (docs/collector.md): munged decodes it, it is neither expired nor signed in the
future, and it was signed from an address of the node it names.

Each check raises :class:`Reject` with the cause (a key of :data:`ncclguard.spool.CAUSES`)
and a detail, or :class:`Defer` when the answer cannot be had now (the collector's
munged is down, Slurm has never said where the nodes are): the caller stops there and
tries again at the next scan, so that an outage never rejects good records.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import time
from typing import TYPE_CHECKING

from ncclguard import config as configmod
from ncclguard import munge

if TYPE_CHECKING:
    from inventoryd.controller.addresses import Addresses

__all__ = ["FUTURE_SKEW_S", "Defer", "Reject", "authentic", "from_node", "printable", "ts",
           "wrong_address"]

FUTURE_SKEW_S = configmod.HEARTBEAT_SKEW_S  # signed further ahead: rejected as rewound
_PRINTABLE = re.compile(r"[A-Za-z0-9_.+@:=,-]{1,200}")


def printable(name: str) -> str:
    """A spool file name as logs and tables may show it: as it is when it holds only
    harmless characters, else its ``repr`` (no newline, escape or control character of
    a spool writer's choosing reaches a log line or a terminal)."""
    return name if _PRINTABLE.fullmatch(name) else repr(name)[:200]


class Reject(Exception):
    """The record is rejected: ``cause`` (``ncclguard.spool.CAUSES``), ``detail``."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause
        self.detail = detail


class Defer(Exception):
    """The rest of this scan cannot be judged now (munged down, no node addresses)."""


def ts(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def authentic(data: bytes, where: str, socket_path: str | None,
              now: float | None = None) -> munge.Credential:
    """The credential in ``data``, decoded by the local munged: not expired, and not
    signed more than :data:`FUTURE_SKEW_S` ahead of this host's clock."""
    try:
        cred = munge.decode(data, socket_path=socket_path)
    except munge.MungeUnavailable as e:
        raise Defer(f"munged: {e}") from None
    except munge.MungeError as e:
        raise Reject("undecodable", f"{where}: {e}") from None
    if cred.status == munge.EXPIRED:
        raise Reject("expired", f"signed at {ts(cred.encoded_at)}, ttl {cred.ttl} s")
    now = time.time() if now is None else now
    if cred.status == munge.REWOUND or cred.encoded_at > now + FUTURE_SKEW_S:
        raise Reject("rewound", f"signed at {ts(cred.encoded_at)}, "
                     f"{cred.encoded_at - now:.0f} s in the future (the node's clock is "
                     f"ahead; at most {FUTURE_SKEW_S} s is accepted)")
    return cred


def from_node(addresses: Addresses, host: str, origin: str) -> None:
    """Signed from one of ``host``'s addresses (Slurm's, or the static map)."""
    addrs = addresses.of(host)
    if addrs is None:
        if not addresses.known:
            raise Defer(f"no node addresses from Slurm yet: {addresses.error}")
        raise Reject("unknown-node", f"{host} is not a node of Slurm or of "
                     f"[collector.addresses] (signed from {origin})")
    if origin not in addrs:
        raise Reject("wrong-address", wrong_address(host, origin, addrs))


def wrong_address(host: str, origin: str, addrs: frozenset[str]) -> str:
    """Why a record of ``host`` signed from ``origin`` is refused. With no address for the
    node and a loopback origin it is most likely one machine (controller and node) whose
    host name resolves only to 127.0.1.1 or 127.0.0.1, and the text says what to set."""
    why = f"signed from {origin}, which is not {host}'s"
    if addrs:
        return f"{why} ({', '.join(sorted(addrs))})"
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(origin).is_loopback:
            return (f"{why} (no address resolved: its names resolve only to loopback "
                    f"addresses, which never count; munged signs from the address of its "
                    f"host name: name {origin} for {host} in [collector.addresses], or set "
                    f"munged's --origin and Slurm's NodeAddr to the node's address; "
                    f"docs/install.md)")
    return f"{why} (no address resolved)"
