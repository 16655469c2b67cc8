"""The gate judges a batch job by the NCCL its saved environment makes it load (issue 40,
docs/jobs.md): the real gate process (``python -I -m prolog.gate``) on a job whose
environment slurmctld saved (laid out as Slurm writes it: docs/slurm.md), the real
collector worker resolving what the gate's audit trail names, a real libnccl.so.2 from
the nvidia-nccl wheels. Real Slurm: tests/test_gate_ownnccl_slurm.py."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.fingerprints import fingerprint
from helpers.gate import ENV, last, run_gate

from inventoryd.controller.jobenv_index import JobEnvIndex, write_job_envs
from ncclguard import audit
from ncclguard.fingerprint.jobenv import env_key
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory

BATCH = {"SLURM_JOB_STDIN": "/dev/null"}  # what makes PrologSlurmctld's job a batch job


def save_env(state: Path, job_id: int, env: dict[str, str], mode: int = 0o600) -> Path:
    """The job's environment as slurmctld saves it at submit (docs/slurm.md)."""
    d = state / f"hash.{job_id % 10}" / f"job.{job_id}"
    d.mkdir(parents=True, exist_ok=True)
    entries = [f"{k}={v}".encode() + b"\0" for k, v in env.items()]
    f = d / "environment"
    f.write_bytes(struct.pack("=I", len(entries)) + b"".join(entries))
    f.chmod(mode)
    return f



def _inventory(tmp_path: Path, hosts: dict[str, str]) -> None:
    """Nodes n1..n3 with the host libnccl ``hosts`` names, and the same net plugin
    (IBext v8) offered to a job's own NCCL (issue 39's offers part)."""
    with Inventory(tmp_path / "inventory.db", values=GATE_VALUES) as inv:
        for h, version in hosts.items():
            inv.upsert(fingerprint(h, nccl=version, plugin_abi=8, offers=True))


def _config(tmp_path: Path) -> str:
    return f'state_save_location = "{tmp_path / "state"}"'


def _resolve(tmp_path: Path) -> int:
    """One pass of the collector's job-environment worker over the gate's audit trail."""
    index = JobEnvIndex(tmp_path / "audit.jsonl", db=tmp_path / "inventory.db")
    index.run_pass()
    with Inventory(tmp_path / "inventory.db", values=GATE_VALUES) as inv:
        return write_job_envs(inv, index)


DIFFER = {"n1": "2.21.5", "n2": "2.21.5", "n3": "2.18.3"}  # the hosts' libnccl differ


def test_a_module_job_is_judged_by_its_own_nccl_once_the_collector_read_it(
    tmp_path: Path, world: Path, nccl_lib: Callable[[str], Path],
) -> None:
    """Host libnccl 2.21.5 on n[1-2], 2.18.3 on n3: a job of the host's NCCL is refused.
    A batch job whose LD_LIBRARY_PATH names a module's real NCCL 2.23.4: the first time
    judged as any job (refused, and the note says the library is not read yet); the
    collector resolves the environment the audit record names; the next job from it is
    accepted, judged by 2.23.4 on each node."""
    _inventory(tmp_path, DIFFER)
    # a copy, not a link to the shared cache: linking to it elsewhere (another test)
    # changes its ctime, which is part of the identity the collector files
    lib = world / "nccl-2.23.4" / "lib" / "libnccl.so.2"
    lib.parent.mkdir(parents=True)
    shutil.copyfile(nccl_lib("2.23.4"), lib)
    lib.chmod(0o644)
    for d in (world / "nccl-2.23.4", lib.parent):
        d.chmod(0o755)
    env = {"HOME": "/home/alice", "LD_LIBRARY_PATH": f"/opt/x/lib:{lib.parent}",
           "NCCL_IB_HCA": "mlx5_0"}
    save_env(tmp_path / "state", 77, env)
    r, _ = run_gate(tmp_path, _config(tmp_path), BATCH)
    first = last(tmp_path)
    assert first["decision"] == "refuse", r.stderr
    # handed on to the collector: the inputs alone (they decide which libnccl loads);
    # the NCCL_* ones are the gate's, applied to each node and kept in the record
    variables = {"LD_LIBRARY_PATH": env["LD_LIBRARY_PATH"]}
    assert first["job_env"] == {"key": env_key(variables), "vars": variables, "uid": 1000}
    assert first["job_nccl_vars"] == {"NCCL_IB_HCA": "mlx5_0"}
    assert "job_nccl" not in first
    assert any("is not read yet" in n for n in first["notes"]), first["notes"]

    assert _resolve(tmp_path) == 1
    r, _ = run_gate(tmp_path, _config(tmp_path), BATCH)
    assert r.returncode == 0, r.stderr
    rec = last(tmp_path)
    assert rec["decision"] == "accept", rec
    assert rec["job_nccl"]["source"] == "LD_LIBRARY_PATH"
    assert rec["job_nccl"]["path"] == str(lib) and rec["job_nccl"]["nccl_version"] == "2.23.4"
    assert any("not by the host's libnccl" in n for n in rec["notes"]), rec["notes"]
    # the same nodes, a job without its own NCCL (not a batch job: no saved environment)
    run_gate(tmp_path, _config(tmp_path))
    plain = last(tmp_path)
    assert plain["decision"] == "refuse" and "job_env" not in plain

    # the module's library replaced in place: the gate does not judge by the old one
    lib.unlink()
    shutil.copyfile(nccl_lib("2.18.3"), lib)
    lib.chmod(0o644)
    run_gate(tmp_path, _config(tmp_path), BATCH)
    rec = last(tmp_path)
    assert rec["decision"] == "refuse"
    rules = {f["rule"]: f["severity"] for f in rec["findings"]}
    assert rules.get("job-nccl-unknown") == "warn", rec["findings"]
    assert rec["job_nccl"]["error"].startswith(f"{lib}: the file changed since it was indexed")


