"""What running jobs really loaded, on a real cluster (issue 42, docs/runtime.md).

Real ``sbatch``/``srun`` jobs on the dev cluster run ``loadnccl`` (tests/helpers/loader.py,
compiled with gcc), which ``dlopen``s the real ``libnccl.so.2`` of an nvidia-nccl wheel
that its node's ``LD_LIBRARY_PATH`` names, and, where told, a gcc-built net plugin, as
NCCL's net set-up would. Each node's ``ncclguard-inventoryd jobmaps`` reads the steps'
``/proc/PID/maps`` (their processes found under their slurmstepd: the dev cluster runs
``proctrack/linuxproc``), the node publishes it in its signed record, and one collector
scan joins the nodes.

- job A: n1 loads 2.21.5, n2 loads 2.23.4: mixed (another release), each node's named;
- job B: 2.21.5 on n3 and n4, the net plugin on n3 only: mixed (a plugin on some nodes);
- job C: 2.21.5 on n2 and n4, nothing else: never mixed;
- with ``on_mixed = "requeue"``, a mixed batch job is requeued away from its odd node and
  completes.

The nodes' net is taken as chosen at once (``settle_s = 0``): the loader maps no
libibverbs, and waiting a minute per test would only cost time (the settle rule:
tests/test_runtime.py).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.fingerprints import fingerprint
from helpers.loader import build_loader
from helpers.parts import build_plugin
from helpers.wait import wait_until

from devtools.devcluster import DevCluster
from ncclguard.store import Inventory

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

CONFIG = '[gate]\naudit_log = "{audit}"\nsteer_wait_s = 30\n[runtime]\nsettle_s = 0\n'


def _script(path: Path, loader: Path, libdir: dict[str, Path], plugin: dict[str, Path],
            seconds: str) -> Path:
    """A batch script whose one srun step loads, on each node, the libnccl of
    ``libdir[node]`` (else ``libdir["*"]``) and the plugin of ``plugin[node]``."""
    cases = "".join(f'  {n}) export LD_LIBRARY_PATH={d}; EXTRA={plugin.get(n, "")} ;;\n'
                    for n, d in libdir.items() if n != "*")
    path.write_text(
        "#!/bin/bash\n"
        f"SECS={seconds}\n"
        "srun bash -c 'case \"$SLURMD_NODENAME\" in\n"
        f"{cases}"
        f'  *) export LD_LIBRARY_PATH={libdir["*"]}; EXTRA= ;;\n'
        "esac\n"
        f"exec {loader} $0 $EXTRA' \"$SECS\"\n")
    path.chmod(0o755)
    return path


def _loaded(out: Path, nodes: int) -> bool:
    try:
        return out.read_text().count("loaded ") >= nodes
    except OSError:
        return False


def _publish_and_collect(c: DevCluster, forged: dict[str, dict] | None = None) -> None:
    """Each node: one jobmaps scan, then its signed record with what it found (or what
    ``forged`` says for it); one collector scan."""
    for host in c.node_names:
        doc = (forged or {}).get(host) or c.jobmaps(host)
        c.publish_fingerprint(host, fingerprint(host, nccl="2.21.5"), loaded=doc)
    r = c.collect()
    assert f"{len(c.node_names)} accepted, 0 rejected" in r.stderr, r.stderr


def _mixed(c: DevCluster) -> dict[str, dict]:
    with Inventory(c.db, readonly=True) as inv:
        return {m["job"]: m for m in inv.mixed_steps()}


@pytest.fixture
def parts(tmp_path: Path, nccl_lib: Callable[[str], Path]) -> dict[str, Path]:
    return {"loader": build_loader(tmp_path / "bin"),
            "old": nccl_lib("2.21.5").parent, "new": nccl_lib("2.23.4").parent,
            "plugin": build_plugin(tmp_path / "plugin", net_abis=[8, 7], name="IBtest")}


def test_mixed_jobs_are_found_within_one_scan_and_the_consistent_one_never(
    cluster: DevCluster, parts: dict[str, Path], tmp_path: Path,
) -> None:
    c = cluster
    c.write_gate_config(CONFIG.format(audit=c.audit_path))
    c.remove_inventory()
    c.remove_records()
    loader, old, new, plugin = (parts[k] for k in ("loader", "old", "new", "plugin"))
    jobs = {}
    for name, nodes, libdir, plug in (
        ("A", "n[1-2]", {"n2": new, "*": old}, {}),
        ("B", "n[3-4]", {"n3": old, "*": old}, {"n3": plugin}),
        ("C", "n[2,4]", {"*": old}, {}),
    ):
        script = _script(tmp_path / f"{name}.sh", loader, libdir, plug, "120")
        out = tmp_path / f"{name}.out"
        jobs[name] = (c.sbatch(["-N2", "-w", nodes, "-o", str(out), str(script)]), out)
    for name, (job, out) in jobs.items():
        wait_until(lambda out=out: _loaded(out, 2), 60, f"job {name}'s two loaders",
                   detail=lambda job=job, out=out: c.show_job(job) + (
                       out.read_text() if out.exists() else ""))
    _publish_and_collect(c)
    a, b, cc = (str(jobs[k][0]) for k in "ABC")
    mixed = _mixed(c)
    assert set(mixed) == {a, b}, mixed
    assert mixed[a]["kind"] == "nccl" and mixed[a]["step"] == "0"
    assert "different NCCL releases" in mixed[a]["summary"]
    assert "n1: libnccl 2.21.5" in mixed[a]["summary"]
    assert "n2: libnccl 2.23.4" in mixed[a]["summary"], mixed[a]
    assert mixed[b]["kind"] == "net-missing" and mixed[b]["action"] is None
    assert "n3: net plugin 'IBtest'" in mixed[b]["summary"], mixed[b]
    # the views: ncclguard jobs, decisions --job, the metrics
    r = c.ncclguard("jobs")
    for job in (a, b, cc):
        assert job in r.stdout, r.stdout
    assert "consistent" in r.stdout and "MIXED nccl" in r.stdout, r.stdout
    r = c.ncclguard("--json", "jobs")
    verdicts = {(x["job"], x["host"]): x["verdict"] for x in json.loads(r.stdout)["steps"]}
    assert verdicts[(cc, "n2")] == verdicts[(cc, "n4")] == "consistent", verdicts
    assert {verdicts[(b, "n3")], verdicts[(b, "n4")]} == {
        "MIXED net-missing", "MIXED net-missing, odd"}, verdicts
    r = c.ncclguard("--json", "decisions", "--job", a)
    doc = json.loads(r.stdout)
    assert {x["host"]: x["nccl"].split(" (")[0] for x in doc["loaded"]} == {
        "n1": "libnccl 2.21.5", "n2": "libnccl 2.23.4"}, doc["loaded"]
    assert doc["mixed"][0]["odd"] in (["n1"], ["n2"])
    # the node keeps the evidence; diagnose --job starts from what was loaded
    r = c.ncclguard("show", "n2")
    assert "what its job steps loaded" in r.stdout and f"{a}.0" in r.stdout, r.stdout
    r = c.ncclguard("diagnose", "--job", a, ok=(0, 1, 2, 3))
    head = r.stdout.split("\n\n", 1)[0]
    assert "what each node's processes loaded" in head, r.stdout
    assert f"job {a} step 0 MIXED: different NCCL releases" in r.stdout, r.stdout
    r = c.ncclguard("diagnose", "--job", cc, ok=(0, 1, 2, 3))
    assert "loaded the same NCCL libraries and plugins" in r.stdout, r.stdout
    m = c._inventoryd(["metrics", "--no-slurm"], c.config_path).stdout
    assert 'ncclguard_mixed_steps{kind="nccl"} 1.0' in m, m
    assert 'ncclguard_mixed_steps{kind="net-missing"} 1.0' in m
    assert "ncclguard_loaded_steps 3.0" in m
    # a second scan finds nothing new: each step is kept once
    _publish_and_collect(c)
    assert set(_mixed(c)) == {a, b}
    c.cancel_all()


def test_on_mixed_requeue_steers_a_mixed_batch_job_away_and_it_completes(
    cluster: DevCluster, parts: dict[str, Path], tmp_path: Path,
) -> None:
    c = cluster
    c.write_gate_config(CONFIG.format(audit=c.audit_path)
                        + 'on_mixed = "requeue"\n')
    c.remove_inventory()
    c.remove_records()
    c.cancel_all()
    # n1 loads 2.23.4, the others 2.21.5: on n[1-3] n1 is odd; its second run, away
    # from n1, loads 2.21.5 everywhere and ends at once
    script = _script(tmp_path / "D.sh", parts["loader"], {"n1": parts["new"], "*": parts["old"]},
                     {}, '$([ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && echo 1 || echo 300)')
    out = tmp_path / "D.out"
    job = c.sbatch(["-N3", "--requeue", "-o", str(out), str(script)])
    wait_until(lambda: _loaded(out, 3), 60, "the job's three loaders",
               detail=lambda: c.show_job(job))
    assert c.job_field(job, "NodeList") == "n[1-3]"
    _publish_and_collect(c)
    (m,) = _mixed(c).values()
    assert m["odd"] == ["n1"] and m["action"] == "requeue", m
    assert m["result"].startswith("requeued: requeued, steered away from n1"), m
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 120) == "COMPLETED", c.show_job(job)
    assert c.job_field(job, "NodeList") == "n[2-4]"
    assert c.job_field(job, "Restarts") == "1"
    assert "AdminComment=ncclguard: mixed NCCL, different NCCL releases" in c.show_job(job)
    # the same job from an exempt user is only recorded: it runs on
    c.write_gate_config(CONFIG.format(audit=c.audit_path)
                        + 'on_mixed = "requeue"\nexempt_users = ["root", "0"]\n')
    out = tmp_path / "E.out"
    job = c.sbatch(["-N3", "--requeue", "-o", str(out), str(script)])
    wait_until(lambda: _loaded(out, 3), 60, "the job's three loaders",
               detail=lambda: c.show_job(job))
    _publish_and_collect(c)
    m = _mixed(c)[str(job)]
    assert m["result"] == "exempt: user root is exempt ([runtime] exempt_users)", m
    assert c.job_field(job, "JobState") == "RUNNING" and c.job_field(job, "Restarts") == "0"
    c.cancel_all()
    # a node's record that claims a step of a job Slurm did not give it: kept as its word,
    # not acted on (n3 says it ran a step of a job of n[1-2])
    c.write_gate_config(CONFIG.format(audit=c.audit_path) + 'on_mixed = "requeue"\n')
    script = _script(tmp_path / "G.sh", parts["loader"], {"*": parts["old"]}, {}, "300")
    out = tmp_path / "G.out"
    job = c.sbatch(["-N2", "-w", "n[1-2]", "--requeue", "-o", str(out), str(script)])
    wait_until(lambda: _loaded(out, 2), 60, "the job's two loaders")
    real = c.jobmaps("n1")
    assert real is not None
    claim = json.loads(json.dumps(real).replace('"host":"n1"', '"host":"n3"')
                       .replace('"host": "n1"', '"host": "n3"'))
    for st in claim["steps"]:
        for x in st["libs"]:
            x.update(sha256="f" * 64, version="2.23.4")
    _publish_and_collect(c, {"n3": claim})
    m = _mixed(c)[str(job)]
    assert m["result"].startswith("skipped: n3 not the job's nodes (n[1-2])"), m
    assert c.job_field(job, "JobState") == "RUNNING" and c.job_field(job, "Restarts") == "0"
    c.cancel_all()
    # an interactive job (srun, no batch script) is told why on its terminal and cancelled
    cmd = (f'case "$SLURMD_NODENAME" in n1) export LD_LIBRARY_PATH={parts["new"]} ;; '
           f'*) export LD_LIBRARY_PATH={parts["old"]} ;; esac; '
           f'exec {parts["loader"]} 300 > {tmp_path}/F.$SLURMD_NODENAME.out')
    srun = subprocess.Popen(["srun", "-N2", "-w", "n[1-2]", "bash", "-c", cmd], env=c.env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: all(_loaded(tmp_path / f"F.{n}.out", 1) for n in ("n1", "n2")),
                   60, "the srun's two loaders")
        _publish_and_collect(c)
        (m,) = [x for x in _mixed(c).values() if x["result"] and "interactive" in x["result"]]
        assert m["result"].startswith("cancelled: interactive: cancelled"), m
        said, _ = srun.communicate(timeout=60)
    finally:
        srun.kill()
    assert "ncclguard: mixed NCCL, different NCCL releases" in said, said
    assert "cancelled, resubmit to run on one class" in said, said

