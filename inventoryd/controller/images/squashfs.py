"""Read a squashfs image without mounting it, without root, and without trusting it.

Every image under an admin's root may have been built by a user, so every image is
hostile input. Nothing in it is ever executed or loaded: squashfs-tools' ``unsquashfs``
(GPL, a separate process; an AGPL reader may not become a dependency) lists it
(``-lln``) and streams single files out of it (``-cat``), each run with an argument list
(never a shell), a deadline, a memory limit and a bound on what it may print.

What this module adds:

- **The listing is parsed against a random prefix** (``-d /<token>``): a file name that
  holds a newline cannot forge an entry, because it cannot know the token. It is parsed
  as unsquashfs prints it (:class:`_Listing`), one line at a time: what is held is what
  is kept, never the listing (issue 48: 126 MiB of long paths was held three times).
- **Symlinks are resolved here, inside the image**: an absolute target restarts at the
  image's root, ``..`` never climbs above it, and at most :data:`MAX_HOPS` links are
  followed (one squashfs library's own resolver looped for ever on a loop).
- **Bounds**, each a clear :class:`ImageError` naming the image and the cause: entries
  listed, listing bytes, tree depth, name length, the size of a file streamed out, what
  may be streamed out in all (from what the image file holds: :func:`image_bytes`), and
  the time of the whole image (checked in every loop, with the collector's SIGTERM).
- **Opened by descriptor** (:func:`open_image`): the index opens an image from its root
  without following a symlink, checks it is the file its walk saw, and unsquashfs reads
  that descriptor.

Only the entries the fingerprint can use are kept (directories, symlinks, and files whose
names :func:`wanted` accepts), so a 1 GB image with 100,000 files costs a few MB. Every
directory is kept (any one may be a search directory, a symlink's step or pip's): at
most :data:`MAX_ENTRIES`, their paths within :data:`MAX_LISTING_BYTES`, about 200 MB at
worst (500,000 directories of 180-byte paths; 137 MB for 34,000 of 3.8 KB).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import secrets
import select
import shutil
import stat
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import IO

from inventoryd.controller.images.tree import (
    MAX_HOPS,
    Entry,
    ImageError,
    ImagePathError,
    ImageStopped,
    ImageTree,
)

__all__ = ["MAX_HOPS", "Entry", "ImageError", "ImagePathError", "SquashImage", "wanted"]

MAX_ENTRIES = 500_000  # entries listed (all of them, kept or not)
MAX_LISTING_BYTES = 128 << 20  # what unsquashfs -lln may print
MAX_DEPTH = 64  # directories below the image's root
MAX_NAME = 255  # bytes of one name (squashfs's own limit is 256)
MAX_PATH = 4096
#: a listing line, or an entry, longer than this is cut and an odd name (skipped and
#: counted): a symlink's path and target of MAX_PATH each with " -> " between them, and
#: room for the fields before them (about 100 bytes)
LINE_CAP = 2 * MAX_PATH + 4 + 512
MAX_FILE_BYTES = 2 << 30  # a file streamed out: as the node probe's MAX_LIBRARY_BYTES
CHILD_MEMORY_BYTES = 1 << 30  # address space of unsquashfs (RLIMIT_AS)
#: unsquashfs's data and fragment queues, in MB (-da, -fr; 256 each by default): its peak
#: RSS streaming a 290 MB libnccl out of a 0.9 GB zstd image went from 268 MB to 13 MB,
#: and 0.49 s to 0.35 s (squashfs-tools 4.5.1)
QUEUE_MB = 8
TIMEOUT_S = 30.0  # one image, listing and every file together
MAX_READ_BYTES = 3 << 30  # streamed out of one image in all (the libnccl a job loads first)
#: at most this many times the image file's own size is streamed out of it: a real
#: libnccl compresses about 1.5x (the 2.21.5 wheel: 290 MB in 200 MB), so a member
#: larger than 64x the whole image is mostly sparse or zeros, never a library
MAX_EXPANSION = 64
STDERR_KEEP = 4096
#: a squashfs 4 superblock: ``bytes_used``, the image's length, is the u64 at byte 40
SUPERBLOCK_BYTES = 96

_ALLOWED_NAME = re.compile(r"[\x20-\x7e]+")


def wanted(name: str) -> bool:
    """The file names the image fingerprint reads (everything else is only counted)."""
    return (name.startswith("libnccl") or name in ("nccl.conf", "environment", "rc",
                                                   "ld.so.conf") or name.endswith(".conf"))


def image_bytes(path: str, fd: int | None = None) -> int:
    """What an image file holds, for its read bound: the least of its size, the blocks it
    has on disk (``st_blocks``) and its superblock's ``bytes_used`` (the image proper).
    ``truncate -s 64G`` on a small image made its ``st_size`` claim 64 GiB: 2 GiB were
    streamed out of it, and written to the controller's tmp, each pass (issue 48)."""
    own = fd is None
    if fd is None:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        n = st.st_size
        if st.st_blocks:  # 0 on a file system that does not count blocks: the size
            n = min(n, st.st_blocks * 512)
        head = os.pread(fd, SUPERBLOCK_BYTES, 0)
    finally:
        if own:
            os.close(fd)
    if len(head) >= SUPERBLOCK_BYTES and head[:4] in (b"hsqs", b"sqsh"):
        order = "<" if head[:4] == b"hsqs" else ">"
        n = min(n, struct.unpack_from(order + "Q", head, 40)[0])
    return n


