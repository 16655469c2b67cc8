"""The node tables: one fingerprint per node, its query rows, its history, and the gate's
narrow values (docs/store.md). :class:`NodeTables` writes a node (``upsert``, and the
collector's ``ingest`` through :class:`_NodeWrite`) and reads it back (``load``,
``load_values`` for the gate, ``nodes``, ``history``, ``fingerprint_at``, freshness)."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from ncclguard.fingerprint.model import hostname
from ncclguard.store.connection import Database, chunks
from ncclguard.store.decoding import decoded as _decoded
from ncclguard.store.decoding import stored_fingerprint as _fingerprint
from ncclguard.store.errors import busy, translate
from ncclguard.store.quota import NOT_KEPT, Quota, history_row_bytes, refusal
from ncclguard.store.schema import GateValues, gate_record, write_gate_row

DEFAULT_HEARTBEAT_S = 300.0


class NodeRecord(NamedTuple):
    host: str
    fingerprint: dict[str, Any]
    fp_hash: str
    compat_key: str
    first_seen: float
    collected_at: float
    last_heartbeat: float


_CURRENT = (
    "SELECT n.fp_hash, n.last_heartbeat, g.values_version, n.errors_hash FROM nodes n "
    "LEFT JOIN gate_nodes g ON g.host = n.host WHERE n.host = ?"
)


class NodeWrite:
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
        self._derived: tuple[dict[str, Any], tuple[str, str, str | None]] | None = None

    def derived(self) -> tuple[dict[str, Any], tuple[str, str, str | None]]:
        if self._derived is None:
            from ncclguard.store.rows import derive

            self._derived = (derive(self.fp), gate_record(self.values, self.fp))
        return self._derived

    def write(self, conn: sqlite3.Connection, heartbeat_due: Callable[[float | None, float], bool],
              quota: Quota | None = None, stored_at: float | None = None) -> str:
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
        stored = now if stored_at is None else stored_at
        if quota is not None:  # the rate first: a node over it costs no diff, no derive
            why = refusal(conn, host, None, 0, stored, quota)
            if why is not None:
                return why
        derived, gate_values = self.derived()
        fp_json = canonical_json(self.fp)
        cols = {
            "fp_hash": h, "fingerprint": fp_json, "collected_at": self.collected,
            "last_heartbeat": now, "last_change": now, "errors_hash": e_hash, **derived,
        }
        names = list(cols)
        diff: list[dict[str, Any]] = []
        old_hash = None
        if cur is not None:
            (old_json,) = conn.execute(
                "SELECT fingerprint FROM nodes WHERE host = ?", (host,)
            ).fetchone()
            try:
                diff = fingerprint_diff(json.loads(old_json), self.fp)
            except (ValueError, RecursionError):
                diff = [{"field": "", "old": None, "new": "(previous fingerprint unreadable)"}]
            old_hash = cur[0]
        keep = quota is None or quota.keep_history
        hist_fp = fp_json if keep else ""
        diff_json = canonical_json(diff if keep else [{"field": "", "old": None,
                                                       "new": NOT_KEPT}])
        row_bytes = history_row_bytes(hist_fp, diff_json)
        if quota is not None and (cur is None or diff):
            why = refusal(conn, host, len(fp_json.encode()), row_bytes, stored, quota)
            if why is not None:
                return why  # nothing written: the node keeps its record
        if cur is None:
            conn.execute(
                f"INSERT INTO nodes (host, first_seen, {', '.join(names)}) "  # noqa: S608 - fixed names
                f"VALUES (?, ?, {', '.join('?' for _ in names)})",
                (host, now, *cols.values()),
            )
        else:
            conn.execute(
                f"UPDATE nodes SET {', '.join(f'{n} = ?' for n in names)} "  # noqa: S608 - fixed names
                "WHERE host = ?",
                (*cols.values(), host),
            )
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
            "INSERT INTO history (host, at, old_hash, new_hash, diff, fingerprint, bytes, "
            "stored_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (host, now, old_hash, h, diff_json, hist_fp, row_bytes, stored),
        )
        return "inserted" if cur is None else "changed"


class NodeTables(Database):
    """The node tables of an :class:`~ncclguard.store.Inventory`."""

    heartbeat_s: float

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
        node = NodeWrite(fp, host, h, now, self.values)
        return self._retrying(
            self._conn, lambda conn: node.write(conn, self._heartbeat_due), f"write {host}"
        )

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
                    out[host] = NodeRecord(host, _fingerprint(host, fpj), h, ck, first, coll,
                                           hb)

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
        # the filterable columns, and the stored compatibility values (shown, not filtered)
        sql = (f"SELECT {', '.join(WHERE_COLUMNS.values())}, n.compat_values "  # noqa: S608
               "FROM nodes n")
        if clauses:
            sql += " WHERE " + " AND ".join(clauses)
        sql += " ORDER BY n.host"
        rows = self._reading("query nodes", lambda c: c.execute(sql, params).fetchall())
        out = []
        for row in rows:
            d = dict(zip((*NODE_COLUMNS, "compat_values"), row, strict=True))
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
            {"id": i, "host": h, "at": at, "old_hash": o, "new_hash": n,
             "diff": _decoded(d, [{"field": "", "old": None, "new": "(diff unreadable)"}])}
            for i, h, at, o, n, d in rows
        ]

    def fingerprint_at(self, host: str, when: float) -> dict[str, Any] | None:
        """The fingerprint a node had at ``when``: the newest change written at or before it.

        Rows are taken in write order, so a writer whose clock went back does not hide its
        newer changes behind older timestamps. None when not known: no change before
        ``when``, or that change was written under disk pressure (its copy not kept), or
        its copy cannot be read.
        """
        row = self._reading(
            "read history",
            lambda c: c.execute(
                "SELECT fingerprint FROM history WHERE host = ? AND at <= ? "
                "ORDER BY id DESC LIMIT 1",
                (host, when),
            ).fetchone(),
        )
        found = _decoded(row[0], None) if row and row[0] else None
        return found if isinstance(found, dict) else None

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
