"""The one wait-until of the tests and benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(pred: Callable[[], T], timeout: float, what: str, *, interval: float = 0.2,
               detail: Callable[[], str] | None = None,
               ignore: tuple[type[BaseException], ...] = ()) -> T:
    """Call ``pred`` every ``interval`` seconds until it returns something true, and
    return that. After ``timeout`` seconds: AssertionError naming ``what`` (and what
    ``detail()`` says, where given). An exception of a type in ``ignore`` from ``pred``
    counts as false (a server not listening yet)."""
    end = time.monotonic() + timeout
    while True:
        try:
            got = pred()
        except ignore:
            got = None
        if got:
            return got
        if time.monotonic() > end:
            more = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{more}")
        time.sleep(interval)
