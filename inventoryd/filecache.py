"""Results that depend only on a file's content, kept between runs of inventoryd.

A result is stored under ``(kind, path, st_dev, st_ino, st_size, st_mtime_ns)``: a file that
is replaced, rewritten or touched gets a new key, so a warm run re-reads nothing large and a
changed file is never served a stale result. ``kind`` names the analysis and its format
version (``"libnccl/1"``), so that a new analysis never reads an old one's results.

Where: ``$NCCLGUARD_CACHE_DIR``, else the ``cache_dir`` of the inventoryd config (when it
has one), else ``cache/`` next to the inventory's default state dir. The file is one JSON
document, replaced atomically. A cache that is missing, unreadable or corrupt is ignored
(with a warning naming the file and the cause) and rebuilt; one that cannot be written
leaves the run correct, only slower next time.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    from inventoryd.nodefs import NodeFS

from ncclguard import config as configmod

log = logging.getLogger(__name__)

FORMAT = 1
FILE_NAME = "filecache.json"
MAX_ENTRIES = 4096  # far more than a node has libraries; bounds a cache under attack
MAX_BYTES = 32 * 1024 * 1024  # a larger cache file is not ours, or is corrupt
UNUSED_TTL_S = 30 * 86400  # entries not used for this long are dropped on save


def cache_dir(config: configmod.InventorydConfig | None = None) -> Path:
    env = os.environ.get("NCCLGUARD_CACHE_DIR")
    if env:
        return Path(env)
    if config is not None and config.cache_dir:
        return Path(config.cache_dir)
    return configmod.default_db_path().parent / "cache"


def _key(kind: str, path: str, st: os.stat_result) -> str:
    return f"{kind}\0{path}\0{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


class FileCache:
    """``get``/``put`` results by file identity; ``save()`` writes back if anything changed.

    ``FileCache(None)`` keeps results in memory only (for one run).
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._entries: dict[str, dict[str, Any]] = {}
        self._dirty = False
        self.hits = 0
        self.misses = 0
        self.load_error: str | None = None
        if path is not None:
            self._load(path)

    @classmethod
    def open(cls, config: configmod.InventorydConfig | None = None) -> FileCache:
        return cls(cache_dir(config) / FILE_NAME)

    def _load(self, path: Path) -> None:
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_BYTES + 1)
        except FileNotFoundError:
            return
        except OSError as e:
            self._ignore(f"cannot read: {e.strerror or e}")
            return
        if len(raw) > MAX_BYTES:
            self._ignore(f"larger than {MAX_BYTES} bytes")
            return
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:
            self._ignore(f"not valid JSON: {e}")
            return
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            self._ignore(f"not a format-{FORMAT} cache")
            return
        entries = doc.get("entries")
        if not isinstance(entries, dict):
            self._ignore("no entries table")
            return
        for k, v in entries.items():
            if (
                isinstance(k, str)
                and isinstance(v, dict)
                and isinstance(v.get("value"), dict)
                and isinstance(v.get("used"), int | float)
            ):
                self._entries[k] = v
        self._dirty = len(self._entries) != len(entries)

    def _ignore(self, why: str) -> None:
        self.load_error = f"{self.path}: {why}; ignored, rebuilding"
        log.warning("file cache %s", self.load_error)
        self._entries = {}
        self._dirty = True

    def get(self, kind: str, path: str, st: os.stat_result) -> dict[str, Any] | None:
        """A copy of the stored result for this exact file version, or None."""
        entry = self._entries.get(_key(kind, path, st))
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        now = int(time.time())
        if now - entry["used"] > 3600:  # refresh the age rarely: a warm run writes nothing
            entry["used"] = now
            self._dirty = True
        return json.loads(json.dumps(entry["value"]))

    def put(self, kind: str, path: str, st: os.stat_result, value: dict[str, Any]) -> None:
        self._entries[_key(kind, path, st)] = {"used": int(time.time()), "value": value}
        self._dirty = True

    def facts(
        self,
        fs: NodeFS,
        node_path: str,
        kind: str,
        analyze: Callable[[BinaryIO, str], dict[str, Any]],
    ) -> tuple[dict[str, Any], os.stat_result, str]:
        """``(facts, stat, resolved node path)`` of one node file.

        The file is opened safely (:func:`inventoryd.probes.linker.open_regular`); its
        facts come from this cache when (dev, ino, size, mtime) match, else from
        ``analyze(file, node_path)`` and are then cached. Raises ``OSError``.
        """
        from inventoryd.probes.linker import open_regular

        f, st, real = open_regular(fs, node_path)
        with f:
            value = self.get(kind, real, st)
            if value is None:
                value = analyze(f, node_path)
                self.put(kind, real, st, value)
        return value, st, real

    def __len__(self) -> int:
        return len(self._entries)

    def save(self) -> str | None:
        """Write back if changed; returns an error text instead of raising."""
        if self.path is None or not self._dirty:
            return None
        now = time.time()
        keep = sorted(
            ((k, v) for k, v in self._entries.items() if now - v["used"] < UNUSED_TTL_S),
            key=lambda kv: kv[1]["used"],
            reverse=True,
        )[:MAX_ENTRIES]
        doc = {"format": FORMAT, "entries": dict(keep)}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".filecache.", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(doc, f, separators=(",", ":"))
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            text = f"{self.path}: cannot write the file cache: {e.strerror or e}"
            log.warning("%s", text)
            return text
        self._dirty = False
        return None
