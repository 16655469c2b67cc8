"""The gate without a cluster: Job from env, the audit file, error outcomes, the deadline.

The gate runs as a real process (``python -I -m prolog.gate``), as Slurm would start it.
Slurm commands, where a path needs them, are absent or stand-ins that hang.

Over 500 lines: the gate as a real process without a cluster, every outcome of one run
(the environment, the audit, the errors, the deadline) with one set of stand-ins
(tests/helpers/gate.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.gate import ENV, inventory, last, run_gate
from helpers.wait import wait_until

from ncclguard import audit
from prolog.job import Job, JobError

# ---------------------------------------------------------------------------- Job


def test_job_from_env() -> None:
    job = Job.from_env({**ENV, "SLURM_JOB_STDOUT": "/x", "SLURM_JOB_RESTART_COUNT": "2"})
    assert job.job_id == 77 and job.nodes == ("n1", "n2", "n3") and job.num_nodes == 3
    assert job.batch and job.restart_count == 2 and job.uid == 1000 and job.user == "alice"
    assert not Job.from_env(ENV).batch
    # a plain sbatch (no -o/-e): 22.05 sets SLURM_JOB_STDIN=/dev/null and no STDOUT
    assert Job.from_env({**ENV, "SLURM_JOB_STDIN": "/dev/null"}).batch


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SLURM_JOB_NODELIST": "n[1-3"}, "invalid hostlist 'n[1-3'"),
        ({"SLURM_JOB_NODELIST": ""}, "SLURM_JOB_NODELIST is empty"),
        ({"SLURM_JOB_ID": ""}, "not a job id"),
        ({"SLURM_JOB_ID": "12; rm"}, "not a job id"),
        ({"SLURM_JOB_NUM_NODES": "4"}, "names 3 nodes but SLURM_JOB_NUM_NODES=4"),
    ],
)
def test_job_from_bad_env(env: dict[str, str], message: str) -> None:
    with pytest.raises(JobError, match=message.replace("[", r"\[")):
        Job.from_env({**ENV, **env})


@pytest.mark.parametrize(
    ("comment", "extra", "off"),
    [
        ("ncclguard=off", "", True),
        ("debug run, ncclguard=off", "", True),
        ("", "ncclguard=OFF", True),
        ("ncclguard=offline", "", False),
        ("xncclguard=off", "", False),
        ("", "", False),
    ],
)
def test_opt_out(comment: str, extra: str, off: bool) -> None:
    env = {**ENV, "SLURM_JOB_COMMENT": comment, "SLURM_JOB_EXTRA": extra}
    assert Job.from_env(env).opted_out is off


# ---------------------------------------------------------------------------- audit


def test_audit_append_and_read(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "decisions.jsonl"
    audit.append(path, {"job": 1, "decision": "accept"})
    audit.append(path, {"job": 2, "decision": "refuse"})
    with open(path, "a") as f:
        f.write('{"job": 3, "decis')  # a torn line is skipped, not fatal
    audit.append(path, {"job": 2, "decision": "followup"})
    assert (path.stat().st_mode & 0o777) == 0o640
    assert [r["job"] for r in audit.read(path)] == [1, 2, 2]
    assert [r["decision"] for r in audit.read(path, job=2)] == ["refuse", "followup"]
    assert [r["job"] for r in audit.read(path, refused=True)] == [2]
    assert audit.read(path, since=time.time() + 60) == []
    assert len(audit.read(path, since="2000-01-01T00:00:00Z")) == 3
    # a job refused by a gate error (on_error = refuse) is a refusal too; fail-open is not
    audit.append(path, {"job": 4, "decision": "error", "action": "refuse"})
    audit.append(path, {"job": 5, "decision": "error", "action": "accept"})
    assert [r["job"] for r in audit.read(path, refused=True)] == [2, 4]
    assert audit.read(tmp_path / "none.jsonl") == []
    with pytest.raises(ValueError, match="'yesterday': expected an age"):
        audit.read(path, since="yesterday")


def test_audit_refuses_unsafe_paths(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    with pytest.raises(audit.AuditError, match="cannot open"):
        audit.append(link, {"job": 1})
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(audit.AuditError, match="writable by everyone"):
        audit.append(open_dir / "d.jsonl", {"job": 1})
    assert target.read_text() == ""


def test_audit_concurrent_appends_stay_whole(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    code = (
        "import sys; from ncclguard import audit\n"
        "for i in range(100): audit.append(sys.argv[1], {'job': i, 'pad': 'x' * 3000})\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)]) for _ in range(4)]
    assert all(p.wait(60) == 0 for p in procs)
    assert len(audit.read(path)) == 400


# ---------------------------------------------------------------------------- gate


def test_accept_makes_no_slurm_call(tmp_path: Path) -> None:
    inventory(tmp_path)
    empty = tmp_path / "bin"
    empty.mkdir()
    r, _ = run_gate(tmp_path, f'slurm_bin_dir = "{empty}"')
    assert r.returncode == 0, r.stderr
    assert "accept n[1-3]" in r.stderr and "ERROR" not in r.stderr
    assert last(tmp_path)["decision"] == "accept"


@pytest.mark.parametrize(
    ("setup", "what"),
    [
        ("missing", "inventory"),
        ("corrupt", "inventory"),
        ("badlist", "job"),
        ("badconfig", "config"),
    ],
)
def test_errors_fail_open_loudly(tmp_path: Path, setup: str, what: str) -> None:
    env: dict[str, str] = {}
    config = ""
    if setup == "corrupt":
        (tmp_path / "inventory.db").write_bytes(b"garbage" * 1000)
    elif setup == "badlist":
        inventory(tmp_path)
        env = {"SLURM_JOB_NODELIST": "n[1-3"}
    elif setup == "badconfig":
        config = "deadline_s = -1"
    r, _ = run_gate(tmp_path, config, env)
    assert r.returncode == 0
    assert f"ERROR: {what}:" in r.stderr and "-> accept (gate.on_error = accept)" in r.stderr
    if setup != "badconfig":  # a broken config cannot say where the audit goes
        rec = last(tmp_path)
        assert rec["decision"] == "error" and rec["error"].startswith(what)


def test_errors_fail_closed_when_configured(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    r, _ = run_gate(tmp_path, f'on_error = "refuse"\nslurm_bin_dir = "{empty}"')
    assert r.returncode == 1
    assert "-> refuse (gate.on_error = refuse)" in r.stderr
    assert "scontrol: not found" in r.stderr  # the comment could not be set: said so


def test_locked_inventory_fails_open_within_the_deadline(tmp_path: Path) -> None:
    import sqlite3

    inventory(tmp_path)
    conn = sqlite3.connect(tmp_path / "inventory.db")
    conn.execute("BEGIN EXCLUSIVE")
    try:
        r, dt = run_gate(tmp_path, "deadline_s = 2")
    finally:
        conn.rollback()
        conn.close()
    assert r.returncode == 0
    assert "ERROR: inventory" in r.stderr or "ERROR: deadline" in r.stderr
    assert dt < 5


def test_deadline_bounds_hanging_slurm_commands(tmp_path: Path) -> None:
    inventory(tmp_path, {"n3": "2.18.3"})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("scontrol", "squeue", "sinfo"):
        p = bin_dir / name
        p.write_text("#!/bin/sh\nexec sleep 60\n")
        p.chmod(0o700)
    r, dt = run_gate(tmp_path, f'deadline_s = 1.5\nslurm_bin_dir = "{bin_dir}"')
    assert dt < 4, r.stderr
    assert "timed out" in r.stderr or "no time left" in r.stderr or "deadline" in r.stderr
    assert r.returncode == 1  # the refusal itself stands; only the Slurm calls were cut


def test_unguarded_partition_is_not_checked(tmp_path: Path) -> None:
    r, _ = run_gate(tmp_path, '[policy]\npartitions = ["gpu"]')
    assert r.returncode == 0  # no inventory at all, and no error: not even opened
    rec = last(tmp_path)
    assert rec["action"] == "skip" and "not guarded" in rec["summary"]


def test_interactive_refusal_exits_nonzero(tmp_path: Path) -> None:
    inventory(tmp_path, {"n3": "2.18.3"})
    empty = tmp_path / "bin"
    empty.mkdir()
    r, _ = run_gate(tmp_path, f'slurm_bin_dir = "{empty}"')
    assert r.returncode == 1
    rec = last(tmp_path)
    assert rec["decision"] == "refuse" and rec["action"] == "kill" and rec["odd_nodes"] == ["n3"]
    assert rec["user"] == "alice" and rec["nodes"] == "n[1-3]"


def test_tie_break_without_slurm_keeps_the_inventory_majority(tmp_path: Path) -> None:
    """n3 (odd) + n4: either could go. Slurm is absent, so the partition's nodes are
    unknown: the whole inventory's majority (2.21.5: n1, n2, n4) keeps n4."""
    inventory(tmp_path, {"n3": "2.18.3"})
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {"SLURM_JOB_NODELIST": "n[3-4]", "SLURM_JOB_NUM_NODES": "2"}
    r, _ = run_gate(tmp_path, f'slurm_bin_dir = "{empty}"', env)
    assert r.returncode == 1
    assert "tie-break: partition nodes unknown" in r.stderr
    rec = last(tmp_path)
    assert rec["decision"] == "refuse" and rec["odd_nodes"] == ["n3"]
    assert rec["tie_break"] == "majority class of the inventory (3 nodes)"
    assert rec["summary"].startswith("ncclguard: refuse, odd n3:")


