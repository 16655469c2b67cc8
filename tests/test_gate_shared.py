"""prolog/shared.py: what concurrent gate runs share, and what they refuse to trust.

Each test runs in well under a second (the concurrency test: 8 processes, about 1 s).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from prolog import shared

KEY = "partitions debug"


def _doc(path: Path, **fields: object) -> None:
    path.write_text(json.dumps({"key": KEY, "t": time.time(), "members": "n[1-4]", **fields}))
    path.chmod(0o600)


def test_computed_once_then_shared(tmp_path: Path) -> None:
    d = tmp_path / "gate-shared"
    calls = []

    def compute() -> dict[str, object]:
        calls.append(1)
        return {"members": "n[1-4]"}

    doc, how = shared.shared(d, "v.json", KEY, 10, 1, compute)
    assert how == "computed" and doc["members"] == "n[1-4]"
    doc2, how2 = shared.shared(d, "v.json", KEY, 10, 1, compute)
    assert how2 == "shared" and doc2 == doc and len(calls) == 1
    assert (d.stat().st_mode & 0o777) == 0o700 and ((d / "v.json").stat().st_mode & 0o777) == 0o600


@pytest.mark.parametrize(
    "spoil",
    ["old", "future", "other-key", "group-writable", "symlink", "two-links", "not-json",
     "too-large", "t-not-a-number"],
)
def test_an_answer_that_cannot_be_trusted_is_computed_again(tmp_path: Path, spoil: str) -> None:
    d = tmp_path / "gate-shared"
    shared.ensure_dir(d)
    path = d / "v.json"
    if spoil == "old":
        _doc(path, t=time.time() - 11)
    elif spoil == "future":
        _doc(path, t=time.time() + 60)
    elif spoil == "other-key":
        _doc(path, key="partitions other")
    elif spoil == "group-writable":
        _doc(path)
        path.chmod(0o620)
    elif spoil == "symlink":
        _doc(tmp_path / "elsewhere.json")
        path.symlink_to(tmp_path / "elsewhere.json")
    elif spoil == "two-links":
        _doc(path)
        os.link(path, d / "second")
    elif spoil == "not-json":
        path.write_text("{")
        path.chmod(0o600)
    elif spoil == "too-large":
        _doc(path, pad="x" * shared.MAX_BYTES)
    elif spoil == "t-not-a-number":
        _doc(path, t="now")
    assert shared.read(path, KEY, 10) is None
    doc, how = shared.shared(d, "v.json", KEY, 10, 1, lambda: {"members": "fresh"})
    assert how == "computed" and doc["members"] == "fresh"


@pytest.mark.parametrize("spoil", ["group-writable-dir", "a-file", "a-symlink", "open-parent"])
def test_a_directory_that_is_not_ours_alone_is_refused(tmp_path: Path, spoil: str) -> None:
    parent = tmp_path / "audit"
    parent.mkdir(mode=0o755)
    d = parent / "gate-shared"
    if spoil == "group-writable-dir":
        d.mkdir()
        d.chmod(0o770)
    elif spoil == "a-file":
        d.write_text("")
    elif spoil == "a-symlink":
        (tmp_path / "other").mkdir(mode=0o700)
        d.symlink_to(tmp_path / "other")
    elif spoil == "open-parent":
        parent.chmod(0o777)
    with pytest.raises(shared.SharedError, match=str(parent)):
        shared.shared(d, "v.json", KEY, 10, 1, lambda: {"members": "x"})


def test_a_failed_computation_writes_nothing_and_the_next_run_computes(tmp_path: Path) -> None:
    d = tmp_path / "gate-shared"

    def fail() -> dict[str, object]:
        raise TimeoutError("scontrol show partition: timed out after 2.4s")

    with pytest.raises(TimeoutError):
        shared.shared(d, "v.json", KEY, 10, 1, fail)
    assert not (d / "v.json").exists()
    doc, how = shared.shared(d, "v.json", KEY, 10, 1, lambda: {"members": "n1"})
    assert how == "computed" and doc["members"] == "n1"


def test_a_run_that_meets_a_held_lock_computes_itself_in_time(tmp_path: Path) -> None:
    import fcntl

    d = tmp_path / "gate-shared"
    shared.ensure_dir(d)
    fd = os.open(d / "v.json.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a run stuck in a slow Slurm call
    try:
        t = time.monotonic()
        doc, how = shared.shared(d, "v.json", KEY, 10, 0.3, lambda: {"members": "n2"})
        assert time.monotonic() - t < 1.0
        assert how == "computed, lock busy" and doc["members"] == "n2"
    finally:
        os.close(fd)


def _burst_one(d: str, log: str, q: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    def compute() -> dict[str, object]:
        with open(log, "a") as f:
            f.write("computed\n")
        time.sleep(0.3)  # the Slurm read and the inventory's classes
        return {"members": "gpu[00001-16384]"}

    doc, how = shared.shared(Path(d), "v.json", KEY, 10, 2.0, compute)
    q.put((how, doc["members"]))


def test_a_burst_of_runs_computes_once(tmp_path: Path) -> None:
    """8 runs at once (the burst after a partial upgrade): one computes, seven read it."""
    d, log = tmp_path / "gate-shared", tmp_path / "computed.log"
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_burst_one, args=(str(d), str(log), q)) for _ in range(8)]
    for p in procs:
        p.start()
    results = [q.get(timeout=20) for _ in procs]
    for p in procs:
        p.join(timeout=20)
    assert log.read_text().count("computed") == 1, results
    assert sorted(h for h, _ in results) == ["computed"] + ["shared"] * 7
    assert {m for _, m in results} == {"gpu[00001-16384]"}
