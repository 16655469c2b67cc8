"""Hostile inputs to the job-maps boundary (issue 42): a user who runs jobs on the node
tries to claim another job's step, or to have a consistent job called mixed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from inventoryd.node.jobmaps import Scanner
from inventoryd.node.procfs import step_dir_of_cgroup, step_of_cgroup

ROOT_STAT = "1 (x) S 0 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 100 0 0\n"


def _proc(root: Path, pid: int, *, ppid: int, uid: int, cmdline: bytes = b"x\0",
          cgroup: str = "0::/\n", uids: tuple[int, int, int, int] | None = None,
          maps: str = "", comm: str | None = None) -> None:
    """One fake /proc/PID laid out as the kernel lays it out: the directory owned by the
    process's effective uid, ``status`` with its real, effective, saved and fs uids,
    ``stat`` with its name (``comm``: by default ``slurmstepd`` for a process of that
    title, else ``x``)."""
    d = root / str(pid)
    d.mkdir()
    if comm is None:
        comm = "slurmstepd" if cmdline.startswith(b"slurmstepd:") else "x"
    (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 0 0 0 0 0 0 0 0 0 20 0 "
                            "1 0 100 0 0\n")
    (d / "cmdline").write_bytes(cmdline)
    (d / "cgroup").write_text(cgroup)
    (d / "maps").write_text(maps)
    r = uids or (uid, uid, uid, uid)
    (d / "status").write_text(f"Name:\tx\nUid:\t{r[0]}\t{r[1]}\t{r[2]}\t{r[3]}\n")
    os.chown(d, uid, uid)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown of a fake /proc needs root")


# ---- a cgroup path whose name holds a line separator other than "\n"


def test_a_cgroup_name_with_a_record_separator_claims_no_slurm_step() -> None:
    # The kernel refuses "\n" in a cgroup's name but not "\x1e" (nor \x0b, \x0c, \x1c,
    # \x1d, \x85, U+2028), and /proc/PID/cgroup prints the path as it is. A user in their
    # delegated subtree (user@UID.service) makes ``x\x1e0::/system.slice/slurmstepd.scope/
    # job_999/step_0`` and puts a process in it: str.splitlines() made a second line of
    # it, anchored at Slurm's own directory.
    for sep in ("\x1e", "\x1c", "\x0b", "\x0c", "\x85", "\u2028", "\r"):
        text = ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/x" + sep
                + "0::/system.slice/slurmstepd.scope/job_999/step_0\n")
        assert step_of_cgroup(text) is None, repr(sep)
        assert step_dir_of_cgroup(text) is None, repr(sep)
        v1 = "4:memory:/user.slice/x" + sep + "4:memory:/slurm/uid_0/job_999/step_0\n"
        assert step_of_cgroup(v1) is None, repr(sep)
    # the real lines still name their step
    assert step_of_cgroup("0::/system.slice/slurmstepd.scope/job_7/step_0/user/task_0\n"
                          ) == ("7", "0")
    assert step_of_cgroup("12:pids:/\n4:memory:/slurm/uid_1000/job_7/step_batch/task_0\n"
                          ) == ("7", "batch")


@needs_root
def test_a_process_in_a_crafted_cgroup_is_not_counted_in_another_job(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    _proc(proc, 1, ppid=0, uid=0)
    _proc(proc, 500, ppid=1, uid=1000, cgroup=(
        "0::/user.slice/user-1000.slice/user@1000.service/x\x1e0::/system.slice/"
        "slurmstepd.scope/job_999/step_0\n"))
    assert Scanner("n1", proc=str(proc)).steps() == {}


# ---- a title of slurmstepd on a process whose effective uid only is root


@needs_root
def test_a_setuid_process_titled_slurmstepd_adopts_no_one(tmp_path: Path) -> None:
    # A user runs a set-user-ID root program that forks and waits (su to themself, with
    # their own password) with argv[0] "slurmstepd: [999.0]" (exec -a): its /proc/PID is
    # owned by its effective uid, root, and its title is a step's. Its children, the
    # user's, were taken for job 999's (proctrack/linuxproc, or any process outside a
    # step's cgroup): the user's libnccl then made job 999 look mixed.
    proc = tmp_path / "proc"
    proc.mkdir()
    _proc(proc, 1, ppid=0, uid=0)
    # (run through a symlink named slurmstepd: the kernel names the process by it)
    _proc(proc, 600, ppid=1, uid=0, uids=(1000, 0, 0, 0),
          cmdline=b"slurmstepd: [999.0]\0/bin/su\0", comm="slurmstepd")
    _proc(proc, 601, ppid=600, uid=1000)
    assert Scanner("n1", proc=str(proc)).steps() == {}
    # a real slurmstepd (root in all four) still names its step's processes
    _proc(proc, 700, ppid=1, uid=0, cmdline=b"slurmstepd: [5.0]\0\0\0")
    _proc(proc, 701, ppid=700, uid=1000)
    got = Scanner("n1", proc=str(proc)).steps()
    assert list(got) == [("5", "0")] and got[("5", "0")].pids == [701]


# ---- a node's record older than another's: the net not chosen yet, or the node gone


def _lib(kind: str, sha: str, **kw: object) -> dict[str, object]:
    lib: dict[str, object] = {"kind": kind, "path": f"/opt/{kind}/lib{kind}.so", "dev": "fd:1",
                              "ino": 1, "size": 1, "sha256": sha * 64, "version": None,
                              "abis": [], "name": None, "error": None}
    lib.update(kw)
    return lib


def _doc(host: str, at: float, libs: list[dict[str, object]], since: float) -> dict[str, object]:
    return {"ncclguard_loaded": 1, "host": host, "scanned_at": at, "complete": True,
            "steps": [{"job": "42", "step": "0", "uid": 1000, "procs": 4, "since": since,
                       "cut": False, "libs": libs}]}


def test_a_node_scanned_before_nccl_set_up_its_net_is_not_called_mixed(tmp_path: Path) -> None:
    # Both nodes imported torch (libnccl mapped) at t=0 and set up NCCL's net at t=96 with
    # the same net plugin. n2 was scanned at t=95, before it; n1 at t=99, after it. The
    # collector judged at t=100 with n2's record of t=95: n2's libnccl mapped for 100 s
    # (over settle_s), no net plugin: "a net plugin on some nodes only", job requeued. A
    # node's record from before the other's is no evidence that its net differs; nor is
    # the time since it mapped libnccl counted past its own scan (a node gone silent).
    from inventoryd.controller.runtime import Runtime
    from ncclguard.config import Config
    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    nccl = _lib("nccl", "a", version="2.21.5", abis=[8, 7])
    net = _lib("net", "b", abis=[8], name="IB")
    with Inventory(tmp_path / "db.sqlite", values=GATE_VALUES) as inv:
        rt = Runtime(Config(), inv)
        rt.pending |= inv.write_loaded([("n2", _doc("n2", 95.0, [nccl], 0.0), 95.0)])
        assert rt.judge_pending(now=95.5) == []
        rt.pending |= inv.write_loaded([("n1", _doc("n1", 99.0, [nccl, net], 0.0), 99.0)])
        assert rt.judge_pending(now=100.0) == []
        assert inv.mixed_steps("42") == []
        # n2's next record shows the plugin: consistent
        rt.pending |= inv.write_loaded([("n2", _doc("n2", 110.0, [nccl, net], 0.0), 110.0)])
        assert rt.judge_pending(now=110.5) == []
        assert inv.mixed_steps("42") == []


def test_a_node_really_without_the_net_plugin_is_still_found(tmp_path: Path) -> None:
    # the other side: n2's own transport, seen after n1's plugin, in a record of its own
    # taken settle_s after it mapped libnccl, is mixed, found once n2's newer record came
    from inventoryd.controller.runtime import Runtime
    from ncclguard.config import Config
    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    nccl = _lib("nccl", "a", version="2.21.5", abis=[8, 7])
    net = _lib("net", "b", abis=[8], name="IB")
    with Inventory(tmp_path / "db.sqlite", values=GATE_VALUES) as inv:
        rt = Runtime(Config(), inv)
        rt.pending |= inv.write_loaded([("n2", _doc("n2", 95.0, [nccl], 0.0), 95.0)])
        rt.pending |= inv.write_loaded([("n1", _doc("n1", 99.0, [nccl, net], 0.0), 99.0)])
        assert rt.judge_pending(now=100.0) == []
        # n2's libraries unchanged in its next record: judged again all the same
        rt.pending |= inv.write_loaded([("n2", _doc("n2", 110.0, [nccl], 0.0), 110.0)])
        found = rt.judge_pending(now=110.5)
        assert [(j, s, v.kind, v.odd) for j, s, v in found] == [("42", "0", "net-missing",
                                                                 ("n2",))]


# ---- the collector acting twice on one job


class _Slurm:
    """A Slurm whose job 42 is a running batch job; the calls made, kept."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []

    def job(self, job: str) -> object:
        from types import SimpleNamespace

        return SimpleNamespace(state="RUNNING", batch=True, partition="", user="u",
                               user_id=1000, comment="", raw={}, node_count=2, end_time=None,
                               nodes="n[1-2]")

    def set_admin_comment(self, job: str, text: str) -> None:
        self.calls.append(("admin_comment", [job]))

    def run(self, cmd: str, args: list[str]) -> None:
        self.calls.append((cmd, args))

    def notify(self, job: str, text: str) -> None:
        self.calls.append(("notify", [job]))


