"""The collector's tables (v3, v6; docs/collector.md): the records it accepted from each
spool file (``publishers``), the ones it rejected (``rejections``), and its write stamp
(``collector_state``); ``ingest``, its one transaction per batch of records."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from ncclguard.fingerprint.model import hostname
from ncclguard.store.connection import chunks
from ncclguard.store.errors import database_failure
from ncclguard.store.nodes import NodeTables, NodeWrite
from ncclguard.store.quota import Quota


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
    #: what the node's running job steps loaded (:mod:`ncclguard.fingerprint.loaded`),
    #: None when the record carries none
    loaded: Mapping[str, Any] | None = None


class Rejected(NamedTuple):
    """One record the collector rejected (``ncclguard.spool.CAUSES`` names the causes)."""

    file: str
    cause: str
    host: str | None
    detail: str
    file_state: str


#: statuses of a change the quota refused (:func:`ncclguard.store.quota.refusal`)
REFUSED = ("over-quota:", "change-rate:")


def _stamp(conn: sqlite3.Connection, now: float, pressure: str | None,
           clear: bool = False) -> None:
    """``written`` = now; ``pressure`` set when given (an empty string keeps the one
    stored), deleted when ``clear``."""
    conn.execute("INSERT OR REPLACE INTO collector_state VALUES ('written', NULL, ?)", (now,))
    if pressure:
        conn.execute("INSERT OR REPLACE INTO collector_state VALUES ('pressure', ?, ?)",
                     (pressure, now))
    elif clear:
        conn.execute("DELETE FROM collector_state WHERE name = 'pressure'")


class RecordTables(NodeTables):
    """The collector's tables of an :class:`~ncclguard.store.Inventory`."""

    def ingest(
        self,
        records: Sequence[Published],
        rejected: Sequence[Rejected] = (),
        now: float | None = None,
        quota: Quota | None = None,
    ) -> list[str]:
        """The collector's write: accepted records and rejections in one transaction.

        Each accepted record is written as :meth:`upsert` writes (its heartbeat is its
        credential's encode time, ``Published.at``) together with its ``publishers`` row;
        each rejection adds to its ``rejections`` row. Returns one status per record:
        :meth:`upsert`'s, "invalid: ..." for a fingerprint the store cannot derive its
        values from (that record alone is rolled back, and should be rejected), or
        "over-quota: ..." / "change-rate: ..." for a change that ``quota``
        (:mod:`ncclguard.store.quota`) does not allow (nothing of it written). The
        collector's write stamp (:meth:`writer_state`) is set in the same transaction.
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
                    node = NodeWrite(fp, hostname(fp), fingerprint_hash(fp), r.at, values)
                    status = node.write(conn, always, quota, now)
                    if status.startswith(REFUSED):
                        conn.execute("RELEASE rec")
                        out.append(status)
                        continue
                    conn.execute(
                        "INSERT OR REPLACE INTO publishers VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (node.host, r.file, r.file_state, r.digest, r.encoded_at or r.at,
                         r.seq, r.origin, r.uid, now),
                    )
                except Exception as e:
                    if database_failure(e):
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
            _stamp(conn, now, None)
            return out

        return self._retrying(self._conn, body, f"ingest {len(records)} records")

    def stamp(self, pressure: str | None, now: float | None = None) -> None:
        """The collector's mark that it can write (``written``), and why the inventory
        cannot grow, if it cannot (``pressure``: None clears it)."""
        self._require_rw()
        now = time.time() if now is None else float(now)
        self._retrying(self._conn, lambda conn: _stamp(conn, now, pressure or None,
                                                       clear=pressure is None),
                       "stamp the collector's state")

    def writer_state(self) -> tuple[float | None, str | None]:
        """``(when the collector last wrote, why the inventory cannot grow)``; each None
        when unknown (no collector ever wrote this inventory)."""
        rows = self._reading("read the collector's state", lambda c: c.execute(
            "SELECT name, value, at FROM collector_state WHERE name IN "
            "('written', 'pressure')").fetchall())
        got = {name: (value, at) for name, value, at in rows}
        written = got.get("written", (None, None))[1]
        pressure = got.get("pressure", (None, None))[0]
        return (float(written) if isinstance(written, int | float) else None,
                str(pressure) if pressure else None)

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