def open_image(root: str, path: str, expect: os.stat_result) -> int:
    """A descriptor of the image at ``path`` under ``root``, opened from the root one
    component at a time with ``O_NOFOLLOW`` (a directory swapped for a symlink after the
    walk is refused, not followed to a decoy), and checked to be the file the walk saw
    (``expect``: its device and inode). Raises ImageError naming the cause."""
    rel = os.path.relpath(path, root)
    parts = rel.split(os.sep)
    if rel.startswith("..") or not parts or "" in parts:
        raise ImageError(path, f"not under the root {root}")
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        d = os.open(root, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY)
    except OSError as e:
        raise ImageError(path, f"cannot open the root {root}: {e.strerror or e}") from None
    try:
        for part in parts[:-1]:
            try:
                nd = os.open(part, flags | os.O_DIRECTORY, dir_fd=d)
            except OSError as e:
                raise ImageError(path, f"{part}: {_open_error(e)}; read again at the next "
                                       "pass") from None
            os.close(d)
            d = nd
        try:
            fd = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=d)
        except OSError as e:
            raise ImageError(path, f"{_open_error(e)}; read again at the next pass") from None
    finally:
        os.close(d)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (expect.st_dev, expect.st_ino) or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ImageError(path, "replaced by another file between the walk and the read; "
                               "read again at the next pass")
    return fd


def _open_error(e: OSError) -> str:
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return "a symlink (or not a directory) in its path since the walk: not followed"
    return f"cannot open: {e.strerror or e}"


def unsquashfs_path(configured: str = "") -> str:
    """The unsquashfs program: the configured one, else the first on PATH, else /usr/bin."""
    if configured:
        return configured
    return shutil.which("unsquashfs") or "/usr/bin/unsquashfs"


def _limit_child(memory: int) -> Callable[[], None]:
    def apply() -> None:  # runs in the child, between fork and exec
        # under the collector's unit these apply: it filters @resources, but glibc's
        # setrlimit() calls prlimit64, which the filter lets through (shown under systemd,
        # tests/test_install_systemd.py). Where a limit is refused, systemd's own limits
        # apply, and the deadline and output bounds still hold
        for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CORE, 0)):
            with contextlib.suppress(OSError, ValueError):
                resource.setrlimit(limit, (value, value))
    return apply


