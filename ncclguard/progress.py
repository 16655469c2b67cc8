"""The progress line of long work (issue 46: ``diagnose`` read a 2 GiB log for 95 s printing
nothing), one home for every command that can run longer than a few seconds:
``ncclguard diagnose``, ``ncclguard features sync``, ``ncclguard-inventoryd collect
--once``. On stderr, only when it is a terminal, rate-limited, cleared at the end;
``--quiet`` turns it off. Standard library and :mod:`ncclguard.text` only: the CLI and
the controller's programs both use it.
"""

from __future__ import annotations

import time
from typing import Any

from ncclguard.text import safe

__all__ = ["Progress"]


class Progress:
    """A progress line: on ``stream`` (stderr) only when it is a terminal, rewritten in
    place, first after :attr:`FIRST_S` and then at most every :attr:`EVERY_S`, cleared by
    :meth:`done`. Scripts and pipes never see it; ``--quiet`` turns it off
    (``enabled=False``)."""

    FIRST_S = 0.5
    EVERY_S = 1.0

    def __init__(self, stream: Any, label: str, *, enabled: bool = True) -> None:
        self.stream = stream
        self.label = label
        isatty = getattr(stream, "isatty", None)
        self.enabled = enabled and callable(isatty) and bool(isatty())
        self.t0 = time.monotonic()
        self.next = self.t0 + self.FIRST_S
        self.shown = False

    def update(self, text: str) -> None:
        now = time.monotonic()
        if not self.enabled or now < self.next:
            return
        self.next = now + self.EVERY_S
        self.stream.write(f"\r{self.label}: {safe(text)} [{now - self.t0:.0f} s]\x1b[K")
        self.stream.flush()
        self.shown = True

    def done(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False
