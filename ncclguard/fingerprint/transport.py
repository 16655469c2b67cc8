"""Which network NCCL ends up on for one node: a plugin's name, ``IB``, ``RoCE`` or ``Socket``.

The derivation follows NCCL's own order (see docs/nccl.md, "Which transport a node ends
up on"), from the node's fingerprint and the settings of its ``/etc/nccl.conf``:

1. ``NCCL_NET`` forces a network by name (compared case-insensitively, as NCCL does).
2. A net plugin that NCCL would load (a common ABI with the default libnccl) is tried first.
3. NCCL's IB transport needs ``NCCL_IB_DISABLE`` unset or 0, libibverbs, an IP interface
   (``NCCL_SOCKET_IFNAME`` applies) and at least one port that is ``ACTIVE``, has link
   layer InfiniBand or Ethernet, and is selected by ``NCCL_IB_HCA``.
4. Otherwise ``Socket``.

A field that a probe could not read makes the result unknown (``None``) only when it could
change the result: an unreadable port on a node that already has an ACTIVE port of the
same link layer does not.

Standard library only: this module is on the prolog's hot path.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from ncclguard.fingerprint.fields import (
    errored,
    nccl_settings,
    net_plugin_state,
    part,
    port_active,
)

__all__ = [
    "TRANSPORT_SETTINGS",
    "effective_transport",
    "hca_matches",
    "nccl_ib_ports",
    "parse_ib_disable",
    "parse_if_list",
    "transport_inputs",
    "transport_under",
]

#: The ``NCCL_*`` settings the derivation reads (docs/nccl.md, "Which transport a node
#: ends up on").
TRANSPORT_SETTINGS = frozenset(
    ("NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_NET", "NCCL_SOCKET_IFNAME"))

IB = "IB"
ROCE = "RoCE"
SOCKET = "Socket"
_LINK_LAYERS = {"InfiniBand": IB, "Ethernet": ROCE}

#: A parsed NCCL interface list: (exclude, exact, [(prefix, port)]); port -1 means any port.
IfList = tuple[bool, bool, list[tuple[str, int]]]


def _atoi(text: str) -> int:
    """glibc's ``atoi``: ``(int) strtol(text, NULL, 10)``: leading white space, an optional
    sign, ASCII digits (no other digit: NCCL reads bytes); the long saturates at its
    range, then is cut to 32 bits (``"4294967297"`` is 1, a 20-digit number -1)."""
    s = text.lstrip(" \t\n\v\f\r")
    sign = 1
    if s[:1] in ("+", "-"):
        sign = -1 if s[0] == "-" else 1
        s = s[1:]
    end = 0
    while end < len(s) and s[end] in "0123456789":
        end += 1
    digits = s[:end].lstrip("0")
    n = sign * (int(digits) if len(digits) <= 20 else _INT64_MAX + 1) if digits else 0
    n = max(_INT64_MIN, min(_INT64_MAX, n))
    n &= 0xFFFFFFFF
    return n - (1 << 32) if n >= 1 << 31 else n


#: How many entries of a list NCCL reads (``parseStringList``'s ``maxList``):
#: ``MAX_IB_DEVS`` for ``NCCL_IB_HCA`` (16 before 2.18.5), ``MAX_IFS`` for
#: ``NCCL_SOCKET_IFNAME``; the rest of the list is ignored.
MAX_IB_DEVS, MAX_IB_DEVS_OLD, MAX_IFS = 32, 16, 16


def parse_if_list(spec: str | None, limit: int | None = None) -> IfList:
    """Parse ``NCCL_IB_HCA`` (or ``NCCL_SOCKET_IFNAME``) as NCCL does.

    A leading ``^`` makes it an exclude list, a following ``=`` makes names exact instead
    of prefixes. Entries are separated by ``,``; ``name:port`` selects one port (anything
    after a second ``:`` is ignored, as ``:rail:plane`` of 2.30.7). Empty names are skipped.
    No white space is trimmed. ``limit``: NCCL's ``maxList``, the entries read.

    >>> parse_if_list("^=mlx5_0:1,mlx5_1")
    (True, True, [('mlx5_0', 1), ('mlx5_1', -1)])
    """
    if spec is None:
        return (False, False, [])
    exclude, exact, entries = _parsed(spec, limit)
    return (exclude, exact, list(entries))


@functools.lru_cache(maxsize=64)
def _parsed(spec: str, limit: int | None) -> tuple[bool, bool, tuple[tuple[str, int], ...]]:
    """:func:`parse_if_list`, once per value: a job's value (up to 64 KiB) is the same on
    every node, and the gate derives each distinct record's transport with it."""
    exclude = spec.startswith("^")
    if exclude:
        spec = spec[1:]
    exact = spec.startswith("=")
    if exact:
        spec = spec[1:]
    entries: list[tuple[str, int]] = []
    for item in spec.split(","):
        name, colon, rest = item.partition(":")
        if not name:
            continue
        if limit is not None and len(entries) >= limit:
            break
        entries.append((name, _atoi(rest.split(":", 1)[0]) if colon else -1))
    return (exclude, exact, tuple(entries))


