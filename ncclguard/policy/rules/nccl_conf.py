"""nccl-conf: ``NCCL_*`` settings of ``/etc/nccl.conf`` that differ between nodes.

NCCL fact (docs/nccl.md, "Config files"): ``/etc/nccl.conf`` is read on every rank
and applied where the environment does not set the variable, so a setting on some nodes
only makes ranks behave differently. The settings that choose the transport
(``NCCL_IB_HCA``, ``NCCL_IB_DISABLE``, ``NCCL_NET``, ``NCCL_SOCKET_IFNAME``) are judged by
their effect, in the transport rule, not by their text.
"""

from __future__ import annotations

from collections.abc import Mapping

from ncclguard.fingerprint.fields import nccl_settings
from ncclguard.fingerprint.transport import TRANSPORT_SETTINGS
from ncclguard.policy.rules.base import ANY, Rule, Values, check_rule
from ncclguard.policy.verdict import Finding

NAME = "nccl-conf"
UNSET = "unset"


def values(fp: dict) -> Values:
    settings = nccl_settings(fp)
    if settings is None:
        return {ANY: None}
    out: Values = {ANY: UNSET}
    for key, value in settings.items():
        if key.startswith("NCCL_") and key not in TRANSPORT_SETTINGS:
            out[key] = value
    return out


def label(aspect: str, value: str) -> str:
    return f"{aspect} unset" if value == UNSET else f"{aspect}={value}"


def message(aspect: str) -> str:
    return f"{aspect} in /etc/nccl.conf differs between nodes"


RULE = Rule(NAME, values, message, label=label, fields=(r"^nccl_conf\.",))


def check(fingerprints: Mapping[str, dict], severity: str = RULE.severity) -> list[Finding]:
    """Findings of nccl-conf over ``{host: fingerprint}``."""
    return check_rule(RULE, fingerprints, severity)
