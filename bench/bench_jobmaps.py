"""What ``ncclguard-inventoryd jobmaps`` costs a node (issue 42, docs/runtime.md): one scan
with 64 running job steps of 64 processes each, every process with a real libnccl mapped,
against a scan of the same machine without them.

Each step is a real process tree shaped as ``proctrack/linuxproc`` leaves one: a
root-owned process titled ``slurmstepd: [J.0]`` (a copy of bash named ``slurmstepd``, so
that the kernel names it so, started with that ``argv[0]``)
whose child is ``loadnccl --fork 64`` (tests/helpers/loader.py, gcc-built), which
``dlopen``s the real libnccl 2.21.5 of the nvidia-nccl wheel and forks 63 children that
share it. The scanner finds them by that ancestry, reads the 4,096 processes' maps and
identifies the one file (hashed once, then from its file cache). Without ``--plugin``
they map libnccl only, so every scan reads every process's maps again; with ``--plugin``
each also maps a gcc-built net plugin, as after NCCL's first communicator: such a process
is read once, then only found (its pid and start) while it lives.

Rounds interleave, in this process:

- ``jobs``: ``Scanner.scan()`` with the 64 steps running;
- ``discovery``: the same scanner's ``steps()`` alone (the /proc walk, cgroups, titles;
  no maps read): what any scan of this machine costs;

and, before the steps start and after they end (a sandwich), ``empty``: a scan with no job
on the machine. Prints milliseconds, ratios, the bytes of maps read per scan, and the
document's growth per step (its JSON bytes over the steps). Never asserts a time.

    .venv/bin/python bench/bench_jobmaps.py [--steps 64] [--procs 64] [--rounds 9] [--plugin]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # devtools
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # helpers

from helpers.loader import build_loader

from devtools import ncclwheels
from inventoryd.filecache import FileCache
from inventoryd.node.jobmaps import Scanner


def _ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def _empty_scans(scanner: Scanner, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        doc = scanner.scan()
        out.append(time.perf_counter() - t)
        assert not doc["steps"], doc["steps"][:1]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--procs", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--plugin", action="store_true", help="each process also maps a net "
                    "plugin (NCCL's net set up)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-jobmaps-"))
    lib = ncclwheels.extract_nccl("2.21.5")
    loader = build_loader(tmp / "bin")
    plugin = ""
    if a.plugin:
        from helpers.parts import build_plugin

        plugin = str(build_plugin(tmp / "plugin", net_abis=[8, 7], name="IBbench"))
    scanner = Scanner("bench", cache=FileCache(tmp / "cache.json"))
    empty = _empty_scans(scanner, a.rounds)
    stepd = tmp / "slurmstepd"
    shutil.copy(shutil.which("bash") or "/bin/bash", stepd)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for j in range(1, a.steps + 1):
            script = (f"LD_LIBRARY_PATH={lib.parent} {loader} --fork {a.procs} 3600 {plugin} "
                      f"> {tmp}/out.{j}; wait")
            procs.append(subprocess.Popen([f"slurmstepd: [{900000 + j}.0]", "-c", script],
                                          executable=stepd,
                                          stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ready = sum(1 for j in range(1, a.steps + 1)
                        if (tmp / f"out.{j}").exists() and (tmp / f"out.{j}").read_text())
            if ready == a.steps:
                break
            time.sleep(0.2)
        time.sleep(1.0)  # the forks
        t = time.perf_counter()
        first = scanner.scan()
        cold = time.perf_counter() - t
        found = sum(s["procs"] for s in first["steps"])
        machine = scanner.stats["procs"]
        jobs: list[float] = []
        disc: list[float] = []
        maps_bytes = 0
        doc = first
        for _ in range(a.rounds):
            t = time.perf_counter()
            doc = scanner.scan()
            jobs.append(time.perf_counter() - t)
            maps_bytes = scanner.stats["maps_bytes"]
            t = time.perf_counter()
            scanner.steps()
            disc.append(time.perf_counter() - t)
    finally:
        for p in procs:
            subprocess.run(["pkill", "-KILL", "-P", str(p.pid)], check=False)
            p.kill()
        subprocess.run(["pkill", "-KILL", "-f", str(loader)], check=False)
        for p in procs:
            p.wait()
    time.sleep(1.0)
    empty += _empty_scans(scanner, a.rounds)
    size = len(json.dumps(doc, separators=(",", ":")))
    base = len(json.dumps({**doc, "steps": []}, separators=(",", ":")))
    print(f"steps {len(doc['steps'])} of {a.steps}, processes found {found} "
          f"(of {a.steps * a.procs}), processes on the machine {machine}")
    print(f"first scan (hashes the library once): {cold * 1000:.0f} ms")
    print(f"scan with the steps: {_ms(jobs):.1f} ms (median of {a.rounds}); "
          f"maps read {maps_bytes / 1e6:.1f} MB")
    print(f"discovery alone (interleaved): {_ms(disc):.1f} ms; "
          f"ratio scan/discovery {statistics.median(jobs) / statistics.median(disc):.2f}")
    print(f"scan without jobs (before and after): {_ms(empty):.1f} ms; "
          f"ratio with/without {statistics.median(jobs) / statistics.median(empty):.1f}")
    libs = len(doc["steps"][0]["libs"]) if doc["steps"] else 0
    print(f"document {size} bytes: {(size - base) / max(len(doc['steps']), 1):.0f} bytes per "
          f"step of {libs} librar{'y' if libs == 1 else 'ies'}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
