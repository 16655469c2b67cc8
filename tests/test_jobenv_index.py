"""The collector's index of job environments (issue 40, docs/jobs.md): the gate's audit
records name each batch job's loading variables; the collector resolves which libnccl
they make the job load, as whom, reads it in a child, and stores it for the gate
(``load_job_env``).

Real parts: a virtualenv with the real ``nvidia-nccl-cu12`` wheel installed by pip, a
conda-style prefix and a module's directory holding real ``libnccl.so.2`` files, the
trail written by ``ncclguard.audit.append`` as the gate writes it, the library read by
the real ``ncclguard-inventoryd read-nccl``. Tests run as root: who may read a file is
computed for the job's uid (and, for one file, checked against the kernel with
``setpriv`` as uid 65534).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers.parts import place

from inventoryd.controller.jobaccess import Access, permitted
from inventoryd.controller.jobenv_index import JobEnvIndex, parse_job_env, write_job_envs
from ncclguard import audit
from ncclguard.fingerprint.jobenv import env_key, loading_vars
from ncclguard.fingerprint.jobread import read_library
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory

NOBODY = 65534


def job_env(env: dict[str, str], uid: int | None) -> dict[str, Any]:
    """What the gate appends: its loading variables, their key and the job's uid."""
    variables, _ = loading_vars(env)
    return {"key": env_key(variables), "vars": variables, "uid": uid}


def gate_record(trail: Path, env: dict[str, str], uid: int | None, ts: float | None = None,
                job: int = 1) -> str:
    rec: dict[str, Any] = {"job": str(job), "user": "alice", "decision": "accept",
                           "action": "none", "job_env": job_env(env, uid)}
    if ts is not None:
        rec |= {"ts": ts, "time": "x"}
    audit.append(trail, rec)
    return str(rec["job_env"]["key"])


