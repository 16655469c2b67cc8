"""The NCCL plugins this node would load, what ABIs they speak, and the ABI in force per kind.

Which file (docs/nccl-facts.md, and NCCL's ``src/plugin/*.cc``): NCCL ``dlopen``s a name,
so the dynamic linker's search decides (:mod:`inventoryd.probes.linker`). The name comes
from ``NCCL_<KIND>_PLUGIN`` (here: as ``/etc/nccl.conf`` sets it; a job's environment is
not known to the node), with the rules of the default libnccl's version
(:func:`expand`, ``src/plugin/plugin_open.cc``):

- unset: ``libnccl-<kind>.so``;
- net, 2.11 to 2.20: ``X`` means ``libnccl-net-X.so``;
- 2.21 to 2.26: ``X`` as given (a name or a path), then ``libnccl-<kind>-X.so``;
- 2.27.3: a ``lib*.so`` name as given only, any other only as ``libnccl-<kind>-X.so``;
- 2.27.5 on: as given, then ``libnccl-<kind>-X.so``, the second try skipped when the
  name has a ``/`` or is ``lib*.so``;
- net from 2.27, GIN and RMA: a comma-separated list, first usable item wins;
- 2.28 on: ``none`` (any case) turns the kind off (GIN, RMA: only the named list).

Kinds and their fallbacks (v2.30.7-1): the tuner (from 2.21) and the profiler (from
2.28) fall back to the net plugin's library when no library of their own opens; GIN
(``ncclGinPlugin_vN``) lives in the net plugin's library in 2.28.x and also in
``libnccl-gin.so`` from 2.29.7; RMA (2.30.7) tries its own list, then GIN's library, then
the net plugin's. The env plugin is named by the *environment* only (``std::getenv``
in ``src/plugin/env.cc``: it is what reads ``/etc/nccl.conf``), so only
``libnccl-env.so`` is looked for. A kind is looked for only when the default libnccl
names its symbols (or is unknown). Plus every plugin in ``plugin_search_paths``.

What each file speaks: its exported ``ncclNetPlugin_vN`` / ``ncclCollNetPlugin_vN`` /
``ncclTunerPlugin_vN`` / ``ncclProfiler_vN`` / ``ncclEnvPlugin_vN`` / ``ncclGinPlugin_vN``
/ ``ncclRmaPlugin_vN`` dynamic symbols (:mod:`inventoryd.elf`), and the ``name`` that each
struct's first field points to. The ABI in force is the highest N that both the default
libnccl looks for and the plugin exports (:mod:`ncclguard.fingerprint.abi`).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, BinaryIO

from inventoryd.filecache import FileCache
from inventoryd.nodefs import ErrorLog, NodeFS
from inventoryd.probes import linker
from ncclguard.config import InventorydConfig
from ncclguard.fingerprint.abi import ABI_KINDS, SYMBOLS, common, exported

PROBE = "plugins"
KIND = "nccl-plugin/2"  # /2: env, GIN and RMA symbols (issue 13)
MAX_LIST_ITEMS = 16  # NCCL_NET_PLUGIN list items considered (NCCL itself keeps a few)
MAX_CONFIG_PLUGINS = 64
# src/plugin/plugin_open.cc (v2.30.7-1), pluginPrefix[]
PREFIXES = {"net": "libnccl-net", "gin": "libnccl-gin", "rma": "libnccl-rma",
            "tuner": "libnccl-tuner", "profiler": "libnccl-profiler", "env": "libnccl-env"}
LATEST = (99, 0, 0)  # rules used when the default libnccl's version is unknown
#: The kinds with an ``effective`` record, in the order NCCL loads them.
EFFECTIVE_KINDS = ("tuner", "profiler", "env", "gin", "rma")
TUNER_NET_FALLBACK = (2, 21, 0)  # tuner.cc: ncclGetNetPluginLib
PROFILER_NET_FALLBACK = (2, 28, 0)  # profiler.cc: ncclGetNetPluginLib (not in 2.27.7)
GIN_OWN_LIBRARY = (2, 29, 7)  # src/plugin/gin.cc, libnccl-gin.so; 2.28: net_v11.cc only
KIND_NONE = (2, 28, 0)  # "none" turns a kind off

_SYMBOL = re.compile(r"(" + "|".join(SYMBOLS.values()) + r")_v(\d{1,4})")
_SYMBOL_KIND = {v: k for k, v in SYMBOLS.items()}

Version = tuple[int, int, int]


# ---- which names NCCL tries ----------------------------------------------------------


def expand(kind: str, value: str | None, version: Version | None) -> list[str]:
    """The names ``openPluginLib`` tries, in order, for one value of ``NCCL_<KIND>_PLUGIN``
    (``src/plugin/plugin_open.cc`` at v2.26.2-1, v2.27.3-1, v2.27.5-1, v2.30.7-1)."""
    prefix = PREFIXES[kind]
    if not value:
        return [f"{prefix}.so"]
    v = version or LATEST
    lib_so = value.startswith("lib") and value.endswith(".so")
    if (2, 27, 0) <= v < (2, 27, 5):  # 2.27.3
        return [value] if lib_so and len(value) >= len("libX.so") else [f"{prefix}-{value}.so"]
    if v >= (2, 27, 5) and ("/" in value or lib_so):
        return [value]
    return [value, f"{prefix}-{value}.so"]


def _off(value: str, v: Version) -> bool:
    return v >= KIND_NONE and value.lower() == "none"


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
        return [expand("net", value, v)]
    if _off(value, v):
        return []
    items = [x for x in value.split(",") if x][:MAX_LIST_ITEMS]
    return [expand("net", x, v) for x in items]


def named_plugin_names(
    kind: str, value: str | None, version: Version | None = None
) -> list[list[str]]:
    """Tuner, profiler, env: one group (the value, expanded); ``[]`` for ``none`` (2.28+)."""
    v = version or LATEST
    if value and _off(value, v):
        return []
    return [expand(kind, value, v)]


def list_plugin_names(kind: str, value: str | None, version: Version | None) -> list[list[str]]:
    """GIN and RMA: ``libnccl-<kind>.so`` by default, else each item of the comma-separated
    list; ``none`` empties the list (``gin.cc``/``rma.cc`` at v2.30.7-1: strtok_r on ",")."""
    v = version or LATEST
    if not value:
        return [[f"{PREFIXES[kind]}.so"]]
    if value.lower() == "none":
        return []
    items = [x for x in value.split(",") if x][:MAX_LIST_ITEMS]
    return [expand(kind, x, v) for x in items]


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


def _vs(abis: list[int]) -> str:
    return ", ".join(f"v{n}" for n in abis) or "none"


def _in_force(
    kind: str,
    lib: dict[str, Any] | None,
    plugin: dict[str, Any] | None,
    via: str | None = None,
) -> dict[str, Any]:
    """One ``effective`` record: ``plugin`` (its path), ``via`` (whose library: the kind's
    own, ``net`` or ``gin``), ``name``, ``abi`` (highest common ABI) and ``reason`` (why
    ``abi`` is null). The one place that judges a libnccl against a plugin, for every kind
    (the ``net`` part is this record's net view)."""
    rec: dict[str, Any] = {"plugin": plugin["path"] if plugin else None,
                           "via": (via or kind) if plugin else None,
                           "name": None, "abi": None, "reason": None}
    if plugin is None:
        return rec
    rec["name"] = (plugin.get("names") or {}).get(kind)
    symbol = SYMBOLS[kind]
    lib_abis = ((lib or {}).get("abis") or {}).get(kind) or []
    mine = exported(plugin.get("abis"), kind)
    if lib is None:
        rec["reason"] = "no default libnccl (libnccl.so.2 not found by the dynamic linker)"
    elif not lib_abis:
        why = lib.get("version_error") or f"it names no {symbol}_vN symbol"
        rec["reason"] = f"the default libnccl's {kind} plugin ABIs are unknown: {why}"
    elif plugin.get("error"):
        rec["reason"] = f"the {kind} plugin cannot be used: {plugin['error']}"
    elif (abi := common(lib_abis, mine)):
        rec["abi"] = abi[0]
    else:
        rec["reason"] = (
            f"no common ABI: libnccl {lib.get('version') or '?'} looks for {_vs(lib_abis)}, "
            f"the plugin exports {_vs(mine)}; {_UNUSED.get(kind, _UNUSED['*'])}"
        )
    return rec


_UNUSED = {
    "net": "NCCL ignores it and uses its internal transports",
    # tuner.cc/profiler.cc at v2.30.7-1: a library that opens without a known symbol is
    # "unsupported" (goto fail): there is no second try in the net plugin's library
    "tuner": "NCCL loads no tuner (a tuner library that opens is not followed by the net "
             "plugin's)",
    "profiler": "NCCL loads no profiler (nor the net plugin's)",
    "env": "NCCL reads variables itself",
    "*": "NCCL does not load it",
}


def _absent(reason: str) -> dict[str, Any]:
    return {"plugin": None, "via": None, "name": None, "abi": None, "reason": reason}


def probe(
    fs: NodeFS,
    errors: ErrorLog,
    config: InventorydConfig,
    nccl_settings: dict[str, str],
    libnccl: list[dict[str, Any]],
    cache: FileCache,
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """``(plugins, net, effective)`` of the fingerprint. Plugins sorted by path."""
    # The nccl probe already recorded the linker's own errors; keep only new ones.
    scratch = ErrorLog()
    view = linker.LinkerView.load(fs, scratch, PROBE)
    errors.entries.extend(
        e for e in scratch.entries
        if not any(o["field"] == e["field"] and o["path"] == e["path"] for o in errors.entries)
    )
    lib = next((x for x in libnccl if x.get("default")), None)
    version = _version(lib)
    v = version or LATEST
    records: dict[str, dict[str, Any]] = {}

    def add(kind: str, path: str, origin: str) -> dict[str, Any]:
        if path not in records:
            records[path] = describe(fs, errors, kind, path, origin, cache)
        return records[path]

    def first(kind: str, group: list[str], origin: str) -> dict[str, Any] | None:
        """The file the first name of ``group`` that opens leads to (NCCL's dlopen)."""
        path = next((p for p in (view.lookup(n) for n in group) if p is not None), None)
        return None if path is None else add(kind, path, origin)

    def usable(kind: str, rec: dict[str, Any]) -> bool:
        lib_abis = ((lib or {}).get("abis") or {}).get(kind) or []
        return not rec["error"] and bool(common(lib_abis, exported(rec["abis"], kind)))

    # net: the first group whose file exists and shares an ABI; else the first found
    value = nccl_settings.get("NCCL_NET_PLUGIN")
    groups = net_plugin_names(value, version)
    origin = "nccl.conf" if value else "linker"
    chosen: dict[str, Any] | None = None
    for group in groups:
        rec = first("net", group, origin)
        if rec is None:
            continue
        chosen = chosen or rec
        if usable("net", rec):
            chosen = rec  # NCCL keeps the first item that loads and speaks its ABI
            break
    if chosen is not None:
        chosen["default"] = True
    net = _net_part(lib, chosen, groups, value)
    # the net plugin's library, as the other kinds fall back to it: only while in use
    net_lib = chosen if net["effective_net_abi"] is not None else None

    def wanted(kind: str) -> bool:  # the default libnccl looks for this kind (or is unknown)
        return lib is None or bool((lib.get("abis") or {}).get(kind))

    effective: dict[str, Any] = {}
    for kind in EFFECTIVE_KINDS:
        var = f"NCCL_{kind.upper()}_PLUGIN"
        kvalue = None if kind == "env" else nccl_settings.get(var)
        korigin = "nccl.conf" if kvalue else "linker"
        if not wanted(kind):
            effective[kind] = _absent(f"libnccl {(lib or {}).get('version') or '?'} "
                                      f"loads no {kind} plugin")
            continue
        if kind in ("tuner", "profiler", "env"):
            # one library of its own; if it opens, it is the one, usable or not
            own = None
            for group in named_plugin_names(kind, kvalue, version):
                own = first(kind, group, korigin)
            fallback = (kind == "tuner" and v >= TUNER_NET_FALLBACK) or (
                kind == "profiler" and v >= PROFILER_NET_FALLBACK)
            if kvalue and _off(kvalue, v):
                effective[kind] = _absent(f"{var}={kvalue}: {kind} plugins are disabled")
            elif own is not None:
                effective[kind] = _in_force(kind, lib, own)
            elif fallback and net_lib is not None and exported(net_lib["abis"], kind):
                effective[kind] = _in_force(kind, lib, net_lib, "net")
            else:
                names = ", ".join(n for g in named_plugin_names(kind, kvalue, version) for n in g)
                tail = " nor in the net plugin" if fallback else ""
                effective[kind] = _absent(f"no {kind} plugin ({names} not found{tail})")
            continue
        # GIN and RMA: a list of their own, then the libraries they fall back to
        if kind == "gin" and v < GIN_OWN_LIBRARY:
            own_groups: list[list[str]] = []  # 2.28.x: the net plugin's library only
        else:
            own_groups = list_plugin_names(kind, kvalue, version)
        tried: list[tuple[dict[str, Any], str]] = []
        for group in own_groups:
            rec = first(kind, group, korigin)
            if rec is not None:
                tried.append((rec, kind))
        if kind == "rma" and effective["gin"]["abi"] is not None:
            tried.append((records[effective["gin"]["plugin"]], "gin"))
        if net_lib is not None:
            tried.append((net_lib, "net"))
        # a library NCCL falls back to counts only where it exports this kind at all
        kept: dict[str, tuple[dict[str, Any], str]] = {}
        for r, via in tried:
            if (via == kind or exported(r["abis"], kind)) and r["path"] not in kept:
                kept[r["path"]] = (r, via)
        tried = list(kept.values())
        pick = next(((r, via) for r, via in tried if usable(kind, r)), None)
        if pick is not None:
            effective[kind] = _in_force(kind, lib, pick[0], pick[1])
        elif tried:
            effective[kind] = _in_force(kind, lib, tried[0][0], tried[0][1])
        else:
            names = ", ".join(n for g in own_groups for n in g) or f"{var}={kvalue}: none"
            effective[kind] = _absent(f"no external {kind} plugin ({names}; not in the net "
                                      "plugin): NCCL uses its internal one, if any")
    for kind, rec in effective.items():
        if rec["abi"] is not None and rec["via"] == kind:
            records[rec["plugin"]]["default"] = True

    found = _config_plugins(fs, errors, config)
    if len(found) > MAX_CONFIG_PLUGINS:
        errors.add(PROBE, "plugins", None, f"{len(found)} plugin files in plugin_search_paths; "
                   f"only the first {MAX_CONFIG_PLUGINS} are read")
        found = found[:MAX_CONFIG_PLUGINS]
    for kind, path in found:
        add(kind, path, "config")
    return [records[p] for p in sorted(records)], net, effective


def _net_part(
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
    else:
        rec = _in_force("net", lib, plugin)
        net["effective_net_abi"] = rec["abi"]
        net["reason"] = rec["reason"]
    return net
