"""What the ``offers`` part (issue 39) costs the collector at each record it takes.

Every record the collector takes, a heartbeat too, is parsed, walked for its bounds
(``ncclguard.spool.parse_payload``: ``json.loads`` and ``check_values``) and hashed
(``ncclguard.fingerprint.canonical.fingerprint_hash``); those are the parts of a
heartbeat's cost that grow with a record (the rest: the file read, MUNGE, one UPDATE).
This times them, in one process, interleaved round by round, for the records of a node
(``tests/helpers/fingerprints.py``):

- ``before``: no ``offers`` part (a daemon before issue 39): the baseline;
- ``after``: the part as the probe writes it (``ncclguard.fingerprint.offers.pack``);
- ``per release``: the same content laid out one row per release and kind
  (``{"2.18.3": {"net": [0, 6]}, ...}``), the layout first written, for comparison;

each for a node with one net plugin and for one with a plugin of every kind (net, tuner,
profiler, env, GIN, RMA; each exporting its kind's three newest ABIs) that every release
uses at its newest ABI.

    .venv/bin/python bench/bench_offers.py [--rounds 15] [--n 2000]

Prints microseconds per record and ratios against ``before``; never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.fingerprints import fingerprint

from ncclguard import spool
from ncclguard.fingerprint.canonical import fingerprint_hash
from ncclguard.fingerprint.offers import KINDS, pack
from ncclguard.fingerprint.releases import RELEASES


def rows_net_only() -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    rows = {}
    for r in RELEASES:
        both = set(r.abis["net"]) & {8, 7, 6}
        rows[r.label] = {"net": [0, max(both) if both else None]}
    return rows, [{"path": "/usr/lib/x86_64-linux-gnu/libnccl-net.so",
                   "names": {"net": "HoldoutNet"}, "abis": {"net": [8, 7, 6]}}]


def rows_every_kind() -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    newest = RELEASES[-1].abis  # each library exports its kind's three newest ABIs
    files = [{"path": f"/usr/lib/x86_64-linux-gnu/libnccl-{k}.so", "names": {k: f"Site{k}"},
              "abis": {k: newest[k][:3]}} for k in KINDS]
    rows = {}
    for r in RELEASES:
        rows[r.label] = {k: [KINDS.index(k), max(both) if both else None] for k in r.loads
                         for both in [set(r.abis[k]) & set(newest[k][:3])]}
    return rows, files


def per_release(rows: dict[str, dict[str, Any]], files: list[dict[str, Any]]) -> dict:
    return {"files": files, "releases": rows}


def payload(fp: dict[str, Any]) -> bytes:
    return json.dumps({"ncclguard_record": spool.RECORD_VERSION, "host": "n1", "seq": 1,
                       "fingerprint": fp}).encode()


def per_record(data: bytes, n: int) -> float:
    """Microseconds per record of parse, bounds walk and hash, ``n`` times."""
    t = time.process_time()
    for _ in range(n):
        rec = spool.parse_payload(data, max_bytes=8 << 20)
        fingerprint_hash(rec.fingerprint)
    return (time.process_time() - t) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--n", type=int, default=2000, help="records per timing")
    a = ap.parse_args()
    base = fingerprint("n1", plugin_abi=8)
    cases: dict[str, bytes] = {"before": payload(base)}
    for label, make in (("one net plugin", rows_net_only), ("every kind", rows_every_kind)):
        rows, files = make()
        cases[f"after, {label}"] = payload({**base, "offers": pack(rows, files)})
        cases[f"per release, {label}"] = payload({**base, "offers": per_release(rows, files)})
    times: dict[str, list[float]] = {k: [] for k in cases}
    run: Callable[[bytes], float] = lambda d: per_record(d, a.n)  # noqa: E731
    for _ in range(a.rounds):  # interleaved: each round times every case once
        for name, data in cases.items():
            times[name].append(run(data))
    before = statistics.median(times["before"])
    print(f"parse + bounds walk + hash per record, CPU, median of {a.rounds} interleaved "
          f"rounds of {a.n}")
    for name, data in cases.items():
        med = statistics.median(times[name])
        print(f"  {name:28} {len(data):6} B  {med:7.1f} us  {med / before:.2f}x "
              f"(+{med - before:.1f} us)  [{min(times[name]):.1f}..{max(times[name]):.1f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
