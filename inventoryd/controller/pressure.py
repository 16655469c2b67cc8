"""Disk pressure on the collector's inventory (issue 25, docs/collector.md "Bounds"): free
space below ``[collector] min_free_bytes``, or a write that failed because the inventory
cannot grow (a full disk, an I/O error, a file system turned read-only).

Under pressure the collector goes on judging every record; it writes without growth
(:class:`ncclguard.store.Quota` ``keep_history=False``: no history copies), leaves what
does not fit for the next scan, and the image index and container records wait. The
state is logged once per change, served as metrics, and stamped into the inventory
(``Inventory.stamp``) so that the gate and the CLI can say how old the inventory is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from ncclguard.store import Inventory, InventoryError
from ncclguard.store.errors import (
    InventoryCorrupt,
    InventoryLocked,
    InventoryMissing,
    InventoryUnsafe,
)

__all__ = ["STAMP_EVERY_S", "DiskPressure", "growth_failure"]

log = logging.getLogger("ncclguard.collector")

STAMP_EVERY_S = 60.0  # the collector marks the inventory written at least this often


def growth_failure(e: InventoryError) -> bool:
    """A write that failed because the inventory cannot grow: the collector judges on and
    retries. A locked, corrupt, missing or unsafe inventory is another matter (the scan
    ends, and is tried again)."""
    return not isinstance(e, InventoryLocked | InventoryCorrupt | InventoryUnsafe
                          | InventoryMissing)


class DiskPressure:
    """Why the inventory at ``path`` cannot grow now, if it cannot."""

    def __init__(self, path: Path, floor: int) -> None:
        self.path = path
        self.floor = floor
        self.space: str | None = None  # free space below the floor
        self.write_failure: str | None = None  # the last write failed
        self.free_bytes: int | None = None
        # (when, what pressure) the inventory was last stamped: the first scan stamps
        self._stamped: tuple[float, str | None] = (-float("inf"), "not yet")

    @property
    def state(self) -> str | None:
        return self.write_failure or self.space

    def check_space(self) -> None:
        """Free space of the inventory's file system against the floor."""
        try:
            st = os.statvfs(self.path.parent)
            self.free_bytes = st.f_bavail * st.f_frsize
        except OSError:
            self.free_bytes = None
        state = None
        if self.floor and self.free_bytes is not None and self.free_bytes < self.floor:
            state = (f"{self.free_bytes} bytes free on {self.path.parent}, below "
                     f"collector.min_free_bytes ({self.floor})")
        if state != self.space:
            if state:
                log.error("disk pressure: %s: records are still judged and the nodes' "
                          "records written; no history is kept, the image index and "
                          "container records wait", state)
            else:
                log.info("disk pressure over: free space back above collector.min_free_bytes")
            self.space = state

    def wrote(self, e: InventoryError | None) -> None:
        """A write of the inventory failed (``e``), or worked (None)."""
        state = None if e is None else f"writing the inventory failed: {e}"
        if state != self.write_failure:
            if state:
                log.error("%s; records are still judged, and written as soon as the "
                          "inventory can grow; the gate reads records as of the last write",
                          state)
            else:
                log.info("the inventory is written again")
            self.write_failure = state

    def guarded(self, write: Callable[[], object]) -> bool:
        """Run a write; True when it worked. A growth failure is noted, not raised."""
        try:
            write()
        except InventoryError as e:
            if not growth_failure(e):
                raise
            self.wrote(e)
            return False
        return True

    def stamp(self, inv: Inventory, now_mono: float, wrote: bool) -> None:
        """Mark the inventory written (``Inventory.stamp``): at every change of the state,
        and at least every STAMP_EVERY_S (``wrote``: a batch this scan stamped it), so
        that the gate and the CLI can tell a frozen inventory
        (``ncclguard.policy.freshness.writer_note``)."""
        at, stamped = self._stamped
        if wrote:
            at = now_mono
        if self.state == stamped and now_mono - at < STAMP_EVERY_S:
            self._stamped = (at, stamped)
            return
        state = self.state
        if self.guarded(lambda: inv.stamp(state)):
            self._stamped = (now_mono, state)
