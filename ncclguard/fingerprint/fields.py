"""Reading the fingerprint fields that the policy needs, telling *unknown* from *absent*.

docs/fingerprint.md: a value a probe could not read is ``null`` with an entry in
``errors``; an absent thing (no plugin, no config file) is ``null`` or empty without one.
Every accessor here returns ``None`` for unknown and an explicit value for absent
(``"none"``, ``{}``, ``0``), so that rules never mistake an unreadable field for a
difference. Standard library only: the prolog's hot path.
"""

from __future__ import annotations

from typing import Any

from ncclguard.fingerprint.model import PROBES

__all__ = [
    "ABSENT",
    "active_ports",
    "default_libnccl",
    "errored",
    "nccl_settings",
    "nccl_version",
    "net_plugin",
    "net_plugin_state",
]

ABSENT = "none"

def errored(fp: dict, prefix: str, exact: bool = False) -> bool:
    """Whether ``errors`` holds an entry for the field ``prefix`` (or, unless ``exact``,
    a field below it)."""
    for e in fp.get("errors") or ():
        f = e.get("field") or ""
        if f == prefix or (not exact and f.startswith((prefix + ".", prefix + "["))):
            return True
    return False


def part(fp: dict, key: str) -> Any:
    """``fp[key]``, or ``None`` when the probe that fills it failed as a whole.

    ``collect()`` replaces a failed probe's part by its empty value and records an
    error whose field is the probe's name; that empty value is unknown, not absent.
    """
    value = fp.get(key)
    probe = PROBES.get(key)
    if value is not None and probe is not None:
        for e in fp.get("errors") or ():
            if e.get("field") == probe and e.get("probe") == probe:
                return None
    return value


def probe_errors(fp: dict, probe: str, ignore: tuple[str, ...] = ()) -> bool:
    """Whether the probe ``probe`` recorded any error outside the fields ``ignore``."""
    return any(
        e.get("probe") == probe and (e.get("field") or "") not in ignore
        for e in fp.get("errors") or ()
    )


def nccl_settings(fp: dict) -> dict[str, str] | None:
    """The settings of ``/etc/nccl.conf`` as NCCL parses them: ``{}`` when there is no
    file, ``None`` when the file or the section could not be read."""
    conf = part(fp, "nccl_conf")
    if conf is None:
        return None
    if conf.get("present") is False:
        return {}
    settings = conf.get("settings")
    return settings if isinstance(settings, dict) else None


def default_libnccl(fp: dict) -> dict | None:
    """The ``libnccl`` entry the dynamic linker resolves (``default: true``), if any."""
    for lib in fp.get("libnccl") or ():
        if lib.get("default"):
            return lib
    return None


def nccl_version(fp: dict) -> str | None:
    """The default libnccl's full version; ``"none"`` if the node has none; ``None``: unknown.

    With no default library, any error of the nccl probe (an unreadable library, ld.so
    cache or directory) makes it unknown: the missing one may be the default.
    """
    if part(fp, "libnccl") is None:
        return None
    lib = default_libnccl(fp)
    if lib is None:
        return None if probe_errors(fp, "nccl", ignore=("libnccl.version",)) else ABSENT
    return lib.get("version")


def net_plugin(fp: dict) -> tuple[str, int] | None:
    """``(name, effective net ABI)`` of the default net plugin; ``None`` when unknown.

    ``("none", 0)``: no default net plugin. ABI ``0``: the plugin is there, but it and the
    default libnccl have no ``ncclNetPlugin_vN`` in common, so NCCL ignores it. The ABI is
    the highest N in both sets (nccl-facts, "Plugins NCCL loads"); the probe's
    ``net.effective_net_abi`` is used only when the ABI lists are missing.
    """
    plugins = part(fp, "plugins")
    net = part(fp, "net")
    if plugins is None or net is None:
        return None
    entry = None
    for p in plugins:
        if p.get("kind") == "net" and p.get("default"):
            entry = p
            break
    if entry is None:
        path = net.get("plugin") if isinstance(net, dict) else None
        if path is None:
            if errored(fp, "plugins", exact=True) or errored(fp, "plugins.net"):
                return None  # the default plugin may be the one that could not be read
            return (ABSENT, 0)
        entry = {"path": path}
    if entry.get("error"):
        return None
    names = entry.get("names") or {}
    name = entry.get("name") or names.get("net")
    if not name:
        path = entry.get("path") or ""
        name = path.rsplit("/", 1)[-1] or "?"
    plugin_abis = (entry.get("abis") or {}).get("net")
    version = nccl_version(fp)
    if version == ABSENT:
        return (name, 0)  # no libnccl: nothing loads the plugin
    lib = default_libnccl(fp)
    lib_abis = (lib.get("abis") or {}).get("net") if lib is not None and version else None
    if plugin_abis is None or not lib_abis:  # a library naming no ABI: unknown (a stub)
        abi = net.get("effective_net_abi") if isinstance(net, dict) else None
        if abi is None:
            return None
        return (name, int(abi))
    common = set(plugin_abis) & set(lib_abis)
    return (name, max(common) if common else 0)


def net_plugin_state(fp: dict) -> tuple[bool, str | None] | None:
    """``(used, name)`` of the default net plugin for the transport; ``None``: unknown."""
    state = net_plugin(fp)
    if state is None:
        return None
    name, abi = state
    return (abi > 0, name if abi > 0 else None)


def port_active(port: dict) -> bool | None:
    """Whether an RDMA port is ACTIVE, as NCCL reads its state (``state`` ``ACTIVE`` or
    ``state_code`` 4); ``None`` when neither could be read."""
    state, code = port.get("state"), port.get("state_code")
    if state is None and code is None:
        return None
    return state == "ACTIVE" or code == 4


def active_ports(fp: dict) -> int | None:
    """How many RDMA ports of the node are ACTIVE (:func:`port_active`), whatever their
    link layer or ``NCCL_IB_HCA``; ``None`` when that cannot be known: the rdma part, a
    device's port list or a port's state could not be read. Unknown is never "down".

    The store's ``rdma_ports_up`` column, ``ncclguard diff``'s ``rdma.active_ports`` and
    ``drain-recommend``'s ports-down check all read this one number.
    """
    rdma = part(fp, "rdma")
    if not isinstance(rdma, dict) or errored(fp, "rdma.devices", exact=True):
        return None
    count = 0
    for dev in rdma.get("devices") or ():
        if not isinstance(dev, dict):
            continue
        if errored(fp, f"rdma.devices.{dev.get('name')}.ports", exact=True):
            return None
        for port in dev.get("ports") or ():
            if not isinstance(port, dict):
                continue
            active = port_active(port)
            if active is None:
                return None
            count += active
    return count
