"""Which plugin ABI NCCL uses: the one rule, shared by the probe and the policy's readers.

NCCL looks up a plugin's exported ``<symbol>_vN`` structs newest first and uses the first
it knows (docs/nccl.md, "Plugins NCCL loads"): the ABI in use is the highest N that
both the libnccl (its string literals) and the plugin (its dynamic symbols) name; with none
in common NCCL does not use that library for that kind. One exception: the RMA loader
takes ``ncclGinPlugin_v13`` when there is no ``ncclRmaPlugin_v13``
(``src/plugin/rma/rma_v13.cc`` at v2.30.7-1 and at v2.31.2-1, NVIDIA/nccl commit
889806836; 2.32.3's ``rma.cc`` still ends its list with ``getNcclRma_v13``, and its
``rma_v13.cc``, of which the store read holds no copy at that commit, is taken as at
2.31.2), so a GIN v13 plugin is an RMA v13 one too. No version is listed here: the ABIs
a release looks for are read from its library, those a plugin offers from its symbols,
so RMA v16 (2.32.3) or v17 (2.32.6) needs no change.

Standard library only: the gate's path imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["ABI_KINDS", "IN_FORCE_KINDS", "SYMBOLS", "common", "exported", "highest_common"]

#: Every ABI list a libnccl or a plugin record holds (``abis``), in the fingerprint's order.
ABI_KINDS = ("net", "collnet", "tuner", "profiler", "env", "gin", "rma")

#: The kinds of plugin library NCCL loads, each of which has one plugin in force
#: (``net`` and ``effective``); collnet is read from the net plugin's library.
IN_FORCE_KINDS = ("net", "tuner", "profiler", "env", "gin", "rma")

#: kind -> the exported struct's symbol prefix (``<prefix>_vN``).
SYMBOLS = {
    "net": "ncclNetPlugin", "collnet": "ncclCollNetPlugin", "tuner": "ncclTunerPlugin",
    "profiler": "ncclProfiler", "env": "ncclEnvPlugin", "gin": "ncclGinPlugin",
    "rma": "ncclRmaPlugin",
}

_RMA_FROM_GIN = 13  # rma_v13.cc: dlsym "ncclRmaPlugin_v13", else "ncclGinPlugin_v13"


def _ints(value: Any) -> list[int]:
    if not isinstance(value, list):
        return []
    return [v for v in value if type(v) is int]


def exported(abis: Mapping[str, Any] | None, kind: str) -> list[int]:
    """The ``kind`` ABIs that a plugin file with these ``abis`` offers NCCL, newest first."""
    if not isinstance(abis, Mapping):
        return []
    got = set(_ints(abis.get(kind)))
    if kind == "rma" and _RMA_FROM_GIN in _ints(abis.get("gin")):
        got.add(_RMA_FROM_GIN)
    return sorted(got, reverse=True)


def common(lib_abis: Iterable[int], plugin_abis: Iterable[int]) -> list[int]:
    """The ABIs both sides know, newest first."""
    return sorted(set(lib_abis) & set(plugin_abis), reverse=True)


def highest_common(lib_abis: Iterable[int], plugin_abis: Iterable[int]) -> int | None:
    """The ABI NCCL uses, or ``None`` when the two share none."""
    both = common(lib_abis, plugin_abis)
    return both[0] if both else None
