"""transport: each node's effective NCCL transport (plugin name, IB, RoCE, Socket) must be
the same.

NCCL fact (docs/nccl.md, "Which transport a node ends up on"): nothing in NCCL
compares the chosen transport across ranks. A node on IB meeting a node on Socket fails
with ``socketFinalizeAccept: wrong type 4 != 3``, or hangs. The derivation (ACTIVE ports,
link layer, IP interface, ``NCCL_IB_HCA`` / ``NCCL_IB_DISABLE`` / ``NCCL_NET``) is in
:mod:`ncclguard.fingerprint.transport`.
"""

from __future__ import annotations

from collections.abc import Mapping

from ncclguard.fingerprint.transport import effective_transport
from ncclguard.policy.rules.base import Rule, Values, check_rule
from ncclguard.policy.verdict import Finding

NAME = "transport"


def values(fp: dict) -> Values:
    return {"transport": effective_transport(fp)}


def message(aspect: str) -> str:
    return "nodes would use different NCCL transports: the job fails or hangs at connect"


RULE = Rule(
    NAME,
    values,
    message,
    severity="refuse",
    fields=(
        r"^compat\.transport$",
        r"^rdma\.devices\[[^\]]*\]\.ports\[[^\]]*\]\.link_layer$",
    ),
    baseline_keys=("transport",),
)


def check(fingerprints: Mapping[str, dict], severity: str = RULE.severity) -> list[Finding]:
    """Findings of transport over ``{host: fingerprint}``."""
    return check_rule(RULE, fingerprints, severity)