class SquashImage(ImageTree):
    """One image, listed once; ``resolve``, ``children``, ``copy_file`` read inside it."""

    def __init__(
        self,
        path: str,
        *,
        deadline: float | None = None,
        unsquashfs: str = "",
        keep: Callable[[str], bool] = wanted,
        max_entries: int = MAX_ENTRIES,
        max_depth: int = MAX_DEPTH,
        max_file_bytes: int = MAX_FILE_BYTES,
        child_memory: int = CHILD_MEMORY_BYTES,
        timeout_s: float = TIMEOUT_S,
        max_read_bytes: int = MAX_READ_BYTES,
        stop: Callable[[], bool] | None = None,
        fd: int | None = None,
    ) -> None:
        # what may still be streamed out of this image (copy_file): the work one image
        # may cost is bounded by its own size, not by what its listing claims
        # ``fd``: the image opened by the caller (:func:`open_image`): unsquashfs reads
        # that file through /proc/self/fd, whatever ``path`` names by then
        self.fd = fd
        self.source = path if fd is None else f"/proc/self/fd/{fd}"
        self.read_left = min(max_read_bytes, MAX_EXPANSION * image_bytes(path, fd) + (1 << 20))
        self.program = unsquashfs_path(unsquashfs)
        self.keep = keep
        self.max_entries = max_entries
        self.max_depth = max_depth
        self.max_file_bytes = max_file_bytes
        self.child_memory = child_memory
        super().__init__(path, stop=stop, deadline=deadline if deadline is not None
                         else time.monotonic() + timeout_s)
        self.listed = 0  # every entry of the image, kept or not
        self.odd_names = 0  # names with control characters or over MAX_NAME: skipped
        self.deepest = 0
        self._list()

    # ---- running unsquashfs ----------------------------------------------------------

    def _run(self, args: list[str], sink: Callable[[bytes], object], limit: int,
             what: str) -> None:
        """Run unsquashfs; each chunk of its stdout goes to ``sink`` as it is read (a
        file's ``write``, the listing's parser: nothing is held here), at most ``limit``
        bytes, before the deadline. Raises ImageError with the cause (what ``sink``
        raises ends the run too)."""
        cmd = [self.program, *args]
        with tempfile.TemporaryFile() as err:
            try:
                p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=err, env={"PATH": os.defpath, "LC_ALL": "C"},
                                     pass_fds=() if self.fd is None else (self.fd,),
                                     preexec_fn=_limit_child(self.child_memory))
            except OSError as e:
                raise ImageError(self.path, f"cannot run {self.program}: "
                                            f"{e.strerror or e}") from None
            assert p.stdout is not None
            total = 0
            fd = p.stdout.fileno()
            try:
                while True:
                    ready, _, _ = select.select([fd], [], [], min(self.left(), 1.0))
                    if not ready:
                        continue
                    chunk = os.read(fd, 1 << 20)
                    if not chunk:
                        break
                    total += len(chunk)
                    if total > limit:
                        raise ImageError(self.path, f"{what}: more than {limit} bytes")
                    sink(chunk)
                rc = p.wait(timeout=max(0.1, self.left()))
            except subprocess.TimeoutExpired:
                raise ImageError(self.path, f"{what}: time limit reached") from None
            except ImageStopped:
                raise
            except ImageError as e:
                if e.cause == "time limit reached":
                    raise ImageError(self.path, f"{what}: time limit reached") from None
                raise
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                p.stdout.close()
            if rc != 0:
                err.seek(0, os.SEEK_END)
                err.seek(max(0, err.tell() - STDERR_KEEP))
                tail = err.read().decode("utf-8", "replace").strip().splitlines()
                cause = tail[-1] if tail else f"exit status {rc}"
                if rc < 0:
                    cause = f"killed by signal {-rc} ({cause})"
                raise ImageError(self.path, f"{what}: unsquashfs failed: {_printable(cause)}")

    # ---- the listing -----------------------------------------------------------------

    def _list(self) -> None:
        token = "/ncg" + secrets.token_hex(12)
        args = ["-no-progress", "-da", str(QUEUE_MB), "-fr", str(QUEUE_MB), "-UTC", "-d", token,
                "-max-depth", str(self.max_depth + 1),
                "-lln", self.source]
        listing = _Listing(token, self._add, self.check)
        self._run(args, listing.feed, MAX_LISTING_BYTES, "listing")
        listing.close()
        if not self.entries.get("/", Entry("", 0)).kind == "d":
            raise ImageError(self.path, "listing: no root directory (not a squashfs image?)")

    def _add(self, kind_b: bytes, size_b: bytes, rest: bytes, cut: bool = False) -> None:
        """One entry of the listing, kept if the fingerprint can use it (``cut``: longer
        than :data:`LINE_CAP`, only counted as an odd name)."""
        self.listed += 1
        if self.listed > self.max_entries:
            raise ImageError(self.path, f"more than {self.max_entries} entries")
        if cut:
            self.odd_names += 1
            return
        kind = kind_b.decode()
        size = int(size_b) if size_b.isdigit() else 0
        target = None
        if kind == "l":  # "name -> target", the size is the target's length
            sep = len(rest) - size - 4
            if size == 0 or sep < 0 or rest[sep : sep + 4] != b" -> ":
                self.odd_names += 1
                return
            rest, target_b = rest[:sep], rest[sep + 4 :]
            target = target_b.decode("utf-8", "surrogateescape")
            if not _ALLOWED_NAME.fullmatch(target) or len(target) > MAX_PATH:
                self.odd_names += 1
                return
        path = rest.decode("utf-8", "surrogateescape") or "/"
        name = path.rsplit("/", 1)[-1]
        if path != "/" and (not _ALLOWED_NAME.fullmatch(path) or len(name) > MAX_NAME
                            or len(path) > MAX_PATH):
            self.odd_names += 1
            return
        depth = path.count("/") if path != "/" else 0
        if depth > self.max_depth:
            raise ImageError(self.path, f"directory tree deeper than {self.max_depth} levels "
                                        f"(at {_printable(path[:200])}...)")
        self.deepest = max(self.deepest, depth)
        if kind == "d":
            self.entries[path] = Entry("d", 0)
            self.dirs.setdefault(path, [])
        elif kind == "l" or self.keep(name):
            self.entries[path] = Entry(kind, size, target)
            if path != "/":
                self.dirs.setdefault(path.rsplit("/", 1)[0] or "/", []).append(name)

    # ---- reading inside the image ----------------------------------------------------

    def copy_file(self, path: str, out: IO[bytes], limit: int | None = None) -> tuple[str, int]:
        """Stream one regular file (symlinks resolved here) into ``out``; returns its real
        path and size. At most ``limit`` (or ``max_file_bytes``) bytes."""
        real = self.resolve(path)
        e = self.entries.get(real)
        if e is None or e.kind != "-":
            raise ImagePathError(self.path, f"{path}: not a regular file")
        bound = self.max_file_bytes if limit is None else limit
        if e.size > bound:
            raise ImagePathError(self.path, f"{path}: {e.size} bytes, more than {bound}; "
                                            "not read")
        if e.size > self.read_left:
            raise ImagePathError(self.path, f"{path}: {e.size} bytes, more than the "
                                 f"{self.read_left} left of this image's read budget "
                                 f"(at most {MAX_EXPANSION}x its size, "
                                 "images.max_read_bytes); not read")
        self.read_left -= e.size
        self._run(["-no-progress", "-no-wildcards", "-da", str(QUEUE_MB), "-fr", str(QUEUE_MB),
                   "-cat", self.source, real.lstrip("/")],
                  out.write, e.size, f"reading {real}")
        if out.tell() != e.size:
            raise ImagePathError(self.path, f"{real}: {out.tell()} of {e.size} bytes read "
                                            "(truncated image?)")
        return real, e.size

    def read_small(self, path: str, limit: int = 64 * 1024) -> bytes:
        with tempfile.TemporaryFile() as f:
            self.copy_file(path, f, limit)
            f.seek(0)
            return f.read()


