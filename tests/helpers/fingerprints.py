"""The one fingerprint factory of the tests and benchmarks (docs/fingerprint.md).

``fingerprint()`` builds one node's schema-1 fingerprint the way the probes lay it out:
by default a node on NCCL 2.21.5 with one HCA (one ACTIVE InfiniBand port) and no net
plugin. Its parameters change the parts a test is about: ``plugin_abi=8`` adds the usual
``IBext_v8`` net plugin, ``net_abis`` what its libnccl offers, ``hcas``/``ports_up`` the
HCAs and how many of their ports are up, ``conf`` /etc/nccl.conf (its settings, or its
text); ``libs``, ``plugins``, ``devices`` and ``netifs`` take parts built with
:func:`libnccl`, :func:`plugin`, :func:`device` and :func:`port`; any other keyword
replaces a top-level key as it is. Tests that need what the real probes produce use
``inventoryd.node.fingerprint.collect`` on trees from ``devtools.nodetree`` instead.
"""

from __future__ import annotations

import copy
from typing import Any

LIB = "/usr/lib/x86_64-linux-gnu/libnccl.so.2"
PLUGIN = "/usr/lib/x86_64-linux-gnu/libnccl-net.so"

NET_ABIS = {
    "2.18.3": [6, 5, 4],
    "2.21.5": [8, 7, 6, 5],
    "2.26.2": [10, 9, 8, 7, 6],
}


def port(
    num: int = 1,
    state: str | None = "ACTIVE",
    link_layer: str | None = "InfiniBand",
    rate_gbps: float | None = 400.0,
) -> dict[str, Any]:
    codes = {"ACTIVE": 4, "DOWN": 1, "INIT": 2, "ARMED": 3}
    return {
        "port": num,
        "state": state,
        "state_code": codes.get(state) if state else None,
        "phys_state": "LinkUp" if state == "ACTIVE" else "Disabled",
        "phys_state_code": 5 if state == "ACTIVE" else 3,
        "rate_gbps": rate_gbps,
        "rate": f"{rate_gbps:g} Gb/sec (4X NDR)" if rate_gbps is not None else None,
        "link_layer": link_layer,
    }


def device(name: str = "mlx5_0", ports: list | None = None, fw: str | None = "28.39.1002"):
    return {
        "name": name,
        "fw_ver": fw,
        "hca_type": "MT4129",
        "board_id": "MT_0000000838",
        "node_guid": "946d:ae03:00f3:8a3c",
        "node_type": "1: CA",
        "ports": [port()] if ports is None else ports,
    }


def libnccl(
    version: str | None = "2.21.5",
    path: str = LIB,
    default: bool = True,
    origin: str = "linker",
    net_abis: list[int] | None = None,
) -> dict[str, Any]:
    if net_abis is None:
        net_abis = NET_ABIS.get(version or "", [8, 7, 6, 5])
    major, minor, patch = (version or "0.0.0").split(".")
    return {
        "path": path,
        "realpath": path,
        "size": 290123456,
        "sha256": f"sha-{version}",
        "version": version,
        "version_code": int(major) * 10000 + int(minor) * 100 + int(patch) if version else None,
        "cuda_version": "12.4",
        "version_source": "banner" if version else None,
        "version_error": None if version else "no NCCL version banner",
        "git_version": None,
        "abis": {"net": net_abis, "collnet": net_abis, "tuner": [2, 1], "profiler": []},
        "default": default,
        "origin": origin,
    }


def plugin(
    name: str | None = "IBext_v8",
    abis: list[int] | None = None,
    sha256: str = "aaaa",
    path: str = PLUGIN,
) -> dict[str, Any]:
    abis = [8, 7, 6, 5] if abis is None else abis
    return {
        "kind": "net",
        "path": path,
        "realpath": path,
        "size": 123456,
        "sha256": sha256,
        "abis": {"net": abis, "collnet": [], "tuner": [], "profiler": []},
        "names": {"net": name} if name else {},
        "name": name,
        "default": True,
        "origin": "linker",
        "error": None,
    }


