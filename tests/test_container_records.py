"""The enroot hook's container records (``<spool>/containers``, issue 25): only the owner
of a job that ran on the node can write one; each record is checked before anything is
written and a bad one is rejected alone; the directory is scanned bounded and fairly
(no first-N window); an outage of munged defers them; old rows are pruned; every reader
reads every stored shape.

Real munged daemons (one per node, signing from its own address), real files, a real
inventory. Slurm's answer about the job (its owner and nodes) is handed to the collector
here (``ContainerRecords.ask_job``); tests/test_container_gate.py asks a real slurmctld.

Before: any user on a node could publish a record for any job (the uid was not
checked); one record with ``"libnccl": 5`` discarded the scan's whole batch, for good;
odd shapes crashed ``ncclguard decisions --job``; the 4,096 names that sort first
blocked every other record; a munged outage dropped the records it judged."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.cli import run_cli
from helpers.collector import config
from helpers.munge import MungeSet

from devtools.devcluster import Munged
from inventoryd.controller import container_records
from inventoryd.controller.collector import Collector
from ncclguard import munge
from ncclguard.slurm.model import JobInfo
from ncclguard.store import Inventory

OWNER = os.getuid()
OTHER = 65534


def record(host: str, job: str, step: str, **override: Any) -> dict[str, Any]:
    """What inventoryd/node/containerhook.py publishes for one container."""
    rec: dict[str, Any] = {
        "ncclguard_container_record": 1, "host": host, "job": job, "step": step,
        "libnccl": [{"path": "/usr/lib/x86_64-linux-gnu/libnccl.so.2",
                     "realpath": "/usr/lib/x86_64-linux-gnu/libnccl.so.2.18.3",
                     "version": "2.18.3", "sha256": "ab" * 32, "default": True}],
        "net": {"plugin": None, "name": None, "abi": None, "reason": "no net plugin"},
        "nccl_conf": {}, "errors": [],
    }
    rec.update(override)
    return rec


def put(ms: MungeSet, d: Path, host: str, job: str, step: str, rec: Any = None, *,
        signer: str | None = None, uid: int = OWNER, raw: bytes | None = None) -> Path:
    """Sign ``rec`` on ``signer``'s munged (default: ``host``'s) as ``uid``, as the hook
    does, into ``<spool>/containers/<host>+<job>+<step>.rec``."""
    data = raw if raw is not None else json.dumps(
        record(host, job, step) if rec is None else rec).encode()
    sock = str(ms.node(signer or host).socket)
    if uid == os.getuid():
        cred = munge.encode(data, socket_path=sock)
    else:
        cred = subprocess.run(["munge", "-S", sock, "-z", "zlib"], input=data,
                              capture_output=True, user=uid, check=True).stdout
    path = d / "containers" / f"{host}+{job}+{step}.rec"
    path.write_bytes(cred)
    return path


class Slurm:
    """Slurm's answer about jobs (what ``Slurm.job_owner`` reads: the job's uid and
    nodes), and how often it was asked."""

    def __init__(self, jobs: dict[str, JobInfo]) -> None:
        self.jobs = jobs
        self.asked: list[str] = []

    def __call__(self, job: str) -> JobInfo | None:
        self.asked.append(job)
        return self.jobs.get(job)


def job(job_id: int, nodes: str, uid: int = OWNER) -> JobInfo:
    return JobInfo(job_id, "RUNNING", user="u", user_id=uid, nodes=nodes,
                   batch_host=nodes.split(",")[0])


@pytest.fixture
def env(tmp_path: Path, mungeds: MungeSet) -> Any:
    d = tmp_path / "spool"
    (d / "containers").mkdir(parents=True)
    os.chmod(d, 0o755)
    os.chmod(d / "containers", 0o1733)
    return mungeds, d, tmp_path / "inventory.db"


def collector(ms: MungeSet, d: Path, db: Path, slurm: Slurm, **spool_kw: Any) -> Collector:
    c = Collector(config(ms, d, **spool_kw), db=db)
    c.containers.ask_job = slurm
    return c


def kept(db: Path, job_id: str) -> list[tuple[str, str]]:
    with Inventory(db, readonly=True) as inv:
        return [(r["step"], r["host"]) for r in inv.container_runs(job_id)]


def test_only_the_jobs_owner_on_a_node_the_job_ran_on_is_kept(env: Any) -> None:
    ms, d, db = env
    slurm = Slurm({"7": job(7, "n[1-2]")})
    put(ms, d, "n1", "7", "0")  # the owner, on a node of the job
    put(ms, d, "n2", "7", "0", uid=OTHER)  # another user on a node of the job
    put(ms, d, "n3", "7", "0")  # the owner, on a node the job did not run on
    put(ms, d, "n1", "8", "0")  # a job Slurm does not know
    put(ms, d, "n1", "7", "1", signer="n2")  # n2's munged signing n1's name
    c = collector(ms, d, db, slurm)
    try:
        res = c.containers.scan(c.inv, lambda: False, writable=True)
    finally:
        c.close()
    assert res.accepted == 1 and res.rejected == {
        "n2+7+0.rec": "wrong-uid", "n3+7+0.rec": "wrong-node", "n1+8+0.rec": "unknown-job",
        "n1+7+1.rec": "wrong-address"}
    assert kept(db, "7") == [("0", "n1")]
    assert sorted(set(slurm.asked)) == ["7", "8"] and slurm.asked.count("7") == 1  # cached


BAD: dict[str, Any] = {
    "libnccl-int": {"libnccl": 5},
    "libnccl-of-ints": {"libnccl": [5]},
    "net-str": {"net": "x"},
    "version-int": {"libnccl": [{"path": "/x", "realpath": None, "version": 5,
                                 "sha256": None, "default": True}]},
    "conf-list": {"nccl_conf": ["x"]},
    "errors-dict": {"errors": {}},
    "deep": {"errors": [json.loads("[" * 60 + "]" * 60)]},
    "big-int": {"net": {"plugin": None, "name": None, "abi": 2**70, "reason": None}},
}


def test_one_bad_record_is_rejected_alone_before_anything_is_written(env: Any) -> None:
    """Each odd shape is rejected under its cause; the good records of the same scan are
    kept (before: one ``"libnccl": 5`` discarded the whole scan's records, for good)."""
    ms, d, db = env
    slurm = Slurm({"7": job(7, "n[1-2]")})
    put(ms, d, "n1", "7", "0")
    for i, over in enumerate(BAD.values()):
        put(ms, d, "n1", "7", str(10 + i), record("n1", "7", str(10 + i), **over))
    put(ms, d, "n2", "7", "0")
    put(ms, d, "n2", "7", "1", raw=b"\xff not json")
    put(ms, d, "n2", "7", "2", record("n1", "7", "2"))  # names another node inside
    c = collector(ms, d, db, slurm)
    try:
        res = c.containers.scan(c.inv, lambda: False, writable=True)
    finally:
        c.close()
    assert res.accepted == 2
    causes = {n: cause for n, cause in res.rejected.items()}
    assert causes.pop("n1+7+16.rec") == "too-deep"
    assert causes.pop("n2+7+2.rec") == "name-mismatch"
    assert set(causes.values()) == {"malformed"} and len(causes) == len(BAD) - 1 + 1
    assert kept(db, "7") == [("0", "n1"), ("0", "n2")]
    audit = d.parent / "audit.jsonl"
    audit.write_text(json.dumps({"job": 7, "decision": "accept", "action": "none"}) + "\n")
    r = run_cli("decisions", "--job", "7", "--audit-log", str(audit), db=db)
    assert r.exit_code == 0 and r.output.count("2.18.3") == 2, r.output


def test_every_stored_shape_is_read_by_decisions(env: Any, tmp_path: Path) -> None:
    """Rows written before these checks (by hand here): ``decisions --job`` and the
    inventory read each, an odd one as "unreadable record", and never fail."""
    ms, d, db = env
    c = collector(ms, d, db, Slurm({}))
    c.close()
    rows = [json.dumps(v) for v in ({"libnccl": 5}, [1], "x", {"net": "x", "libnccl": []},
                                    {"libnccl": [{"default": True, "path": 5}]})]
    rows += ["not json", "[" * 5000 + "]" * 5000]
    with sqlite3.connect(db) as conn:
        for i, text in enumerate(rows):
            conn.execute("INSERT INTO container_runs VALUES ('7', ?, 'n1', ?, 0, '10.0.0.1', "
                         "'1:1:1', NULL, ?)", (str(i), time.time(), text))
    audit = tmp_path / "audit.jsonl"
    audit.write_text(json.dumps({"job": 7, "decision": "accept", "action": "none"}) + "\n")
    for fmt in ([], ["--json"]):
        r = run_cli("decisions", "--job", "7", "--audit-log", str(audit), *fmt, db=db)
        assert r.exit_code == 0, (r.output, r.exception)
        assert r.output.count("unreadable record") == len(rows), r.output


def test_no_first_n_window_the_scan_is_bounded_and_fair(env: Any) -> None:
    """6,000 files of another user whose names sort first, half of them past any
    credential's life, half garbage: a good record is kept within two scans (before:
    never, behind the first 4,096 names); each scan stats, reads and asks Slurm within
    its bounds; the old files are never read."""
    ms, d, db = env
    slurm = Slurm({"7": job(7, "n1")})
    old = time.time() - 3 * 3600
    for i in range(6000):
        p = d / "containers" / f"a{i:05d}+{i}+0.rec"
        p.write_bytes(b"garbage")
        os.chown(p, OTHER, OTHER)
        if i % 2:
            os.utime(p, (old, old))
    put(ms, d, "n1", "7", "0")
    c = collector(ms, d, db, slurm)
    try:
        results = [c.containers.scan(c.inv, lambda: False, writable=True) for _ in range(2)]
    finally:
        c.close()
    assert sum(r.accepted for r in results) == 1 and kept(db, "7") == [("0", "n1")]
    for r in results:
        read = [n for n, cause in r.rejected.items() if cause != "expired"]
        assert len(read) <= container_records.READS_PER_SCAN
        assert len(r.rejected) <= container_records.STATS_PER_SCAN
    expired = {n for r in results for n, cause in r.rejected.items() if cause == "expired"}
    assert all(int(n[1:6]) % 2 for n in expired) and len(slurm.asked) <= 2


def test_fresh_names_that_sort_first_before_every_scan_hold_no_record_back(env: Any) -> None:
    """Another user writes 5,000 new garbage files before each scan, named to sort before
    every record (more than a scan looks at): a good record is kept within three scans
    (before: never, since new names were looked at in name order from the first)."""
    ms, d, db = env
    slurm = Slurm({"7": job(7, "n1")})
    put(ms, d, "n1", "7", "0")
    c = collector(ms, d, db, slurm)
    results = []
    try:
        for scan in range(3):
            for i in range(5000):
                p = d / "containers" / f"{9 - scan}{i:05d}+{i}+0.rec"  # "9..", "8..", "7.."
                p.write_bytes(b"garbage")
                os.chown(p, OTHER, OTHER)
            results.append(c.containers.scan(c.inv, lambda: False, writable=True))
            if kept(db, "7"):
                break
    finally:
        c.close()
    assert kept(db, "7") == [("0", "n1")], [len(r.rejected) for r in results]
    for r in results:
        assert len(r.rejected) <= container_records.READS_PER_SCAN


def test_a_munged_outage_defers_the_records(env: Any) -> None:
    """The collector's munged stops mid-way: nothing is judged (nor remembered as
    judged); once it is back, the record is kept (before: dropped for good)."""
    ms, d, db = env
    ctl = Munged(ms.directory, "ctl-outage", ms.key, "127.42.250.7", mode=0o755).start()
    try:
        slurm = Slurm({"7": job(7, "n1")})
        put(ms, d, "n1", "7", "0")
        c = collector(ms, d, db, slurm, munge_socket=str(ctl.socket))
        try:
            ctl.stop()
            res = c.containers.scan(c.inv, lambda: False, writable=True)
            assert res.deferred and "munged" in res.deferred and not res.rejected
            ctl.start()
            res = c.containers.scan(c.inv, lambda: False, writable=True)
            assert res.accepted == 1 and res.deferred is None
        finally:
            c.close()
    finally:
        ctl.stop()
    assert kept(db, "7") == [("0", "n1")]


def test_slurm_unreachable_defers_and_old_rows_are_pruned(env: Any) -> None:
    ms, d, db = env

    def down(_job: str) -> JobInfo:
        raise OSError("scontrol: cannot connect")

    put(ms, d, "n1", "7", "0")
    c = collector(ms, d, db, Slurm({}))
    c.containers.ask_job = down
    try:
        res = c.containers.scan(c.inv, lambda: False, writable=True)
        assert res.deferred and "Slurm" in res.deferred and not res.rejected
        c.containers.ask_job = Slurm({"7": job(7, "n1")})
        c.containers._slurm_failed_at = -float("inf")  # its 30 s pause over
        assert c.containers.scan(c.inv, lambda: False, writable=True).accepted == 1
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE container_runs SET encoded_at = encoded_at - 31 * 86400")
        assert c.inv.prune_container_runs(time.time(), c.cfg.inventory.container_days) == 1
    finally:
        c.close()
    assert kept(db, "7") == []


def test_at_most_so_many_steps_of_one_job_on_one_node(env: Any) -> None:
    ms, d, db = env
    slurm = Slurm({"7": job(7, "n1")})
    c = collector(ms, d, db, slurm)
    try:
        n = container_records.STEPS_PER_JOB
        runs = [{"job": "7", "step": str(i), "host": "n1", "encoded_at": 1.0, "uid": OWNER,
                 "origin": "x", "file_state": "1:1:1", "nccl_version": None,
                 "record": record("n1", "7", str(i))} for i in range(n + 1)]
        statuses = c.inv.write_container_runs(runs, max_steps=n)
        assert statuses[:n] == ["written"] * n and statuses[n].startswith("over-quota")
    finally:
        c.close()


def test_a_restarted_collector_reaches_every_file(env: Any) -> None:
    """Stored records are known after a restart from the inventory: each scan looks at
    the next files, so that a new record behind 5,000 stored ones and 5,000 names that
    are no record's is reached (names that are no record's are never looked at)."""
    ms, d, db = env
    slurm = Slurm({"7": job(7, "n1"), "8": job(8, "n1")})
    put(ms, d, "n1", "7", "0")
    c = collector(ms, d, db, slurm)
    try:
        assert c.containers.scan(c.inv, lambda: False, writable=True).accepted == 1
        runs = [{"job": "7", "step": f"s{i:05d}", "host": "n1", "encoded_at": time.time(),
                 "uid": OWNER, "origin": "x", "file_state": "", "nccl_version": None,
                 "record": record("n1", "7", f"s{i:05d}")} for i in range(5000)]
        for r in runs:
            p = d / "containers" / f"n1+7+{r['step']}.rec"
            p.write_bytes(b"stored")
            st = os.stat(p)
            r["file_state"] = f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
        assert c.inv.write_container_runs(runs) == ["written"] * 5000
        for i in range(5000):
            (d / "containers" / f"a{i:05d}.junk").write_bytes(b"x")
    finally:
        c.close()
    put(ms, d, "n1", "8", "zz")  # sorts after every stored one
    c = collector(ms, d, db, slurm)  # restarted: what it knew is the inventory's
    try:
        got = [c.containers.scan(c.inv, lambda: False, writable=True) for _ in range(3)]
    finally:
        c.close()
    assert sum(r.accepted for r in got) == 1 and kept(db, "8") == [("zz", "n1")]
    assert not any(r.rejected for r in got)  # the stored ones are not read again


def test_slurm_is_asked_about_a_bounded_number_of_jobs_a_scan(env: Any) -> None:
    """20 records of 20 jobs: each scan asks Slurm about at most JOBS_PER_SCAN of them
    (the rest wait); records that fail before Slurm is asked (another node's munged)
    cost no lookup."""
    ms, d, db = env
    n = container_records.JOBS_PER_SCAN
    slurm = Slurm({str(j): job(j, "n1") for j in range(100, 120)})
    for j in range(100, 120):
        put(ms, d, "n1", str(j), "0")
    for j in range(200, 220):
        put(ms, d, "n1", str(j), "0", signer="n2")  # wrong-address: no lookup
    c = collector(ms, d, db, slurm)
    try:
        kept_by_scan = []
        for _ in range(3):
            before = len(slurm.asked)
            res = c.containers.scan(c.inv, lambda: False, writable=True)
            assert len(slurm.asked) - before <= n
            kept_by_scan.append(res.accepted)
    finally:
        c.close()
    assert kept_by_scan == [n, n, 20 - 2 * n] and len(set(slurm.asked)) == 20