class _Listing:
    """``unsquashfs -lln``'s output parsed as it streams, one line at a time: only the
    entry being read and one line are held, never the listing (34,000 paths of 3.8 KB,
    126 MiB of listing, was held three times over: 398 MB; issue 48). A line that does
    not match the pattern is the rest of the previous entry (a name holding a newline).

    A line, or an entry, longer than :data:`LINE_CAP` is cut there and the entry is an
    odd name (``_add(..., cut=True)``): its path or its symlink target is over
    :data:`MAX_PATH`, which ``_add`` skips anyway."""

    def __init__(self, token: str, add: Callable[[bytes, bytes, bytes, bool], None],
                 check: Callable[[], None]) -> None:
        self.pattern = re.compile(
            rb"(?P<kind>[-dlbcps])[-rwxsStT]{9} \d+/\d+ +(?P<size>\d+|\d+, *\d+) "
            rb"\d{4}-\d\d-\d\d \d\d:\d\d " + re.escape(token.encode()) + rb"(?P<rest>/.*)?")
        self.add = add
        self.check = check
        self.lines = 0
        self.partial = bytearray()  # the line not ended yet, at most LINE_CAP bytes
        self.partial_cut = False
        self.current: tuple[bytes, bytes, bytearray] | None = None  # kind, size, rest
        self.current_cut = False

    def feed(self, chunk: bytes) -> None:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            stop = len(chunk) if end < 0 else end
            piece = chunk[start : min(stop, start + LINE_CAP)]
            cut = start + LINE_CAP < stop
            if self.partial or end < 0:
                cut = _append(self.partial, piece) or cut or self.partial_cut
                if end < 0:
                    self.partial_cut = cut
                    return
                piece = bytes(self.partial)
                self.partial.clear()
                self.partial_cut = False
            self._line(piece, cut)
            start = end + 1

    def close(self) -> None:
        """The end of the listing: its last line (unless it ended with a newline) and
        the last entry."""
        if self.partial:
            self._line(bytes(self.partial), self.partial_cut)
            self.partial.clear()
        self._flush()

    def _line(self, raw: bytes, cut: bool) -> None:
        if self.lines % 4096 == 0:
            self.check()
        self.lines += 1
        m = self.pattern.fullmatch(raw)
        if m is None:  # a name holding a newline: the rest of the previous entry
            if self.current is not None:
                self.current_cut = _append(self.current[2], b"\n" + raw) or cut or \
                    self.current_cut
            return
        self._flush()
        self.current = (m.group("kind"), m.group("size"), bytearray(m.group("rest") or b""))
        self.current_cut = cut

    def _flush(self) -> None:
        if self.current is not None:
            kind, size, rest = self.current
            self.current = None
            self.add(kind, size, bytes(rest), self.current_cut)


def _append(buf: bytearray, data: bytes) -> bool:
    """``data`` added to ``buf``, kept to at most LINE_CAP bytes: whether it was cut."""
    room = LINE_CAP - len(buf)
    buf += data[: max(room, 0)]
    return len(data) > room


def _printable(text: str) -> str:
    return text if _ALLOWED_NAME.fullmatch(text) else repr(text)
