"""The ``slurm_cluster`` and ``cluster`` fixtures (a plugin of tests/conftest.py): a real
munged + slurmctld + 4 slurmd for this test session.

A thin wrapper over :class:`devtools.devcluster.DevCluster` (the demo uses the same class).
Without Slurm installed the tests that use it are skipped with the reason, unless
``NCCLGUARD_REQUIRE_SLURM=1`` (CI): then they fail.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from devtools.devcluster import DevCluster, missing_programs

REQUIRE_SLURM = os.environ.get("NCCLGUARD_REQUIRE_SLURM") == "1"


def class_features(c: DevCluster) -> dict[str, str]:
    """Each node's class feature (``nc_...``) as Slurm has it now, "" for none."""
    return {h: next((f for f in fs if f.startswith("nc_")), "") for h, fs in
            c.node_features().items()}


def require_slurm() -> None:
    missing = missing_programs()
    if missing:
        why = f"Slurm test cluster needs {', '.join(missing)} (apt-get install slurm-wlm munge)"
        if REQUIRE_SLURM:
            pytest.fail(f"{why}; NCCLGUARD_REQUIRE_SLURM=1 forbids skipping", pytrace=False)
        pytest.skip(why)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """One private cluster (n1..n4, partition ``debug``) with the gate as PrologSlurmctld."""
    require_slurm()
    root = tmp_path_factory.mktemp("slurm")
    with DevCluster(root, nodes=4, prolog=True) as cluster:
        yield cluster


@pytest.fixture
def cluster(slurm_cluster: DevCluster) -> Iterator[DevCluster]:
    """The session cluster, emptied of jobs before and after the test, nodes idle, and
    the gate's config and inventory as at the start (no test inherits another's)."""
    slurm_cluster.cancel_all()
    slurm_cluster.wait_nodes_idle(60)
    slurm_cluster.reset_gate_state()
    yield slurm_cluster
    slurm_cluster.cancel_all()
    slurm_cluster.reset_gate_state()