def test_no_tie_no_tie_break(tmp_path: Path) -> None:
    inventory(tmp_path, {"n3": "2.18.3"})
    empty = tmp_path / "bin"
    empty.mkdir()
    r, _ = run_gate(tmp_path, f'slurm_bin_dir = "{empty}"')
    assert r.returncode == 1 and "tie-break" not in r.stderr
    assert "tie_break" not in last(tmp_path)


def test_gate_does_not_import_heavy_modules(tmp_path: Path) -> None:
    inventory(tmp_path)
    code = (
        "import sys; from prolog.gate import main; rc = main();"
        "heavy = ('click', 'sqlite_utils', 'subprocess', 'psutil', 'elftools', 'devtools',"
        " 'inventoryd', 'ncclguard.cli', 'ncclguard.diagnose', 'ncclguard.policy.drain',"
        " 'ncclguard.policy.fpdiff', 'ncclguard.slurm', 'prometheus_client');"
        "print(sorted(m for m in sys.modules if m == 'hashlib' or m.startswith(heavy)))"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "NCCLGUARD_DB": str(tmp_path / "inventory.db"),
        "NCCLGUARD_CONFIG": str(tmp_path / "c.toml"),
        **ENV,
    }
    (tmp_path / "c.toml").write_text(f'[gate]\naudit_log = "{tmp_path / "a.jsonl"}"\n')
    r = subprocess.run([sys.executable, "-I", "-c", code], env=env, capture_output=True, text=True)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr
    assert os.path.exists(tmp_path / "a.jsonl")


