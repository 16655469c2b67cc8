"""Where the dynamic linker of a node finds a library, read inside the node root.

The linker resolves a bare name (``libnccl.so.2``, ``libnccl-net.so``) through
``/etc/ld.so.cache`` (written by ``ldconfig`` from ``/etc/ld.so.conf`` and its
``include`` files), then through the standard directories. This module reads the cache
(the ``glibc-ld.so.cache1.1`` format, alone or after the old ``ld.so-1.7.0`` table),
``ld.so.conf``, and lists the directories, all through a :class:`NodeFS` root.

Paths are node paths. Symlinks are resolved as ``chroot`` would: an absolute target is
taken inside the root and ``..`` never climbs out of it; more than
:data:`inventoryd.nodefs.MAX_SYMLINKS` links is ELOOP, so a loop is an error and never a hang. Every
file is opened without blocking and must be a regular file (a FIFO named like a library
must not stall the collector). Globs are expanded here too, chroot-style, and bounded.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import platform
import stat
import struct
from dataclasses import dataclass, field
from typing import BinaryIO

from inventoryd.nodefs import ErrorLog, NodeFS

PROBE = "linker"
LD_SO_CACHE = "/etc/ld.so.cache"
LD_SO_CONF = "/etc/ld.so.conf"
MAX_CACHE_BYTES = 16 * 1024 * 1024  # real caches are ~100 KB
MAX_CONF_BYTES = 1024 * 1024
MAX_CONF_FILES = 256
MAX_INCLUDE_DEPTH = 8
MAX_GLOB_MATCHES = 1000  # per pattern; more is recorded as an error and cut

OLD_MAGIC = b"ld.so-1.7.0"
NEW_MAGIC = b"glibc-ld.so.cache1.1"
_NEW_HEADER = struct.Struct("<20sIIB3xI12x")  # magic+version, nlibs, len_strings, flags, ext
_NEW_ENTRY = struct.Struct("<iIIIQ")  # flags, key, value, osversion, hwcap
_OLD_ENTRY = struct.Struct("<iII")

# ld.so.cache entry flags: FLAG_ELF_LIBC6 | the architecture's FLAG_*_LIB64
_ARCH = {
    "x86_64": (0x0303, "x86_64-linux-gnu"),
    "aarch64": (0x0A03, "aarch64-linux-gnu"),
    "ppc64le": (0x0503, "powerpc64le-linux-gnu"),
}


class LinkerError(ValueError):
    """A linker file that cannot be parsed; the message names the file and the cause."""


@dataclass(frozen=True)
class CacheEntry:
    soname: str
    path: str
    flags: int
    hwcap: int


def standard_dirs(machine: str | None = None) -> list[str]:
    """The linker's built-in directories (Debian multiarch and the lib64 layouts)."""
    arch = _ARCH.get(machine or platform.machine())
    multi = [f"/lib/{arch[1]}", f"/usr/lib/{arch[1]}"] if arch else []
    return [*multi, "/lib64", "/usr/lib64", "/lib", "/usr/lib"]


def arch_flags(machine: str | None = None) -> int | None:
    arch = _ARCH.get(machine or platform.machine())
    return arch[0] if arch else None


# ---- paths inside the root ---------------------------------------------------------------


def resolve(fs: NodeFS, node_path: str) -> str:
    """The node path with every symlink resolved inside the root. Raises OSError.

    A missing component raises ENOENT, a loop ELOOP (see :meth:`NodeFS.resolve`).
    """
    return fs.resolve(node_path, strict=True)


def open_regular(fs: NodeFS, node_path: str) -> tuple[BinaryIO, os.stat_result, str]:
    """Open a node file for reading: (file, its fstat, its resolved node path).

    Never blocks (``O_NONBLOCK``), and refuses what is not a regular file (FIFO, socket,
    device, directory) with an OSError that says so.
    """
    real = resolve(fs, node_path)
    fd = os.open(fs.host(real), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), node_path)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{node_path}: not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st, real
    except BaseException:
        os.close(fd)
        raise


