"""Field-level differences between fingerprints, each mapped to the policy rule it triggers.

The raw field diff is :func:`ncclguard.fingerprint.canonical.fingerprint_diff` (the one the
store's history table keeps), so field names are the same everywhere
(``rdma.devices[mlx5_0].ports[1].rate_gbps``, lists keyed by path, name or port). On top
of it come the derived values that the refuse-level rules compare
(``compat.nccl``, ``compat.net_plugin``, ``compat.net_abi``, ``compat.transport`` from
:func:`ncclguard.fingerprint.compat.compat_values`) and ``rdma.active_ports``
(:func:`ncclguard.fingerprint.fields.active_ports`). Which rule a field belongs to is
each rule's own ``fields`` (:mod:`ncclguard.policy.rules`). Per-node identity (host
name, boot id, GUIDs, IP addresses) is left out: it always differs and means nothing.

A field that a probe could not read (an entry in ``errors``), and a derived value that is
``None``, is *unknown*, never different, as in the policy; :func:`diff` reports such
fields apart.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ncclguard.config import PolicyConfig
from ncclguard.fingerprint.canonical import fingerprint_diff
from ncclguard.fingerprint.compat import COMPAT_FIELDS, compat_values
from ncclguard.fingerprint.fields import active_ports
from ncclguard.policy.rules import RULES
from ncclguard.policy.settings import severity_of

#: Fields that identify one node or one collection; they are never compared.
_SKIP = re.compile(
    r"^(host\.(hostname|collected_at|boot_id|tool_version)$|errors\b|nccl_conf\.raw$)"
    r"|\.addresses$|\.node_guid$"
)

#: (pattern on the field name, rule): each rule's ``fields``. The patterns do not overlap.
_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r.name) for r in RULES for p in r.fields
)

#: Severity shown for a difference that no rule looks at.
INFO = "info"
_SEVERITY_ORDER = {"refuse": 0, "warn": 1, "ignore": 2, INFO: 3}


def compared(name: str) -> bool:
    """Whether a difference in field ``name`` means anything (not per-node identity)."""
    return not _SKIP.search(name)


def rule_for(name: str) -> str | None:
    """The policy rule a difference in field ``name`` triggers, or ``None``."""
    for pat, rule in _RULES:
        if pat.search(name):
            return rule
    return None


def severity_for(rule: str | None, config: PolicyConfig | None = None) -> str:
    """The configured severity of ``rule`` (``info`` for a field no rule looks at)."""
    if rule is None:
        return INFO
    return severity_of(config or PolicyConfig(), rule)


def derived(fp: Mapping[str, Any]) -> dict[str, Any]:
    """The values the refuse-level rules compare, as fields ``compat.*``, and active ports."""
    values = compat_values(dict(fp))
    out = {f"compat.{k}": v for k, v in values.items()}
    out["rdma.active_ports"] = active_ports(dict(fp))
    return out


#: The fields of :func:`derived`.
DERIVED = frozenset({*(f"compat.{k}" for k in COMPAT_FIELDS), "rdma.active_ports"})


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


def pair(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``[(field, value in a, value in b)]``: derived fields first, then the raw ones."""
    da, db = derived(a), derived(b)
    out = [(k, da.get(k), db.get(k)) for k in dict.fromkeys([*da, *db]) if da.get(k) != db.get(k)]
    for d in fingerprint_diff(dict(a), dict(b)):
        if compared(d["field"]):
            out.append((d["field"], d["old"], d["new"]))
    return out


def diff(
    fingerprints: Mapping[str, Mapping[str, Any]],
    config: PolicyConfig | None = None,
    *,
    include_info: bool = True,
) -> Diff:
    """The fields that differ across ``{host: fingerprint}`` (two hosts or more).

    Each difference names the values with the hosts that hold them, the rule it
    triggers and that rule's configured severity. Sorted worst first, then by field.
    Every host is compared with the first one, so the cost is linear in the hosts.
    """
    hosts = list(fingerprints)
    result = Diff(hosts=hosts)
    if len(hosts) < 2:
        return result
    ref = hosts[0]
    ref_fp = fingerprints[ref]
    ref_value: dict[str, Any] = {}
    changed: dict[str, dict[str, Any]] = {}  # field -> {host: value} where not as on ref
    for h in hosts[1:]:
        for name, old, new in pair(ref_fp, fingerprints[h]):
            ref_value.setdefault(name, old)
            changed.setdefault(name, {})[h] = new
    errs = {h: errored_fields(fp) for h, fp in fingerprints.items()}
    for name, per_host in changed.items():
        groups: dict[Any, tuple[Any, list[str]]] = {}
        unknown: list[str] = []
        for h in hosts:
            v = per_host[h] if h in per_host else ref_value[name]
            # a derived value (compat.*, rdma.active_ports) of None is unknown by definition
            if v is None and (name in DERIVED or _is_errored(name, errs[h])):
                unknown.append(h)
                continue
            groups.setdefault(_freeze(v), (v, []))[1].append(h)
        rule = rule_for(name)
        if not include_info and rule is None:
            continue
        fd = FieldDiff(
            field=name,
            values=tuple((v, tuple(hs)) for v, hs in groups.values()),
            rule=rule,
            severity=severity_for(rule, config),
            unknown_on=tuple(unknown),
        )
        (result.differences if len(groups) > 1 else result.unknown).append(fd)
    result.differences.sort(key=lambda d: (_SEVERITY_ORDER.get(d.severity, 9), d.field))
    result.unknown.sort(key=lambda d: d.field)
    return result
