"""job-stack and job-nccl-unknown: a job that brings its own NCCL (issue 40).

A job from a pip virtualenv, a conda env or a module loads its own ``libnccl.so.2``
(:mod:`ncclguard.fingerprint.jobenv` finds which), not the node's. Its verdict is that
NCCL against what each node adds for it, as for a container image
(:mod:`ncclguard.policy.rules.container`): on each node, the net plugin that the job's
release opens there (the ``offers`` part's row for the nearest release of the table,
:func:`ncclguard.fingerprint.offers.release_for`), used at the highest ABI both the job's
library and the plugin know, or, with none in common, NCCL's own transport of that node.
Nodes that end up on different stacks hang the job.

- **job-stack** (refuse by default): the job's NCCL cannot use the plugin on some nodes
  (it falls back there), or the nodes would use different transports.
- **job-nccl-unknown** (warn by default): the job names a libnccl that cannot be read,
  or nodes whose records do not say what they offer (a daemon before issue 39).
- **job-vars** (warn by default): the job sets an ``NCCL_*`` variable whose effect on
  some nodes their records cannot tell (:mod:`ncclguard.policy.jobvars`); those nodes
  are judged by their own settings. Any job, with its own NCCL or the host's.

The host's own libnccl, and what it does with the node's plugins, is not what such a job
loads: :data:`HOST_RULES` are not applied to it. ``/etc/nccl.conf``, the RDMA and GPU
rules and unknown-node are.
"""

from __future__ import annotations

from collections.abc import Mapping

from ncclguard.policy.rules import container
from ncclguard.policy.rules.base import Rule, Values
from ncclguard.policy.verdict import Finding

STACK = "job-stack"
UNKNOWN = "job-nccl-unknown"
VARS = "job-vars"
#: Rules about what the host's libnccl does: a job with its own NCCL does not load it
#: (node-adds judges any release; job-stack this job's). The container rules' set but
#: nccl-conf: a job on the host reads the node's /etc/nccl.conf, a container does not.
HOST_RULES = container.HOST_RULES - {"nccl-conf"}


def _none(fp: dict) -> Values:
    return {}  # not a comparison of node values: the job's NCCL is judged on each node


STACK_RULE = Rule(STACK, _none, lambda _: "the job's own NCCL meets different stacks",
                  severity="refuse")
UNKNOWN_RULE = Rule(UNKNOWN, _none, lambda _: "the job's own NCCL cannot be checked")
VARS_RULE = Rule(VARS, _none, lambda _: "the job's NCCL variables cannot be applied")


def job_records(records: Mapping[str, dict | None], release: str
                ) -> dict[str, dict | None]:
    """Each node's record as :func:`ncclguard.policy.rules.container.check_stack` reads
    it: the net plugin the job's ``release`` opens there (``injected``: ``"NAME|8,7,6"``,
    ``""`` for none, None when the record does not say) and the node's own transport."""
    from ncclguard.fingerprint.offers import NONE, parse

    out: dict[str, dict | None] = {}
    for host, rec in records.items():
        if rec is None:
            out[host] = None
            continue
        job, container = rec.get("job"), rec.get("container")
        value = job.get("net") if isinstance(job, dict) else None
        internal = container.get("internal") if isinstance(container, dict) else None
        injected = None if value is None else (
            "" if value == NONE else parse(value).get(release, ""))
        out[host] = {"container": {"injected": injected, "internal": internal}}
    return out


def unknown_finding(subject: str, why: str, hosts: list[str], severity: str) -> Finding:
    return Finding.from_hosts(UNKNOWN, severity, f"{subject} cannot be checked: {why}",
                              [(why, hosts)])


def vars_finding(unapplied: list[tuple[str, list[str]]], severity: str) -> Finding:
    """The job-vars finding of :class:`ncclguard.policy.jobvars.Applied`'s ``unapplied``
    (``(why, hosts)``: each why names the variable and its value)."""
    return Finding.from_hosts(VARS, severity, "the job's NCCL variables: their effect on "
                              "some nodes is not known, those are judged by their own "
                              "settings", unapplied)
