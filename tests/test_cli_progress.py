"""A progress line for every command that can run longer than a few seconds (issue 46):
``ncclguard features sync`` and ``ncclguard-inventoryd collect --once``, beside
``diagnose`` (tests/test_diagnose_guard.py), all through the one helper,
``ncclguard.progress.Progress``: on stderr, on a terminal only, ``--quiet`` to silence it.

Each command runs in a child process whose stderr is a pseudo-terminal (or a pipe), as an
admin runs it, with its slow part made slow: Slurm's ``scontrol update`` (a fake Slurm,
each call 0.4 s) and the verification of each spool record (5 ms each, as munge's decode
of a real record at scale), so that the work lasts past the line's first half second.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli import stderr_on_a_terminal
from helpers.inventory import build, standard

REPO = Path(__file__).resolve().parent.parent

#: ``ncclguard`` with a Slurm that answers as a real one would, slowly: 16 idle nodes of
#: partition debug, without features; each ``scontrol update`` takes 0.4 s.
SLOW_SLURM = """
import sys, time
from ncclguard.cli import context, main
from ncclguard.slurm import NodeInfo

class Slurm:
    def nodes(self, nodes=None):
        return [NodeInfo(name=f"n{i:02d}", state="idle", partitions=("debug",))
                for i in range(1, 17)]
    def default_partition(self):
        return "debug"
    def set_features(self, nodes, available, active):
        time.sleep(0.4)
    def pending_features(self):
        return []

context.Ctx.slurm = property(lambda self: Slurm())
main(sys.argv[1:], prog_name="ncclguard")
"""

#: ``ncclguard-inventoryd`` whose verification of a record takes 5 ms.
SLOW_VERIFY = """
import sys, time
from inventoryd.controller.collector import Collector
from inventoryd.main import main

judge = Collector.judge
def slow(self, name, st):
    time.sleep(0.005)
    return judge(self, name, st)
Collector.judge = slow
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def features_argv(tmp_path: Path) -> list[str]:
    db = build(tmp_path / "inv.db", standard())
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[features]\nclasses_file = "{tmp_path / "classes"}"\n')
    return [sys.executable, "-c", SLOW_SLURM, "--db", str(db), "--config", str(cfg),
            "features", "sync"]


@pytest.fixture
def collect_argv(tmp_path: Path) -> list[str]:
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o755)
    for i in range(300):  # files that name no known node: judged (256 a scan), rejected
        (spool / f"x{i:03d}.rec").write_bytes(b"x" * 100)
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[inventory]\ndb = "{tmp_path / "inv.db"}"\n[spool]\ndir = "{spool}"\n'
                   '[collector]\npublisher = "0"\n[collector.addresses]\nn1 = ["10.0.0.1"]\n')
    return [sys.executable, "-c", SLOW_VERIFY, "collect", "--once", "--config", str(cfg)]


@pytest.mark.parametrize(("argv", "label", "done"), [
    ("features_argv", "ncclguard features sync: ", "nodes updated in"),
    ("collect_argv", "ncclguard-inventoryd collect: spool: ", "256 rejected"),
], ids=["features sync", "collect --once"])
def test_long_work_shows_progress_on_a_terminal_only(
        request: pytest.FixtureRequest, argv: str, label: str, done: str) -> None:
    """Before: both printed nothing until the end (a sync of 16,384 nodes, a scan of
    16,384 records: minutes). On a terminal the line comes within a second, rewritten in
    place; with --quiet, or in a pipe, nothing."""
    args: list[str] = request.getfixturevalue(argv)
    text, first = stderr_on_a_terminal(args, label, cwd=REPO)
    assert first is not None and first < 2.0, text
    assert "\r" in text and "\x1b[K" in text  # rewritten in place, then cleared
    text, first = stderr_on_a_terminal([*args, "--quiet"], label, cwd=REPO)
    assert first is None, text
    piped = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert label not in piped.stderr and "\r" not in piped.stderr, piped.stderr
    assert done in piped.stdout + piped.stderr, (piped.stdout, piped.stderr)
