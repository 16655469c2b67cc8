"""The NCCL plugins this node would load, what ABIs they speak, and the net ABI in use.

Which file (docs/nccl-facts.md, and NCCL's src/plugin/*.cc): NCCL ``dlopen``s a name,
so the dynamic linker's search decides (:mod:`inventoryd.probes.linker`). The name comes
from ``NCCL_NET_PLUGIN`` (here: as ``/etc/nccl.conf`` sets it; a job's environment is
not known to the node), with the rules of the default libnccl's version:

- unset: ``libnccl-net.so``;
- 2.11 to 2.20: ``X`` means ``libnccl-net-X.so``;
- 2.21 to 2.26: ``X`` as given (a name or a path), then ``libnccl-net-X.so``;
- 2.27 on: a comma-separated list, each item as above, first usable one wins;
- 2.28 on: ``none`` (any case) means no external net plugin.

Tuner (``NCCL_TUNER_PLUGIN``; default ``libnccl-tuner.so``, ``X``: as given, then
``libnccl-tuner-X.so``) and profiler (``NCCL_PROFILER_PLUGIN``; ``libnccl-profiler.so``,
``libnccl-profiler-X.so``) plugins are looked for when the default libnccl looks up
their symbols. Plus every plugin in the configured ``plugin_search_paths``.

What each file speaks: its exported ``ncclNetPlugin_vN`` / ``ncclCollNetPlugin_vN`` /
``ncclTunerPlugin_vN`` / ``ncclProfiler_vN`` dynamic symbols (:mod:`inventoryd.elf`), and
the ``name`` that each struct's first field points to. The net ABI in use is the highest
N that both the default libnccl looks for and the default net plugin exports; if they
share none, NCCL ignores the plugin and uses its internal IB/Socket transports.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, BinaryIO

from inventoryd.filecache import FileCache
from inventoryd.nodefs import ErrorLog, NodeFS
from inventoryd.probes import linker
from ncclguard.config import InventorydConfig

PROBE = "plugins"
KIND = "nccl-plugin/1"
ABI_KINDS = ("net", "collnet", "tuner", "profiler")
MAX_LIST_ITEMS = 16  # NCCL_NET_PLUGIN list items considered (NCCL itself keeps a few)
MAX_CONFIG_PLUGINS = 64
PREFIXES = {"net": "libnccl-net", "tuner": "libnccl-tuner", "profiler": "libnccl-profiler"}
LATEST = (99, 0, 0)  # rules used when the default libnccl's version is unknown

_SYMBOL = re.compile(r"(ncclNetPlugin|ncclCollNetPlugin|ncclTunerPlugin|ncclProfiler)_v(\d{1,4})")
_SYMBOL_KIND = {"ncclNetPlugin": "net", "ncclCollNetPlugin": "collnet",
                "ncclTunerPlugin": "tuner", "ncclProfiler": "profiler"}

Version = tuple[int, int, int]


# ---- which names NCCL tries ----------------------------------------------------------


def net_plugin_names(value: str | None, version: Version | None) -> list[list[str]]:
    """The names NCCL ``dlopen``s for its net plugin, as groups tried in order.

    Each group is one plugin (its names tried in order, the first that opens is it); the
    groups are the items of a list. ``[]``: external net plugins are off.
    """
    v = version or LATEST
    if not value or v < (2, 11, 0):
        return [["libnccl-net.so"]]
    if v < (2, 21, 0):
        return [[f"libnccl-net-{value}.so"]]
    if v < (2, 27, 0):
        return [[value, f"libnccl-net-{value}.so"]]
    if v >= (2, 28, 0) and value.lower() == "none":
        return []
    items = [x for x in value.split(",") if x][:MAX_LIST_ITEMS]
    return [[x, f"libnccl-net-{x}.so"] for x in items]


def named_plugin_names(kind: str, value: str | None) -> list[list[str]]:
    """Tuner/profiler: the variable's value as given, then ``libnccl-<kind>-X.so``."""
    prefix = PREFIXES[kind]
    if not value:
        return [[f"{prefix}.so"]]
    return [[value, f"{prefix}-{value}.so"]]


def _version(lib: dict[str, Any] | None) -> Version | None:
    if not lib or not lib.get("version"):
        return None
    try:
        a, b, c = (int(x) for x in str(lib["version"]).split("."))
    except ValueError:
        return None
    return (a, b, c)


