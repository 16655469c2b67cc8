"""The compatibility policy: pure functions from fingerprints (or their derived values) to
a :class:`Verdict`, and the decisions that several commands share.

- :mod:`.rules`: one module per rule family; each :class:`~.rules.base.Rule` carries its
  name, default severity, the fingerprint fields it reads and its ``[baseline]`` keys.
- :mod:`.evaluation`: :func:`evaluate` (classes, findings, odd nodes), :func:`node_values`
  and :data:`GATE_VALUES` (what the store keeps for the gate).
- :mod:`.ownstack`: :func:`evaluate_image`, :func:`evaluate_nccl` and :func:`evaluate_env`
  (a job's own ``NCCL_*`` variables, :mod:`.jobvars`), jobs that bring their
  own NCCL (an image, a virtualenv, a conda env, a module).
- :mod:`.verdict`: the :class:`Verdict` and its findings.
- :mod:`.tiebreak`: :func:`break_tie`, the one tie-break for odd nodes.
- :mod:`.settings`: :func:`load_config`, :func:`severity_of`.
- :mod:`.baseline`: :func:`~.baseline.choose_baseline`, the one baseline class.
- :mod:`.fpdiff`: field differences between fingerprints, each with its rule.
- :mod:`.freshness`: whether a heartbeat is current (:func:`stale_hosts`).
- :mod:`.drain`: drain recommendations.

Standard library only on the gate's path (this package's ``__init__`` and what it imports).
"""

from ncclguard.policy.evaluation import (
    GATE_VALUES,
    NODE_VALUES,
    evaluate,
    evaluate_values,
    in_scope,
    node_values,
    odd_nodes,
    partitions_of,
    valid_values,
)
from ncclguard.policy.freshness import heartbeat_state, is_stale, stale_hosts
from ncclguard.policy.ownstack import evaluate_env, evaluate_image, evaluate_nccl
from ncclguard.policy.settings import DEFAULT_SEVERITY, load_config, severity_of
from ncclguard.policy.tiebreak import break_tie, majority
from ncclguard.policy.verdict import Finding, Verdict

__all__ = [
    "DEFAULT_SEVERITY",
    "GATE_VALUES",
    "NODE_VALUES",
    "Finding",
    "Verdict",
    "break_tie",
    "evaluate",
    "evaluate_env",
    "evaluate_image",
    "evaluate_nccl",
    "evaluate_values",
    "heartbeat_state",
    "in_scope",
    "is_stale",
    "load_config",
    "majority",
    "node_values",
    "odd_nodes",
    "partitions_of",
    "severity_of",
    "stale_hosts",
    "valid_values",
]
