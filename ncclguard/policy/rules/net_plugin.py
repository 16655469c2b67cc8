"""net-plugin: the default net plugin must be present on all nodes or on none, and give the
same effective ABI and name with each node's libnccl; a different sha256 with the same ABI
is a warning.

NCCL fact (docs/nccl.md, "Plugins NCCL loads"): NCCL loads ``libnccl-net.so`` by
default and uses the highest ``ncclNetPlugin_vN`` that both it and the plugin know; with
none in common it falls back to its internal transports. A plugin present on only some
nodes hangs the job with no error. A plugin that shares no ABI with the node's libnccl
is therefore the same, for the job, as no plugin at all: that difference is only worth a
warning (the admin installed something NCCL ignores).
"""

from __future__ import annotations

from collections.abc import Mapping

from ncclguard.fingerprint.fields import ABSENT, nccl_version, net_plugin
from ncclguard.policy.rules.base import Rule, Values, check_rule
from ncclguard.policy.verdict import Finding

NAME = "net-plugin"
PLUGIN = "net plugin"
SHA = "net plugin sha256"
IGNORED = "net plugin ignored by NCCL"


def values(fp: dict) -> Values:
    state = net_plugin(fp)
    if state is None:
        return {PLUGIN: None, SHA: None, IGNORED: None}
    name, abi = state
    if name == ABSENT or nccl_version(fp) == ABSENT:
        # no plugin, or no host libnccl to load it: what the node adds to a job's own
        # NCCL is node-adds' (issue 39), not a plugin "ignored" by a libnccl not there
        return {PLUGIN: ABSENT, SHA: ABSENT, IGNORED: ABSENT}
    if not abi:  # no common ABI: NCCL closes it and uses its own transports
        return {PLUGIN: ABSENT, SHA: ABSENT, IGNORED: f"{name} (no common ABI)"}
    main = f"{name} v{abi}"
    sha = None
    for p in fp.get("plugins") or ():
        if p.get("kind") == "net" and p.get("default"):
            sha = p.get("sha256")
            break
    return {PLUGIN: main, SHA: sha[:12] if isinstance(sha, str) else None, IGNORED: ABSENT}


def message(aspect: str) -> str:
    if aspect == SHA:
        return "the net plugin is a different build on some nodes (same name and ABI)"
    if aspect == IGNORED:
        return "a net plugin that NCCL ignores (no common ABI) is installed on some nodes"
    return "the net plugin differs (missing, other name or other ABI): the job may hang"


RULE = Rule(
    NAME,
    values,
    message,
    warn_only=(SHA, IGNORED),
    severity="refuse",
    fields=(r"^compat\.(net_plugin|net_abi)$", r"^net\.(?!reason$)"),
    baseline_keys=("net_plugin", "net_abi"),
)


def check(fingerprints: Mapping[str, dict], severity: str = RULE.severity) -> list[Finding]:
    """Findings of net-plugin over ``{host: fingerprint}``."""
    return check_rule(RULE, fingerprints, severity)