def is_file(fs: NodeFS, node_path: str) -> bool:
    """True if the node path leads (inside the root) to something that is not a directory.

    A FIFO or a device counts: the linker would try to open it, so the probes report it
    (and refuse to read it) rather than pretend that nothing is there. Never raises.
    """
    try:
        return not stat.S_ISDIR(os.stat(fs.host(resolve(fs, node_path))).st_mode)
    except OSError:
        return False


def read_small(fs: NodeFS, node_path: str, limit: int) -> tuple[bytes, bool]:
    """At most ``limit`` bytes of a regular node file, and whether there was more."""
    f, _, _ = open_regular(fs, node_path)
    with f:
        data = f.read(limit + 1)
    return data[:limit], len(data) > limit


def join_path(d: str, name: str) -> str:
    return d.rstrip("/") + "/" + name if d != "/" else "/" + name


def glob(
    fs: NodeFS,
    pattern: str,
    errors: ErrorLog | None = None,
    probe: str = PROBE,
    field_: str = "",
    limit: int = MAX_GLOB_MATCHES,
) -> list[str]:
    """Existing node paths that match a shell glob, sorted, at most ``limit`` of them.

    Directories are walked with chroot-style symlink resolution. An unreadable directory
    or a link loop on the way is recorded in ``errors`` (naming the directory) and that
    branch is skipped; more than ``limit`` matches is recorded and cut to the first ones.
    """
    if not pattern.startswith("/"):
        if errors is not None:
            errors.add(probe, field_ or pattern, pattern, "not an absolute path")
        return []
    parts = [p for p in pattern.split("/") if p]
    current = ["/"]
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        nxt: list[str] = []
        for d in current:
            if not _is_magic(part):
                nxt.append(join_path(d, part))
                continue
            try:
                with os.scandir(fs.host(resolve(fs, d))) as it:
                    names = sorted(e.name for e in it)
            except OSError as e:
                if not isinstance(e, FileNotFoundError | NotADirectoryError) and errors:
                    errors.add(probe, field_ or pattern, d, e)
                continue
            hidden_ok = part.startswith(".")
            for n in names:
                if (hidden_ok or not n.startswith(".")) and fnmatch.fnmatchcase(n, part):
                    nxt.append(join_path(d, n))
        if len(nxt) > limit:
            if errors is not None:
                errors.add(probe, field_ or pattern, pattern,
                           f"matches more than {limit} paths; only the first {limit} are used")
            nxt = nxt[:limit]
        current = nxt
        if not last:
            current = [p for p in current if _lexists_dir(fs, p, errors, probe, field_)]
    return [p for p in current if _lexists(fs, p)]


def _is_magic(part: str) -> bool:
    return any(c in part for c in "*?[")


def _lexists(fs: NodeFS, node_path: str) -> bool:
    """The path's last component exists (a dangling or looping link counts), its parent
    directory resolved inside the root."""
    parent, _, name = node_path.rpartition("/")
    try:
        os.lstat(fs.host(join_path(resolve(fs, parent or "/"), name)))
        return True
    except (OSError, ValueError):
        return False


def _lexists_dir(
    fs: NodeFS, node_path: str, errors: ErrorLog | None, probe: str, field_: str
) -> bool:
    try:
        return stat.S_ISDIR(os.stat(fs.host(resolve(fs, node_path))).st_mode)
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno == errno.ELOOP and errors is not None:
            errors.add(probe, field_ or node_path, node_path, e)
        return False


# ---- ld.so.cache -------------------------------------------------------------------------


def _cstr(data: bytes, offset: int, source: str) -> str:
    if not 0 <= offset < len(data):
        raise LinkerError(f"{source}: string offset {offset} outside the file")
    end = data.find(b"\0", offset)
    if end < 0:
        raise LinkerError(f"{source}: unterminated string at offset {offset}")
    return data[offset:end].decode("utf-8", "surrogateescape")


