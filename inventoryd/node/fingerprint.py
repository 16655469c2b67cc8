"""One node's fingerprint (docs/fingerprint.md): every probe, run once, in one value.

``collect(root, hostname, config)`` never raises for what it finds on the node: a probe
that fails outright (a bug, an unexpected file) costs that probe's part, which becomes
its empty value, and an entry in ``errors`` naming the probe and the cause. File-only
results are kept in the :class:`~inventoryd.filecache.FileCache` between runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from inventoryd.filecache import FileCache
from inventoryd.nodefs import ErrorLog, NodeFS
from inventoryd.probes import containers, gpu, host, nccl, ncclconf, netifs, plugins, rdma
from ncclguard.config import InventorydConfig
from ncclguard.fingerprint import model
from ncclguard.fingerprint.shape import Fingerprint

SCHEMA = model.SCHEMA


def _run(errors: ErrorLog, name: str, fn: Callable[[], Any], empty: Any) -> Any:
    try:
        return fn()
    except Exception as e:  # one broken probe must not cost the node's whole record
        errors.add(name, name, None, f"probe failed: {type(e).__name__}: {e}")
        return empty


def collect(
    root: str = "/",
    hostname: str | None = None,
    config: InventorydConfig | None = None,
    cache: FileCache | None = None,
) -> Fingerprint:
    """The fingerprint of the node whose files are under ``root``."""
    from inventoryd.nodefs import READ_BUDGET_BYTES, read_budget

    config = config or InventorydConfig()
    fs = NodeFS(root)
    errors = ErrorLog()
    budget = read_budget.set([READ_BUDGET_BYTES])
    try:
        return _collect(fs, errors, hostname, config, cache)
    finally:
        read_budget.reset(budget)


def _collect(fs: NodeFS, errors: ErrorLog, hostname: str | None, config: InventorydConfig,
             cache: FileCache | None) -> Fingerprint:
    if cache is None:
        cache = FileCache.open(config)
    host_ = _run(errors, host.PROBE, lambda: host.probe(fs, errors, hostname),
                 model.empty_host(hostname, host.utc_now()))
    libnccl = _run(errors, nccl.PROBE, lambda: nccl.probe(fs, errors, config, cache), [])
    conf = _run(errors, ncclconf.PROBE, lambda: ncclconf.probe(fs, errors), model.empty_nccl_conf())
    settings = conf.get("settings") or {}
    plugins_, net, effective, offers = _run(
        errors, plugins.PROBE,
        lambda: plugins.probe(fs, errors, config, settings, libnccl, cache),
        ([], model.empty_net(), model.empty_effective(), {}),
    )
    rdma_ = _run(errors, rdma.PROBE, lambda: rdma.probe(fs, errors),
                 model.empty_rdma())
    netifs_ = _run(errors, netifs.PROBE, lambda: netifs.probe(fs, errors), [])
    gpu_ = _run(errors, gpu.PROBE, lambda: gpu.probe(fs, errors),
                model.empty_gpu())
    # a probe that fails says what the node injects is not known, never "nothing"
    containers_ = _run(errors, containers.PROBE, lambda: containers.probe(fs, errors, cache),
                       containers.empty(unknown="the containers probe failed (see errors)"))
    cache.save()
    # the probes build plain dicts of the parts' shapes (ncclguard.fingerprint.model)
    return {
        "schema": SCHEMA,
        "host": host_,
        "libnccl": libnccl,
        "plugins": plugins_,
        "net": net,
        "effective": effective,
        "offers": offers,
        "rdma": rdma_,
        "netifs": netifs_,
        "nccl_conf": conf,
        "gpu": gpu_,
        "containers": containers_,
        "errors": errors.entries,
    }
