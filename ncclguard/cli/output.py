"""Rendering for the admin CLI, in one place: tables for people, JSON and CSV for scripts.

Every command builds plain values (a JSON-ready document, and rows for a table) and
hands them here; nothing else in the CLI formats text. Table cells are strings made by
:func:`cell`; JSON keeps the real types (numbers stay numbers, ``None`` stays ``null``).

Every string shown in a table, a CSV cell, a ``key: value`` line or a title goes through
:func:`ncclguard.text.safe` (in :func:`cell`): a value from a node, a record, an image
or a job cannot add a line, a row or a terminal escape sequence. JSON needs nothing:
``json.dumps`` escapes control characters itself.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ncclguard.text import safe
from ncclguard.timeparse import iso_utc

FORMATS = ("table", "json", "csv")

#: The three words for a value of a node's stack, in every view (docs/cli.md, "Values:
#: none, unknown, -"): the node was read and has no such thing; it could not be read (or
#: the record does not say: JSON ``null``); nothing applies (and an empty cell).
NONE = "none"
UNKNOWN = "unknown"
NOT_APPLICABLE = "-"

#: A column: (key in the row, header shown in the table and the CSV).
Column = tuple[str, str]


def cell(value: Any) -> str:
    """One table or CSV cell: ``None`` shows as ``-``, lists are comma-joined, a mapping
    is JSON, and control characters are escaped (:func:`ncclguard.text.safe`)."""
    t = type(value)
    if t is str:  # the common cases first: tables of 16,000 rows
        return safe(value)
    if t is int:
        return str(value)
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isfinite(value) and value == int(value):
            return str(int(value))
        return f"{value:g}"
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=str) if isinstance(value, set | frozenset) else value
        return ",".join(cell(v) for v in items) if items else "-"
    if isinstance(value, dict):  # as JSON, in every view (not a Python repr: issue 46)
        return safe(json.dumps(value, sort_keys=True, default=str))
    return safe(str(value))


def known(value: Any) -> Any:
    """A stack value for a cell: ``None`` (the fingerprint model's *unknown*,
    :mod:`ncclguard.fingerprint.fields`) as :data:`UNKNOWN`, anything else as it is."""
    return UNKNOWN if value is None else value


def table(rows: Iterable[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """A plain aligned table with a header line; an empty table still has its header."""
    header = [cell(h) for _, h in columns]
    keys = [k for k, _ in columns]
    body = [[cell(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in body)) if body else len(h)
              for i, h in enumerate(header)]
    out = []
    for line in [header, *body]:
        out.append("  ".join(t.ljust(w) for t, w in zip(line, widths, strict=True)).rstrip())
    return "\n".join(out) + "\n"


def csv_text(rows: Iterable[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """CSV with the column keys as header (stable for scripts), cells as in the table."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([k for k, _ in columns])
    keys = [k for k, _ in columns]
    for r in rows:
        values = [r.get(k) for k in keys]
        w.writerow(["" if v is None else cell(v) for v in values])
    return buf.getvalue()


def json_text(doc: Any, *, pretty: bool = True) -> str:
    """JSON with a trailing newline; indented when ``pretty``. Sets become sorted lists.

    ``pretty=False`` is one line: the json module's C encoder, several times faster on
    16,000 rows (its indenting encoder is pure Python).
    """
    if pretty:
        return json.dumps(doc, indent=2, default=_json_default) + "\n"
    return json.dumps(doc, separators=(",", ":"), default=_json_default) + "\n"


def _json_default(o: Any) -> Any:
    if isinstance(o, set | frozenset):
        return sorted(o, key=str)
    if hasattr(o, "to_dict"):
        return o.to_dict()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def iso(epoch: float | None) -> str | None:
    """Epoch seconds as UTC ISO-8601 with a ``Z`` (the fingerprint's convention)."""
    if epoch is None:
        return None
    return _iso_second(int(epoch // 1))


@functools.lru_cache(maxsize=4096)
def _iso_second(second: int) -> str:
    # heartbeats of thousands of nodes fall on a few hundred distinct seconds
    return iso_utc(second)


def age(seconds: float | None) -> str | None:
    """A short human age: ``42s``, ``5m``, ``3h``, ``2d``; ``None`` stays ``None``."""
    if seconds is None:
        return None
    s = max(0.0, seconds)
    if s < 120:
        return f"{int(s)}s"
    if s < 2 * 3600:
        return f"{int(s // 60)}m"
    if s < 2 * 86400:
        return f"{int(s // 3600)}h"
    return f"{int(s // 86400)}d"


def now() -> float:
    return time.time()


def section(title: str, body: str) -> str:
    """A titled block of text (used by ``show`` and ``drain-recommend``)."""
    title = safe(title)
    return f"{title}\n{body}" if body.endswith("\n") else f"{title}\n{body}\n"


def kv(pairs: Sequence[tuple[str, Any]], indent: int = 2) -> str:
    """``key: value`` lines, keys aligned; for readable single records."""
    if not pairs:
        return ""
    keys = [safe(k) for k, _ in pairs]
    w = max(len(k) for k in keys)
    pad = " " * indent
    return "".join(f"{pad}{k.ljust(w)}  {cell(v)}\n"
                   for k, (_, v) in zip(keys, pairs, strict=True))


class Progress:
    """A progress line for long work (issue 46: ``diagnose`` read a 2 GiB log for 95 s
    printing nothing): on ``stream`` (stderr) only when it is a terminal, rewritten in
    place, first after :attr:`FIRST_S` and then at most every :attr:`EVERY_S`, cleared by
    :meth:`done`. Scripts and pipes never see it; ``--quiet`` turns it off."""

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