def hca_matches(spec: str | IfList | None, device: str, port: int = -1) -> bool:
    """Whether NCCL keeps ``device`` port ``port`` under the list ``spec`` (``NCCL_IB_HCA``).

    No list (unset or empty) keeps everything. Without ``=`` each entry is a prefix:
    ``mlx5_1`` also keeps ``mlx5_10``. An entry's port, if given, must equal ``port``;
    ``port=-1`` asks about the device as a whole (any port).

    >>> hca_matches("mlx5_1", "mlx5_10", 1), hca_matches("=mlx5_1", "mlx5_10", 1)
    (True, False)
    >>> hca_matches("^mlx5_0:1", "mlx5_0", 1), hca_matches("^mlx5_0:1", "mlx5_0", 2)
    (False, True)
    """
    exclude, exact, entries = parse_if_list(spec) if not isinstance(spec, tuple) else spec
    if not entries:
        matched = True  # NCCL: "no user list" matches all, so "^" alone excludes all
    else:
        matched = False
        for name, want in entries:
            if (device == name if exact else device.startswith(name)) and (
                want == -1 or port == -1 or want == port
            ):
                matched = True
                break
    return matched != exclude


def parse_ib_disable(value: str | None) -> bool:
    """``NCCL_IB_DISABLE`` as NCCL reads an integer parameter: non-zero disables IB.

    NCCL parses it with ``strtoll(value, NULL, 0)`` and rejects it only when ``errno`` is
    set (an overflow): leading white space and a sign are skipped, ``0x`` means hex, a
    leading ``0`` octal, and the longest valid prefix counts (``"1 # off"`` is 1, ``"08"``
    is 0, ``"abc"`` is 0). See :func:`strtoll_base0`.
    """
    if value is None:
        return False
    parsed = strtoll_base0(value)
    return parsed is not None and parsed != 0


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def strtoll_base0(text: str) -> int | None:
    """C's ``strtoll(text, NULL, 0)``; ``None`` where it sets ``errno`` (out of range)."""
    i, n = 0, len(text)
    while i < n and text[i] in " \t\n\v\f\r":
        i += 1
    sign = 1
    if i < n and text[i] in "+-":
        sign = -1 if text[i] == "-" else 1
        i += 1
    base, digits = 10, "0123456789"
    if text[i : i + 2].lower() == "0x" and i + 2 < n and text[i + 2] in "0123456789abcdefABCDEF":
        base, digits, i = 16, "0123456789abcdefABCDEF", i + 2
    elif text[i : i + 1] == "0":
        base, digits = 8, "01234567"
    j = i
    while j < n and text[j] in digits:
        j += 1
    if j == i:
        return 0  # no conversion: strtoll returns 0 (glibc leaves errno alone)
    if j - i - (len(text[i:j]) - len(text[i:j].lstrip("0"))) > 64:
        return None  # out of range in any base (and never a 64 KiB int() for a job's value)
    value = sign * int(text[i:j], base)
    return value if _INT64_MIN <= value <= _INT64_MAX else None


def _selected_ports(
    fp: dict, settings: dict[str, str], limit: int = MAX_IB_DEVS
) -> list[tuple[str, dict, bool | None, str | None]] | None:
    """``(device, port, active, kind)`` of every port that ``NCCL_IB_HCA`` selects.

    ``active`` is ``None`` when the state is unreadable; ``kind`` is ``"IB"``, ``"RoCE"``,
    ``""`` (another link layer: NCCL skips it) or ``None`` (unreadable). A device whose
    port list is unreadable gives one entry with an empty port, both unknown. ``None``:
    the device list itself is unknown.
    """
    rdma = part(fp, "rdma")
    devices = rdma.get("devices") if isinstance(rdma, dict) else None
    # the error fields, looked up exactly: the probes name each field they could not read
    bad = {e.get("field") for e in fp.get("errors") or ()}
    if devices is None or "rdma.devices" in bad:
        return None
    spec = parse_if_list(settings.get("NCCL_IB_HCA"), limit)
    out: list[tuple[str, dict, bool | None, str | None]] = []
    for dev in devices:
        name = dev.get("name")
        if not isinstance(name, str):
            return None
        field = f"rdma.devices.{name}" if bad else ""
        ports = dev.get("ports")
        if ports is None or (bad and (field in bad or field + ".ports" in bad)):
            if hca_matches(spec, name, -1):
                out.append((name, {}, None, None))
            continue
        for p in ports:
            num = p.get("port")
            if not hca_matches(spec, name, num if isinstance(num, int) else -1):
                continue
            ll = p.get("link_layer")
            active = port_active(p)
            kind = None if ll is None else _LINK_LAYERS.get(ll, "")
            if bad:
                pfield = f"{field}.ports.{num}"
                if pfield + ".state" in bad:
                    active = None
                if pfield + ".link_layer" in bad:
                    kind = None
            out.append((name, p, active, kind))
    return out