def test_a_job_whose_environment_names_no_own_nccl_is_judged_by_the_hosts(
    tmp_path: Path, world: Path,
) -> None:
    """A venv without the nvidia-nccl wheel: the collector finds no library of the job's
    own, and the gate judges the job by the node's (the note says so)."""
    _inventory(tmp_path, DIFFER)
    venv = world / "venv"
    (venv / "lib/python3.11/site-packages").mkdir(parents=True)
    for d in (venv, venv / "lib", venv / "lib/python3.11", venv / "lib/python3.11/site-packages"):
        d.chmod(0o755)
    save_env(tmp_path / "state", 77, {"VIRTUAL_ENV": str(venv)})
    run_gate(tmp_path, _config(tmp_path), BATCH)
    assert _resolve(tmp_path) == 1
    run_gate(tmp_path, _config(tmp_path), BATCH)
    rec = last(tmp_path)
    assert rec["decision"] == "refuse" and rec["job_nccl"]["source"] == "host"
    assert any("names no libnccl of its own" in n for n in rec["notes"]), rec["notes"]


def test_the_jobs_own_nccl_settings_are_applied_to_each_node(tmp_path: Path) -> None:
    """n3's IB port is down (it falls back to Socket, n[1-2] use IB): a batch job is
    refused. The same job with NCCL_IB_DISABLE=1 in its saved environment runs on Socket
    on every node: accepted, the variable in the record and the note. A job's NCCL_*
    variables are not handed to the collector (they do not change which libnccl loads)."""
    with Inventory(tmp_path / "inventory.db", values=GATE_VALUES) as inv:
        for h in ("n1", "n2", "n3"):
            inv.upsert(fingerprint(h, ports_up=0 if h == "n3" else 1))
    save_env(tmp_path / "state", 77, {"HOME": "/home/alice", "NCCL_DEBUG": "INFO"})
    run_gate(tmp_path, _config(tmp_path), BATCH)
    rec = last(tmp_path)
    assert rec["decision"] == "refuse" and rec["odd_nodes"] == ["n3"], rec
    save_env(tmp_path / "state", 77, {"HOME": "/home/alice", "NCCL_IB_DISABLE": "1"})
    r, _ = run_gate(tmp_path, _config(tmp_path), BATCH)
    assert r.returncode == 0, r.stderr
    rec = last(tmp_path)
    assert rec["decision"] != "refuse", rec
    assert "transport" not in {f["rule"] for f in rec["findings"]}, rec["findings"]
    assert rec["job_nccl_vars"] == {"NCCL_IB_DISABLE": "1"} and "job_env" not in rec
    assert any("NCCL_IB_DISABLE applied on each node" in n for n in rec["notes"]), rec


@pytest.mark.parametrize("case", ["group-writable", "symlink", "missing", "too-long",
                                  "no-state-dir"])
def test_a_saved_environment_the_gate_cannot_take_is_named_and_the_job_judged_as_any(
    tmp_path: Path, case: str,
) -> None:
    """Whatever the file: the gate's verdict is the one without the job's own NCCL, the
    audit record names the file and why, and nothing is handed to the collector."""
    _inventory(tmp_path, {"n1": "2.21.5", "n2": "2.21.5", "n3": "2.21.5"})
    state = tmp_path / "state"
    env = {"VIRTUAL_ENV": "/v"}
    config = _config(tmp_path)
    if case == "group-writable":
        f = save_env(state, 77, env, mode=0o620)
        why = f"{f}: "
    elif case == "symlink":
        real = save_env(state, 78, env)
        f = real.parent.parent.parent / "hash.7" / "job.77" / "environment"
        f.parent.mkdir(parents=True)
        f.symlink_to(real)
        why = f"{f}: "
    elif case == "missing":
        why = "no saved environment"
    elif case == "too-long":
        save_env(state, 77, {"LD_LIBRARY_PATH": ":".join(f"/p{i:05d}" for i in range(6000)),
                             "VIRTUAL_ENV": "/v"})
        why = "more than 32768 handed on"
    else:
        conf = tmp_path / "slurm.conf"
        conf.write_text("ClusterName=c\n")
        config = f'slurm_conf = "{conf}"'
        why = f"{conf} sets no StateSaveLocation"
    r, _ = run_gate(tmp_path, config, BATCH)
    assert r.returncode == 0 and "ERROR" not in r.stderr, r.stderr
    rec = last(tmp_path)
    assert rec["decision"] == "accept" and "job_env" not in rec
    assert why in rec["job_env_error"], rec["job_env_error"]