def fingerprint(
    host: str = "n1",
    nccl: str | None = "2.21.5",
    libs: list[dict] | None = None,
    plugins: list[dict] | None = None,
    devices: list[dict] | None = None,
    conf: dict[str, str] | str | None = None,
    netifs: list[dict] | None = None,
    driver: str | None = "550.54.15",
    peermem: str | None = "nvidia_peermem",
    errors: list[dict] | None = None,
    *,
    net_abis: list[int] | None = None,
    plugin_abi: int | None = None,
    hcas: int = 1,
    ports_up: int | None = None,
    collected_at: str = "2026-11-30T02:13:28Z",
    offers: bool = False,
    **override: Any,
) -> dict[str, Any]:
    """One node's fingerprint.

    ``conf``: nccl.conf's settings (its text is then ``NAME=value`` lines), or its text as
    read. ``net_abis``: the net plugin ABIs the libnccl of ``nccl`` offers (by default its
    release's, :data:`NET_ABIS`; not with ``libs``). ``plugin_abi``: a default
    ``IBext_v<abi>`` net plugin that offers that one ABI (not with ``plugins``). ``hcas``:
    that many HCAs ``mlx5_0``.., one InfiniBand port each, the first ``ports_up`` of them
    ACTIVE and the others DOWN (all ACTIVE when None; not with ``devices``). ``override``
    replaces top-level keys as they are. ``offers``: add the part a daemon of issue 39
    sends (:func:`offers_part` of the default net plugin; without it, the record of an
    older daemon: node-adds finds it unknown).
    """
    if libs is None:
        libs = [libnccl(nccl, net_abis=net_abis)]
    else:
        assert net_abis is None, "net_abis or libs, not both"
    if plugin_abi is not None:
        assert plugins is None, "plugin_abi or plugins, not both"
        plugins = [plugin(f"IBext_v{plugin_abi}", abis=[plugin_abi])]
    plugins = [] if plugins is None else plugins
    if devices is None:
        up = hcas if ports_up is None else ports_up
        devices = [device(f"mlx5_{i}", ports=[port(1, "ACTIVE" if i < up else "DOWN")])
                   for i in range(hcas)]
    else:
        assert (hcas, ports_up) == (1, None), "hcas/ports_up or devices, not both"
    if isinstance(conf, str):  # the file's text: its NAME=value lines are its settings
        raw, settings = conf, dict(ln.split("=", 1) for ln in conf.splitlines() if "=" in ln)
    else:
        settings = {} if conf is None else dict(conf)
        raw = "".join(f"{k}={v}\n" for k, v in settings.items())
    present = isinstance(conf, str) or bool(settings)
    default_lib = next((lib for lib in libs if lib["default"]), None)
    default_plugin = next((p for p in plugins if p["kind"] == "net" and p["default"]), None)
    abi = None
    reason: str | None = "no net plugin"
    if default_plugin and default_lib:
        common = set(default_plugin["abis"]["net"]) & set(default_lib["abis"]["net"])
        abi = max(common) if common else None
        reason = None if common else "no common ABI"
    fp: dict[str, Any] = {
        "schema": 1,
        "host": {
            "hostname": host,
            "kernel": "6.1.0-18-amd64",
            "boot_id": "b00t",
            "collected_at": collected_at,
            "tool_version": "0.1.0",
        },
        "libnccl": libs,
        "plugins": plugins,
        "net": {
            "libnccl": default_lib["path"] if default_lib else None,
            "plugin": default_plugin["path"] if default_plugin else None,
            "effective_net_abi": abi,
            "reason": reason,
        },
        # a daemon of issue 13 or later: no tuner, profiler, env, GIN or RMA plugin
        "effective": {k: {"plugin": None, "via": None, "name": None, "abi": None,
                          "reason": f"no {k} plugin"}
                      for k in ("tuner", "profiler", "env", "gin", "rma")},
        "rdma": {
            "abi_version": {"verbs": "6", "mad": "5"},
            "libibverbs": {"path": "/usr/lib/x86_64-linux-gnu/libibverbs.so.1",
                           "version": "1.14.50.0"},
            "providers": ["mlx5"],
            "devices": devices,
        },
        "netifs": [{"name": "ib0", "up": True, "addresses": ["10.0.0.1"]}]
        if netifs is None
        else netifs,
        "nccl_conf": {
            "path": "/etc/nccl.conf",
            "present": present,
            "sha256": "c0nf" if present else None,
            "raw": raw,
            "truncated": False,
            "settings": settings,
        },
        "gpu": {
            "driver_version": driver,
            "count": 8,
            "models": ["NVIDIA H100 80GB HBM3"] * 8,
            "peermem": peermem,
        },
        "errors": errors or [],
    }
    if offers:
        fp["offers"] = offers_part(default_plugin)
    fp.update(copy.deepcopy(override))
    return fp


def offers_part(net: dict[str, Any] | None) -> dict[str, Any]:
    """The ``offers`` part of a node whose only plugin is the net plugin ``net`` (a
    :func:`plugin` record; None: none), as the plugin probe writes it: for each release
    of the table, that plugin at the highest ABI both know (None: none), and no library
    of the other kinds."""
    from ncclguard.fingerprint.offers import pack
    from ncclguard.fingerprint.releases import RELEASES

    rows: dict[str, dict[str, Any]] = {}
    for release in RELEASES:
        row: dict[str, Any] = {}
        if net is not None:
            both = set(release.abis["net"]) & set(net["abis"].get("net") or [])
            row["net"] = [0, max(both) if both else None]
        rows[release.label] = row
    files = [] if net is None else [{
        "path": net["path"], "names": dict(net.get("names") or {}),
        "abis": {k: v for k, v in net["abis"].items() if v}}]
    return pack(rows, files)


def error(field: str, path: str = "/sys/x", probe: str = "rdma") -> dict[str, Any]:
    return {"probe": probe, "field": field, "path": path, "error": "[Errno 22] Invalid argument"}
