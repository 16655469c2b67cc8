"""Field-level differences between fingerprints, each mapped to the policy rule it triggers.

A fingerprint is flattened into ``{field: value}`` with stable field names (lists keyed by
path, device name or port number, never by position), plus a few derived fields that carry
the rules (``nccl.version`` is the default libnccl's version, ``transport`` is the
effective transport). Per-node identity (host name, times, GUIDs, IP addresses) is left out:
it always differs and means nothing.

A field that a probe could not read (an entry in ``errors``) is *unknown*, never
different, as in the policy; :func:`diff` reports such fields apart.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ncclguard.config import DEFAULT_SEVERITY

#: Fields that identify one node or one collection; they are never compared.
_SKIP = re.compile(
    r"^(host\.(hostname|collected_at|boot_id|tool_version)|errors|nccl_conf\.raw|schema)$"
    r"|\.addresses$|\.node_guid$"
)

#: (pattern on the field name, rule). First match wins; no match: no rule (information).
_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r)
    for p, r in (
        (r"^nccl\.version$", "nccl-version"),
        (r"^net\.", "net-plugin"),
        (r"^transport$", "transport"),
        (r"^rdma\.devices\[[^\]]*\]\.ports\[[^\]]*\]\.link_layer$", "transport"),
        (r"^rdma\.active_ports$", "rdma-port-count"),
        (r"^rdma\.devices\[[^\]]*\]\.ports\[[^\]]*\]\.(state|state_code|phys_state|phys_state_code)$",
         "rdma-port-count"),
        (r"^rdma\.devices\[[^\]]*\]\.ports\[[^\]]*\]$", "rdma-port-count"),
        (r"^rdma\.devices\[[^\]]*\]\.ports\[[^\]]*\]\.(rate|rate_gbps)$", "rdma-rate"),
        (r"^rdma\.devices\[[^\]]*\]\.fw_ver$", "rdma-firmware"),
        (r"^nccl_conf\.", "nccl-conf"),
        (r"^gpu\.driver_version$", "gpu-driver"),
        (r"^gpu\.peermem$", "gpudirect"),
    )
)

#: Severity shown for a difference that no rule looks at.
INFO = "info"
_SEVERITY_ORDER = {"refuse": 0, "warn": 1, "ignore": 2, INFO: 3}


def rule_for(name: str) -> str | None:
    """The policy rule a difference in field ``name`` triggers, or ``None``."""
    for pat, rule in _RULES:
        if pat.search(name):
            return rule
    return None


def severity_for(rule: str | None, severity: Mapping[str, str] | None = None) -> str:
    """The configured severity of ``rule`` (``info`` for a field no rule looks at)."""
    if rule is None:
        return INFO
    table = severity if severity is not None else DEFAULT_SEVERITY
    return table.get(rule, DEFAULT_SEVERITY.get(rule, INFO))


def _key(name: str) -> str:
    """Bracketed key for a list element (paths contain dots, so they go in brackets)."""
    return f"[{name}]"


def _walk(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if _SKIP.search(prefix):
        return
    if isinstance(value, dict):
        if not value and prefix:
            out[prefix] = {}
        for k, v in value.items():
            _walk(f"{prefix}.{k}" if prefix else str(k), v, out)
        return
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for i, v in enumerate(value):
            ident = v.get("name") or v.get("path")
            if "port" in v:
                ident = str(v["port"])
            if "kind" in v and "path" in v:
                ident = f"{v['kind']}:{v['path']}"
            _walk(f"{prefix}{_key(str(ident) if ident is not None else str(i))}", v, out)
        return
    out[prefix] = value


def _default_libnccl(fp: Mapping[str, Any]) -> Mapping[str, Any] | None:
    libs = fp.get("libnccl") or []
    for lib in libs:
        if isinstance(lib, Mapping) and lib.get("default"):
            return lib
    return None


def _active_ports(fp: Mapping[str, Any]) -> int | None:
    rdma = fp.get("rdma")
    if not isinstance(rdma, Mapping):
        return None
    n = 0
    for dev in rdma.get("devices") or []:
        for port in dev.get("ports") or []:
            if port.get("state") == "ACTIVE":
                n += 1
    return n


def _transport(fp: Mapping[str, Any]) -> Any:
    try:
        from prolog.transport import effective_transport
    except ImportError:  # the policy package is not installed next to the CLI
        return None
    try:
        return effective_transport(dict(fp))
    except Exception:  # a malformed record: no derived value, the raw fields still compare
        return None


def flatten(fp: Mapping[str, Any]) -> dict[str, Any]:
    """``{field: value}`` for one fingerprint: derived fields first, then the raw ones."""
    out: dict[str, Any] = {}
    lib = _default_libnccl(fp)
    out["nccl.version"] = lib.get("version") if lib else None
    out["nccl.versions"] = sorted(
        {str(x.get("version")) for x in fp.get("libnccl") or [] if x.get("version")}
    )
    tr = _transport(fp)
    if tr is not None:
        out["transport"] = tr
    out["rdma.active_ports"] = _active_ports(fp)
    _walk("", {k: v for k, v in fp.items()}, out)
    return out


def _plain(name: str) -> str:
    """``rdma.devices[mlx5_0].ports[1].rate`` -> ``rdma.devices.mlx5_0.ports.1.rate``."""
    return name.replace("[", ".").replace("]", "")


def errored_fields(fp: Mapping[str, Any]) -> list[str]:
    """The field paths that the node's probes could not read (``errors[].field``)."""
    return [str(e.get("field")) for e in fp.get("errors") or [] if e.get("field")]


