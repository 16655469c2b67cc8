"""Slurm hostlists (``n[001-004,9],gpu[1-2]-ib[0-1]``) expanded and compressed in-process.

The expansion follows what ``scontrol show hostnames`` does on Slurm 23.11 and later
(checked by ``tests/test_hostlist.py`` against the real command of 22.05 and 24.11 on
generated lists):

- items are separated by commas or white space outside brackets; empty items are skipped;
- a bracket set holds comma-separated numbers and ``lo-hi`` ranges; the width of ``lo``
  sets the zero padding (``n[01-3]`` is ``n01 n02 n03``; ``n[1-03]`` is ``n1 n2 n3``);
- an item may hold several bracket sets (``rack[1-2]-node[01-02]``) and text after the
  last ``]`` (``gpu[01-02]-ib`` is ``gpu01-ib gpu02-ib``). Slurm accepts that text from
  23.11 on; 22.05 rejects it, but no Slurm writes it (its own lists, such as
  ``SLURM_JOB_NODELIST``, bracket only trailing digits), so accepting it changes nothing
  that Slurm hands the gate;
- order and duplicates are kept.

Anything else raises :class:`HostlistError`, whose message names the list. One list
expands to at most :data:`MAX_HOSTS` names, so a hostile list cannot exhaust memory.

The digit work is done by python-hostlist; this module adds Slurm's rules on top. It is
on the prolog's hot path: the standard library and python-hostlist only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import hostlist as _hl

_TRAILING_DIGITS = re.compile(r"^(.*?)([0-9]+)$")
_NOT_IN_NAMES = re.compile(r"[\[\],\s]")

MAX_HOSTS = 65536  # Slurm's own limit on one range ("Too many hosts in range")

__all__ = ["MAX_HOSTS", "HostlistError", "compress", "compress_within", "expand"]


class HostlistError(ValueError):
    """A hostlist that cannot be expanded. The message names the list and the problem."""

    def __init__(self, hostlist: str, problem: str) -> None:
        self.hostlist = hostlist
        self.problem = problem
        shown = hostlist if len(hostlist) <= 200 else hostlist[:200] + "..."
        super().__init__(f"invalid hostlist {shown!r}: {problem}")


def _items(text: str) -> list[str]:
    """Split at commas and white space outside brackets; check bracket balance."""
    items: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise HostlistError(text, f"nested '[' at offset {i}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise HostlistError(text, f"unbalanced ']' at offset {i}")
            depth = 0
        elif depth == 0 and (ch == "," or ch.isspace()):
            if i > start:
                items.append(text[start:i])
            start = i + 1
        elif depth and not (ch.isdigit() or ch in ",-"):
            raise HostlistError(text, f"{ch!r} inside brackets at offset {i}")
    if depth:
        raise HostlistError(text, "unbalanced '[' (missing ']')")
    if start < len(text):
        items.append(text[start:])
    return items


def expand(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist into host names, in order, duplicates kept.

    >>> expand("n[01-03],gpu[1-2]-ib[0-1]")
    ['n01', 'n02', 'n03', 'gpu1-ib0', 'gpu1-ib1', 'gpu2-ib0', 'gpu2-ib1']
    """
    if not isinstance(hostlist, str):
        raise HostlistError(repr(hostlist), f"expected a string, got {type(hostlist).__name__}")
    out: list[str] = []
    for item in _items(hostlist):
        if "[" not in item:
            out.append(item)
        else:
            try:
                names = _hl.expand_hostlist(item, allow_duplicates=True)
            except _hl.BadHostlist as e:
                raise HostlistError(hostlist, f"{e} in {item!r}") from None
            out.extend(names)
        if len(out) > MAX_HOSTS:
            raise HostlistError(hostlist, f"more than {MAX_HOSTS} hosts")
    return out


def compress(hosts: Iterable[str]) -> str:
    """A short hostlist for ``hosts`` that Slurm accepts (sorted, duplicates dropped).

    Only the trailing digits of a name are bracketed, as Slurm does, so the result always
    expands back (here and in ``scontrol``) to the same names.

    >>> compress(["n3", "n1", "n2", "x01", "x02", "x10", "login"])
    'login,n[1-3],x[01-02,10]'
    """
    names = set(hosts)
    groups: dict[tuple[str, int], list[int]] = {}
    plain: list[str] = []
    padded: set[tuple[str, int]] = set()
    split: list[tuple[str, str]] = []
    for name in names:
        if not isinstance(name, str) or not name or _NOT_IN_NAMES.search(name):
            raise HostlistError(
                ",".join(map(str, sorted(names, key=str))), f"{name!r} is not a host name"
            )
        m = _TRAILING_DIGITS.match(name)
        if m is None:
            plain.append(name)
            continue
        prefix, digits = m.groups()
        split.append((prefix, digits))
        if len(digits) > 1 and digits[0] == "0":
            padded.add((prefix, len(digits)))
    for prefix, digits in split:
        width = len(digits) if (prefix, len(digits)) in padded else 0
        groups.setdefault((prefix, width), []).append(int(digits))
    parts = [(name, -1, name) for name in plain]
    for (prefix, width), numbers in groups.items():
        numbers.sort()
        if len(numbers) == 1:
            parts.append((prefix, numbers[0], f"{prefix}{numbers[0]:0{width}d}"))
            continue
        ranges: list[str] = []
        lo = prev = numbers[0]
        for n in [*numbers[1:], None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            ranges.append(f"{lo:0{width}d}" if lo == prev else f"{lo:0{width}d}-{prev:0{width}d}")
            if n is not None:
                lo = prev = n
        parts.append((prefix, numbers[0], f"{prefix}[{','.join(ranges)}]"))
    parts.sort()
    return ",".join(text for _, _, text in parts)


def _order(name: str) -> tuple[str, int, int]:
    """Sort key that keeps a prefix's numbered names together, by number (``n2`` before
    ``n10``; zero-padded widths apart): neighbours in this order compress into one range."""
    m = _TRAILING_DIGITS.match(name)
    if m is None:
        return (name, -1, -1)
    prefix, digits = m.groups()
    return (prefix, len(digits) if digits[0] == "0" else 0, int(digits))


def compress_within(hosts: Iterable[str], limit: int) -> list[str]:
    """``hosts`` as compressed hostlists of at most ``limit`` bytes (UTF-8) each: one when
    :func:`compress` fits, else the names in number order cut in two, and each half again
    until it fits. Together they name every host once, in order. For an argument of a
    command: Linux refuses to run one with an argument over 128 KiB (``MAX_ARG_STRLEN``,
    "Argument list too long"; docs/slurm.md).

    >>> compress_within([f"gpu{i:05d}" for i in range(1, 16385)], 64 * 1024)
    ['gpu[00001-16384]']
    >>> compress_within([f"node-{c}" for c in "abcd"], 13)
    ['node-a,node-b', 'node-c,node-d']
    """
    names = sorted(set(hosts), key=_order)
    out: list[str] = []
    todo = [names] if names else []
    while todo:
        part = todo.pop()
        text = compress(part)
        if len(text.encode()) <= limit:
            out.append(text)
        elif len(part) == 1:
            raise HostlistError(part[0][:200], f"a host name longer than {limit} bytes")
        else:
            half = len(part) // 2
            todo += [part[half:], part[:half]]  # the first half comes out first
    return out
