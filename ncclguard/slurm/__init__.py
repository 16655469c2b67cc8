"""Slurm through its commands, for every release from 22.05 to 25.11 (docs/slurm-versions.md).

- :mod:`~ncclguard.slurm.model`: the typed results (:class:`NodeInfo`, :class:`JobInfo`,
  :class:`Release`) and errors, the same on every release
- :mod:`~ncclguard.slurm.schema`: reading a ``--json`` answer by its ``meta`` block
- :mod:`~ncclguard.slurm.paths`: the files a batch job's output goes to
- :mod:`~ncclguard.slurm.savedenv`: a batch job's environment as slurmctld saved it at submit
- :mod:`~ncclguard.slurm.adapter`: :class:`Slurm`, the commands themselves
- :mod:`~ncclguard.slurm.conf`: one setting of slurm.conf

The names below are imported when first used (PEP 562): the gate reads a batch job's
saved environment through :mod:`~ncclguard.slurm.savedenv` on its hot path, and
importing this package must not bring the adapter's subprocess machinery with it (29 ms
measured with ``python -X importtime``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

#: where each name lives
_HOMES = {
    "Slurm": "adapter",
    "JobInfo": "model",
    "NodeInfo": "model",
    "Release": "model",
    "SlurmError": "model",
    "SlurmNotFound": "model",
    "SlurmSchemaError": "model",
    "SlurmTimeout": "model",
    "clean_text": "model",
    "output_path": "paths",
}

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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