def test_the_state_save_location_is_read_from_slurm_conf(tmp_path: Path) -> None:
    _inventory(tmp_path, {"n1": "2.21.5", "n2": "2.21.5", "n3": "2.21.5"})
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"ClusterName=c\nStateSaveLocation={tmp_path / 'state'}\n")
    save_env(tmp_path / "state", 77, {"CONDA_PREFIX": "/envs/x"})
    run_gate(tmp_path, f'slurm_conf = "{conf}"', BATCH)
    rec = last(tmp_path)
    assert rec["job_env"]["vars"] == {"CONDA_PREFIX": "/envs/x"}
    assert any("is not read yet" in n for n in rec["notes"])
    # off: nothing read
    run_gate(tmp_path, f'slurm_conf = "{conf}"\nread_job_env = false', BATCH)
    assert "job_env" not in last(tmp_path) and "job_env_error" not in last(tmp_path)


def test_an_array_task_is_read_through_its_master(tmp_path: Path) -> None:
    _inventory(tmp_path, {"n1": "2.21.5", "n2": "2.21.5", "n3": "2.21.5"})
    save_env(tmp_path / "state", 70, {"VIRTUAL_ENV": "/v"})
    run_gate(tmp_path, _config(tmp_path), {**BATCH, "SLURM_ARRAY_JOB_ID": "70",
                                           "SLURM_ARRAY_TASK_ID": "7"})
    assert last(tmp_path)["job_env"]["vars"] == {"VIRTUAL_ENV": "/v"}


def test_the_record_the_gate_hands_on_is_one_the_collector_takes(tmp_path: Path) -> None:
    """Odd bytes in a value (not UTF-8) survive the audit line and the collector's check
    of the key (it recomputes env_key from the variables)."""
    _inventory(tmp_path, {"n1": "2.21.5", "n2": "2.21.5", "n3": "2.21.5"})
    d = tmp_path / "state" / "hash.7" / "job.77"
    d.mkdir(parents=True)
    raw = [b"VIRTUAL_ENV=/v\xff\xfe\0", b"PATH=/bin\0"]
    (d / "environment").write_bytes(struct.pack("=I", 2) + b"".join(raw))
    (d / "environment").chmod(0o600)
    run_gate(tmp_path, _config(tmp_path), BATCH)
    rec = audit.read(tmp_path / "audit.jsonl")[-1]
    assert rec["job_env"]["vars"] == {"VIRTUAL_ENV": os.fsdecode(b"/v\xff\xfe")}
    assert json.loads(json.dumps(rec))["job_env"]["key"] == env_key(rec["job_env"]["vars"])
    index = JobEnvIndex(tmp_path / "audit.jsonl", db=tmp_path / "inventory.db")
    index.run_pass()
    assert index.ignored == 0


def test_a_batch_jobs_read_stays_off_the_heavy_imports(tmp_path: Path) -> None:
    """The saved environment read on the gate's path imports neither Slurm's adapter
    (subprocess: 29 ms) nor hashlib (OpenSSL: 3.5 ms; the key's SHA-256 comes from
    CPython's builtin module), and the key is hashlib's SHA-256 all the same."""
    import subprocess
    import sys

    _inventory(tmp_path, {"n1": "2.21.5", "n2": "2.21.5", "n3": "2.21.5"})
    save_env(tmp_path / "state", 77, {"VIRTUAL_ENV": "/v"})
    (tmp_path / "c.toml").write_text(f'[gate]\naudit_log = "{tmp_path / "audit.jsonl"}"\n'
                                     f"{_config(tmp_path)}\n")
    code = ("import sys; from prolog.gate import main; rc = main();"
            "heavy = ('hashlib', '_hashlib', 'subprocess', 'ncclguard.slurm.adapter', "
            "'ncclguard.slurm.model', 'click', 'sqlite_utils');"
            "print(sorted(m for m in sys.modules if m.startswith(heavy)))")
    env = {"PATH": "/usr/bin:/bin", "NCCLGUARD_DB": str(tmp_path / "inventory.db"),
           "NCCLGUARD_CONFIG": str(tmp_path / "c.toml"), **ENV, **BATCH}
    r = subprocess.run([sys.executable, "-I", "-c", code], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr
    import hashlib

    rec = last(tmp_path)
    assert rec["job_env"]["key"] == hashlib.sha256(b'{"VIRTUAL_ENV":"/v"}').hexdigest()
