"""Rendering for the admin CLI, in one place: tables for people, JSON and CSV for scripts.

Every command builds plain values (a JSON-ready document, and rows for a table) and
hands them here; nothing else in the CLI formats text. Table cells are strings made by
:func:`cell`; JSON keeps the real types (numbers stay numbers, ``None`` stays ``null``).

Every string shown in a table, a CSV cell, a ``key: value`` line or a title goes through
:func:`ncclguard.text.safe` (in :func:`cell`): a value from a node, a record, an image
or a job cannot add a line, a row or a terminal escape sequence. JSON needs nothing:
``json.dumps`` escapes control characters itself.

**Width** (issue 46: ``drain-recommend`` printed ~150 columns, ``diff`` ~190): with a
``width`` (:data:`WIDTH`, unless ``--wide``), :func:`table` fits its columns: it leaves out
the table's optional columns, then narrows the widest ones, each cell cut to its column
ending in :data:`CUT`; :func:`wrap` breaks any other line longer than the width at a
space, the rest indented under it. A value's own ``…`` is shown escaped (``\u2026``) in a
table, so that :data:`CUT` always means "cut here" (``--wide`` and ``--json`` show it whole).
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import re
import textwrap
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


#: The columns every table and line of a command's text fits without ``--wide``.
WIDTH = 100
#: The end of a cell cut to fit its column (a value's own is escaped: never ambiguous).
CUT = "\u2026"
_CUT_ESCAPED = "\\u2026"
#: A column is not narrowed below its header nor below this (but a shorter value's width).
MIN_CELL = 8
_GAP = 2  # spaces between two columns


def known(value: Any) -> Any:
    """A stack value for a cell: ``None`` (the fingerprint model's *unknown*,
    :mod:`ncclguard.fingerprint.fields`) as :data:`UNKNOWN`, anything else as it is."""
    return UNKNOWN if value is None else value


def table(rows: Iterable[Mapping[str, Any]], columns: Sequence[Column],
          width: int | None = None, *, optional: Sequence[str] = (),
          keep: Sequence[str] = (), wrap: Sequence[str] = ()) -> str:
    """A plain aligned table with a header line; an empty table still has its header.

    ``width``: fit the table in that many columns (None: as wide as its values). While it
    is too wide, the columns whose keys are in ``optional`` are left out, in that order;
    then the widest columns not in ``keep`` (names: a host, a class, a hostlist) are
    narrowed to one level, none below its header or :data:`MIN_CELL`. A cell longer than
    its column is cut, ending in :data:`CUT`; in a ``wrap`` column it is broken at spaces,
    commas, slashes or dots between names instead, its other lines indented two under it
    (a row's first line never starts with a space)."""
    header = [cell(h) for _, h in columns]
    keys = [k for k, _ in columns]
    body = [[cell(r.get(k)) for k in keys] for r in rows]
    for n, line in enumerate(body):
        if not "".join(line).isascii():  # a rare row: its cells' own … escaped
            body[n] = [_marked(t) for t in line]
    widths = [max(len(h), *(len(line[i]) for line in body)) if body else len(h)
              for i, h in enumerate(header)]
    shown = list(range(len(columns)))
    if width is None or _total(widths, shown) <= width:  # as wide as its values
        return "\n".join("  ".join(t.ljust(w) for t, w in zip(line, widths, strict=True))
                         .rstrip() for line in [header, *body]) + "\n"
    for key in optional:
        if _total(widths, shown) <= width:
            break
        if key in keys:
            shown.remove(keys.index(key))
    kept = [i for i in shown if keys[i] in keep]
    fitted = _narrowed(widths, header, [i for i in shown if i not in kept],
                       width - _total(widths, kept) - (_GAP if kept else 0))
    wrapped = [i for i in shown if keys[i] in wrap and fitted[i] < widths[i]]
    out = []
    for line in [header, *body]:
        if any(len(line[i]) > fitted[i] for i in wrapped):
            cells = [_wrapped(line[i], fitted[i]) if i in wrapped
                     else [_fitted(line[i], fitted[i])] for i in shown]
            for n in range(max(len(c) for c in cells)):
                out.append("  ".join((c[n] if n < len(c) else "").ljust(fitted[i])
                                     for c, i in zip(cells, shown, strict=True)).rstrip())
        else:
            out.append("  ".join(_fitted(line[i], fitted[i]).ljust(fitted[i])
                                 for i in shown).rstrip())
    return "\n".join(out) + "\n"


def _marked(text: str) -> str:
    """A cell's own ``…`` escaped, so that :data:`CUT` only ever marks a cut."""
    if text.isascii() or CUT not in text:
        return text
    return text.replace(CUT, _CUT_ESCAPED)


def _total(widths: Sequence[int], shown: Sequence[int]) -> int:
    return sum(widths[i] for i in shown) + _GAP * max(0, len(shown) - 1)


def _narrowed(widths: list[int], header: Sequence[str], shown: Sequence[int],
              width: int) -> list[int]:
    """The widths with the widest of the ``shown`` columns narrowed to one level, the
    highest at which they fit ``width`` (each at least its floor: its header,
    :data:`MIN_CELL`)."""
    floor = {i: min(widths[i], max(len(header[i]), MIN_CELL)) for i in shown}
    budget = width - _GAP * max(0, len(shown) - 1)

    def used(level: int) -> int:
        return sum(max(floor[i], min(widths[i], level)) for i in shown)

    lo, hi = 0, max((widths[i] for i in shown), default=0)
    while lo < hi:  # the highest level whose columns fit the budget
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if used(mid) <= budget else (lo, mid - 1)
    out = list(widths)
    for i in shown:
        out[i] = max(floor[i], min(widths[i], lo))
    spare = budget - used(lo)
    for i in shown:  # what is left goes to the columns cut at the level, in order
        if spare <= 0:
            break
        if out[i] < widths[i]:
            out[i] += 1
            spare -= 1
    return out


def _fitted(text: str, w: int) -> str:
    return text if len(text) <= w else text[: w - 1] + CUT


#: where a wrapped cell may break: after spaces, a comma, a slash, or a dot before a
#: name (``rdma.devices``, ``].version``; not inside a version: ``2.21.5``)
_BREAK = re.compile(r"[ ,/]+|\.(?=[A-Za-z_])")


def _pieces(text: str) -> list[str]:
    pieces, start = [], 0
    for m in _BREAK.finditer(text):
        pieces.append(text[start:m.end()])
        start = m.end()
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def _wrapped(text: str, w: int) -> list[str]:
    """``text`` in lines of at most ``w``, broken where :data:`_BREAK` allows (a longer
    piece where it must); the lines after the first indented by two."""
    if len(text) <= w:
        return [text]
    lines: list[str] = []
    line = ""
    for piece in _pieces(text):
        room = w - (2 if lines else 0)
        if line and len(line) + len(piece.rstrip()) > room:
            lines.append(line.rstrip())
            line = ""
            room = w - 2
        while len(piece.rstrip()) > room:  # one piece longer than a line: split it
            lines.append(piece[:room])
            piece = piece[room:]
            room = w - 2
        line += piece
    if line.strip():
        lines.append(line.rstrip())
    return [ln if n == 0 else "  " + ln for n, ln in enumerate(lines)]


def wrap(text: str, width: int | None) -> str:
    """Every line of ``text`` longer than ``width`` broken at spaces, the rest of it
    indented four more than the line (None: ``text`` as it is)."""
    if width is None or all(len(line) <= width for line in text.split("\n")):
        return text
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        indent = line[: len(line) - len(line.lstrip(" "))]
        out.extend(textwrap.wrap(line, width, subsequent_indent=indent + "    ",
                                 break_long_words=True, break_on_hyphens=False,
                                 drop_whitespace=True) or [line])
    return "\n".join(out)


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