class Reader:
    """read_library, recording what it was asked to read."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def __call__(self, path: str, source: str, *, timeout_s: float
                 ) -> tuple[dict[str, Any] | None, str | None]:
        self.asked.append(path)
        return read_library(path, source, timeout_s=timeout_s)



def _index(tmp_path: Path, **kw: Any) -> tuple[JobEnvIndex, Path, Reader]:
    reader = Reader()
    trail = tmp_path / "audit.log"
    return JobEnvIndex(trail, db=tmp_path / "inv.db", reader=reader, **kw), trail, reader


def _resolve(index: JobEnvIndex, db: Path) -> dict[str, dict[str, Any]]:
    index.run_pass()
    with Inventory(db, values=GATE_VALUES) as inv:
        write_job_envs(inv, index)
        return {r["key"]: r for r in inv.job_envs()}


def test_real_envs_resolve_store_and_load(venv: Callable[[str], Path],
                                          nccl_lib: Callable[[str], Path],
                                          tmp_path: Path, world: Path) -> None:
    """A pip venv, a conda env and a module's directory, each named by a gate record:
    resolved and read, stored, and read back by the gate's ``load_job_env``; a replaced
    library is noticed by ``check_file``; a key used again within ``max_age_s`` is not
    read again, one used later is."""
    db = tmp_path / "inv.db"
    Inventory(db, values=GATE_VALUES).close()
    index, trail, reader = _index(tmp_path)
    uid = os.getuid()
    v = venv("2.18.3")
    conda = tmp_path / "conda"
    (conda / "conda-meta").mkdir(parents=True)
    place(conda, "lib/libnccl.so.2", nccl_lib("2.21.5"))
    # a module's tree, shared: its job's uid is unknown (null), the others' bits decide
    module = world / "sw/nccl/2.23.4/lib"
    place(world, "sw/nccl/2.23.4/lib/libnccl.so.2", nccl_lib("2.23.4")).chmod(0o644)
    for d in (world / "sw", world / "sw/nccl", world / "sw/nccl/2.23.4", module):
        d.chmod(0o755)
    k_venv = gate_record(trail, {"VIRTUAL_ENV": str(v), "PATH": "/usr/bin"}, uid)
    k_conda = gate_record(trail, {"CONDA_PREFIX": str(conda), "NCCL_NET": "IB"}, uid)
    k_mod = gate_record(trail, {"LD_LIBRARY_PATH": f"/nowhere:{module}"}, None, job=3)
    rows = _resolve(index, db)
    assert set(rows) == {k_venv, k_conda, k_mod}
    with Inventory(db, readonly=True) as inv:
        got = inv.load_job_env(k_venv)
        assert got is not None and got.error is None and got.source == "VIRTUAL_ENV"
        assert got.library == {"nccl_version": "2.18.3", "net_abis": [6, 5, 4],
                               "path": got.path, "source": "VIRTUAL_ENV"}
        assert got.path is not None and got.path.startswith(f"{v}/lib/python3.")
        conda_env = inv.load_job_env(k_conda)
        assert conda_env is not None and conda_env.library is not None
        assert (conda_env.source, conda_env.library["nccl_version"]) == \
            ("CONDA_PREFIX", "2.21.5")
        assert conda_env.path == f"{conda}/lib/libnccl.so.2"
        mod = inv.load_job_env(k_mod)
        assert mod is not None and mod.library is not None
        assert (mod.source, mod.library["nccl_version"]) == ("LD_LIBRARY_PATH", "2.23.4")
        assert inv.load_job_env("0" * 64) is None
    assert rows[k_mod]["uid"] is None and rows[k_conda]["vars"]["NCCL_NET"] == "IB"
    # the module's library replaced by another file (a new inode): the gate no longer
    # trusts the row, until the collector reads it again
    lib = module / "libnccl.so.2"
    shutil.copyfile(nccl_lib("2.18.3"), tmp_path / "new.so")
    os.replace(tmp_path / "new.so", lib)
    with Inventory(db, readonly=True) as inv:
        mod = inv.load_job_env(k_mod)
        assert mod is not None and mod.library is None
        assert mod.error == f"{lib}: the file changed since it was indexed: read again at " \
            "the collector's next pass"
        unchecked = inv.load_job_env(k_mod, check_file=False)
        assert unchecked is not None and unchecked.library is not None
    # used again within max_age_s: only its use is written; later: read again
    asked = len(reader.asked)
    gate_record(trail, {"LD_LIBRARY_PATH": f"/nowhere:{module}"}, None, ts=time.time() + 60)
    rows = _resolve(index, db)
    assert len(reader.asked) == asked and rows[k_mod]["used_at"] > time.time() + 30
    gate_record(trail, {"LD_LIBRARY_PATH": f"/nowhere:{module}"}, None, ts=time.time() + 700)
    _resolve(index, db)
    assert reader.asked[asked:] == [str(lib)]
    with Inventory(db, readonly=True) as inv:
        mod = inv.load_job_env(k_mod)
        assert mod is not None and mod.library is not None
        assert mod.library["nccl_version"] == "2.18.3"


def test_hostile_paths_are_refused_named_and_never_read(world: Path, nccl_lib, tmp_path
                                                        ) -> None:
    """Into /proc or /dev (spelled, or through a link), a FIFO named libnccl.so.2, a
    link to a root-only file and a directory the job's uid cannot enter: none is handed
    to the reader, each is named, and nothing blocks."""
    db = tmp_path / "inv.db"
    Inventory(db, values=GATE_VALUES).close()
    index, trail, reader = _index(tmp_path)
    real = nccl_lib("2.21.5")
    (world / "proc").mkdir()
    (world / "proc/libnccl.so.2").symlink_to("/proc/self/environ")
    (world / "dev").mkdir()
    (world / "dev/libnccl.so.2").symlink_to("/dev/zero")
    (world / "fifo").mkdir()
    os.mkfifo(world / "fifo/libnccl.so.2")
    (world / "secret").mkdir()
    secret = world / "secret/libnccl.so.2"  # a copy: a hardlink's chmod is the cache's
    shutil.copyfile(real, secret)
    secret.chmod(0o600)
    (world / "link").mkdir()
    (world / "link/libnccl.so.2").symlink_to(secret)
    (world / "closed/lib").mkdir(parents=True)
    shutil.copyfile(real, world / "closed/lib/libnccl.so.2")
    (world / "closed").chmod(0o700)
    (world / "closed/lib/libnccl.so.2").chmod(0o644)
    dirs = [str(world / d) for d in ("proc", "dev", "fifo", "link", "closed/lib")]
    t = time.monotonic()
    key = gate_record(trail, {"LD_LIBRARY_PATH": ":".join(dirs)}, NOBODY)
    spelled = gate_record(trail, {"LD_LIBRARY_PATH": "/proc/self/root:/dev/shm"}, NOBODY)
    rows = _resolve(index, db)
    row = rows[key]
    assert time.monotonic() - t < 60  # the FIFO was never opened
    assert reader.asked == [] and row["source"] == "host" and row["library"] is None
    # spelled into /proc or /dev: not looked at, and what the job loads is not known
    assert rows[spelled]["source"] == "LD_LIBRARY_PATH" and rows[spelled]["library"] is None
    assert "searched before any entry that holds libnccl.so.2" in rows[spelled]["error"]
    problems = "\n".join(row["problems"])
    assert f"{world}/proc/libnccl.so.2: leads to /proc/" in problems
    assert f"{world}/dev/libnccl.so.2: leads to /dev/zero, into /proc" in problems
    assert f"{world}/fifo/libnccl.so.2: a FIFO, not a library: not read" in problems
    assert (f"{world}/link/libnccl.so.2: uid {NOBODY} may not read it (mode 0600, owner "
            "uid 0): not read") in problems
    assert f"{world}/closed/lib/libnccl.so.2: uid {NOBODY} may not enter {world}/closed" \
        in problems
    if shutil.which("setpriv"):  # the kernel agrees with the computation
        for path in (world / "link/libnccl.so.2", world / "closed/lib/libnccl.so.2"):
            r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                                "--clear-groups", "head", "-c1", str(path)],
                               capture_output=True, timeout=30, check=False)
            assert r.returncode != 0 and b"Permission denied" in r.stderr
    # the reader itself never blocks on a FIFO either (a file swapped after the test)
    lib, why = read_library(str(world / "fifo/libnccl.so.2"), "LD_LIBRARY_PATH")
    assert lib is None and why == f"{world}/fifo/libnccl.so.2: not a regular file"
    # the owner of the root-only file (root's job) loads it: it is read
    key = gate_record(trail, {"LD_LIBRARY_PATH": str(world / "link")}, 0)
    row = _resolve(index, db)[key]
    assert reader.asked == [str(world / "link/libnccl.so.2")]
    assert row["library"]["nccl_version"] == "2.21.5"


def test_permission_bits_by_uid_group_and_unknown_owner() -> None:
    """Which bits apply: the owner's, the group's (the uid's groups), the others'; an
    owner that cannot be known or an unknown uid: the others' only."""
    def st(mode: int, uid: int = 1000, gid: int = 100) -> os.stat_result:
        return os.stat_result((stat.S_IFREG | mode, 0, 0, 1, uid, gid, 0, 0, 0, 0))

    assert permitted(st(0o400), 1000, frozenset(), 4)
    assert not permitted(st(0o044), 1000, frozenset({100}), 4)  # owner bits win
    assert permitted(st(0o040), 2000, frozenset({100}), 4)
    assert not permitted(st(0o004 & 0), 2000, frozenset({100}), 4)
    assert not permitted(st(0o404), 2000, frozenset({100}), 4)  # group bits apply: none
    assert permitted(st(0o004), 2000, frozenset({7}), 4)
    assert permitted(st(0o004), 2000, None, 4)
    assert not permitted(st(0o440), None, None, 4)  # unknown uid: others' bits
    assert not permitted(st(0o440), 1000, frozenset({100}), 4, owner_known=False)
    assert permitted(st(0o004), 1000, frozenset({100}), 4, owner_known=False)
    assert Access(None).groups is None and 0 in (Access(0).groups or ())


def test_hostile_records_are_ignored_and_counted(tmp_path: Path) -> None:
    """Odd types, a key that is not env_key(vars), a variable the gate does not hand on,
    a 1 MB value: ignored, counted, nothing pending, nothing crashes; 10,000
    LD_LIBRARY_PATH entries are resolved bounded."""
    index, trail, reader = _index(tmp_path)
    good = job_env({"VIRTUAL_ENV": "/opt/venv"}, 1000)
    big = {"VIRTUAL_ENV": "/x" * (1 << 19)}
    bad: list[Any] = [
        "not a dict", {**good, "vars": ["VIRTUAL_ENV", "/opt/venv"]},
        {**good, "key": env_key({"VIRTUAL_ENV": "/opt/other"})}, {**good, "key": 5},
        {**good, "uid": "1000"}, {**good, "uid": True}, {**good, "uid": -1},
        {**good, "vars": {"VIRTUAL_ENV": 5}},
        job_env({"VIRTUAL_ENV": "/opt/venv", "NCCL_NET": "IB"}, 1) | {
            "vars": {"VIRTUAL_ENV": "/opt/venv", "PATH": "/bin"}},
        {"key": env_key({"NCCL_NET": "IB"}), "vars": {"NCCL_NET": "IB"}, "uid": 1},
        {"key": env_key(big), "vars": big, "uid": 1},
        {"key": env_key({"VIRTUAL_ENV": "/a\0b"}), "vars": {"VIRTUAL_ENV": "/a\0b"}, "uid": 1},
    ]
    for value in bad:
        assert parse_job_env(value) is None
        index.seen({"ts": time.time(), "job_env": value})
    assert index.ignored == len(bad) and not index.pending
    audit.append(trail, {"job": "1", "job_env": {"key": env_key(big), "vars": big}})
    audit.append(trail, {"job": "2", "job_env": None})
    index.seen({"job": "3"})  # no job_env: not the index's
    Inventory(tmp_path / "inv.db", values=GATE_VALUES).close()
    assert index.run_pass() == 0 and index.ignored == len(bad) + 1
    # 10,000 entries: the first 256 looked at, said so
    dirs = ":".join(f"/{i}" for i in range(10_000))  # under 64 KiB: the gate keeps it
    key = gate_record(trail, {"LD_LIBRARY_PATH": dirs}, 1000)
    t = time.monotonic()
    row = _resolve(index, tmp_path / "inv.db")[key]
    assert time.monotonic() - t < 30
    assert ("LD_LIBRARY_PATH: 10000 entries, none of the first 256 holds libnccl.so.2: "
            "the rest are not looked at") in row["problems"]
    # not the host's: an entry past the 256th may hold the library the job loads
    assert row["source"] == "LD_LIBRARY_PATH" and "not known" in row["error"]
    assert reader.asked == []


def test_one_users_thousands_of_environments_do_not_starve_another(tmp_path: Path) -> None:
    """5,000 distinct keys from one uid, then one from another: the pending keys stay
    bounded (the first uid's oldest dropped, counted) and the other's is resolved among
    the first two."""
    index, _, _ = _index(tmp_path)
    Inventory(tmp_path / "inv.db", values=GATE_VALUES).close()
    now = time.time()
    for i in range(5000):
        index.seen({"ts": now, "job_env": job_env({"VIRTUAL_ENV": f"/nowhere/{i}"}, 1000)})
    other = job_env({"CONDA_PREFIX": "/nowhere/conda"}, 1001)
    index.seen({"ts": now, "job_env": other})
    assert sum(len(q) for q in index.pending.values()) == index.max_pending
    assert index.dropped == 5001 - index.max_pending and len(index.pending[1001]) == 1
    assert index.run_pass(max_keys=2) == 2
    rows, _ = index.drain()
    assert other["key"] in [r["key"] for r in rows]


def test_the_table_is_bounded_least_recently_used_first(tmp_path: Path) -> None:
    with Inventory(tmp_path / "inv.db", values=GATE_VALUES) as inv:
        rows = [{"key": f"k{i}", "vars": {"VIRTUAL_ENV": f"/v/{i}"}, "uid": 1,
                 "source": "host", "path": None, "why": "w", "problems": [], "used_at": i}
                for i in range(10)]
        inv.write_job_envs(rows, max_rows=8)  # k0 and k1 used least: dropped
        assert set(inv.job_env_states()) == {f"k{i}" for i in range(2, 10)}
        inv.write_job_envs([], used={"k2": 100.0}, max_rows=8)  # a job used k2 again
        inv.write_job_envs([{**rows[0], "key": "k10", "used_at": 50}], max_rows=8)
        assert set(inv.job_env_states()) == {"k2", "k10", *(f"k{i}" for i in range(4, 10))}
        assert inv.load_job_env("k5", check_file=True) == inv.load_job_env("k5")
        got = inv.load_job_env("k5")
        assert got is not None and (got.source, got.library, got.error) == ("host", None, None)
