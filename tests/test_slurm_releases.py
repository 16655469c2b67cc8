"""What differs between Slurm releases and that the gate relies on, checked on the real
Slurm installed here (22.05.8 on the host, 24.11.5 in the root of scripts/slurm-root.sh).

docs/slurm-versions.md records each difference with the release it starts at; these
tests hold the facts of that page that a running Slurm can show, on whichever release
runs them: PrologSlurmctld's environment (batch or interactive, SLURM_JOB_EXTRA from
23.02), the adapter's choice of command, and how a refused batch job comes back.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.slurm import require_slurm
from helpers.wait import wait_until

from devtools.devcluster import DevCluster
from ncclguard.slurm import Release, Slurm, SlurmError
from ncclguard.slurm.schema import parser_for
from prolog.job import is_batch

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def env_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """A cluster whose PrologSlurmctld writes its environment to ``envs/<job>`` and
    refuses (exit 1) the jobs named ``refuse-me``."""
    require_slurm()
    root = tmp_path_factory.mktemp("prolog-env")
    envs = root / "envs"
    envs.mkdir()
    script = root / "dump-env.sh"
    script.write_text(
        "#!/bin/sh\n"
        f'env > "{envs}/$SLURM_JOB_ID.$SLURM_JOB_RESTART_COUNT"\n'
        '[ "$SLURM_JOB_NAME" = refuse-me ] && [ "$SLURM_JOB_RESTART_COUNT" = 0 ] && exit 1\n'
        "exit 0\n"
    )
    script.chmod(0o755)
    with DevCluster(root, nodes=2, prolog=False, extra_conf=f"PrologSlurmctld={script}") as c:
        yield c


def _env(c: DevCluster, job: int, restart: int = 0) -> dict[str, str]:
    path = c.root / "envs" / f"{job}.{restart}"
    wait_until(path.exists, 30, f"the prolog of job {job} to run", interval=0.1)
    time.sleep(0.1)  # written by one `env >`: let it finish
    lines = path.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def _release(c: DevCluster) -> Release:
    return c.slurm().version()


def test_batch_and_interactive_jobs_as_the_prolog_sees_them(env_cluster: DevCluster) -> None:
    c = env_cluster
    plain = c.sbatch(["-N1", "--wrap", "true"])
    named = c.sbatch(["-N1", "-o", "/dev/null/out-%j-%N.log", "--wrap", "true"])
    subprocess.run(["srun", "-N1", "-J", "inter", "true"], env=c.env, timeout=60, check=True,
                   capture_output=True, cwd=c.root)  # fmt: skip
    inter = int(c.run(["squeue", "-h", "-t", "all", "-n", "inter", "-o", "%i"]).stdout.split()[0])
    batch, with_o, srun = _env(c, plain), _env(c, named), _env(c, inter)
    for env in (batch, with_o, srun):
        assert env["SLURM_SCRIPT_CONTEXT"] == "prolog_slurmctld"
        assert env["SLURM_JOB_NODELIST"] and env["SLURM_JOB_PARTITION"] == "debug"
    # sbatch always sets the job's stdin (/dev/null); salloc/srun set none of the three
    assert batch["SLURM_JOB_STDIN"] == "/dev/null" and is_batch(batch)
    assert not {"SLURM_JOB_STDIN", "SLURM_JOB_STDOUT", "SLURM_JOB_STDERR"} & set(srun)
    assert not is_batch(srun)
    # -o comes through as written (absolute, not expanded); without it, only 25.11 sets one
    assert with_o["SLURM_JOB_STDOUT"] == "/dev/null/out-%j-%N.log"
    assert ("SLURM_JOB_STDOUT" in batch) == (_release(c) >= Release(25, 11))


def test_job_extra_and_times_from_2302(env_cluster: DevCluster) -> None:
    c = env_cluster
    if _release(c) < Release(23, 2):
        r = c.run(["sbatch", "-N1", "--extra=x", "--wrap", "true"], check=False)
        assert r.returncode != 0  # 22.05: no --extra, and no SLURM_JOB_EXTRA
        env = _env(c, c.sbatch(["-N1", "--wrap", "true"]))
        assert "SLURM_JOB_EXTRA" not in env and "SLURM_JOB_START_TIME" not in env
        return
    env = _env(c, c.sbatch(["-N1", "--extra=ncclguard-test", "--wrap", "true"]))
    assert env["SLURM_JOB_EXTRA"] == "ncclguard-test"
    assert int(env["SLURM_JOB_START_TIME"]) > 0 and "SLURM_JOB_END_TIME" in env


def test_a_refused_batch_job_is_requeued_not_held(env_cluster: DevCluster) -> None:
    """Exit 1 from PrologSlurmctld: the batch job goes back to PENDING, Restarts=1, not
    held, not killed (every release); StartTime=now lets it run without the ~121 s wait."""
    c = env_cluster
    job = c.sbatch(["-N1", "-J", "refuse-me", "--wrap", "true"])
    _env(c, job, 0)
    c.wait_job(job, {"PENDING"}, 30)
    info = c.slurm().job(job)
    assert info is not None and info.restart_count == 1 and info.state == "PENDING"
    assert info.state_reason != "JobHeldUser" and "Held" not in info.state_reason
    c.slurm().update_job(job, StartTime="now")
    assert c.wait_job(job, {"COMPLETED"}, 60) == "COMPLETED"
    assert is_batch(_env(c, job, 1))


def test_adapter_reads_this_release(env_cluster: DevCluster, tmp_path: Path) -> None:
    """The adapter picks its command by the release and reads the answer by its meta."""
    c = env_cluster
    log = tmp_path / "calls.log"
    for name in ("scontrol", "squeue", "sinfo"):  # log each call, then run the real one
        real = shutil.which(name, path=c.env["PATH"])
        wrapper = tmp_path / name
        wrapper.write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\nexec {real} "$@"\n')
        wrapper.chmod(0o755)
    s = Slurm(tmp_path, conf=str(c.conf))
    nodes = s.nodes()
    assert sorted(n.name for n in nodes) == ["n1", "n2"]
    # what the collector checks a record's origin against: NodeAddr and NodeHostname
    assert {n.name: (n.address, n.hostname) for n in nodes} == {
        name: (c.node_addrs[name], name) for name in ("n1", "n2")}
    job = c.sbatch(["-N1", "--hold", "--wrap", "true"])
    info = s.job(job)
    assert info is not None and info.state == "PENDING" and info.batch
    c.run(["scancel", str(job)])
    c.wait_job(job, {"CANCELLED"}, 30)
    done = s.job(job)  # finished jobs stay readable until MinJobAge, on every release
    assert done is not None and done.state == "CANCELLED"
    v = s.version()
    json = f"--json={parser_for(v)}" if parser_for(v) else "--json"
    node_call = "scontrol show nodes" if v >= Release(23, 2) else "sinfo"
    assert log.read_text().splitlines() == [
        "scontrol --version",
        f"{node_call} {json}",
        f"squeue -j {job} -t all {json}",
        f"squeue -j {job} -t all {json}",
    ]


def test_text_after_brackets_is_accepted_from_2311(env_cluster: DevCluster) -> None:
    s = env_cluster.slurm()
    if s.version() >= Release(23, 11):
        assert s.hostnames("gpu[01-02]-ib") == ["gpu01-ib", "gpu02-ib"]
    else:
        with pytest.raises(SlurmError, match="not a hostlist"):
            s.hostnames("gpu[01-02]-ib")
