"""A fingerprint's parts, their empty values, and its identity.

A fingerprint is a plain JSON-ready ``dict`` (docs/fingerprint.md): the daemon prints it,
the store keeps it and the policy reads it, all as the same value. Its shape, part by
part, is :mod:`ncclguard.fingerprint.shape` (``TypedDict`` classes). The ``empty_*``
functions are the value a part takes when its probe fails as a whole
(``inventoryd/node/fingerprint.py``), which the readers in :mod:`ncclguard.fingerprint.fields`
then treat as unknown (see :data:`PROBES`).

Standard library only: the gate's path imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ncclguard.fingerprint.shape import (
        EffectivePlugin,
        GpuPart,
        HostPart,
        NcclConfPart,
        NetPart,
        RdmaPart,
    )

__all__ = [
    "NCCL_CONF_PATH",
    "PROBES",
    "SCHEMA",
    "hostname",
    "obj",
]

#: The fingerprint's schema version; a change of meaning bumps it (fields are only added).
SCHEMA = 1

#: Fingerprint part -> the probe that fills it (``inventoryd/probes/``). A probe that
#: fails as a whole leaves its part at the empty value and records an error whose
#: ``probe`` and ``field`` are this name.
PROBES: dict[str, str] = {
    "host": "host",
    "libnccl": "nccl",
    "plugins": "plugins",
    "net": "plugins",
    "effective": "plugins",
    "offers": "plugins",
    "rdma": "rdma",
    "netifs": "netifs",
    "nccl_conf": "nccl_conf",
    "gpu": "gpu",
}

NCCL_CONF_PATH = "/etc/nccl.conf"


# --------------------------------------------------------------------------- empty parts


def empty_host(hostname: str | None, collected_at: str) -> HostPart:
    return {"hostname": hostname, "kernel": None, "boot_id": None,
            "collected_at": collected_at, "tool_version": None}


def empty_net(reason: str = "the plugin probe failed") -> NetPart:
    return {"libnccl": None, "plugin": None, "effective_net_abi": None, "reason": reason}


#: The kinds of the ``effective`` part (the net plugin's is the ``net`` part).
EFFECTIVE_KINDS = ("tuner", "profiler", "env", "gin", "rma")


def empty_effective(reason: str = "the plugin probe failed") -> dict[str, EffectivePlugin]:
    return {k: {"plugin": None, "via": None, "name": None, "abi": None, "reason": reason}
            for k in EFFECTIVE_KINDS}


def empty_rdma() -> RdmaPart:
    return {"abi_version": {"verbs": None, "mad": None}, "libibverbs": None,
            "providers": [], "devices": []}


def empty_nccl_conf() -> NcclConfPart:
    return {"path": NCCL_CONF_PATH, "present": False, "sha256": None, "raw": None,
            "truncated": False, "settings": {}}


def empty_gpu() -> GpuPart:
    return {"driver_version": None, "count": 0, "models": [], "peermem": None}


# --------------------------------------------------------------------------- identity


def obj(value: Any, key: str) -> dict[str, Any]:
    """``value[key]`` when it is an object, else ``{}``: a part that is missing, null or of
    the wrong type (a hostile or broken record) reads as empty, never as a crash."""
    got = value.get(key) if isinstance(value, dict) else None
    return got if isinstance(got, dict) else {}


def hostname(fp: Any) -> str:
    """``host.hostname``; ``ValueError`` when the fingerprint names no host."""
    host = fp.get("host") if isinstance(fp, dict) else None
    name = host.get("hostname") if isinstance(host, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError("fingerprint has no host.hostname")
    return name
