"""Verdicts of jobs that bring their own NCCL: in a container image (issue 15) or from
their environment, a pip virtualenv, a conda env, a module (issue 40).

Both judge the job's NCCL on each node against what the node adds for it, instead of the
host's libnccl (docs/containers.md, docs/jobs.md), and both fall back to what holds for
any NCCL when the job's library cannot be read. Pure, like
:mod:`ncclguard.policy.evaluation`, whose :func:`evaluate_values` they build on.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from ncclguard.config import PolicyConfig
from ncclguard.policy.evaluation import evaluate_values, in_scope
from ncclguard.policy.rules import COMPARISONS
from ncclguard.policy.settings import severity_of
from ncclguard.policy.verdict import SEVERITY_RANK, Finding, Verdict

__all__ = ["evaluate_env", "evaluate_image", "evaluate_nccl"]


def evaluate_image(
    records: Mapping[str, dict | None],
    config: PolicyConfig,
    ref: str,
    image: tuple[dict | None, str | None] | None,
    stale: Collection[str] = (),
    partition: str | None = None,
    prefer: Collection[str] = (),
) -> Verdict:
    """The verdict for a job that runs in the container image ``ref`` (docs/containers.md).

    ``image``: the inventory's read of the image (``Inventory.load_image_values``): None
    when it is not indexed, else ``(values, error)``. For an image that can be checked the
    host-stack rules (``container.HOST_RULES``) are not applied: the job loads the image's
    libnccl. The others (RDMA, GPU, unknown-node) are, and ``image-stack`` compares each
    node's effective stack. An image that cannot be checked (a registry reference, a
    ``./`` path, not indexed, unreadable, no libnccl found) is ``image-unknown``, and the
    nodes are compared by their own stacks (all rules but ``nccl-version``): a mix that
    the nodes alone show is not let through because the image is unknown.
    """
    from ncclguard.policy.rules import container

    skip = _out_of_scope(records, config, partition)
    if skip is not None:
        return skip
    hosts = sorted(records)
    unknown_sev, stack_sev = _severities(config, container.UNKNOWN, container.STACK)
    why = None
    path = container.is_path_image(ref)
    if path and ref.startswith("."):
        why = ("a path relative to the step's working directory, where pyxis reads it when "
               "the step starts: the gate cannot know which file that is; give an "
               "absolute path")
    elif image is None:
        why = ("not in the image index (not under [images] roots, or not scanned yet)" if path
               else "a registry reference the collector has not resolved yet ([registry] "
               "enabled, and refs or a job that used it: it is resolved at the next pass)")
    elif image[0] is None:
        why = f"unreadable: {image[1]}" if path else str(image[1])
    elif not container.checkable(image[0]):
        why = "no libnccl the job would load was found in it (static, or off its paths)"
    sev = {r.name: severity_of(config, r.name) for r in COMPARISONS}
    if why is None:
        # the job loads the image's libnccl: the host's stack is not compared
        judged = config.replace(severity={**sev,
                                          **dict.fromkeys(container.HOST_RULES, "ignore")})
    else:
        # an image that cannot be read is judged by what the nodes alone show: their
        # plugins, transports and NCCL settings still differ for any image, and a job
        # on mixed nodes is not let through because its image is unknown (only the
        # host's libnccl version says nothing about the container's)
        judged = config.replace(severity={**sev, "nccl-version": "ignore"})
    base = evaluate_values(records, judged, stale, partition, prefer)
    findings = list(base.findings)
    odd = set(base.odd_nodes)
    if why is not None:
        if unknown_sev != "ignore":
            findings.append(container.unknown_finding(ref, why, hosts, unknown_sev))
    elif image is not None and image[0] is not None and stack_sev != "ignore":
        known = {h: r for h, r in records.items() if r is not None}
        _add_stack(container.check_stack(ref, image[0], known, stack_sev), findings, odd,
                   stack_sev, lambda unsaid: None if unknown_sev == "ignore" else
                   container.unknown_finding(
                       ref, "these nodes' records do not say what they inject into "
                       "containers (their containers probe could not tell, `ncclguard show "
                       "NODE` says why; or a node daemon before issue 15)", unsaid,
                       unknown_sev))
    notes = [*base.notes, (f"container image {ref}: the job loads the image's libnccl, so "
                           "the host's NCCL stack is not compared") if why is None else
             (f"container image {ref} cannot be checked ({why}): the nodes' own stacks are "
              "compared, without the host's libnccl version")]
    return _verdict(findings, odd, hosts, notes, partition, base.odd_tie)


def _add_stack(got: tuple[list[Finding], list[str], list[str]], findings: list[Finding],
               odd: set[str], stack_sev: str,
               unsaid_finding: Callable[[list[str]], Finding | None]) -> None:
    """Take one stack comparison's ``(findings, odd, nodes that do not say)`` into the
    verdict's: its odd nodes only where it refuses, and a finding for the silent nodes."""
    found, stack_odd, unsaid = got
    findings.extend(found)
    if stack_sev == "refuse":
        odd.update(stack_odd)
    extra = unsaid_finding(unsaid) if unsaid else None
    if extra is not None:
        findings.append(extra)


