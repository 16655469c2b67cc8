"""Hostile review of a batch job judged by its own NCCL (issue 40): environments whose
resolution by the collector (``jobenv.locate``) differs from what ld.so and the job's
python load on the nodes. Each case: the real gate process on a job whose environment
slurmctld saved, the real collector worker resolving what the gate's trail names, the
gate again; hosts whose libnccl differ (2.21.5 on n[1-2], 2.18.3 on n3), so that a job
judged by the 2.23.4 library the collector found is accepted and a job whose NCCL is not
known is refused."""

from __future__ import annotations

import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.fingerprints import fingerprint
from helpers.gate import last, run_gate
from helpers.parts import place

from inventoryd.controller.jobenv_index import JobEnvIndex, write_job_envs
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory

BATCH = {"SLURM_JOB_STDIN": "/dev/null"}
DIFFER = {"n1": "2.21.5", "n2": "2.21.5", "n3": "2.18.3"}


def save_raw(state: Path, job_id: int, entries: list[tuple[str, str]]) -> Path:
    """The saved environment as slurmctld writes it, entries in order (a name may repeat:
    sbatch passes its ``environ`` as it got it, and execve takes duplicates)."""
    d = state / f"hash.{job_id % 10}" / f"job.{job_id}"
    d.mkdir(parents=True, exist_ok=True)
    raw = [f"{k}={v}".encode() + b"\0" for k, v in entries]
    f = d / "environment"
    f.write_bytes(struct.pack("=I", len(raw)) + b"".join(raw))
    f.chmod(0o600)
    return f



def _open(world: Path, rel: str, lib: Path) -> Path:
    """``lib`` copied to ``world/rel``, every directory on the way enterable by all."""
    got = place(world, rel, lib)
    got.chmod(0o644)
    d = got.parent
    while d != world:
        d.chmod(0o755)
        d = d.parent
    return got


def _judged(tmp_path: Path, entries: list[tuple[str, str]]) -> dict:
    """Gate, collector pass, gate: the second audit record."""
    with Inventory(tmp_path / "inventory.db", values=GATE_VALUES) as inv:
        for h, version in DIFFER.items():
            inv.upsert(fingerprint(h, nccl=version, plugin_abi=8, offers=True))
    save_raw(tmp_path / "state", 77, entries)
    config = f'state_save_location = "{tmp_path / "state"}"'
    run_gate(tmp_path, config, BATCH)  # refused (not read yet); steering fails here
    index = JobEnvIndex(tmp_path / "audit.jsonl", db=tmp_path / "inventory.db")
    index.run_pass()
    with Inventory(tmp_path / "inventory.db", values=GATE_VALUES) as inv:
        write_job_envs(inv, index)
    r, _ = run_gate(tmp_path, config, BATCH)
    assert "Traceback" not in r.stderr, r.stderr
    return last(tmp_path)


def _why(rec: dict) -> tuple:
    return rec["decision"], rec.get("job_nccl"), rec.get("job_env_error")


def test_the_honest_case_is_accepted(tmp_path: Path, world: Path,
                                     nccl_lib: Callable[[str], Path]) -> None:
    """The control: a module's 2.23.4 named plainly is resolved, and the job accepted."""
    good = _open(world, "nccl-2.23.4/lib/libnccl.so.2", nccl_lib("2.23.4"))
    rec = _judged(tmp_path, [("LD_LIBRARY_PATH", str(good.parent))])
    assert rec["decision"] == "accept", rec


# Each: what ld.so does with the entry the collector skipped (ld.so(8), glibc
# elf/dl-load.c fillin_rpath / _dl_dst_substitute, elf/rtld.c process_envvars).
SKIPPED_LIBRARY_PATH = {
    # an empty entry is the current directory (the job's: the submit directory)
    "empty-first": ":{good}",
    "empty-middle": "/opt/none::{good}",
    # a relative entry: relative to the job's working directory
    "relative": "lib:{good}",
    # $LIB and $PLATFORM are expanded by ld.so in LD_LIBRARY_PATH
    "dst-lib": "/opt/$LIB:{good}",
    "dst-platform": "/opt/${{PLATFORM}}/lib:{good}",
    # /proc/self/cwd is the job's working directory
    "proc-cwd": "/proc/self/cwd/lib:{good}",
}


@pytest.mark.parametrize("case", sorted(SKIPPED_LIBRARY_PATH))
def test_an_ld_library_path_entry_the_collector_skips_is_not_passed_over(
    tmp_path: Path, world: Path, nccl_lib: Callable[[str], Path], case: str,
) -> None:
    """An entry before the module's that ld.so searches and the collector does not look
    at (empty, relative, a $LIB token, /proc): the job may load another libnccl from
    it (here, a 2.18.3 in its working directory), so it must not be judged by the
    module's 2.23.4. Before: accepted (judged by 2.23.4)."""
    good = _open(world, "nccl-2.23.4/lib/libnccl.so.2", nccl_lib("2.23.4"))
    value = SKIPPED_LIBRARY_PATH[case].format(good=good.parent)
    rec = _judged(tmp_path, [("LD_LIBRARY_PATH", value)])
    assert rec["decision"] != "accept", _why(rec)
    assert rec["job_nccl"]["error"], rec["job_nccl"]
    rules = {f["rule"]: f["severity"] for f in rec["findings"]}
    assert rules.get("job-nccl-unknown") == "warn", rec["findings"]


