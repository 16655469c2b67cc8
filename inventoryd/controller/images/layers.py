"""A registry image's layers, read as a stream, once each, and their union.

:func:`read_layer` reads one layer blob (gzip, zstd or plain tar) member by member
(:mod:`.tar`) and keeps its **summary**: the entries the fingerprint can use
(directories, symlinks, hard links, whiteouts, and the files whose names
:func:`~.squashfs.wanted` accepts), the small configuration files it reads
(``/etc/environment``, ``/etc/rc``, ``/etc/nccl.conf``, the linker's ``ld.so.conf``
files), and the facts of every ``libnccl*`` file, analysed as it streams past by the node
probe's own code, one file at a time in an unlinked temporary file. Nothing else of a
layer touches the disk, and nothing in it is run. A summary is keyed by the layer's
digest and cached in the inventory: a new tag that shares layers reads only the new ones.

:class:`LayeredImage` is the union of the summaries, lowest layer first, with the OCI
whiteouts applied (``.wh.NAME`` removes ``NAME`` of the layers below, ``.wh..wh..opq``
every entry below in its directory; image-spec ``layer.md``), read by the same
fingerprint as a squashfs image (:func:`.fingerprint.read_tree`).

Bounds, each an :class:`~.tree.ImageError` naming the layer and the cause: the compressed
bytes (what the manifest says, and the configured maximum), the unpacked bytes (64 times
the compressed size, and the maximum), the entries, one file's size, the bytes analysed,
a member's depth (:data:`~.squashfs.MAX_DEPTH`, as a squashfs image's), and the image's
deadline; the directories a member implies count as entries and path bytes as named
ones do; the blob's sha256 must be the digest it was asked by, and is checked before any
of these is said of its content (on an error the rest of the blob is hashed first): a
blob that is not its digest's is :class:`~.tree.ImageUnverified`, the serving registry's
failure; the collector's own temporary directory failing is :class:`~.tree.ImageTransient`.

Over 500 lines: the streaming read (its bounds, and the digest verified before anything
is said of the content) and the union read back from its summaries share one summary
format; split, each half would define it again.
"""

from __future__ import annotations

import base64
import bisect
import gzip
import hashlib
import posixpath
import re
import tempfile
import time
import zlib
from collections.abc import Callable
from typing import IO, Any, cast

from inventoryd.controller.images.squashfs import (
    MAX_DEPTH,
    MAX_EXPANSION,
    MAX_FILE_BYTES,
    wanted,
)
from inventoryd.controller.images.tar import (
    DIRECTORY,
    HARDLINK,
    REGULAR,
    SYMLINK,
    TarError,
    TarReader,
)
from inventoryd.controller.images.tree import (
    Analyzer,
    Entry,
    ImageError,
    ImagePathError,
    ImageStopped,
    ImageTransient,
    ImageTree,
    ImageUnverified,
)
from inventoryd.probes import nccl as nccl_probe
from inventoryd.probes import plugins as plugin_probe

SUMMARY_VERSION = 3  # 2: the entries in tar order (ops); 3: implied directories bounded
MAX_ENTRIES = 500_000  # members of one layer (all of them, kept or not)
MAX_KEPT = 200_000  # entries of one layer kept in its summary (implied directories too)
MAX_NAME_BYTES = 16 << 20  # bytes of paths one layer's summary keeps (implied ones too)
MAX_SMALL = 64 * 1024
#: ``ld.so.conf.d/*.conf`` contents one layer keeps, the first by name: the fingerprint
#: reads no more (fingerprint.py, MAX_CONF_FILES plus /etc/ld.so.conf). Their bytes count
#: against MAX_NAME_BYTES like the paths (issue 41's hostile review: 6,000 conf files of
#: 64 KiB in an 8.2 MB layer made 500 MB of summaries and 1.57 GB of peak memory).
MAX_CONF_KEPT = 65
#: the configuration files whose content the fingerprint reads (fingerprint.py)
SMALL_FILES = ("/etc/environment", "/etc/rc", "/etc/nccl.conf", "/etc/ld.so.conf")
SMALL_DIRS = ("/etc/ld.so.conf.d",)
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"