def parse_ld_so_cache(data: bytes, source: str = LD_SO_CACHE) -> list[CacheEntry]:
    """The entries of an ``ld.so.cache``, in file order (the order the linker searches)."""
    start = 0
    if data.startswith(OLD_MAGIC):
        if len(data) < 16:
            raise LinkerError(f"{source}: truncated old-format header")
        (nlibs,) = struct.unpack_from("<I", data, 12)
        old_end = 16 + nlibs * _OLD_ENTRY.size
        if old_end > len(data):
            raise LinkerError(f"{source}: old-format table of {nlibs} entries is truncated")
        start = (old_end + 7) & ~7
        if not data.startswith(NEW_MAGIC, start):
            return _parse_old(data, nlibs, old_end, source)
    if not data.startswith(NEW_MAGIC, start):
        raise LinkerError(f"{source}: not an ld.so.cache (unknown magic)")
    if len(data) < start + _NEW_HEADER.size:
        raise LinkerError(f"{source}: truncated header")
    _, nlibs, _, _, _ = _NEW_HEADER.unpack_from(data, start)
    table = start + _NEW_HEADER.size
    if table + nlibs * _NEW_ENTRY.size > len(data):
        raise LinkerError(f"{source}: table of {nlibs} entries is longer than the file")
    strings = data[start:]  # new-format offsets count from the new header
    out = []
    for i in range(nlibs):
        flags, key, value, _, hwcap = _NEW_ENTRY.unpack_from(data, table + i * _NEW_ENTRY.size)
        out.append(CacheEntry(_cstr(strings, key, source), _cstr(strings, value, source),
                              flags, hwcap))
    return out


def _parse_old(data: bytes, nlibs: int, old_end: int, source: str) -> list[CacheEntry]:
    strings = data[old_end:]  # old-format offsets count from the end of the table
    out = []
    for i in range(nlibs):
        flags, key, value = _OLD_ENTRY.unpack_from(data, 16 + i * _OLD_ENTRY.size)
        out.append(CacheEntry(_cstr(strings, key, source), _cstr(strings, value, source),
                              flags, 0))
    return out


# ---- ld.so.conf --------------------------------------------------------------------------


def conf_dirs(fs: NodeFS, errors: ErrorLog, probe: str = PROBE) -> list[str]:
    """Directories named by ``/etc/ld.so.conf`` and its ``include`` files, in order."""
    dirs: list[str] = []
    seen: set[str] = set()
    _conf_file(fs, errors, probe, LD_SO_CONF, 0, dirs, seen, top=True)
    return dirs


def _conf_file(
    fs: NodeFS, errors: ErrorLog, probe: str, path: str, depth: int,
    dirs: list[str], seen: set[str], top: bool = False,
) -> None:
    if path in seen:
        return
    if len(seen) >= MAX_CONF_FILES:
        errors.add(probe, "ld.so.conf", path, f"more than {MAX_CONF_FILES} ld.so.conf files; "
                   "the rest are ignored")
        return
    seen.add(path)
    try:
        data, truncated = read_small(fs, path, MAX_CONF_BYTES)
    except FileNotFoundError:
        if not top:
            errors.add(probe, "ld.so.conf", path, "included file not found")
        return
    except OSError as e:
        errors.add(probe, "ld.so.conf", path, e)
        return
    if truncated:
        errors.add(probe, "ld.so.conf", path,
                   f"longer than {MAX_CONF_BYTES} bytes; the rest is ignored")
    here = path.rsplit("/", 1)[0] or "/"
    for raw in data.decode("utf-8", "replace").splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        word, _, rest = line.partition(" ")
        if word == "include" and rest.strip():
            if depth >= MAX_INCLUDE_DEPTH:
                errors.add(probe, "ld.so.conf", path,
                           f"includes nested deeper than {MAX_INCLUDE_DEPTH}; ignored")
                continue
            for pat in rest.split():
                pat = pat if pat.startswith("/") else join_path(here, pat)
                for inc in glob(fs, pat, errors, probe, "ld.so.conf"):
                    _conf_file(fs, errors, probe, inc, depth + 1, dirs, seen)
        elif word == "hwcap":
            continue
        else:
            d = line.split("=", 1)[0].strip().rstrip("/") or "/"
            if d.startswith("/") and d not in dirs:
                dirs.append(d)


