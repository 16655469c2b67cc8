"""The policy's rules: one module per rule family.

- :mod:`.nccl_version` (nccl-version), :mod:`.net_plugin` (net-plugin),
  :mod:`.node_adds` (node-adds: the plugins a node adds to any release's NCCL),
  :mod:`.transport` (transport), :mod:`.nccl_conf` (nccl-conf),
- :mod:`.rdma` (rdma-rate, rdma-port-count, rdma-firmware),
- :mod:`.gpu` (gpu-driver, gpudirect), :mod:`.unknown_node` (unknown-node),
- :mod:`.plugin_kinds` (env-plugin, gin-rma, tuner),
- :mod:`.container` (image-stack, image-unknown: jobs in a container image),
- :mod:`.jobnccl` (job-stack, job-nccl-unknown: jobs that bring their own NCCL; job-vars:
  a job's NCCL variables whose effect the records cannot tell).

:data:`COMPARISONS` lists every rule that compares values between nodes, in the order
findings are reported; ``unknown-node`` is about missing records and stands apart.
:data:`RULES` lists them all, each with its name, default severity and fields.
"""

from __future__ import annotations

from ncclguard.policy.rules import (
    container,
    gpu,
    jobnccl,
    nccl_conf,
    nccl_version,
    net_plugin,
    node_adds,
    plugin_kinds,
    rdma,
    transport,
    unknown_node,
)
from ncclguard.policy.rules.base import Rule

COMPARISONS: tuple[Rule, ...] = (
    nccl_version.RULE,
    net_plugin.RULE,
    node_adds.RULE,
    plugin_kinds.ENV,
    transport.RULE,
    nccl_conf.RULE,
    plugin_kinds.TUNER,
    plugin_kinds.GIN_RMA,
    rdma.RATE,
    rdma.PORT_COUNT,
    rdma.FIRMWARE,
    gpu.DRIVER,
    gpu.GPUDIRECT,
)

#: Every rule, comparisons first and then ``unknown-node``: the one list of rule names,
#: default severities and fields that the config check, ``diff``/``history``, the
#: baseline and the diagnose catalog read.
RULES: tuple[Rule, ...] = (*COMPARISONS, unknown_node.RULE, container.STACK_RULE,
                           container.UNKNOWN_RULE, jobnccl.STACK_RULE, jobnccl.UNKNOWN_RULE,
                           jobnccl.VARS_RULE)
BY_NAME: dict[str, Rule] = {r.name: r for r in RULES}

__all__ = ["BY_NAME", "COMPARISONS", "RULES", "Rule", "container", "unknown_node"]
