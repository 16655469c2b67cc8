"""Prevention for jobs that bring their own NCCL, on a real cluster (issue 40,
``[features] own_nccl``): the features daemon gives each node a second class feature (what
it gives a job's own NCCL), the collector resolves a venv a job used, the daemon writes
its ``env`` line, and the shipped job_submit.lua offers the next ``sbatch`` from that venv
the second family's classes: the job runs across nodes whose host libnccl differ, where a
job of the host's NCCL is confined to one host class (and an ``-N4`` one refused at
submit).

Nodes: host libnccl 2.21.5 on n[1-2], 2.18.3 on n[3-4], the same IBext net plugin (v8) on
each; the venv holds pip's real nvidia-nccl-cu12 2.23.4 (net v8..v5).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.fingerprints import fingerprint
from helpers.slurm import require_slurm
from helpers.wait import wait_until

from devtools.devcluster import DevCluster
from ncclguard import audit
from ncclguard.fingerprint.jobenv import submit_key
from ncclguard.sched import classfile

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

HOST = {"n1": "2.21.5", "n2": "2.21.5", "n3": "2.18.3", "n4": "2.18.3"}


def _file(c: DevCluster) -> classfile.ClassFile | None:
    try:
        return classfile.read(c.classes_file)
    except classfile.ClassFileError:
        return None


def _features(c: DevCluster) -> dict[str, set[str]]:
    return {n.name: set(n.active_features) for n in c.slurm().nodes()}


@pytest.fixture(scope="module")
def oc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    require_slurm()
    with DevCluster(tmp_path_factory.mktemp("ownnccl"), nodes=4, prolog=True,
                    job_submit=True) as c:
        c.write_gate_config(f'[gate]\naudit_log = "{c.audit_path}"\nsteer_wait_s = 30\n'
                            "[features]\n"
                            f'classes_file = "{c.classes_file}"\ninterval_s = 0.5\n'
                            "own_nccl = true\n")
        for host in c.node_names:
            c.publish_fingerprint(host, fingerprint(host, nccl=HOST[host], plugin_abi=8,
                                                    offers=True))
        r = c.collect()
        assert "4 accepted, 0 rejected" in r.stderr, r.stderr
        c.set_reconfig_trigger()
        c.start_features_daemon()

        def in_place() -> bool:
            cf, feats = _file(c), _features(c)
            return cf is not None and len(cf.adds.get("*", ())) == 1 and all(
                len({f for f in fs if f.startswith("nc_")}) == 2 for fs in feats.values())

        wait_until(in_place, 30, "both class features on every node",
                   detail=lambda: f"{_features(c)}\n{_file(c)}")
        yield c


def _sbatch(c: DevCluster, env: dict[str, str], *args: str) -> tuple[int | None, str]:
    r = c.run(["sbatch", "--parsable", *args], env=env, check=False)
    if r.returncode != 0:
        return None, r.stderr
    return int(r.stdout.strip().split(";")[0]), ""


def test_a_venv_job_is_offered_the_nodes_that_run_its_nccl_not_one_host_class(
        oc: DevCluster, venv: Callable[[str], Path]) -> None:
    c = oc
    env = {"VIRTUAL_ENV": str(venv("2.23.4"))}
    feats = _features(c)
    host = {h: next(f for f in fs if f.startswith("nc_") and not f.startswith("nc_j"))
            for h, fs in feats.items()}
    adds = {h: next(f for f in fs if f.startswith("nc_j")) for h, fs in feats.items()}
    assert host["n1"] == host["n2"] != host["n3"] == host["n4"], feats
    assert len(set(adds.values())) == 1, feats
    # a job of the host's NCCL: one host class, so -N4 is refused at submit, with why
    job, err = _sbatch(c, {}, "-N4", "--wrap", "true")
    assert job is None and "needs 4 nodes with one NCCL stack" in err, err
    # the first job from the venv: not known yet, so the host classes (2 nodes each)
    job, err = _sbatch(c, env, "-N4", "--wrap", "true")
    assert job is None and "needs 4 nodes with one NCCL stack" in err, err
    first, err = _sbatch(c, env, "-N2", "--wrap", "true")
    assert first is not None, err
    assert c.job_field(first, "Features").startswith("[nc_") and \
        "nc_j" not in c.job_field(first, "Features")
    assert c.wait_job(first, {"COMPLETED", "FAILED"}, 60) == "COMPLETED"
    (rec,) = audit.read(c.audit_path, job=first)
    assert rec["job_env"]["vars"] == env, rec
    c.collect()  # the collector resolves the venv the audit trail names
    key = submit_key(env)
    assert key is not None
    wait_until(lambda: (cf := _file(c)) is not None and key in cf.envs, 30,
               "the features daemon's env line for the venv", detail=lambda: str(_file(c)))
    cf = _file(c)
    assert cf is not None and cf.envs[key] == (adds["n1"],)
    # now the venv's -N4 job gets the second family and runs across both host classes
    job, err = _sbatch(c, env, "-N4", "--wrap", "hostname")
    assert job is not None, err
    assert c.job_field(job, "Features") == f"[{adds['n1']}]"
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 60) == "COMPLETED"
    (rec,) = audit.read(c.audit_path, job=job)
    assert (rec["decision"], rec["nodes"], rec["path"]) == ("accept", "n[1-4]", "features"), rec
    assert rec["job_nccl"]["nccl_version"] == "2.23.4"
    # -w across the two host classes: the lua leaves it to the gate, which judges it by
    # its own NCCL and accepts it (a job of the hosts' NCCL is refused at submit)
    job, err = _sbatch(c, env, "-N2", "-w", "n1,n3", "--wrap", "true")
    assert job is not None, err
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 60) == "COMPLETED"
    (rec,) = audit.read(c.audit_path, job=job)
    assert (rec["decision"], rec["nodes"]) == ("accept", "n[1,3]"), rec
    # an srun (no environment sent) and the same venv inside sbatch --export=NONE: hosts
    job, err = _sbatch(c, env, "--export=NONE", "-N4", "--wrap", "true")
    assert job is None and "needs 4 nodes with one NCCL stack" in err, err
    # the admin's check sees both families in place
    r = c.ncclguard("features", "check", check=False)
    assert r.returncode == 0, r.stdout + r.stderr