def nccl_ib_ports(fp: dict, settings: dict[str, str] | None = None) -> list[dict] | None:
    """The RDMA ports NCCL's IB transport would use, each with ``"device"`` added.

    ``None`` when that cannot be known: the device list, or the state or link layer of a
    port that ``NCCL_IB_HCA`` selects, could not be read. Ignores ``NCCL_IB_DISABLE``.
    """
    if settings is None:
        settings = nccl_settings(fp)
        if settings is None:
            return None
    selected = _selected_ports(fp, settings)
    if selected is None:
        return None
    used: list[dict] = []
    for name, p, active, kind in selected:
        if active is None or (active and kind is None):
            return None
        if active and kind:
            used.append({**p, "device": name})
    return used


def _ib_result(fp: dict, settings: dict[str, str]) -> str | None:
    """IB/RoCE/IB+RoCE from the usable ports; Socket when none; None when unknown.

    Ports whose state or link layer is unknown make the result unknown only if they
    could add a link layer that the known ports don't already give.
    """
    got = _ib_kinds(_selected_ports(fp, settings))
    # NCCL before 2.18.5 reads 16 entries: known only where both readings agree
    if (len(parse_if_list(settings.get("NCCL_IB_HCA"), MAX_IB_DEVS)[2]) > MAX_IB_DEVS_OLD
            and _ib_kinds(_selected_ports(fp, settings, MAX_IB_DEVS_OLD)) != got):
        return None
    return got


def _ib_kinds(
    selected: list[tuple[str, dict, bool | None, str | None]] | None,
) -> str | None:
    if selected is None:
        return None
    sure: set[str] = set()
    maybe: set[str] = set()
    for _, _, active, kind in selected:
        if active is False or kind == "":
            continue
        kinds = {IB, ROCE} if kind is None else {kind}
        (sure if active and kind is not None else maybe).update(kinds)
    if not maybe <= sure:
        return None
    if not sure:
        return SOCKET
    return "+".join(k for k in (IB, ROCE) if k in sure)


def _has_ip_interface(fp: dict, settings: dict[str, str]) -> bool | None:
    netifs = part(fp, "netifs")
    if netifs is None:
        return None
    value = settings.get("NCCL_SOCKET_IFNAME")
    # NCCL takes the value only when longer than one byte (``strlen(env) > 1``), else
    # picks interfaces itself: ib, any but docker and lo, docker, lo: any that is up
    if value is not None and len(value.encode("utf-8", "surrogateescape")) <= 1:
        value = None
    spec = parse_if_list(value, MAX_IFS)
    for nif in netifs:
        name = nif.get("name")
        if nif.get("up") is False or not nif.get("addresses") or not isinstance(name, str):
            continue
        if hca_matches(spec, name, -1):
            return True
    return False


def effective_transport(fp: dict, with_plugin: bool = True,
                        plugin: tuple[bool, str | None] | bool | None = False) -> str | None:
    """The network NCCL would use on this node; ``None`` when it cannot be known.

    ``with_plugin=False``: the network NCCL's own transports give this node when no net
    plugin is used (a container whose libnccl cannot use the node's plugin, issue 15).

    Returns the net plugin's name when NCCL would load one, else ``"IB"``, ``"RoCE"``,
    ``"IB+RoCE"`` (ACTIVE ports of both link layers) or ``"Socket"``. A ``NCCL_NET`` that
    names no network available on the node gives ``"none (NCCL_NET=<value>)"``: NCCL
    fails to initialise there.

    ``plugin``: the net plugin's ``(used, name)`` when already known (``None``: unknown),
    in place of :func:`~ncclguard.fingerprint.fields.net_plugin_state` of ``fp`` (False).
    """
    settings = nccl_settings(fp)
    if settings is None:
        return None
    forced = settings.get("NCCL_NET")
    wanted = forced.lower() if forced is not None else None
    if with_plugin and wanted not in ("ib", "socket"):
        if plugin is False:
            plugin = net_plugin_state(fp)
        if not isinstance(plugin, tuple):
            return None
        used, name = plugin
        if used and name is not None and (wanted is None or wanted == name.lower()):
            return name
    if wanted == "socket":
        return SOCKET
    # the value may be a job's (issue 40): cut, as every user string in a message
    from ncclguard.text import cut  # here only: off the gate's usual path

    unavailable = f"none (NCCL_NET={forced if forced is None else cut(forced)})"
    if wanted not in (None, "ib"):
        return unavailable
    fallback = unavailable if wanted == "ib" else SOCKET
    if parse_ib_disable(settings.get("NCCL_IB_DISABLE")):
        return fallback
    rdma = part(fp, "rdma")
    if rdma is None:
        return None
    if isinstance(rdma, dict) and "libibverbs" in rdma and rdma["libibverbs"] is None:
        if errored(fp, "rdma.libibverbs"):
            return None
        return fallback
    result = _ib_result(fp, settings)
    if result is None:
        return None
    if result == SOCKET:
        return fallback
    has_ip = _has_ip_interface(fp, settings)
    if has_ip is None:
        return None
    return result if has_ip else fallback



