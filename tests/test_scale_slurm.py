"""At cluster scale on a real slurmctld: 16,384 nodes named ``gpu00001``... in one class
get their class feature from one sync. Joined with commas their names are 147 KB, more
than Linux lets one argument be (128 KiB, ``MAX_ARG_STRLEN``: "Argument list too long");
the update names them as Slurm's compressed hostlist (docs/slurm.md).

The 16,384 are defined in slurm.conf with no slurmd (``DevCluster.extra_nodes``); their
fingerprints are written to the inventory as the collector would.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from helpers.fingerprints import fingerprint
from helpers.slurm import require_slurm

from devtools.devcluster import DevCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

GPUS = [f"gpu{i:05d}" for i in range(1, 16385)]


@pytest.fixture(scope="module")
def big_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    require_slurm()
    root = tmp_path_factory.mktemp("scale")
    with DevCluster(root, nodes=2, extra_nodes=GPUS) as c:
        # slurmctld can take more than the CLI's default 15 s to list 16,386 nodes just
        # after updating them all (CI's machine did); an admin raises it so
        c.write_gate_config(f'[gate]\naudit_log = "{c.audit_path}"\ncli_slurm_timeout_s = 120\n'
                            f'[features]\nclasses_file = "{c.classes_file}"\n')
        c.store_fingerprints(fingerprint(h, nccl="2.21.5") for h in [*c.node_names, *GPUS])
        yield c


def test_one_class_of_16384_nodes_gets_its_feature_in_one_sync(big_cluster: DevCluster) -> None:
    c = big_cluster
    assert len(",".join(GPUS)) > 128 * 1024  # what one argument could not hold
    dry = c.features("sync", "--dry-run").stdout
    assert "would run: scontrol update NodeName=gpu[00001-16384]" in dry, dry[:2000]
    r = c.features("sync", check=False)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    # one update for the 16,384 (the two slurmd nodes may carry other own features)
    assert re.search(r"\b16386 of 16386 nodes updated in [12] calls", r.stdout), r.stdout[-2000:]
    feats = c.node_features()
    classes = {next((f for f in fs if f.startswith("nc_")), "") for fs in feats.values()}
    assert len(feats) == 16386 and len(classes) == 1 and "" not in classes, classes
    assert "0 of 16386 nodes updated in 0 calls" in c.features("sync").stdout
