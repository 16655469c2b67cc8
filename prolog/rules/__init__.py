"""The policy's rules: one module per rule family.

- :mod:`.nccl_version` (nccl-version), :mod:`.net_plugin` (net-plugin),
  :mod:`.transport` (transport), :mod:`.nccl_conf` (nccl-conf),
- :mod:`.rdma` (rdma-rate, rdma-port-count, rdma-firmware),
- :mod:`.gpu` (gpu-driver, gpudirect), :mod:`.unknown_node` (unknown-node).

:data:`COMPARISONS` lists every rule that compares values between nodes, in the order
findings are reported; ``unknown-node`` is about missing records and stands apart.
"""

from __future__ import annotations

from prolog.rules import gpu, nccl_conf, nccl_version, net_plugin, rdma, transport, unknown_node
from prolog.rules.base import Rule

COMPARISONS: tuple[Rule, ...] = (
    nccl_version.RULE,
    net_plugin.RULE,
    transport.RULE,
    nccl_conf.RULE,
    rdma.RATE,
    rdma.PORT_COUNT,
    rdma.FIRMWARE,
    gpu.DRIVER,
    gpu.GPUDIRECT,
)

__all__ = ["COMPARISONS", "Rule", "unknown_node"]