#: The parts :func:`effective_transport` reads, besides the net plugin's state.
_INPUT_PARTS = ("nccl_conf", "rdma", "netifs")
_PORT_KEYS = ("port", "link_layer", "state", "state_code")


def transport_inputs(fp: dict) -> str:
    """What :func:`effective_transport` reads of ``fp``, and nothing else, as compact JSON:
    kept with a node's record so that the gate can derive the node's transport again
    under a job's own ``NCCL_*`` settings (:func:`transport_under`, issue 40) without the
    fingerprint. The net plugin's state is kept as derived (``plugin``: ``[used, name]``,
    None when unknown); of the RDMA ports and IP interfaces only the fields read; of
    ``errors`` only those of these parts (an error is what makes a value unknown)."""
    mini: dict[str, Any] = {}
    conf = fp.get("nccl_conf")
    mini["nccl_conf"] = ({k: conf[k] for k in ("present", "settings") if k in conf}
                         if isinstance(conf, dict) else conf)
    rdma = fp.get("rdma")
    if isinstance(rdma, dict):
        devices = rdma.get("devices")
        if isinstance(devices, list):
            devices = [_device(d) for d in devices]
        mini["rdma"] = {**({"libibverbs": None if rdma["libibverbs"] is None else 1}
                           if "libibverbs" in rdma else {}), "devices": devices}
    else:
        mini["rdma"] = rdma
    netifs = fp.get("netifs")
    mini["netifs"] = ([{"name": n.get("name"), "up": n.get("up"),
                        "addresses": [1] if n.get("addresses") else []}
                       if isinstance(n, dict) else n for n in netifs]
                      if isinstance(netifs, list) else netifs)
    mini["errors"] = [{"field": e.get("field"), "probe": e.get("probe")}
                      for e in fp.get("errors") or () if isinstance(e, dict)
                      and str(e.get("field") or "").startswith(_INPUT_PARTS)]
    state = net_plugin_state(fp)
    mini["plugin"] = None if state is None else list(state)
    return json.dumps(mini, separators=(",", ":"), sort_keys=True)


def _device(dev: Any) -> Any:
    if not isinstance(dev, dict):
        return dev
    ports = dev.get("ports")
    if isinstance(ports, list):
        ports = [{k: p.get(k) for k in _PORT_KEYS} if isinstance(p, dict) else p
                 for p in ports]
    return {"name": dev.get("name"), "ports": ports}


def transport_under(inputs: str | None, settings: Mapping[str, str],
                    with_plugin: bool = True) -> str | None:
    """The transport of the node whose :func:`transport_inputs` are ``inputs``, with
    ``settings`` (a job's own ``NCCL_*`` variables) over its ``/etc/nccl.conf``'s: NCCL
    applies the file only where the environment does not set a variable
    (``setenv(..., 0)``, docs/nccl.md). ``None``: unknown (no inputs, inputs that are
    not such a value, or a value the node's record cannot tell)."""
    try:
        mini = json.loads(inputs) if isinstance(inputs, str) else None
        if not isinstance(mini, dict):
            return None
        conf = nccl_settings(mini)
        if not isinstance(conf, dict):
            return None
        mini["nccl_conf"] = {"present": True, "settings": {**conf, **settings}}
        state = mini.get("plugin")
        plugin = (bool(state[0]), state[1] if isinstance(state[1], str) else None) if (
            isinstance(state, list) and len(state) == 2) else None
        return effective_transport(mini, with_plugin, plugin)
    except (ValueError, TypeError, AttributeError, KeyError, RecursionError):
        return None
