"""The node inventory: the one place where ncclguard speaks SQL.

One :class:`Inventory` serves the daemon (``upsert``/``heartbeat``), the Slurm gate
(``Inventory(readonly=True, values=GATE_VALUES).load_values(hosts)``) and the admin CLI
(``classes``, ``nodes``, ``history``, ``fingerprint_at``, ``stale``). See docs/store.md
for the schema, the locking model and the failure modes.

The read-only path imports only the standard library and the fingerprint model:
sqlite-utils is imported lazily, where the schema is created or migrated. What the
policy derives of a fingerprint (``GATE_VALUES``) is handed in by the caller.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ncclguard.config import InventoryConfig
from ncclguard.fingerprint.model import hostname
from ncclguard.store.connection import Database, chunks
from ncclguard.store.errors import busy, translate
from ncclguard.store.schema import GateValues, gate_record, write_gate_row

__all__ = [
    "DEFAULT_HEARTBEAT_S", "CompatClass", "Inventory", "NodeRecord", "Published", "Rejected",
]

DEFAULT_HEARTBEAT_S = 300.0


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


_CURRENT = (
    "SELECT n.fp_hash, n.last_heartbeat, g.values_version, n.errors_hash FROM nodes n "
    "LEFT JOIN gate_nodes g ON g.host = n.host WHERE n.host = ?"
)


class Published(NamedTuple):
    """One record the collector accepted: the fingerprint, and where it came from."""

    fingerprint: Mapping[str, Any]
    at: float  # the node's heartbeat: the credential's encode time (never in the future)
    file: str
    file_state: str  # the file's identity when read ("ino:size:mtime_ns")
    digest: str  # SHA-256 of the credential
    origin: str
    uid: int
    encoded_at: float = 0.0  # the credential's encode time, as signed
    seq: int = 0  # the publisher's signed sequence: orders records of one second


class Rejected(NamedTuple):
    """One record the collector rejected (``ncclguard.spool.CAUSES`` names the causes)."""

    file: str
    cause: str
    host: str | None
    detail: str
    file_state: str


def _database_failure(e: Exception) -> bool:
    """An error of the database itself (busy, full, I/O, damaged), as opposed to a value
    that cannot be bound or a constraint that one record breaks."""
    if isinstance(e, sqlite3.ProgrammingError):  # a value of a type SQLite cannot bind
        return "binding parameter" not in str(e)  # ... or a closed connection
    return isinstance(e, sqlite3.DatabaseError) and not isinstance(
        e, sqlite3.IntegrityError | sqlite3.DataError
    )


class _NodeWrite:
    """One fingerprint's write, decided under the write lock (``upsert`` and ``ingest``).

    The derived rows are computed once, and only when the row is new or changed: a
    heartbeat costs one read and two UPDATEs.
    """

    def __init__(
        self, fp: dict[str, Any], host: str, fp_hash: str, now: float, values: GateValues
    ) -> None:
        from ncclguard.timeparse import parse_iso

        self.fp, self.host, self.hash, self.now, self.values = fp, host, fp_hash, now, values
        host_part = fp.get("host")
        collected = parse_iso(host_part.get("collected_at") if isinstance(host_part, dict)
                              else None)
        self.collected = now if collected is None else collected
        self._derived: tuple[dict[str, Any], tuple[str, str]] | None = None

    def derived(self) -> tuple[dict[str, Any], tuple[str, str]]:
        if self._derived is None:
            from ncclguard.store.rows import derive

            self._derived = (derive(self.fp), gate_record(self.values, self.fp))
        return self._derived

    def write(self, conn: sqlite3.Connection, heartbeat_due: Callable[[float | None, float], bool]
              ) -> str:
        from ncclguard.fingerprint.canonical import (
            canonical_json,
            errors_hash,
            fingerprint_diff,
        )
        from ncclguard.store.rows import DETAIL_DELETE, DETAIL_INSERT, detail_rows

        host, h, now, version = self.host, self.hash, self.now, self.values.version
        cur = conn.execute(_CURRENT, (host,)).fetchone()
        e_hash = errors_hash(self.fp)
        if cur is not None and cur[0] == h:
            stale_values = cur[2] != version
            new_errors = cur[3] != e_hash
            if not stale_values and not new_errors and not heartbeat_due(cur[1], now):
                return "unchanged"
            conn.execute(
                "UPDATE nodes SET last_heartbeat = ?, collected_at = ? WHERE host = ?",
                (now, self.collected, host),
            )
            if new_errors:  # the same stack, other errors: shown, not a change (no history)
                conn.execute(
                    "UPDATE nodes SET fingerprint = ?, error_count = ?, errors_hash = ? "
                    "WHERE host = ?",
                    (canonical_json(self.fp), len(self.fp.get("errors") or []), e_hash, host),
                )
            if stale_values:  # written by an older policy: derive them again
                derived, gate_values = self.derived()
                names = list(derived)
                conn.execute(
                    f"UPDATE nodes SET {', '.join(f'{n} = ?' for n in names)} "  # noqa: S608 - fixed names
                    "WHERE host = ?",
                    (*derived.values(), host),
                )
                write_gate_row(conn, host, gate_values, now, version)
            else:
                conn.execute(
                    "UPDATE gate_nodes SET last_heartbeat = ? WHERE host = ?", (now, host)
                )
            return "heartbeat"
        derived, gate_values = self.derived()
        fp_json = canonical_json(self.fp)
        cols = {
            "fp_hash": h, "fingerprint": fp_json, "collected_at": self.collected,
            "last_heartbeat": now, "last_change": now, "errors_hash": e_hash, **derived,
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
                diff = fingerprint_diff(json.loads(old_json), self.fp)
            except ValueError:
                diff = [{"field": "", "old": None, "new": "(previous fingerprint unreadable)"}]
            old_hash = cur[0]
        for table, rows in detail_rows(host, self.fp).items():
            conn.execute(DETAIL_DELETE[table], (host,))
            if rows:
                conn.executemany(DETAIL_INSERT[table], rows)
        write_gate_row(conn, host, gate_values, now, version)
        if cur is not None and not diff:
            # the same fingerprint under another hash (a release that hashes otherwise,
            # e.g. without the errors list): no change, no history row
            return "heartbeat"
        conn.execute(
            "INSERT INTO history (host, at, old_hash, new_hash, diff, fingerprint) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (host, now, old_hash, h, canonical_json(diff), fp_json),
        )
        return "inserted" if cur is None else "changed"


class Inventory(Database):
    """The node inventory in one SQLite file (:class:`~ncclguard.store.connection.Database`
    says how it is opened, locked and migrated).

    ``heartbeat_s``: how often :meth:`upsert` rewrites an unchanged fingerprint's
    heartbeat (a writer's setting).
    """

    def __init__(
        self,
        path: Path | str | None = None,
        *,
        readonly: bool = False,
        config: InventoryConfig | None = None,
        values: GateValues | None = None,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    ) -> None:
        self.heartbeat_s = heartbeat_s
        super().__init__(path, readonly=readonly, config=config, values=values)

    # ---- writing

    def upsert(self, fingerprint: Mapping[str, Any], now: float | None = None) -> str:
        """Store one node's fingerprint.

        Returns "inserted" (a new node), "changed" (a new fingerprint: the node row, its
        query rows and a history row are written together), "heartbeat" (the same
        fingerprint, and ``heartbeat_s`` has passed, or the writer's clock went back)
        or "unchanged" (nothing written).
        """
        self._require_rw()
        from ncclguard.fingerprint.canonical import errors_hash, fingerprint_hash

        fp = dict(fingerprint)
        now = time.time() if now is None else float(now)
        host = hostname(fp)
        h = fingerprint_hash(fp)
        assert self.values is not None  # a writer (checked when opened)
        # a cheap read first: most cycles write nothing and need no write lock
        try:
            row = self._conn.execute(_CURRENT, (host,)).fetchone()
        except sqlite3.Error as e:
            if not busy(e):
                raise translate(e, self.path, "read the node") from None
            row = None  # decide under the write lock below
        if (
            row is not None and row[0] == h and row[2] == self.values.version
            and row[3] == errors_hash(fp) and not self._heartbeat_due(row[1], now)
        ):
            return "unchanged"
        node = _NodeWrite(fp, host, h, now, self.values)
        return self._retrying(
            self._conn, lambda conn: node.write(conn, self._heartbeat_due), f"write {host}"
        )

    def ingest(
        self,
        records: Sequence[Published],
        rejected: Sequence[Rejected] = (),
        now: float | None = None,
    ) -> list[str]:
        """The collector's write: accepted records and rejections in one transaction.

        Each accepted record is written as :meth:`upsert` writes (its heartbeat is its
        credential's encode time, ``Published.at``) together with its ``publishers`` row;
        each rejection adds to its ``rejections`` row. Returns one status per record:
        :meth:`upsert`'s, or "invalid: ..." for a fingerprint the store cannot derive
        its values from (that record alone is rolled back, and should be rejected).
        """
        self._require_rw()
        assert self.values is not None
        from ncclguard.fingerprint.canonical import fingerprint_hash

        values = self.values
        now = time.time() if now is None else float(now)

        def always(_last: float | None, _now: float) -> bool:
            return True  # the node decides when to heartbeat: every new record is one

        def body(conn: sqlite3.Connection) -> list[str]:
            out: list[str] = []
            for r in records:
                conn.execute("SAVEPOINT rec")
                try:
                    fp = dict(r.fingerprint)
                    node = _NodeWrite(fp, hostname(fp), fingerprint_hash(fp), r.at, values)
                    status = node.write(conn, always)
                    conn.execute(
                        "INSERT OR REPLACE INTO publishers VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (node.host, r.file, r.file_state, r.digest, r.encoded_at or r.at,
                         r.seq, r.origin, r.uid, now),
                    )
                except Exception as e:
                    if _database_failure(e):
                        raise  # busy, full, damaged: the whole batch, as any write
                    # a value the store cannot hash, derive or bind: this record only
                    conn.execute("ROLLBACK TO rec")
                    status = f"invalid: {type(e).__name__}: {str(e)[:200]}"
                else:
                    conn.execute(
                        "UPDATE rejections SET resolved_at = ? WHERE file = ? "
                        "AND resolved_at IS NULL", (now, r.file),
                    )
                conn.execute("RELEASE rec")
                out.append(status)
            for j in rejected:
                conn.execute(
                    "INSERT INTO rejections (file, cause, host, detail, file_state, first_at, "
                    "last_at, count, resolved_at) VALUES (?, ?, ?, ?, ?, ?, ?, 1, NULL) "
                    "ON CONFLICT (file, cause) DO UPDATE SET host = excluded.host, "
                    "detail = excluded.detail, file_state = excluded.file_state, "
                    "last_at = excluded.last_at, count = count + 1, resolved_at = NULL",
                    (j.file, j.cause, j.host, j.detail[:500], j.file_state, now, now),
                )
            return out

        return self._retrying(self._conn, body, f"ingest {len(records)} records")

    def publishers(self) -> dict[str, dict[str, Any]]:
        """The collector's state per spool file: the record it last accepted."""
        rows = self._reading(
            "read publishers", lambda c: c.execute(
                "SELECT host, file, file_state, digest, encoded_at, seq, origin, uid, "
                "accepted_at FROM publishers"
            ).fetchall(),
        )
        keys = ("host", "file", "file_state", "digest", "encoded_at", "seq", "origin", "uid",
                "accepted_at")
        return {r[1]: dict(zip(keys, r, strict=True)) for r in rows}

    def resolve_rejections(self, files: Sequence[str], keep_s: float,
                           now: float | None = None) -> None:
        """Mark the rejections of ``files`` (gone from the spool) resolved, and delete
        resolved rejections older than ``keep_s``."""
        self._require_rw()
        now = time.time() if now is None else float(now)

        def body(conn: sqlite3.Connection) -> None:
            for chunk in chunks(list(files)):
                conn.execute(
                    "UPDATE rejections SET resolved_at = ? WHERE resolved_at IS NULL "
                    "AND file IN (SELECT value FROM json_each(?))", (now, json.dumps(chunk)),
                )
            conn.execute("DELETE FROM rejections WHERE resolved_at < ?", (now - keep_s,))

        self._retrying(self._conn, body, "resolve rejections")

    def rejections(self, *, include_resolved: bool = False) -> list[dict[str, Any]]:
        """Records the collector rejected, newest first: file, cause, host, detail, count,
        first_at, last_at, resolved_at (set once the file held an accepted record)."""
        sql = ("SELECT file, cause, host, detail, file_state, count, first_at, last_at, "
               "resolved_at FROM rejections")
        if not include_resolved:
            sql += " WHERE resolved_at IS NULL"
        sql += " ORDER BY last_at DESC, file, cause"
        rows = self._reading("read rejections", lambda c: c.execute(sql).fetchall())
        keys = ("file", "cause", "host", "detail", "file_state", "count", "first_at",
                "last_at", "resolved_at")
        return [dict(zip(keys, r, strict=True)) for r in rows]

    # ---- the image index (v5, docs/containers.md)

    def write_images(self, scanned: Sequence[dict[str, Any]], gone: Sequence[str] = (),
                     now: float | None = None) -> None:
        """Write image rows in one transaction: each item is ``{"path", "inode", "size",
        "mtime_ns", "record"}`` (a record of ``scan_image``) or the same with ``"error"``
        instead of a record; ``gone``: paths no longer under the roots."""
        import hashlib  # not on the gate's path (3 ms)

        from ncclguard.fingerprint.canonical import canonical_json
        from ncclguard.fingerprint.image import image_values

        self._require_rw()
        now = time.time() if now is None else float(now)
        rows: list[tuple[Any, ...]] = []
        for item in scanned:
            record = item.get("record")
            if record is not None:
                text = canonical_json(record)
                values = image_values(record)
                rows.append((item["path"], item["inode"], item["size"], item["mtime_ns"], now,
                             text, hashlib.sha256(text.encode()).hexdigest(),
                             canonical_json(values), values["nccl_version"], None))
            else:
                rows.append((item["path"], item["inode"], item["size"], item["mtime_ns"], now,
                             None, None, None, None, str(item.get("error") or "unreadable")))

        def body(conn: sqlite3.Connection) -> None:
            conn.executemany("INSERT OR REPLACE INTO images VALUES (?,?,?,?,?,?,?,?,?,?)", rows)
            for chunk in chunks(list(gone)):
                conn.execute("DELETE FROM images WHERE path IN (SELECT value FROM json_each(?))",
                             (json.dumps(chunk),))

        self._retrying(self._conn, body, f"write {len(rows)} images")

    def image_states(self) -> dict[str, tuple[int, int, int]]:
        """path -> (inode, size, mtime_ns) of every indexed image (the scanner's cache)."""
        rows = self._reading("read images", lambda c: c.execute(
            "SELECT path, inode, size, mtime_ns FROM images").fetchall())
        return {r[0]: (r[1], r[2], r[3]) for r in rows}

    def images(self) -> list[dict[str, Any]]:
        """Every indexed image: path, size, mtime_ns, scanned_at, nccl_version, error."""
        rows = self._reading("read images", lambda c: c.execute(
            "SELECT path, inode, size, mtime_ns, scanned_at, nccl_version, error, record_hash "
            "FROM images ORDER BY path").fetchall())
        keys = ("path", "inode", "size", "mtime_ns", "scanned_at", "nccl_version", "error",
                "record_hash")
        return [dict(zip(keys, r, strict=True)) for r in rows]

    def image(self, path: str) -> dict[str, Any] | None:
        """One image's row with its full ``record`` (None if the image is not indexed)."""
        row = self._reading("read image", lambda c: c.execute(
            "SELECT path, inode, size, mtime_ns, scanned_at, nccl_version, error, record "
            "FROM images WHERE path = ?", (path,)).fetchone())
        if row is None:
            return None
        keys = ("path", "inode", "size", "mtime_ns", "scanned_at", "nccl_version", "error",
                "record")
        out = dict(zip(keys, row, strict=True))
        out["record"] = json.loads(out["record"]) if out["record"] else None
        return out

    def load_image_values(self, path: str) -> tuple[dict[str, Any] | None, str | None] | None:
        """The gate's read of one image: None when it is not indexed, else
        ``(image_values, error)`` (values None with the cause when it was unreadable).
        A record that fails the check is computed again from the stored record."""
        from ncclguard.fingerprint.image import image_values, valid_image_values

        row = self._reading("read image", lambda c: c.execute(
            "SELECT image_values, error, record FROM images WHERE path = ?",
            (path,)).fetchone())
        if row is None:
            return None
        text, error, record = row
        if error is not None:
            return None, str(error)
        try:
            values = json.loads(text)
            if valid_image_values(values):
                return values, None
            values = image_values(json.loads(record))
        except (TypeError, ValueError, RecursionError, AttributeError):
            return None, "the stored record cannot be read"
        return (values, None) if valid_image_values(values) else (
            None, "the stored record cannot be read")

    def write_container_runs(self, runs: Sequence[dict[str, Any]]) -> None:
        """Store verified container records: each ``{"job", "step", "host", "encoded_at",
        "uid", "origin", "file_state", "record"}``; a newer one replaces an older one."""
        from ncclguard.fingerprint.canonical import canonical_json

        self._require_rw()
        rows = []
        for r in runs:
            lib = next((x for x in r["record"].get("libnccl") or []
                        if isinstance(x, dict) and x.get("default")), None)
            version = lib.get("version") if lib else None
            rows.append((r["job"], r["step"], r["host"], r["encoded_at"], r["uid"],
                         r["origin"], r["file_state"],
                         version if isinstance(version, str) else None,
                         canonical_json(r["record"])))

        def body(conn: sqlite3.Connection) -> None:
            conn.executemany(
                "INSERT INTO container_runs VALUES (?,?,?,?,?,?,?,?,?) "
                "ON CONFLICT (job, step, host) DO UPDATE SET encoded_at = excluded.encoded_at, "
                "uid = excluded.uid, origin = excluded.origin, file_state = excluded.file_state, "
                "nccl_version = excluded.nccl_version, record = excluded.record "
                "WHERE excluded.encoded_at >= container_runs.encoded_at", rows)

        self._retrying(self._conn, body, f"write {len(rows)} container records")

    def container_states(self) -> dict[tuple[str, str, str], str]:
        """(job, step, host) -> the file state last stored (the collector's cache)."""
        rows = self._reading("read container runs", lambda c: c.execute(
            "SELECT job, step, host, file_state FROM container_runs").fetchall())
        return {(r[0], r[1], r[2]): r[3] for r in rows}

    def container_runs(self, job: str) -> list[dict[str, Any]]:
        """What each node's container had for ``job``: step, host, encoded_at, uid,
        origin, nccl_version, record; by step and host."""
        rows = self._reading("read container runs", lambda c: c.execute(
            "SELECT step, host, encoded_at, uid, origin, nccl_version, record "
            "FROM container_runs WHERE job = ? ORDER BY step, host", (str(job),)).fetchall())
        keys = ("step", "host", "encoded_at", "uid", "origin", "nccl_version", "record")
        out = [dict(zip(keys, r, strict=True)) for r in rows]
        for r in out:
            r["record"] = json.loads(r["record"])
        return out

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
            for chunk in chunks(wanted):
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

        The values are :func:`ncclguard.policy.node_values` records, stored at write time
        in the narrow ``gate_nodes`` / ``policy_values`` tables. Nodes with equal records
        share one decoded dict, so that an allocation of 1,024 identical nodes costs one
        ``json.loads`` here and one comparison in the policy.

        A record written by another ``GATE_VALUES.version`` (a node whose
        daemon has not run since an upgrade), or one that cannot be decoded, is never
        trusted: its values are computed again from the stored fingerprint (slower, for
        those nodes only). A node whose fingerprint cannot be read either is returned as
        None, i.e. unknown.
        """
        if self.values is None:
            raise ValueError("load_values needs values= (ncclguard.policy.GATE_VALUES)")
        version, check = self.values.version, self.values.check
        node_values = self.values.compute
        from ncclguard.store.schema import record_key

        wanted = list(dict.fromkeys(hosts))
        out: dict[str, tuple[dict, float] | None] = dict.fromkeys(wanted)

        def q(conn: sqlite3.Connection) -> None:
            rows: list[tuple[str, str, float, int]] = []
            for chunk in chunks(wanted):
                rows += conn.execute(
                    "SELECT host, policy_key, last_heartbeat, values_version FROM gate_nodes "
                    "WHERE host IN (SELECT value FROM json_each(?))",
                    (json.dumps(chunk),),
                ).fetchall()
            keys = list({key for _, key, _, v in rows if v == version})
            decoded: dict[str, dict] = {}
            for key, text in conn.execute(
                "SELECT policy_key, policy_values FROM policy_values "
                "WHERE policy_key IN (SELECT value FROM json_each(?))",
                (json.dumps(keys),),
            ):
                # a record is trusted only when its key names its text and it has the
                # policy's shape and types: anything else is computed again below
                if not isinstance(text, str) or record_key(version, text) != key:
                    continue
                try:
                    values = json.loads(text)
                except (ValueError, RecursionError):
                    continue
                if check(values):
                    decoded[key] = values
            redo: dict[str, float] = {}
            for host, key, heartbeat, _version in rows:
                values = decoded.get(key)
                if values is None or not isinstance(heartbeat, int | float):
                    redo[host] = heartbeat if isinstance(heartbeat, int | float) else 0.0
                else:
                    out[host] = (values, heartbeat)
            if redo:
                for host, text in conn.execute(
                    "SELECT host, fingerprint FROM nodes "
                    "WHERE host IN (SELECT value FROM json_each(?))",
                    (json.dumps(list(redo)),),
                ):
                    try:  # unreadable too: None (unknown), never an error of the job's
                        values = node_values(json.loads(text))
                    except Exception:  # noqa: S112 - a node's bad record is that node's
                        continue
                    if check(values):
                        out[host] = (values, redo[host])

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
        from ncclguard.store.rows import HAS_NCCL, NODE_COLUMNS, WHERE_COLUMNS

        clauses: list[str] = []
        params: list[Any] = []
        for key, value in (where or {}).items():
            if key == HAS_NCCL:
                clauses.append(
                    "EXISTS (SELECT 1 FROM libraries l WHERE l.host = n.host AND l.version = ?)"
                )
                params.append(value)
                continue
            col = WHERE_COLUMNS.get(key)
            if col is None:
                known = ", ".join([*NODE_COLUMNS, HAS_NCCL])
                raise ValueError(f"nodes(where=...): unknown field {key!r} (known: {known})")
            if value is None:
                clauses.append(f"{col} IS NULL")
            elif isinstance(value, list | tuple | set | frozenset):
                clauses.append(f"{col} IN (SELECT value FROM json_each(?))")  # noqa: S608
                params.append(json.dumps(list(value)))
            else:
                clauses.append(f"{col} = ?")
                params.append(value)
        sql = f"SELECT {', '.join(WHERE_COLUMNS.values())} FROM nodes n"  # noqa: S608 - fixed
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
        clauses: list[str] = []
        params: list[Any] = []
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

    def stale(self, now: float, ttl: float, future_s: float | None = None) -> list[str]:
        """Hosts whose last heartbeat is older than ``ttl`` seconds at ``now`` (or, with
        ``future_s``, further than that ahead of ``now``: ``ncclguard.policy.freshness``)."""
        ahead = float("inf") if future_s is None else now + future_s
        rows = self._reading(
            "query stale nodes",
            lambda c: c.execute(
                "SELECT host FROM nodes WHERE last_heartbeat < ? OR last_heartbeat > ? "
                "ORDER BY host", (now - ttl, ahead)
            ).fetchall(),
        )
        return [r[0] for r in rows]

    def oldest_heartbeat(self, hosts: Iterable[str] | None = None) -> float | None:
        """The oldest heartbeat of ``hosts`` (default: every node), or None: the
        inventory's freshness, for ``classes`` and the collector's metrics."""
        params: tuple[str, ...] = ()
        if hosts is None:
            sql = "SELECT min(last_heartbeat) FROM gate_nodes"
        else:
            sql = ("SELECT min(last_heartbeat) FROM gate_nodes "
                   "WHERE host IN (SELECT value FROM json_each(?))")
            params = (json.dumps(list(hosts)),)
        row = self._reading("read heartbeats", lambda c: c.execute(sql, params).fetchone())
        return row[0] if row is not None and isinstance(row[0], int | float) else None

    def heartbeats(self) -> dict[str, float]:
        """Every node's last heartbeat (host -> time): the exporter's freshness counts."""
        rows = self._reading(
            "read heartbeats",
            lambda c: c.execute("SELECT host, last_heartbeat FROM nodes").fetchall(),
        )
        return {h: float(hb) for h, hb in rows if isinstance(hb, int | float)}

    def hosts(self) -> list[str]:
        rows = self._reading(
            "list hosts", lambda c: c.execute("SELECT host FROM nodes ORDER BY host").fetchall()
        )
        return [r[0] for r in rows]

    def prune_history(self, now: float, keep_days: float) -> int:
        """Delete history rows older than ``keep_days`` (0: none), except each node's
        newest (``fingerprint_at`` still answers for today). Returns how many."""
        self._require_rw()
        if keep_days <= 0:
            return 0

        cutoff = now - keep_days * 86400

        def body(conn: sqlite3.Connection) -> int:
            # each host keeps the newest row from before the cutoff: what it had at any
            # time inside the window (fingerprint_at), and its newest of all
            cur = conn.execute(
                "DELETE FROM history WHERE at < ? AND id NOT IN "
                "(SELECT max(id) FROM history WHERE at < ? GROUP BY host)", (cutoff, cutoff),
            )
            return int(cur.rowcount)

        return self._retrying(self._conn, body, "prune history")

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
