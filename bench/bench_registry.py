"""What reading a registry image costs: memory and downloads (issue 30).

A real registry (Debian's docker-registry on loopback, tests/helpers/registry.py) holds
two tags of a multi-GiB image laid out like a CUDA container: a base layer with the
linker's real libnccl 2.18.3 and --gib GiB of incompressible data in 256 MiB files
(gzip), and a top layer with pip's real libnccl 2.21.5 (``big:v1``) or 2.23.4
(``big:v2``, zstd). A tiny image (one small layer) is the baseline.

Each read runs in a child process (``read_image`` as the collector's worker calls it,
with a layer cache kept in a file between the two tags), interleaved tiny / big / tiny /
big, --runs times; printed: wall time, the child's peak RSS (VmHWM) and the ratio to the
tiny image's, and how many bytes the second tag downloaded of its total.

    .venv/bin/python bench/bench_registry.py [--gib 2] [--runs 3] [--work DIR]

Prints figures; never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

CHILD = """
import json, sys, time
from inventoryd.controller.images.registry import Client, Credentials, RegistryLimits, read_image
from ncclguard.fingerprint.imageref import parse
host, ref, cache_path = sys.argv[1], sys.argv[2], sys.argv[3]
cache = json.load(open(cache_path)) if cache_path != "-" else {}
client = Client(parse(ref), deadline=time.monotonic() + 1800, credentials=Credentials(),
                insecure=(host,))
t = time.perf_counter()
rec = read_image(client, "linux/amd64", RegistryLimits(), cached=cache.get,
                 store=lambda s: cache.__setitem__(s["digest"], s))
dt = time.perf_counter() - t
if cache_path != "-":
    json.dump(cache, open(cache_path, "w"))
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
lib = next((r for r in rec["libnccl"] if r["default"]), {"version": None})
layers = rec["image"]["layers"]
print(json.dumps({"seconds": dt, "hwm_kb": hwm, "nccl": lib["version"],
                  "size": rec["image"]["size"],
                  "downloaded": sum(x["size"] for x in layers if not x["cached"])}))
"""


def child(host: str, ref: str, cache: str = "-") -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, host, ref, cache], capture_output=True,
                       text=True, cwd=ROOT, check=False)
    if r.returncode != 0:
        raise SystemExit(f"child failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    from helpers.registry import File, Registry, Symlink, layer_tar, push_image

    from devtools.ncclwheels import extract_nccl

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-registry-"))
    work.mkdir(parents=True, exist_ok=True)
    lib = "/usr/lib/x86_64-linux-gnu"
    pip = "/usr/local/lib/python3.10/dist-packages/nvidia/nccl/lib"
    chunks = []
    for i in range(int(args.gib * 4)):
        p = work / f"data{i}.bin"
        if not p.exists():
            with open(p, "wb") as f:
                for _ in range(256):
                    f.write(os.urandom(1 << 20))
        chunks.append(File(f"/opt/data/blob{i}.bin", p))
    with Registry(work / "registry") as reg:
        base = layer_tar([File(f"{lib}/libnccl.so.2.18.3", extract_nccl("2.18.3")),
                          Symlink(f"{lib}/libnccl.so.2", "libnccl.so.2.18.3"), *chunks],
                         "gzip", level=1)
        top1 = layer_tar([File(f"{pip}/libnccl.so.2", extract_nccl("2.21.5"))], "zstd")
        top2 = layer_tar([File(f"{pip}/libnccl.so.2", extract_nccl("2.23.4"))], "zstd")
        push_image(reg, "big", "v1", [base, top1])
        push_image(reg, "big", "v2", [base, top2])
        push_image(reg, "tiny", "v1", [layer_tar([File("/etc/hostname", b"x\n")])])
        del base, top1, top2
        tiny, big = [], []
        for _ in range(args.runs):
            tiny.append(child(reg.host, f"{reg.host}#tiny:v1"))
            big.append(child(reg.host, f"{reg.host}#big:v1"))
        cache = work / "layers.json"
        cache.write_text("{}")
        first = child(reg.host, f"{reg.host}#big:v1", str(cache))
        second = child(reg.host, f"{reg.host}#big:v2", str(cache))
    size = big[0]["size"]
    t_med = statistics.median(x["hwm_kb"] for x in tiny)
    b_med = statistics.median(x["hwm_kb"] for x in big)
    print(f"image {size / 2**30:.2f} GiB compressed ({args.gib} GiB of data), runs {args.runs}")
    print(f"tiny image: {statistics.median(x['seconds'] for x in tiny):.2f} s, "
          f"peak RSS {t_med / 1024:.0f} MB")
    print(f"big image:  {statistics.median(x['seconds'] for x in big):.2f} s, "
          f"peak RSS {b_med / 1024:.0f} MB ({b_med / t_med:.2f}x the tiny image's), "
          f"NCCL {big[0]['nccl']}")
    print(f"second tag sharing the base layer: downloaded {second['downloaded']:,} of "
          f"{second['size']:,} bytes ({second['downloaded'] / second['size']:.1%}); "
          f"the first downloaded {first['downloaded']:,}; NCCL {second['nccl']}")


if __name__ == "__main__":
    main()
