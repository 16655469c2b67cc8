"""A batch job's saved environment (``ncclguard/slurm/savedenv.py``; docs/slurm.md, "A
batch job's saved environment"): files laid out as slurmctld writes them, hostile ones,
and the files a real slurmctld wrote on this machine's Slurm."""

from __future__ import annotations

import errno
import os
import stat
import struct
import threading
import tracemalloc
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from helpers.slurm import require_slurm

from devtools.devcluster import DevCluster
from ncclguard.fingerprint import jobenv
from ncclguard.slurm import savedenv
from ncclguard.slurm.savedenv import SavedEnv, environment_path

NAMES = jobenv.INPUTS + jobenv.NCCL_VARS
#: 10,000 directories in 58 KB, within jobenv's 64 KiB value bound
LIB10K = ":".join(f"/{i:x}" for i in range(10_000))


def write_env(path: Path, entries: Sequence[bytes], count: int | None = None,
              tail: bytes = b"") -> Path:
    """A file as slurmctld's ``_write_data_array_to_file`` writes one: a native uint32
    count, then each entry and its NUL; ``tail``: bytes after them, with no NUL."""
    n = len(entries) if count is None else count
    path.write_bytes(struct.pack("=I", n) + b"".join(e + b"\0" for e in entries) + tail)
    path.chmod(0o600)
    return path


def read(path: Path, names: Sequence[str] = NAMES, **kw: int) -> SavedEnv:
    return savedenv.read(str(path), names, max_value=jobenv.MAX_VALUE, **kw)


def test_the_path_is_slurmctlds_and_an_array_task_reads_its_masters() -> None:
    assert environment_path("/var/spool/slurmctld", 1234) == \
        "/var/spool/slurmctld/hash.4/job.1234/environment"
    assert environment_path("/s", 1240, array_job_id=1237) == "/s/hash.7/job.1237/environment"
    assert environment_path("/s", 1240, array_job_id=0) == "/s/hash.0/job.1240/environment"
    for bad in (0, -1, 1 << 32, True, "12"):
        with pytest.raises(ValueError):
            environment_path("/s", bad)  # type: ignore[arg-type]


def test_only_the_named_variables_are_kept_and_a_1mb_value_is_read_past(tmp_path: Path) -> None:
    f = write_env(tmp_path / "environment", [
        b"BIG=" + b"x" * (1 << 20),
        b"VIRTUAL_ENV=/home/u/venv",
        b"LD_LIBRARY_PATH=" + LIB10K.encode(),
        b"NCCL_NET_PLUGIN=aws-ofi",
        b"HOME=/home/u",
        b"NOEQUALS",
        b"LD_PRELOADX=/not/asked",
        b"=empty-name",
    ])
    got = read(f)
    assert got == SavedEnv({"VIRTUAL_ENV": "/home/u/venv", "LD_LIBRARY_PATH": LIB10K,
                            "NCCL_NET_PLUGIN": "aws-ofi"}, (), str(f))
    # the reader returns the whole list; jobenv bounds what locate looks at
    found = jobenv.locate(got.values, lambda p: False)
    assert ("LD_LIBRARY_PATH: 10000 entries, none of the first 256 holds libnccl.so.2: the "
            "rest are not looked at") in found.problems
    # a 1 MB value asked for is dropped, named
    got = read(f, ["BIG", "HOME"])
    assert got.values == {"HOME": "/home/u"}
    assert got.problems == (f"{f}: BIG is longer than {jobenv.MAX_VALUE} bytes: not read",)
    # a value exactly at the bound is kept
    at = write_env(tmp_path / "at", [b"LD_PRELOAD=" + b"/" * jobenv.MAX_VALUE])
    assert read(at).values == {"LD_PRELOAD": "/" * jobenv.MAX_VALUE}


def test_entries_split_across_reads_are_joined(tmp_path: Path) -> None:
    """Names and values that straddle the 64 KiB pieces the file is read in."""
    for pad in range(savedenv.CHUNK - 40, savedenv.CHUNK + 2):
        f = write_env(tmp_path / "environment", [
            b"P=" + b"p" * pad, b"CONDA_PREFIX=/opt/conda/envs/x", b"NCCL_IB_HCA=mlx5_0"])
        got = read(f)
        assert got.values == {"CONDA_PREFIX": "/opt/conda/envs/x", "NCCL_IB_HCA": "mlx5_0"}, pad
        assert got.problems == ()