SKIPPED_PRELOAD = {
    # no slash: ld.so searches LD_LIBRARY_PATH, the cache, the default directories
    "bare-name": "libnccl.so.2",
    "relative": "lib/libnccl.so.2",
    "dst-lib": "/opt/$LIB/libnccl.so.2",
    "proc-cwd": "/proc/self/cwd/libnccl.so.2",
}


@pytest.mark.parametrize("case", sorted(SKIPPED_PRELOAD))
def test_a_preloaded_libnccl_the_collector_cannot_follow_is_not_passed_over(
    tmp_path: Path, world: Path, nccl_lib: Callable[[str], Path], case: str,
) -> None:
    """``LD_PRELOAD=libnccl.so.2`` (ld.so finds it by its search: the host's 2.18.3 on
    n3) with ``CONDA_PREFIX`` naming a 2.23.4: the preloaded object is the one the job's
    ``dlopen("libnccl.so.2")`` gets. Before: the collector went on to CONDA_PREFIX and the
    job was accepted, judged by 2.23.4."""
    _open(world, "conda/lib/libnccl.so.2", nccl_lib("2.23.4"))
    rec = _judged(tmp_path, [("LD_PRELOAD", SKIPPED_PRELOAD[case]),
                             ("CONDA_PREFIX", str(world / "conda"))])
    assert rec["decision"] != "accept", _why(rec)
    rules = {f["rule"]: f["severity"] for f in rec["findings"]}
    assert rules.get("job-nccl-unknown") == "warn", rec["findings"]


@pytest.mark.parametrize("name", ["LD_LIBRARY_PATH", "LD_PRELOAD", "CONDA_PREFIX"])
def test_a_loading_variable_saved_twice_is_not_judged_by_the_first(
    tmp_path: Path, world: Path, nccl_lib: Callable[[str], Path], name: str,
) -> None:
    """A name twice in the saved environment (sbatch run with a crafted ``envp``): ld.so
    takes the last LD_* (glibc rtld.c process_envvars overwrites at each), bash binds the
    last; the gate kept the first. Before: the first, a 2.23.4, resolved and the job
    accepted while it loads the second."""
    good = _open(world, "conda/lib/libnccl.so.2", nccl_lib("2.23.4"))
    value = {"LD_LIBRARY_PATH": str(good.parent), "LD_PRELOAD": str(good),
             "CONDA_PREFIX": str(world / "conda")}[name]
    rec = _judged(tmp_path, [(name, value), ("PATH", "/bin"), (name, "/opt/other")])
    assert rec["decision"] != "accept", _why(rec)
    assert "more than once" in rec.get("job_env_error", ""), rec


def test_a_venv_with_two_python_versions_is_not_judged_by_the_newest(
    tmp_path: Path, world: Path, nccl_lib: Callable[[str], Path],
) -> None:
    """A venv of python 3.11 (its wheel 2.18.3) where the user added a lib/python3.13
    holding a 2.23.4 wheel its python never imports: the collector took the newest.
    Before: accepted, judged by 2.23.4."""
    v = world / "venv"
    _open(world, "venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2",
          nccl_lib("2.18.3"))
    _open(world, "venv/lib/python3.13/site-packages/nvidia/nccl/lib/libnccl.so.2",
          nccl_lib("2.23.4"))
    (v / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.11.9\n")
    rec = _judged(tmp_path, [("VIRTUAL_ENV", str(v))])
    assert rec["decision"] != "accept", _why(rec)


def test_a_directory_the_collector_cannot_look_into_stops_the_search(
    nccl_lib: Callable[[str], Path],
) -> None:
    """The collector runs unprivileged: ``LD_LIBRARY_PATH=<a 0700 directory of the job's
    owner, holding 2.18.3>:<a shared module directory, 2.23.4>``. The job (root here)
    loads 2.18.3; the collector cannot look into the first directory. Before: its stat's
    EACCES read as "nothing there", and the job was judged by the shared 2.23.4. Now: not
    known (the review's finding, run as uid 65534 under setpriv, as the collector's unit
    runs as a user of its own)."""
    import json
    import subprocess
    import sys

    base = Path(tempfile.mkdtemp(prefix="ncclguard-eacces-", dir="/tmp"))
    try:
        base.chmod(0o755)
        private = base / "private" / "lib"
        private.mkdir(parents=True)
        shutil.copyfile(nccl_lib("2.18.3"), private / "libnccl.so.2")
        (base / "private").chmod(0o700)  # root's, like a user's 0700 home
        shared = base / "shared" / "lib"
        shared.mkdir(parents=True)
        shutil.copyfile(nccl_lib("2.23.4"), shared / "libnccl.so.2")
        for d in (base / "shared", shared):
            d.chmod(0o755)
        (shared / "libnccl.so.2").chmod(0o644)
        env = {"LD_LIBRARY_PATH": f"{private}:{shared}"}
        code = ("import json, sys; from ncclguard.fingerprint.jobenv import locate;"
                "from inventoryd.controller.jobaccess import Access;"
                "f = locate(json.loads(sys.argv[1]), Access(0).is_file);"
                "print(json.dumps([f.source, f.path, f.why]))")
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            sys.executable, "-c", code, json.dumps(env)],
                           capture_output=True, text=True, timeout=60, cwd="/")
        assert r.returncode == 0, r.stderr
        source, path, why = json.loads(r.stdout)
        assert (source, path) == ("unknown", None), (source, path, why)
        assert f"{private}/libnccl.so.2: the collector cannot look (Permission denied)" in why
    finally:
        shutil.rmtree(base, ignore_errors=True)
