"""ncclguard.slurm against the real test cluster (and its failure modes without one)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from devtools.devcluster import DevCluster
from ncclguard.hostlist import expand
from ncclguard.slurm import (
    Release,
    Slurm,
    SlurmError,
    SlurmNotFound,
    SlurmTimeout,
    clean_text,
)
from ncclguard.slurm.schema import TYPED, parser_for

pytestmark = pytest.mark.slurm


def test_nodes_from_sinfo_json(cluster: DevCluster) -> None:
    nodes = {n.name: n for n in cluster.slurm().nodes()}
    assert sorted(nodes) == ["n1", "n2", "n3", "n4"]
    assert all(n.state == "idle" and n.partitions == ("debug",) for n in nodes.values())
    assert cluster.slurm().partition_nodes("debug") == ["n1", "n2", "n3", "n4"]
    assert cluster.slurm().partition_nodes("nope") == []


def test_drain_and_resume_with_reason(cluster: DevCluster) -> None:
    s = cluster.slurm()
    try:
        s.drain(["n3", "n4"], "ncclguard: nccl 2.18.3 vs 2.21.5\nsecond line")
        nodes = {n.name: n for n in s.nodes("n[3-4]")}
        assert set(nodes) == {"n3", "n4"}
        assert all(n.drained for n in nodes.values())
        assert nodes["n3"].reason == "ncclguard: nccl 2.18.3 vs 2.21.5 second line"
    finally:
        s.resume("n[3-4]")
    assert not any(n.drained for n in s.nodes())


def test_job_info_and_updates(cluster: DevCluster) -> None:
    s = cluster.slurm()
    job = cluster.sbatch(["-N2", "-x", "n4", "--comment", "x y", "--hold", "--wrap", "true"])
    info = s.job(job)
    assert info is not None
    assert info.state == "PENDING" and info.batch and info.node_count == 2
    assert info.excluded_nodes == "n4" and info.comment == "x y" and info.partition == "debug"
    assert s.job_state(job) == "PENDING"
    s.set_admin_comment(job, "ncclguard: hello\tworld")
    s.update_job(job, ExcNodeList="n[3-4]")
    info = s.job(job)
    assert info is not None
    assert info.admin_comment == "ncclguard: hello world"
    assert info.excluded_nodes == "n[3-4]"
    s.release(job)
    info = s.job(job)
    assert info is not None and info.state_reason != "JobHeldUser"
    cluster.run(["scancel", str(job)])


def test_the_narrow_reads_say_what_the_whole_records_say(cluster: DevCluster) -> None:
    """``job_brief`` (one job, in text: what the gate reads) gives the placement and the
    AdminComment that ``job`` (``squeue --json``, which on 22.05 lists every job) gives;
    ``partitions`` and ``feature_groups`` the nodes that ``nodes`` lists. An AdminComment
    holding ``|`` and a line break (an operator's) comes back whole."""
    s = cluster.slurm()
    job = cluster.sbatch(["-N2", "-x", "n4", "-w", "n1", "--hold", "--wrap", "true"])
    try:
        cluster.run(["scontrol", "update", f"jobid={job}", "AdminComment=ops: a | b\n7|c"])
        brief, whole = s.job_brief(job), s.job(job)
        assert brief is not None and whole is not None
        for field in ("job_id", "state", "partition", "required_nodes", "excluded_nodes",
                      "admin_comment"):
            assert getattr(brief, field) == getattr(whole, field), field
        assert brief.admin_comment == "ops: a | b\n7|c" and brief.excluded_nodes == "n4"
        quiet = s.job_brief(job, admin_comment=False)
        assert quiet is not None and quiet.admin_comment == "" and quiet.required_nodes == "n1"
        cluster.run(["scontrol", "update", f"jobid={job}", "AdminComment="])
        cleared = s.job_brief(job)
        assert cleared is not None and cleared.admin_comment == ""
        # the collector's read for a container record: the owner and nodes, as json says
        owner = s.job_owner(job)
        assert owner is not None and (owner.state, owner.user_id, owner.nodes) == (
            whole.state, whole.user_id, whole.nodes) and owner.nodes == ""
        ran = cluster.sbatch(["-N2", "--wrap", "sleep 30"])
        cluster.wait_job(ran, {"RUNNING"}, 60)
        owner, whole = s.job_owner(ran), s.job(ran)
        assert owner is not None and whole is not None
        assert (owner.user_id, owner.nodes) == (whole.user_id, whole.nodes) == (
            os.getuid(), whole.nodes) and len(expand(owner.nodes)) == 2
        cluster.run(["scancel", str(ran)], check=False)
    finally:
        cluster.run(["scancel", str(job)], check=False)
    assert s.job_brief(99999999) is None and s.job_owner(99999999) is None
    nodes = s.nodes()
    assert s.partitions() == {"debug": "n[1-4]"}
    assert s.partition_nodes("debug") == sorted(n.name for n in nodes if "debug" in n.partitions)
    groups = s.feature_groups()
    assert {(p, d) for p, d, _, _ in groups} == {("debug", True)}
    listed = [h for _, _, hosts, _ in groups for h in s.hostnames(hosts)]
    assert sorted(listed) == sorted(n.name for n in nodes)
    by_host = {h: set(f) for _, _, hosts, f in groups for h in s.hostnames(hosts)}
    assert by_host == {n.name: set(n.active_features) for n in nodes}


def _scontrol(cluster: DevCluster, job: int) -> dict[str, str]:
    out = cluster.run(["scontrol", "-o", "show", "job", str(job)]).stdout
    return dict(tok.partition("=")[::2] for tok in out.split() if "=" in tok)


def test_job_times_and_output_paths(cluster: DevCluster) -> None:
    """The adapter names the files the node writes, pending, running and (until
    MinJobAge) finished alike, on every release: 22.05's squeue --json gives the output
    patterns raw ("" for the default, %j unexpanded), data parsers v0.0.39 to v0.0.42
    (24.11) give them expanded, %N left; both give epoch seconds."""
    s = cluster.slurm()
    tmp = cluster.root / "tmp"
    before = time.time()
    job = int(
        cluster.run(
            ["sbatch", "--parsable", "-N1", "-J", "typed", "-o", f"{tmp}/out-%j-%x-%N.log",
             "-e", f"{tmp}/err-%5j-%%.log", "--hold", "--wrap", "echo out; echo err >&2"]
        ).stdout
    )  # fmt: skip
    default = int(cluster.run(["sbatch", "--parsable", "-N1", "--hold", "--wrap", "true"]).stdout)
    info = s.job(job)
    assert info is not None and info.state == "PENDING"
    assert info.start_time is None and info.batch_host == "" and info.name == "typed"
    # the data parser the adapter asks for (or the release's only one) decides
    v = s.version()
    used = parser_for(v) or ("v0.0.39" if v >= Release(23, 2) else "v0.0.38")
    expanded = used in TYPED.expanded
    raw = info.raw["standard_output"]
    assert raw == (f"{tmp}/out-{job}-typed-%N.log" if expanded else f"{tmp}/out-%j-%x-%N.log")
    assert info.std_out == f"{tmp}/out-{job}-typed-%N.log"  # %N: the node expands it
    assert info.std_err == f"{tmp}/err-{job:05d}-%.log"
    assert info.work_dir == str(tmp)
    sc = _scontrol(cluster, job)
    # 26.05's scontrol expands %N of a pending job to "(null)" (docs/slurm-versions.md)
    assert info.std_out.replace("%N", "(null)" if v >= Release(26, 5) else "%N") \
        == sc["StdOut"]
    if v < Release(23, 2):
        assert sc["StdErr"] == f"{tmp}/err-%5j-%%.log"  # 22.05's scontrol: no widths, no %%
    d = s.job(default)
    assert d is not None  # Slurm's default: 22.05 stores none, 24.11 names the file
    # (26.05.5 stores the default pattern itself, relative: "slurm-%j.out")
    assert d.raw["standard_output"] == (f"{tmp}/slurm-{default}.out" if expanded else
                                        "slurm-%j.out" if v >= Release(26, 5) else "")
    assert d.std_out == d.std_err == f"{tmp}/slurm-{default}.out"
    sc = _scontrol(cluster, default)
    # 26.05.5's scontrol shows no StdErr for a job that named none (it goes to StdOut)
    assert (d.std_out, d.std_err) == (sc["StdOut"], sc["StdErr"] or
                                      (sc["StdOut"] if v >= Release(26, 5) else ""))
    cluster.run(["scancel", str(default)])

    s.release(job)
    assert cluster.wait_job(job, {"COMPLETED"}, 60) == "COMPLETED"
    done = s.job(job)  # squeue --json still lists it, as scontrol does
    assert done is not None and done.state == "COMPLETED"
    assert done.start_time is not None and before - 1 <= done.start_time <= time.time() + 1
    assert done.end_time is not None and done.end_time >= done.start_time
    assert done.batch_host == done.nodes
    assert (done.std_out, done.std_err) == (info.std_out, info.std_err)
    # the node wrote StdErr as named, and StdOut with %N as its short host name
    assert Path(done.std_err).read_text() == "err\n"
    written = list(tmp.glob(f"out-{job}-typed-*.log"))
    assert len(written) == 1 and written[0].read_text() == "out\n"


def test_running_job_has_its_start_time(cluster: DevCluster) -> None:
    s = cluster.slurm()
    before = time.time()
    job = cluster.sbatch(["-N2", "--wrap", "sleep 30"])
    assert cluster.wait_job(job, {"RUNNING"}, 60) == "RUNNING"
    info = s.job(job)
    assert info is not None and info.state == "RUNNING"
    assert info.start_time is not None and before - 1 <= info.start_time <= time.time() + 1
    assert info.batch_host == cluster.slurm().hostnames(info.nodes)[0]
    assert info.std_out == info.std_err == str(cluster.root / "tmp" / f"slurm-{job}.out")
    cluster.run(["scancel", str(job)])


def test_unknown_job(cluster: DevCluster) -> None:
    s = cluster.slurm()
    assert s.job(999999) is None
    assert s.job_state(999999) is None
    with pytest.raises(SlurmError, match="scontrol"):
        s.hold(999999)


def test_bad_arguments_never_reach_slurm(cluster: DevCluster) -> None:
    s = cluster.slurm()
    for bad in ("1; rm -rf /", "-1", "1 2", ""):
        with pytest.raises(SlurmError, match="not a job id"):
            s.hold(bad)
    with pytest.raises(SlurmError, match="not a node list"):
        s.drain("n1 n2", "x")
    with pytest.raises(SlurmError, match="not a node list"):
        s.resume("--all")
    with pytest.raises(SlurmError, match="not a job field"):
        s.update_job(1, **{"a b": "x"})


def test_controller_down_is_a_clear_error(tmp_path: Path) -> None:
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=x\nSlurmctldHost=localhost\nSlurmctldPort=1\nAuthType=auth/none\n"
        "NodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n"
    )
    s = Slurm(conf=str(conf), timeout=20)
    # from 26.05 the commands retry an unreachable controller for about 20 s before they
    # say so (docs/slurm-versions.md): the adapter's own timeout ends the call first
    retries = s.version() >= Release(26, 5)
    if retries:
        s.timeout = 3
    # a job: never "unknown" when the controller cannot say (scontrol show job --json
    # answers "jobs": [] with exit 0 then, on 23.02+; the adapter asks squeue)
    with pytest.raises(SlurmError) as job_err:
        s.job(5)
    assert str(job_err.value).startswith("squeue -j 5"), job_err.value
    # 22.05 answers {"errors": ["Failed while looking for jobs"]}; 23.02+ exit 1 and say why
    modern = s.version() >= Release(23, 2)
    if retries:
        assert isinstance(job_err.value, SlurmTimeout)
        assert "timed out after 3.0s" in str(job_err.value)
    else:
        assert ("Unable to contact slurm controller" if modern else "Failed") \
            in str(job_err.value)
    with pytest.raises(SlurmError) as err:
        s.nodes()
    # named by the command (not its path, which 24.11's own messages start with)
    first = "scontrol show nodes" if s.version() >= Release(23, 2) else "sinfo --json"
    assert str(err.value).startswith(first), err.value
    # 22.05's sinfo --json answers {"errors": ["Unspecified error"]}; scontrol says why
    cause = "Unable to contact slurm controller" if first.startswith("scontrol") else "error"
    assert ("timed out after 3.0s" if retries else cause) in str(err.value)
    assert "/usr/bin" not in str(err.value)