def _out_of_scope(records: Mapping[str, dict | None], config: PolicyConfig,
                  partition: str | None) -> Verdict | None:
    """An accept with the note why, for an allocation the policy does not check."""
    note = in_scope(config, partition, len(records))
    return None if note is None else Verdict("accept", nodes=list(records), notes=[note],
                                             partition=partition)


def _severities(config: PolicyConfig, unknown: str, stack: str) -> tuple[str, str]:
    return severity_of(config, unknown), severity_of(config, stack)


def _verdict(findings: list, odd: set[str], hosts: list[str], notes: list[str],
             partition: str | None, tie: bool) -> Verdict:
    """The verdict of these findings: the worst severity decides; odd nodes only when
    refused."""
    findings.sort(key=lambda f: -SEVERITY_RANK[f.severity])
    worst = max((SEVERITY_RANK[f.severity] for f in findings), default=0)
    decision = ("accept", "warn", "refuse")[worst]
    return Verdict(decision, findings, sorted(odd) if decision == "refuse" else [], hosts,
                   notes, partition=partition, odd_tie=tie)


def evaluate_env(
    records: Mapping[str, dict | None],
    config: PolicyConfig,
    variables: Mapping[str, str],
    stale: Collection[str] = (),
    partition: str | None = None,
    prefer: Collection[str] = (),
) -> Verdict:
    """The verdict for a job on the host's NCCL whose environment sets ``variables``
    (its ``NCCL_*`` ones are applied to each node: :mod:`ncclguard.policy.jobvars`);
    without any, :func:`evaluate_values`'s."""
    from ncclguard.policy.jobvars import apply

    skip = _out_of_scope(records, config, partition)
    if skip is not None:
        return skip
    applied = apply(records, variables)
    base = evaluate_values(applied.records, config, stale, partition, prefer)
    if not applied.unapplied and not applied.notes:
        return base
    findings = list(base.findings)
    _vars_findings(applied.unapplied, config, findings)
    return _verdict(findings, set(base.odd_nodes), sorted(records),
                    [*base.notes, *applied.notes], partition, base.odd_tie)


def _vars_findings(unapplied: list[tuple[str, list[str]]], config: PolicyConfig,
                   findings: list[Finding]) -> None:
    from ncclguard.policy.rules import jobnccl

    sev = severity_of(config, jobnccl.VARS)
    if unapplied and sev != "ignore":
        findings.append(jobnccl.vars_finding(unapplied, sev))


