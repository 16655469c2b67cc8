"""The refuse-level fields of a fingerprint, and a short key that groups identical nodes.

Two nodes with the same :func:`compat_key` agree on everything that the refuse-by-default
rules (``nccl-version``, ``net-plugin``, ``env-plugin``, ``transport``) look at. The key is
not the class: the class follows the configured refuse-level rules
(:func:`ncclguard.policy.schedule.class_key`, the store's ``gate_nodes.class_key``);
``compat_values`` is what ``ncclguard classes`` shows of a class's stack.

:func:`compat_values` returns (``None`` always means *unknown*, never *absent*)::

    {
      "nccl": "2.21.5",              # default libnccl version; "none": no libnccl.so.2
      "nccl_paths": {                # libnccl found under inventoryd.nccl_search_paths
        "/opt/nccl/lib/libnccl.so.2": "2.18.3"   # None: that file's version is unknown
      },                             # None: the libnccl probe failed
      "net_plugin": "IBext_v8",      # name of the default net plugin; "none": no plugin
                                     # or one that NCCL ignores (no common ABI)
      "net_abi": 8,                  # effective ncclNetPlugin_vN; 0: no plugin in use
      "env_plugin": "none",          # "NAME vN" of the env plugin NCCL loads; "none"
      "transport": "IB",             # ncclguard.fingerprint.transport.effective_transport
      "adds": "HoldoutNet v8..v6"    # the net plugin the node adds to a job's own NCCL,
                                     # whatever the host's libnccl (issue 39): each name
                                     # with the ABIs some release would use; "none"
    }

``net_plugin`` and ``net_abi`` are what the host's default libnccl does with the node's
plugin; on a node without one (``nccl`` "none") they are "none" and 0, and ``adds`` is
what the node offers.

The key is the first 16 hex digits of the SHA-256 of the canonical JSON of these values
(sorted keys, no spaces); it changes only when one of them changes.
"""

from __future__ import annotations

import json

from ncclguard.fingerprint.fields import ABSENT, nccl_version, net_plugin, plugin_in_force
from ncclguard.fingerprint.transport import effective_transport

__all__ = ["COMPAT_FIELDS", "VALUES_VERSION", "compat_key", "compat_values"]

COMPAT_FIELDS = ("nccl", "nccl_paths", "net_plugin", "net_abi", "env_plugin", "transport",
                 "adds")

#: The version of what is derived from a fingerprint where it is written: these compat
#: values, the store's query columns (:mod:`ncclguard.store.rows`), the field readers of
#: :mod:`ncclguard.fingerprint.fields` and :mod:`.transport`, and the rules' values
#: (``ncclguard.policy.node_values``, whose ``GATE_VALUES`` carry this number). **Bump it
#: whenever one of them changes meaning**: the daemon then rewrites each node's derived
#: values at its next cycle, and until then the gate recomputes them from the stored
#: fingerprint instead of trusting an older record (slower: a bump costs the gate time
#: until every daemon has run once).
VALUES_VERSION = 6  # 3: env-plugin, gin-rma, tuner and compat.env_plugin (issue 13)
#                    4: node_values' "container" part: injected net plugin, own transport
#                    5: node-adds, from the fingerprint's offers part (issue 39)
#                    6: node_values' job.inputs: the transport's inputs (issue 40)


def _configured_paths(fp: dict) -> dict[str, str | None] | None:
    libs = fp.get("libnccl")
    if libs is None:
        return None
    return {
        lib["path"]: lib.get("version")
        for lib in libs
        if lib.get("origin") == "config" and isinstance(lib.get("path"), str)
    }


def env_plugin(fp: dict) -> str | None:
    """``"NAME vN"`` of the env plugin NCCL loads; ``"none"`` (none, or one NCCL ignores);
    ``None``: unknown. The env-plugin rule's main value."""
    state = plugin_in_force(fp, "env")
    if state is None:
        return None
    name, abi = state
    return ABSENT if name == ABSENT or not abi else f"{name} v{abi}"


def compat_values(fp: dict) -> dict:
    """The values that the refuse-by-default rules compare (see the module doc)."""
    plugin = net_plugin(fp)
    if plugin is not None and plugin[1] == 0:
        plugin = (ABSENT, 0)  # no common ABI: NCCL ignores the plugin, as if it were absent
    return {
        "nccl": nccl_version(fp),
        "nccl_paths": _configured_paths(fp),
        "net_plugin": plugin[0] if plugin is not None else None,
        "net_abi": plugin[1] if plugin is not None else None,
        "env_plugin": env_plugin(fp),
        "transport": effective_transport(fp),
        "adds": adds(fp),
    }


def adds(fp: dict) -> str | None:
    """The net plugin this node adds to a job's own NCCL, in a few words (``HoldoutNet
    v8..v6``: :func:`ncclguard.fingerprint.offers.summary`); ``"none"``; ``None``:
    unknown (an older daemon)."""
    from ncclguard.fingerprint import offers

    value = offers.by_kind(fp)["net"][0]
    return None if value is None else offers.summary(value)


def compat_key(fp: dict, values: dict | None = None) -> str:
    """A short, stable hex hash of :func:`compat_values` (16 hex digits); ``values``: those
    of ``fp`` already computed (the store's row derives both)."""
    import hashlib

    if values is None:
        values = compat_values(fp)
    text = json.dumps(values, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
