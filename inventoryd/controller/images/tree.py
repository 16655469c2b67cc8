"""The file tree of an image as the fingerprint reads it (:mod:`.fingerprint`): the
entries kept (directories, symlinks, the files it can use), symlinks resolved inside the
image, and each file analysed once. A squashfs file (:mod:`.squashfs`) and a registry
image's layers (:mod:`.layers`) are both read through it.

Symlinks are resolved here, inside the image: an absolute target restarts at the image's
root, ``..`` never climbs above it, and at most :data:`MAX_HOPS` links are followed.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, BinaryIO

MAX_HOPS = 40  # as the kernel's ELOOP limit
CHECK_EVERY = 1024  # cheap steps between two checks of the deadline and stop (tick)

#: an analysis of one file: (open file, label) -> facts (the node probes' analyze())
Analyzer = Callable[[BinaryIO, str], Any]


class ImageError(Exception):
    """An image that cannot be read within the bounds: the message names the image and
    the cause."""

    def __init__(self, image: str, cause: str) -> None:
        super().__init__(f"{image}: {cause}")
        self.image = image
        self.cause = cause


class ImageTransient(ImageError):
    """A read cut short by the network or the clock, not by the image's content (a
    registry layer's connection failed, the time limit): tried again, never stored as
    what the image is."""


class ImageUnverified(ImageTransient):
    """A blob whose bytes are not its digest's (or that runs past its descriptor's size):
    what one registry served, not what the image is; that registry's failure, tried again
    after a back-off, never stored as the digest's content (issue 41: a hostile registry
    serving an honest digest with garbage)."""


class ImagePathError(ImageError):
    """One path inside a readable image is missing, not a file, or loops."""


class ImageStopped(ImageTransient):
    """The collector is stopping (SIGTERM): the read was given up, nothing is stored."""


@dataclass(frozen=True, slots=True)
class Entry:
    kind: str  # "d" directory, "l" symlink, "-" regular file, others as ls prints them
    size: int
    target: str | None = None  # a symlink's target


class ImageTree:
    """``entries`` (path -> Entry) and ``dirs`` (directory -> the names kept in it), filled
    by the subclass; ``copy_file`` and ``read_small`` are the subclass's.

    ``deadline`` (``time.monotonic()``; None: none) bounds the whole image and ``stop``
    is the collector's "stop now?" (SIGTERM), one home for a squashfs image and a
    registry image's union alike: every loop over the tree (the subclass's own reading
    of it, the fingerprint's, a link's resolution) calls :meth:`check` (or :meth:`tick`),
    and a file's analysis runs with a :data:`inventoryd.nodefs.progress` callback that
    checks it too (issue 48)."""

    def __init__(self, path: str, *, deadline: float | None = None,
                 stop: Callable[[], bool] | None = None) -> None:
        self.path = path  # what the image is called in messages
        self.deadline = deadline
        self.stop = stop
        self.entries: dict[str, Entry] = {}
        self.dirs: dict[str, list[str]] = {}
        self.listed = 0  # every entry of the image, kept or not
        self.odd_names = 0  # names with control characters or over the bounds: skipped
        self.memo: dict[tuple[str, Any], Any] = {}  # (real path, analyzer) -> its result
        self._ticks = 0

    def left(self) -> float:
        """What is left of the deadline (``inf``: none). Raises ImageStopped once the
        collector is asked to stop, ImageError ``time limit reached`` at the deadline."""
        if self.stop is not None and self.stop():
            raise ImageStopped(self.path, "not read: the collector is stopping")
        if self.deadline is None:
            return math.inf
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ImageError(self.path, "time limit reached")
        return left

    def check(self) -> None:
        """Raise ImageError ``time limit reached`` once the image's deadline has passed,
        ImageStopped once the collector is asked to stop."""
        self.left()

    def tick(self) -> None:
        """:meth:`check` once every :data:`CHECK_EVERY` calls: for a loop of cheap steps."""
        self._ticks += 1
        if self._ticks >= CHECK_EVERY:
            self._ticks = 0
            self.check()

    def resolve(self, path: str) -> str:
        """The path inside the image that ``path`` names, with every symlink followed
        inside the image. Raises ImagePathError (missing, not a directory, a loop)."""
        todo = [p for p in reversed(path.split("/")) if p]
        done: list[str] = []
        hops = 0
        while todo:
            part = todo.pop()
            if part == ".":
                continue
            if part == "..":
                if done:
                    done.pop()  # never above the image's root
                continue
            here = "/" + "/".join([*done, part])
            e = self.entries.get(here)
            if e is None:
                raise ImagePathError(self.path, f"{path}: no such file in the image")
            if e.kind == "l":
                # a link's target may hold 2,048 components: the deadline at each hop
                self.check()
                hops += 1
                if hops > MAX_HOPS:
                    raise ImagePathError(self.path, f"{path}: more than {MAX_HOPS} symlinks "
                                                    "(a loop?)")
                assert e.target is not None
                if e.target.startswith("/"):
                    done = []
                todo.extend(p for p in reversed(e.target.split("/")) if p)
                continue
            if todo and e.kind != "d":
                raise ImagePathError(self.path, f"{path}: {here} is not a directory")
            done.append(part)
        return "/" + "/".join(done)

    def entry(self, path: str) -> Entry | None:
        try:
            return self.entries.get(self.resolve(path))
        except ImagePathError:
            return None

    def is_dir(self, path: str) -> bool:
        e = self.entry(path)
        return e is not None and e.kind == "d"

    def children(self, directory: str) -> list[str]:
        """The kept names in a directory (after resolving it), sorted."""
        try:
            real = self.resolve(directory)
        except ImagePathError:
            return []
        return sorted(self.dirs.get(real, []))

    def directories(self) -> Iterator[str]:
        return iter(self.dirs)

    def copy_file(self, path: str, out: IO[bytes], limit: int | None = None) -> tuple[str, int]:
        raise NotImplementedError

    def read_small(self, path: str, limit: int = 64 * 1024) -> bytes:
        raise NotImplementedError

    def analyze(self, path: str, analyze: Analyzer, tmpdir: str) -> tuple[str, Any]:
        """(real path, facts) of one file, each real file analysed once: streamed out
        into an unlinked temporary file and read there."""
        from inventoryd.nodefs import TimeLimit, progress

        real = self.resolve(path)
        if (real, analyze) in self.memo:
            return real, self.memo[real, analyze]
        with tempfile.TemporaryFile(dir=tmpdir) as f:
            real, _ = self.copy_file(path, f)
            f.seek(0)
            outer = progress.get()

            def tick() -> None:  # the analysis of one file is under the image's deadline
                try:
                    self.check()
                except ImageError:
                    raise TimeLimit(f"{self.path}:{real}") from None
                if outer is not None:
                    outer()

            token = progress.set(tick)
            try:
                self.memo[real, analyze] = facts = analyze(f, f"{self.path}:{real}")
            except TimeLimit:
                self.check()  # stopping: ImageStopped
                raise ImageError(self.path, f"analysing {real}: time limit reached") from None
            finally:
                progress.reset(token)
            return real, facts