def test_a_job_acted_on_is_not_acted_on_again_for_another_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Job 42 found mixed in step 0 and requeued; its next run (the same job id) found mixed
    # in step 1: requeued again, and the second action recorded nowhere (at most one is
    # kept per job), so neither `decisions --job` nor the metrics said so.
    from inventoryd.controller import runtime as rtmod
    from ncclguard.config import Config
    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    monkeypatch.setattr(rtmod.Runtime, "_steer", lambda self, job, odd: None)
    monkeypatch.setattr(rtmod.Runtime, "_exempt", lambda self, info: None)
    cfg = Config()
    cfg = cfg.replace(runtime=cfg.runtime.replace(on_mixed="requeue"))
    slurm = _Slurm()
    a, b = _lib("nccl", "a", version="2.21.5"), _lib("nccl", "c", version="2.18.3")
    with Inventory(tmp_path / "db.sqlite", values=GATE_VALUES) as inv:
        rt = rtmod.Runtime(cfg, inv, slurm)  # type: ignore[arg-type]
        for step, at in (("0", 10.0), ("1", 500.0)):
            for host, lib in (("n1", a), ("n2", b)):
                doc = _doc(host, at, [lib], at)
                doc["steps"][0]["step"] = step  # type: ignore[index]
                rt.pending |= inv.write_loaded([(host, doc, at)])
            assert [s for _, s, _ in rt.judge_pending(now=at + 1)] == [step]
        assert [c for c in slurm.calls if c[0] == "scontrol"] == [("scontrol", ["requeue", "42"])]


