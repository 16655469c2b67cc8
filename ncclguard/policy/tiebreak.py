"""The one tie-break for odd nodes: keep the majority class of the job's partition.

When several minimum sets of odd nodes exist (two nodes of four differ from each other and
from the rest, or 2 against 2), :func:`~ncclguard.policy.evaluate` marks the verdict
``odd_tie`` and picks by name. The gate, ``ncclguard check`` and ``ncclguard diagnose`` then
all call :func:`break_tie`: it evaluates again, preferring to keep the nodes of the largest
compatibility class among the partition's nodes (``a,b``: of either), or among the whole
inventory when the partition's nodes are not known. Nothing is preferred when the largest
classes tie: the choice by name stands.

Pure: the caller hands in how to list a partition's nodes and the inventory's classes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from ncclguard.policy.evaluation import partitions_of
from ncclguard.policy.verdict import Verdict

__all__ = ["break_tie", "majority"]

#: ``classes(hosts)``: the host lists of the inventory's classes among ``hosts`` (None: all).
ClassLister = Callable[[list[str] | None], Sequence[Collection[str]]]
#: ``members(partitions)``: the nodes of any of these partitions ([] when unknown).
MemberLister = Callable[[set[str]], list[str]]
#: ``again(prefer)``: the verdict evaluated again, as before, keeping ``prefer`` if it can.
Reevaluate = Callable[[Collection[str]], Verdict]


def majority(groups: Sequence[Collection[str]]) -> set[str]:
    """The hosts of the one largest group (e.g. ``Inventory.classes()``' host lists): the
    ``prefer`` for :func:`evaluate`. Empty when there is none, or the largest ones tie."""
    sizes = sorted((len(set(g)) for g in groups), reverse=True)
    if not sizes or (len(sizes) > 1 and sizes[0] == sizes[1]):
        return set()
    return next(set(g) for g in groups if len(set(g)) == sizes[0])


def break_tie(
    verdict: Verdict,
    again: Reevaluate,
    classes: ClassLister,
    members: MemberLister | None = None,
) -> tuple[Verdict, str | None]:
    """``(verdict, source)``: ``verdict`` itself when it has no tie (``source`` None), else
    the verdict that keeps the majority class, and a note saying which class that was
    (``"majority class of partition debug (4 nodes)"``, ``"none (...)"``).

    ``again(prefer)`` evaluates the allocation as ``verdict`` was (the same nodes, config,
    stale nodes and partition), with ``prefer``.
    """
    partition = verdict.partition
    if not verdict.odd_tie:
        return verdict, None
    hosts: list[str] = []
    scope = "the inventory"
    names = partitions_of(partition)
    if names and members is not None:
        hosts = members(names)
        if hosts:
            scope = f"partition {partition}"
    largest = majority(classes(hosts or None))
    if not largest:
        return verdict, f"none (no single largest class in {scope})"
    kept = again(largest & set(verdict.nodes))
    return kept, f"majority class of {scope} ({len(largest)} nodes)"
