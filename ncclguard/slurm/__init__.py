"""Slurm through its commands, for every release from 22.05 to 25.11 (docs/slurm-versions.md).

- :mod:`~ncclguard.slurm.model`: the typed results (:class:`NodeInfo`, :class:`JobInfo`,
  :class:`Release`) and errors, the same on every release
- :mod:`~ncclguard.slurm.schema`: reading a ``--json`` answer by its ``meta`` block
- :mod:`~ncclguard.slurm.paths`: the files a batch job's output goes to
- :mod:`~ncclguard.slurm.savedenv`: a batch job's environment as slurmctld saved it at submit
- :mod:`~ncclguard.slurm.adapter`: :class:`Slurm`, the commands themselves
"""

from ncclguard.slurm.adapter import Slurm
from ncclguard.slurm.model import (
    JobInfo,
    NodeInfo,
    Release,
    SlurmError,
    SlurmNotFound,
    SlurmSchemaError,
    SlurmTimeout,
    clean_text,
)
from ncclguard.slurm.paths import output_path

__all__ = [
    "JobInfo",
    "NodeInfo",
    "Release",
    "Slurm",
    "SlurmError",
    "SlurmNotFound",
    "SlurmSchemaError",
    "SlurmTimeout",
    "clean_text",
    "output_path",
]
