#!/usr/bin/env python3
"""How long ``ncclguard diagnose`` takes on a big log, and how much memory it holds.

Generates a log of ``--size`` (default 2 GiB) in a temporary directory (a 16-host
job with NCCL_DEBUG=INFO: banners and plugin lines per host, then training output
interleaved with NCCL INFO lines, and a version mismatch near the end), then runs, each
in its own child process so that peak RSS is measured per phase (``wait4`` rusage):

  baseline-wc     ``wc -l`` over the file
  baseline-loop   a plain Python ``for line in file`` loop counting lines
  diagnose        the real scanner + catalog + diagnosis (no inventory)
  every-line      (with --every-line) the same with the block prefilter off: every
                  line gets the per-line work, as before the prefilter
  progress        (with --progress) diagnose with the CLI's progress line on, as on a
                  terminal (to /dev/null), interleaved with diagnose, --rounds times each
  diagnose-base   (with --against DIR) the diagnose phase with the ncclguard package of
                  the source tree DIR (an older checkout: git archive REV | tar -x -C DIR),
                  interleaved with diagnose, --rounds times each

and prints time (wall and CPU: user + system of the child, what a loaded machine
changes least) and peak RSS of ``diagnose`` as ratios against the baselines of the
same run, plus the absolute peak RSS against the 100 MB bound.

    .venv/bin/python bench/bench_diagnose.py              # 2 GiB
    .venv/bin/python bench/bench_diagnose.py --size 200M  # a quick run
    .venv/bin/python bench/bench_diagnose.py --size 500M --every-line  # prefilter vs not
    .venv/bin/python bench/bench_diagnose.py --size 1G --against /tmp/base --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RSS_BOUND_MB = 100.0


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B").rstrip("I")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def generate(path: Path, size: int) -> int:
    """Write about ``size`` bytes, streaming; returns the number of lines."""
    hosts = [f"n{i}" for i in range(1, 17)]
    head = []
    for i, h in enumerate(hosts):
        ver = "2.18.3+cuda12.1" if h == "n3" else "2.21.5+cuda12.4"
        head.append(f"{h}:{1000 + i}:{1000 + i} [0] NCCL INFO Bootstrap : Using ib0:10.0.0.{i}<0>")
        head.append(f"{h}:{1000 + i}:{1000 + i} [0] NCCL INFO NCCL version {ver}")
        head.append(
            f"{h}:{1000 + i}:{1040 + i} [0] NCCL INFO NET/Plugin: Using internal network plugin."
        )
        head.append(f"{h}:{1000 + i}:{1040 + i} [0] NCCL INFO Using network IB")
    block = []
    for k in range(64):
        h = hosts[k % 16]
        block.append(
            f"epoch 3 step {k} loss 1.{k:04d} lr 3.0e-04 tokens/s 181234 grad_norm 0.{k:03d}"
        )
        block.append(
            f"{h}:{1000 + k % 16}:{1040 + k % 16} [{k % 8}] NCCL INFO Channel {k % 32:02d}/0 : "
            f"{k} [{k % 8}] -> {k + 1} [{(k + 1) % 8}] [send] via NET/IB/{k % 4}/GDRDMA"
        )
        block.append(f"[rank{k}]:[W1130 01:02:03.{k:06d} ProcessGroupNCCL.cpp:4561] heartbeat ok")
    chunk = ("\n".join(block) + "\n").encode()
    tail = (
        b"\nn1:1000:1040 [0] bootstrap.cc:73 NCCL WARN Message truncated : received 2136 bytes "
        b"instead of 1728\nRuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1275, unhandled "
        b"system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n"
    )
    lines = 0
    with open(path, "wb") as f:
        data = ("\n".join(head) + "\n").encode()
        f.write(data)
        written = len(data)
        lines += len(head)
        big = chunk * 256
        big_lines = len(block) * 256
        while written + len(big) + len(tail) <= size:
            f.write(big)
            written += len(big)
            lines += big_lines
        while written + len(chunk) + len(tail) <= size:
            f.write(chunk)
            written += len(chunk)
            lines += len(block)
        f.write(tail)
        lines += 3
    return lines


def child(phase: str, path: str) -> int:
    if phase == "loop":
        n = 0
        with open(path, "rb") as f:
            for _ in f:
                n += 1
        print(n)
        return 0
    if phase == "diagnose":
        from ncclguard.diagnose import load_catalog, run

        report = run([path], catalog=load_catalog())
        ids = ",".join(d.signature.id for d in report.diagnoses)
        print(f"{report.evidence.lines} {ids}")
        return 0
    if phase == "progress":  # as on a terminal: the CLI's progress line, to /dev/null
        from ncclguard.diagnose import load_catalog, run
        from ncclguard.progress import Progress

        class Tty:
            def __init__(self) -> None:
                self.f = open(os.devnull, "w")  # noqa: SIM115

            def isatty(self) -> bool:
                return True

            def write(self, s: str) -> int:
                return self.f.write(s)

            def flush(self) -> None:
                self.f.flush()

        shown = Progress(Tty(), "ncclguard diagnose")
        report = run([path], catalog=load_catalog(),
                     progress=lambda name, n, lines: shown.update(f"{name}: {n} {lines}"))
        shown.done()
        ids = ",".join(d.signature.id for d in report.diagnoses)
        print(f"{report.evidence.lines} {ids}")
        return 0
    if phase == "every-line":
        from ncclguard.diagnose import Scanner, diagnose, load_catalog

        catalog = load_catalog()
        scanner = Scanner(catalog, prefilter=False)
        scanner.feed(path)
        ev = scanner.evidence()
        ids = ",".join(d.signature.id for d in diagnose(ev, catalog))
        print(f"{ev.lines} {ids}")
        return 0
    raise SystemExit(f"unknown phase {phase}")


def measure(
    argv: list[str], pythonpath: str | None = None
) -> tuple[float, float, str, float]:
    """(seconds, peak RSS in MB, stdout, CPU seconds) of one child process;
    ``pythonpath``: put in front of the child's import path (the baseline's source
    tree)."""
    env = None
    if pythonpath is not None:
        env = dict(os.environ, PYTHONPATH=pythonpath)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    _, status, rusage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - t0
    out = proc.stdout.read().decode() if proc.stdout else ""
    err = proc.stderr.read().decode() if proc.stderr else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{argv}: exit {proc.returncode}: {err.strip()}")
    return elapsed, rusage.ru_maxrss / 1024.0, out.strip(), rusage.ru_utime + rusage.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description="diagnose on a big log: time and peak RSS")
    ap.add_argument("--size", default="2G", help="log size (2G, 500M, ...)")
    ap.add_argument("--keep", action="store_true", help="keep the generated log")
    ap.add_argument(
        "--every-line", action="store_true", help="also run with the prefilter off (slow)"
    )
    ap.add_argument("--against", metavar="DIR", help="also the diagnose of this source tree")
    ap.add_argument("--progress", action="store_true",
                    help="also diagnose with the progress line on (as on a terminal), "
                         "interleaved with diagnose, --rounds times each")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved runs with --against")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("file", nargs="?", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.phase:
        return child(a.phase, a.file)
    size = parse_size(a.size)
    tmp = Path(tempfile.mkdtemp(prefix="ncclguard-bench-"))
    try:
        log = tmp / "job.log"
        t0 = time.perf_counter()
        lines = generate(log, size)
        gen_s = time.perf_counter() - t0
        real = log.stat().st_size
        print(f"log: {real / (1 << 20):.0f} MiB, {lines} lines (generated in {gen_s:.1f} s)")
        me = [sys.executable, str(Path(__file__).resolve())]
        results = {}
        wc = shutil.which("wc")
        if wc:
            results["baseline-wc"] = measure([wc, "-l", str(log)])
        results["baseline-loop"] = measure([*me, "--phase", "loop", str(log)])
        if a.against:
            base = str(Path(a.against).resolve())
            if not (Path(base) / "ncclguard" / "diagnose").is_dir():
                raise SystemExit(f"{base}: no ncclguard/diagnose there")
            runs: dict[str, list[tuple[float, float, str, float]]] = {
                "diagnose": [], "diagnose-base": []
            }
            for r in range(max(a.rounds, 1)):
                order = ["diagnose-base", "diagnose"] if r % 2 == 0 else ["diagnose",
                                                                          "diagnose-base"]
                for name in order:
                    pp = base if name == "diagnose-base" else None
                    got = measure([*me, "--phase", "diagnose", str(log)], pythonpath=pp)
                    runs[name].append(got)
                    print(f"  round {r + 1} {name:14s} {got[0]:8.2f} s  cpu {got[3]:8.2f} s  "
                          f"peak RSS {got[1]:7.1f} MB")
            for name, got in runs.items():
                results[name] = (
                    sorted(g[0] for g in got)[len(got) // 2],  # the medians
                    max(g[1] for g in got),
                    got[-1][2],
                    sorted(g[3] for g in got)[len(got) // 2],
                )
        elif a.progress:
            runs = {"diagnose": [], "progress": []}
            for r in range(max(a.rounds, 1)):
                for name in (["progress", "diagnose"] if r % 2 else ["diagnose", "progress"]):
                    got = measure([*me, "--phase", name, str(log)])
                    runs[name].append(got)
                    print(f"  round {r + 1} {name:14s} {got[0]:8.2f} s  cpu {got[3]:8.2f} s  "
                          f"peak RSS {got[1]:7.1f} MB")
            for name, got in runs.items():
                results[name] = (sorted(g[0] for g in got)[len(got) // 2],
                                 max(g[1] for g in got), got[-1][2],
                                 sorted(g[3] for g in got)[len(got) // 2])
            p_s, _, _, p_cpu = results["progress"]
            print(f"progress / diagnose: time x{p_s / results['diagnose'][0]:.3f}, cpu "
                  f"x{p_cpu / max(results['diagnose'][3], 1e-3):.3f}")
        else:
            results["diagnose"] = measure([*me, "--phase", "diagnose", str(log)])
        if a.every_line:
            results["every-line"] = measure([*me, "--phase", "every-line", str(log)])
        for name, (sec, rss, out, cpu) in results.items():
            mbps = real / (1 << 20) / sec
            print(
                f"{name:14s} {sec:8.2f} s  cpu {cpu:8.2f} s  {mbps:8.1f} MiB/s  "
                f"peak RSS {rss:7.1f} MB  [{out[:80]}]"
            )
        d_s, d_rss, d_out, d_cpu = results["diagnose"]
        for base in ("diagnose-base", "every-line", "baseline-loop", "baseline-wc"):
            if base in results:
                b_s, b_rss, _, b_cpu = results[base]
                cpu_x = d_cpu / max(b_cpu, 1e-3)
                print(f"diagnose / {base}: time x{d_s / b_s:.2f}, cpu x{cpu_x:.2f}, "
                      f"peak RSS x{d_rss / b_rss:.2f}")
        ok = d_rss < RSS_BOUND_MB
        print(
            f"peak RSS bound {RSS_BOUND_MB:.0f} MB: {'OK' if ok else 'EXCEEDED'} ({d_rss:.1f} MB)"
        )
        if "nccl-version-differs" not in d_out:
            print("unexpected diagnosis: " + d_out)
            return 1
        if "every-line" in results and results["every-line"][2] != d_out:
            print("the prefilter changed the diagnosis: " + results["every-line"][2])
            return 1
        return 0 if ok else 1
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")


if __name__ == "__main__":
    sys.exit(main())
