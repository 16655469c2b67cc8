"""The canary's state: which nodes are held until their canary passes, and its history
(issue 43, docs/canary.md, docs/store.md).

``canary_nodes``: one row per node the canary service has seen: the class it was last
vetted in (``accepted``), the class it has now (``class_key``), its ``state`` (``ok``, or
one of :data:`ncclguard.policy.canary.HELD_STATES`), since when it is held, why
(``reason``, shown by ``ncclguard nodes``, ``show`` and ``canary status``) and its canary
job. ``canary_history``: each
event (held, canary submitted, passed, failed, approved, released) with who did it
(``ncclguard`` or the admin's name). Only the canary service and an admin's ``ncclguard
canary`` write them; the gate and the features daemon read them (:meth:`~CanaryTables.
canary_holds`, :meth:`~CanaryTables.canary_held`), and take a node whose record's class
moved as held from the collector's write on, before the service's next pass writes it.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ncclguard.store.connection import Database, chunks

__all__ = ["CANARY_FIELDS", "CanaryTables"]

CANARY_FIELDS = ("host", "accepted", "class_key", "state", "changed_at", "held_since",
                 "reason", "job_id", "job_nodes", "submitted_at", "attempts", "updated_at")
_SELECT = "SELECT " + ", ".join(CANARY_FIELDS) + " FROM canary_nodes"  # noqa: S608 - fixed names
_INSERT = ("INSERT OR REPLACE INTO canary_nodes (" + ", ".join(CANARY_FIELDS)  # noqa: S608 - fixed
           + ") VALUES (" + ",".join("?" * len(CANARY_FIELDS)) + ")")
#: a row and the class its node's record has now (the collector's ``gate_nodes``)
_SELECT_NOW = ("SELECT " + ", ".join(f"c.{f}" for f in CANARY_FIELDS)  # noqa: S608 - fixed
               + ", g.class_key FROM canary_nodes c LEFT JOIN gate_nodes g ON g.host = c.host")
#: held: by its row, or its record's class is no longer the one it was vetted in (the
#: service's next pass holds it: ncclguard.policy.canary.observe)
#: (only when the stored keys were derived under the policy the rows are under: after an
#: admin changes a severity, every key moves and the service's next pass re-keys the rows)
_HELD = ("(c.state != 'ok' OR (c.accepted IS NOT NULL AND g.class_key IS NOT NULL "
         "AND g.class_key != c.accepted AND (SELECT value FROM collector_state WHERE "
         "name = 'class_policy') IS (SELECT value FROM collector_state WHERE "
         "name = 'canary_policy')))")
_HELD_HOSTS = ("SELECT c.host FROM canary_nodes c LEFT JOIN gate_nodes g "  # noqa: S608 - fixed
               "ON g.host = c.host WHERE " + _HELD)
#: nodes with a class and no row: first seen since the service's first pass
_UNSEEN = ("SELECT g.host, g.class_key FROM gate_nodes g WHERE g.class_key IS NOT NULL "
           "AND NOT EXISTS (SELECT 1 FROM canary_nodes c WHERE c.host = g.host)")
_HISTORY = ("at", "host", "event", "class_key", "job_id", "detail", "by")
_ADOPTED = "canary_adopted"  # collector_state: when the service first took the classes as good
#: the events counted for the metrics, each a running total in collector_state
COUNTED = ("submitted", "passed", "failed", "approved")
_COUNT = "canary_events_"
_POLICY = "canary_policy"  # collector_state: the class policy the rows' keys are under


class CanaryTables(Database):
    """The canary tables of an :class:`~ncclguard.store.Inventory`."""

    def canary_nodes(self) -> dict[str, dict[str, Any]]:
        """Every node's row, by host."""
        rows = self._reading("read the canary's nodes", lambda c: c.execute(
            _SELECT).fetchall())
        return {r[0]: dict(zip(CANARY_FIELDS, r, strict=True)) for r in rows}

    def canary_holds(self, hosts: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The rows of the held ones among ``hosts`` (the gate's question: one indexed
        read per 500 hosts). Held from the collector's write on: a node whose stored
        class is not the one it was vetted in, or that the service has not seen since
        its first pass, is held before the service's next pass writes its row (a row
        made up here, ``settling``); until then the features sync gave it its new class
        and the gate let it into multi-node jobs."""
        wanted = list(dict.fromkeys(hosts))

        def q(c: sqlite3.Connection) -> tuple[list[Any], list[Any]]:
            out: list[Any] = []
            new: list[Any] = []
            adopted = _adopted(c)
            for part in chunks(wanted):
                marks = ",".join("?" * len(part))
                out += c.execute(
                    _SELECT_NOW + f" WHERE c.host IN ({marks}) AND " + _HELD, part).fetchall()
                if adopted:
                    new += c.execute(_UNSEEN + f" AND g.host IN ({marks})", part).fetchall()
            return out, new

        rows, new = self._reading("read the canary's holds", q)
        return _rows_now(rows, new)

    def canary_held(self) -> set[str]:
        """Every held node (the features daemon's question: they get no class), from the
        collector's write on (:meth:`canary_holds`)."""
        def q(c: sqlite3.Connection) -> list[Any]:
            rows = c.execute(_HELD_HOSTS).fetchall()
            if _adopted(c):
                rows += c.execute(_UNSEEN).fetchall()
            return rows

        return {r[0] for r in self._reading("read the canary's holds", q)}

    def canary_owner(self) -> int | None:
        """The inventory file's owner: the user the canary service runs and submits its
        jobs as (it writes this file, which only its owner can); None if unreadable."""
        try:
            return os.stat(self.path).st_uid
        except OSError:
            return None

    def canary_adopted(self) -> float | None:
        """When the service first took every node's class as vetted (None: not yet)."""
        row = self._reading("read the canary's start", lambda c: c.execute(
            "SELECT value FROM collector_state WHERE name = ?", (_ADOPTED,)).fetchone())
        try:
            return float(row[0]) if row else None
        except (TypeError, ValueError):
            return None

    def canary_policy(self) -> str | None:
        """The class policy (:func:`~ncclguard.policy.schedule.class_policy`) the rows'
        class keys were derived under (None: not recorded)."""
        row = self._reading("read the canary's class policy", lambda c: c.execute(
            "SELECT value FROM collector_state WHERE name = ?", (_POLICY,)).fetchone())
        return str(row[0]) if row and row[0] is not None else None

    def canary_write(self, rows: Sequence[Mapping[str, Any]],
                     events: Sequence[Mapping[str, Any]] = (), *, adopted: float | None = None,
                     expect: Mapping[str, tuple[str, int | None]] | None = None,
                     policy: str | None = None) -> bool:
        """Write node rows and history events in one transaction; ``adopted``: also mark
        the service's first pass; ``policy``: the class policy the keys written are under.
        ``expect``: ``{host: (state, job_id)}`` each row must still have (an admin's
        ``approve`` or ``run`` since the service read them wins): when one differs
        nothing is written and False is returned."""
        self._require_rw()

        def body(conn: sqlite3.Connection) -> bool:
            for host, (state, job) in (expect or {}).items():
                got = conn.execute("SELECT state, job_id FROM canary_nodes WHERE host = ?",
                                   (host,)).fetchone()
                if (got is None and state != "") or (got is not None and
                                                     (got[0], got[1]) != (state, job)):
                    return False
            for r in rows:
                conn.execute(
                    _INSERT, tuple(r.get(f) for f in CANARY_FIELDS))
            for e in events:
                conn.execute(
                    "INSERT INTO canary_history (at, host, event, class_key, job_id, detail, "
                    "by) VALUES (?,?,?,?,?,?,?)",
                    (float(e["at"]), e["host"], e["event"], e.get("class_key"),
                     e.get("job_id"), str(e.get("detail", ""))[:2000], e.get("by", "ncclguard")))
                if e["event"] in COUNTED:  # a running total: pruning the history keeps it
                    conn.execute(
                        "INSERT INTO collector_state (name, value, at) VALUES (?, '1', ?) "
                        "ON CONFLICT (name) DO UPDATE SET "
                        "value = CAST(value AS INTEGER) + 1, at = excluded.at",
                        (_COUNT + e["event"], float(e["at"])))
            if adopted is not None:
                conn.execute("INSERT OR REPLACE INTO collector_state (name, value, at) "
                             "VALUES (?,?,?)", (_ADOPTED, repr(adopted), adopted))
            if policy is not None:
                conn.execute("INSERT OR REPLACE INTO collector_state (name, value, at) "
                             "VALUES (?,?,?)", (_POLICY, policy, time.time()))
            return True

        return bool(self._retrying(self._conn, body, "write the canary's state"))

    def canary_history(self, host: str | None = None, limit: int = 50
                       ) -> list[dict[str, Any]]:
        """The last ``limit`` events (of ``host``), newest first."""
        rows = self._reading("read the canary's history", lambda c: c.execute(
            "SELECT at, host, event, class_key, job_id, detail, by FROM canary_history "
            "WHERE (? IS NULL OR host = ?) ORDER BY id DESC LIMIT ?",
            (host, host, int(limit))).fetchall())
        return [dict(zip(_HISTORY, r, strict=True)) for r in rows]

    def canary_counts(self, now: float | None = None) -> dict[str, Any]:
        """For the metrics: nodes per state, the longest-held node's seconds, and the
        events so far (:data:`COUNTED`: running totals kept beside the history, which is
        pruned, so that they only grow)."""
        now = time.time() if now is None else now

        def q(c: sqlite3.Connection) -> tuple[list[Any], Any, list[Any]]:
            return (c.execute("SELECT state, count(*) FROM canary_nodes GROUP BY state")
                    .fetchall(),
                    c.execute("SELECT min(held_since) FROM canary_nodes WHERE state != 'ok'")
                    .fetchone()[0],
                    c.execute("SELECT name, value FROM collector_state WHERE name >= ? AND "
                              "name < ?", (_COUNT, _COUNT + "~")).fetchall())

        states, oldest, results = self._reading("count the canary's nodes", q)
        return {"states": {s: int(n) for s, n in states},
                "held_max_s": max(now - float(oldest), 0.0) if oldest is not None else 0.0,
                "events": {e[len(_COUNT):]: int(n) for e, n in results
                           if e[len(_COUNT):] in COUNTED and str(n).isdigit()}}

    def prune_canary_history(self, before: float | None, per_host: int | None = None) -> int:
        """Drop events older than ``before`` (None: none for their age) and, with
        ``per_host``, each node's but its newest ``per_host``; the count dropped."""
        self._require_rw()

        def body(c: sqlite3.Connection) -> int:
            n = 0
            if before is not None:
                n += c.execute("DELETE FROM canary_history WHERE at < ?",
                               (float(before),)).rowcount
            if per_host is not None:
                over = c.execute("SELECT host FROM canary_history GROUP BY host "
                                 "HAVING count(*) > ?", (int(per_host),)).fetchall()
                for (host,) in over:
                    n += c.execute(
                        "DELETE FROM canary_history WHERE host = ? AND id <= (SELECT id FROM "
                        "canary_history WHERE host = ? ORDER BY id DESC LIMIT 1 OFFSET ?)",
                        (host, host, int(per_host))).rowcount
            return n

        return int(self._retrying(self._conn, body, "prune the canary's history"))


def _adopted(c: sqlite3.Connection) -> bool:
    return c.execute("SELECT 1 FROM collector_state WHERE name = ?",
                     (_ADOPTED,)).fetchone() is not None


def _rows_now(rows: Sequence[Any], new: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """The held rows as the service's next pass will write them: a row still ``ok`` whose
    class moved, and a node without one, ``settling`` (as ``observe`` holds them)."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        row = dict(zip(CANARY_FIELDS, r[:-1], strict=True))
        now = r[-1]
        if row["state"] == "ok":
            row.update(state="settling", class_key=now, job_id=None, job_nodes=None,
                       reason=f"its stack changed (class {_short(row['accepted'])} -> "
                       f"{_short(now)}): held until its canary passes")
        out[row["host"]] = row
    for host, key in new:
        out[host] = {**dict.fromkeys(CANARY_FIELDS), "host": host, "class_key": key,
                     "state": "settling", "attempts": 0,
                     "reason": f"first seen (class {_short(key)}): held until its canary "
                     "passes"}
    return out


def _short(key: str | None) -> str:
    return key[:10] if key else "none"