def _is_errored(name: str, errs: list[str]) -> bool:
    plain = _plain(name)
    return any(plain == f or plain.startswith((f + ".", f + "_")) for f in errs)


@dataclass(frozen=True)
class FieldDiff:
    """One field whose value is not the same on every node compared."""

    field: str
    values: tuple[tuple[Any, tuple[str, ...]], ...]  # (value, hosts holding it)
    rule: str | None
    severity: str
    unknown_on: tuple[str, ...] = ()  # hosts where a probe could not read it

    def value_of(self, host: str) -> Any:
        for v, hosts in self.values:
            if host in hosts:
                return v
        return None

    def to_dict(self, compress: Any = None) -> dict[str, Any]:
        def hl(hosts: tuple[str, ...]) -> Any:
            return compress(list(hosts)) if compress else list(hosts)

        return {
            "field": self.field,
            "rule": self.rule,
            "severity": self.severity,
            "values": [{"value": v, "hosts": hl(h), "count": len(h)} for v, h in self.values],
            "unknown_on": hl(self.unknown_on) if self.unknown_on else [],
        }


@dataclass
class Diff:
    hosts: list[str]
    differences: list[FieldDiff] = field(default_factory=list)
    unknown: list[FieldDiff] = field(default_factory=list)  # differ only where unreadable

    def worst(self) -> str | None:
        ranked = [d.severity for d in self.differences]
        return min(ranked, key=lambda s: _SEVERITY_ORDER.get(s, 9)) if ranked else None


def _freeze(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    return v


def diff(
    fingerprints: Mapping[str, Mapping[str, Any]],
    severity: Mapping[str, str] | None = None,
    *,
    include_info: bool = True,
) -> Diff:
    """The fields that differ across ``{host: fingerprint}`` (two hosts or more).

    Each difference names the values with the hosts that hold them, the rule it
    triggers and that rule's configured severity. Sorted worst first, then by field.
    """
    hosts = list(fingerprints)
    flat = {h: flatten(fp) for h, fp in fingerprints.items()}
    errs = {h: errored_fields(fp) for h, fp in fingerprints.items()}
    names: dict[str, None] = {}
    for f in flat.values():
        names.update(dict.fromkeys(f))
    result = Diff(hosts=hosts)
    for name in names:
        groups: dict[Any, tuple[Any, list[str]]] = {}
        unknown: list[str] = []
        for h in hosts:
            v = flat[h].get(name)
            if v is None and _is_errored(name, errs[h]):
                unknown.append(h)
                continue
            groups.setdefault(_freeze(v), (v, []))[1].append(h)
        if len(groups) <= 1 and not (unknown and groups):
            continue
        rule = rule_for(name)
        sev = severity_for(rule, severity)
        if not include_info and rule is None:
            continue
        fd = FieldDiff(
            field=name,
            values=tuple((v, tuple(hs)) for v, hs in groups.values()),
            rule=rule,
            severity=sev,
            unknown_on=tuple(unknown),
        )
        (result.differences if len(groups) > 1 else result.unknown).append(fd)
    result.differences.sort(key=lambda d: (_SEVERITY_ORDER.get(d.severity, 9), d.field))
    result.unknown.sort(key=lambda d: d.field)
    return result
