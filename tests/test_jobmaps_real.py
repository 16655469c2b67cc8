"""Hostile jobs against the node's scanner, as real processes (issue 42, docs/runtime.md):
the most mappings the kernel allows a process, a process that changes its maps while they
are read, programs named like NCCL libraries, and a path with a newline and a terminal
escape. Each step is a real process tree shaped as ``proctrack/linuxproc`` leaves one: a
process the kernel names ``slurmstepd`` (a copy of bash) titled ``slurmstepd: [J.0]``,
root (the tests run as root, as CI does), whose children are the job's.

Each asserts what is bounded (bytes read, counted), what is shown (escaped), and that no
false mixed verdict comes of it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.parts import place
from helpers.wait import wait_until

from inventoryd.node.jobmaps import Scanner
from ncclguard.cli import output as out
from ncclguard.policy.loaded import judge, node_load

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a root slurmstepd stand-in")

MAP = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
def mapped(path, n):  # n mappings of the file's first page, no fd kept per mapping
    fd = os.open(path, os.O_RDONLY)
    got = [libc.mmap(None, 4096, 1, 2, fd, 0) for _ in range(n)]  # PROT_READ, MAP_PRIVATE
    os.close(fd)
    return got
mapped(sys.argv[1], int(sys.argv[2]))
print("ready", flush=True)
if len(sys.argv) > 3:  # map and unmap 500 regions of another file, for ever
    while True:
        for a in mapped(sys.argv[3], 500):
            libc.munmap(a, 4096)
time.sleep(300)
"""


@pytest.fixture
def steps(tmp_path: Path) -> Iterator[Callable[..., None]]:
    """``start(job, *argv)``: a stand-in slurmstepd of step ``job``.0 running argv."""
    stepd = tmp_path / "slurmstepd"
    shutil.copy(shutil.which("bash") or "/bin/bash", stepd)
    started: list[subprocess.Popen[str]] = []

    def start(job: int, *argv: str) -> None:
        ready = tmp_path / f"ready.{job}"
        cmd = shlex.join(argv)
        p = subprocess.Popen([f"slurmstepd: [{job}.0]", "-c", f"{cmd} > {ready}; wait"],
                             executable=stepd, text=True, start_new_session=True)
        started.append(p)
        wait_until(lambda: ready.exists() and "ready" in ready.read_text(), 60,
                   f"step {job}.0's process")

    yield start
    for p in started:
        os.killpg(p.pid, 9)
        p.wait()


def _libs(doc: dict, job: int) -> list[dict]:
    (st,) = [s for s in doc["steps"] if s["job"] == str(job)]
    return st["libs"]


def test_the_most_mappings_a_process_may_have_are_read_to_a_bound_and_starve_no_one(
    steps: Callable[..., None], tmp_path: Path, nccl_lib: Callable[[str], Path],
) -> None:
    lib = place(tmp_path / "v", "/libnccl.so.2", nccl_lib("2.21.5"))
    most = int(Path("/proc/sys/vm/max_map_count").read_text()) - 1000  # 64,530 by default
    steps(9101, sys.executable, "-c", MAP, str(lib), str(most))
    steps(9102, sys.executable, "-c", MAP, str(lib), "1")
    sc = Scanner("n1", maps_bytes=1 << 20)
    doc = sc.scan()
    big = next(s for s in doc["steps"] if s["job"] == "9101")
    assert big["cut"] and sc.stats["maps_bytes"] <= (1 << 20) + 64 * 1024  # + 9102's
    # the file mapped 64,530 times is one library, identified; the other step is whole
    assert [(x["kind"], x["version"]) for x in big["libs"]] == [("nccl", "2.21.5")]
    assert [(x["kind"], x["version"]) for x in _libs(doc, 9102)] == [("nccl", "2.21.5")]
    whole = Scanner("n1")  # the default bound (16 MiB) holds all of it
    doc = whole.scan()
    assert not next(s for s in doc["steps"] if s["job"] == "9101")["cut"]
    assert whole.stats["maps_bytes"] > most * 60


def test_a_process_that_changes_its_maps_while_they_are_read_is_read_right(
    steps: Callable[..., None], tmp_path: Path, nccl_lib: Callable[[str], Path],
) -> None:
    lib = place(tmp_path / "v", "/libnccl.so.2", nccl_lib("2.21.5"))
    other = tmp_path / "data.bin"
    other.write_bytes(b"\0" * 8192)
    steps(9103, sys.executable, "-c", MAP, str(lib), "1", str(other))
    sc = Scanner("n1")
    for _ in range(30):
        libs = _libs(sc.scan(), 9103)
        assert [(x["kind"], x["version"], x["error"]) for x in libs] == [
            ("nccl", "2.21.5", None)], libs
        time.sleep(0.01)


def test_programs_named_like_nccl_libraries_are_never_taken_for_them(
    steps: Callable[..., None], tmp_path: Path, nccl_lib: Callable[[str], Path],
) -> None:
    """A user's programs called ``libnccl-net.so`` and ``libnccl.so.2`` (their
    executables are mapped under those names) on one node of a job: not a net plugin, not
    another libnccl; the job is not called mixed."""
    lib = place(tmp_path / "v", "/libnccl.so.2", nccl_lib("2.21.5"))
    fake_dir = tmp_path / "bin"
    fake_dir.mkdir()
    for name in ("libnccl-net.so", "libnccl.so.2"):
        shutil.copy(shutil.which("sleep") or "/bin/sleep", fake_dir / name)
    steps(9104, sys.executable, "-c", MAP, str(lib), "1")
    for job, name in ((9105, "libnccl-net.so"), (9106, "libnccl.so.2")):
        steps(job, "sh", "-c", f"echo ready; exec {fake_dir / name} 300")
    doc = Scanner("n1").scan()
    (net,) = _libs(doc, 9105)
    assert (net["kind"], net["error"]) == ("net", "exports no NCCL net plugin symbol"), net
    (nccl,) = _libs(doc, 9106)
    assert nccl["kind"] == "nccl" and nccl["version"] is None and nccl["error"], nccl
    # a job whose one node also ran them: not a plugin on some nodes, not another libnccl
    real = _libs(doc, 9104)
    assert judge([node_load("n1", real, 0.0, 1e9),
                  node_load("n2", [*real, net, nccl], 0.0, 1e9)]) is None


def test_a_path_with_a_newline_and_a_terminal_escape_is_read_and_shown_escaped(
    steps: Callable[..., None], tmp_path: Path, nccl_lib: Callable[[str], Path],
) -> None:
    d = tmp_path / "es\x1b[31mc\nline"
    lib = place(d, "/libnccl.so.2", nccl_lib("2.21.5"))
    steps(9107, sys.executable, "-c", MAP, str(lib), "1")
    (x,) = _libs(Scanner("n1").scan(), 9107)
    # the kernel writes the newline as \012; the file is found by its device and inode
    assert "\\012line" in x["path"] and "\n" not in x["path"] and "\x1b" in x["path"]
    assert (x["version"], x["error"]) == ("2.21.5", None)
    shown = out.table([{"path": x["path"]}], [("path", "LIBNCCL")])
    assert "\x1b" not in shown and shown.count("\n") == 2, shown
