"""What a hostile registry image costs in memory: layers of directory paths that imply
their parents (issue 41, item 1).

A real registry (Debian's docker-registry on loopback, tests/helpers/registry.py) holds:

- ``tiny``: one small layer (the baseline);
- ``deep``: the review's layer, 150 directory members of distinct paths 800 levels deep
  (an 18 KB gzip);
- ``implied``: 2,000 directory members 60 levels deep (within the depth bound) with
  4 KB paths: 8 MB of names, 230 MB of the parents they imply;
- ``wide``: near the worst the bounds let through: three gzip layers of directory
  members 60 levels deep, two near one layer's bound of entries kept (200,000), one near
  its bound of path bytes (16 MiB), the parents they imply included.

Each read runs in a child process (``read_image`` as the collector's worker calls it,
then the image written as the collector's loop writes it, ``canonical_json`` of each
summary), interleaved tiny / deep / wide, --runs times; printed: the outcome, wall time,
the child's peak RSS (VmHWM) and its ratio to the tiny image's. ``--code DIR`` runs the
children on another checkout (the code before the fix, for the "before" figures).

    .venv/bin/python bench/bench_registry_hostile.py [--runs 3] [--code DIR]

Prints figures; never asserts.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

CHILD = """
import json, sys, time
from inventoryd.controller.images.registry import Client, Credentials, RegistryLimits, read_image
from inventoryd.controller.images.tree import ImageError
from ncclguard.fingerprint.canonical import canonical_json
from ncclguard.fingerprint.imageref import parse
host, ref = sys.argv[1], sys.argv[2]
cache = {}
client = Client(parse(ref), deadline=time.monotonic() + 600, credentials=Credentials(),
                insecure=(host,))
t = time.perf_counter()
try:
    rec = read_image(client, "linux/amd64", RegistryLimits(), cached=cache.get,
                     store=lambda s: cache.__setitem__(s["digest"], s))
    text = sum(len(canonical_json(s)) for s in cache.values())
    out = f"read: {len(cache)} layers, {text / 2**20:.1f} MB of summaries"
except ImageError as e:
    out = "refused: " + e.cause[:90]
dt = time.perf_counter() - t
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"seconds": dt, "hwm_kb": hwm, "out": out}))
"""


def child(code: Path, host: str, ref: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code)}
    r = subprocess.run([sys.executable, "-c", CHILD, host, ref], capture_output=True,
                       text=True, cwd=code, check=False, env=env)
    if r.returncode != 0:
        raise SystemExit(f"child failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def dirs_layer(paths: list[str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for p in paths:
            info = tarfile.TarInfo(p)
            info.type = tarfile.DIRTYPE
            t.addfile(info)
        # incompressible bytes: the layer within 64x its compressed size unpacked
        pad = tarfile.TarInfo("opt/pad.bin")
        pad.size = (2 * sum(len(p) for p in paths) + 1536 * len(paths)) // 60 + 4096
        t.addfile(pad, io.BytesIO(os.urandom(pad.size)))
    return gzip.compress(buf.getvalue(), compresslevel=6)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--code", type=Path, default=ROOT)
    args = ap.parse_args()
    from helpers.registry import File, Registry, layer_tar, push_image

    work = Path(tempfile.mkdtemp(prefix="bench-registry-hostile-"))
    deep = dirs_layer([f"{i}/" + "/".join(["d"] * 799) for i in range(150)])
    part = "x" * 64
    # under the bounds: two layers near the entries kept by one layer (200,000: 3,300
    # members 60 levels deep, each implying 59 parents) and one near its path bytes
    # (16 MiB: 135 members with 4 KB paths, each implying 115 KB of parents)
    wide = [dirs_layer([f"E{n}s{i:05d}/" + "/".join(["d"] * 59) for i in range(3_300)])
            for n in range(2)]
    wide.append(dirs_layer([f"Bm{i:05d}/" + "/".join([part] * 59) for i in range(135)]))
    # the review's 2,000 members, within the depth bound: 60 levels, 4 KB paths
    implied = dirs_layer([f"I{i:05d}/" + "/".join([part] * 59) for i in range(2_000)])
    with Registry(work / "registry") as reg:
        push_image(reg, "tiny", "v1", [layer_tar([File("/etc/hostname", b"x\n")])])
        push_image(reg, "deep", "v1", [deep])
        push_image(reg, "implied", "v1", [implied])
        push_image(reg, "wide", "v1", wide)
        runs: dict[str, list[dict]] = {"tiny": [], "deep": [], "implied": [], "wide": []}
        for _ in range(args.runs):
            for name in runs:
                runs[name].append(child(args.code, reg.host, f"{reg.host}#{name}:v1"))
    base = statistics.median(x["hwm_kb"] for x in runs["tiny"])
    print(f"code: {args.code}; runs {args.runs}; layers: deep {len(deep):,} B gzip, "
          f"implied {len(implied):,} B, wide {sum(len(x) for x in wide):,} B gzip in "
          f"{len(wide)} layers")
    for name, xs in runs.items():
        hwm = statistics.median(x["hwm_kb"] for x in xs)
        print(f"{name:7s} {statistics.median(x['seconds'] for x in xs):6.2f} s, peak RSS "
              f"{hwm / 1024:6.0f} MB ({hwm / base:5.2f}x the tiny image's): {xs[0]['out']}")


if __name__ == "__main__":
    main()
