"""The class group in a job's constraint: its format, and where it may be joined.

``job_submit.lua`` gives a multi-node job the matching-OR group ``[nc_a|nc_b]``, joined
to the user's own expression as ``(user)&[nc_a|nc_b]``. This module is the one Python
home of those rules; the lua (``slurm/job_submit.lua``) implements the same ones, and
``tests/test_lua_submit.py`` runs one corpus through both:

- the gate reads a job's constraint with :func:`is_class_group`;
- :func:`joinable` says whether a user's expression can take the group without turning a
  constraint Slurm accepts into one it rejects;
- :func:`terms` counts the positions a constraint takes in slurmctld's matching-OR
  bitmaps (64: more crashes slurmctld 22.05);
- the sync's :func:`~ncclguard.sched.sync.regroup_pending` and the lua's mirror
  (:mod:`ncclguard.sched.submit`) build groups with :func:`render` and :func:`join`.

Slurm's grammar (``build_feature_list()`` in src/slurmctld/job_scheduler.c, 22.05.8 and
``_feature_string2list()`` 24.11.5 and 26.05.3, docs/slurm.md): commas become ``&``; an
operator (``&``, ``|``) needs a feature before it; ``(`` and ``[`` need no feature
before them; ``)`` and ``]`` need one; a count ``*N`` may not stand inside parentheses;
one bracket group per constraint; an operator at the very end is dropped. So ``a&``
alone is accepted, but ``(a&)&[...]`` is not. Everything else is part of a feature's
name (spaces, ``:``, ``=``...).

Standard library only: the gate imports it on its hot path.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = [
    "ADDS_FEATURE",
    "FEATURE",
    "HOST_FEATURE",
    "MAX_CONSTRAINT",
    "MAX_TERMS",
    "is_class_feature_name",
    "is_class_group",
    "join",
    "joinable",
    "parse",
    "render",
    "terms",
]

#: A class feature of the host's stack as the sync names it (``nc_`` and 8 to 64 hex
#: digits, or ``nc_unknown``); :mod:`ncclguard.policy.schedule` makes them.
HOST_FEATURE = re.compile(r"nc_(?:unknown|[0-9a-f]{8,64})")
#: A class of the second family (what nodes give a job's own NCCL, issue 40): ``nc_j``
#: and 8 to 64 hex digits (:data:`ncclguard.policy.schedule.ADDS_PREFIX`).
ADDS_FEATURE = re.compile(r"nc_j[0-9a-f]{8,64}")
#: Either: a feature the lua may put in a job's group.
FEATURE = re.compile(r"nc_(?:unknown|j?[0-9a-f]{8,64})")
#: slurmctld's matching-OR bitmaps: ``MAX_FEATURES`` (64) in
#: src/slurmctld/node_scheduler.c, one position per term of a bracket group, no check.
MAX_TERMS = 64
#: Slurm's cap on a constraint, a preference, a comment, ``--extra`` and a partition
#: (``_test_job_desc_fields()`` in src/slurmctld/job_mgr.c), checked *after* the
#: job_submit plugin ran (``validate_job_create_req()``, 22.05.8 to 26.05.3).
MAX_CONSTRAINT = 1024

_OPERATORS = "&|,"
_NOT_JOINABLE = re.compile(r"[\[\]()*]")
_GROUP = re.compile(r"(?:\((?P<user>[^()\[\]*]*)\)&)?\[(?P<group>[^\[\]]*)\]")
_TERMS = re.compile(r"\[([^\]]*)\]?")
_TERM = re.compile(r"[^&|,()]+")


def is_class_feature_name(name: str) -> bool:
    return FEATURE.fullmatch(name) is not None


def render(features: Sequence[str]) -> str:
    """``[nc_a|nc_b]``."""
    return "[" + "|".join(features) + "]"


def joinable(user: str | None) -> bool:
    """Whether ``(user)&[group]`` parses wherever ``user`` alone does.

    Not for an expression with brackets (one group per job: theirs), parentheses (Slurm
    rejects them nested), a count (``a*2``: not allowed inside parentheses), or one that
    ends with an operator (``a&`` is fine alone, ``(a&)`` is not). One that starts with an
    operator or has two in a row is rejected by Slurm anyway, and joined it stays so."""
    if not user:
        return True
    return _NOT_JOINABLE.search(user) is None and user[-1] not in _OPERATORS


def join(user: str | None, group: str) -> str | None:
    """The group joined to a user's expression, or None where that is not safe."""
    if not user:
        return group
    if not joinable(user):
        return None
    return f"({user})&{group}"


def joined_length(user: str | None, group_length: int) -> int:
    """``len(join(user, group))`` without building it."""
    return group_length if not user else len(user) + 3 + group_length


def parse(constraint: str) -> tuple[str | None, list[str]] | None:
    """``(user expression, classes)`` of a constraint the lua wrote (``[a|b]`` or
    ``(user)&[a|b]`` with class features only), else None (a user's own group, none)."""
    m = _GROUP.fullmatch(constraint)
    if not m:
        return None
    group = m["group"].split("|")
    if not (all(HOST_FEATURE.fullmatch(g) for g in group)
            or all(ADDS_FEATURE.fullmatch(g) for g in group)):
        return None  # the lua's groups are of one family
    return m["user"], group


def is_class_group(constraint: str) -> bool:
    """Whether a constraint carries the lua's group of class features."""
    return parse(constraint) is not None


def terms(constraint: str) -> int:
    """The terms of a constraint's bracket groups: the positions slurmctld gives them
    (``_valid_features()`` counts only the terms of a bracket group)."""
    return sum(len(_TERM.findall(group)) for group in _TERMS.findall(constraint))
