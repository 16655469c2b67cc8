"""Whether one running job step loaded the same NCCL on every node (issue 42,
docs/runtime.md): the one home of the *mixed job* verdict, which the collector, its
metrics and ``ncclguard jobs`` / ``decisions --job`` all ask.

A step is **mixed** when two of its nodes mapped

- different ``libnccl`` files (sha256): another release, or another build of one release;
- a net plugin on one node and, on another whose net is chosen, none: a plugin on some
  nodes only (a node's net is *chosen* once it mapped a net plugin or ``libibverbs``,
  NCCL's own IB transport, or when its libnccl has been mapped for ``settle_s``: NCCL
  opens the plugin when it sets up its net, not when it is loaded);
- net plugins that differ (sha256), or whose ABI in force (the highest the plugin
  exports that its libnccl looks for) differs;
- a tuner, profiler, env, GIN or RMA plugin that differs between nodes that both mapped
  one of that kind.

What a node could not identify (a file replaced or deleted since it was mapped, one it
could not read, one not read yet) is never called different: it is left out of the
comparison, and says so. Standard library and core only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ncclguard.fingerprint.abi import highest_common

__all__ = ["PLUGIN_KINDS", "SETTLE_S", "Mixed", "NodeLoad", "identified", "judge", "node_load",
           "shown_lib"]

SETTLE_S = 60.0  # a node's net is taken as chosen this long after it mapped libnccl
PLUGIN_KINDS = ("net", "gin", "rma", "tuner", "profiler", "env")


def _short(sha: str | None) -> str:
    return sha[:12] if sha else "?"


def shown_lib(lib: Mapping[str, Any]) -> str:
    """One library as the views show it: ``libnccl 2.21.5 (4de8ef6a9d27)``, ``net plugin
    "IB-x" ABI v8 (...)``; its path is shown beside it by the views that have room."""
    kind = lib.get("kind")
    if kind == "nccl":
        what = f"libnccl {lib.get('version') or '?'}"
    else:
        name = lib.get("name")
        what = f"{kind} plugin" + (f" {name!r}" if name else "")
    return f"{what} ({_short(lib.get('sha256'))})"


@dataclass(frozen=True)
class NodeLoad:
    """What one node's processes of a step mapped, as the verdict compares it."""

    host: str
    nccl: frozenset[str]  # sha256 of each identified libnccl
    nccl_shown: tuple[str, ...]
    plugins: dict[str, frozenset[tuple[str, int | None]]]  # kind -> {(sha256, ABI in force)}
    plugins_shown: dict[str, tuple[str, ...]]
    net_chosen: bool
    unknown: tuple[str, ...] = ()  # libraries left out, and why


def identified(lib: Mapping[str, Any]) -> bool:
    """Whether a library's record says what it is: a libnccl with its hash and the
    version its banner gives; a plugin with its hash and an ABI of its kind it exports. A
    file that only has the name (a user's program or data file called ``libnccl.so.2``
    or ``libnccl-net.so``) is not one, and is never compared."""
    if not lib.get("sha256"):
        return False
    if lib.get("kind") == "nccl":
        return bool(lib.get("version"))
    return bool(lib.get("abis"))