# ---- what a file is ------------------------------------------------------------------


def analyze(f: BinaryIO, label: str) -> dict[str, Any]:
    """The file-only facts of one plugin (cacheable): size, sha256, abis, names, error."""
    from inventoryd.elf import ElfError, ElfReader  # only on a cache miss: a warm run skips it
    from inventoryd.nodefs import library_unreadable, progress

    size, why = library_unreadable(f)
    if why is not None:  # the same bounds as libnccl's: a 4 GiB sparse file took 12 s
        return {"size": size, "sha256": None, "abis": {k: [] for k in ABI_KINDS},
                "names": {}, "error": why}
    tick = progress.get()
    h = hashlib.sha256()
    size = 0
    while chunk := f.read(1 << 20):
        h.update(chunk)
        size += len(chunk)
        if tick is not None and size % (16 << 20) == 0:
            tick()
    out: dict[str, Any] = {"size": size, "sha256": h.hexdigest(),
                           "abis": {k: [] for k in ABI_KINDS}, "names": {}, "error": None}
    try:
        f.seek(0)
        elf = ElfReader(f, label)
        problem = elf.truncation()
        syms = elf.exported(lambda n: _SYMBOL.fullmatch(n) is not None)
        best: dict[str, tuple[int, int]] = {}
        for name, sym in syms.items():
            m = _SYMBOL.fullmatch(name)
            assert m is not None
            kind, n = _SYMBOL_KIND[m.group(1)], int(m.group(2))
            out["abis"][kind].append(n)
            if kind not in best or n > best[kind][0]:
                best[kind] = (n, sym.value)
        for kind in out["abis"]:
            out["abis"][kind].sort(reverse=True)
        for kind, (_, addr) in sorted(best.items()):
            out["names"][kind] = elf.pointed_string(addr)
        if problem:
            out["error"] = f"{label}: {problem}"
    except ElfError as e:
        out["error"] = str(e)
    return out


def describe(
    fs: NodeFS, errors: ErrorLog, kind: str, path: str, origin: str, cache: FileCache
) -> dict[str, Any]:
    """The schema record of one plugin file (``default`` is set by the caller)."""
    rec: dict[str, Any] = {
        "kind": kind, "path": path, "realpath": None, "size": None, "sha256": None,
        "abis": {k: [] for k in ABI_KINDS}, "names": {}, "name": None,
        "default": False, "origin": origin, "error": None,
    }
    try:
        facts, _, real = cache.facts(fs, path, KIND, analyze)
    except OSError as e:
        rec["error"] = f"{path}: cannot read: {e.strerror or e}"
        errors.add(PROBE, f"plugins.{kind}", path, e)
        return rec
    rec.update(realpath=real, **facts)
    rec["name"] = rec["names"].get(kind)
    if rec["error"]:
        errors.add(PROBE, f"plugins.{kind}", path, rec["error"])
    return rec


# ---- the probe -----------------------------------------------------------------------


def _config_plugins(
    fs: NodeFS, errors: ErrorLog, config: InventorydConfig
) -> list[tuple[str, str]]:
    """(kind, node path) of the plugin files in ``plugin_search_paths``."""
    out: list[tuple[str, str]] = []
    for pattern in config.plugin_search_paths:
        for p in linker.glob(fs, pattern, errors, PROBE, "plugins"):
            try:
                real = linker.resolve(fs, p)
            except OSError as e:
                errors.add(PROBE, "plugins", p, e)
                continue
            if fs.host(real).is_dir():
                for kind, prefix in PREFIXES.items():
                    for q in linker.glob(fs, linker.join_path(p, f"{prefix}*.so*"), errors,
                                         PROBE, "plugins"):
                        if _kind_of(q) == kind:
                            out.append((kind, q))
            elif (found := _kind_of(p)) is not None:
                out.append((found, p))
    return out


def _kind_of(path: str) -> str | None:
    name = path.rsplit("/", 1)[-1]
    for kind, prefix in PREFIXES.items():
        if name.startswith(prefix + ".so") or name.startswith(prefix + "-"):
            return kind
    return None


def _common(lib_abis: list[int], plugin_abis: list[int]) -> list[int]:
    return sorted(set(lib_abis) & set(plugin_abis), reverse=True)


