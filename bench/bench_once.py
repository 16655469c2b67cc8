"""Cold and warm ``ncclguard-inventoryd once`` on a node root with a real 290 MB libnccl.

Usage: .venv/bin/python bench/bench_once.py [--runs N] [--version 2.18.3] [--drop-caches]
                                           [--all-kinds]

The node root holds the real ``libnccl.so.2`` of the NCCL 2.18.3 cu12 wheel (290 MB; the
test fixture fetches and extracts it) as the linker's default, plus a gcc-built net plugin.
``--all-kinds`` adds a gcc-built plugin of every other kind (tuner, profiler, env, GIN,
RMA), each under its default name, so that the effective-plugin logic has work to do.
"Cold" is a run with an empty inventoryd file cache; "warm" the runs after it. The OS page
cache stays warm unless ``--drop-caches`` (root) empties it before the cold run.

Figures are printed as ratios against baselines measured in this same process:
- ``read``: sha256 of the library in this process (the floor of any cold run: every
  byte once);
- ``startup``: a child interpreter that imports inventoryd.node.fingerprint and exits (the floor
  of any run of the CLI);
and peak RSS of each child (``wait4``), against the bare-import child's.
Goals: warm ``collect()`` under 5 % of cold; the CLI's peak RSS under 60 MB.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from helpers.parts import build_plugin, extract_nccl, place, run_ldconfig  # noqa: E402

MULTIARCH = "/usr/lib/x86_64-linux-gnu"


# The child reports its own VmHWM at exit: ru_maxrss from wait4 would include the
# high-water mark inherited from this (larger) process across fork and exec.
_REPORT = (
    "import atexit, sys\n"
    "def _hwm():\n"
    "    for line in open('/proc/self/status'):\n"
    "        if line.startswith('VmHWM:'):\n"
    "            sys.stderr.write('VMHWM ' + line.split()[1] + '\\n')\n"
    "atexit.register(_hwm)\n"
)


def child(code: str, env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of one child interpreter running ``code``."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", _REPORT + code], stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, check=False)
    wall = time.perf_counter() - t0
    hwm = [line for line in r.stderr.splitlines() if line.startswith("VMHWM ")]
    if r.returncode != 0 or not hwm:
        raise SystemExit(f"child failed ({r.returncode}): {r.stderr}")
    return wall, int(hwm[-1].split()[1]) / 1024


def drop_caches() -> None:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        print(f"note: cannot drop the page cache ({e}); cold means 'empty file cache' only")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--version", default="2.18.3")
    ap.add_argument("--drop-caches", action="store_true")
    ap.add_argument("--all-kinds", action="store_true")
    args = ap.parse_args()

    lib = extract_nccl(args.version)
    work = Path(tempfile.mkdtemp(prefix="bench-once-"))
    try:
        root = work / "node"
        place(root, f"{MULTIARCH}/libnccl.so.2", lib)
        if shutil.which("gcc"):
            place(root, f"{MULTIARCH}/libnccl-net.so",
                  build_plugin(work / "build", net_abis=[8, 7, 6], name="IBext_v8"))
            kinds = {"tuner": [6, 2], "profiler": [7, 1], "env": [2, 1], "gin": [14, 11],
                     "rma": [16, 13]}
            for kind, abis in kinds.items() if args.all_kinds else ():
                so = f"libnccl-{kind}.so"
                place(root, f"{MULTIARCH}/{so}", build_plugin(
                    work / kind, filename=so, **{f"{kind}_abis": abis}))
        run_ldconfig(root)
        size_mb = lib.stat().st_size / 1e6
        print(f"libnccl {args.version}: {size_mb:.0f} MB; root {root}")

        # baselines, in this process
        t0 = time.perf_counter()
        with open(lib, "rb") as f:
            hashlib.file_digest(f, "sha256")
        read_s = time.perf_counter() - t0
        env = {**os.environ, "NCCLGUARD_CACHE_DIR": str(work / "fcache")}
        env.pop("NCCLGUARD_CONFIG", None)
        startup = [child("import inventoryd.node.fingerprint", env) for _ in range(args.runs)]
        startup_s = statistics.median(s for s, _ in startup)
        startup_rss = max(r for _, r in startup)

        # the CLI, cold then warm
        once = ("import sys\nfrom inventoryd.main import main\n"
                f"sys.exit(main(['once', '--json', '--root', {str(root)!r}, '--hostname', "
                "'bench']))\n")
        if args.drop_caches:
            drop_caches()
        cold_s, cold_rss = child(once, env)
        warm = [child(once, env) for _ in range(args.runs)]
        warm_s = statistics.median(s for s, _ in warm)
        warm_rss = max(r for _, r in warm)

        # collect() in this process: the probes' own work, without interpreter start-up
        from inventoryd.filecache import FileCache
        from inventoryd.node.fingerprint import collect

        store = work / "fcache2" / "filecache.json"
        t0 = time.perf_counter()
        collect(str(root), "bench", None, FileCache(store))
        in_cold = time.perf_counter() - t0
        in_warm_runs = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            collect(str(root), "bench", None, FileCache(store))
            in_warm_runs.append(time.perf_counter() - t0)
        in_warm = statistics.median(in_warm_runs)

        # the plugin probe alone (which file NCCL loads per kind), warm, in this process
        from inventoryd.nodefs import ErrorLog, NodeFS
        from inventoryd.probes import plugins
        from ncclguard.config import InventorydConfig

        fp = collect(str(root), "bench", None, FileCache(store))
        libs, fs, cfg = fp["libnccl"], NodeFS(str(root)), InventorydConfig()
        cache = FileCache(store)
        probe_runs = []
        for _ in range(20):
            t0 = time.perf_counter()
            for _ in range(50):
                plugins.probe(fs, ErrorLog(), cfg, {}, libs, cache)
            probe_runs.append((time.perf_counter() - t0) / 50)
        probe_s = statistics.median(probe_runs)

        print(f"baseline read (sha256 of the lib, in process): {read_s * 1000:8.1f} ms")
        print(f"baseline startup (python + imports, child):    {startup_s * 1000:8.1f} ms, "
              f"peak RSS {startup_rss:.1f} MB")
        print(f"once cold (CLI):  {cold_s * 1000:8.1f} ms = {cold_s / read_s:5.2f} x read, "
              f"peak RSS {cold_rss:.1f} MB = {cold_rss / startup_rss:.2f} x startup")
        print(f"once warm (CLI):  {warm_s * 1000:8.1f} ms = {warm_s / startup_s:5.2f} x startup, "
              f"peak RSS {warm_rss:.1f} MB")
        print(f"collect() cold:   {in_cold * 1000:8.1f} ms = {in_cold / read_s:5.2f} x read")
        print(f"collect() warm:   {in_warm * 1000:8.1f} ms")
        print(f"plugins.probe warm: {probe_s * 1e6:6.0f} us = {probe_s / in_warm:6.1%} of "
              "collect() warm")
        print(f"warm/cold: collect() {in_warm / in_cold:6.2%} (goal < 5%), "
              f"CLI {warm_s / cold_s:6.2%} (of which startup {startup_s / cold_s:6.2%})")
        print(f"peak RSS goal < 60 MB: cold {cold_rss:.1f} MB, warm {warm_rss:.1f} MB")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
