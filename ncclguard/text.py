"""Safe text: how every string from outside (a node, a record, an image, a job, a file
name) is shown in a table, a message or a log line.

:func:`safe` shows control characters as escapes (``\\n``, ``\\x1b``, ``\\u202e``), so that
no value can start a new line (and so forge a log line or a table row), move the
cursor, set a terminal's title (OSC), hide text (bidirectional overrides, zero-width
characters) or break a line in two (U+2028). A backslash is shown as ``\\\\``, so that an
escape shown can be told from the same characters written out. Text without any of them
is returned as it is (one regex search).

JSON output needs none of this: ``json.dumps`` already escapes control characters.

The lowest layer: standard library only (the gate imports it on every job).
"""

from __future__ import annotations

import re

__all__ = ["safe"]

#: C0 and C1 controls, DEL, the backslash, and the Unicode formatting characters that
#: change how text is laid out or hide it: soft hyphen, Arabic letter mark, Mongolian
#: vowel separator, zero-width and directional marks, line and paragraph separators,
#: bidirectional embeddings, overrides and isolates, invisible operators, BOM,
#: interlinear annotations; lone surrogates.
_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\\\\\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e"
    "\u2060-\u206f\ufeff\ufff9-\ufffb\ud800-\udfff]"
)
_UNSAFE_IN_BLOCK = re.compile(  # the same but the newline and the backslash
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e"
    "\u2060-\u206f\ufeff\ufff9-\ufffb\ud800-\udfff]"
)
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
    if keep_newlines:
        return _UNSAFE_IN_BLOCK.sub(_escape, text) if _UNSAFE_IN_BLOCK.search(text) else text
    if not _UNSAFE.search(text):
        return text
    return _UNSAFE.sub(_escape, text)
