"""The inventory's query columns and rows, derived from a fingerprint where it is written.

Everything here is read from the fingerprint model (:mod:`ncclguard.fingerprint`): the
compatibility key and values, the effective transport, the active RDMA ports. The CLI's
``nodes --where`` filters on :data:`NODE_COLUMNS` (names never come from the caller).
"""

from __future__ import annotations

from typing import Any

from ncclguard.fingerprint.canonical import canonical_json
from ncclguard.fingerprint.compat import compat_key, compat_values
from ncclguard.fingerprint.fields import ABSENT, active_ports, plugin_in_force
from ncclguard.fingerprint.model import EFFECTIVE_KINDS, obj

__all__ = [
    "DETAIL_DELETE",
    "DETAIL_INSERT",
    "HAS_NCCL",
    "NODE_COLUMNS",
    "PLUGIN_COLUMNS",
    "WHERE_COLUMNS",
    "derive",
    "detail_rows",
    "plugin_columns",
]

#: The v4 query columns (issue 13): per kind, the name of the plugin NCCL loads
#: (``"none"``: none) and its ABI in force (0: none; NULL: unknown).
PLUGIN_COLUMNS = tuple(f"{k}_{c}" for k in EFFECTIVE_KINDS for c in ("plugin", "abi"))


def plugin_columns(fp: dict[str, Any]) -> dict[str, Any]:
    """``{<kind>_plugin, <kind>_abi}`` of :data:`PLUGIN_COLUMNS`, read with
    :func:`ncclguard.fingerprint.fields.plugin_in_force` (a plugin NCCL ignores: its name,
    ABI 0)."""
    out: dict[str, Any] = {}
    for kind in EFFECTIVE_KINDS:
        state = plugin_in_force(fp, kind)
        out[f"{kind}_plugin"] = None if state is None else state[0]
        out[f"{kind}_abi"] = None if state is None else (0 if state[0] == ABSENT else state[1])
    return out


def derive(fp: dict[str, Any]) -> dict[str, Any]:
    """The compatibility key and the query columns of one fingerprint."""
    libs = [x for x in fp.get("libnccl") or [] if isinstance(x, dict)]
    plugins = [x for x in fp.get("plugins") or [] if isinstance(x, dict)]
    net = obj(fp, "net")
    rdma = obj(fp, "rdma")
    gpu = obj(fp, "gpu")
    default_lib = next((x for x in libs if x.get("default")), None)
    versions = sorted({str(x["version"]) for x in libs if x.get("version")})
    net_plugin = net.get("plugin")
    plugin_row = next(
        (p for p in plugins if p.get("kind") == "net" and p.get("path") == net_plugin), None
    )
    ports = [
        port
        for dev in rdma.get("devices") or []
        if isinstance(dev, dict)
        for port in dev.get("ports") or []
        if isinstance(port, dict)
    ]
    values = compat_values(fp)
    transport = values["transport"]  # effective_transport(fp), computed once
    return {
        "compat_key": str(compat_key(fp, values)),
        "compat_values": canonical_json(values),
        "nccl_version": default_lib.get("version") if default_lib else None,
        "nccl_versions": ",".join(versions),
        "net_plugin": net_plugin,
        "net_plugin_name": plugin_row.get("name") if plugin_row else None,
        "net_abi": values.get("net_abi") if isinstance(values, dict) else None,
        "transport": None if transport is None else str(transport),
        "rdma_ports_up": active_ports(fp),  # NULL: unknown, never "down"
        "rdma_ports_total": len(ports),
        "driver": gpu.get("driver_version"),
        "error_count": len(fp.get("errors") or []),
        **plugin_columns(fp),
    }


def _max_abi(abis: Any, kind: Any) -> int | None:
    if isinstance(abis, dict):
        vals = [v for v in abis.get(kind) or [] if isinstance(v, int)]
        return max(vals) if vals else None
    return None


def detail_rows(host: str, fp: dict[str, Any]) -> dict[str, list[tuple[Any, ...]]]:
    libs = [
        (host, x.get("path"), x.get("realpath"), x.get("version"), x.get("version_code"),
         x.get("cuda_version"), x.get("sha256"), int(bool(x.get("default"))))
        for x in fp.get("libnccl") or [] if isinstance(x, dict) and x.get("path")
    ]
    plugins = [
        (host, x.get("kind") or "", x.get("path"), x.get("name"),
         _max_abi(x.get("abis"), x.get("kind")), canonical_json(x.get("abis")),
         int(bool(x.get("default"))), x.get("error"))
        for x in fp.get("plugins") or [] if isinstance(x, dict) and x.get("path")
    ]
    rdma = obj(fp, "rdma")
    ports = [
        (host, dev.get("name"), p.get("port"), p.get("state"), p.get("rate_gbps"),
         p.get("link_layer"), dev.get("fw_ver"), dev.get("hca_type"))
        for dev in rdma.get("devices") or [] if isinstance(dev, dict) and dev.get("name")
        for p in dev.get("ports") or [] if isinstance(p, dict) and p.get("port") is not None
    ]
    # a fingerprint with duplicate keys must not abort the write: the last one wins
    return {
        "libraries": list({r[:2]: r for r in libs}.values()),
        "plugins": list({r[:3]: r for r in plugins}.values()),
        "rdma_ports": list({r[:3]: r for r in ports}.values()),
    }


DETAIL_INSERT = {
    "libraries": "INSERT INTO libraries (host, path, realpath, version, version_code, "
    "cuda_version, sha256, is_default) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
    "plugins": "INSERT INTO plugins (host, kind, path, name, abi, abis, is_default, error) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
    "rdma_ports": "INSERT INTO rdma_ports (host, device, port, state, rate_gbps, link_layer, "
    "fw_ver, hca_type) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
}
DETAIL_DELETE = {
    "libraries": "DELETE FROM libraries WHERE host = ?",
    "plugins": "DELETE FROM plugins WHERE host = ?",
    "rdma_ports": "DELETE FROM rdma_ports WHERE host = ?",
}

# nodes(where=...): the only columns a caller may filter on (identifiers never come
# from the caller), and the one computed filter.
NODE_COLUMNS = (
    "host", "nccl_version", "nccl_versions", "net_plugin", "net_plugin_name", "net_abi",
    "transport", "rdma_ports_up", "rdma_ports_total", "driver", "last_heartbeat",
    "error_count", "compat_key", *PLUGIN_COLUMNS,
)
WHERE_COLUMNS = {c: f"n.{c}" for c in NODE_COLUMNS}
HAS_NCCL = "has_nccl"  # any libnccl on the node has this version
