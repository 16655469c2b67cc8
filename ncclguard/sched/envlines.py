"""The file of classes' ``env`` lines: which classes of the second family run the NCCL of
each job environment the collector resolved (issue 40, ``[features] own_nccl``).

    job_envs (the collector: the libnccl a job's variables make it load) ──▶ submit key
    the second family's sample nodes, as job-stack reads them for that release
                                         ──▶ runnable_classes ──▶ env lines (classfile)

A job from such an environment is offered only those classes by job_submit.lua, whatever
libnccl each host has: the gate judges it by its own NCCL (prolog/ownnccl.py), and a
class of the second family never splits by what such a job does not load.
"""

from __future__ import annotations

from collections.abc import Mapping

from ncclguard.config import Config
from ncclguard.policy.rules import container, jobnccl
from ncclguard.sched import classfile
from ncclguard.sched.imagelines import samples_of
from ncclguard.store import Inventory
from ncclguard.store.jobenvs import MAX_JOB_ENVS

__all__ = ["env_groups", "job_nccl"]


def job_nccl(row: Mapping) -> tuple[str | None, dict | None]:
    """``(submit key, the job's NCCL as job-stack reads it)`` of one ``job_envs`` row
    (:meth:`~ncclguard.store.Inventory.job_envs`). The key is None where the lua could not
    match the row (variables stored cut: their :func:`~ncclguard.fingerprint.jobenv.
    env_key` is not the row's; none of the inputs; too long); the NCCL is None where the
    gate would not judge the job by it (a library not read, the host's, no version or
    ABI)."""
    from ncclguard.fingerprint.jobenv import env_key, submit_key
    from ncclguard.fingerprint.loading import parse_version

    variables, library = row.get("vars"), row.get("library")
    if not isinstance(variables, dict) or not all(
            isinstance(v, str) for v in variables.values()) or env_key(variables) != row.get("key"):
        return None, None
    key = submit_key(variables)
    if key is None or row.get("error") is not None or row.get("source") == "host" \
            or not isinstance(library, dict):
        return key, None
    raw = library.get("net_abis")
    abis = sorted({a for a in raw if type(a) is int}, reverse=True) \
        if isinstance(raw, list) else []
    if parse_version(library.get("nccl_version")) is None or not abis:
        return key, None
    return key, {"nccl_version": str(library["nccl_version"]), "net_abis": abis,
                 "plugin": None}


def in_turns(rows: list[dict], limit: int) -> list[dict]:
    """At most ``limit`` of ``rows`` (most recently used first), taken in turns by
    ``uid``: each user's most recent, then each one's second, and so on, users in the
    order of their most recent row. One user's thousands of environments then never push
    another's few out of the file (the lines past ``MAX_ENVS`` are dropped), as the
    collector takes keys in turns by uid (inventoryd/controller/jobenv_index.py)."""
    by_uid: dict[object, list[dict]] = {}
    for row in rows:
        by_uid.setdefault(row.get("uid"), []).append(row)
    out: list[dict] = []
    depth = 0
    while len(out) < limit:
        took = [queue[depth] for queue in by_uid.values() if depth < len(queue)]
        if not took:
            break
        out.extend(took[: limit - len(out)])
        depth += 1
    return out


def env_groups(config: Config, inventory: Inventory, adds: Mapping[str, str | None]
               ) -> dict[str, tuple[str, ...]]:
    """The file's ``env`` lines: for each submit key of the environments jobs used (the
    most recent first, in turns by user: :func:`in_turns`, at most ``2 * MAX_ENVS`` rows
    looked at), the classes of the second
    family (``adds``: host -> class) whose nodes run its NCCL without a ``job-stack``
    finding (:func:`~ncclguard.policy.rules.container.runnable_classes` over
    :func:`~ncclguard.policy.rules.jobnccl.job_records`; every class while job-stack does
    not refuse). Rows that differ only in ``NCCL_*`` share a submit key: the line has the
    classes that run every one of them, and none where the gate would not judge one of
    them by its NCCL (the job then gets the host classes, and the gate decides), or where
    some of a class's nodes run it and others do not."""
    from ncclguard.fingerprint.loading import parse_version
    from ncclguard.fingerprint.offers import release_for
    from ncclguard.policy.settings import severity_of

    if not config.features.own_nccl or not any(adds.values()):
        return {}
    images: dict[str, list[dict]] = {}
    spoiled: set[str] = set()
    for row in in_turns(inventory.job_envs(MAX_JOB_ENVS), 2 * classfile.MAX_ENVS):
        key, image = job_nccl(row)
        if key is None:
            continue
        if image is None:
            spoiled.add(key)
        else:
            images.setdefault(key, []).append(image)
    for key in spoiled:
        images.pop(key, None)
    if not images:
        return {}
    samples = samples_of(inventory, adds)
    refuses = severity_of(config.policy, jobnccl.STACK) == "refuse"
    out: dict[str, tuple[str, ...]] = {}
    for key, found in images.items():
        if not refuses:
            out[key] = tuple(sorted(samples))
            continue
        ables: list[set[str]] = []
        for image in found:
            version = parse_version(image["nccl_version"])
            assert version is not None
            release = release_for(version)
            seen = {cls: [r for r in jobnccl.job_records(
                        {str(i): rec for i, rec in enumerate(recs)}, release).values()
                          if r is not None]
                    for cls, recs in samples.items()}
            able = container.runnable_classes(image, seen)
            if able is None:
                break
            ables.append(set(able))
        else:
            out[key] = tuple(sorted(set.intersection(*ables)))
    return out