def test_what_jobs_loaded_never_costs_the_node_its_fingerprint(
    tmp_path: Path, node_munged: Any,
) -> None:
    """A node's record with a full ``loaded`` part (a user's steps with the longest paths
    the quota allows) over ``[spool] max_record_bytes``: published without it, the
    fingerprint whole, and why said (before: the record was written too large and the
    collector rejected it, fingerprint and all)."""
    from helpers.fingerprints import fingerprint

    from inventoryd.node.publish import Publisher
    from ncclguard import spool
    from ncclguard.config import SpoolConfig
    from ncclguard.fingerprint.loaded import LIBS_PER_STEP, MAX_PATH, loaded_problem

    def lib() -> dict[str, Any]:  # a path munged's compression cannot shrink much
        return {"kind": "nccl", "path": "/" + os.urandom(MAX_PATH // 2 - 1).hex(),
                "dev": "fd:1", "ino": 1, "size": None, "sha256": None, "version": None,
                "abis": [], "name": None, "error": "cannot read: Permission denied"}

    steps = [{"job": str(j), "step": "0", "uid": 1000, "procs": 1, "since": None,
              "cut": False, "libs": [lib() for _ in range(LIBS_PER_STEP)]}
             for j in range(1, 40)]
    doc = {"ncclguard_loaded": 1, "host": "n1", "scanned_at": 1.0, "complete": False,
           "steps": steps}
    while loaded_problem(doc) is not None:
        doc["steps"] = doc["steps"][:-1]
    fp = fingerprint("n1")
    sock = str(node_munged("n1").socket)
    plain = Publisher(SpoolConfig(dir=str(tmp_path / "a"), munge_socket=sock), 300)
    size = plain.publish(fp).stat().st_size
    pub = Publisher(SpoolConfig(dir=str(tmp_path / "b"), munge_socket=sock,
                                max_record_bytes=size + 4096), 300)
    path = pub.publish(fp, loaded=doc)
    assert pub.loaded_left_out is not None and "max_record_bytes" in pub.loaded_left_out
    assert path.stat().st_size <= size + 4096
    from ncclguard.munge import decode

    rec = spool.parse_payload(decode(path.read_bytes().strip(), socket_path=sock).payload,
                              max_bytes=1 << 22)
    assert rec.loaded is None and rec.fingerprint["host"]["hostname"] == "n1"
    # with room, it goes with the record
    roomy = Publisher(SpoolConfig(dir=str(tmp_path / "c"), munge_socket=sock), 300)
    rec = spool.parse_payload(decode(roomy.publish(fp, loaded=doc).read_bytes().strip(),
                                     socket_path=sock).payload, max_bytes=1 << 22)
    assert roomy.loaded_left_out is None and rec.loaded == doc


@needs_root
def test_a_pid_reused_between_discovery_and_its_maps_is_not_the_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Step 5.0's process 701 ends after the scan found it; its pid goes to another
    process (of a user's, mapping their own libnccl) before its maps are read. Before: the
    other process's libraries were put down as step 5.0's. Now: its start time (``stat``
    field 22) is read again after the maps, and a changed one leaves them out."""
    from inventoryd.node import jobmaps

    proc = tmp_path / "proc"
    proc.mkdir()
    _proc(proc, 1, ppid=0, uid=0)
    _proc(proc, 700, ppid=1, uid=0, cmdline=b"slurmstepd: [5.0]\0\0\0")
    maps = "7f-8f r-xp 0 fd:01 12 /home/u/v/libnccl.so.2\n"
    _proc(proc, 701, ppid=700, uid=1000, maps=maps)
    read = jobmaps.read_maps

    def reused(path: Path, limit: int) -> tuple[list[jobmaps.Mapping], int, bool]:
        out = read(path, limit)  # the maps read are the new process's: it started later
        stat = proc / "701" / "stat"
        stat.write_text(stat.read_text().replace(" 100 0 0", " 999 0 0"))
        return out

    monkeypatch.setattr(jobmaps, "read_maps", reused)
    assert Scanner("n1", proc=str(proc)).scan()["steps"] == []
    monkeypatch.setattr(jobmaps, "read_maps", read)  # the same process all along: listed
    (proc / "701" / "stat").write_text(
        (proc / "701" / "stat").read_text().replace(" 999 0 0", " 100 0 0"))
    (st,) = Scanner("n1", proc=str(proc)).scan()["steps"]
    assert (st["job"], st["libs"][0]["path"]) == ("5", "/home/u/v/libnccl.so.2")


@needs_root
def test_a_process_whose_nccl_opened_its_net_plugin_is_read_once(tmp_path: Path) -> None:
    """Bounded work per scan (docs/runtime.md, "Bounds"): a process that mapped libnccl
    and its net plugin has nothing more to show, and its maps are not read again while it
    lives (counted in bytes read); one with libnccl only is read every scan (its plugin may
    come); a pid reused is read anew."""
    proc = tmp_path / "proc"
    proc.mkdir()
    _proc(proc, 1, ppid=0, uid=0)
    _proc(proc, 700, ppid=1, uid=0, cmdline=b"slurmstepd: [5.0]\0")
    both = ("7f-8f r-xp 0 fd:01 12 /v/libnccl.so.2\n"
            "8f-9f r-xp 0 fd:01 13 /opt/p/libnccl-net.so\n")
    _proc(proc, 701, ppid=700, uid=1000, maps=both)
    _proc(proc, 702, ppid=700, uid=1000, maps="7f-8f r-xp 0 fd:01 12 /v/libnccl.so.2\n")
    sc = Scanner("n1", proc=str(proc))
    first = sc.scan()
    read_first = sc.stats["maps_bytes"]
    assert read_first == len(both) + len("7f-8f r-xp 0 fd:01 12 /v/libnccl.so.2\n")
    second = sc.scan()
    assert sc.stats["maps_bytes"] == read_first - len(both)  # 702 only
    assert [lib["path"] for lib in second["steps"][0]["libs"]] == [
        lib["path"] for lib in first["steps"][0]["libs"]] == ["/opt/p/libnccl-net.so",
                                                              "/v/libnccl.so.2"]
    stat = proc / "701" / "stat"  # 701 ended; its pid reused by a process started later
    stat.write_text(stat.read_text().replace(" 100 0 0", " 200 0 0"))
    (proc / "701" / "maps").write_text("")
    sc.scan()
    assert sc.stats["maps_bytes"] == read_first - len(both)  # both read again, 701's empty
    assert list(sc.settled) == []
