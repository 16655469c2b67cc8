"""env-plugin, gin-rma, tuner: the plugins other than net that NCCL loads (2.19 to 2.32).

Each reads ``effective.<kind>`` through :func:`ncclguard.fingerprint.fields.plugin_in_force`:
the plugin NCCL loads for that kind (its own library, or the net plugin's library it
falls back to: the rules of each release are ``ncclguard/fingerprint/loading.py``) and
the highest ABI it shares with the node's libnccl (docs/fingerprint.md, "Plugin kinds by
NCCL"). As for the net plugin, a file
that shares no ABI with the libnccl is the same, for the job, as none: only a warning
that something NCCL ignores is installed. A different build (sha256) under the same name
and ABI is a warning.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ncclguard.fingerprint.fields import ABSENT, plugin_in_force, plugin_record
from ncclguard.policy.rules.base import Rule, Values, check_rule
from ncclguard.policy.verdict import Finding

_LABELS = {"env": "env plugin", "gin": "GIN plugin", "rma": "RMA plugin", "tuner": "tuner"}


def kind_values(fp: dict, kind: str) -> Values:
    """``{"<kind> plugin": "NAME vN" | "none", "... sha256": ..., "... ignored by NCCL": ...}``;
    ``None`` where unknown."""
    label = _LABELS[kind]
    plugin, sha_key, ignored = label, f"{label} sha256", f"{label} ignored by NCCL"
    state = plugin_in_force(fp, kind)
    if state is None:
        return {plugin: None, sha_key: None, ignored: None}
    name, abi = state
    if name == ABSENT:
        return {plugin: ABSENT, sha_key: ABSENT, ignored: ABSENT}
    if not abi:
        return {plugin: ABSENT, sha_key: ABSENT, ignored: f"{name} (no common ABI)"}
    eff = fp.get("effective") or {}
    entry = plugin_record(fp, (eff.get(kind) or {}).get("plugin")) or {}
    sha = entry.get("sha256")
    return {plugin: f"{name} v{abi}", sha_key: sha[:12] if isinstance(sha, str) else None,
            ignored: ABSENT}


def _warn_only(kind: str) -> tuple[str, str]:
    label = _LABELS[kind]
    return (f"{label} sha256", f"{label} ignored by NCCL")


def _message(kind: str, differs: str) -> Callable[[str], str]:
    label = _LABELS[kind]

    def message(aspect: str) -> str:
        if aspect.endswith("sha256"):
            return f"the {label} is a different build on some nodes (same name and ABI)"
        if aspect.endswith("ignored by NCCL"):
            return f"a {label} that NCCL ignores (no common ABI) is installed on some nodes"
        return differs

    return message


# ---- env-plugin ------------------------------------------------------------------------

ENV_NAME = "env-plugin"


def env_values(fp: dict) -> Values:
    return kind_values(fp, "env")


#: env-plugin: an env plugin on some nodes only, or different ones.
#:
#: NCCL fact (``src/plugin/env.cc`` and ``src/misc/param.cc`` at v2.30.7-1; 2.28.x
#: loads ``ncclEnvPlugin_v1``; docs/nccl.md, "The env plugin"): the env plugin
#: (``libnccl-env.so``, or what ``NCCL_ENV_PLUGIN`` names, which ``/etc/nccl.conf`` can
#: set) replaces how NCCL reads **every** ``NCCL_*``
#: variable, ``/etc/nccl.conf`` included. It can therefore set, per node and invisibly
#: to this fingerprint, what the refuse-level rules judge: ``NCCL_NET_PLUGIN`` (a net
#: plugin on some nodes only hangs the job), ``NCCL_IB_HCA``/``NCCL_IB_DISABLE``/
#: ``NCCL_NET`` (IB meeting Socket fails with "wrong type" or hangs), as well as
#: ``NCCL_PROTO``/``NCCL_ALGO``. A difference in it is at least as strong as any
#: ``nccl-conf`` difference (warn) and can hide a ``net-plugin`` or ``transport`` one
#: (refuse); what it returns is code, not a file ncclguard can read. So: **refuse** by
#: default, and it is part of the compatibility key. A different build under the same
#: name and ABI stays a warning, as for the net plugin.
ENV = Rule(
    ENV_NAME,
    env_values,
    _message("env", "the env plugin differs (missing, other name or other ABI): it decides "
                    "every NCCL_* variable, /etc/nccl.conf included, on its nodes"),
    warn_only=_warn_only("env"),
    severity="refuse",
    fields=(r"^compat\.env_plugin$", r"^effective\.env\.(?!reason$)"),
    baseline_keys=("env_plugin",),
)


# ---- gin-rma ---------------------------------------------------------------------------

GIN_RMA_NAME = "gin-rma"


def gin_rma_values(fp: dict) -> Values:
    return {**kind_values(fp, "gin"), **kind_values(fp, "rma")}


def _gin_rma_message(aspect: str) -> str:
    kind = "gin" if aspect.startswith("GIN") else "rma"
    return _message(kind, f"the {_LABELS[kind]} differs between nodes: NCCL ANDs "
                    "GIN/RMA support across ranks, so the job runs without it (a job "
                    "that needs it fails)")(aspect)


#: gin-rma: GIN (``ncclGinPlugin_vN``, 2.28+) and RMA (``ncclRmaPlugin_vN``, 2.30.7+)
#: plugins that differ between nodes.
#:
#: NCCL fact (``src/init.cc`` at v2.30.7-1, lines 1062/1064: ``globalGinSupport &=
#: (peerInfo[i].supportedGinType == ...)``, ``globalRmaPluginSupport &=
#: peerInfo[i].rmaPluginAvailable``): support is ANDed across ranks, so a mix turns
#: the feature off for the whole job rather than hanging it; a job that needs GIN or RMA
#: then fails. **warn** by default.
GIN_RMA = Rule(
    GIN_RMA_NAME,
    gin_rma_values,
    _gin_rma_message,
    warn_only=(*_warn_only("gin"), *_warn_only("rma")),
    severity="warn",
    fields=(r"^effective\.(gin|rma)\.(?!reason$)",),
)


# ---- tuner -----------------------------------------------------------------------------

TUNER_NAME = "tuner"


def tuner_values(fp: dict) -> Values:
    return kind_values(fp, "tuner")


#: tuner: nodes with and without a tuner plugin, or with different ones.
#:
#: NCCL fact (``src/enqueue.cc`` at v2.30.7-1, line 2147: each rank calls
#: ``comm->tuner->getCollInfo`` on its own cost table, and no answer is exchanged
#: between ranks): nodes with and without a tuner (its own ``libnccl-tuner.so``, or the
#: one in the net plugin's library from 2.21), or with different tuners, can pick
#: different algorithms or protocols for the same collective. **warn** by default.
TUNER = Rule(
    TUNER_NAME,
    tuner_values,
    _message("tuner", "the tuner plugin differs between nodes: each rank asks its own tuner "
                      "and nothing exchanges the answer, so ranks can pick different "
                      "algorithms or protocols for one collective"),
    warn_only=_warn_only("tuner"),
    severity="warn",
    fields=(r"^effective\.tuner\.(?!reason$)",),
)


def check(rule: Rule, fingerprints: Mapping[str, dict],
          severity: str | None = None) -> list[Finding]:
    """Findings of one of these rules over ``{host: fingerprint}``."""
    return check_rule(rule, fingerprints, severity or rule.severity)
