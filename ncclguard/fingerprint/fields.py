"""Reading the fingerprint fields that the policy needs, telling *unknown* from *absent*.

docs/fingerprint.md: a value a probe could not read is ``null`` with an entry in
``errors``; an absent thing (no plugin, no config file) is ``null`` or empty without one.
Every accessor here returns ``None`` for unknown and an explicit value for absent
(``"none"``, ``{}``, ``0``), so that rules never mistake an unreadable field for a
difference. Standard library only: the prolog's hot path.
"""

from __future__ import annotations

from typing import Any

from ncclguard.fingerprint.abi import exported, highest_common
from ncclguard.fingerprint.model import EFFECTIVE_KINDS, PROBES, obj

__all__ = [
    "ABSENT",
    "active_ports",
    "default_libnccl",
    "errored",
    "nccl_settings",
    "nccl_version",
    "net_plugin",
    "net_plugin_state",
    "plugin_in_force",
    "plugin_record",
    "plugins_in_force",
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


def _abi_in_force(fp: dict, entry: dict, kind: str, stored: Any) -> int | None:
    """The ABI NCCL uses for ``kind`` from the plugin file ``entry``: the highest both it
    and the default libnccl know (:mod:`ncclguard.fingerprint.abi`), ``0`` for none in
    common; the probe's ``stored`` value only when the ABI lists are missing."""
    plugin_abis = entry.get("abis")
    version = nccl_version(fp)
    if version == ABSENT:
        return 0  # no libnccl: nothing loads the plugin
    lib = default_libnccl(fp)
    lib_abis = (lib.get("abis") or {}).get(kind) if lib is not None and version else None
    if not isinstance(plugin_abis, dict) or not lib_abis:  # a library naming no ABI: a stub
        return int(stored) if type(stored) is int else None
    return highest_common(lib_abis, exported(plugin_abis, kind)) or 0


def _name(entry: dict, kind: str) -> str:
    names = entry.get("names") or {}
    name = (entry.get("name") if entry.get("kind") == kind else None) or names.get(kind)
    if not name:
        path = entry.get("path") or ""
        name = path.rsplit("/", 1)[-1] or "?"
    return str(name)


def plugin_record(fp: dict, path: Any) -> dict | None:
    """The ``plugins`` entry of the file at ``path`` (any kind), if listed."""
    for p in fp.get("plugins") or ():
        if isinstance(p, dict) and p.get("path") == path:
            return p
    return None


def net_plugin(fp: dict) -> tuple[str, int] | None:
    """``(name, effective net ABI)`` of the default net plugin; ``None`` when unknown.

    ``("none", 0)``: no default net plugin. ABI ``0``: the plugin is there, but it and the
    default libnccl have no ``ncclNetPlugin_vN`` in common, so NCCL ignores it. The ABI is
    the highest N in both sets (docs/nccl.md, "Plugins NCCL loads"); the probe's
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
    stored = net.get("effective_net_abi") if isinstance(net, dict) else None
    abi = _abi_in_force(fp, entry, "net", stored)
    return None if abi is None else (_name(entry, "net"), abi)


def plugin_in_force(fp: dict, kind: str) -> tuple[str, int] | None:
    """``(name, ABI)`` of the ``kind`` plugin NCCL loads (tuner, profiler, env, gin, rma),
    read from ``effective.<kind>`` as :func:`net_plugin` reads the net one.

    ``("none", 0)``: none (no file, the kind disabled, or a libnccl that loads no such
    plugin); ABI ``0``: the file NCCL opens shares no ABI with the libnccl, so NCCL does
    not use it; ``None``: unknown (the probe failed, the file could not be read, or the
    record predates the ``effective`` part: a daemon before issue 13).
    """
    eff = part(fp, "effective")
    if not isinstance(eff, dict) or part(fp, "plugins") is None:
        return None
    rec = eff.get(kind)
    if not isinstance(rec, dict):
        return None
    path = rec.get("plugin")
    if path is None:
        if errored(fp, "plugins", exact=True) or errored(fp, f"plugins.{kind}"):
            return None
        if rec.get("via") is None and rec.get("abi") is None and rec.get("reason") is None:
            return None  # an empty record: not an answer
        return (ABSENT, 0)
    entry = plugin_record(fp, path) or {"path": path}
    if entry.get("error"):
        return None
    abi = _abi_in_force(fp, entry, kind, rec.get("abi"))
    if abi is None:
        return None
    name = rec.get("name") if isinstance(rec.get("name"), str) else None
    return (name or _name(entry, kind), abi)


def plugins_in_force(fp: dict) -> list[dict[str, Any]]:
    """One row per plugin kind: the library NCCL loads for it and the ABI in force (the
    policy's reading, :func:`plugin_in_force`), and the
    probe's reason when there is none."""
    net = obj(fp, "net")
    state = net_plugin(fp)
    rows = [{"kind": "net", "plugin": net.get("plugin"), "via": "net" if net.get("plugin")
             else None, "name": state[0] if state else None,
             "abi": state[1] if state else None, "reason": net.get("reason")}]
    eff = obj(fp, "effective")
    for kind in EFFECTIVE_KINDS:
        rec = obj(eff, kind)
        state = plugin_in_force(fp, kind)
        rows.append({"kind": kind, "plugin": rec.get("plugin"), "via": rec.get("via"),
                     "name": state[0] if state else None, "abi": state[1] if state else None,
                     "reason": rec.get("reason") if rec else "not recorded (an older daemon)"})
    return rows


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