# ------------------------------------------------------------ review fixes: no hang, no loop


def _fake_slurm(tmp_path: Path, script: str) -> Path:
    """Stand-ins for scontrol/squeue/sinfo that log their arguments, then run ``script``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "slurm-calls.log"
    for name in ("scontrol", "squeue", "sinfo"):
        p = bin_dir / name
        p.write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\n{script}\n')
        p.chmod(0o700)
    return bin_dir


def test_a_held_audit_lock_cannot_hang_the_gate(tmp_path: Path) -> None:
    """Another writer holding the audit file's lock costs the record, never the deadline."""
    import fcntl

    inventory(tmp_path)
    path = tmp_path / "audit.jsonl"
    audit.append(path, {"job": 1, "decision": "accept"})
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        r, dt = run_gate(tmp_path, "deadline_s = 1", timeout=20)
    assert r.returncode == 0 and dt < 4, r.stderr
    assert "locked by another writer" in r.stderr
    assert [x["job"] for x in audit.read(path)] == [1]  # nothing torn, nothing half-written


def test_audit_refuses_a_sticky_world_writable_directory(tmp_path: Path) -> None:
    tmpdir_like = tmp_path / "tmp"
    tmpdir_like.mkdir()
    tmpdir_like.chmod(0o1777)
    with pytest.raises(audit.AuditError, match="writable by everyone"):
        audit.append(tmpdir_like / "decisions.jsonl", {"job": 1})


