"""Reading the fingerprint fields that the policy needs, telling *unknown* from *absent*.

docs/fingerprint.md: a value a probe could not read is ``null`` with an entry in
``errors``; an absent thing (no plugin, no config file) is ``null`` or empty without one.
Every accessor here returns ``None`` for unknown and an explicit value for absent
(``"none"``, ``{}``, ``0``), so that rules never mistake an unreadable field for a
difference. Standard library only: the prolog's hot path.
"""

from __future__ import annotations

__all__ = [
    "ABSENT",
    "default_libnccl",
    "errored",
    "nccl_settings",
    "nccl_version",
    "net_plugin",
    "net_plugin_state",
]

ABSENT = "none"


def errored(fp: dict, prefix: str) -> bool:
    """Whether ``errors`` holds an entry for the field ``prefix`` or a field below it."""
    for e in fp.get("errors") or ():
        f = e.get("field") or ""
        if f == prefix or f.startswith((prefix + ".", prefix + "[")):
            return True
    return False


def nccl_settings(fp: dict) -> dict[str, str] | None:
    """The settings of ``/etc/nccl.conf`` as NCCL parses them: ``{}`` when there is no
    file, ``None`` when the file or the section could not be read."""
    conf = fp.get("nccl_conf")
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
    """The default libnccl's full version; ``"none"`` if the node has none; ``None``: unknown."""
    if fp.get("libnccl") is None:
        return None
    lib = default_libnccl(fp)
    if lib is None:
        return ABSENT
    return lib.get("version")


def net_plugin(fp: dict) -> tuple[str, int] | None:
    """``(name, effective net ABI)`` of the default net plugin; ``None`` when unknown.

    ``("none", 0)``: no default net plugin. ABI ``0``: the plugin is there, but it and the
    default libnccl have no ``ncclNetPlugin_vN`` in common, so NCCL ignores it. The ABI is
    the highest N in both sets (nccl-facts, "Plugins NCCL loads"); the probe's
    ``net.effective_net_abi`` is used only when the ABI lists are missing.
    """
    plugins = fp.get("plugins")
    net = fp.get("net")
    if plugins is None and net is None:
        return None
    entry = None
    for p in plugins or ():
        if p.get("kind") == "net" and p.get("default"):
            entry = p
            break
    if entry is None:
        path = net.get("plugin") if isinstance(net, dict) else None
        if path is None:
            if plugins is None or errored(fp, "net.plugin"):
                return None
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
    lib = default_libnccl(fp)
    lib_abis = (lib.get("abis") or {}).get("net") if lib is not None else []
    if fp.get("libnccl") is None:
        lib_abis = None
    if plugin_abis is None or lib_abis is None:
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
