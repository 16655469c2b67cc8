"""What container images cost: scanning one image, and the gate judging a job with one.

1. Scan. A ~1 GB squashfs image (zstd; cached under --work) laid out like a CUDA
   container: a real libnccl 2.18.3 with its links, pip's libnccl 2.21.5, a net plugin,
   /etc/environment, 20,000 small files and incompressible data. ``scan_image`` runs in
   a child process, --runs times: its wall time, and the peak memory (max RSS) of the
   Python process and of the unsquashfs processes it ran. Targets: under 2 s, under 100 MB.
2. Gate. A 1,024-node inventory whose nodes inject a net plugin into containers, and the
   image indexed; the gate process (``python -I -m prolog.gate``) for a 1,024-node batch
   job without an image and with ``SPANK__SLURM_SPANK_OPTION_pyxis_container_image``,
   interleaved: the ratio is the image's added cost.

    .venv/bin/python bench/bench_images.py [--runs 5] [--no-gate]

Prints figures; never asserts (timed tests are not tests).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

IMAGE_BYTES = 1 << 30

CHILD = """
import json, resource, sys, time
from inventoryd.controller.images.fingerprint import scan_image
t = time.perf_counter()
rec = scan_image(sys.argv[1])
dt = time.perf_counter() - t
lib = next(r for r in rec["libnccl"] if r["default"])
# VmHWM, not ru_maxrss: Linux carries ru_maxrss across execve (the forking parent's pages)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"seconds": dt, "self_kb": hwm,
                  "children_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
                  "entries": rec["image"]["entries"], "nccl": lib["version"],
                  "libs": len(rec["libnccl"]), "errors": rec["errors"]}))
