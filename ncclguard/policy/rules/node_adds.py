"""node-adds: the plugins a node adds to a job's NCCL, whatever release the job brings
(issue 39).

Most multi-node jobs load their own NCCL (a pip wheel, a conda env, a module), not the
node's ``libnccl.so.2``; many nodes have none. What the node adds to such a job is what
its plugins give that job's release: the library each kind (net, tuner, profiler, env,
GIN, RMA) would load and the ABI it would use, release by release
(:mod:`ncclguard.fingerprint.offers`, the ``offers`` part). Two nodes that would give some
release of the table (:data:`ncclguard.fingerprint.releases.RELEASES`) another plugin, or
another ABI of it, differ for a job of that release: a net plugin on some nodes only
hangs the job (NVIDIA/nccl#1634; docs/nccl.md, "Plugins NCCL loads"). Refuse by default.

The net and env plugins refuse (a job's ranks would use another network, or read other
variables); the tuner, profiler, GIN and RMA only warn, as the host's own tuner and
gin-rma rules do by default, and do not split classes. A library that some release opens
but no release of the table can use changes nothing for a job: a warning too, as the
net-plugin rule does for a plugin the host's libnccl ignores. The node's own transport
without a plugin (IB, RoCE, Socket) is the transport rule's.
"""

from __future__ import annotations

from collections.abc import Mapping

from ncclguard.fingerprint import offers
from ncclguard.policy.rules.base import Rule, Values, check_rule
from ncclguard.policy.verdict import Finding

NAME = "node-adds"
_PLUGIN, _UNUSED = " plugin", " plugin no release uses"
#: the kinds whose difference refuses; the others warn (module doc)
REFUSING = ("net", "env")


def values(fp: dict) -> Values:
    out: Values = {}
    for kind, (used, unused) in offers.by_kind(fp).items():
        out[kind + _PLUGIN] = used
        out[kind + _UNUSED] = unused
    return out


def _kind(aspect: str) -> str:
    return aspect.split(" ", 1)[0]


def label(aspect: str, value: str) -> str:
    if aspect.endswith(_UNUSED):
        return f"{_kind(aspect)} plugin {value}"
    used = offers.parse(value)
    if not used:
        return f"{_kind(aspect)} plugin none"
    return f"{_kind(aspect)} plugin {offers.summary(value)} (NCCL {offers.span(list(used))})"


def explain(aspect: str, found: list[str]) -> str:
    kind = _kind(aspect)
    if aspect.endswith(_UNUSED):
        return (f"a {kind} plugin that no NCCL release ncclguard knows can use is installed on "
                "some nodes (no job loads it)")
    releases = offers.span(offers.differing(found))
    if offers.NONE in found:
        return (f"a job's NCCL ({releases}, of the releases ncclguard knows) would use a "
                f"{kind} plugin on some nodes only: the job may hang or fail")
    return (f"a job's NCCL ({releases}, of the releases ncclguard knows) would use another "
            f"{kind} plugin or ABI on some nodes: the job may hang or fail")


def message(aspect: str) -> str:
    """Without the values: what the aspect is about (findings use :func:`explain`)."""
    kind = _kind(aspect)
    if aspect.endswith(_UNUSED):
        return f"a {kind} plugin that no NCCL release ncclguard knows can use"
    return f"the {kind} plugin a job's own NCCL would use differs between nodes"


RULE = Rule(
    NAME,
    values,
    message,
    label=label,
    warn_only=(*(k + _UNUSED for k in offers.KINDS),
               *(k + _PLUGIN for k in offers.KINDS if k not in REFUSING)),
    severity="refuse",
    fields=(r"^offers\.",),
    explain=explain,
)


def check(fingerprints: Mapping[str, dict], severity: str = RULE.severity) -> list[Finding]:
    """Findings of node-adds over ``{host: fingerprint}``."""
    return check_rule(RULE, fingerprints, severity)
