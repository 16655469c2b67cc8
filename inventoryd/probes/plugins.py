"""The NCCL plugins this node would load, what ABIs they speak, and the plugin in force per kind.

Which file: NCCL ``dlopen``s a name, so the dynamic linker's search decides
(:mod:`inventoryd.probes.linker`). Which names, for each kind (net, tuner, profiler, env,
GIN, RMA), which variables name them, and which libraries a kind falls back to: the
loading rules of the default libnccl's release, and nothing else
(:mod:`ncclguard.fingerprint.loading`, one table keyed by release, each row citing the
NCCL tag and files it was read from). The variables are ``NCCL_<KIND>_PLUGIN`` as
``/etc/nccl.conf`` sets them (NCCL puts that file into its environment before it reads
any of them, the env plugin's included); a job's own environment is not known to the
node. Plus every plugin in ``plugin_search_paths``.

What each file speaks: its exported ``ncclNetPlugin_vN`` / ``ncclCollNetPlugin_vN`` /
``ncclTunerPlugin_vN`` / ``ncclProfiler_vN`` / ``ncclEnvPlugin_vN`` / ``ncclGinPlugin_vN``
/ ``ncclRmaPlugin_vN`` dynamic symbols (:mod:`inventoryd.elf`), and the ``name`` that each
struct's first field points to. The ABI in force is the highest N that both the default
libnccl looks for (its strings) and the plugin exports (:mod:`ncclguard.fingerprint.abi`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import Any, BinaryIO

from inventoryd.filecache import FileCache
from inventoryd.nodefs import ErrorLog, NodeFS
from inventoryd.probes import linker
from ncclguard.config import InventorydConfig
from ncclguard.fingerprint import loading
from ncclguard.fingerprint.abi import ABI_KINDS, SYMBOLS, common, exported
from ncclguard.fingerprint.loading import PREFIXES, Version, net_plugin_names
from ncclguard.fingerprint.model import EFFECTIVE_KINDS
from ncclguard.fingerprint.offers import pack as pack_offers
from ncclguard.fingerprint.releases import RELEASES

__all__ = ["EFFECTIVE_KINDS", "PREFIXES", "analyze", "describe", "net_plugin_names", "probe"]

PROBE = "plugins"
KIND = "nccl-plugin/2"  # /2: env, GIN and RMA symbols (issue 13)
MAX_CONFIG_PLUGINS = 64

_SYMBOL = re.compile(r"(" + "|".join(SYMBOLS.values()) + r")_v(\d{1,4})")
_SYMBOL_KIND = {v: k for k, v in SYMBOLS.items()}


def _version(lib: dict[str, Any] | None) -> Version | None:
    return loading.parse_version(lib.get("version")) if lib and lib.get("version") else None


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
    own or ``net``), ``name``, ``abi`` (highest common ABI) and ``reason`` (why
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
        if abi[0] not in exported({kind: (plugin.get("abis") or {}).get(kind)}, kind):
            rec["name"] = (plugin.get("names") or {}).get("gin")  # RMA v13 from GIN v13
    else:
        rec["reason"] = (
            f"no common ABI: libnccl {lib.get('version') or '?'} looks for {_vs(lib_abis)}, "
            f"the plugin exports {_vs(mine)}; {_UNUSED.get(kind, _UNUSED['*'])}"
        )
    return rec


_UNUSED = {
    "net": "NCCL ignores it and uses its internal transports",
    # tuner.cc/profiler.cc at v2.30.7-1 (tuner.cc the same at v2.32.3-1, NVIDIA/nccl
    # 12df1a11): a library that opens without a known symbol is "unsupported" (goto fail):
    # there is no second try in the net plugin's library
    "tuner": "NCCL loads no tuner (a tuner library that opens is not followed by the net "
             "plugin's)",
    "profiler": "NCCL loads no profiler (nor the net plugin's)",
    "env": "NCCL reads variables itself",
    "*": "NCCL does not load it",
}


def _absent(reason: str) -> dict[str, Any]:
    return {"plugin": None, "via": None, "name": None, "abi": None, "reason": reason}


#: Stands for the job's own executable among the files a kind may load
#: (:data:`ncclguard.fingerprint.loading.EXECUTABLE`).
_EXE: dict[str, Any] = {"path": None, "abis": {}, "error": None}


def _names(groups: list[list[str]]) -> str:
    return ", ".join(n or "the job's executable" for g in groups for n in g)


def _unknown(errors: ErrorLog, kind: str, var: str, value: str | None) -> dict[str, Any]:
    """The record of a kind whose library is the job's own executable: unknown here."""
    why = (f"{var}={value!r}: NCCL looks for the {kind} plugin in the job's own executable "
           "(a prefix of STATIC_PLUGIN, or an empty name), which the node cannot see")
    errors.add(PROBE, f"plugins.{kind}", None, why)
    return _absent(why)