GZIP = ("application/vnd.oci.image.layer.v1.tar+gzip",
        "application/vnd.docker.image.rootfs.diff.tar.gzip")
ZSTD = ("application/vnd.oci.image.layer.v1.tar+zstd",)
PLAIN = ("application/vnd.oci.image.layer.v1.tar",
         "application/vnd.docker.image.rootfs.diff.tar")
LAYER_TYPES = GZIP + ZSTD + PLAIN

_ALLOWED = re.compile(r"[\x20-\x7e]+")

#: analyzer name -> function; a summary stores facts under the name
ANALYZERS: dict[str, Analyzer] = {"nccl": nccl_probe.analyze, "plugin": plugin_probe.analyze}


def analyzer_for(name: str) -> str | None:
    """Which analysis the fingerprint asks of a file of this name (fingerprint.py):
    ``libnccl.so*`` is a libnccl, ``libnccl-*.so*`` a plugin."""
    if name == "libnccl.so" or name.startswith("libnccl.so."):
        return "nccl"
    if name.startswith("libnccl-") and ".so" in name:
        return "plugin"
    return None


class _Bounded:
    """A file-like read of ``source`` that stops at ``limit`` bytes (``what`` names the
    bound in the error), at the deadline and at ``stop`` (the collector's SIGTERM:
    ImageStopped), hashing what passes when asked. The source
    is read 1 MiB at a time whatever the caller asks: gzip reads a header's file name a
    byte at a time, and a byte a read of the registry's stream cost 4.3 us a byte."""

    def __init__(self, source: Any, limit: int, deadline: float, label: str, what: str,
                 hasher: Any = None, stop: Callable[[], bool] | None = None) -> None:
        self.source, self.limit, self.deadline, self.stop = source, limit, deadline, stop
        self.label, self.what, self.hasher = label, what, hasher
        self.count = 0  # bytes taken from the source
        self.eof = False  # the source has ended
        self.buf, self.pos = b"", 0

    def read(self, n: int = -1) -> bytes:
        if self.stop is not None and self.stop():
            raise ImageStopped(self.label, "not read: the collector is stopping")
        if time.monotonic() > self.deadline:
            raise ImageTransient(self.label, "time limit reached")
        n = 1 << 20 if n is None or n < 0 else min(n, 1 << 20)
        if self.pos >= len(self.buf):
            chunk: bytes = self.source.read(1 << 20)
            if not chunk:
                self.eof = True
                return b""
            self.count += len(chunk)
            if self.count > self.limit:
                raise ImageError(self.label, f"{self.what}: more than {self.limit} bytes")
            if self.hasher is not None:
                self.hasher.update(chunk)
            self.buf, self.pos = chunk, 0
        out = self.buf[self.pos:self.pos + n]
        self.pos += len(out)
        return out

    def readable(self) -> bool:
        return True


def _decompressed(raw: _Bounded, media_type: str, label: str) -> Any:
    if media_type in GZIP:
        return gzip.GzipFile(fileobj=cast(Any, raw), mode="rb")
    if media_type in ZSTD:
        # the standard library's from Python 3.14 (compression.zstd), else zstandard: a
        # compiled module, whose wheels are per Python release; both keep libzstd's
        # default window limit (128 MiB) on what a frame may ask for
        try:
            from compression import zstd  # type: ignore[import-not-found,unused-ignore]

            return zstd.ZstdFile(cast(Any, raw), mode="rb")
        except ImportError:
            import zstandard

            return zstandard.ZstdDecompressor().stream_reader(cast(Any, raw),
                                                              read_across_frames=True)
    if media_type in PLAIN:
        return raw
    raise ImageError(label, f"layer media type {media_type!r} is not one this reader takes "
                            f"({', '.join(LAYER_TYPES)})")


def _normal(name: str) -> str | None:
    """The member's path from the image's root, or None for a name that climbs above it
    or that holds characters the fingerprint never needs."""
    if not name or not _ALLOWED.fullmatch(name):
        return None
    parts: list[str] = []
    for part in name.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            return None
        parts.append(part)
    return "/" + "/".join(parts)


