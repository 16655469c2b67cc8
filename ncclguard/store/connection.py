"""Opening the inventory's SQLite file safely, and running reads and writes on it.

- Safety: a file, or a directory holding it, that others can write is refused (as ssh
  does); a missing parent directory is a missing mount, never created; the file is
  created ``0644`` with ``O_EXCL | O_NOFOLLOW``.
- Versions: a reader refuses a schema other than its own; a writer migrates an older
  one inside one ``BEGIN IMMEDIATE`` transaction (:mod:`ncclguard.store.schema`).
- Locking: writes are short ``BEGIN IMMEDIATE`` transactions retried with jittered
  backoff; a read-only reader that meets a killed writer's hot journal waits for a
  writer within its busy budget. Every ``sqlite3.Error`` becomes an
  :class:`~ncclguard.store.errors.InventoryError` that names the file.
- A reader leaves nothing beside the file (issue 46: ``ncclguard nodes --db COPY`` of a
  WAL database left ``COPY-wal`` and ``COPY-shm``): a WAL database that no connection
  has open (no ``-wal``, no ``-shm``) is read ``immutable=1``, which creates neither,
  and each read checks that no writer has come since (else it is read again through a
  plain ``mode=ro`` connection); docs/store.md, "Readers leave no -wal or -shm".
"""

from __future__ import annotations

import contextlib
import os
import random
import sqlite3
import stat
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self, TypeVar

from ncclguard.config import InventoryConfig, default_db_path
from ncclguard.store.errors import (
    InventoryCorrupt,
    InventoryError,
    InventoryFull,
    InventoryLocked,
    InventoryMissing,
    InventoryReadOnly,
    InventoryUnsafe,
    busy,
    hot_journal,
    translate,
)
from ncclguard.store.schema import MIGRATIONS, SCHEMA_VERSION, GateValues

__all__ = ["DIR_MODE", "FILE_MODE", "Database", "chunks"]

_T = TypeVar("_T")

DIR_MODE = 0o755  # readable by the gate's user (slurm) and admins, writable by the owner only
FILE_MODE = 0o644


def _check_safe(path: Path) -> None:
    """Refuse a database, or a directory holding one, that others can write (as ssh does).
    A symlinked path is judged by where it leads too: the link's directory, the file it
    names and that file's directory (a link from a safe place into /tmp is not safe)."""
    real = Path(os.path.realpath(path))
    places = [(path, "the file"), (path.parent, f"its directory {path.parent}")]
    if real != path:
        places += [(real, f"the file it links to, {real}"),
                   (real.parent, f"the directory it links into, {real.parent}")]
    for p, what in places:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise InventoryError(path, f"cannot stat {p}: {e.strerror or e}") from None
        if st.st_mode & stat.S_IWOTH:
            raise InventoryUnsafe(path, f"{what} has mode {stat.filemode(st.st_mode)}")
    # every directory above: one that anyone may write without the sticky bit lets
    # anyone rename the inventory's directory away and put another in its place
    for d in real.parents[1:]:
        try:
            st = os.stat(d)
        except OSError:
            continue
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise InventoryUnsafe(path, f"the directory {d} above it has mode "
                                  f"{stat.filemode(st.st_mode)}")


def _uri(path: Path, mode: str, immutable: bool = False) -> str:
    return f"file:{urllib.parse.quote(str(path))}?mode={mode}" + (
        "&immutable=1" if immutable else "")


#: The file header's "file format write version" (offset 18): 2 is WAL (SQLite's file
#: format, section 1.3.3); 1 a rollback journal.
_WAL_FORMAT = 2