def node_load(host: str, libs: Iterable[Mapping[str, Any]], since: float | None,
              now: float, settle_s: float = SETTLE_S) -> NodeLoad:
    libs = list(libs)
    unknown = []
    ncclv: dict[str, str] = {}
    net_abis: list[int] = []
    for lib in libs:
        if lib.get("kind") != "nccl":
            continue
        if identified(lib):
            ncclv[str(lib["sha256"])] = shown_lib(lib)
            net_abis += [a for a in lib.get("abis") or [] if isinstance(a, int)]
        else:
            unknown.append(f"{lib.get('path')}: {lib.get('error') or 'not identified'}")
    plugins: dict[str, set[tuple[str, int | None]]] = {}
    shown: dict[str, list[str]] = {}
    ibverbs = False
    for lib in libs:
        kind = lib.get("kind")
        if kind == "ibverbs":
            ibverbs = True
        if kind not in PLUGIN_KINDS:
            continue
        if not identified(lib):
            unknown.append(f"{lib.get('path')}: {lib.get('error') or 'not identified'}")
            plugins.setdefault(str(kind), set())
            continue
        abis = [a for a in lib.get("abis") or [] if isinstance(a, int)]
        force = highest_common(net_abis, abis) if kind == "net" and net_abis else None
        plugins.setdefault(str(kind), set()).add((str(lib["sha256"]), force))
        shown.setdefault(str(kind), []).append(
            shown_lib(lib) + (f" ABI v{force}" if force is not None else ""))
    chosen = bool(ncclv) and (
        "net" in plugins or ibverbs or (since is not None and now - since >= settle_s))
    return NodeLoad(host, frozenset(ncclv), tuple(sorted(ncclv.values())),
                    {k: frozenset(v) for k, v in plugins.items()},
                    {k: tuple(sorted(v)) for k, v in shown.items()}, chosen, tuple(unknown))


@dataclass(frozen=True)
class Mixed:
    """A mixed step: what differs (``kind``: "nccl", "net-missing", "<kind>-plugin"), the
    groups of nodes that agree, and one line saying it."""

    kind: str
    groups: tuple[tuple[str, tuple[str, ...]], ...]  # (what they loaded, hosts)
    summary: str
    odd: tuple[str, ...] = field(default=())  # the nodes outside the largest group


def _groups(loads: Sequence[NodeLoad], key: Any, shown: Any) -> list[tuple[str, list[str]]]:
    by: dict[Any, tuple[str, list[str]]] = {}
    for n in loads:
        k = key(n)
        by.setdefault(k, (shown(n), []))[1].append(n.host)
    # the largest group first; a tie by name, so that the odd nodes are stable
    return sorted(by.values(), key=lambda g: (-len(g[1]), g[0]))


def _mixed(kind: str, what: str, groups: list[tuple[str, list[str]]]) -> Mixed:
    from ncclguard.hostlist import compress

    parts = "; ".join(f"{compress(hosts)}: {shown}" for shown, hosts in groups)
    odd = tuple(h for _, hosts in groups[1:] for h in hosts)
    return Mixed(kind, tuple((s, tuple(h)) for s, h in groups), f"{what}: {parts}", odd)


def judge(loads: Sequence[NodeLoad]) -> Mixed | None:
    """The verdict on one step from what each of its nodes mapped (None: not mixed, as
    far as the nodes could tell)."""
    known = [n for n in loads if n.nccl]
    groups = _groups(known, lambda n: n.nccl, lambda n: ", ".join(n.nccl_shown))
    if len(groups) > 1:
        versions = {s.split(" (")[0] for s, _ in groups}
        what = ("different NCCL releases" if len(versions) > 1
                else "different builds of one NCCL release")
        return _mixed("nccl", what, groups)
    chosen = [n for n in known if n.net_chosen]
    with_net = [n for n in chosen if n.plugins.get("net")]
    without = [n for n in chosen if "net" not in n.plugins]
    if with_net and without:
        groups = _groups(chosen, lambda n: "net" in n.plugins,
                         lambda n: ", ".join(n.plugins_shown.get("net", ()))
                         if "net" in n.plugins else "no net plugin (NCCL's own transports)")
        return _mixed("net-missing", "a net plugin on some nodes only", groups)
    for kind in PLUGIN_KINDS:
        have = [n for n in known if n.plugins.get(kind)]
        groups = _groups(have, lambda n, k=kind: n.plugins[k],
                         lambda n, k=kind: ", ".join(n.plugins_shown.get(k, ())))
        if len(groups) > 1:
            return _mixed(f"{kind}-plugin", f"different {kind} plugins", groups)
    return None
