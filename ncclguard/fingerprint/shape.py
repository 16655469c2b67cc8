"""What a fingerprint holds, part by part, for the type checker and for a reader.

A fingerprint is a plain JSON-ready ``dict`` (docs/fingerprint.md); nothing converts to
or from these classes at run time. They live apart from :mod:`.model` so that the gate,
which reads fingerprints but never builds one, does not pay for creating them.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

__all__ = [
    "Abis",
    "EffectivePlugin",
    "Fingerprint",
    "GpuPart",
    "HostPart",
    "Libnccl",
    "NcclConfPart",
    "NetPart",
    "Netif",
    "Plugin",
    "ProbeError",
    "RdmaDevice",
    "RdmaPart",
    "RdmaPort",
]


class HostPart(TypedDict):
    hostname: str | None
    kernel: str | None
    boot_id: str | None
    collected_at: str  # UTC ISO-8601 with a Z
    tool_version: str | None


class Abis(TypedDict, total=False):
    net: list[int]
    collnet: list[int]
    tuner: list[int]
    profiler: list[int]
    env: list[int]  # ncclEnvPlugin_vN (2.28+)
    gin: list[int]  # ncclGinPlugin_vN (2.28+)
    rma: list[int]  # ncclRmaPlugin_vN (2.30.7+)


class Libnccl(TypedDict, total=False):
    path: str
    realpath: str | None
    size: int | None
    sha256: str | None
    version: str | None
    version_code: int | None
    cuda_version: str | None
    version_source: Literal["banner", "ncclGetVersion"] | None
    version_error: str | None
    git_version: str | None
    abis: Abis | None
    default: bool
    origin: Literal["linker", "config"]


class Plugin(TypedDict, total=False):
    kind: str  # "net" | "tuner" | "profiler" | "env" | "gin" | "rma"
    path: str
    realpath: str | None
    size: int | None
    sha256: str | None
    abis: Abis | None
    names: dict[str, str]
    name: str | None
    default: bool
    origin: Literal["linker", "nccl.conf", "config"]
    error: str | None


class NetPart(TypedDict):
    libnccl: str | None  # the default libnccl
    plugin: str | None  # the default net plugin
    effective_net_abi: int | None
    reason: str | None  # why effective_net_abi is null


class EffectivePlugin(TypedDict):
    """The plugin NCCL loads for one kind (``effective.<kind>``)."""

    plugin: str | None  # its library's path; null: none (reason says why)
    via: str | None  # whose library it is: the kind's own, "net" or "gin" (a fallback)
    name: str | None  # the name string of its struct
    abi: int | None  # the highest ABI both it and the default libnccl know
    reason: str | None  # why abi is null


class RdmaPort(TypedDict, total=False):
    port: int
    state: str | None
    state_code: int | None
    phys_state: str | None
    phys_state_code: int | None
    rate_gbps: float | None
    rate: str | None
    link_layer: str | None


class RdmaDevice(TypedDict, total=False):
    name: str
    fw_ver: str | None
    hca_type: str | None
    board_id: str | None
    node_guid: str | None
    node_type: str | None
    ports: list[RdmaPort] | None


class RdmaPart(TypedDict):
    abi_version: dict[str, str | None]
    libibverbs: dict[str, str | None] | None
    providers: list[str]
    devices: list[RdmaDevice]


class Netif(TypedDict):
    name: str
    up: bool | None
    addresses: list[str]


class NcclConfPart(TypedDict, total=False):
    path: str
    present: bool | None
    sha256: str | None
    raw: str | None
    truncated: bool
    settings: dict[str, str] | None
    comment_settings: dict[str, str]


class GpuPart(TypedDict):
    driver_version: str | None
    count: int
    models: list[str]
    peermem: str | None


class ProbeError(TypedDict):
    probe: str
    field: str | None
    path: str | None
    error: str


class Fingerprint(TypedDict):
    """One node's fingerprint (docs/fingerprint.md)."""

    schema: int
    host: HostPart
    libnccl: list[Libnccl]
    plugins: list[Plugin]
    net: NetPart
    effective: dict[str, EffectivePlugin]  # tuner, profiler, env, gin, rma
    rdma: RdmaPart
    netifs: list[Netif]
    nccl_conf: NcclConfPart
    gpu: GpuPart
    containers: NotRequired[dict[str, Any]]  # what the node injects into containers (issue 15)
    errors: list[ProbeError]
