"""What an ELF shared object exports, and the C string that an exported pointer points to.

Read with pyelftools from an open file; nothing is loaded or executed. Every failure of a
malformed file (truncated, not ELF, tables that point past the end) comes out as
:class:`ElfError` with the file and the cause, never as a pyelftools exception.

The string behind a pointer: a NCCL plugin struct starts with ``const char *name``. In a
shared object that pointer is filled in at load time by a relocation at the symbol's
address (``R_X86_64_RELATIVE``: the addend is the string's address; ``R_X86_64_64``: a
symbol's address plus the addend). With RELR (``-z pack-relative-relocs``), REL tables,
or in a non-PIE executable, the address sits in the file at that place already.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from elftools.elf.elffile import ELFFile

from inventoryd.nodefs import TimeLimit, progress

MAX_SYMBOLS = 200_000  # more dynamic symbols than any real plugin; a bound against bad tables
MAX_RELOCATIONS = 2_000_000
MAX_NAME = 256  # a plugin name is short; a longer "string" is not one
#: section and program headers read at most: a real libnccl has about 40 sections and 10
#: segments. Counted before any is read, extended numbering included (``e_shnum`` 0 with
#: the count in section 0: 4M sections took 232 s and 347 MB, issue 48)
MAX_SECTIONS = 4096
MAX_SEGMENTS = 4096
TICK_EVERY = 1024  # entries between two calls of nodefs.progress (the image's deadline)

# (e_machine, r_type) -> how the relocation computes the pointer
_RELATIVE = {("EM_X86_64", 8), ("EM_AARCH64", 1027), ("EM_386", 8), ("EM_PPC64", 22)}
_ABSOLUTE = {("EM_X86_64", 1), ("EM_AARCH64", 257), ("EM_386", 1), ("EM_PPC64", 38)}


class ElfError(Exception):
    """A file that cannot be read as ELF; the message names the file and the cause."""


@dataclass(frozen=True)
class DynSymbol:
    name: str
    value: int  # virtual address
    size: int


class ElfReader:
    """Read-only view of one ELF file. ``label`` names the file in error messages."""

    def __init__(self, f: BinaryIO, label: str) -> None:
        self.label = label
        self._f = f
        try:
            self._size = os.fstat(f.fileno()).st_size
        except (OSError, AttributeError, ValueError):
            f.seek(0, os.SEEK_END)
            self._size = f.tell()
        f.seek(0)
        head = f.read(4)
        if len(head) == 0:
            raise ElfError(f"{label}: empty file (0 bytes), not an ELF file")
        if head != b"\x7fELF":
            raise ElfError(f"{label}: not an ELF file (no ELF magic)")
        f.seek(0)
        problem = self._header_problem(f.read(64))
        if problem:
            raise ElfError(f"{label}: {problem}")
        f.seek(0)
        self._elf = self._guard("header", lambda: ELFFile(f))
        self._loads: list[tuple[int, int, int]] = self._guard("program headers", self._load_map)
        self._dynamic: Any = self._guard("dynamic segment", self._find_dynamic)
        self._tables: list[tuple[bytes, bool]] | None = None

    # ---- helpers -----------------------------------------------------------------------

    def _header_problem(self, head: bytes) -> str | None:
        """Check the ELF header's tables against the file size before pyelftools reads them."""
        if len(head) < 52 or head[4] not in (1, 2) or head[5] not in (1, 2):
            return "malformed ELF header (too short, or unknown class or byte order)"
        end = "<" if head[5] == 1 else ">"
        if head[4] == 2:
            if len(head) < 64:
                return "truncated: the ELF header is cut short"
            phoff, shoff = struct.unpack_from(end + "QQ", head, 32)
            phentsize, phnum, shentsize, shnum = struct.unpack_from(end + "HHHH", head, 54)
        else:
            phoff, shoff = struct.unpack_from(end + "II", head, 28)
            phentsize, phnum, shentsize, shnum = struct.unpack_from(end + "HHHH", head, 42)
        # ELF's extended numbering: e_shnum 0 puts the section count in section 0's
        # sh_size, e_phnum 0xffff the segment count in its sh_info
        if shoff and (shnum == 0 or phnum == 0xFFFF):
            first = self._section_zero(shoff, head[4] == 2, end)
            if first is None:
                return f"truncated: the section headers lie past byte {self._size}"
            if shnum == 0:
                shnum = first[0]
            if phnum == 0xFFFF:
                phnum = first[1]
        if shnum > MAX_SECTIONS:
            return f"more than {MAX_SECTIONS} section headers ({shnum}); not read"
        if phnum > MAX_SEGMENTS:
            return f"more than {MAX_SEGMENTS} program headers ({phnum}); not read"
        if phnum and not self._in_file(phoff, phnum * phentsize):
            return f"truncated: the program headers lie past byte {self._size}"
        if shoff and shnum and not self._in_file(shoff, shnum * shentsize):
            return f"truncated: the section headers lie past byte {self._size}"
        return None

    def _section_zero(self, shoff: int, wide: bool, end: str) -> tuple[int, int] | None:
        """``(sh_size, sh_info)`` of section 0 (the counts of extended numbering)."""
        n = 64 if wide else 40
        if not self._in_file(shoff, n):
            return None
        raw = self._read_at(shoff, n)
        if wide:
            return struct.unpack_from(end + "Q", raw, 32)[0], struct.unpack_from(end + "I",
                                                                                 raw, 44)[0]
        return struct.unpack_from(end + "I", raw, 20)[0], struct.unpack_from(end + "I", raw, 28)[0]

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (ElfError, TimeLimit):  # a deadline is not a malformed file
            raise
        except RecursionError:
            raise ElfError(f"{self.label}: malformed ELF {what}: recursion") from None
        except Exception as e:  # pyelftools/construct raise many types on bad input
            text = str(e) or type(e).__name__
            raise ElfError(f"{self.label}: malformed ELF {what}: {text}") from None

    def _load_map(self) -> list[tuple[int, int, int]]:
        out = []
        for seg in self._elf.iter_segments():
            if seg["p_type"] == "PT_LOAD":
                out.append((seg["p_vaddr"], seg["p_filesz"], seg["p_offset"]))
        return out

    def _find_dynamic(self) -> Any:
        for seg in self._elf.iter_segments():
            if seg["p_type"] == "PT_DYNAMIC":
                return seg
        return None

    def _in_file(self, offset: int, size: int) -> bool:
        return offset >= 0 and size >= 0 and offset + size <= self._size

    def file_offset(self, vaddr: int, size: int = 1) -> int | None:
        """The file offset holding ``size`` bytes at ``vaddr``, or None if not in the file."""
        for p_vaddr, p_filesz, p_offset in self._loads:
            if p_vaddr <= vaddr and vaddr + size <= p_vaddr + p_filesz:
                off = p_offset + (vaddr - p_vaddr)
                return off if self._in_file(off, size) else None
        return None

    def _read_at(self, offset: int, size: int) -> bytes:
        self._f.seek(offset)
        return self._f.read(size)

    # ---- symbols -----------------------------------------------------------------------

    def _symbol_source(self) -> Iterator[Any]:
        sec = self._elf.get_section_by_name(".dynsym")
        if sec is not None:
            if not self._in_file(sec["sh_offset"], sec["sh_size"]):
                raise ElfError(f"{self.label}: malformed ELF: .dynsym lies past the end")
            return sec.iter_symbols()
        if self._dynamic is not None:
            return self._dynamic.iter_symbols()
        return iter(())

    def exported(self, wanted: Callable[[str], bool] | None = None) -> dict[str, DynSymbol]:
        """Defined, visible dynamic symbols (those ``dlsym`` finds), by name."""

        def run() -> dict[str, DynSymbol]:
            out: dict[str, DynSymbol] = {}
            tick = progress.get()
            for i, sym in enumerate(self._symbol_source()):
                if tick is not None and i % TICK_EVERY == 0:
                    tick()
                if i >= MAX_SYMBOLS:
                    raise ElfError(f"{self.label}: more than {MAX_SYMBOLS} dynamic symbols")
                if sym["st_shndx"] == "SHN_UNDEF":
                    continue
                if sym["st_info"]["bind"] not in ("STB_GLOBAL", "STB_WEAK", "STB_GNU_UNIQUE"):
                    continue
                if sym["st_other"]["visibility"] in ("STV_HIDDEN", "STV_INTERNAL"):
                    continue
                name = sym.name
                if not name or (wanted is not None and not wanted(name)):
                    continue
                out[name] = DynSymbol(name, int(sym["st_value"]), int(sym["st_size"]))
            return out

        return self._guard("dynamic symbol table", run)

    # ---- pointers ----------------------------------------------------------------------

    def _relocation_tables(self) -> list[tuple[bytes, bool]]:
        """``(raw table, is RELA)`` of the dynamic RELA and REL tables (``DT_RELA`` /
        ``DT_RELASZ``, ``DT_REL`` / ``DT_RELSZ``), read once, bounded by MAX_RELOCATIONS."""
        if self._tables is not None:
            return self._tables
        self._tables = []
        if self._dynamic is None:
            return self._tables
        tags: dict[str, int] = {}
        for t in self._dynamic.iter_tags():
            tags.setdefault(str(t.entry.d_tag), int(t.entry.d_val))
        width = self._elf.elfclass // 8
        for addr, size, rela in (("DT_RELA", "DT_RELASZ", True), ("DT_REL", "DT_RELSZ", False)):
            if addr not in tags or size not in tags:
                continue
            entsize = width * (3 if rela else 2)
            n = tags[size] // entsize
            if n > MAX_RELOCATIONS:
                raise ElfError(f"{self.label}: more than {MAX_RELOCATIONS} relocations")
            off = self.file_offset(tags[addr], n * entsize)
            if off is None:
                raise ElfError(f"{self.label}: malformed ELF relocations: table outside "
                               "the file")
            self._tables.append((self._read_at(off, n * entsize), rela))
        return self._tables

    def _find_relocation(self, vaddr: int) -> tuple[int, int, int | None] | None:
        """(type, symbol index, addend or None for REL) of the relocation at ``vaddr``.

        The tables are searched as bytes for ``r_offset == vaddr`` at entry boundaries
        (one C-speed ``find`` per hit): walking them entry by entry in Python took 7 s
        for a plugin with 500,000 relocations, per pointer."""
        width = self._elf.elfclass // 8
        end = "<" if self._elf.little_endian else ">"
        word, sword = ("Q", "q") if width == 8 else ("I", "i")
        key = struct.pack(end + word, vaddr)
        for data, rela in self._relocation_tables():
            entsize = width * (3 if rela else 2)
            i = data.find(key)
            while i >= 0:
                if i % entsize == 0:
                    fields = struct.unpack_from(end + word + (word + sword if rela else word),
                                                data, i)
                    info = fields[1]
                    rtype, sym = ((info & 0xFFFFFFFF, info >> 32) if width == 8
                                  else (info & 0xFF, info >> 8))
                    return rtype, sym, (fields[2] if rela else None)
                i = data.find(key, i - i % entsize + entsize)  # the next entry: linear
        return None

    def _symbol_value(self, index: int) -> int | None:
        sec = self._elf.get_section_by_name(".dynsym")
        sym = sec.get_symbol(index) if sec is not None else self._dynamic.get_symbol(index)
        if sym is None or sym["st_shndx"] == "SHN_UNDEF":
            return None  # defined elsewhere: not knowable from this file
        return int(sym["st_value"])

    def pointer_target(self, vaddr: int) -> int | None:
        """The address stored at ``vaddr`` once relocated; None if not determinable here."""

        def run() -> int | None:
            width = self._elf.elfclass // 8
            machine = self._elf["e_machine"]
            rel = self._find_relocation(vaddr)
            off = self.file_offset(vaddr, width)
            in_file = None
            if off is not None:
                raw = self._read_at(off, width)
                if len(raw) == width:
                    in_file = int.from_bytes(raw, "little" if self._elf.little_endian else "big")
            if rel is not None:
                rtype, sym_index, addend = rel
                implicit = in_file if addend is None else addend
                if (machine, rtype) in _RELATIVE:
                    return implicit
                if (machine, rtype) in _ABSOLUTE:
                    base = self._symbol_value(sym_index)
                    if base is None or implicit is None:
                        return None
                    return base + implicit
                return None  # a relocation kind that does not yield a plain address
            return in_file or None  # RELR, non-PIE, or REL with the address in place

        return self._guard("relocations", run)

    def c_string(self, vaddr: int, max_len: int = MAX_NAME) -> str | None:
        """The NUL-terminated string at ``vaddr``, or None if it is not one within bounds."""
        for p_vaddr, p_filesz, p_offset in self._loads:
            if p_vaddr <= vaddr < p_vaddr + p_filesz:
                n = min(max_len + 1, p_vaddr + p_filesz - vaddr)
                off = p_offset + (vaddr - p_vaddr)
                if not self._in_file(off, 1):
                    return None
                data = self._read_at(off, n)
                end = data.find(b"\0")
                if end < 0:
                    return None
                try:
                    return data[:end].decode("utf-8")
                except UnicodeDecodeError:
                    return None
        return None

    def truncation(self) -> str | None:
        """Why the file is cut short (a segment or a table past its end), or None."""

        def run() -> str | None:
            for p_vaddr, p_filesz, p_offset in self._loads:
                if not self._in_file(p_offset, p_filesz):
                    return (f"truncated: a loadable segment (0x{p_vaddr:x}) ends at byte "
                            f"{p_offset + p_filesz}, the file has {self._size}")
            shoff, shnum = self._elf["e_shoff"], self._elf["e_shnum"]
            if shoff and not self._in_file(shoff, shnum * self._elf["e_shentsize"]):
                return f"truncated: the section header table lies past byte {self._size}"
            return None

        return self._guard("program headers", run)

    def section_ranges(self, names: frozenset[str]) -> list[tuple[int, int]]:
        """File ranges ``(start, end)`` of the named sections that have contents, sorted
        (at most :data:`MAX_SECTIONS` sections: the header check)."""

        def run() -> list[tuple[int, int]]:
            out = []
            tick = progress.get()
            for i, sec in enumerate(self._elf.iter_sections()):
                if tick is not None and i % TICK_EVERY == 0:
                    tick()
                if sec.name in names and sec["sh_type"] != "SHT_NOBITS":
                    start, size = sec["sh_offset"], sec["sh_size"]
                    if self._in_file(start, size):
                        out.append((start, start + size))
            return sorted(out)

        return self._guard("section headers", run)

    def pointed_string(self, vaddr: int) -> str | None:
        """The string that the pointer stored at ``vaddr`` points to (e.g. a struct's name)."""
        target = self.pointer_target(vaddr)
        if target is None:
            return None
        return self.c_string(target)