def test_memory_holds_only_the_named_variables_each_bounded(tmp_path: Path) -> None:
    """3 MiB of a value asked for, 3 MiB of one not, 3 MiB with no '=': the reader keeps
    at most the bound of a value asked for and a piece of the file at a time."""
    f = write_env(tmp_path / "environment", [b"LD_PRELOAD=" + b"/" * (3 << 20),
                                             b"OTHER=" + b"o" * (3 << 20), b"n" * (3 << 20),
                                             b"VIRTUAL_ENV=/v"])
    tracemalloc.start()
    try:
        got = read(f, max_bytes=16 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got.values == {"VIRTUAL_ENV": "/v"}
    assert got.problems == (f"{f}: LD_PRELOAD is longer than {jobenv.MAX_VALUE} bytes: "
                            "not read",)
    assert peak < 4 * (savedenv.CHUNK + jobenv.MAX_VALUE), peak


def test_a_file_larger_than_the_cap_is_read_no_further(tmp_path: Path) -> None:
    f = write_env(tmp_path / "environment", [b"VIRTUAL_ENV=/v"] + [b"P=" + b"p" * 1000] * 6000
                  + [b"CONDA_PREFIX=/c"])
    assert f.stat().st_size > savedenv.MAX_BYTES
    got = read(f)
    assert got.values == {"VIRTUAL_ENV": "/v"}  # CONDA_PREFIX lies past the cap
    assert got.problems == (
        f"{f}: larger than {savedenv.MAX_BYTES} bytes: only the first {savedenv.MAX_BYTES} "
        "read, the variables after them are not known",
        f"{f}: the entry at the cap is not read")
    # the cap is the caller's to lower
    assert read(f, max_bytes=100).values == {"VIRTUAL_ENV": "/v"}
    # a whole file at the cap is read whole
    exact = write_env(tmp_path / "exact", [b"VIRTUAL_ENV=/v"])
    assert read(exact, max_bytes=exact.stat().st_size) == SavedEnv({"VIRTUAL_ENV": "/v"}, (),
                                                                   str(exact))


def test_truncation_a_lying_count_and_a_nul_less_tail_are_problems(tmp_path: Path) -> None:
    entries = [b"VIRTUAL_ENV=/v", b"HOME=/h", b"CONDA_PREFIX=/c"]
    f = write_env(tmp_path / "more", entries, count=5)
    got = read(f)
    assert got.values == {"VIRTUAL_ENV": "/v", "CONDA_PREFIX": "/c"}
    assert got.problems == (f"{f}: says 5 entries, holds 3: truncated, the rest are not known",)
    # a count below what is there: slurmctld reads no further, nor does the reader
    f = write_env(tmp_path / "fewer", entries, count=2)
    got = read(f)
    assert got.values == {"VIRTUAL_ENV": "/v"}
    assert got.problems == (f"{f}: says 2 entries, holds 3: those past 2 are not read "
                            "(slurmctld reads no further)",)
    f = write_env(tmp_path / "huge", entries, count=0xFFFFFFFF)
    assert "says 4294967295 entries, holds 3" in read(f).problems[0]
    # cut inside an entry: that entry is not read
    f = write_env(tmp_path / "tail", entries[:2], count=3, tail=b"CONDA_PREFIX=/c")
    got = read(f)
    assert got.values == {"VIRTUAL_ENV": "/v"}
    assert got.problems == (
        f"{f}: ends inside an entry (no NUL after its last bytes): that entry is not read",
        f"{f}: says 3 entries, holds 2: truncated, the rest are not known")
    # shorter than the count itself; empty; a count of 0 and nothing else (valid)
    for size in (0, 3):
        f = tmp_path / f"short{size}"
        f.write_bytes(b"\1" * size)
        assert read(f) == SavedEnv({}, (f"{f}: {size} bytes, shorter than its 4-byte count: "
                                        "not read",), str(f))
    f = write_env(tmp_path / "zero", [])
    assert read(f) == SavedEnv({}, (), str(f))


def test_a_name_twice_keeps_the_first_and_says_so(tmp_path: Path) -> None:
    f = write_env(tmp_path / "environment", [b"VIRTUAL_ENV=/first", b"VIRTUAL_ENV=/second"])
    got = read(f)
    assert got.values == {"VIRTUAL_ENV": "/first"}
    assert got.problems == (f"{f}: VIRTUAL_ENV appears more than once: the first kept",)


def test_non_utf8_bytes_come_back_as_the_same_bytes(tmp_path: Path) -> None:
    raw = b"/home/u/caf\xe9/\xff\xfe/venv"
    f = write_env(tmp_path / "environment", [b"VIRTUAL_ENV=" + raw, b"NCCL_NET=\xc3\xa9"])
    got = read(f)
    assert got.problems == ()
    assert os.fsencode(got.values["VIRTUAL_ENV"]) == raw  # surrogateescape, as fsdecode
    assert got.values["NCCL_NET"] == "é"


def test_a_missing_file_is_a_plain_outcome(tmp_path: Path) -> None:
    p = tmp_path / "hash.1" / "job.1" / "environment"
    assert read(p) == SavedEnv({}, (), str(p), missing=True)


def test_a_symlink_is_not_followed(tmp_path: Path) -> None:
    target = write_env(tmp_path / "real", [b"VIRTUAL_ENV=/v"])
    link = tmp_path / "environment"
    link.symlink_to(target)
    got = read(link)
    assert got == SavedEnv({}, (f"{link}: cannot open: {os.strerror(errno.ELOOP)} (a symbolic "
                                "link: not followed)",), str(link))


def test_a_fifo_never_blocks(tmp_path: Path) -> None:
    fifo = tmp_path / "environment"
    os.mkfifo(fifo, 0o600)
    out: list[SavedEnv] = []
    t = threading.Thread(target=lambda: out.append(read(fifo)), daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():  # let a blocked open go, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading a FIFO blocked")
    assert out == [SavedEnv({}, (f"{fifo}: a FIFO, not a regular file: not read",), str(fifo))]


def test_a_directory_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "environment"
    d.mkdir(mode=0o700)
    got = read(d)
    assert got.values == {} and not got.missing
    assert got.problems == (f"{d}: a directory, not a regular file: not read",)


def test_a_file_writable_by_group_or_others_is_refused(tmp_path: Path) -> None:
    f = write_env(tmp_path / "environment", [b"VIRTUAL_ENV=/v"])
    for mode in (0o620, 0o602, 0o666):
        f.chmod(mode)
        assert read(f) == SavedEnv({}, (f"{f}: writable by group or others (mode {mode:04o}): "
                                        "not read",), str(f))
    f.chmod(0o644)  # readable by others is slurmctld's business, not a forgery
    assert read(f).values == {"VIRTUAL_ENV": "/v"}


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_file_of_another_user_is_refused(tmp_path: Path) -> None:
    f = write_env(tmp_path / "environment", [b"VIRTUAL_ENV=/v"])
    os.chown(f, 65534, -1)
    got = read(f)
    assert got.values == {}
    assert len(got.problems) == 1
    assert got.problems[0].startswith(f"{f}: owned by ")
    assert got.problems[0].endswith(f", not by this process's uid {os.geteuid()}: not read")


# ------------------------------------------------------------------ real Slurm

@pytest.fixture(scope="module")
def ctld(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    require_slurm()
    with DevCluster(tmp_path_factory.mktemp("savedenv"), nodes=1, prolog=False) as c:
        yield c


def _entries(path: str) -> tuple[int, list[bytes]]:
    """The count and entries of a saved environment, read whole (for the test only)."""
    data = Path(path).read_bytes()
    (count,) = struct.unpack("=I", data[:4])
    assert data.endswith(b"\0")
    return count, data[4:-1].split(b"\0")


def _submit(c: DevCluster, args: Sequence[str], env: dict[str, str]) -> int:
    r = c.run(["sbatch", "--parsable", "--hold", *args, "--wrap", "true"], env=env)
    return int(r.stdout.strip().split(";")[0])


@pytest.mark.slurm
@pytest.mark.slow
def test_a_real_batch_jobs_saved_environment(ctld: DevCluster, tmp_path: Path) -> None:
    state = str(ctld.root / "state")
    # the largest one value exec(2) passes is under 128 KiB (MAX_ARG_STRLEN), so a 1 MB
    # environment is nine such variables; a single 1 MB one never reaches sbatch
    pads = {f"PAD{i}": chr(ord("a") + i) * (120 << 10) for i in range(9)}
    env = {"VIRTUAL_ENV": "/home/u/venv", "LD_LIBRARY_PATH": LIB10K,
           "NCCL_NET_PLUGIN": "aws-ofi", **pads}
    job = _submit(ctld, [], env)
    path = environment_path(state, job)
    st = os.stat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid()  # SlurmUser: root in the dev cluster
    assert st.st_size > 1 << 20
    count, entries = _entries(path)
    assert count == len(entries)
    got = savedenv.read(path, NAMES, max_value=jobenv.MAX_VALUE)
    assert got.problems == () and not got.missing
    assert got.values == {"VIRTUAL_ENV": "/home/u/venv", "LD_LIBRARY_PATH": LIB10K,
                          "NCCL_NET_PLUGIN": "aws-ofi"}
    assert savedenv.read(path, ["PAD8"], max_value=1 << 20).values == {"PAD8": pads["PAD8"]}

    with pytest.raises(OSError) as e:
        ctld.run(["sbatch", "--hold", "--wrap", "true"], env={"BIG": "x" * (1 << 20)})
    assert e.value.errno == errno.E2BIG
    # --export-file carries any length to sbatch, which drops a value of 256 KiB or more
    # (ENV_BUFSIZE, with its NUL): Slurm's file holds the one a byte shorter only
    ef = tmp_path / "env0"
    ef.write_bytes(b"BIG=" + b"x" * (1 << 20) + b"\0AT=" + b"a" * (256 << 10) + b"\0"
                   b"UNDER=" + b"u" * ((256 << 10) - 1) + b"\0")
    job = _submit(ctld, ["--export=ALL", f"--export-file={ef}"], {})
    got = savedenv.read(environment_path(state, job), ["BIG", "AT", "UNDER"],
                        max_value=1 << 20)
    assert got.problems == ()
    assert got.values == {"UNDER": "u" * ((256 << 10) - 1)}


@pytest.mark.slurm
@pytest.mark.slow
def test_an_array_task_reads_its_masters_file(ctld: DevCluster) -> None:
    state = str(ctld.root / "state")
    master = _submit(ctld, ["--array=0-1"], {"VIRTUAL_ENV": "/arr/venv"})
    # a change to one task splits it off into a job record of its own
    ctld.run(["scontrol", "update", f"JobId={master}_1", "Comment=split"])
    r = ctld.run(["squeue", "--noheader", "-r", "-j", str(master), "-o", "%A %F %K"])
    tasks = [tuple(map(int, line.split())) for line in r.stdout.splitlines()]
    assert sorted(t[2] for t in tasks) == [0, 1] and {t[1] for t in tasks} == {master}
    assert any(t[0] != master for t in tasks)  # the split task has its own id
    for job, array_job, _ in tasks:
        path = environment_path(state, job, array_job_id=array_job)
        assert path == environment_path(state, master)
        got = savedenv.read(path, NAMES, max_value=jobenv.MAX_VALUE)
        assert got.values == {"VIRTUAL_ENV": "/arr/venv"} and got.problems == ()
        if job != master:  # no file under the task's own id
            assert savedenv.read(environment_path(state, job), NAMES,
                                 max_value=jobenv.MAX_VALUE).missing


@pytest.mark.slurm
@pytest.mark.slow
def test_export_none_saves_only_slurms_own_variables(ctld: DevCluster) -> None:
    state = str(ctld.root / "state")
    job = _submit(ctld, ["--export=NONE"], {"VIRTUAL_ENV": "/home/u/venv",
                                            "LD_LIBRARY_PATH": "/opt/nccl/lib"})
    path = environment_path(state, job)
    got = savedenv.read(path, NAMES, max_value=jobenv.MAX_VALUE)
    assert got.values == {} and got.problems == () and not got.missing
    _, entries = _entries(path)
    names = sorted(e.split(b"=", 1)[0].decode() for e in entries)
    # 24.11 on also keep the SPANK options (env_array_merge_slurm_spank: "_SLURM_SPANK_OPTION_")
    # and set the external MPI launchers' variables (set_env_from_opts, src/common/env.c:
    # OMPI_MCA_plm_slurm_args, PRTE_MCA_plm_slurm_args, HYDRA_*, I_MPI_HYDRA_*; seen on
    # 24.11.5 and 26.05 in CI's roots)
    launchers = ("OMPI_MCA_plm_slurm_args", "PRTE_MCA_plm_slurm_args", "HYDRA_BOOTSTRAP",
                 "HYDRA_LAUNCHER_EXTRA_ARGS", "I_MPI_HYDRA_BOOTSTRAP",
                 "I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS")
    assert names and all(n.startswith(("SLURM", "_SLURM_SPANK_OPTION_")) or n in launchers
                         for n in names), names
    assert "SLURM_GET_USER_ENV" in names


@pytest.mark.slurm
@pytest.mark.slow
def test_an_salloc_job_has_no_saved_environment(ctld: DevCluster) -> None:
    r = ctld.run(["salloc", "--no-shell", "-N1"], env={"VIRTUAL_ENV": "/home/u/venv"})
    job = int(r.stderr.split("Granted job allocation ")[1].split()[0])
    try:
        got = savedenv.read(environment_path(str(ctld.root / "state"), job), NAMES,
                            max_value=jobenv.MAX_VALUE)
        assert got == SavedEnv({}, (), got.path, missing=True)
    finally:
        ctld.run(["scancel", str(job)], check=False)