class _Small:
    """The small files' contents a layer keeps (base64), at most :data:`MAX_CONF_KEPT`
    ``ld.so.conf.d`` files, the first by name; :meth:`keep` returns the change in bytes
    kept (for the layer's byte bound)."""

    def __init__(self, into: dict[str, str]) -> None:
        self.into = into
        self.confs: list[str] = []  # sorted

    def wants(self, path: str) -> bool:
        return (not path.startswith(SMALL_DIRS[0] + "/") or path in self.into
                or len(self.confs) < MAX_CONF_KEPT or path < self.confs[-1])

    def keep(self, path: str, data: str) -> int:
        if not self.wants(path):
            return 0
        delta = len(data) - len(self.into.get(path, ""))
        if path.startswith(SMALL_DIRS[0] + "/") and path not in self.into:
            bisect.insort(self.confs, path)
            if len(self.confs) > MAX_CONF_KEPT:
                delta -= len(self.into.pop(self.confs.pop()))
        self.into[path] = data
        return delta


def _small(path: str) -> bool:
    parent = posixpath.dirname(path)
    return path in SMALL_FILES or (parent in SMALL_DIRS and path.endswith(".conf"))


def read_layer(
    blob: Any, *, digest: str, size: int, media_type: str, deadline: float,
    max_bytes: int, max_unpacked: int, max_read_bytes: int, tmpdir: str | None = None,
    label: str | None = None, stop: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """The summary of one layer (module docstring), read from ``blob`` (a file-like
    ``read(n)`` of the blob's bytes, which must bound its own time per call), until the
    deadline or ``stop`` (ImageStopped). Raises ImageError naming the layer and the
    cause, also when its sha256 is not ``digest``."""
    label = label or f"layer {digest}"
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise ImageError(label, "the layer's digest is not sha256")
    if size > max_bytes:
        raise ImageError(label, f"{size} bytes compressed, more than registry.max_layer_bytes "
                                f"({max_bytes})")
    hasher = hashlib.sha256()
    raw = _Bounded(blob, size, deadline, label, "the blob is longer than its descriptor says",
                   hasher, stop)
    unpacked_limit = min(max_unpacked, MAX_EXPANSION * size + (1 << 20))
    stream = _Bounded(_decompressed(raw, media_type, label), unpacked_limit, deadline, label,
                      f"unpacked (at most {MAX_EXPANSION}x the layer, "
                      "registry.max_unpacked_bytes)", stop=stop)
    out: dict[str, Any] = {"v": SUMMARY_VERSION, "digest": digest, "size": size,
                           "media_type": media_type, "listed": 0, "odd": 0, "ops": [],
                           "files": {}, "whiteouts": [], "opaque": [], "small": {},
                           "facts": {}}
    read_left = min(max_read_bytes, unpacked_limit)
    kept = 0
    t0 = time.monotonic()
    ops: list[list[Any]] = out["ops"]
    made: set[str] = set()  # directories this layer makes (named, or implied by a member)
    names = 0  # bytes of the paths kept, and of the small files' contents
    small = _Small(out["small"])

    def implied(path: str) -> None:
        """Make the directories above ``path`` that this layer has not made, as tar does:
        each one an entry and its path's bytes, counted against the layer's bounds
        (a member 60 levels deep implies 59; the review's 150 members 800 levels deep
        grew the inventory 195 MB); iteratively, from the nearest up."""
        nonlocal kept, names
        new: list[str] = []
        parent = posixpath.dirname(path)
        while parent != "/" and parent not in made:
            new.append(parent)
            parent = posixpath.dirname(parent)
        for d in reversed(new):
            made.add(d)
            ops.append(["d", d])
        kept += len(new)
        names += sum(len(d) for d in new)

    try:
        tar = TarReader(stream)  # type: ignore[arg-type]
        for m in tar:
            out["listed"] += 1
            if out["listed"] > MAX_ENTRIES:
                raise ImageError(label, f"more than {MAX_ENTRIES} entries")
            path = _normal(m.name)
            if path is None or (m.link and not _ALLOWED.fullmatch(m.link)):
                out["odd"] += 1
                continue
            if path.count("/") > MAX_DEPTH:  # as a squashfs image's tree (squashfs.py)
                raise ImageError(label, f"a member deeper than {MAX_DEPTH} levels "
                                        f"({path.count('/')}: {path[:120]}...)")
            # tar makes a member's directories as it extracts it, kept or not
            implied(path)
            name = posixpath.basename(path)
            kept += 1
            names += len(path) + len(m.link)
            if name.startswith(WHITEOUT):
                parent = posixpath.dirname(path)
                if name == OPAQUE:
                    out["opaque"].append(parent)
                else:
                    out["whiteouts"].append(posixpath.join(parent, name[len(WHITEOUT):]))
            elif m.kind == DIRECTORY:
                if path not in made:
                    made.add(path)
                    ops.append(["d", path])
            elif m.kind == SYMLINK:
                made.discard(path)
                ops.append(["l", path, m.link])
            elif m.kind == HARDLINK:
                made.discard(path)
                target = _normal(m.link)
                if target is not None and target in out["files"]:  # an earlier member
                    out["files"][path] = out["files"][target]
                    if target in out["facts"]:
                        out["facts"][path] = out["facts"][target]
                    if target in out["small"] and _small(path):
                        names += small.keep(path, out["small"][target])
                    ops.append(["f", path])
                elif wanted(name):  # tar fails on it, or it is a file not kept: not read
                    out["files"][path] = 0
                    out["facts"][path] = {"error": f"{path}: a hard link to {m.link[:200]}, "
                                                   "which is not a file the reader kept "
                                                   "earlier in the layer; not read"}
                    ops.append(["f", path])
                else:
                    kept -= 1
            elif m.kind == REGULAR and wanted(name):
                made.discard(path)
                out["files"][path] = m.size
                ops.append(["f", path])
                if _small(path) and m.size <= MAX_SMALL and small.wants(path):
                    names += small.keep(path, base64.b64encode(_read_all(tar, m.size)).decode())
                kind = analyzer_for(name)
                if kind is not None:
                    out["facts"][path] = _analyze_member(tar, m.size, kind, path, read_left,
                                                         tmpdir, label)
                    read_left -= min(m.size, max(read_left, 0))
            elif wanted(name):  # a device or FIFO of a name the fingerprint reads
                made.discard(path)
                out["files"].pop(path, None)
                ops.append(["o", path])
            else:
                kept -= 1
                names -= len(path) + len(m.link)
            if kept > MAX_KEPT:
                raise ImageError(label, f"more than {MAX_KEPT} entries the fingerprint keeps")
            if names > MAX_NAME_BYTES:
                raise ImageError(label, f"more than {MAX_NAME_BYTES} bytes of paths the "
                                        "fingerprint keeps")
        # the rest of the blob (tar padding, the compressor's end), for its digest
        while stream.read(1 << 20):
            pass
    except ImageTransient:
        raise
    except Exception as e:
        cause = _content_cause(e, media_type)
        if cause is None:  # a bug: the caller's internal error, never the image's content
            raise
        if raw.eof and raw.count < size:  # the blob ended early: the connection
            raise ImageTransient(label, f"the blob ended after {raw.count} of {size} bytes "
                                        f"({type(e).__name__}: {e})") from None
        # nothing about the content is decided before its digest is verified: a registry
        # serving garbage under an honest digest is that registry's failure
        _verified(raw, size, hasher, digest, label)
        raise ImageError(label, cause) from None
    _verified(raw, size, hasher, digest, label)
    out["unpacked"] = stream.count
    out["kept_bytes"] = names
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


def _content_cause(e: Exception, media_type: str) -> str | None:
    """What an error while reading says of the layer's content (once its digest is
    verified); None for an error that says nothing of it (a bug)."""
    if isinstance(e, ImageError):
        return e.cause
    if isinstance(e, TarError):
        return f"not a tar archive this reader takes: {e}"
    if isinstance(e, OSError | EOFError | zlib.error) or type(e).__name__ == "ZstdError":
        return f"cannot be decompressed ({media_type}): {type(e).__name__}: {e}"
    return None


def _verified(raw: _Bounded, size: int, hasher: Any, digest: str, label: str) -> None:
    """Read the rest of the blob (hashed, within its size and the deadline) and check
    that it is ``digest``'s: else ImageUnverified (that registry's failure) or
    ImageTransient (the connection)."""
    if raw.count > size:
        raise ImageUnverified(label, f"the blob is longer than its descriptor says ({size} "
                                     "bytes); its digest cannot be verified")
    try:
        while raw.read(1 << 20):
            pass
    except ImageTransient:
        raise
    except ImageError as e:  # longer than its descriptor says
        raise ImageUnverified(label, f"{e.cause}; its digest cannot be verified") from None
    if raw.count != size:
        raise ImageTransient(label, f"{raw.count} of {size} bytes (the blob ended early)")
    if f"sha256:{hasher.hexdigest()}" != digest:
        raise ImageUnverified(label, "the blob's content does not match its digest")


def _read_all(tar: TarReader, size: int) -> bytes:
    parts = []
    while chunk := tar.read(1 << 16):
        parts.append(chunk)
    return b"".join(parts)[:size]


def _analyze_member(tar: TarReader, size: int, kind: str, path: str, read_left: int,
                    tmpdir: str | None, label: str) -> dict[str, Any]:
    """{kind: facts} of the member being read, or {"error": cause}."""
    if size > MAX_FILE_BYTES:
        return {"error": f"{path}: {size} bytes, more than {MAX_FILE_BYTES}; not read"}
    if size > read_left:
        return {"error": f"{path}: {size} bytes, more than the {max(read_left, 0)} left of "
                         f"this layer's read budget (at most {MAX_EXPANSION}x its size, "
                         "registry.max_read_bytes); not read"}
    try:  # the collector's own disk failing (ENOSPC, a tmp_dir gone): not the image's
        f = tempfile.TemporaryFile(dir=tmpdir)  # noqa: SIM115 - closed below
    except OSError as e:
        raise _local(e, tmpdir, label) from None
    with f:
        while chunk := tar.read(1 << 20):  # the layer's errors pass; the disk's are named
            try:
                f.write(chunk)
            except OSError as e:
                raise _local(e, tmpdir, label) from None
        if f.tell() != size:
            return {"error": f"{path}: {f.tell()} of {size} bytes in the layer"}
        f.seek(0)
        return {kind: ANALYZERS[kind](cast(Any, f), f"{label}:{path}")}


def _local(e: OSError, tmpdir: str | None, label: str) -> ImageTransient:
    where = tmpdir or tempfile.gettempdir()
    return ImageTransient(label, f"the collector's temporary directory {where} (registry."
                                 f"tmp_dir): {e.strerror or e}; not the image's content")


def summary_ok(s: Any) -> bool:
    """A cached summary this code can use (its version, its shape)."""
    return (isinstance(s, dict) and s.get("v") == SUMMARY_VERSION
            and all(isinstance(s.get(k), dict) for k in ("files", "small", "facts"))
            and all(isinstance(s.get(k), list) for k in ("ops", "whiteouts", "opaque")))


class LayeredImage(ImageTree):
    """The union of layer summaries, lowest first (module docstring). ``deadline`` and
    ``stop`` as a squashfs image's (:class:`~.tree.ImageTree`): the union is built, and
    then read by the fingerprint, under them; a cached layer costs no download, but its
    union may cost seconds of CPU (issue 48's hostile review)."""

    def __init__(self, label: str, summaries: list[dict[str, Any]], *,
                 deadline: float | None = None, stop: Callable[[], bool] | None = None
                 ) -> None:
        super().__init__(label, deadline=deadline, stop=stop)
        self.check()
        self.kids: dict[str, set[str]] = {"/": set()}
        self.entries["/"] = Entry("d", 0)
        #: real path -> (layer index, path in that layer) of each regular file
        self.source: dict[str, tuple[int, str]] = {}
        self.summaries = summaries
        self.listed = sum(int(s.get("listed") or 0) for s in summaries)
        self.odd_names = sum(int(s.get("odd") or 0) for s in summaries)
        for i, s in enumerate(summaries):
            self._apply(i, s)
        for d, names in self.kids.items():
            self.tick()
            self.dirs[d] = sorted(names)
        self.check()

    # ---- the union -------------------------------------------------------------------

    def _remove(self, path: str) -> None:
        if path == "/" or path not in self.entries:
            return
        self.tick()
        e = self.entries.pop(path)
        self.source.pop(path, None)
        if e.kind == "d":
            for name in list(self.kids.pop(path, ())):
                self._remove(f"{path}/{name}")
        parent, name = posixpath.split(path)
        self.kids.get(parent, set()).discard(name)

    def _dir(self, path: str) -> None:
        # iteratively: the directories missing above path, then each from the top down
        missing: list[str] = []
        while path != "/":
            e = self.entries.get(path)
            if e is not None and e.kind == "d":
                break
            missing.append(path)
            path = posixpath.dirname(path)
        for p in reversed(missing):
            if p in self.entries:
                self._remove(p)
            self.entries[p] = Entry("d", 0)
            self.kids.setdefault(p, set())
            self.kids[posixpath.dirname(p)].add(posixpath.basename(p))

    def _put(self, path: str, entry: Entry) -> None:
        if path == "/":
            return
        parent = posixpath.dirname(path)
        self._dir(parent)
        self._remove(path)
        self.entries[path] = entry
        self.kids[parent].add(posixpath.basename(path))

    def _apply(self, i: int, s: dict[str, Any]) -> None:
        # whiteouts remove what the layers below hold, before this layer's own entries
        # (image-spec layer.md); then the entries in tar order: a later one wins
        for d in s["opaque"]:
            self.tick()
            for name in list(self.kids.get(d, ())):
                self._remove(f"{d.rstrip('/')}/{name}")
        for p in s["whiteouts"]:
            self.tick()
            self._remove(p)
        for op in s["ops"]:
            self.tick()
            kind, path = op[0], op[1]
            if kind == "d":
                self._dir(path)
            elif kind == "l":
                self._put(path, Entry("l", len(op[2]), str(op[2])))
            elif kind == "f":
                self._put(path, Entry("-", int(s["files"].get(path, 0))))
                self.source[path] = (i, path)
            else:  # a device or FIFO: what was there is gone, and nothing is read
                self._put(path, Entry("?", 0))

    # ---- reading inside it -----------------------------------------------------------

    def _file(self, path: str) -> tuple[str, dict[str, Any], str]:
        real = self.resolve(path)
        e = self.entries.get(real)
        if e is None or e.kind != "-" or real not in self.source:
            raise ImagePathError(self.path, f"{path}: not a regular file")
        i, inner = self.source[real]
        return real, self.summaries[i], inner

    def read_small(self, path: str, limit: int = MAX_SMALL) -> bytes:
        real, s, inner = self._file(path)
        text = s["small"].get(inner)
        if text is None:
            raise ImagePathError(self.path, f"{real}: over {MAX_SMALL} bytes or not a "
                                            "configuration file the layer reader keeps")
        data = base64.b64decode(text)
        if len(data) > limit:
            raise ImagePathError(self.path, f"{real}: {len(data)} bytes, more than {limit}")
        return data

    def copy_file(self, path: str, out: IO[bytes], limit: int | None = None) -> tuple[str, int]:
        data = self.read_small(path, MAX_SMALL if limit is None else limit)
        out.write(data)
        return self.resolve(path), len(data)

    def analyze(self, path: str, analyze: Callable[..., Any], tmpdir: str) -> tuple[str, Any]:
        real, s, inner = self._file(path)
        kind = next((k for k, f in ANALYZERS.items() if f is analyze), None)
        facts = s["facts"].get(inner)
        if facts is None or kind is None:
            raise ImagePathError(self.path, f"{real}: not a file the layer reader analyses "
                                            "(its name is not libnccl.so* or libnccl-*.so)")
        if "error" in facts:
            raise ImagePathError(self.path, str(facts["error"]))
        if kind not in facts:
            raise ImagePathError(self.path, f"{real}: read as a {next(iter(facts))}, not "
                                            f"as a {kind}")
        return real, facts[kind]