def probe(
    fs: NodeFS,
    errors: ErrorLog,
    config: InventorydConfig,
    nccl_settings: dict[str, str],
    libnccl: list[dict[str, Any]],
    cache: FileCache,
    with_offers: bool = True,
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(plugins, net, effective, offers)`` of the fingerprint. Plugins sorted by path;
    ``offers`` is ``{}`` unless ``with_offers`` (:func:`_offers`)."""
    # The nccl probe already recorded the linker's own errors; keep only new ones.
    scratch = ErrorLog()
    view = linker.LinkerView.load(fs, scratch, PROBE)
    errors.entries.extend(
        e for e in scratch.entries
        if not any(o["field"] == e["field"] and o["path"] == e["path"] for o in errors.entries)
    )
    lib = next((x for x in libnccl if x.get("default")), None)
    rules = loading.rules_for(_version(lib))
    records: dict[str, dict[str, Any]] = {}

    def add(kind: str, path: str, origin: str) -> dict[str, Any]:
        if path not in records:
            records[path] = describe(fs, errors, kind, path, origin, cache)
        return records[path]

    found_at: dict[str, str | None] = {}  # name -> what dlopen opens: one search per name

    def lookup(name: str) -> str | None:
        if name not in found_at:
            found_at[name] = view.lookup(name)
        return found_at[name]

    chosen, net, effective = _stacks(lookup, add, errors, lib, rules, nccl_settings)
    if chosen is not None and chosen is not _EXE:
        chosen["default"] = True
    for kind, rec in effective.items():
        if rec["abi"] is not None and rec["via"] == kind:
            records[rec["plugin"]]["default"] = True
    if rules.caveat and lib is not None:
        for rec in (net, *effective.values()):
            rec["reason"] = f"{rec['reason']}; {rules.caveat}" if rec["reason"] else rules.caveat

    found = _config_plugins(fs, errors, config)
    if len(found) > MAX_CONFIG_PLUGINS:
        errors.add(PROBE, "plugins", None, f"{len(found)} plugin files in plugin_search_paths; "
                   f"only the first {MAX_CONFIG_PLUGINS} are read")
        found = found[:MAX_CONFIG_PLUGINS]
    for kind, path in found:
        add(kind, path, "config")
    offers = _offers(fs, lookup, cache, nccl_settings) if with_offers else {}
    return [records[p] for p in sorted(records)], net, effective, offers


Add = Callable[[str, str, str], dict[str, Any]]


def _stacks(
    lookup: Callable[[str], str | None],
    add: Add,
    errors: ErrorLog,
    lib: dict[str, Any] | None,
    rules: loading.Rules,
    nccl_settings: dict[str, str],
) -> tuple[dict[str, Any] | None, dict[str, Any], dict[str, Any]]:
    """``(the net plugin's file, net, effective)`` that the libnccl ``lib`` (its version
    read with ``rules``) gets on this node: the one derivation, for the host's default
    libnccl and for every release of the ``offers`` part. The net file is
    :data:`_EXE` when the job's executable decides."""
    ver = (lib or {}).get("version") or "?"

    def first(kind: str, group: list[str], origin: str) -> dict[str, Any] | None:
        """The file the first name of ``group`` that opens leads to (NCCL's dlopen);
        :data:`_EXE` for the job's executable (it always opens)."""
        for name in group:
            if name == loading.EXECUTABLE:
                return _EXE
            path = lookup(name)
            if path is not None:
                return add(kind, path, origin)
        return None

    def lib_abis(kind: str) -> list[int]:
        return list(((lib or {}).get("abis") or {}).get(kind) or [])

    def usable(kind: str, rec: dict[str, Any]) -> bool:
        return not rec["error"] and bool(common(lib_abis(kind), exported(rec["abis"], kind)))

    # net: the first item whose file opens and shares an ABI; else the first that opens
    value = nccl_settings.get("NCCL_NET_PLUGIN") if rules.kinds["net"].var else None
    groups = loading.own_names("net", value, rules) or []
    origin = "nccl.conf" if value else "linker"
    chosen: dict[str, Any] | None = None
    for group in groups:
        rec = first("net", group, origin)
        if rec is None:
            continue
        if rec is _EXE or usable("net", rec):
            chosen = rec  # NCCL keeps the first item that loads and speaks its ABI
            break
        chosen = chosen or rec
    if chosen is _EXE:  # no earlier item was usable: the job's executable decides
        bad = _unknown(errors, "net", "NCCL_NET_PLUGIN", value)
        net = {"libnccl": lib["path"] if lib else None, "plugin": None,
               "effective_net_abi": None, "reason": bad["reason"]}
        net_lib: dict[str, Any] | None = _EXE  # what the other kinds fall back to: unknown
    else:
        net = _net_part(lib, chosen, groups, value)
        # the net plugin's library, as the other kinds fall back to it: only while in use
        net_lib = chosen if net["effective_net_abi"] is not None else None

    def wanted(kind: str) -> bool:  # the default libnccl looks for this kind (or is unknown)
        return lib is None or bool(lib_abis(kind))

    effective: dict[str, Any] = {}
    for kind in EFFECTIVE_KINDS:
        rule = rules.kinds.get(kind)
        var = f"NCCL_{kind.upper()}_PLUGIN"
        if rule is not None and not rule.external:
            effective[kind] = _absent(f"libnccl {ver} loads no external {kind} plugin: "
                                      f"{rule.note}")
            continue
        if rule is None or not wanted(kind):
            effective[kind] = _absent(f"libnccl {ver} loads no {kind} plugin")
            continue
        kvalue = nccl_settings.get(var) if rule.var else None
        own = loading.own_names(kind, kvalue, rules)
        if own is None:
            effective[kind] = _absent(f"{var}={kvalue}: {kind} plugins are disabled")
            continue
        # the candidates in NCCL's order: its own (a list's items), then its fallbacks;
        # each is (file, whose library, the variable and value that named it)
        korigin = "nccl.conf" if kvalue else "linker"
        cands: list[tuple[dict[str, Any], str, str, str | None]] = []
        for group in own:
            if (rec := first(kind, group, korigin)) is not None:
                cands.append((rec, kind, var, kvalue))
        if not (cands and rule.unusable == loading.STOP):  # an own library that opens is it
            for fb in rule.fallbacks:
                if fb == loading.NET and net_lib is not None:
                    cands.append((net_lib, "net", "NCCL_NET_PLUGIN", value))
                elif fb == loading.NET_NAMES and (rec := first(
                        "net", [n for g in groups for n in g], origin)) is not None:
                    cands.append((rec, "net", "NCCL_NET_PLUGIN", value))
        # a library NCCL falls back to counts only where it exports this kind at all
        kept = [c for i, c in enumerate(cands)
                if (c[1] == kind or c[0] is _EXE or exported(c[0]["abis"], kind))
                and all(c[0] is not o[0] for o in cands[:i])]
        pick = next((c for c in kept if c[0] is _EXE or rule.unusable == loading.STOP
                     or usable(kind, c[0])), kept[0] if kept else None)
        if pick is None:
            effective[kind] = _absent(_nothing(kind, rule, var, kvalue, own, groups, ver))
        elif pick[0] is _EXE:
            effective[kind] = _unknown(errors, kind, pick[2], pick[3])
        else:
            effective[kind] = _in_force(kind, lib, pick[0], pick[1])
    return chosen, net, effective


def _offers(fs: NodeFS, lookup: Callable[[str], str | None], cache: FileCache,
            nccl_settings: dict[str, str]) -> dict[str, Any]:
    """The ``offers`` part: what this node adds to the NCCL of each release of
    :data:`ncclguard.fingerprint.releases.RELEASES`, whatever libnccl the node has itself
    (issue 39), in :func:`ncclguard.fingerprint.offers.pack`'s form. Per release and kind
    it loads: the library NCCL opens (an index in ``files``) and the ABI it uses (None:
    none in common, so NCCL does not use it); unknown for the job's own executable or a
    file that cannot be read; nothing for no library. Nothing here adds to the
    fingerprint's ``errors``: a file only some other release would open says nothing
    about the host's own stack."""
    files: dict[str, dict[str, Any]] = {}
    quiet = ErrorLog()

    def add(kind: str, path: str, origin: str) -> dict[str, Any]:
        if path not in files:
            files[path] = describe(fs, quiet, kind, path, origin, cache)
        return files[path]

    index: dict[str, int] = {}
    out: dict[str, dict[str, Any]] = {}
    for release in RELEASES:
        rules = loading.rules_for(release.version)
        lib = {"path": None, "version": release.label,
               "abis": {k: list(v) for k, v in release.abis.items()}}
        quiet.entries.clear()
        chosen, net, effective = _stacks(lookup, add, quiet, lib, rules, nccl_settings)
        unknown = {e["field"] for e in quiet.entries}
        got: dict[str, tuple[dict[str, Any] | None, Any]] = {
            "net": (chosen, None if chosen is _EXE else net["effective_net_abi"])}
        for kind, rec in effective.items():
            got[kind] = (files[rec["plugin"]] if rec["plugin"] else
                         (_EXE if f"plugins.{kind}" in unknown else None), rec["abi"])
        row: dict[str, Any] = {}
        for kind in release.loads:
            file, abi = got[kind]
            if file is None:
                continue  # no library: absent
            if file is _EXE or file["error"]:
                row[kind] = None
                continue
            row[kind] = [index.setdefault(file["path"], len(index)), abi]
        out[release.label] = row
    return pack_offers(out, [{"path": p, "names": files[p]["names"],
                               "abis": {k: v for k, v in files[p]["abis"].items() if v}}
                              for p in index])  # never one with an error: unknown above


def _nothing(kind: str, rule: loading.Kind, var: str, value: str | None,
             own: list[list[str]], net_groups: list[list[str]], ver: str) -> str:
    """Why no library is in force for ``kind`` (none of its own opens, no fallback has it)."""
    tail = {loading.NET: "the net plugin's library",
            loading.NET_NAMES: f"NCCL_NET_PLUGIN's library ({_names(net_groups)})"}
    also = [tail[fb] for fb in rule.fallbacks]
    where = f"; not in {' nor '.join(also)}" if also else ""
    if not rule.own:
        mine = f"libnccl {ver} has no {kind} library of its own"
    elif own:
        mine = f"{_names(own)} not found"
    elif rule.var and value is None and not rule.default:
        mine = (f"libnccl {ver} opens one only where {var} names it, and /etc/nccl.conf "
                "does not (a job's own environment may)")
    elif value is not None and value.lower() == "none":
        mine = f"{var}={value}: its list is empty"
    else:
        mine = f"{var} is empty: its list is empty"
    external = "external " if kind in ("gin", "rma") else ""
    inner = ": NCCL uses its internal one, if any" if external else ""
    return f"no {external}{kind} plugin ({mine}{where}){inner}"


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
    if not groups and value is not None and value.lower() == "none":
        net["reason"] = f"NCCL_NET_PLUGIN={value}: external net plugins are disabled"
    elif not groups:
        net["reason"] = "NCCL_NET_PLUGIN is empty (a list of no item): no external net plugin"
    elif plugin is None:
        net["reason"] = f"no net plugin ({_names(groups)} not found by the dynamic linker)"
    else:
        rec = _in_force("net", lib, plugin)
        net["effective_net_abi"] = rec["abi"]
        net["reason"] = rec["reason"]
    return net
