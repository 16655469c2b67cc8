"""The node's filesystem as seen through ``--root``, and the probe error log.

Every probe takes a :class:`NodeFS`. ``NodeFS("/")`` is the real node; tests and the
demo hand in a directory tree laid out like one. Reads either return a value or
record an error for that one field and return ``None``: one unreadable file costs
one field, never the device or the node.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from ncclguard.fileowner import kind as file_kind
from ncclguard.fingerprint.shape import ProbeError

MAX_SMALL_READ = 64 * 1024  # sysfs/procfs attributes are tiny; never read more
MAX_SYMLINKS = 40  # as the kernel's own limit (ELOOP)


#: Called now and then while a long file is read (``ncclguard-inventoryd run`` sets it to
#: pet systemd's watchdog): a collection that reads gigabytes makes progress, a hung one
#: does not, and the watchdog can tell them apart.
progress: ContextVar[Callable[[], object] | None] = ContextVar("progress", default=None)


class TimeLimit(Exception):
    """Raised by a :data:`progress` callback whose reader's deadline has passed (an
    image's: :meth:`inventoryd.controller.images.tree.ImageTree.analyze`): never taken
    for a malformed file (:class:`inventoryd.elf.ElfReader` lets it through)."""

MAX_LIBRARY_BYTES = 2 << 30  # a real libnccl is 0.2-0.6 GiB, a plugin far less
READ_BUDGET_BYTES = 8 << 30  # library bytes one collection reads at most (cache misses)
#: What is left of this collection's read budget (``collect()`` sets it): files that
#: others can touch (a conda env on a search path) are read again after each change.
read_budget: ContextVar[list[int] | None] = ContextVar("read_budget", default=None)


def library_unreadable(f: BinaryIO) -> tuple[int, str | None]:
    """``(size, why it is not read)`` of an open file named like a library, or
    ``(size, None)`` to read it: larger than any library, not ELF (only a library is
    hashed), or past this collection's read budget. An empty file is the caller's."""
    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    if size > MAX_LIBRARY_BYTES:
        return size, f"{size} bytes, more than any library ({MAX_LIBRARY_BYTES}); not read"
    head = f.read(4)
    f.seek(0)
    if size and head != b"\x7fELF":
        return size, "not an ELF file (no ELF magic); not read"
    left = read_budget.get()
    if left is not None:
        if size > left[0]:  # raised, so that the file cache does not keep this answer
            raise BudgetSpent(f"this collection already read {READ_BUDGET_BYTES} bytes of "
                              "libraries; the next one reads this file")
        left[0] -= size
    return size, None


class BudgetSpent(OSError):
    """This collection's read budget is spent: the file is read by a later one."""


@dataclass
class ErrorLog:
    """The fingerprint's ``errors`` list: what could not be read, and why."""

    entries: list[ProbeError] = field(default_factory=list)

    def add(self, probe: str, field_: str, path: str | None, error: BaseException | str) -> None:
        if isinstance(error, OSError) and error.strerror:
            text = f"[Errno {error.errno}] {error.strerror}"
        else:
            text = str(error) or type(error).__name__
        self.entries.append({"probe": probe, "field": field_, "path": path, "error": text})

    def for_probe(self, probe: str) -> list[ProbeError]:
        return [e for e in self.entries if e["probe"] == probe]


