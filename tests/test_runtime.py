"""What running jobs loaded (issue 42, docs/runtime.md), piece by piece: which processes
are a step's (Slurm's cgroup layouts and slurmstepd's title, as docs/runtime.md cites
them), a maps line, the document's shape and quota, the record that carries it, the
store, and the mixed verdict. The whole path on a real cluster:
tests/test_runtime_slurm.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from inventoryd.node.jobmaps import read_loaded
from inventoryd.node.procfs import (
    lib_kind,
    parse_maps_line,
    step_dir_of_cgroup,
    step_of_cgroup,
    step_of_title,
)
from ncclguard import spool
from ncclguard.fingerprint.loaded import LIBS_PER_STEP, MAX_LOADED_BYTES, loaded_problem
from ncclguard.policy.loaded import judge, node_load
from ncclguard.store import Inventory

SHA = {k: c * 64 for k, c in (("a", "a"), ("b", "b"), ("p", "c"), ("q", "d"))}


def lib(kind: str = "nccl", sha: str | None = SHA["a"], version: str | None = "2.21.5",
        abis: list[int] | None = None, name: str | None = None,
        error: str | None = None, path: str = "/v/libnccl.so.2") -> dict:
    return {"kind": kind, "path": path, "dev": "fd:1", "ino": 7, "size": 10, "sha256": sha,
            "version": version if kind == "nccl" else None,
            "abis": abis if abis is not None else ([8, 7] if kind == "nccl" else [8]),
            "name": name, "error": error}


def doc(host: str = "n1", steps: list[dict] | None = None, at: float = 1000.0) -> dict:
    return {"ncclguard_loaded": 1, "host": host, "scanned_at": at, "complete": True,
            "steps": steps if steps is not None else [step()]}


def step(job: str = "42", name: str = "0", libs: list[dict] | None = None,
         since: float | None = 900.0) -> dict:
    return {"job": job, "step": name, "uid": 1000, "procs": 2, "since": since, "cut": False,
            "libs": libs if libs is not None else [lib()]}


# ---- which processes are a step's: Slurm's layouts (docs/runtime.md cites the sources)

@pytest.mark.parametrize(("line", "want"), [
    # cgroup v1, freezer (proctrack/cgroup): /slurm/uid_U/job_J/step_S/task_N
    ("4:freezer:/slurm/uid_1000/job_42/step_0/task_1", ("42", "0")),
    ("4:freezer:/slurm/uid_1000/job_42/step_batch", ("42", "batch")),
    ("6:memory:/slurm/uid_0/job_7/step_extern/task_0", ("7", "extern")),
    ("4:freezer:/slurm/uid_1000/job_42/step_3+1/task_0", ("42", "3+1")),  # a het step
    # several slurmd on one host: /slurm_<NodeName>
    ("4:freezer:/slurm_n3/uid_1000/job_9/step_0/task_0", ("9", "0")),
    # cgroup v2: <slice>/slurmstepd.scope/job_J/step_S/user/task_N
    ("0::/system.slice/slurmstepd.scope/job_42/step_0/user/task_0", ("42", "0")),
    ("0::/system.slice/n3_slurmstepd.scope/job_42/step_interactive/user/task_0",
     ("42", "interactive")),
    ("0::/system.slice/slurmstepd.scope/job_42/step_0/user/task_special", ("42", "0")),
])
def test_a_process_in_a_step_cgroup_slurm_made_is_that_steps(line: str, want: tuple) -> None:
    assert step_of_cgroup(f"1:name=systemd:/\n{line}\n") == want


@pytest.mark.parametrize("line", [
    # a user's own delegated subtree (systemd user@.service) that copies Slurm's names
    "0::/user.slice/user-1000.slice/user@1000.service/app.slice/slurmstepd.scope/job_1/step_0",
    "0::/user.slice/user-1000.slice/user@1000.service/x/slurm/uid_1000/job_1/step_0",
    # Slurm's names below something else
    "0::/mine/slurmstepd.scope/job_1/step_0/user/task_0",
    "4:freezer:/docker/abc/slurm/uid_0/job_1/step_0",
    # the scope itself, the daemon's "system" directory: no step
    "0::/system.slice/slurmstepd.scope/system",
    "0::/system.slice/slurmstepd.scope/job_42",
    "0::/system.slice/slurmstepd.scope/job_42/step_0x",
])
def test_a_path_that_only_looks_like_slurms_is_no_steps(line: str) -> None:
    assert step_dir_of_cgroup(line) is None


def test_a_26_05_sluid_directory_names_no_job_until_its_slurmstepd_does() -> None:
    line = "0::/system.slice/slurmstepd.scope/sEKNKTV3WPV500/step_0/user/task_0"
    where, job, name = step_dir_of_cgroup(line)  # type: ignore[misc]
    assert (job, name) == (None, "0")
    assert where == "/system.slice/slurmstepd.scope/sEKNKTV3WPV500/step_0"
    assert step_of_cgroup(line) is None
    # the step's slurmstepd is in .../step_0/slurm: the same step directory
    d = step_dir_of_cgroup("0::/system.slice/slurmstepd.scope/sEKNKTV3WPV500/step_0/slurm")
    assert d is not None and d[0] == where


def test_the_node_a_path_names_must_be_this_one() -> None:
    line = "4:freezer:/slurm_n3/uid_1000/job_9/step_0/task_0"
    assert step_of_cgroup(line, "n3") == ("9", "0")
    assert step_of_cgroup(line, "n4") is None


@pytest.mark.parametrize(("title", "want"), [
    (b"slurmstepd: [42.0]\x00", ("42", "0")),
    (b"slurmstepd: [42.batch]", ("42", "batch")),
    (b"slurmstepd: [1.bat\x00d\x00", ("1", "batch")),  # cut at argv's length (seen here)
    (b"slurmstepd: [42.extern]", ("42", "extern")),
    (b"slurmstepd: [42.0 stepmgr]", ("42", "0")),  # 24.11 on
    (b"slurmstepd: [42.3+1]", ("42", "3+1")),
])
def test_slurmstepd_titles(title: bytes, want: tuple) -> None:
    assert step_of_title(title) == want


@pytest.mark.parametrize("title", [b"slurmstepd: infinity", b"python slurmstepd: [1.0]",
                                   b"slurmstepd [1.0]", b"slurmstepd: [x.0]"])
def test_other_titles_are_no_step(title: bytes) -> None:
    assert step_of_title(title) is None


# ---- a maps line

def test_maps_lines_give_the_libraries_of_interest_only() -> None:
    line = (b"7f1c2a000000-7f1c2a200000 r-xp 00000000 fd:01 1234567                    "
            b"/home/u/venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2")
    m = parse_maps_line(line)
    assert m is not None and m.dev == (0xFD, 1) and m.ino == 1234567 and not m.deleted
    assert m.path.endswith("/nvidia/nccl/lib/libnccl.so.2")
    gone = parse_maps_line(b"7f-8f r--p 0 103:02 99  /opt/p/libnccl-net.so (deleted)")
    assert gone is not None and gone.deleted and gone.path == "/opt/p/libnccl-net.so"
    for other in (b"7f-8f r--p 0 00:00 0  [heap]",
                  b"7f-8f r--p 0 fd:01 5  /usr/lib/libc.so.6",
                  b"7f-8f r--p 0 00:00 0  /anon/libnccl.so.2",  # no inode: not a file
                  b"7f-8f r--p 0 fd:01 zz /x/libnccl.so.2", b"garbage"):
        assert parse_maps_line(other) is None, other


@pytest.mark.parametrize(("path", "kind"), [
    ("/x/libnccl.so.2", "nccl"), ("/x/libnccl.so", "nccl"), ("/x/libnccl.so.2.21.5", "nccl"),
    ("/x/libnccl-net.so", "net"), ("/x/libnccl-net-aws-ofi.so", "net"),
    ("/x/libnccl-tuner-x.so", "tuner"), ("/x/libnccl-profiler.so", "profiler"),
    ("/x/libibverbs.so.1.14", "ibverbs"), ("/x/libnccl_static.a", None),
    ("/x/libnccl-net.so/../libc.so", None), ("/x/libnccl-foo.so", None),
])
def test_library_kinds(path: str, kind: str | None) -> None:
    assert lib_kind(path) == kind


# ---- the document: shape, quota, trust

def test_the_document_shape_is_checked_field_by_field() -> None:
    assert loaded_problem(doc()) is None
    assert loaded_problem(doc(), "n2") is not None  # another host's
    bad = [
        {**doc(), "ncclguard_loaded": 2},
        doc(steps=[{**step(), "job": "4x"}]),
        doc(steps=[{**step(), "step": "0; rm"}]),
        doc(steps=[step(libs=[{**lib(), "sha256": "zz"}])]),
        doc(steps=[step(libs=[{**lib(), "kind": "gpu"}])]),
        doc(steps=[step(libs=[{**lib(), "path": "/x" * 400}])]),
        doc(steps=[step(libs=[lib()] * (LIBS_PER_STEP + 1))]),
        doc(steps=[step(libs=[{**lib(), "abis": [True]}])]),
    ]
    for d in bad:
        assert loaded_problem(d) is not None, d


def test_the_document_has_a_quota_of_its_own() -> None:
    big = doc(steps=[step(job=str(j), libs=[lib(path="/" + "p" * 500)] * 4)
                     for j in range(200)])
    why = loaded_problem(big)
    assert why is not None and f"over its quota of {MAX_LOADED_BYTES}" in why


def test_the_node_daemon_trusts_only_its_own_fresh_file(tmp_path: Path) -> None:
    f = tmp_path / "loaded.json"
    assert read_loaded(str(f), "n1", 60, 1000.0) == (None, None)  # not watched
    f.write_text(json.dumps(doc(at=1000.0)))
    os.chmod(f, 0o644)
    got, why = read_loaded(str(f), "n1", 60, 1030.0)
    assert why is None and got is not None and got["steps"][0]["job"] == "42"
    assert "has stopped" in str(read_loaded(str(f), "n1", 60, 1100.0)[1])
    assert "not 'n2'" in str(read_loaded(str(f), "n2", 60, 1030.0)[1])
    os.chmod(f, 0o666)
    assert "not trusted" in str(read_loaded(str(f), "n1", 60, 1030.0)[1])
    os.chmod(f, 0o644)
    link = tmp_path / "link.json"
    link.symlink_to(f)
    assert "cannot open" in str(read_loaded(str(link), "n1", 60, 1030.0)[1])
    f.write_text("x" * (MAX_LOADED_BYTES + 10))
    assert "over" in str(read_loaded(str(f), "n1", 60, 1030.0)[1])


# ---- the record that carries it

def _fp(host: str = "n1") -> dict:
    from helpers.fingerprints import fingerprint

    return fingerprint(host)


def test_the_record_carries_it_beside_the_fingerprint_never_in_its_hash() -> None:
    from ncclguard.fingerprint.canonical import fingerprint_hash

    fp = _fp()
    data = spool.payload(fp, seq=1, loaded=doc())
    rec = spool.parse_payload(data, max_bytes=1 << 22)
    assert rec.loaded == doc() and rec.loaded_error is None
    assert fingerprint_hash(rec.fingerprint) == fingerprint_hash(fp)
    assert spool.parse_payload(spool.payload(fp, seq=1), max_bytes=1 << 22).loaded is None


def test_a_bad_loaded_part_is_left_out_and_the_fingerprint_kept() -> None:
    fp = _fp()
    for bad in ({**doc(), "host": "n2"}, {"ncclguard_loaded": 1}, doc(steps=[{"job": 1}])):
        rec = spool.parse_payload(spool.payload(fp, seq=1, loaded=bad), max_bytes=1 << 22)
        assert rec.loaded is None and rec.loaded_error, bad
        assert rec.fingerprint["host"]["hostname"] == "n1"


# ---- the store

def test_the_store_keeps_each_steps_libraries_and_marks_what_a_node_stopped_listing(
    tmp_path: Path,
) -> None:
    from ncclguard.policy import GATE_VALUES

    with Inventory(tmp_path / "inv.db", values=GATE_VALUES) as inv:
        changed = inv.write_loaded([("n1", doc(steps=[step(), step(job="43")]), 1000.0),
                                    ("n2", doc("n2"), 1000.0)])
        assert changed == {("42", "0"), ("43", "0")}
        # the same again: nothing changed
        assert inv.write_loaded([("n2", doc("n2"), 1010.0)]) == set()
        # n1 no longer lists 43: gone, not deleted
        assert inv.write_loaded([("n1", doc(steps=[step()]), 1020.0)]) == set()
        rows = inv.job_loads("43")
        assert [(r["host"], r["gone_at"]) for r in rows] == [("n1", 1020.0)]
        assert inv.job_loads("43", current=True) == []
        assert {r["host"] for r in inv.job_loads("42", current=True)} == {"n1", "n2"}
        # another library on n2: a change
        assert inv.write_loaded([("n2", doc("n2", [step(libs=[lib(sha=SHA["b"])])]),
                                  1030.0)]) == {("42", "0")}
        assert inv.record_mixed("42", "0", 1030.0, "nccl", "s", [("x", ["n1"])], ["n1"])
        assert not inv.record_mixed("42", "0", 1040.0, "nccl", "t", [], [])  # once
        assert inv.set_mixed_action("42", "requeue", "requeued: x", 1050.0)
        assert not inv.set_mixed_action("42", "requeue", "requeued: y", 1060.0)  # once
        (m,) = inv.mixed_steps("42")
        assert (m["summary"], m["result"], m["odd"]) == ("s", "requeued: x", ["n1"])
        assert inv.runtime_counts() == (1, {"nccl": 1}, {"nccl": 1})
        assert inv.prune_loads(1030.0 + 86400 * 2, 1) == 4  # 43 on n1, 42 on n1+n2, the verdict


# ---- the verdict

NOW = 2000.0


def load(host: str, *libs: dict, since: float | None = 1000.0) -> object:
    return node_load(host, libs, since, NOW, settle_s=60)


def test_one_release_everywhere_is_not_mixed() -> None:
    assert judge([load("n1", lib()), load("n2", lib()), load("n3", lib())]) is None


def test_another_release_or_another_build_is_mixed_and_each_node_named() -> None:
    m = judge([load("n1", lib()), load("n2", lib()), load("n3", lib(sha=SHA["b"],
                                                                    version="2.23.4"))])
    assert m is not None and m.kind == "nccl" and m.odd == ("n3",)
    assert m.summary.startswith("different NCCL releases: n[1-2]: libnccl 2.21.5")
    assert "n3: libnccl 2.23.4" in m.summary
    build = judge([load("n1", lib()), load("n2", lib(sha=SHA["b"]))])
    assert build is not None and "different builds of one NCCL release" in build.summary


def test_what_a_node_could_not_identify_is_never_called_different() -> None:
    unread = lib(sha=None, version=None, error="cannot read: Permission denied")
    assert judge([load("n1", lib()), load("n2", unread)]) is None
    assert judge([load("n1", lib(), lib("net", sha=SHA["p"])),
                  load("n2", lib(), lib("net", sha=None, error="replaced"))]) is None


def test_a_plugin_on_some_nodes_only_counts_once_the_nets_are_chosen() -> None:
    plug = lib("net", sha=SHA["p"], name="IBext")
    # n2 mapped libnccl 10 s ago and nothing else: its net may not be set up yet
    young = [load("n1", lib(), plug), load("n2", lib(), since=NOW - 10)]
    assert judge(young) is None
    # a minute later, or once it mapped libibverbs (NCCL's own IB): mixed
    for n2 in (load("n2", lib(), since=NOW - 61),
               load("n2", lib(), lib("ibverbs", sha=None), since=NOW - 10)):
        m = judge([load("n1", lib(), plug), n2])
        assert m is not None and m.kind == "net-missing", n2
        assert "n1: net plugin 'IBext'" in m.summary and "n2: no net plugin" in m.summary


def test_plugins_that_differ_or_speak_another_abi_are_mixed() -> None:
    p, q = lib("net", sha=SHA["p"], abis=[8]), lib("net", sha=SHA["q"], abis=[8])
    m = judge([load("n1", lib(), p), load("n2", lib(), q)])
    assert m is not None and m.kind == "net-plugin"
    tuner = judge([load("n1", lib(), lib("tuner", sha=SHA["p"])),
                   load("n2", lib(), lib("tuner", sha=SHA["q"])), load("n3", lib())])
    assert tuner is not None and tuner.kind == "tuner-plugin"
    assert "n3" not in tuner.summary  # a node without a tuner is not compared for it


def test_a_step_not_of_the_shape_is_left_out_alone_and_the_rest_written(tmp_path: Path) -> None:
    """A text past the shape (a 3 KB error) used to fail the whole document's check: not
    written, and the node's jobs went unpublished. Now that step alone is left out."""
    from inventoryd.node.jobmaps import _fit, write

    bad = step(job="7", libs=[lib(error="x" * 3000)])
    d = _fit(doc(steps=[step(), bad]))
    assert [s["job"] for s in d["steps"]] == ["42"] and d["complete"] is False
    write(d, tmp_path / "loaded.json")
    assert read_loaded(str(tmp_path / "loaded.json"), "n1", 1e12, 1000.0)[0] == d