def evaluate_nccl(
    records: Mapping[str, dict | None],
    config: PolicyConfig,
    job: Mapping[str, Any] | None,
    why: str | None = None,
    stale: Collection[str] = (),
    partition: str | None = None,
    prefer: Collection[str] = (),
    variables: Mapping[str, str] | None = None,
) -> Verdict:
    """The verdict for a job that loads its own libnccl (issue 40, docs/jobs.md).

    ``job``: what that library is (``{"nccl_version", "net_abis", "path", "source"}``,
    from ``ncclguard-inventoryd read-nccl`` and :func:`ncclguard.fingerprint.jobenv.locate`);
    None with ``why`` when it cannot be read. A job whose NCCL is known is judged by it
    on each node (``job-stack``), without the host-stack rules
    (:data:`ncclguard.policy.rules.jobnccl.HOST_RULES`); one whose NCCL cannot be read by
    every rule, node-adds included (what holds for any NCCL), with ``job-nccl-unknown``.
    The job's ``NCCL_*`` ``variables`` are applied to each node
    (:mod:`ncclguard.policy.jobvars`): for the job's release when its NCCL is known.
    """
    from ncclguard.fingerprint.loading import parse_version
    from ncclguard.fingerprint.offers import release_for
    from ncclguard.policy.jobvars import Applied, apply
    from ncclguard.policy.rules import container, jobnccl

    skip = _out_of_scope(records, config, partition)
    if skip is not None:
        return skip
    hosts = sorted(records)
    unknown_sev, stack_sev = _severities(config, jobnccl.UNKNOWN, jobnccl.STACK)
    if job is not None and not isinstance(job, Mapping):
        job, why = None, why or f"not a description of a library: {type(job).__name__}"
    version = parse_version(job.get("nccl_version")) if job else None
    raw = (job or {}).get("net_abis")
    abis = [a for a in raw if type(a) is int] if isinstance(raw, list | tuple) else []
    where = f"{(job or {}).get('source') or 'its environment'} {(job or {}).get('path') or ''}"
    if job is not None and (version is None or not abis):
        why = why or "its libnccl names no version or no net plugin ABI"
    applied = Applied(dict(records), [], [])
    if why is not None or job is None:
        why = why or "not read"
        if variables:
            applied = apply(records, variables)
            records = applied.records
        base = evaluate_values(records, config, stale, partition, prefer)
        findings = list(base.findings)
        if unknown_sev != "ignore":
            findings.append(jobnccl.unknown_finding(f"the job's own NCCL ({where.strip()})",
                                                    why, hosts, unknown_sev))
        notes = [*base.notes, f"the job's own NCCL cannot be read ({why}): judged by what "
                 "holds for any NCCL (node-adds) and the host's stack"]
        odd = set(base.odd_nodes)
        tie = base.odd_tie
    else:
        assert job is not None and version is not None
        release = release_for(version)
        if variables:
            applied = apply(records, variables, release)
            records = applied.records
        sev = {r.name: severity_of(config, r.name) for r in COMPARISONS}
        judged = config.replace(severity={**sev, **dict.fromkeys(jobnccl.HOST_RULES,
                                                                  "ignore")})
        base = evaluate_values(records, judged, stale, partition, prefer)
        findings = list(base.findings)
        odd = set(base.odd_nodes)
        tie = base.odd_tie
        label = str(job.get("nccl_version"))
        subject = f"the job's own NCCL {label} ({where.strip()})"
        if stack_sev != "ignore":
            known = {h: r for h, r in records.items() if r is not None}
            image = {"nccl_version": label, "net_abis": sorted(set(abis), reverse=True),
                     "plugin": None}
            _add_stack(container.check_stack(
                str(job.get("path") or ""), image, jobnccl.job_records(known, release),
                stack_sev, rule=jobnccl.STACK, subject=subject), findings, odd, stack_sev,
                lambda unsaid: None if unknown_sev == "ignore" else jobnccl.unknown_finding(
                    subject, "these nodes' records do not say what they offer a job's own "
                    "NCCL (a node daemon before issue 39)", unsaid, unknown_sev))
        notes = [*base.notes, f"{subject}: judged by it on each node (the plugin NCCL "
                 f"{release} opens there), not by the host's libnccl"]
    _vars_findings(applied.unapplied, config, findings)
    return _verdict(findings, odd, hosts, [*notes, *applied.notes], partition, tie)
