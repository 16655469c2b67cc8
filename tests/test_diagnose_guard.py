"""diagnose and the Epilog on long and stalled reads (issues 46 and 47): a progress line
on a terminal, a child killed past the budget when a read never returns, and the job's
own files never read from FUSE."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest


def test_a_long_read_shows_progress_on_a_terminal_only(tmp_path):
    """Issue 46: diagnose read a 2 GiB log for 95 s printing nothing. On a terminal it
    shows a progress line on stderr within 2 s; in a pipe, or with --quiet, nothing."""
    import subprocess
    import sys

    from helpers.cli import stderr_on_a_terminal

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from bench_diagnose import generate

    log = tmp_path / "big.log"
    generate(log, 120 << 20)
    argv = [sys.executable, "-m", "ncclguard.cli", "diagnose", str(log), "--no-inventory"]

    def on_a_terminal(*extra: str) -> tuple[str, float | None]:
        return stderr_on_a_terminal([*argv, *extra], "MiB")

    text, first = on_a_terminal()
    assert "ncclguard diagnose: " in text and "lines read" in text, text
    assert first is not None and first < 2.0, first
    text, first = on_a_terminal("--quiet")
    assert "lines read" not in text and first is None
    piped = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and "lines read" not in piped.stderr


def test_a_read_that_never_returns_is_killed_past_the_budget(tmp_path, monkeypatch):
    """Issue 47's review: a file on a stalled FUSE mount held the Epilog for good (the
    deadline is checked between reads, and only a fatal signal ends such a read). The
    reading runs in a child, killed GRACE_S past the budget, and the trail says so. The
    stuck read is the child sleeping: what it reads does not matter to the parent."""
    from ncclguard import audit
    from prolog import epilog

    audit_path = tmp_path / "decisions.jsonl"
    conf = tmp_path / "c.toml"
    conf.write_text(f'[gate]\naudit_log = "{audit_path}"\n[inventory]\ndb = "{tmp_path}/no.db"\n')
    monkeypatch.setattr(epilog, "GRACE_S", 0.5)
    monkeypatch.setattr(epilog, "_run", lambda *a: time.sleep(3600))
    t0 = time.monotonic()
    env = {"SLURM_JOB_ID": "91", "SLURM_JOB_EXIT_CODE": "256"}
    assert epilog.main(["--config", str(conf), "--budget", "1"], env=env) == 0
    assert time.monotonic() - t0 < 4.0
    (rec,) = audit.read(audit_path, job=91)
    assert "did not return within the budget" in rec["error"]


def test_the_jobs_own_file_on_fuse_is_not_read(tmp_path, monkeypatch):
    """Issue 47's review: a user's FUSE mount (``allow_other``) can make a read stall for
    good; the job's own files are not read from one (a file an admin names is)."""
    from ncclguard.diagnose import logparse

    log = tmp_path / "slurm-1.out"
    log.write_text("x\n")
    fd = os.open(log, os.O_RDONLY)
    try:
        # None where /proc/self/mountinfo does not show the mount (in a chroot: the
        # Slurm roots' runs); the job's file is then read, and the Epilog's child is
        # killed past its budget if a read stalls
        kind = logparse.fs_type(fd)
        assert kind is None or not kind.startswith("fuse"), kind
    finally:
        os.close(fd)
    monkeypatch.setattr(logparse, "fs_type", lambda fd: "fuse.sshfs")
    with pytest.raises(logparse.LogError, match="on a FUSE filesystem"):
        logparse.LogReader(log, owner_uid=os.getuid())
    logparse.LogReader(log).close()  # named by an admin: read
