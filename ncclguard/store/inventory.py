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

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from ncclguard.config import InventoryConfig
from ncclguard.fingerprint.model import hostname
from ncclguard.store.connection import Database, chunks
from ncclguard.store.errors import busy, translate
from ncclguard.store.schema import GateValues, gate_record, write_gate_row

__all__ = ["DEFAULT_HEARTBEAT_S", "CompatClass", "Inventory", "NodeRecord"]

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
        # writers only: the gate's path (a read) does not load these modules
        from ncclguard.fingerprint.canonical import (
            canonical_json,
            fingerprint_diff,
            fingerprint_hash,
        )
        from ncclguard.store.rows import DETAIL_DELETE, DETAIL_INSERT, derive, detail_rows
        from ncclguard.timeparse import parse_iso

        fp = dict(fingerprint)
        now = time.time() if now is None else float(now)
        host = hostname(fp)
        h = fingerprint_hash(fp)
        collected = parse_iso((fp.get("host") or {}).get("collected_at"))
        collected = now if collected is None else collected
        assert self.values is not None  # a writer (checked when opened)
        values = self.values
        version = values.version

        # a cheap read first: most cycles write nothing and need no write lock
        current = (
            "SELECT n.fp_hash, n.last_heartbeat, g.values_version FROM nodes n "
            "LEFT JOIN gate_nodes g ON g.host = n.host WHERE n.host = ?"
        )
        try:
            row = self._conn.execute(current, (host,)).fetchone()
        except sqlite3.Error as e:
            if not busy(e):
                raise translate(e, self.path, "read the node") from None
            row = None  # decide under the write lock below
        if (
            row is not None and row[0] == h and row[2] == version
            and not self._heartbeat_due(row[1], now)
        ):
            return "unchanged"

        derived: dict[str, Any] | None = None
        gate_values: tuple[str, str] | None = None

        def body(conn: sqlite3.Connection) -> str:
            nonlocal derived, gate_values
            cur = conn.execute(current, (host,)).fetchone()
            if derived is None and (cur is None or cur[0] != h or cur[2] != version):
                derived = derive(fp)
                gate_values = gate_record(values, fp)
            if cur is not None and cur[0] == h:
                stale_values = cur[2] != version
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
                    write_gate_row(conn, host, gate_values, now, version)
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
            for table, rows in detail_rows(host, fp).items():
                conn.execute(DETAIL_DELETE[table], (host,))
                if rows:
                    conn.executemany(DETAIL_INSERT[table], rows)
            write_gate_row(conn, host, gate_values, now, version)
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
        version, marker = self.values.version, self.values.marker
        node_values = self.values.compute

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
                try:
                    values = json.loads(text)
                except ValueError:
                    continue
                if isinstance(values, dict) and marker in values:
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