@pytest.mark.parametrize(("mode", "refused"), [(0o757, True), (0o775, False), (0o755, False)])
def test_audit_directory_refused_for_the_other_write_bit_only(
    tmp_path: Path, mode: int, refused: bool
) -> None:
    """Our own directory, writable by its group: fine; by others: refused (0o777 and
    0o1777 above have both bits, so a check of the group bit hid)."""
    d = tmp_path / "audit"
    d.mkdir()
    d.chmod(mode)
    if refused:
        with pytest.raises(audit.AuditError, match="writable by everyone"):
            audit.append(d / "decisions.jsonl", {"job": 1})
    else:
        audit.append(d / "decisions.jsonl", {"job": 1})
        assert [r["job"] for r in audit.read(d / "decisions.jsonl")] == [1]


def test_an_oversized_record_drops_fields_and_stays_valid_json(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    big = {"rule": "x", "message": "y" * 5000}
    audit.append(path, {"job": 5, "decision": "refuse", "findings": [big] * 40,
                        "summary": "s" * 200_000})
    (rec,) = audit.read(path)  # read() skips lines that are not JSON: this one is whole
    assert rec["job"] == 5 and rec["decision"] == "refuse" and rec["truncated"] is True
    assert "findings" not in rec and len(rec["summary"]) == 1000


def test_a_failed_steering_check_requeues_without_steering(tmp_path: Path) -> None:
    """Without the BadConstraints check, an ExcNodeList could strand the job: requeue."""
    inventory(tmp_path, {"n3": "2.18.3"})
    bin_dir = _fake_slurm(tmp_path, 'echo "slurm_load_jobs error: Socket timed out" >&2\nexit 1')
    r, _ = run_gate(tmp_path, f'slurm_bin_dir = "{bin_dir}"', {"SLURM_JOB_STDOUT": "/o"})
    assert r.returncode == 1
    assert "steering check failed" in r.stderr
    rec = last(tmp_path)
    assert rec["decision"] == "refuse" and rec["action"] == "requeue", rec


_PART = "PartitionName=debug Hidden=NO Nodes={} State=UP"


@pytest.mark.parametrize(
    ("job", "partitions", "said"),
    [("77|PENDING", _PART.format("n[1-4]"), "not five fields: '77|PENDING'"),
     ("77|PENDING|debug||", "PartitionName=debug State=UP",
      "a line without one PartitionName and one Nodes"),
     ("77|PENDING|debug||", _PART.format("n[1-"), "debug has Nodes='n[1-'"),
     ("77|PENDING|debug||", _PART.replace("debug", "other").format("n[1-4]"),
      "no partition 'debug' in Slurm's answer (it names 1)"),
     ("77|PENDING|debug||n[1-", _PART.format("n[1-4]"), "n[1-")],
    ids=["job-fields", "partition-without-nodes", "partition-bad-hostlist",
         "partition-missing", "excluded-bad-hostlist"],
)  # fmt: skip
def test_a_slurm_answer_the_gate_cannot_read_takes_the_same_fall_back(
    tmp_path: Path, job: str, partitions: str, said: str
) -> None:
    """A garbled answer to the gate's narrow reads (the job's placement, the partitions'
    node lists): the steering check fails with an error that names what was wrong, and
    the job is requeued without steering, as for any failed Slurm call (never "internal
    error -> accept"); the AdminComment is still set."""
    inventory(tmp_path, {"n3": "2.18.3"})
    (tmp_path / "job.txt").write_text(job + "\n")
    (tmp_path / "parts.txt").write_text(partitions + "\n")
    script = (f'case "$*" in *"-o %A|"*) cat {tmp_path / "job.txt"};;\n'
              f'  *"show partition"*) cat {tmp_path / "parts.txt"};; esac\nexit 0')  # fmt: skip
    bin_dir = _fake_slurm(tmp_path, script)
    r, _ = run_gate(tmp_path, f'slurm_bin_dir = "{bin_dir}"\nshared_max_age_s = 0',
                    {"SLURM_JOB_STDOUT": "/o"})
    assert r.returncode == 1, r.stderr
    assert "steering check failed" in r.stderr
    assert said in r.stderr, r.stderr
    rec = last(tmp_path)
    assert rec["decision"] == "refuse" and rec["action"] == "requeue", rec
    calls = (tmp_path / "slurm-calls.log").read_text()
    assert "scontrol update jobid=77 AdminComment=ncclguard: refuse" in calls, calls


def test_fail_closed_holds_a_batch_job_after_max_refusals(tmp_path: Path) -> None:
    """on_error = refuse must not requeue a batch job for ever while the inventory is down."""
    bin_dir = _fake_slurm(tmp_path, 'case "$*" in *"-o %T"*) echo PENDING;; esac\nexit 0')
    config = f'on_error = "refuse"\nmax_refusals = 3\nslurm_bin_dir = "{bin_dir}"'
    batch = {"SLURM_JOB_STDOUT": "/o"}
    log = tmp_path / "slurm-calls.log"
    r, _ = run_gate(tmp_path, config, {**batch, "SLURM_JOB_RESTART_COUNT": "0"})
    assert r.returncode == 1 and "-> hold" not in r.stderr
    assert last(tmp_path)["action"] == "refuse"
    r, _ = run_gate(tmp_path, config, {**batch, "SLURM_JOB_RESTART_COUNT": "2"})
    assert r.returncode == 1 and "-> hold" in r.stderr
    rec = last(tmp_path)
    assert rec["decision"] == "error" and rec["action"] == "hold" and rec["refusal"] == 3
    def followups() -> list[dict]:
        return [x for x in audit.read(tmp_path / "audit.jsonl") if x["decision"] == "followup"]

    # the follow-up is detached: it holds the job once it is PENDING
    wait_until(followups, 15, "the follow-up's audit record",
               detail=lambda: log.read_text() if log.exists() else "no Slurm call")
    calls = log.read_text()
    assert "scontrol hold 77" in calls, calls
    assert "held: refused 3 times" in calls  # the AdminComment says why
    # the first run started no follow-up: one started then would have held the job before
    # this one did (no fixed sleep stands in for "it did not run")
    assert calls.count("scontrol hold 77") == 1 and len(followups()) == 1, calls


def test_fail_closed_hold_is_arranged_even_when_the_deadline_fires(tmp_path: Path) -> None:
    """A cause that recurs on every run would end each run in the deadline handler: the
    hold must be arranged there too (no Slurm command is run from the handler; the
    detached follow-up holds the job), or the job is requeued for ever."""
    from ncclguard import config as configmod
    from prolog import gate

    bin_dir = _fake_slurm(tmp_path, 'case "$*" in *"-o %T"*) echo PENDING;; esac\nexit 0')
    conf = tmp_path / "gate.toml"
    conf.write_text(f'[gate]\naudit_log = "{tmp_path / "audit.jsonl"}"\non_error = "refuse"\n'
                    f'max_refusals = 2\nslurm_bin_dir = "{bin_dir}"\n')
    run = gate.Run({**ENV, "SLURM_JOB_STDIN": "/dev/null", "SLURM_JOB_RESTART_COUNT": "1"})
    run.config = configmod.load(conf)
    assert run.fail("deadline", "gate.deadline_s = 1 s reached", late=True) == gate.EXIT_REFUSE
    rec = last(tmp_path)
    assert rec["decision"] == "error" and rec["action"] == "hold" and rec["refusal"] == 2
    log = tmp_path / "slurm-calls.log"
    wait_until(lambda: "scontrol hold 77" in (log.read_text() if log.exists() else ""), 15,
               "the detached follow-up to hold job 77")
    calls = log.read_text()
    assert "scontrol hold 77" in calls
    assert calls.splitlines()[0].startswith("squeue")  # the handler itself ran no scontrol


def test_a_locked_inventory_cannot_outlast_the_deadline(tmp_path: Path) -> None:
    """SQLite waits for a lock inside C, where the deadline's handler cannot run: the
    gate caps that wait at what is left of its deadline, whatever busy_timeout_ms says."""
    import sqlite3

    inventory(tmp_path)
    conn = sqlite3.connect(tmp_path / "inventory.db")
    conn.execute("BEGIN EXCLUSIVE")
    try:
        r, dt = run_gate(tmp_path, "deadline_s = 1\n[inventory]\nbusy_timeout_ms = 20000")
    finally:
        conn.rollback()
        conn.close()
    assert r.returncode == 0 and dt < 3, (dt, r.stderr)
    assert "ERROR: inventory" in r.stderr and "locked" in r.stderr


def test_the_tie_break_opens_the_inventory_after_asking_slurm(tmp_path: Path) -> None:
    """The tie-break's inventory read waits for a lock inside SQLite, where the deadline's
    handler cannot run, so its wait is capped at what is left of the deadline when it is
    opened: after the (slow) partition read, not before it. Here ``scontrol show
    partition`` takes 1.5 s (the gate's reads give up at 1.3 s of this 2.5 s deadline) and,
    meanwhile, another process locks the inventory: the gate must still end within its
    deadline."""
    inventory(tmp_path, {"n3": "2.18.3"})
    db = tmp_path / "inventory.db"
    done = tmp_path / "locker.done"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    locker = (
        f"import sqlite3, time, pathlib; c = sqlite3.connect({str(db)!r});"
        f" c.execute('BEGIN EXCLUSIVE'); time.sleep(4); c.rollback();"
        f" pathlib.Path({str(done)!r}).touch()"
    )
    (bin_dir / "scontrol").write_text(
        '#!/bin/sh\ncase "$*" in *"show partition"*)\n'
        f"  {sys.executable} -c \"{locker}\" </dev/null >/dev/null 2>&1 &\n"
        "  sleep 1.5; exit 1;;\nesac\nexit 0\n"
    )
    (bin_dir / "squeue").write_text("#!/bin/sh\nexit 0\n")
    for p in bin_dir.iterdir():
        p.chmod(0o700)
    env = {"SLURM_JOB_NODELIST": "n[3-4]", "SLURM_JOB_NUM_NODES": "2"}
    try:
        r, dt = run_gate(tmp_path, f'slurm_bin_dir = "{bin_dir}"\ndeadline_s = 2.5', env)
        rec = last(tmp_path)
    finally:
        for _ in range(100):  # the locker holds the lock 4 s, then leaves
            if done.exists():
                break
            time.sleep(0.1)
    assert dt < 3.2, (dt, r.stderr)
    assert r.returncode == 1 and rec["decision"] == "refuse", r.stderr
    assert rec["tie_break"].startswith("none (") and "locked" in rec["tie_break"], rec


# ------------------------------------------------------------ issues 31/32: scale and bursts


def _slurm_stand_ins(tmp_path: Path, squeue: str, scontrol: str) -> Path:
    """Stand-ins that log each call (``name args``) and each finished update."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "slurm-calls.log"
    for name, body in (("squeue", squeue), ("scontrol", scontrol), ("sinfo", "exit 1")):
        p = bin_dir / name
        p.write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\n{body}\n')
        p.chmod(0o700)
    return bin_dir


_PARTITION = 'case "$*" in *"show partition"*) echo "PartitionName=debug Nodes=n[1-4]";; esac'


def test_a_burst_of_refusals_reads_the_partitions_once(tmp_path: Path) -> None:
    """Six refusals at once (a burst after a partial upgrade): one run reads the
    partition's nodes and classes, the five others read what it wrote; every one
    steers. Before (issue 31) each read the whole cluster and, at 16,384 nodes, timed out."""
    inventory(tmp_path, {"n3": "2.18.3"})
    squeue = ('case "$*" in *"-o %A|"*) echo "77|CONFIGURING|debug||";;\n'
              '  *"-O JobId"*) echo "77|(null)";; esac')  # fmt: skip
    scontrol = ('case "$*" in *"show partition"*) sleep 0.5; '
                'echo "PartitionName=debug Nodes=n[1-4]";; esac')  # fmt: skip
    bin_dir = _slurm_stand_ins(tmp_path, squeue, scontrol)
    conf = tmp_path / "gate.toml"
    conf.write_text(f'[gate]\naudit_log = "{tmp_path / "audit.jsonl"}"\n'
                    f'slurm_bin_dir = "{bin_dir}"\nsteer_wait_s = 0.5\n')
    env = {"PATH": "/usr/bin:/bin", "NCCLGUARD_CONFIG": str(conf),
           "NCCLGUARD_DB": str(tmp_path / "inventory.db"), **ENV, "SLURM_JOB_STDIN": "/dev/null"}
    procs = [subprocess.Popen([sys.executable, "-I", "-m", "prolog.gate"], env=env,
                              stderr=subprocess.PIPE, text=True) for _ in range(6)]
    errs = [p.communicate(timeout=30)[1] for p in procs]
    assert [p.returncode for p in procs] == [1] * 6, errs
    calls = (tmp_path / "slurm-calls.log").read_text()
    assert calls.count("show partition") == 1, calls
    recs = [r for r in audit.read(tmp_path / "audit.jsonl") if r["decision"] == "refuse"]
    assert [r["action"] for r in recs] == ["steer"] * 6, recs
    assert sorted(r["shared"] for r in recs) == ["computed"] + ["shared"] * 5, recs


def test_a_slow_job_read_does_not_cost_the_admin_comment(tmp_path: Path) -> None:
    """slurmctld holding its job lock (a backfill cycle, a busy controller): the job read
    never answers, and the update takes 1.5 s. The reads give up in time for the
    AdminComment, which is set within the deadline; the job is requeued without steering.
    Before, each of two job reads took its own 2 s and the update was cut off."""
    inventory(tmp_path, {"n3": "2.18.3"})
    log = tmp_path / "slurm-calls.log"
    scontrol = (f'{_PARTITION}\ncase "$*" in update*) sleep 1.5; echo "updated" >> {log};;\n'
                '  --version) echo "slurm 22.05.8";; esac')  # fmt: skip
    bin_dir = _slurm_stand_ins(tmp_path, "exec sleep 30", scontrol)
    r, dt = run_gate(tmp_path, f'slurm_bin_dir = "{bin_dir}"', {"SLURM_JOB_STDIN": "/dev/null"})
    assert r.returncode == 1 and dt < 5.5, (dt, r.stderr)
    assert "steering check failed" in r.stderr, r.stderr
    calls = log.read_text()
    assert "AdminComment=ncclguard: refuse" in calls and calls.rstrip().endswith("updated"), calls
    rec = last(tmp_path)
    assert rec["action"] == "requeue" and rec["duration_ms"] < 5000, rec