def test_missing_binaries(tmp_path: Path) -> None:
    with pytest.raises(SlurmNotFound, match="scontrol: not found in"):
        Slurm(tmp_path).hold(1)


def test_timeout_and_deadline(tmp_path: Path) -> None:
    slow = tmp_path / "squeue"
    slow.write_text("#!/bin/sh\nexec sleep 30\n")
    slow.chmod(0o700)
    t = time.monotonic()
    with pytest.raises(SlurmTimeout, match="timed out"):
        Slurm(tmp_path, timeout=0.5).job_state(1)
    assert time.monotonic() - t < 5
    t = time.monotonic()
    with pytest.raises(SlurmTimeout):
        Slurm(tmp_path, timeout=60, deadline=time.monotonic() + 0.5).job_state(1)
    assert time.monotonic() - t < 5
    with pytest.raises(SlurmTimeout, match="no time left"):
        Slurm(tmp_path, deadline=time.monotonic() - 1).job_state(1)


def test_clean_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = tmp_path / "squeue"
    out = tmp_path / "env.txt"
    spy.write_text(f"#!/bin/sh\nenv > {out}\n")
    spy.chmod(0o700)
    monkeypatch.setenv("SQUEUE_FORMAT", "%i")
    Slurm(tmp_path, conf="/x/slurm.conf").job_state(1)
    env = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    assert env["SLURM_CONF"] == "/x/slurm.conf"
    assert "SQUEUE_FORMAT" not in env
    assert env["PATH"].startswith(str(tmp_path))


def test_clean_text() -> None:
    assert clean_text("a\nb\x00c   d") == "a b c d"
    assert len(clean_text("x" * 5000)) == 1000
    assert os.linesep not in clean_text("l1" + os.linesep + "l2")
