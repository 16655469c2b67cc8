"""A bounded reader of one tar stream (a registry image's layer), member by member.

Python's ``tarfile`` is not used on layers: it reads a pax or GNU long-name header whole
into memory whatever size the header declares (CPython 3.11 ``Lib/tarfile.py``,
``TarInfo._proc_pax``: ``tarfile.fileobj.read(self._block(self.size))``), and in stream
mode it keeps every member it has read; a layer is hostile input from a registry.
This reader holds one 512-byte header at a time and at most :data:`MAX_HEADER` bytes of
extended header, and checks every header's checksum. It reads the POSIX ustar, pax
(``path``, ``linkpath``, ``size``) and GNU (``L``/``K`` long names) forms that image
builders write (docs/containers.md, "Registry images").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

BLOCK = 512
MAX_HEADER = 1 << 20  # a pax or GNU long-name header, at most
MAX_NAME = 4096  # a member's path or link target, at most (PATH_MAX)

REGULAR = "-"
DIRECTORY = "d"
SYMLINK = "l"
HARDLINK = "h"
OTHER = "?"

_KINDS = {b"0": REGULAR, b"\0": REGULAR, b"7": REGULAR, b"5": DIRECTORY, b"2": SYMLINK,
          b"1": HARDLINK}
#: devices and FIFOs: no data follows them, whatever their size field says (as GNU tar,
#: which enroot extracts layers with, and tarfile read them)
_NO_DATA = (b"3", b"4", b"6")
#: GNU sparse members and multi-volume parts: a file whose content this reader would
#: misread; the layer is refused rather than read another way than tar reads it
_REFUSED = (b"S", b"M", b"V")


class TarError(Exception):
    """The stream is not a tar archive this reader accepts; the message says why."""


@dataclass(slots=True)
class Member:
    name: str  # as written in the archive (not yet normalised)
    kind: str  # REGULAR, DIRECTORY, SYMLINK, HARDLINK, OTHER
    size: int  # bytes of data that follow (0 but for regular files)
    link: str  # a link's target ("" for others)
    mode: int


def _number(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256
        value = int.from_bytes(field[1:], "big")
        if field[0] & 0x40:
            raise TarError("a negative number in a header")
        return value
    text = field.replace(b"\0", b" ").strip()
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise TarError(f"a header number that is not octal: {text[:24]!r}") from None


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax(data: bytes) -> dict[str, str]:
    """``LEN key=value\\n`` records (POSIX pax); malformed ones raise."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        sp = data.find(b" ", pos, pos + 20)
        if sp < 0:
            if not data[pos:].strip(b"\0"):
                break
            raise TarError("a malformed pax record")
        try:
            length = int(data[pos:sp])
        except ValueError:
            raise TarError("a malformed pax record length") from None
        if length <= sp - pos + 1 or pos + length > len(data):
            raise TarError("a pax record longer than its header")
        record = data[sp + 1:pos + length - 1]
        key, eq, value = record.partition(b"=")
        if not eq:
            raise TarError("a pax record without '='")
        out[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


class TarReader:
    """``for member in reader:`` ... ``reader.read(n)`` reads the member's data (what is
    not read is skipped at the next member). ``source.read(n)`` must bound itself (bytes
    and time); this reader bounds what it keeps."""

    def __init__(self, source: IO[bytes]) -> None:
        self.source = source
        self._left = 0  # data of the current member not read yet
        self._pad = 0

    def _exact(self, n: int) -> bytes:
        parts: list[bytes] = []
        want = n
        while want:
            chunk = self.source.read(min(want, 1 << 20))
            if not chunk:
                raise TarError(f"the archive ends inside a member ({n - want} of {n} bytes)")
            parts.append(chunk)
            want -= len(chunk)
        return b"".join(parts)

    def _skip(self, n: int) -> None:
        while n:
            chunk = self.source.read(min(n, 1 << 20))
            if not chunk:
                raise TarError("the archive ends inside a member")
            n -= len(chunk)

    def read(self, n: int) -> bytes:
        """At most ``n`` bytes of the current member's data (b"" at its end)."""
        n = min(n, self._left)
        if n <= 0:
            return b""
        chunk = self.source.read(min(n, 1 << 20))
        if not chunk:
            raise TarError("the archive ends inside a member")
        self._left -= len(chunk)
        return chunk

    def _header(self) -> bytes | None:
        self._skip(self._left + self._pad)
        self._left = self._pad = 0
        block = self.source.read(BLOCK)
        while block and len(block) < BLOCK:
            more = self.source.read(BLOCK - len(block))
            if not more:
                raise TarError("the archive ends inside a header")
            block += more
        if not block or block == b"\0" * BLOCK:
            return None  # the end (two zero blocks; one, or none, is accepted)
        stored = _number(block[148:156])
        if stored != sum(block[:148]) + 256 + sum(block[156:]):
            raise TarError("a header with a bad checksum (not a tar archive, or corrupt)")
        return block

    def _data(self, size: int, what: str) -> bytes:
        if size > MAX_HEADER:
            raise TarError(f"a {what} header of {size} bytes (more than {MAX_HEADER})")
        data = self._exact(size)
        self._skip(-size % BLOCK)
        return data

    def __iter__(self) -> Iterator[Member]:
        pax: dict[str, str] = {}
        long_name: str | None = None
        long_link: str | None = None
        while True:
            block = self._header()
            if block is None:
                return
            flag = block[156:157]
            size = _number(block[124:136])
            if flag in (b"x", b"g"):
                records = _pax(self._data(size, "pax"))
                if flag == b"x":
                    pax = records  # "g" (global) sets nothing this reader uses
                continue
            if flag in (b"L", b"K"):
                text = _text(self._data(size, "long-name"))
                if flag == b"L":
                    long_name = text
                else:
                    long_link = text
                continue
            name = _text(block[0:100])
            if block[257:263] == b"ustar\0":  # POSIX: a prefix before the name
                prefix = _text(block[345:500])
                if prefix:
                    name = f"{prefix}/{name}"
            link = _text(block[157:257])
            name = pax.get("path", long_name if long_name is not None else name)
            link = pax.get("linkpath", long_link if long_link is not None else link)
            if flag in _REFUSED or any(k.startswith("GNU.sparse.") for k in pax):
                raise TarError(f"a GNU sparse or multi-volume member ({name[:200]!r}), which "
                               "this reader does not read")
            if "size" in pax:
                try:
                    size = int(pax["size"])
                except ValueError:
                    raise TarError("a pax size that is not a number") from None
            pax, long_name, long_link = {}, None, None
            if len(name) > MAX_NAME or len(link) > MAX_NAME:
                raise TarError(f"a member name or link over {MAX_NAME} bytes")
            # an unknown type is extracted as a regular file (POSIX; GNU tar does so)
            kind = _KINDS.get(flag, OTHER if flag in _NO_DATA else REGULAR)
            if kind == REGULAR and flag == b"\0" and name.endswith("/"):
                kind = DIRECTORY  # an old-style directory
            # as GNU tar reads them: regular files carry data; links, directories,
            # devices and FIFOs do not
            data = size if kind == REGULAR else 0
            member = Member(name, kind, size if kind == REGULAR else 0, link,
                            _number(block[100:108]) & 0o7777)
            self._left, self._pad = data, -data % BLOCK
            yield member
