"""The shared SQLite inventory: the one place where ncclguard speaks SQL.

One :class:`Inventory` serves the daemon (``upsert``/``heartbeat``), the Slurm gate
(``Inventory(readonly=True).load(hosts)``) and the admin CLI (``classes``, ``nodes``,
``history``, ``fingerprint_at``, ``stale``). See docs/store.md for the schema, the
locking model and the failure modes.

The read-only path imports only the standard library: sqlite-utils is imported
lazily, where the schema is created or migrated, and the policy modules
(``prolog.compat``, ``prolog.transport``) only where a fingerprint is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sqlite3
import stat
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

from ncclguard.config import InventoryConfig, default_db_path

DEFAULT_HEARTBEAT_S = 300.0
DIR_MODE = 0o755  # readable by the gate's user (slurm) and admins, writable by the owner only
FILE_MODE = 0o644

# SQLite primary result codes (sqlite3.Error.sqlite_errorcode & 0xff)
_BUSY, _LOCKED, _READONLY, _IOERR, _CORRUPT, _FULL, _CANTOPEN, _NOTADB = 5, 6, 8, 10, 11, 13, 14, 26

# fields that change on every collection and so are not part of the fingerprint hash
_VOLATILE = (("host", "collected_at"),)


# --------------------------------------------------------------------------- errors


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


# --------------------------------------------------------------------------- values


class NodeRecord(NamedTuple):
    host: str
    fingerprint: dict[str, Any]
    fp_hash: str
    compat_key: str
    first_seen: float
    collected_at: float
    last_heartbeat: float


class CompatClass(NamedTuple):
    compat_key: str
    values: dict[str, Any]
    hosts: list[str]


# --------------------------------------------------------------------------- schema

# Each migration takes the schema from version i to i+1. They run inside one
# BEGIN IMMEDIATE transaction together with the user_version bump, so a
# migration runs exactly once even when many writers start on a fresh file.


def _migrate_0_to_1(conn: sqlite3.Connection) -> None:
    from sqlite_utils import Database  # lazy: only writers that create/migrate need it

    db = Database(conn, recursive_triggers=False, execute_plugins=False)
    tables: list[tuple[str, dict[str, type], Any]] = [
        (
            "nodes",
            {
                "host": str, "fp_hash": str, "compat_key": str, "compat_values": str,
                "fingerprint": str, "first_seen": float, "collected_at": float,
                "last_heartbeat": float, "last_change": float,
                "nccl_version": str, "nccl_versions": str, "net_plugin": str,
                "net_plugin_name": str, "net_abi": int, "transport": str,
                "rdma_ports_up": int, "rdma_ports_total": int, "driver": str,
                "error_count": int,
            },
            "host",
        ),
        (
            "libraries",
            {
                "host": str, "path": str, "realpath": str, "version": str,
                "version_code": int, "cuda_version": str, "sha256": str, "is_default": int,
            },
            ("host", "path"),
        ),
        (
            "plugins",
            {
                "host": str, "kind": str, "path": str, "name": str, "abi": int,
                "abis": str, "is_default": int, "error": str,
            },
            ("host", "kind", "path"),
        ),
        (
            "rdma_ports",
            {
                "host": str, "device": str, "port": int, "state": str, "rate_gbps": float,
                "link_layer": str, "fw_ver": str, "hca_type": str,
            },
            ("host", "device", "port"),
        ),
        (
            "history",
            {
                "id": int, "host": str, "at": float, "old_hash": str, "new_hash": str,
                "diff": str, "fingerprint": str,
            },
            "id",
        ),
    ]
    not_null = {
        "nodes": ["fp_hash", "compat_key", "compat_values", "fingerprint", "first_seen",
                  "collected_at", "last_heartbeat", "last_change"],
        "history": ["host", "at", "new_hash", "diff", "fingerprint"],
    }
    for name, columns, pk in tables:
        conn.execute(db.create_table_sql(name, columns, pk=pk, not_null=not_null.get(name)))
    for sql in (
        "CREATE INDEX idx_nodes_compat_key ON nodes (compat_key)",
        "CREATE INDEX idx_nodes_last_heartbeat ON nodes (last_heartbeat)",
        "CREATE INDEX idx_libraries_version ON libraries (version)",
        "CREATE INDEX idx_history_host ON history (host, id)",
        "CREATE INDEX idx_history_at ON history (at)",
    ):
        conn.execute(sql)


def _migrate_1_to_2(conn: sqlite3.Connection) -> None:
    """Add the gate's narrow tables: ``gate_nodes`` and ``policy_values``.

    The gate loads up to 16,384 nodes per job. Reading them from ``nodes`` cost it
    seconds: every column stored after the fingerprint sits behind that blob's overflow
    pages. ``gate_nodes`` holds per host only the key of its policy values
    (:func:`prolog.policy.node_values`) and its heartbeat; ``policy_values`` holds each
    distinct record once, so the gate decodes one record per class, not per node.
    Existing rows are backfilled.
    """
    conn.execute(
        "CREATE TABLE gate_nodes (host TEXT PRIMARY KEY, policy_key TEXT NOT NULL, "
        "last_heartbeat REAL NOT NULL, values_version INTEGER NOT NULL) WITHOUT ROWID"
    )
    conn.execute("CREATE INDEX idx_gate_nodes_policy_key ON gate_nodes (policy_key)")
    conn.execute(
        "CREATE TABLE policy_values (policy_key TEXT PRIMARY KEY, policy_values TEXT NOT NULL) "
        "WITHOUT ROWID"
    )
    rows = conn.execute("SELECT host, fingerprint, last_heartbeat FROM nodes").fetchall()
    for host, fp_json, heartbeat in rows:
        try:
            fp = json.loads(fp_json)
        except ValueError:
            continue  # an unreadable fingerprint: the gate sees no record, i.e. unknown
        _write_gate_row(conn, host, _policy_values(fp), heartbeat)


def _policy_values(fp: dict[str, Any]) -> tuple[str, str]:
    """``(key, canonical JSON)`` of what the policy reads of one fingerprint."""
    import hashlib  # writers only: the gate's read path does not pay for OpenSSL

    from prolog.compat import VALUES_VERSION
    from prolog.policy import node_values

    text = canonical_json(node_values(fp))
    key = hashlib.sha256(f"{VALUES_VERSION}:{text}".encode()).hexdigest()[:32]
    return key, text


def _write_gate_row(
    conn: sqlite3.Connection, host: str, values: tuple[str, str], heartbeat: float
) -> None:
    from prolog.compat import VALUES_VERSION

    key, text = values
    old = conn.execute("SELECT policy_key FROM gate_nodes WHERE host = ?", (host,)).fetchone()
    conn.execute("INSERT OR IGNORE INTO policy_values VALUES (?, ?)", (key, text))
    conn.execute(
        "INSERT OR REPLACE INTO gate_nodes VALUES (?, ?, ?, ?)",
        (host, key, heartbeat, VALUES_VERSION),
    )
    if old is not None and old[0] != key:  # drop a record that no node uses any more
        conn.execute(
            "DELETE FROM policy_values WHERE policy_key = ? AND NOT EXISTS "
            "(SELECT 1 FROM gate_nodes WHERE policy_key = ?)",
            (old[0], old[0]),
        )


MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_migrate_0_to_1, _migrate_1_to_2)
SCHEMA_VERSION = len(MIGRATIONS)


# --------------------------------------------------------------------------- helpers


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _without_volatile(fp: dict[str, Any]) -> dict[str, Any]:
    out = dict(fp)
    for section, key in _VOLATILE:
        sub = out.get(section)
        if isinstance(sub, dict) and key in sub:
            out[section] = {k: v for k, v in sub.items() if k != key}
    return out


def fingerprint_hash(fp: dict[str, Any]) -> str:
    """sha256 of the canonical JSON, without the fields that change every collection."""
    import hashlib  # writers only: the gate's read path does not pay for OpenSSL

    return hashlib.sha256(canonical_json(_without_volatile(fp)).encode()).hexdigest()


_LIST_KEYS = ("path", "name", "port")


def _list_key(items: list[Any]) -> str | None:
    if not items or not all(isinstance(i, dict) for i in items):
        return None
    for k in _LIST_KEYS:
        keys = [i.get(k) for i in items]
        if all(v is not None for v in keys) and len(set(map(str, keys))) == len(keys):
            return k
    return None


def fingerprint_diff(old: Any, new: Any, prefix: str = "") -> list[dict[str, Any]]:
    """Field-level diff: ``[{"field": "libnccl[/usr/lib/libnccl.so.2].version", "old", "new"}]``.

    Lists of objects are matched by their ``path``/``name``/``port``; other lists are
    compared as one value. ``host.collected_at`` is ignored.
    """
    if prefix == "" and isinstance(old, dict) and isinstance(new, dict):
        old, new = _without_volatile(old), _without_volatile(new)
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[dict[str, Any]] = []
        for k in sorted(set(old) | set(new), key=str):
            p = f"{prefix}.{k}" if prefix else str(k)
            if k not in old:
                out.append({"field": p, "old": None, "new": new[k]})
            elif k not in new:
                out.append({"field": p, "old": old[k], "new": None})
            else:
                out.extend(fingerprint_diff(old[k], new[k], p))
        return out
    if isinstance(old, list) and isinstance(new, list):
        ko, kn = _list_key(old), _list_key(new)
        if ko is not None and ko == kn:
            om = {str(i[ko]): i for i in old}
            nm = {str(i[ko]): i for i in new}
            out = []
            for k in sorted(set(om) | set(nm)):
                p = f"{prefix}[{k}]"
                out.extend(fingerprint_diff(om.get(k), nm.get(k), p))
            return out
    if old != new:
        return [{"field": prefix, "old": old, "new": new}]
    return []


def _epoch(iso: Any, default: float) -> float:
    if isinstance(iso, str):
        try:
            return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return default
    return default


def _host_of(fp: dict[str, Any]) -> str:
    host = fp.get("host") if isinstance(fp, dict) else None
    name = host.get("hostname") if isinstance(host, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError("fingerprint has no host.hostname")
    return name


def _derive(fp: dict[str, Any]) -> dict[str, Any]:
    """The compatibility key and the query columns of one fingerprint."""
    from prolog.compat import compat_key, compat_values  # the policy owns these
    from prolog.transport import effective_transport

    libs = [x for x in fp.get("libnccl") or [] if isinstance(x, dict)]
    plugins = [x for x in fp.get("plugins") or [] if isinstance(x, dict)]
    net = fp.get("net") if isinstance(fp.get("net"), dict) else {}
    rdma = fp.get("rdma") if isinstance(fp.get("rdma"), dict) else {}
    gpu = fp.get("gpu") if isinstance(fp.get("gpu"), dict) else {}
    default_lib = next((x for x in libs if x.get("default")), None)
    versions = sorted({str(x["version"]) for x in libs if x.get("version")})
    net_plugin = net.get("plugin")
    plugin_row = next(
        (p for p in plugins if p.get("kind") == "net" and p.get("path") == net_plugin), None
    )
    ports = [
        port
        for dev in rdma.get("devices") or []
        if isinstance(dev, dict)
        for port in dev.get("ports") or []
        if isinstance(port, dict)
    ]
    transport = effective_transport(fp)
    values = compat_values(fp)
    return {
        "compat_key": str(compat_key(fp)),
        "compat_values": canonical_json(values),
        "nccl_version": default_lib.get("version") if default_lib else None,
        "nccl_versions": ",".join(versions),
        "net_plugin": net_plugin,
        "net_plugin_name": plugin_row.get("name") if plugin_row else None,
        "net_abi": values.get("net_abi") if isinstance(values, dict) else None,
        "transport": None if transport is None else str(transport),
        "rdma_ports_up": sum(
            1 for p in ports if p.get("state_code") == 4 or p.get("state") == "ACTIVE"
        ),
        "rdma_ports_total": len(ports),
        "driver": gpu.get("driver_version"),
        "error_count": len(fp.get("errors") or []),
    }


def _max_abi(abis: Any, kind: Any) -> int | None:
    if isinstance(abis, dict):
        vals = [v for v in abis.get(kind) or [] if isinstance(v, int)]
        return max(vals) if vals else None
    return None


def _detail_rows(host: str, fp: dict[str, Any]) -> dict[str, list[tuple[Any, ...]]]:
    libs = [
        (host, x.get("path"), x.get("realpath"), x.get("version"), x.get("version_code"),
         x.get("cuda_version"), x.get("sha256"), int(bool(x.get("default"))))
        for x in fp.get("libnccl") or [] if isinstance(x, dict) and x.get("path")
    ]
    plugins = [
        (host, x.get("kind") or "", x.get("path"), x.get("name"),
         _max_abi(x.get("abis"), x.get("kind")), canonical_json(x.get("abis")),
         int(bool(x.get("default"))), x.get("error"))
        for x in fp.get("plugins") or [] if isinstance(x, dict) and x.get("path")
    ]
    rdma = fp.get("rdma") if isinstance(fp.get("rdma"), dict) else {}
    ports = [
        (host, dev.get("name"), p.get("port"), p.get("state"), p.get("rate_gbps"),
         p.get("link_layer"), dev.get("fw_ver"), dev.get("hca_type"))
        for dev in rdma.get("devices") or [] if isinstance(dev, dict) and dev.get("name")
        for p in dev.get("ports") or [] if isinstance(p, dict) and p.get("port") is not None
    ]
    # a fingerprint with duplicate keys must not abort the write: the last one wins
    return {
        "libraries": list({r[:2]: r for r in libs}.values()),
        "plugins": list({r[:3]: r for r in plugins}.values()),
        "rdma_ports": list({r[:3]: r for r in ports}.values()),
    }


_DETAIL_INSERT = {
    "libraries": "INSERT INTO libraries (host, path, realpath, version, version_code, "
    "cuda_version, sha256, is_default) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
    "plugins": "INSERT INTO plugins (host, kind, path, name, abi, abis, is_default, error) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
    "rdma_ports": "INSERT INTO rdma_ports (host, device, port, state, rate_gbps, link_layer, "
    "fw_ver, hca_type) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
}
_DETAIL_DELETE = {
    "libraries": "DELETE FROM libraries WHERE host = ?",
    "plugins": "DELETE FROM plugins WHERE host = ?",
    "rdma_ports": "DELETE FROM rdma_ports WHERE host = ?",
}

# nodes(where=...): the only columns a caller may filter on (identifiers never come
# from the caller), and the one computed filter.
NODE_COLUMNS = (
    "host", "nccl_version", "nccl_versions", "net_plugin", "net_plugin_name", "net_abi",
    "transport", "rdma_ports_up", "rdma_ports_total", "driver", "last_heartbeat",
    "error_count", "compat_key",
)
_WHERE_COLUMNS = {c: f"n.{c}" for c in NODE_COLUMNS}
_HAS_NCCL = "has_nccl"  # any libnccl on the node has this version


def _check_safe(path: Path) -> None:
    """Refuse a database, or a directory holding one, that others can write (as ssh does)."""
    for p, what in ((path, "the file"), (path.parent, f"its directory {path.parent}")):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise InventoryError(path, f"cannot stat {p}: {e.strerror or e}") from None
        if st.st_mode & stat.S_IWOTH:
            raise InventoryUnsafe(path, f"{what} has mode {stat.filemode(st.st_mode)}")


def _uri(path: Path, mode: str) -> str:
    return f"file:{urllib.parse.quote(str(path))}?mode={mode}"


def _translate(e: sqlite3.Error, path: Path, doing: str) -> InventoryError:
    code = (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF
    msg = f"{doing}: {e}"
    if code in (_CORRUPT, _NOTADB) or "not a database" in str(e) or "malformed" in str(e):
        return InventoryCorrupt(path, msg)
    if code in (_BUSY, _LOCKED) or "locked" in str(e):
        return InventoryLocked(path, msg)
    if code == _READONLY or "readonly" in str(e):
        return InventoryReadOnly(path, msg)
    if code == _FULL or "disk is full" in str(e):
        return InventoryFull(path, msg)
    if code == _CANTOPEN and not path.parent.is_dir():
        return InventoryMissing(path, f"{doing}: directory {path.parent} does not exist")
    return InventoryError(path, msg)


_READONLY_ROLLBACK = _READONLY | (3 << 8)


def _hot_journal(e: sqlite3.Error, path: Path) -> bool:
    """A read-only connection met the hot journal of an interrupted writer."""
    if (getattr(e, "sqlite_errorcode", 0) or 0) == _READONLY_ROLLBACK:
        return True
    return "readonly" in str(e) and path.with_name(path.name + "-journal").exists()


def _busy(e: sqlite3.Error) -> bool:
    code = (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF
    return code in (_BUSY, _LOCKED) or "database is locked" in str(e)


def _chunks(items: list[str], n: int = 30000) -> Iterator[list[str]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


# --------------------------------------------------------------------------- inventory


class Inventory:
    """The node inventory in one SQLite file.

    ``readonly=True`` opens the file with ``mode=ro`` and never creates, migrates or
    writes anything (the gate, the CLI's queries). Otherwise the directory and file are
    created with safe modes when missing and the schema is migrated to the current
    version. Every write is one short ``BEGIN IMMEDIATE`` transaction, retried with
    jittered backoff while the database is busy.
    """

    def __init__(
        self,
        path: Path | str | None = None,
        *,
        readonly: bool = False,
        config: InventoryConfig | None = None,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    ) -> None:
        self.config = config or InventoryConfig()
        self.path = Path(path) if path is not None else self.config.db_path()
        self.readonly = readonly
        self.heartbeat_s = heartbeat_s
        self._busy_s = max(self.config.busy_timeout_ms, 0) / 1000.0
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
        try:
            conn = sqlite3.connect(
                _uri(path, "ro"), uri=True, timeout=self._busy_s, isolation_level=None,
                check_same_thread=False,
            )
        except sqlite3.Error as e:
            raise _translate(e, path, "open") from None
        def probe(c: sqlite3.Connection) -> int:
            version = int(c.execute("PRAGMA user_version").fetchone()[0])
            c.execute("SELECT count(*) FROM sqlite_master").fetchone()
            return version

        try:
            version = self._read_ro(conn, "open", probe)
        except InventoryError:
            conn.close()
            raise
        if version == 0:
            conn.close()
            raise InventoryMissing(path, "empty database: no inventoryd has written to it yet")
        self._check_version(conn, version)
        return conn

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
        try:
            conn = sqlite3.connect(
                _uri(path, "rw"), uri=True, timeout=self._busy_s, isolation_level=None,
                check_same_thread=False,
            )
        except sqlite3.Error as e:
            raise _translate(e, path, "open") from None
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            self._check_version(conn, version, migrate_ok=True)
            self._set_journal_mode(conn)
            if version < SCHEMA_VERSION:
                self._retrying(conn, self._migrate, "migrate the schema")
        except InventoryError:
            conn.close()
            raise
        except sqlite3.Error as e:
            conn.close()
            raise _translate(e, path, "open") from None
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
            if not _busy(e):
                raise
            # switching needs the database to ourselves; the next open tries again

    def _migrate(self, conn: sqlite3.Connection) -> str:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise InventoryCorrupt(self.path, f"schema version {version} appeared during migration")
        for step in MIGRATIONS[version:]:
            step(conn)
        conn.execute(f"PRAGMA user_version = {int(SCHEMA_VERSION)}")
        return "migrated"

    # ---- plumbing

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Inventory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_rw(self) -> None:
        if self.readonly:
            raise InventoryReadOnly(self.path, "opened read-only")

    def _retrying(
        self, conn: sqlite3.Connection, body: Callable[[sqlite3.Connection], str], doing: str
    ) -> str:
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
                if _busy(e) and attempt < retries:
                    time.sleep(min(0.02 * 2**attempt, 1.0) * random.uniform(0.5, 1.5))
                    continue
                if _busy(e):
                    spent = time.monotonic() - started
                    raise InventoryLocked(
                        self.path,
                        f"{doing}: still busy after {attempt + 1} tries in {spent:.1f}s "
                        f"(busy_timeout_ms={self.config.busy_timeout_ms}, "
                        f"write_retries={retries})",
                    ) from None
                raise _translate(e, self.path, doing) from None
        raise AssertionError("unreachable")

    def _reading(self, doing: str, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        if self.readonly:
            return self._read_ro(self._conn, doing, fn)
        try:
            return fn(self._conn)
        except sqlite3.Error as e:
            raise _translate(e, self.path, doing) from None

    def _read_ro(
        self, conn: sqlite3.Connection, doing: str, fn: Callable[[sqlite3.Connection], Any]
    ) -> Any:
        """A read on a ``mode=ro`` connection. A hot journal left by a killed writer can
        only be rolled back by a writer: wait for one within the busy budget."""
        deadline = time.monotonic() + self._busy_s
        while True:
            try:
                return fn(conn)
            except sqlite3.Error as e:
                if not _hot_journal(e, self.path):
                    raise _translate(e, self.path, doing) from None
                if time.monotonic() >= deadline:
                    raise InventoryLocked(
                        self.path,
                        f"{doing}: an interrupted writer left a hot journal "
                        f"({self.path.name}-journal) that only a writer can roll back; "
                        "the next write to the inventory recovers it",
                    ) from None
                time.sleep(0.05)

    # ---- writing

    def upsert(self, fp: dict[str, Any], now: float | None = None) -> str:
        """Store one node's fingerprint.

        Returns "inserted" (a new node), "changed" (a new fingerprint: the node row, its
        query rows and a history row are written together), "heartbeat" (the same
        fingerprint, and ``heartbeat_s`` has passed, or the writer's clock went back)
        or "unchanged" (nothing written).
        """
        self._require_rw()
        now = time.time() if now is None else float(now)
        host = _host_of(fp)
        h = fingerprint_hash(fp)
        collected = _epoch((fp.get("host") or {}).get("collected_at"), now)

        from prolog.compat import VALUES_VERSION

        # a cheap read first: most cycles write nothing and need no write lock
        current = (
            "SELECT n.fp_hash, n.last_heartbeat, g.values_version FROM nodes n "
            "LEFT JOIN gate_nodes g ON g.host = n.host WHERE n.host = ?"
        )
        try:
            row = self._conn.execute(current, (host,)).fetchone()
        except sqlite3.Error as e:
            if not _busy(e):
                raise _translate(e, self.path, "read the node") from None
            row = None  # decide under the write lock below
        if (
            row is not None and row[0] == h and row[2] == VALUES_VERSION
            and not self._heartbeat_due(row[1], now)
        ):
            return "unchanged"

        derived: dict[str, Any] | None = None
        gate_values: tuple[str, str] | None = None

        def body(conn: sqlite3.Connection) -> str:
            nonlocal derived, gate_values
            cur = conn.execute(current, (host,)).fetchone()
            if derived is None and (cur is None or cur[0] != h or cur[2] != VALUES_VERSION):
                derived = _derive(fp)
                gate_values = _policy_values(fp)
            if cur is not None and cur[0] == h:
                stale_values = cur[2] != VALUES_VERSION
                if not stale_values and not self._heartbeat_due(cur[1], now):
                    return "unchanged"
                conn.execute(
                    "UPDATE nodes SET last_heartbeat = ?, collected_at = ? WHERE host = ?",
                    (now, collected, host),
                )
                if stale_values:  # written by an older policy: derive them again
                    assert derived is not None and gate_values is not None
                    names = list(derived)
                    conn.execute(
                        f"UPDATE nodes SET {', '.join(f'{n} = ?' for n in names)} "  # noqa: S608 - fixed names
                        "WHERE host = ?",
                        (*derived.values(), host),
                    )
                    _write_gate_row(conn, host, gate_values, now)
                else:
                    conn.execute(
                        "UPDATE gate_nodes SET last_heartbeat = ? WHERE host = ?", (now, host)
                    )
                return "heartbeat"
            assert derived is not None and gate_values is not None
            fp_json = canonical_json(fp)
            cols = {
                "fp_hash": h, "fingerprint": fp_json, "collected_at": collected,
                "last_heartbeat": now, "last_change": now, **derived,
            }
            names = list(cols)
            if cur is None:
                conn.execute(
                    f"INSERT INTO nodes (host, first_seen, {', '.join(names)}) "  # noqa: S608 - fixed names
                    f"VALUES (?, ?, {', '.join('?' for _ in names)})",
                    (host, now, *cols.values()),
                )
                diff: list[dict[str, Any]] = []
                old_hash = None
            else:
                (old_json,) = conn.execute(
                    "SELECT fingerprint FROM nodes WHERE host = ?", (host,)
                ).fetchone()
                conn.execute(
                    f"UPDATE nodes SET {', '.join(f'{n} = ?' for n in names)} "  # noqa: S608 - fixed names
                    "WHERE host = ?",
                    (*cols.values(), host),
                )
                try:
                    diff = fingerprint_diff(json.loads(old_json), fp)
                except ValueError:
                    diff = [{"field": "", "old": None, "new": "(previous fingerprint unreadable)"}]
                old_hash = cur[0]
            for table, rows in _detail_rows(host, fp).items():
                conn.execute(_DETAIL_DELETE[table], (host,))
                if rows:
                    conn.executemany(_DETAIL_INSERT[table], rows)
            _write_gate_row(conn, host, gate_values, now)
            conn.execute(
                "INSERT INTO history (host, at, old_hash, new_hash, diff, fingerprint) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (host, now, old_hash, h, canonical_json(diff), fp_json),
            )
            return "inserted" if cur is None else "changed"

        return self._retrying(self._conn, body, f"write {host}")

    def _heartbeat_due(self, last: float | None, now: float) -> bool:
        if last is None:
            return True
        # a clock that went back is a heartbeat too: the row then shows the writer's clock
        return now - last >= self.heartbeat_s or now < last

    def heartbeat(self, host: str, now: float | None = None) -> bool:
        """Confirm a node's current record. False if the node is not in the inventory."""
        self._require_rw()
        now = time.time() if now is None else float(now)

        def body(conn: sqlite3.Connection) -> str:
            cur = conn.execute("UPDATE nodes SET last_heartbeat = ? WHERE host = ?", (now, host))
            conn.execute("UPDATE gate_nodes SET last_heartbeat = ? WHERE host = ?", (now, host))
            return "heartbeat" if cur.rowcount else "unknown"

        return self._retrying(self._conn, body, f"heartbeat {host}") == "heartbeat"

    # ---- reading

    def load(self, hosts: Iterable[str]) -> dict[str, NodeRecord | None]:
        """The current record of each host (None for a host the inventory does not know)."""
        wanted = list(dict.fromkeys(hosts))
        out: dict[str, NodeRecord | None] = dict.fromkeys(wanted)

        def q(conn: sqlite3.Connection) -> None:
            for chunk in _chunks(wanted):
                rows = conn.execute(
                    "SELECT host, fingerprint, fp_hash, compat_key, first_seen, collected_at, "
                    "last_heartbeat FROM nodes WHERE host IN (SELECT value FROM json_each(?))",
                    (json.dumps(chunk),),
                )
                for host, fpj, h, ck, first, coll, hb in rows:
                    out[host] = NodeRecord(host, json.loads(fpj), h, ck, first, coll, hb)

        self._reading("load nodes", q)
        return out

    def load_values(self, hosts: Iterable[str]) -> dict[str, tuple[dict, float] | None]:
        """The gate's read: per host, ``(policy values, last heartbeat)`` or None.

        The values are :func:`prolog.policy.node_values` records, stored at write time
        in the narrow ``gate_nodes`` / ``policy_values`` tables. Nodes with equal records
        share one decoded dict, so that an allocation of 1,024 identical nodes costs one
        ``json.loads`` here and one comparison in the policy.

        A record written by another :data:`prolog.compat.VALUES_VERSION` (a node whose
        daemon has not run since an upgrade), or one that cannot be decoded, is never
        trusted: its values are computed again from the stored fingerprint (slower, for
        those nodes only). A node whose fingerprint cannot be read either is returned as
        None, i.e. unknown.
        """
        from prolog.compat import VALUES_VERSION
        from prolog.policy import NODE_VALUES, node_values

        wanted = list(dict.fromkeys(hosts))
        out: dict[str, tuple[dict, float] | None] = dict.fromkeys(wanted)

        def q(conn: sqlite3.Connection) -> None:
            rows: list[tuple[str, str, float, int]] = []
            for chunk in _chunks(wanted):
                rows += conn.execute(
                    "SELECT host, policy_key, last_heartbeat, values_version FROM gate_nodes "
                    "WHERE host IN (SELECT value FROM json_each(?))",
                    (json.dumps(chunk),),
                ).fetchall()
            keys = list({key for _, key, _, version in rows if version == VALUES_VERSION})
            decoded: dict[str, dict] = {}
            for key, text in conn.execute(
                "SELECT policy_key, policy_values FROM policy_values "
                "WHERE policy_key IN (SELECT value FROM json_each(?))",
                (json.dumps(keys),),
            ):
                try:
                    values = json.loads(text)
                except ValueError:
                    continue
                if isinstance(values, dict) and NODE_VALUES in values:
                    decoded[key] = values
            redo: dict[str, float] = {}
            for host, key, heartbeat, _version in rows:
                values = decoded.get(key)
                if values is None:
                    redo[host] = heartbeat
                else:
                    out[host] = (values, heartbeat)
            if redo:
                for host, text in conn.execute(
                    "SELECT host, fingerprint FROM nodes "
                    "WHERE host IN (SELECT value FROM json_each(?))",
                    (json.dumps(list(redo)),),
                ):
                    with contextlib.suppress(ValueError):  # unreadable too: None (unknown)
                        out[host] = (node_values(json.loads(text)), redo[host])

        self._reading("load nodes", q)
        return out

    def classes(self, hosts: Iterable[str] | None = None) -> list[CompatClass]:
        """Nodes grouped by compatibility key, largest class first."""
        def q(conn: sqlite3.Connection) -> list[tuple[str, str, str]]:
            if hosts is None:
                return conn.execute(
                    "SELECT compat_key, compat_values, host FROM nodes ORDER BY compat_key, host"
                ).fetchall()
            return conn.execute(
                "SELECT compat_key, compat_values, host FROM nodes "
                "WHERE host IN (SELECT value FROM json_each(?)) ORDER BY compat_key, host",
                (json.dumps(list(hosts)),),
            ).fetchall()

        groups: dict[str, CompatClass] = {}
        for key, values, host in self._reading("load classes", q):
            cls = groups.get(key)
            if cls is None:
                cls = groups[key] = CompatClass(key, json.loads(values), [])
            cls.hosts.append(host)
        return sorted(groups.values(), key=lambda c: (-len(c.hosts), c.compat_key))

    def nodes(self, where: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Rows from the query tables, filtered by equality on the columns in NODE_COLUMNS.

        ``{"has_nccl": "2.21.5"}`` matches nodes where any libnccl has that version. A
        value of None matches NULL; a list or tuple matches any of its values.
        """
        clauses: list[str] = []
        params: list[Any] = []
        for key, value in (where or {}).items():
            if key == _HAS_NCCL:
                clauses.append(
                    "EXISTS (SELECT 1 FROM libraries l WHERE l.host = n.host AND l.version = ?)"
                )
                params.append(value)
                continue
            col = _WHERE_COLUMNS.get(key)
            if col is None:
                known = ", ".join([*NODE_COLUMNS, _HAS_NCCL])
                raise ValueError(f"nodes(where=...): unknown field {key!r} (known: {known})")
            if value is None:
                clauses.append(f"{col} IS NULL")
            elif isinstance(value, list | tuple | set | frozenset):
                clauses.append(f"{col} IN (SELECT value FROM json_each(?))")  # noqa: S608
                params.append(json.dumps(list(value)))
            else:
                clauses.append(f"{col} = ?")
                params.append(value)
        sql = f"SELECT {', '.join(_WHERE_COLUMNS.values())} FROM nodes n"  # noqa: S608 - fixed
        if clauses:
            sql += " WHERE " + " AND ".join(clauses)
        sql += " ORDER BY n.host"
        rows = self._reading("query nodes", lambda c: c.execute(sql, params).fetchall())
        out = []
        for row in rows:
            d = dict(zip(NODE_COLUMNS, row, strict=True))
            d["nccl_versions"] = [v for v in (d["nccl_versions"] or "").split(",") if v]
            out.append(d)
        return out

    def history(self, host: str | None = None, since: float | None = None) -> list[dict[str, Any]]:
        """Fingerprint changes in write order: id, host, at, old_hash, new_hash, diff."""
        clauses, params = [], []
        if host is not None:
            clauses.append("host = ?")
            params.append(host)
        if since is not None:
            clauses.append("at >= ?")
            params.append(since)
        sql = "SELECT id, host, at, old_hash, new_hash, diff FROM history"
        if clauses:
            sql += " WHERE " + " AND ".join(clauses)
        sql += " ORDER BY id"
        rows = self._reading("read history", lambda c: c.execute(sql, params).fetchall())
        return [
            {"id": i, "host": h, "at": at, "old_hash": o, "new_hash": n, "diff": json.loads(d)}
            for i, h, at, o, n, d in rows
        ]

    def fingerprint_at(self, host: str, when: float) -> dict[str, Any] | None:
        """The fingerprint a node had at ``when``: the newest change written at or before it.

        Rows are taken in write order, so a writer whose clock went back does not hide its
        newer changes behind older timestamps.
        """
        row = self._reading(
            "read history",
            lambda c: c.execute(
                "SELECT fingerprint FROM history WHERE host = ? AND at <= ? "
                "ORDER BY id DESC LIMIT 1",
                (host, when),
            ).fetchone(),
        )
        return json.loads(row[0]) if row else None

    def stale(self, now: float, ttl: float) -> list[str]:
        """Hosts whose last heartbeat is older than ``ttl`` seconds at ``now``."""
        rows = self._reading(
            "query stale nodes",
            lambda c: c.execute(
                "SELECT host FROM nodes WHERE last_heartbeat < ? ORDER BY host", (now - ttl,)
            ).fetchall(),
        )
        return [r[0] for r in rows]

    def hosts(self) -> list[str]:
        rows = self._reading(
            "list hosts", lambda c: c.execute("SELECT host FROM nodes ORDER BY host").fetchall()
        )
        return [r[0] for r in rows]

    def integrity_check(self) -> str:
        """``PRAGMA integrity_check``: "ok" or SQLite's list of problems."""
        rows = self._reading(
            "check integrity", lambda c: c.execute("PRAGMA integrity_check").fetchall()
        )
        return "\n".join(r[0] for r in rows)

    def schema_version(self) -> int:
        return int(
            self._reading("read version", lambda c: c.execute("PRAGMA user_version").fetchone()[0])
        )