class NodeFS:
    """Root-prefixed access to one node's files. Node paths are absolute (``/sys/...``)."""

    def __init__(self, root: str | os.PathLike[str] = "/") -> None:
        self.root = Path(root)

    def host(self, node_path: str | os.PathLike[str]) -> Path:
        """The path on this machine for a node path: ``/sys/x`` -> ``<root>/sys/x``."""
        p = str(node_path)
        if not p.startswith("/"):
            raise ValueError(f"node paths are absolute: {p!r}")
        return self.root / p.lstrip("/") if str(self.root) != "/" else Path(p)

    def node(self, host_path: str | os.PathLike[str]) -> str:
        """The node path for a path on this machine (the inverse of :meth:`host`)."""
        p = Path(host_path)
        if str(self.root) == "/":
            return str(p)
        try:
            return "/" + str(p.relative_to(self.root))
        except ValueError:
            return str(p)

    def _open_regular(self, node_path: str) -> int:
        """Open a node file for reading without ever blocking; only regular files pass.

        ``O_NONBLOCK`` makes opening a FIFO return at once (a plain open would wait for a
        writer forever); the ``fstat`` check then refuses it, like sockets and devices
        (``/dev/zero`` linked in as a config file must not be read). A directory gives
        EISDIR. sysfs and procfs attributes are regular files, so they pass.
        """
        fd = os.open(self.host(node_path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
            if not stat.S_ISREG(mode):
                kind = file_kind(mode)
                raise OSError(f"not a regular file ({kind})")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_bytes(
        self,
        node_path: str,
        limit: int,
        errors: ErrorLog | None = None,
        probe: str = "",
        field_: str = "",
        missing_ok: bool = True,
    ) -> tuple[bytes, bool] | None:
        """Read at most ``limit`` bytes: ``(data, truncated)``; ``None`` as in :meth:`read_text`.

        ``truncated`` is true when the file holds more than ``limit`` bytes; the rest is
        never read, so a huge or endless file costs bounded time and memory.
        """
        try:
            fd = self._open_regular(node_path)
            try:
                chunks: list[bytes] = []
                left = limit + 1  # one byte more tells "exactly limit" from "longer"
                while left > 0:
                    chunk = os.read(fd, min(left, 1 << 20))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    left -= len(chunk)
            finally:
                os.close(fd)
        except FileNotFoundError as e:
            if not missing_ok and errors is not None:
                errors.add(probe, field_ or node_path, node_path, e)
            return None
        except OSError as e:
            if errors is not None:
                errors.add(probe, field_ or node_path, node_path, e)
            return None
        data = b"".join(chunks)
        return data[:limit], len(data) > limit

    def read_text(
        self,
        node_path: str,
        errors: ErrorLog | None = None,
        probe: str = "",
        field_: str = "",
        missing_ok: bool = True,
    ) -> str | None:
        """Read a small text attribute, stripped of its trailing newline.

        A missing file returns ``None`` (and records an error only if ``missing_ok`` is
        false). Any other failure (EINVAL from a driver, EACCES, EISDIR, a FIFO or a
        device where a file belongs, bad UTF-8) records an error naming the file and
        returns ``None``. At most :data:`MAX_SMALL_READ` bytes are read.
        """
        got = self.read_bytes(node_path, MAX_SMALL_READ, errors, probe, field_, missing_ok)
        if got is None:
            return None
        try:
            return got[0].decode("utf-8").rstrip("\n")
        except UnicodeDecodeError as e:
            if errors is not None:
                errors.add(probe, field_ or node_path, node_path, f"not UTF-8 text: {e}")
            return None

    def list_dir(
        self,
        node_path: str,
        errors: ErrorLog | None = None,
        probe: str = "",
        field_: str = "",
        missing_ok: bool = True,
    ) -> list[str] | None:
        """The sorted entry names of a node directory, or ``None``.

        A missing directory returns ``None`` (an error only if ``missing_ok`` is false).
        Any other failure (a file where a directory belongs: ENOTDIR; a symlink loop:
        ELOOP; a dangling link) records an error naming the directory.
        """
        try:
            with os.scandir(self.host(node_path)) as it:
                return sorted(e.name for e in it)
        except FileNotFoundError as e:
            if not missing_ok and errors is not None:
                errors.add(probe, field_ or node_path, node_path, e)
            return None
        except OSError as e:
            if errors is not None:
                errors.add(probe, field_ or node_path, node_path, e)
            return None

    def exists(self, node_path: str) -> bool:
        """True if the node path exists (links followed); never raises."""
        try:
            return self.host(node_path).exists()
        except OSError:
            return False

    def is_dir(self, node_path: str) -> bool:
        try:
            return self.host(node_path).is_dir()
        except OSError:
            return False

    def resolve(self, node_path: str, strict: bool = False,
                visit: Callable[[str, os.stat_result], None] | None = None) -> str:
        """The node path with every symlink resolved *inside the node root*.

        An absolute link target is taken relative to the root (as on the node itself),
        and ``..`` never climbs above it. More than :data:`MAX_SYMLINKS` links raise
        ``OSError(ELOOP)``, so a loop is an error and never a hang.

        ``strict=False`` keeps missing components as they are (like ``realpath -m``);
        ``strict=True`` raises ENOENT for a missing component and ENOTDIR for a
        non-directory in the middle of the path. ``visit(node path, lstat)`` is called on
        every component that is not a link, as it is reached (a check that raises stops
        the resolution: the containers probe's trust of every directory on the way).
        """
        if not node_path.startswith("/"):
            raise ValueError(f"node paths are absolute: {node_path!r}")
        todo = [c for c in node_path.split("/") if c]
        todo.reverse()  # a stack: the next component is last
        done: list[str] = []
        hops = 0
        while todo:
            part = todo.pop()
            if part == ".":
                continue
            if part == "..":
                if done:
                    done.pop()
                continue
            candidate = "/" + "/".join([*done, part])
            try:
                st = os.lstat(self.host(candidate))
            except OSError:
                if strict:
                    raise
                done.append(part)  # not there: keep the name
                continue
            if not stat.S_ISLNK(st.st_mode):
                if strict and todo and not stat.S_ISDIR(st.st_mode):
                    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), candidate)
                if visit is not None:
                    visit(candidate, st)
                done.append(part)
                continue
            hops += 1
            if hops > MAX_SYMLINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), node_path)
            target = os.readlink(self.host(candidate))
            if target.startswith("/"):
                done = []
            todo.extend(reversed([c for c in target.split("/") if c]))
        return "/" + "/".join(done)
