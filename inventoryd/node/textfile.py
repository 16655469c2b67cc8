"""The node_exporter textfile output: ``<textfile_dir>/ncclguard.prom``, written atomically.

prometheus_client's ``write_to_textfile`` writes a temporary file in the same directory
and renames it, so node_exporter never reads half a file.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Info, write_to_textfile

from ncclguard.fingerprint import offers
from ncclguard.fingerprint.fields import plugins_in_force
from ncclguard.fingerprint.model import obj

FILE_NAME = "ncclguard.prom"


def _s(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [x for x in value or [] if isinstance(x, dict)] if isinstance(value, list) else []


def registry_for(
    fp: Mapping[str, Any],
    *,
    last_change: float | None,
    publish_ok: bool | None,
    last_publish: float | None,
) -> CollectorRegistry:
    reg = CollectorRegistry()
    lib = Info("ncclguard_libnccl", "A libnccl a job on this node can load", ["path"],
               registry=reg)
    for x in _dicts(fp.get("libnccl")):
        lib.labels(path=_s(x.get("path"))).info({
            "realpath": _s(x.get("realpath")), "version": _s(x.get("version")),
            "cuda_version": _s(x.get("cuda_version")), "default": _s(bool(x.get("default"))),
            "origin": _s(x.get("origin")),
        })
    plugin = Info("ncclguard_plugin", "An NCCL plugin on this node", ["kind", "path"],
                  registry=reg)
    for x in _dicts(fp.get("plugins")):
        abis = obj(x, "abis")
        mine = [v for v in abis.get(str(x.get("kind")), []) or [] if isinstance(v, int)]
        plugin.labels(kind=_s(x.get("kind")), path=_s(x.get("path"))).info({
            "name": _s(x.get("name")), "abi": _s(max(mine) if mine else None),
            "default": _s(bool(x.get("default"))), "error": _s(x.get("error")),
        })
    in_force = Info("ncclguard_plugin_in_force", "The library NCCL loads for each plugin "
                    "kind (net, tuner, profiler, env, gin, rma) and its ABI in force",
                    ["kind"], registry=reg)
    abi = Gauge("ncclguard_plugin_abi_in_force", "ABI version NCCL uses for each plugin kind "
                "(0: none, or a library NCCL ignores); absent: unknown", ["kind"],
                registry=reg)
    for row in plugins_in_force(dict(fp)):
        kind = _s(row["kind"])
        in_force.labels(kind=kind).info({
            "plugin": _s(row["plugin"]), "via": _s(row["via"]), "name": _s(row["name"]),
            "abi": _s(row["abi"]), "reason": _s(row["reason"]),
        })
        if row["abi"] is not None:
            abi.labels(kind=kind).set(row["abi"])
    adds = Info("ncclguard_plugin_adds", "What this node adds to a job's own NCCL, whatever "
                "its libnccl (issue 39): per kind, each plugin name with the ABIs some "
                "release would use (none), and the plugin release by release", ["kind"],
                registry=reg)
    for kind, (value, _) in offers.by_kind(dict(fp)).items():
        adds.labels(kind=kind).info({
            "plugin": _s(None if value is None else offers.summary(value)),
            "by_release": _s(value)})
    port = Info("ncclguard_rdma_port", "An RDMA port on this node", ["device", "port"],
                registry=reg)
    rdma = obj(fp, "rdma")
    for dev in _dicts(rdma.get("devices")):
        for p in _dicts(dev.get("ports")):
            port.labels(device=_s(dev.get("name")), port=_s(p.get("port"))).info({
                "state": _s(p.get("state")), "link_layer": _s(p.get("link_layer")),
                "rate_gbps": _s(p.get("rate_gbps")), "fw_ver": _s(dev.get("fw_ver")),
            })
    errors = Gauge("ncclguard_probe_errors", "Fields the probes could not read in the "
                   "latest fingerprint", registry=reg)
    errors.set(len(fp.get("errors") or []))
    if last_change is not None:
        Gauge("ncclguard_fingerprint_last_change_timestamp_seconds",
              "When this node's fingerprint last changed", registry=reg).set(last_change)
    if last_publish is not None:
        Gauge("ncclguard_record_last_publish_timestamp_seconds",
              "When the daemon last published this node's signed record", registry=reg
              ).set(last_publish)
    if publish_ok is not None:
        Gauge("ncclguard_publish_up", "1 if the last publish of the record succeeded",
              registry=reg).set(1 if publish_ok else 0)
    return reg


def write_textfile(
    directory: Path | str,
    fp: Mapping[str, Any],
    *,
    last_change: float | None = None,
    publish_ok: bool | None = None,
    last_publish: float | None = None,
) -> Path:
    """Write ``ncclguard.prom`` atomically into ``directory``; returns its path."""
    path = Path(directory) / FILE_NAME
    reg = registry_for(fp, last_change=last_change, publish_ok=publish_ok,
                       last_publish=last_publish)
    write_to_textfile(str(path), reg)
    return path