def _vs(abis: list[int]) -> str:
    return ", ".join(f"v{n}" for n in abis) or "none"


def probe(
    fs: NodeFS,
    errors: ErrorLog,
    config: InventorydConfig,
    nccl_settings: dict[str, str],
    libnccl: list[dict[str, Any]],
    cache: FileCache,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(plugins, net)`` of the fingerprint. Plugins sorted by path."""
    # The nccl probe already recorded the linker's own errors; keep only new ones.
    scratch = ErrorLog()
    view = linker.LinkerView.load(fs, scratch, PROBE)
    errors.entries.extend(
        e for e in scratch.entries
        if not any(o["field"] == e["field"] and o["path"] == e["path"] for o in errors.entries)
    )
    lib = next((x for x in libnccl if x.get("default")), None)
    version = _version(lib)
    records: dict[str, dict[str, Any]] = {}

    def add(kind: str, path: str, origin: str) -> dict[str, Any]:
        if path not in records:
            records[path] = describe(fs, errors, kind, path, origin, cache)
        return records[path]

    # net: the first group whose file exists and shares an ABI; else the first found
    value = nccl_settings.get("NCCL_NET_PLUGIN")
    groups = net_plugin_names(value, version)
    origin = "nccl.conf" if value else "linker"
    lib_net = (lib or {}).get("abis", {}).get("net") or []
    chosen: dict[str, Any] | None = None
    for group in groups:
        path = next((p for p in (view.lookup(n) for n in group) if p is not None), None)
        if path is None:
            continue
        rec = add("net", path, origin)
        chosen = chosen or rec
        if not rec["error"] and _common(lib_net, rec["abis"]["net"]):
            chosen = rec  # NCCL keeps the first item that loads and speaks its ABI
            break
    if chosen is not None:
        chosen["default"] = True
    net = _effective(lib, chosen, groups, value)

    # tuner and profiler, when the default libnccl looks for them (or is unknown)
    for kind in ("tuner", "profiler"):
        if lib is not None and not (lib.get("abis") or {}).get(kind):
            continue
        var = f"NCCL_{kind.upper()}_PLUGIN"
        kvalue = nccl_settings.get(var)
        for name in named_plugin_names(kind, kvalue)[0]:
            path = view.lookup(name)
            if path is not None:
                add(kind, path, "nccl.conf" if kvalue else "linker")["default"] = True
                break

    found = _config_plugins(fs, errors, config)
    if len(found) > MAX_CONFIG_PLUGINS:
        errors.add(PROBE, "plugins", None, f"{len(found)} plugin files in plugin_search_paths; "
                   f"only the first {MAX_CONFIG_PLUGINS} are read")
        found = found[:MAX_CONFIG_PLUGINS]
    for kind, path in found:
        add(kind, path, "config")
    return [records[p] for p in sorted(records)], net


def _effective(
    lib: dict[str, Any] | None,
    plugin: dict[str, Any] | None,
    groups: list[list[str]],
    value: str | None,
) -> dict[str, Any]:
    net: dict[str, Any] = {
        "libnccl": lib["path"] if lib else None,
        "plugin": plugin["path"] if plugin else None,
        "effective_net_abi": None,
        "reason": None,
    }
    if not groups:
        net["reason"] = f"NCCL_NET_PLUGIN={value}: external net plugins are disabled"
    elif plugin is None:
        tried = ", ".join(n for g in groups for n in g)
        net["reason"] = f"no net plugin ({tried} not found by the dynamic linker)"
    elif lib is None:
        net["reason"] = "no default libnccl (libnccl.so.2 not found by the dynamic linker)"
    elif not lib["abis"]["net"]:
        why = lib.get("version_error") or "it names no ncclNetPlugin_vN symbol"
        net["reason"] = f"the default libnccl's net plugin ABIs are unknown: {why}"
    elif plugin["error"]:
        net["reason"] = f"the net plugin cannot be used: {plugin['error']}"
    else:
        common = _common(lib["abis"]["net"], plugin["abis"]["net"])
        if common:
            net["effective_net_abi"] = common[0]
        else:
            net["reason"] = (
                f"no common ABI: libnccl {lib.get('version') or '?'} looks for "
                f"{_vs(lib['abis']['net'])}, the plugin exports {_vs(plugin['abis']['net'])}; "
                "NCCL ignores it and uses its internal transports"
            )
    return net
