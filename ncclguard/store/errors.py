"""Why the inventory cannot be used: one exception class per cause, each naming the path.

:func:`translate` turns an ``sqlite3.Error`` into the matching class, so that every
caller (the daemon, the gate, the CLI) tells a missing file from a locked, corrupt,
read-only or full one in the same way (docs/store.md, "Failures").
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

__all__ = [
    "InventoryCorrupt",
    "InventoryError",
    "InventoryFull",
    "InventoryLocked",
    "InventoryMissing",
    "InventoryReadOnly",
    "InventoryUnsafe",
    "busy",
    "hot_journal",
    "translate",
]

# SQLite primary result codes (sqlite3.Error.sqlite_errorcode & 0xff)
_BUSY, _LOCKED, _READONLY, _IOERR, _CORRUPT, _FULL, _CANTOPEN, _NOTADB = 5, 6, 8, 10, 11, 13, 14, 26


class InventoryError(Exception):
    """The inventory cannot be used. The message names the path and the cause."""

    def __init__(self, path: Path | str, cause: str) -> None:
        self.path = str(path)
        self.cause = cause
        super().__init__(self._text())

    def _text(self) -> str:
        return f"inventory at {self.path}: {self.cause}"


class InventoryMissing(InventoryError):
    """No database (or not even its directory) at the configured path."""


class InventoryCorrupt(InventoryError):
    """The file is not a database, is damaged, or has a schema this code cannot read."""

    def _text(self) -> str:
        return f"corrupt inventory at {self.path}: {self.cause}"


class InventoryLocked(InventoryError):
    """Another process held the lock for longer than the busy budget."""

    def _text(self) -> str:
        return f"inventory at {self.path} is locked: {self.cause}"


class InventoryUnsafe(InventoryError):
    """The database or its directory is writable by others."""

    def _text(self) -> str:
        return f"world-writable inventory at {self.path}: refusing ({self.cause})"


class InventoryReadOnly(InventoryError):
    """The database (or its directory, or its filesystem) cannot be written."""

    def _text(self) -> str:
        return f"read-only inventory at {self.path}: {self.cause}"


class InventoryFull(InventoryError):
    """The filesystem holding the database is full (ENOSPC / SQLITE_FULL)."""

    def _text(self) -> str:
        return f"inventory at {self.path}: disk full: {self.cause}"


def translate(e: sqlite3.Error, path: Path, doing: str) -> InventoryError:
    code = (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF
    msg = f"{doing}: {e}"
    if code in (_CORRUPT, _NOTADB) or "not a database" in str(e) or "malformed" in str(e):
        return InventoryCorrupt(path, msg)
    if code in (_BUSY, _LOCKED) or "locked" in str(e):
        return InventoryLocked(path, msg)
    if code == _READONLY or "readonly" in str(e):
        if path.exists() and not os.access(path.parent, os.W_OK):
            msg += (f" (permission denied: SQLite must create the -shm file of this WAL "
                    f"database beside it, and this user cannot write {path.parent}; copy "
                    "the database with its -wal file into a directory you can write, or "
                    "run as the collector's user)")
        return InventoryReadOnly(path, msg)
    if code == _FULL or "disk is full" in str(e):
        return InventoryFull(path, msg)
    if code == _CANTOPEN and not path.parent.is_dir():
        return InventoryMissing(path, f"{doing}: directory {path.parent} does not exist")
    if code == _CANTOPEN and path.exists() and not (os.access(path, os.R_OK)
                                                    and os.access(path.parent, os.X_OK)):
        return InventoryError(path, f"{doing}: permission denied: this user (uid "
                              f"{os.getuid()}) cannot read it; run as root or a member of "
                              "the inventory's group, or name a readable copy with --db")
    return InventoryError(path, msg)


_READONLY_ROLLBACK = _READONLY | (3 << 8)


def hot_journal(e: sqlite3.Error, path: Path) -> bool:
    """A read-only connection met the hot journal of an interrupted writer."""
    if (getattr(e, "sqlite_errorcode", 0) or 0) == _READONLY_ROLLBACK:
        return True
    return "readonly" in str(e) and path.with_name(path.name + "-journal").exists()


def busy(e: sqlite3.Error) -> bool:
    code = (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF
    return code in (_BUSY, _LOCKED) or "database is locked" in str(e)


def database_failure(e: Exception) -> bool:
    """An error of the database itself (busy, full, I/O, damaged), as opposed to a value
    that cannot be bound or a constraint that one record breaks."""
    if isinstance(e, sqlite3.ProgrammingError):  # a value of a type SQLite cannot bind
        return "binding parameter" not in str(e)  # ... or a closed connection
    return isinstance(e, sqlite3.DatabaseError) and not isinstance(
        e, sqlite3.IntegrityError | sqlite3.DataError
    )
