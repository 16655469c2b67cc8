"""Issue 12: diagnose and the Epilog read files a job's user controls, as SlurmUser. No
such file makes them run past their budget: every catalog pattern is linear on long
adversarial lines, the deadline is checked inside the read loop (a line with no newline,
a gzip bomb), and no user-chosen path is globbed."""

from __future__ import annotations

import gzip
import os
import re
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from ncclguard.diagnose import catalog, resolve_output
from ncclguard.diagnose.scanner import Scanner

BUDGET_S = 2.0
LINE = 64 * 1024
FILLERS = (b" ", b"a", b"0", b".", b"\t", b"x ", b", ", b"(", b"/", b"=", b"v", b"-", b":",
           b"\xff", b"NCCL ", b": ")


def _adversarial(needles: list[bytes]) -> Iterator[bytes]:
    """Lines of 64 KiB of each character class, alone and after each literal a pattern
    needs, ending in the class or in another character (what makes a lazy or greedy
    group backtrack), and each literal repeated."""
    for f in FILLERS:
        n = LINE // len(f)
        yield f * n
        for nd in needles:
            yield nd + f * n
            yield nd + b"x" + f * n + b"y"
            yield (nd + f) * (LINE // (len(nd) + len(f)))
    for nd in needles:
        yield nd * (LINE // max(len(nd), 1))


def _patterns() -> list[tuple[str, catalog.Pattern]]:
    return [(f"{s.id}:{i}", p) for s in catalog.load() for i, p in enumerate(s.patterns)]


@pytest.mark.parametrize(("name", "pattern"), _patterns(), ids=[n for n, _ in _patterns()])
def test_every_catalog_pattern_is_linear_on_long_lines(name: str, pattern: catalog.Pattern
                                                       ) -> None:
    """``^Using network (?P<net>.+?)\\s*$`` took 10 s on one 64 KiB line here (a run of
    spaces before a last character): 133 s for a 1 MiB log of 17 such lines."""
    needles = list(pattern.needles or [b""])
    # and the literal a pattern starts with, which need not be its needle: a greedy
    # "NET/IB\S*" tried at each of 10,000 "NET/IB" on one line took minutes
    lead = re.match(r"\^?([A-Za-z0-9/ :_-]{4,})", pattern.text)
    if lead:
        needles.append(lead.group(1).encode())
    for line in _adversarial(needles):
        t0 = time.perf_counter()
        pattern.regex.search(line)
        took = time.perf_counter() - t0
        assert took < 0.5, f"{name}: {took:.1f} s on {line[:40]!r}..."


def _scan(path: Path, budget: float = BUDGET_S) -> tuple[Scanner, float]:
    scanner = Scanner(catalog.load())
    t0 = time.monotonic()
    scanner.feed(path, deadline=t0 + budget)
    return scanner, time.monotonic() - t0


def test_a_file_with_no_newline_stops_at_the_budget(tmp_path: Path) -> None:
    """A 3 GiB file without a newline took 7.1 s with a budget of 2: the over-long line
    was skipped without looking at the clock (before issue 12's fix)."""
    p = tmp_path / "slurm-1.out"
    with open(p, "wb") as f:
        f.write(b"x" * (1 << 20))
        f.truncate(16 << 30)  # the rest: sparse zero bytes, no newline
    # a budget no machine reads 16 GiB within (64 GB/s): with 3 GiB and 2 s, a fresh CI
    # machine read the holes all in time (CI of 2026-12-02), and there was no limit to reach
    budget = 0.25
    scanner, took = _scan(p, budget)
    assert took < budget + 0.5, took
    assert [pr.cause for pr in scanner.problems] == ["time limit reached"]


def test_a_gzip_bomb_stops_at_the_budget(tmp_path: Path) -> None:
    """3 MB of gzip that inflates to 3 GiB took 8.1 s with a budget of 2."""
    p = tmp_path / "slurm-2.out.gz"
    # 48 gzip members of 64 MiB of zeros each (a gzip file may hold several; gzip and the
    # reader read on through them): compressed once, not 3 GiB through zlib in the test
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    member = comp.compress(b"\0" * (64 << 20)) + comp.flush()
    with open(p, "wb") as f:
        for _ in range(48):
            f.write(member)
    assert p.stat().st_size < 8 << 20
    with gzip.open(p) as g:  # it is what it says
        assert g.read(10) == b"\0" * 10
    # a budget no machine inflates 3 GiB within (zlib: 1-3 GB/s): with 2 s, a fresh,
    # quiet CI machine read it all in time, and there was no limit to reach
    budget = 0.25
    scanner, took = _scan(p, budget)
    assert took < budget + 0.5, took
    assert [pr.cause for pr in scanner.problems] == ["time limit reached"]


def test_a_deep_percent_n_path_is_not_globbed(tmp_path: Path) -> None:
    """``-o /%N/%N/%N/%N/%N/%N/%N/x`` expanded to a filesystem-wide glob (depth 7: 30 s).
    A %N in a directory part is never searched; in the file name, one directory is."""
    t0 = time.monotonic()
    deep = "/" + "/".join(["%N"] * 7) + "/x"
    assert resolve_output(deep, "n1") == "/n1/n1/n1/n1/n1/n1/n1/x"
    assert time.monotonic() - t0 < 0.5
    (tmp_path / "out-gpu001.log").write_text("hi")
    (tmp_path / "other.log").write_text("")
    # the file of another host name than the node name: found in its one directory
    assert resolve_output(f"{tmp_path}/out-%N.log", "n1") == f"{tmp_path}/out-gpu001.log"
    (tmp_path / "out-gpu002.log").write_text("hi")
    assert resolve_output(f"{tmp_path}/out-%N.log", "n1") == f"{tmp_path}/out-n1.log"
    assert resolve_output(f"{tmp_path}/%N/out.log", "n1") == f"{tmp_path}/n1/out.log"
    os.mkdir(tmp_path / "n[1]")  # glob metacharacters in the real name: no special meaning
    assert resolve_output(f"{tmp_path}/n[1]/%N", "n2") == f"{tmp_path}/n[1]/n2"


def test_gzip_that_never_yields_data_stops_at_the_budget(tmp_path: Path) -> None:
    """Review of issue 12: one gzip read can run long without returning: millions of
    empty members, or a file-name field parsed byte by byte. The deadline is checked on
    every raw read."""
    empty = gzip.compress(b"")
    p = tmp_path / "empty-members.gz"
    p.write_bytes(empty * 2_000_000)  # 40 MB, nothing in it
    scanner, took = _scan(p)
    assert took < BUDGET_S + 0.5, took
    assert [pr.cause for pr in scanner.problems] == ["time limit reached"]
    q = tmp_path / "fname.gz"
    header = b"\x1f\x8b\x08\x08" + b"\0" * 6  # FNAME set
    q.write_bytes(header + b"a" * (200 << 20) + b"\0")
    scanner, took = _scan(q)
    assert took < BUDGET_S + 0.5, took
    assert [pr.cause for pr in scanner.problems] == ["time limit reached"]


def test_many_percent_n_in_a_file_name_match_in_linear_time(tmp_path: Path) -> None:
    """Review of issue 12: the %N match was a regex of ``.*`` groups: 8 of them against a
    60-character name took 7.9 s, 10 ran for minutes, before the Epilog had a deadline."""
    (tmp_path / ("a" * 60)).write_text("")
    t0 = time.monotonic()
    name = "%N" * 10 + "b"
    assert resolve_output(f"{tmp_path}/{name}", "n1") == f"{tmp_path}/{name.replace('%N', 'n1')}"
    assert time.monotonic() - t0 < 0.5
    (tmp_path / "x-n7-y-n7-z").write_text("")
    assert resolve_output(f"{tmp_path}/x-%N-y-%N-z", "q") == f"{tmp_path}/x-n7-y-n7-z"


def _distinct_hosts_and_values(path: Path, n: int) -> None:
    """What a user can print: ever new host names (not the job's) and, from the job's
    own nodes, ever new NCCL versions and net plugin names (issue 47: a 108 MB log of
    these held 752 MB in the Epilog)."""
    with open(path, "w") as f:
        for i in range(n):
            own = f"n{i % 4 + 1}"
            f.write(f"{own}:{i}:{i} [0] NCCL INFO NCCL version 2.{i}.0+cuda12.4\n"
                    f"host{i}:{i}:{i} [0] NCCL INFO NCCL version 2.18.{i}+cuda12\n"
                    f"host{i}:{i}:{i} [0] NCCL INFO NET/Plugin: Loaded net plugin p{i} (v8)\n"
                    f"{own}:{i}:{i} [0] NCCL INFO comm 0x{i:x} rank {i} nranks {n} cudaDev 0 "
                    "busId 0 - Init COMPLETE\n")


def test_distinct_hosts_and_values_are_bounded_and_the_cut_said(tmp_path: Path) -> None:
    from ncclguard.diagnose import run
    from ncclguard.diagnose.scanner import MAX_HOSTS, MAX_VALUES

    log = tmp_path / "slurm-1.out"
    _distinct_hosts_and_values(log, 6000)
    # the job's nodes known (the Epilog, --job): only they are attributed
    scanner = Scanner(catalog.load(), hosts=["n1", "n2", "n3", "n4"])
    scanner.feed(log)
    ev = scanner.evidence()
    assert {"n1", "n2", "n3", "n4"} <= set(ev.hosts) and len(ev.hosts) <= MAX_HOSTS
    for st in ev.states.values():
        assert len(st.values) <= MAX_VALUES
        assert {k for k in st.printers} <= {"n1", "n2", "n3", "n4"}
        assert all(set(by) <= {"n1", "n2", "n3", "n4"} for by in st.values.values())
    assert len(scanner._pid_rank) <= 4 * 6000  # the job's own processes
    assert any("not of the job's nodes" in p for p in ev.problems), ev.problems
    assert any(f"past the first {MAX_VALUES}" in p for p in ev.problems), ev.problems
    # unknown nodes: at most MAX_HOSTS names, whatever the log says
    scanner = Scanner(catalog.load())
    scanner.feed(log)
    ev = scanner.evidence()
    assert len(ev.hosts) <= MAX_HOSTS
    keys = {k for st in ev.states.values() for k in st.printers}
    assert len(keys) <= MAX_HOSTS
    assert any(f"past the first {MAX_HOSTS} host names" in p for p in ev.problems)
    # the report still diagnoses the job's nodes' versions, with its evidence
    report = run([log], catalog=catalog.load(), nodes=["n1", "n2", "n3", "n4"])
    (d,) = [d for d in report.diagnoses if d.signature.id == "nccl-version-differs"]
    assert set(d.hosts) == {"n1", "n2", "n3", "n4"} and d.evidence


def test_past_the_deadline_the_inventory_is_not_read(tmp_path: Path) -> None:
    """The deadline is checked to the end: once it has passed, the report is made of what
    was read and the inventory is not opened."""
    from ncclguard.diagnose import run

    log = tmp_path / "slurm-1.out"
    _distinct_hosts_and_values(log, 10)
    opened: list[int] = []
    report = run([log], catalog=catalog.load(), nodes=["n1"], deadline=time.monotonic() - 1,
                 open_inventory=lambda: opened.append(1))
    assert opened == [] and report.inventory_note.endswith("the time limit was reached")


def test_a_large_honest_job_where_every_rank_failed_names_no_odd_node(tmp_path: Path) -> None:
    """From issue 47's review of the bounds: on a 1,024-node x 8-GPU job (nodes known) in
    which every rank printed PyTorch's ``[rankR]:`` error, the ranks ran out the bound on
    host names, and 384 healthy nodes were named odd ("the other 640 did not print it").
    A rank's host is read from its banner; no odd node is named by absence."""
    from ncclguard.diagnose import run

    log = tmp_path / "slurm-1.out"
    nodes = [f"n{i}" for i in range(1, 1025)]
    with open(log, "w") as f:
        for r in range(8192):
            f.write(f"[rank{r}]: n{r // 8 + 1}:{5000 + r}:{5000 + r} [{r % 8}] NCCL INFO NCCL "
                    "version 2.21.5+cuda12.4\n")
        for r in range(8192):
            f.write(f"[rank{r}]: ncclUnhandledCudaError: Call to CUDA function failed.\n"
                    f"[rank{r}]: Last error:\n[rank{r}]: Cuda failure 'out of memory'\n")
        f.write("[rank8191]: n1024:1:1 [0] NCCL INFO NCCL version 2.18.3+cuda12.1\n")
    report = run([log], catalog=catalog.load(), nodes=nodes)
    assert all(not d.odd_nodes for d in report.diagnoses
               if d.signature.id != "nccl-version-differs"), [
        (d.signature.id, d.odd_nodes[:3]) for d in report.diagnoses]
    oom = next(d for d in report.diagnoses if d.signature.id == "cuda-out-of-memory")
    assert "All 1024 hosts printed it" in oom.summary, oom.summary
    (v,) = [d for d in report.diagnoses if d.signature.id == "nccl-version-differs"]
    assert v.odd_nodes == ["n1024"]


def test_long_text_before_nccl_is_not_cached(tmp_path: Path) -> None:
    """From issue 47's review: lines of 64,000 distinct bytes before " NCCL INFO x" filled
    the prefix caches (50,000 entries, no byte bound): 1.15 GB from a 1 GiB log. No
    prefix is that long: such text is neither captured whole nor cached."""
    scanner = Scanner(catalog.load(), hosts=["n1"])
    log = tmp_path / "slurm-1.out"
    pad = b"x" * 64000
    with open(log, "wb") as f:
        for i in range(400):
            f.write(b"%012d" % i + pad + b" NCCL INFO x\n")
    scanner.feed(log)
    cached = (sum(len(k) for k in scanner._first_of) + sum(map(len, scanner._first_of.values()))
              + sum(len(k) for k in scanner._settled) + sum(len(k) for k in scanner._prefixes))
    assert cached < 1 << 20, cached
    # and whatever the keys, the three caches hold at most their byte budget
    from ncclguard.diagnose.scanner import _CACHE_BYTES

    scanner._spend(_CACHE_BYTES + 1)
    assert not scanner._prefixes and not scanner._first_of and not scanner._settled


def test_ranks_of_hosts_that_are_not_the_jobs_are_not_kept(tmp_path: Path) -> None:
    """From issue 47's review: ``comm ... rank R nranks N`` lines of ever new hosts that
    are not the job's filled the (host, pid) -> rank table (148 MB)."""
    log = tmp_path / "slurm-1.out"
    with open(log, "w") as f:
        for i in range(5000):
            f.write(f"other{i}:{i}:{i} [0] NCCL INFO comm 0x{i:x} rank {i} nranks 9 cudaDev 0 "
                    "busId 0 - Init COMPLETE\n")
        f.write("n1:7:7 [0] NCCL INFO comm 0x1 rank 3 nranks 9 cudaDev 0 busId 0 - Init "
                "COMPLETE\n")
    scanner = Scanner(catalog.load(), hosts=["n1"])
    scanner.feed(log)
    assert scanner._pid_rank == {("n1", 7): 3}


@pytest.mark.parametrize("line", [
    b"n1:1:2 [0] NCCL INFO comm 0xab rank %s nranks 4 cudaDev 0 - Init COMPLETE",
    b"n1:1:2 [0] NCCL INFO comm 0xab rank 1 nranks %s cudaDev 0 - Init COMPLETE",
    b"%s: n1:1:2 [0] NCCL INFO NCCL version 2.21.5+cuda12.4",
    b"[rank%s]: n1:1:2 [0] NCCL INFO NCCL version 2.21.5+cuda12.4",
    b"[1,%s]<stderr>: n1:1:2 [0] NCCL INFO NCCL version 2.21.5+cuda12.4",
    b"%s: Last error:",
], ids=["rank", "nranks", "srun-tag", "torchrun-tag", "mpi-tag", "tag-last-error"])
def test_a_number_of_5000_digits_is_read_as_text_not_a_crash(tmp_path: Path, line: bytes
                                                              ) -> None:
    """Issue 44's review: int() of more than 4,300 digits raises ValueError, and a rank, a
    communicator size or a launcher tag of 5,000 digits stopped diagnose with a traceback
    (exit 1). Such a number is no NCCL or launcher field: the line is read as text."""
    log = tmp_path / "slurm-1.out"
    log.write_bytes(line.replace(b"%s", b"9" * 5000) + b"\n"
                    + b"n2:1:2 [0] NCCL INFO NCCL version 2.21.5+cuda12.4\n")
    scanner = Scanner(catalog.load())
    scanner.feed(log)
    ev = scanner.evidence()
    assert "n2" in ev.hosts and ev.nranks < 10**9
