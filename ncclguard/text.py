"""Safe text: how every string from outside (a node, a record, an image, a job, a file
name) is shown in a table, a message or a log line.

:func:`safe` shows control characters as escapes (``\\n``, ``\\x1b``, ``\\u202e``), so that
no value can start a new line (and so forge a log line or a table row), move the
cursor, set a terminal's title (OSC), hide text (bidirectional overrides, zero-width
characters) or break a line in two (U+2028). A backslash is shown as ``\\\\``, so that an
escape shown can be told from the same characters written out. Text without any of them
is returned as it is: printable ASCII without a backslash (a gate's usual line) at the
cost of two string tests, without compiling the patterns; other text after one regex
search.

JSON output needs none of this: ``json.dumps`` already escapes control characters.

The lowest layer: standard library only (the gate imports it on every job).
"""

from __future__ import annotations

import functools
import re

__all__ = ["count", "safe"]

#: C0 and C1 controls, DEL, the backslash, and the Unicode formatting characters that
#: change how text is laid out or hide it: soft hyphen, Arabic letter mark, Mongolian
#: vowel separator, zero-width and directional marks, line and paragraph separators,
#: bidirectional embeddings, overrides and isolates, invisible operators, BOM,
#: interlinear annotations; lone surrogates.
_UNSAFE = (
    "[\x00-\x1f\x7f-\x9f\\\\\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e"
    "\u2060-\u206f\ufeff\ufff9-\ufffb\ud800-\udfff]"
)
_UNSAFE_IN_BLOCK = (  # the same but the newline and the backslash
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e"
    "\u2060-\u206f\ufeff\ufff9-\ufffb\ud800-\udfff]"
)


@functools.cache
def _pattern(block: bool) -> re.Pattern[str]:
    """The pattern, compiled the first time text needs it (the gate's usual line never
    does: compiling these character classes costs about a millisecond)."""
    return re.compile(_UNSAFE_IN_BLOCK if block else _UNSAFE)


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    named = _NAMED.get(c)
    if named is not None:
        return named
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}"


def safe(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with every control and layout character escaped (see the module).

    ``keep_newlines``: keep ``\\n`` as it is (and the backslash: a whole block of text
    that its writer composed from already escaped values, such as a CLI table, where
    only a stray terminal sequence is to be caught)."""
    if text.isascii() and text.isprintable() and (keep_newlines or "\\" not in text):
        return text  # no control character, no backslash to show: nothing to escape
    pattern = _pattern(keep_newlines)
    return pattern.sub(_escape, text) if pattern.search(text) else text


#: The most of a user's value (a job's variable) a message shows.
SHOWN = 120


def cut(text: str, limit: int = SHOWN) -> str:
    """``text``, or its first ``limit`` characters and ``...`` when it is longer: a
    user's value in a message, a finding's label, an audit record (issue 40)."""
    return text if len(text) <= limit else text[:limit] + "..."


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``1 node``, ``2 nodes``: a number with its noun as English reads it (issue 46: the
    CLI printed "1 nodes")."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"
