"""What running job steps loaded, node by node, and the steps found mixed (issue 42,
docs/runtime.md, docs/store.md).

``job_loads``: one row per (job, step, node) that a node's record said had a libnccl or an
NCCL plugin mapped: the libraries (JSON, :mod:`ncclguard.fingerprint.loaded`), since when,
when last seen (``seen_at``, the record's time) and when the node stopped listing it
(``gone_at``). ``mixed_steps``: one row per step found mixed, with the verdict
(:func:`ncclguard.policy.loaded.judge`) and what was done about it.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

from ncclguard.store.connection import Database
from ncclguard.store.decoding import decoded

__all__ = ["RuntimeTables"]


def _objects(text: Any) -> list[dict[str, Any]]:
    """A stored list of libraries, read through the one guard of stored JSON
    (:func:`ncclguard.store.decoding.decoded`): its objects; [] when it cannot be read."""
    v = decoded(text, [])
    return [x for x in v if isinstance(x, dict)] if isinstance(v, list) else []


class RuntimeTables(Database):
    """The runtime tables of an :class:`~ncclguard.store.Inventory`."""

    def write_loaded(self, docs: Sequence[tuple[str, Mapping[str, Any], float]]
                     ) -> set[tuple[str, str]]:
        """Store each node's loaded document ``(host, doc, at)``: its steps' rows written
        (``seen_at`` = at), the node's other current rows marked gone. Returns the steps
        whose libraries changed on some node (new, or other libraries)."""
        from ncclguard.fingerprint.canonical import canonical_json

        self._require_rw()

        def body(conn: sqlite3.Connection) -> set[tuple[str, str]]:
            changed: set[tuple[str, str]] = set()
            for host, doc, at in docs:
                present = []
                for s in doc.get("steps") or []:
                    if not s.get("libs"):
                        continue
                    job, step = str(s["job"]), str(s["step"])
                    present.append((job, step))
                    libs = canonical_json(s["libs"])
                    before = conn.execute(
                        "SELECT libs, gone_at FROM job_loads WHERE job = ? AND step = ? "
                        "AND host = ?", (job, step, host)).fetchone()
                    if before is None or before[0] != libs or before[1] is not None:
                        changed.add((job, step))
                    conn.execute(
                        "INSERT INTO job_loads VALUES (?,?,?,?,?,?,?,?,?,NULL) "
                        "ON CONFLICT (job, step, host) DO UPDATE SET uid = excluded.uid, "
                        "procs = excluded.procs, since = excluded.since, "
                        "libs = excluded.libs, cut = excluded.cut, "
                        "seen_at = excluded.seen_at, gone_at = NULL "
                        "WHERE excluded.seen_at >= job_loads.seen_at",
                        (job, step, host, int(s["uid"]), int(s["procs"]), s.get("since"),
                         libs, int(bool(s.get("cut"))), float(at)))
                gone = conn.execute(
                    "SELECT job, step FROM job_loads WHERE host = ? AND gone_at IS NULL",
                    (host,)).fetchall()
                keep = set(present)
                for job, step in gone:
                    if (job, step) not in keep:
                        conn.execute("UPDATE job_loads SET gone_at = ? WHERE job = ? AND "
                                     "step = ? AND host = ?", (float(at), job, step, host))
            return changed

        return set(self._retrying(self._conn, body, f"write {len(docs)} loaded documents"))

    def job_loads(self, job: str | None = None, *, current: bool = False
                  ) -> list[dict[str, Any]]:
        """Rows of ``job_loads`` (of ``job``; ``current``: not gone), by job, step, host."""
        args = (None if job is None else str(job),) * 2 + (int(current),)
        rows = self._reading("read job loads", lambda c: c.execute(
            "SELECT job, step, host, uid, procs, since, libs, cut, seen_at, gone_at "
            "FROM job_loads WHERE (? IS NULL OR job = ?) AND (NOT ? OR gone_at IS NULL) "
            "ORDER BY CAST(job AS INTEGER), step, host", args).fetchall())
        keys = ("job", "step", "host", "uid", "procs", "since", "libs", "cut", "seen_at",
                "gone_at")
        out = []
        for r in rows:
            d = dict(zip(keys, r, strict=True))
            d["libs"] = _objects(d["libs"])
            d["cut"] = bool(d["cut"])
            out.append(d)
        return out

    def host_loads(self, host: str, limit: int = 20) -> list[dict[str, Any]]:
        """The last steps seen on ``host`` (newest first): the evidence ``show`` keeps."""
        rows = self._reading("read job loads", lambda c: c.execute(
            "SELECT job, step, libs, since, seen_at, gone_at FROM job_loads WHERE host = ? "
            "ORDER BY seen_at DESC LIMIT ?", (host, int(limit))).fetchall())
        out = []
        for job, step, libs, since, seen, gone in rows:
            out.append({"job": job, "step": step, "libs": _objects(libs), "since": since,
                        "seen_at": seen, "gone_at": gone})
        return out

    def record_mixed(self, job: str, step: str, at: float, kind: str, summary: str,
                     groups: Sequence[tuple[str, Sequence[str]]], odd: Sequence[str]) -> bool:
        """Keep a step found mixed; False when it was already kept (the first verdict
        stays)."""
        self._require_rw()
        row = (str(job), str(step), float(at), kind, summary[:2000],
               json.dumps([[s, list(h)] for s, h in groups]), json.dumps(list(odd)))
        return bool(self._retrying(self._conn, lambda conn: conn.execute(
            "INSERT OR IGNORE INTO mixed_steps (job, step, found_at, kind, summary, groups, "
            "odd) VALUES (?,?,?,?,?,?,?)", row).rowcount, "record a mixed step"))

    def set_mixed_action(self, job: str, action: str, result: str, at: float) -> bool:
        """Record what was done about mixed job ``job`` (on all its steps' rows); False
        when an action was already recorded (at most one per job)."""
        self._require_rw()
        return bool(self._retrying(self._conn, lambda conn: conn.execute(
            "UPDATE mixed_steps SET action = ?, result = ?, acted_at = ? WHERE job = ? AND "
            "NOT EXISTS (SELECT 1 FROM mixed_steps WHERE job = ? AND action IS NOT NULL)",
            (action, result[:500], float(at), str(job), str(job))).rowcount,
            "record a mixed job's action"))

    def mixed_steps(self, job: str | None = None) -> list[dict[str, Any]]:
        """Steps found mixed (of ``job``), oldest first."""
        args = (None if job is None else str(job),) * 2
        rows = self._reading("read mixed steps", lambda c: c.execute(
            "SELECT job, step, found_at, kind, summary, groups, odd, action, result, "
            "acted_at FROM mixed_steps WHERE (? IS NULL OR job = ?) "
            "ORDER BY found_at, job, step", args).fetchall())
        keys = ("job", "step", "found_at", "kind", "summary", "groups", "odd", "action",
                "result", "acted_at")
        out = []
        for r in rows:
            d = dict(zip(keys, r, strict=True))
            for k in ("groups", "odd"):
                v = decoded(d[k], [])
                d[k] = v if isinstance(v, list) else []
            out.append(d)
        return out

    def runtime_counts(self) -> tuple[int, dict[str, int], dict[str, int]]:
        """``(running steps with NCCL loaded, {kind: running mixed steps}, {kind: mixed
        steps kept})``: the metrics' view (docs/metrics.md)."""
        def read(c: sqlite3.Connection) -> tuple[int, dict[str, int], dict[str, int]]:
            running = c.execute("SELECT count(*) FROM (SELECT DISTINCT job, step FROM "
                                "job_loads WHERE gone_at IS NULL)").fetchone()[0]
            live = dict(c.execute(
                "SELECT kind, count(*) FROM mixed_steps m WHERE EXISTS (SELECT 1 FROM "
                "job_loads l WHERE l.job = m.job AND l.step = m.step AND l.gone_at IS NULL) "
                "GROUP BY kind").fetchall())
            kept = dict(c.execute("SELECT kind, count(*) FROM mixed_steps GROUP BY kind"
                                  ).fetchall())
            return int(running), live, kept

        counts: tuple[int, dict[str, int], dict[str, int]] = self._reading(
            "count job loads", read)
        return counts

    def prune_loads(self, now: float, keep_days: float) -> int:
        """Delete rows gone (or last seen) more than ``keep_days`` ago, and mixed steps
        found that long ago (0: none)."""
        self._require_rw()
        if keep_days <= 0:
            return 0
        cutoff = now - keep_days * 86400

        def body(conn: sqlite3.Connection) -> int:
            n = conn.execute("DELETE FROM job_loads WHERE coalesce(gone_at, seen_at) < ?",
                             (cutoff,)).rowcount
            n += conn.execute("DELETE FROM mixed_steps WHERE found_at < ?", (cutoff,)).rowcount
            return int(n)

        return int(self._retrying(self._conn, body, "prune job loads"))