# ---- the linker's view -------------------------------------------------------------------


@dataclass
class LinkerView:
    """The cache entries, the configured and the standard directories of one node."""

    fs: NodeFS
    cache: list[CacheEntry] | None  # None: no usable ld.so.cache
    conf: list[str]
    std: list[str]
    errors: ErrorLog | None = None
    probe: str = PROBE
    _listings: dict[str, list[str] | None] = field(default_factory=dict)

    @classmethod
    def load(cls, fs: NodeFS, errors: ErrorLog, probe: str = PROBE) -> LinkerView:
        cache: list[CacheEntry] | None = None
        try:
            data, truncated = read_small(fs, LD_SO_CACHE, MAX_CACHE_BYTES)
            if truncated:
                raise LinkerError(f"{LD_SO_CACHE}: larger than {MAX_CACHE_BYTES} bytes")
            cache = parse_ld_so_cache(data)
        except FileNotFoundError:
            pass
        except (OSError, LinkerError) as e:
            errors.add(probe, "ld.so.cache", LD_SO_CACHE, e)
        return cls(fs, cache, conf_dirs(fs, errors, probe), standard_dirs(), errors, probe)

    def _cache_matches(self, soname: str) -> list[str]:
        want = arch_flags()
        hits = [
            e for e in self.cache or []
            if e.soname == soname and (want is None or e.flags == want)
        ]
        hits.sort(key=lambda e: e.hwcap != 0)  # the plain entry before glibc-hwcaps ones
        return [e.path for e in hits]

    def lookup(self, name: str) -> str | None:
        """The node path that ``dlopen(name)`` would open, as far as files tell; or None.

        A name with a ``/`` is a path. Otherwise the cache first (an entry whose file is
        gone falls through, as in glibc), then the standard directories.
        """
        if "/" in name:
            return name if name.startswith("/") and is_file(self.fs, name) else None
        for p in self._cache_matches(name):
            if is_file(self.fs, p):
                return p
        for d in self.std:
            p = join_path(d, name)
            if is_file(self.fs, p):
                return p
        return None

    def dirs(self) -> list[str]:
        """Every directory the linker searches: cached libraries' dirs, conf dirs, standard."""
        out: dict[str, None] = {}  # ordered, and a set: ld.so.cache has thousands
        for e in self.cache or []:
            out.setdefault(e.path.rsplit("/", 1)[0] or "/")
        for d in [*self.conf, *self.std]:
            out.setdefault(d)
        return list(out)

    def listing(self, d: str) -> list[str] | None:
        """Sorted entry names of a directory (memoised), None if not listable.

        A missing directory is normal; any other failure (EACCES, ELOOP) is recorded once.
        """
        if d not in self._listings:
            try:
                with os.scandir(self.fs.host(resolve(self.fs, d))) as it:
                    self._listings[d] = sorted(e.name for e in it)
            except OSError as e:
                self._listings[d] = None
                if not isinstance(e, FileNotFoundError | NotADirectoryError) and self.errors:
                    self.errors.add(self.probe, "linker.dirs", d, e)
        return self._listings[d]

    def find(self, name_glob: str) -> list[str]:
        """Node paths in the linker's directories whose name matches ``name_glob``."""
        out: dict[str, None] = {}  # ordered, and a set: a list here was quadratic
        for d in self.dirs():
            for n in self.listing(d) or []:
                if fnmatch.fnmatchcase(n, name_glob):
                    out.setdefault(join_path(d, n))
        return list(out)
