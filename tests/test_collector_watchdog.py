"""The services' watchdog while a step works for long (issue 48): the collector reading a
user's image up to its time limit sent no ``WATCHDOG=1`` until the scan ended, so a
``WatchdogSec=`` shorter than ``[images] timeout_s`` (or ``scan_budget_s``) killed it. Now
a step that asks "stop now?" as it works pets the watchdog (rate-limited); one that stops
asking is still left to it. On a real notify socket (tests/helpers/notify.py), the
collector on a real hostile image (``devtools.images.link_maze``); under systemd itself:
tests/test_install_systemd.py."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.notify import Listener
from helpers.parts import unavailable

from devtools import images
from devtools.ncclwheels import PartUnavailable
from inventoryd.loop import Outcome, serve
from inventoryd.sdnotify import Notifier
from ncclguard import config as configmod


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[Listener]:
    lst = Listener(str(tmp_path / "notify.sock"))
    yield lst
    lst.close()


def _times(listener: Listener, line: str) -> list[float]:
    return [t for t, m in list(listener.stamped) if line in m.split("\n")]


def _longest_gap(points: list[float], start: float, end: float) -> float:
    inside = sorted(t for t in points if start < t < end)
    marks = [start, *inside, end]
    return max(b - a for a, b in itertools.pairwise(marks))


class TwoSteps:
    """A service of two steps of ``seconds`` each: the first asks ``should_stop`` as it
    works (as the collector's loops do), the second works without asking."""

    label = "test"
    what = "work"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.spans: list[tuple[float, float]] = []
        self.asked = 0

    def started(self) -> str:
        return "two steps"

    def step(self, should_stop: Callable[[], bool]) -> Outcome:
        t0 = time.monotonic()
        if not self.spans:
            while time.monotonic() - t0 < self.seconds:
                self.asked += 1
                should_stop()
        else:
            time.sleep(self.seconds)
        self.spans.append((t0, time.monotonic()))
        return Outcome()

    def delay(self, ok: bool) -> float:
        return 0.0

    def reloaded(self, config: configmod.Config) -> TwoSteps:
        return self

    def close(self, *, replaced: bool = False) -> None:
        pass


def test_a_step_that_asks_whether_to_stop_pets_the_watchdog(listener: Listener) -> None:
    """A 0.8 s watchdog (a ping every 0.4 s) and two steps of 1.2 s. Before: no
    ``WATCHDOG=1`` during either step (the loop pinged only after a step and in its
    sleep). Now the step that asks "stop now?" (hundreds of thousands of times) sends one
    every 0.2 s (a quarter of the timeout), no more; the step that does not ask sends
    none: a hung step is still systemd's to end."""
    import logging

    service = TwoSteps(1.2)
    notifier = Notifier({"NOTIFY_SOCKET": listener.addr, "WATCHDOG_USEC": "800000"})
    assert serve(service, logging.getLogger("test.watchdog"), config_path=None,
                 notifier=notifier, max_steps=2) == 0
    listener.wait_for("STOPPING=1")
    pings = _times(listener, "WATCHDOG=1")
    (a0, a1), (b0, b1) = service.spans
    during = [t for t in pings if a0 < t < a1]
    assert service.asked > 10_000, service.asked
    assert 3 <= len(during) <= 7, during  # one per 0.2 s at most
    assert _longest_gap(pings, a0, a1) < 0.8, [round(t - a0, 2) for t in during]
    assert not [t for t in pings if b0 + 0.05 < t < b1], "a step that never asks: no ping"


def test_the_collector_pets_its_watchdog_while_it_reads_a_slow_image(
        tmp_path: Path, listener: Listener) -> None:
    """The collector, one scan, a user's link maze under ``[images] roots`` read up to its
    2 s time limit, and a 1.2 s watchdog (a ping every 0.6 s; the reader checks in at
    least once a second, even while unsquashfs is silent). Before: no ``WATCHDOG=1``
    from ``READY=1`` until the scan ended (the whole read: over 2 s, systemd would have
    killed it); now no gap of 1.2 s between ``READY=1``, the pings and ``STOPPING=1``,
    and the image is stored as having reached its time limit (it was being read all
    along)."""
    from inventoryd.controller import collector_service
    from ncclguard.store import Inventory

    root = tmp_path / "images"
    root.mkdir()
    try:
        maze = images.link_maze(root / "maze.sqsh")
    except PartUnavailable as e:
        unavailable(str(e))
    spool = tmp_path / "spool"
    spool.mkdir()
    os.chmod(spool, 0o755)
    db = tmp_path / "inventory.db"
    cfg = configmod.from_dict({
        "spool": {"dir": str(spool)},
        "collector": {"publisher": str(os.getuid())},
        "images": {"roots": [str(root)], "timeout_s": 2.0, "scan_budget_s": 2.0},
    })
    notifier = Notifier({"NOTIFY_SOCKET": listener.addr, "WATCHDOG_USEC": "1200000"})
    assert collector_service.run(None, cfg, db=db, notifier=notifier, max_scans=1) == 0
    listener.wait_for("STOPPING=1")
    (ready,) = _times(listener, "READY=1")
    (stopping,) = _times(listener, "STOPPING=1")
    # the read took its whole limit (what was left of the pass's 2 s budget: a few ms
    # less than 2 s once the roots were walked)
    assert stopping - ready >= 1.9, stopping - ready
    pings = _times(listener, "WATCHDOG=1")
    gap = _longest_gap(pings, ready, stopping)
    assert gap < 1.2, (gap, [round(t - ready, 2) for t in pings], stopping - ready)
    with Inventory(db, readonly=True) as inv:
        (row,) = inv.images()
    assert row["path"] == str(maze) and row["error"].endswith("time limit reached"), row
