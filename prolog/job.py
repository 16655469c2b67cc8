"""The job a PrologSlurmctld run is about, read from its ``SLURM_*`` environment.

Slurm 22.05 sets (docs/slurm-versions.md, "1. PrologSlurmctld / EpilogSlurmctld
environment"): ``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST`` (compressed),
``SLURM_JOB_NUM_NODES``, ``SLURM_JOB_PARTITION``, ``SLURM_JOB_USER``,
``SLURM_JOB_UID``, ``SLURM_JOB_RESTART_COUNT``; batch jobs also ``SLURM_JOB_STDIN`` (see
:func:`is_batch`);
when set by the user ``SLURM_JOB_COMMENT``; 23.02+ ``SLURM_JOB_EXTRA``.

Hot path: standard library and ncclguard.hostlist only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

from ncclguard.hostlist import HostlistError, expand

BATCH_VARIABLES = ("SLURM_JOB_STDIN", "SLURM_JOB_STDOUT", "SLURM_JOB_STDERR")


def is_batch(env: Mapping[str, str]) -> bool:
    """A batch job (sbatch), as PrologSlurmctld's environment shows it.

    Seen on 22.05.8 and 24.11.5 (tests/test_slurm_releases.py): a batch job always has
    ``SLURM_JOB_STDIN`` (``/dev/null`` by default), and ``SLURM_JOB_STDOUT``/``STDERR``
    only when ``-o``/``-e`` was given (25.11, from its source: STDOUT always); ``srun``
    and ``salloc`` allocations have none of the three.
    """
    return any(k in env for k in BATCH_VARIABLES)


#: How slurmctld names a SPANK plugin's option in PrologSlurmctld's environment:
#: ``SPANK_`` + ``_SLURM_SPANK_OPTION_<plugin>_<option>`` (dashes as underscores), seen on
#: Slurm 22.05.8 and 24.11 with a stub plugin registering pyxis's options
#: (tests/test_container_gate.py).
PYXIS_IMAGE_VAR = "SPANK__SLURM_SPANK_OPTION_pyxis_container_image"


class JobError(ValueError):
    """The environment does not describe a job we can check (the message says why)."""


class Job(NamedTuple):
    """One job as PrologSlurmctld sees it (a NamedTuple: the gate's imports stay light)."""

    job_id: int
    nodelist: str  # as Slurm gave it (compressed)
    nodes: tuple[str, ...]  # expanded, in order, without duplicates
    user: str = ""
    uid: int | None = None
    partition: str = ""
    num_nodes: int = 0
    restart_count: int = 0
    batch: bool = False
    comment: str = ""
    extra: str = ""
    name: str = ""
    constraints: str = ""  # --constraint, with the class group job_submit.lua added
    work_dir: str = ""
    #: pyxis's job-level --container-image (sbatch/salloc/srun), as slurmctld hands the
    #: SPANK option to PrologSlurmctld (docs/containers.md); "" when none
    container_image: str = ""
    #: an array task's master job id (``SLURM_ARRAY_JOB_ID``): slurmctld keeps the
    #: task's saved environment under it (docs/slurm.md); None for other jobs
    array_job_id: int | None = None

    @property
    def image_path(self) -> str:
        """The image as the gate judges it: as given. A ``./`` path stays relative: pyxis
        reads it in each step's working directory when the step starts, which need not
        be the job's (``srun --chdir``, a ``cd`` in the script), so the gate cannot know
        the file and judges it unknown (docs/containers.md)."""
        return self.container_image

    @property
    def class_group(self) -> bool:
        """Whether the job carries a matching-OR group of class features (``[nc_..|..]``,
        docs/scheduling.md): Slurm then gave it nodes of one class."""
        # no class feature (ncclguard.policy.schedule.FEATURE_PREFIX): no group, and no
        # import of the parser on the accept path
        if "nc_" not in self.constraints:
            return False
        from ncclguard.sched.group import is_class_group  # standard library only

        return is_class_group(self.constraints)

    @property
    def opted_out(self) -> bool:
        """``ncclguard=off`` as a word of the comment (22.05) or of ``--extra`` (23.02+)."""
        from ncclguard.policy.optout import opted_out

        return opted_out(self.comment, self.extra)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Job:
        e = os.environ if env is None else env
        raw_id = e.get("SLURM_JOB_ID", "")
        if not raw_id.isdigit():
            raise JobError(f"SLURM_JOB_ID={raw_id!r}: not a job id (not run by slurmctld?)")
        nodelist = e.get("SLURM_JOB_NODELIST", "")
        if not nodelist.strip():
            raise JobError(f"job {raw_id}: SLURM_JOB_NODELIST is empty")
        try:
            nodes = tuple(dict.fromkeys(expand(nodelist)))
        except HostlistError as err:
            raise JobError(f"job {raw_id}: SLURM_JOB_NODELIST: {err}") from None
        num = e.get("SLURM_JOB_NUM_NODES", "")
        uid = e.get("SLURM_JOB_UID", "")
        restarts = e.get("SLURM_JOB_RESTART_COUNT", "")
        if num.isdigit() and int(num) != len(nodes):
            raise JobError(
                f"job {raw_id}: SLURM_JOB_NODELIST={nodelist!r} names {len(nodes)} nodes "
                f"but SLURM_JOB_NUM_NODES={num}"
            )
        return cls(
            job_id=int(raw_id),
            nodelist=nodelist,
            nodes=nodes,
            user=e.get("SLURM_JOB_USER", ""),
            uid=int(uid) if uid.isdigit() else None,
            partition=e.get("SLURM_JOB_PARTITION", ""),
            num_nodes=len(nodes),
            restart_count=int(restarts) if restarts.isdigit() else 0,
            batch=is_batch(e),
            comment=e.get("SLURM_JOB_COMMENT", ""),
            extra=e.get("SLURM_JOB_EXTRA", ""),
            name=e.get("SLURM_JOB_NAME", ""),
            constraints=e.get("SLURM_JOB_CONSTRAINTS", ""),
            work_dir=e.get("SLURM_JOB_WORK_DIR", ""),
            container_image=e.get(PYXIS_IMAGE_VAR, "").strip(),
            array_job_id=int(a) if (a := e.get("SLURM_ARRAY_JOB_ID", "")).isdigit() else None,
        )
