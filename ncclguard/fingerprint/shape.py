"""What a fingerprint holds, part by part, for the type checker and for a reader.

A fingerprint is a plain JSON-ready ``dict`` (docs/fingerprint.md); nothing converts to
or from these classes at run time. They live apart from :mod:`.model` so that the gate,
which reads fingerprints but never builds one, does not pay for creating them.

:func:`bounds_problem` is the one run-time check here: how deep and how large a
fingerprint (or any stored record) may be so that every reader handles it (issue 25).
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

__all__ = [
    "MAX_DEPTH",
    "MAX_KEY",
    "MAX_PATH_CHARS",
    "MAX_VALUES",
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
    "bounds_problem",
]

#: Past any of these a record is refused ("too-deep") where it is stored, and not shown
#: where it is read: nesting (a real fingerprint is 6 to 8 levels deep; Python's json
#: and the history's field diff recurse, with a limit near 1,000), values (keys, items
#: and scalars: a real fingerprint holds a few hundred), a key's length, and the length
#: of the field names a diff of it could write (over its scalars, the keys and list keys
#: above each: a chain of long keys above many values would make a diff of gigabytes).
MAX_DEPTH = 32
MAX_VALUES = 50_000
MAX_KEY = 256
MAX_PATH_CHARS = 4 << 20
_LIST_KEYS = ("path", "name", "port")  # what the history's diff names a list item by


def bounds_problem(doc: Any, scalars: list[Any] | None = None) -> str | None:
    """Why ``doc`` goes past the bounds above (what it holds), or None. ``scalars``: a
    list that gets every key and scalar of ``doc`` (for a check of their values in one
    go: the spool's storable values). No recursion, no call per value; at most
    :data:`MAX_VALUES` values are looked at."""
    if type(doc) not in _CONTAINERS:
        if scalars is not None:
            scalars.append(doc)
        return None
    stack: list[tuple[Any, int, int]] = [(doc, 0, 0)]  # (container, depth, its name's chars)
    values = 1
    path_chars = 0
    while stack:
        x, depth, named = stack.pop()
        if depth >= MAX_DEPTH:
            return f"nesting deeper than {MAX_DEPTH} levels"
        if type(x) is dict:
            values += 2 * len(x)
            if values > MAX_VALUES:
                return f"more than {MAX_VALUES} values"
            if scalars is not None:
                scalars.extend(x)
            for k, v in x.items():
                width = len(k) if type(k) is str else len(str(k))
                if width > MAX_KEY:
                    return f"a key of {width} characters (at most {MAX_KEY})"
                if type(v) in _CONTAINERS:
                    stack.append((v, depth + 1, named + width + 1))
                else:
                    path_chars += named + width + 1
                    if scalars is not None:
                        scalars.append(v)
        else:
            values += len(x)
            if values > MAX_VALUES:
                return f"more than {MAX_VALUES} values"
            for v in x:
                t = type(v)
                if t is dict:
                    width = max((len(str(v[k])) for k in _LIST_KEYS if k in v), default=0)
                    stack.append((v, depth + 1, named + width + 2))
                elif t is list:
                    stack.append((v, depth + 1, named + 2))
                else:
                    path_chars += named + 2
                    if scalars is not None:
                        scalars.append(v)
    if path_chars > MAX_PATH_CHARS:
        return (f"field names of more than {MAX_PATH_CHARS} characters in all (long keys "
                "above many values)")
    return None


_CONTAINERS = frozenset((dict, list))


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
    via: str | None  # whose library it is: the kind's own, or "net" (a fallback)
    name: str | None  # the name string of its struct
    abi: int | None  # the highest ABI both it and the default libnccl know
    reason: str | None  # why abi is null; also names a release outside the loading-rules
    #                     table (ncclguard.fingerprint.loading), even with an ABI


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
    offers: NotRequired[dict[str, Any]]  # what the node adds to each release's NCCL (issue 39)
    rdma: RdmaPart
    netifs: list[Netif]
    nccl_conf: NcclConfPart
    gpu: GpuPart
    containers: NotRequired[dict[str, Any]]  # what the node injects into containers (issue 15)
    errors: list[ProbeError]
