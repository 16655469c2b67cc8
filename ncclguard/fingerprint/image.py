"""What the gate reads of an image record (``image_values``), and the effective NCCL stack
of a job that runs an image on a node (:func:`effective_stack`).

An image record is :func:`inventoryd.controller.images.fingerprint.scan_image`'s output
(docs/containers.md). Standard library only: the gate's path imports it.
"""

from __future__ import annotations

from typing import Any

from ncclguard.fingerprint.abi import common

__all__ = ["IMAGE_VALUES_VERSION", "effective_stack", "image_values", "valid_image_values"]

IMAGE_VALUES_VERSION = 1


def _ints(v: Any) -> list[int]:
    return sorted({x for x in v if type(x) is int}, reverse=True) if isinstance(v, list) else []


def image_values(record: dict[str, Any]) -> dict[str, Any]:
    """The narrow record the gate compares: the libnccl a job in the image loads (its
    version and the net ABIs it looks for) and the image's own net plugin."""
    libs = [r for r in record.get("libnccl") or [] if isinstance(r, dict)]
    lib = next((r for r in libs if r.get("default")), None)
    plugin = None
    net = record.get("net_plugin")
    for p in record.get("plugins") or []:
        if isinstance(p, dict) and p.get("path") == net and p.get("kind") == "net":
            plugin = {"path": net, "name": p.get("name"),
                      "abis": _ints((p.get("abis") or {}).get("net"))}
    return {
        "v": IMAGE_VALUES_VERSION,
        "nccl_version": lib.get("version") if lib else None,
        "nccl_path": lib.get("path") if lib else None,
        "net_abis": _ints((lib.get("abis") or {}).get("net")) if lib else [],
        "plugin": plugin,
    }


def valid_image_values(v: Any) -> bool:
    if not isinstance(v, dict) or v.get("v") != IMAGE_VALUES_VERSION:
        return False
    if not isinstance(v.get("nccl_version"), str | None) or not isinstance(v.get("net_abis"), list):
        return False
    p = v.get("plugin")
    return p is None or (isinstance(p, dict) and isinstance(p.get("abis"), list))


def effective_stack(image: dict[str, Any], injected: dict[str, Any] | None,
                    internal: str | None) -> dict[str, Any]:
    """The stack of a job in ``image`` on one node.

    ``injected``: the net plugin the node mounts into containers (``{"name", "abis",
    "path"}``), or None; it takes the place of the image's own (it is mounted over the
    image's linker path, or named by the node's ``NCCL_NET_PLUGIN``). ``internal``: the
    node's own transport without a plugin (``IB``, ``RoCE``, ``Socket``; None: unknown).

    NCCL uses a plugin only at an ABI both sides know; with none in common it logs
    ``Failed to find ncclNetPlugin_vN symbol`` and uses its internal transports
    (docs/nccl.md, "Plugins NCCL loads"). Returns ``{"nccl", "plugin", "source", "abi", "transport",
    "fallback"}``; ``fallback`` is True when a plugin is there but unusable.
    """
    plugin = injected if injected is not None else image.get("plugin")
    source = "node" if injected is not None else ("image" if plugin else None)
    abi = None
    fallback = False
    if plugin is not None:
        both = common(_ints(image.get("net_abis")), _ints(plugin.get("abis")))
        abi = both[0] if both else None
        fallback = abi is None
    if plugin is not None and abi is not None:
        transport: str | None = str(plugin.get("name") or plugin.get("path") or "plugin")
    else:
        transport = internal
    return {"nccl": image.get("nccl_version"), "plugin": plugin, "source": source,
            "abi": abi, "transport": transport, "fallback": fallback}
