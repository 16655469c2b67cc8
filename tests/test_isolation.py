"""Tests that share the session's Slurm cluster do not lean on each other (issue 17).

The pair below once failed in this order: the first left ``on_error = "refuse"`` and no
inventory behind, so the second's job pended for 60 s. The ``cluster`` fixture now puts
the gate's config and inventory back before and after each test; this runs the pair in
that order, in a pytest of its own with its own cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.slurm import require_slurm

ROOT = Path(__file__).resolve().parents[1]
PAIR = [
    "tests/test_gate_e2e.py::test_missing_inventory_fails_closed_when_configured",
    "tests/test_slurm_adapter.py::test_running_job_has_its_start_time",
]


@pytest.mark.slurm
def test_the_pair_that_leaked_passes_in_that_order(tmp_path: Path) -> None:
    require_slurm()
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         f"--basetemp={tmp_path / 'inner'}", *PAIR],
        cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    assert "2 passed" in r.stdout