"""


def build_image(work: Path) -> Path:
    from devtools import images
    from devtools.ncclwheels import build_plugin, extract_nccl

    out = work / "bench-1g.sqsh"
    if out.exists() and out.stat().st_size > IMAGE_BYTES * 0.9:
        return out
    t = time.perf_counter()
    tree = Path(tempfile.mkdtemp(prefix="bench-image-", dir=work))
    lib = extract_nccl("2.18.3")
    pip = extract_nccl("2.21.5")
    plugin = build_plugin(tree / "_p", [8, 7], name="IBext_v8")
    files: dict[str, Path | bytes | str] = {
        "/usr/lib/x86_64-linux-gnu/libnccl.so.2.18.3": lib,
        "/usr/local/lib/python3.10/dist-packages/nvidia/nccl/lib/libnccl.so.2": pip,
        "/usr/lib/x86_64-linux-gnu/libnccl-net.so": plugin,
        "/etc/environment": "NCCL_DEBUG=WARN\nLD_LIBRARY_PATH=/usr/local/nvidia/lib64\n",
        "/etc/rc": 'exec "$@"\n',
    }
    for i in range(20000):
        files[f"/usr/share/doc/pkg{i % 200}/f{i}.txt"] = f"{i}\n" * 10
    have = int(0.6 * (lib.stat().st_size + pip.stat().st_size))  # what zstd leaves of them
    i = 0
    while have < IMAGE_BYTES:
        n = min(64 << 20, IMAGE_BYTES - have)
        files[f"/opt/data/blob{i}.bin"] = os.urandom(n)
        have += n
        i += 1
    images.build_image(out, files, {"/usr/lib/x86_64-linux-gnu/libnccl.so.2": "libnccl.so.2.18.3",
                                     "/usr/lib/x86_64-linux-gnu/libnccl.so": "libnccl.so.2"},
                       comp="zstd", compress_data=True)
    print(f"built {out} ({out.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t:.0f}s")
    return out


def scan_cost(work: Path, runs: int) -> None:
    img = build_image(work)
    got = []
    for _ in range(runs):
        r = subprocess.run([sys.executable, "-c", CHILD, str(img)], capture_output=True,
                           text=True, timeout=300, cwd=ROOT)
        if r.returncode != 0:
            raise SystemExit(r.stderr[-2000:])
        got.append(json.loads(r.stdout))
    s = statistics.median(g["seconds"] for g in got)
    py = max(g["self_kb"] for g in got) / 1024
    ch = max(g["children_kb"] for g in got) / 1024
    g = got[0]
    print(f"\nscan of a {img.stat().st_size / 2**30:.2f} GiB image ({g['entries']} entries, "
          f"{g['libs']} libnccl, default {g['nccl']}), median of {runs}:")
    print(f"  time {s:.2f} s (target < 2 s) {'OK' if s < 2 else 'OVER'}; peak RSS: python "
          f"{py:.0f} MB, unsquashfs {ch:.0f} MB (target < 100 MB) "
          f"{'OK' if max(py, ch) < 100 else 'OVER'}")


def gate_cost(work: Path, runs: int) -> None:
    from helpers.fingerprints import fingerprint

    from ncclguard.policy import GATE_VALUES
    from ncclguard.store import Inventory

    db = work / "images-inventory.db"
    if db.exists():
        db.unlink()
    n = 1024
    img = "/shared/containers/pytorch.sqsh"
    record = {"libnccl": [{"path": "/usr/lib/x86_64-linux-gnu/libnccl.so.2", "default": True,
                           "version": "2.21.5", "abis": {"net": [8, 7, 6, 5]}}],
              "plugins": [], "net_plugin": None}
    now = time.time()
    with Inventory(db, values=GATE_VALUES) as inv:
        inv._retrying = lambda conn, body, doing: body(conn)  # type: ignore[method-assign]
        inv._conn.execute("BEGIN IMMEDIATE")
        for i in range(1, n + 1):
            fp = fingerprint(f"n{i:05d}")
            fp["containers"] = {"net_plugin": {"name": "IBext_v8", "abis": [8, 7],
                                               "path": "/opt/p.so", "target": "/usr/lib/p.so"}}
            inv.upsert(fp, now=now)
        inv._conn.execute("COMMIT")
        inv.write_images([{"path": img, "inode": 1, "size": 1, "mtime_ns": 1,
                           "record": record}])
    conf = work / "images-bench.toml"
    conf.write_text(f'[gate]\naudit_log = "{work / "decisions.jsonl"}"\n')
    env = {"PATH": "/usr/bin:/bin", "LANG": "C", "NCCLGUARD_CONFIG": str(conf),
           "NCCLGUARD_DB": str(db), "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": f"n[00001-{n:05d}]", "SLURM_JOB_NUM_NODES": str(n),
           "SLURM_JOB_PARTITION": "debug", "SLURM_JOB_USER": "bench", "SLURM_JOB_UID": "1000",
           "SLURM_JOB_STDIN": "/dev/null", "SLURM_SCRIPT_CONTEXT": "prolog_slurmctld"}
    with_img = {**env, "SPANK__SLURM_SPANK_OPTION_pyxis_container_image": img}
    argv = [sys.executable, "-I", "-m", "prolog.gate"]

    def timed(e: dict[str, str]) -> float:
        t = time.perf_counter()
        r = subprocess.run(argv, env=e, capture_output=True, timeout=60, cwd=ROOT)
        dt = time.perf_counter() - t
        if r.returncode != 0 or b"ERROR" in r.stderr or b"accept" not in r.stderr:
            raise SystemExit(f"the gate did not accept cleanly: {r.stderr.decode()[-2000:]}")
        return dt

    timed(env)
    timed(with_img)
    plain, image = [], []
    for _ in range(runs):
        plain.append(timed(env))
        image.append(timed(with_img))
    p, i = statistics.median(plain), statistics.median(image)
    print(f"\ngate, 1,024-node batch job, median of {runs} (interleaved):")
    print(f"  without image {p * 1000:6.1f} ms, with an indexed image {i * 1000:6.1f} ms, "
          f"ratio {i / p:4.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ncclguard-bench")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--no-scan", action="store_true")
    p.add_argument("--no-gate", action="store_true")
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    if not a.no_scan:
        scan_cost(a.work, a.runs)
    if not a.no_gate:
        gate_cost(a.work, max(a.runs, 11))


if __name__ == "__main__":
    main()