def _unopened_wal(path: Path) -> tuple[int, int, int, int] | None:
    """The file's (inode, size, mtime, ctime) when it is a WAL database that no
    connection has open: no ``-wal`` and no ``-shm`` beside it (a writer in WAL mode
    keeps its ``-wal`` from its first read to its last close; a killed one leaves both).
    A reader of it with ``mode=ro`` alone would create both and leave them (it cannot
    checkpoint, so it does not delete them). None otherwise: a rollback journal (a
    reader creates nothing), told by the header's 20 bytes, a few microseconds (the gate
    opens the inventory per job).

    The file itself is opened only when neither is there: closing a descriptor of a file
    drops every POSIX lock this process holds on it, SQLite's among them. The collector's
    metrics read the inventory in the collector's process; a header read there dropped
    the collector's own locks, and another writer (the canary service, an admin's
    ``ncclguard canary approve``) then switched the running collector's file out of WAL
    and removed its -wal and -shm (issue 43)."""
    if os.path.lexists(f"{path}-wal") or os.path.lexists(f"{path}-shm"):
        return None  # the usual case while the collector runs: a writer has it open
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None  # sqlite3 says why
    try:
        head = os.pread(fd, 20, 0)
        st = os.fstat(fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(head) < 20 or head[18] != _WAL_FORMAT:
        return None
    return _identity(st)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def chunks(items: list[str], n: int = 30000) -> Iterator[list[str]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]



class Database:
    """One SQLite file, opened safely: the plumbing under :class:`~ncclguard.store.Inventory`.

    ``readonly=True`` opens the file with ``mode=ro`` and never creates, migrates or
    writes anything (the gate, the CLI's queries). Otherwise the directory and file are
    created with safe modes when missing and the schema is migrated to the current
    version; a writer needs ``values`` (:class:`~ncclguard.store.schema.GateValues`, the
    policy's ``GATE_VALUES``) to fill the gate's tables. Every write is one short
    ``BEGIN IMMEDIATE`` transaction, retried with jittered backoff while the database is
    busy.
    """

    def __init__(
        self,
        path: Path | str | None = None,
        *,
        readonly: bool = False,
        config: InventoryConfig | None = None,
        values: GateValues | None = None,
    ) -> None:
        self.config = config or InventoryConfig()
        self.path = Path(path) if path is not None else self.config.db_path()
        self.readonly = readonly
        if values is None and not readonly:
            raise ValueError(
                "a writer of the inventory needs values= (ncclguard.policy.GATE_VALUES): "
                "the gate's tables hold the policy's values of each node"
            )
        self.values = values
        self._busy_s = max(self.config.busy_timeout_ms, 0) / 1000.0
        #: the file's identity when read ``immutable=1`` (:func:`_unopened_wal`), else None
        self._frozen: tuple[int, int, int, int] | None = None
        # a test seam: called inside the write transaction, just before COMMIT
        self._before_commit: Callable[[sqlite3.Connection], None] | None = None
        self._conn = self._open_ro() if readonly else self._open_rw()

    # ---- opening

    def _open_ro(self) -> sqlite3.Connection:
        path = self.path
        if not path.exists():
            why = "no such file" if path.parent.is_dir() else f"directory {path.parent} is missing"
            raise InventoryMissing(path, why)
        _check_safe(path)
        if not path.is_file():
            raise InventoryCorrupt(path, "not a regular file")
        # a WAL database no writer has open: read as it is, creating no -wal or -shm
        self._frozen = _unopened_wal(path)
        conn = self._connect("ro", immutable=self._frozen is not None)

        def probe(c: sqlite3.Connection) -> int:
            version = int(c.execute("PRAGMA user_version").fetchone()[0])
            c.execute("SELECT count(*) FROM sqlite_master").fetchone()
            return version

        self._conn = conn
        try:
            version = self._read_ro(conn, "open", probe)
        except InventoryError:
            self._conn.close()
            raise
        conn = self._conn  # another one if a writer came while it was read
        if version == 0:
            conn.close()
            raise InventoryMissing(path, "empty database: no inventoryd has written to it yet")
        self._check_version(conn, version)
        return conn

    def _connect(self, mode: str, immutable: bool = False) -> sqlite3.Connection:
        """A connection in SQLite's ``mode`` (``ro``, ``rw``); transactions are explicit.
        ``immutable``: SQLite takes no lock and creates no ``-wal``/``-shm`` (only for a
        WAL database no writer has open: :func:`_unopened_wal`)."""
        try:
            return sqlite3.connect(
                _uri(self.path, mode, immutable), uri=True, timeout=self._busy_s,
                isolation_level=None, check_same_thread=False,
            )
        except sqlite3.Error as e:
            raise translate(e, self.path, "open") from None

    def _ensure_dir(self) -> None:
        d = self.path.parent
        if d.is_dir():
            return
        # Create only the last component, unless this is the per-user default: a
        # missing parent is most likely a missing mount, and writing under the mount
        # point would hide the real inventory.
        try:
            if self.path == default_db_path():
                d.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            elif d.parent.is_dir():
                d.mkdir(mode=DIR_MODE, exist_ok=True)
            else:
                raise InventoryMissing(
                    self.path, f"directory {d.parent} does not exist (missing mount?)"
                )
            os.chmod(d, DIR_MODE)
        except PermissionError as e:
            raise InventoryReadOnly(self.path, f"cannot create {d}: {e.strerror}") from None
        except OSError as e:
            if isinstance(e, InventoryError):
                raise
            raise InventoryError(self.path, f"cannot create {d}: {e.strerror or e}") from None

    def _create_file(self) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(self.path, flags, FILE_MODE)
        except FileExistsError:
            return  # another writer won the race; fine
        except PermissionError as e:
            raise InventoryReadOnly(self.path, f"cannot create: {e.strerror}") from None
        except OSError as e:
            if e.errno == 30:  # EROFS
                raise InventoryReadOnly(self.path, f"cannot create: {e.strerror}") from None
            if e.errno == 28:  # ENOSPC
                raise InventoryFull(self.path, f"cannot create: {e.strerror}") from None
            raise InventoryError(self.path, f"cannot create: {e.strerror or e}") from None
        try:
            os.fchmod(fd, FILE_MODE)
        finally:
            os.close(fd)

    def _open_rw(self) -> sqlite3.Connection:
        path = self.path
        self._ensure_dir()
        _check_safe(path)
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise InventoryCorrupt(path, "not a regular file")
        if not path.exists():
            self._create_file()
        conn = self._connect("rw")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            self._check_version(conn, version, migrate_ok=True)
            self._set_journal_mode(conn)
            # a savepoint's undo journal (ingest isolates each record in one) stays in
            # memory: on a temp file it cost 110 KiB of writes per new record (bench)
            conn.execute("PRAGMA temp_store = MEMORY")
            if version < SCHEMA_VERSION:
                self._retrying(conn, self._migrate, "migrate the schema")
        except InventoryError:
            conn.close()
            raise
        except sqlite3.Error as e:
            conn.close()
            raise translate(e, path, "open") from None
        return conn

    def _check_version(
        self, conn: sqlite3.Connection, version: int, migrate_ok: bool = False
    ) -> None:
        if version > SCHEMA_VERSION:
            conn.close()
            raise InventoryCorrupt(
                self.path,
                f"schema version {version} is newer than this ncclguard's ({SCHEMA_VERSION}); "
                "upgrade ncclguard",
            )
        if version < SCHEMA_VERSION and not migrate_ok:
            conn.close()
            raise InventoryCorrupt(
                self.path,
                f"schema version {version} is older than {SCHEMA_VERSION}; "
                "a writer (ncclguard-inventoryd) migrates it",
            )

    def _set_journal_mode(self, conn: sqlite3.Connection) -> None:
        want = self.config.journal_mode.lower()
        have = conn.execute("PRAGMA journal_mode").fetchone()[0].lower()
        if have == want:
            return
        try:
            got = conn.execute(f"PRAGMA journal_mode = {'wal' if want == 'wal' else 'delete'}")
            have = got.fetchone()[0].lower()
        except sqlite3.OperationalError as e:
            if not busy(e):
                raise
            # switching needs the database to ourselves; the next open tries again

    def set_journal_mode(self, mode: str, *, wait_s: float = 10.0) -> str:
        """Switch the journal mode ("wal" or "delete"), waiting up to ``wait_s`` for
        readers to let go; returns the mode in force. The collector leaves WAL when it
        stops: a reader of a rollback journal needs nothing beside the file."""
        self._require_rw()
        want = "wal" if mode == "wal" else "delete"
        deadline = time.monotonic() + wait_s
        while True:
            try:
                got = self._conn.execute(f"PRAGMA journal_mode = {want}").fetchone()[0]
            except sqlite3.Error as e:
                if busy(e) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                raise translate(e, self.path, f"switch to journal_mode={want}") from None
            if str(got).lower() == want or time.monotonic() >= deadline:
                return str(got).lower()
            time.sleep(0.05)

    def _migrate(self, conn: sqlite3.Connection) -> str:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise InventoryCorrupt(self.path, f"schema version {version} appeared during migration")
        assert self.values is not None  # a writer (checked in __init__)
        for step in MIGRATIONS[version:]:
            step(conn, self.values)
        conn.execute(f"PRAGMA user_version = {int(SCHEMA_VERSION)}")
        return "migrated"

    def _moved(self) -> bool:
        """Whether a writer may have changed the file since it was opened immutable: a
        ``-wal`` now (a WAL writer makes it before it changes anything), or another
        inode, size, mtime or ctime (a checkpoint, a rollback-journal write)."""
        try:
            return (os.path.lexists(f"{self.path}-wal")
                    or _identity(os.stat(self.path)) != self._frozen)
        except OSError:
            return True

    def _thaw(self) -> sqlite3.Connection:
        """The ``immutable=1`` connection replaced: by a plain ``mode=ro`` one while a
        writer has the file open, else (it has written and gone) by another immutable one
        of the file as it is now."""
        self._conn.close()
        self._frozen = _unopened_wal(self.path)
        self._conn = self._connect("ro", immutable=self._frozen is not None)
        return self._conn

    # ---- plumbing

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_rw(self) -> None:
        if self.readonly:
            raise InventoryReadOnly(self.path, "opened read-only")

    def _retrying(
        self, conn: sqlite3.Connection, body: Callable[[sqlite3.Connection], _T], doing: str
    ) -> _T:
        """Run ``body`` in one BEGIN IMMEDIATE transaction, retrying while busy."""
        retries = max(self.config.write_retries, 0)
        started = time.monotonic()
        for attempt in range(retries + 1):
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    result = body(conn)
                    if self._before_commit is not None:
                        self._before_commit(conn)
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        with contextlib.suppress(sqlite3.Error):
                            conn.execute("ROLLBACK")
                    raise
                return result
            except sqlite3.Error as e:
                if busy(e) and attempt < retries:
                    time.sleep(min(0.02 * 2**attempt, 1.0) * random.uniform(0.5, 1.5))
                    continue
                if busy(e):
                    spent = time.monotonic() - started
                    raise InventoryLocked(
                        self.path,
                        f"{doing}: still busy after {attempt + 1} tries in {spent:.1f}s "
                        f"(busy_timeout_ms={self.config.busy_timeout_ms}, "
                        f"write_retries={retries})",
                    ) from None
                raise translate(e, self.path, doing) from None
        raise AssertionError("unreachable")

    def _reading(self, doing: str, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        if self.readonly:
            return self._read_ro(self._conn, doing, fn)
        try:
            return fn(self._conn)
        except sqlite3.Error as e:
            raise translate(e, self.path, doing) from None

    def _read_ro(
        self, conn: sqlite3.Connection, doing: str, fn: Callable[[sqlite3.Connection], Any]
    ) -> Any:
        """A read on a ``mode=ro`` connection. A hot journal left by a killed writer can
        only be rolled back by a writer: wait for one within the busy budget. A read of a
        file opened ``immutable=1`` stands only if no writer came while it was read (no
        ``-wal`` yet, the file as it was): else it is read again (:meth:`_thaw`) through
        a ``mode=ro`` connection, which sees the writer's WAL and takes its locks."""
        deadline = time.monotonic() + self._busy_s
        while True:
            try:
                got = fn(conn)
                if self._frozen is None or not self._moved():
                    return got
                conn = self._thaw()
                continue
            except sqlite3.Error as e:
                if self._frozen is not None and self._moved():
                    conn = self._thaw()
                    continue
                if not hot_journal(e, self.path):
                    raise translate(e, self.path, doing) from None
                if time.monotonic() >= deadline:
                    raise InventoryLocked(
                        self.path,
                        f"{doing}: an interrupted writer left a hot journal "
                        f"({self.path.name}-journal) that only a writer can roll back; "
                        "the next write to the inventory recovers it",
                    ) from None
                time.sleep(0.05)
