"""Each node's class (v7, docs/store.md): the key the policy derives from what the
configured refuse-level rules read (``ncclguard.policy.schedule.class_key``), stored per
node by the writer, derived again when the policy changes, and derived by a reader whose
policy is not the one the stored keys were derived under."""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from ncclguard.store.connection import chunks
from ncclguard.store.decoding import decoded as _decoded
from ncclguard.store.nodes import NodeTables

_CLASS_KEY = re.compile(r"[0-9a-f]{64}").fullmatch  # a stored class key of another shape is
                                                    # derived again, never trusted


class NodeClass(NamedTuple):
    """One class of the inventory (:meth:`Inventory.classes`): its key, what its nodes
    report of the stack (``ncclguard.fingerprint.compat.compat_values``: a value all of
    them share, None where they differ or it is unknown), its hosts, and each field on
    which its nodes differ with every value seen (a difference the configured policy
    does not refuse: a rule at ``warn``)."""

    key: str
    values: dict[str, Any]
    hosts: list[str]
    spread: dict[str, list[Any]]


class ClassTables(NodeTables):
    """The classes of an :class:`~ncclguard.store.Inventory`: handed in by the caller as
    ``values=`` (``ncclguard.policy.schedule.class_values``), as the store never imports
    the policy."""

    def _classifier(self) -> tuple[Callable[[dict[str, Any]], str], str | None]:
        if self.values is None or self.values.classify is None:
            raise ValueError("classes need values= with a policy's classes "
                             "(ncclguard.policy.schedule.class_values)")
        return self.values.classify, self.values.class_policy

    def derive_classes(self, now: float | None = None) -> int:
        """Store every node's class key under the policy handed in, when the stored keys
        were derived under another one (an admin changed a severity) or some are missing;
        one transaction. Returns the number of nodes whose key was written (0: current).
        A node whose record cannot be read keeps no key (readers take it as unknown)."""
        self._require_rw()
        classify, policy = self._classifier()
        assert self.values is not None
        version, check = self.values.version, self.values.check
        now = time.time() if now is None else float(now)
        from ncclguard.store.schema import record_key

        def body(conn: sqlite3.Connection) -> int:
            row = conn.execute("SELECT value FROM collector_state "
                               "WHERE name = 'class_policy'").fetchone()
            if row is not None and row[0] == policy and conn.execute(
                    "SELECT 1 FROM gate_nodes WHERE class_key IS NULL LIMIT 1").fetchone() is None:
                return 0
            rows = conn.execute(
                "SELECT g.host, g.policy_key, g.values_version, p.policy_values "
                "FROM gate_nodes g LEFT JOIN policy_values p ON p.policy_key = g.policy_key"
            ).fetchall()
            by_record: dict[str, str | None] = {}  # policy_key -> class key: one per record
            updates: list[tuple[str | None, str]] = []
            for host, key, ver, text in rows:
                if ver == version and key in by_record:
                    updates.append((by_record[key], host))
                    continue
                record: Any = None
                if ver == version and isinstance(text, str) and record_key(ver, text) == key:
                    with contextlib.suppress(ValueError, RecursionError):
                        record = json.loads(text)
                if not check(record):  # another version's, or damaged: from the fingerprint
                    record = self._values_from_fingerprint(conn, host)
                klass = classify(record) if record is not None else None
                if ver == version and check(record):
                    by_record[key] = klass
                updates.append((klass, host))
            conn.executemany("UPDATE gate_nodes SET class_key = ? WHERE host = ?", updates)
            conn.execute("INSERT OR REPLACE INTO collector_state VALUES ('class_policy', ?, ?)",
                         (policy, now))
            return len(updates)

        return self._retrying(self._conn, body, "derive the classes")

    def _values_from_fingerprint(self, conn: sqlite3.Connection, host: str) -> Any:
        assert self.values is not None
        row = conn.execute("SELECT fingerprint FROM nodes WHERE host = ?", (host,)).fetchone()
        try:
            record = self.values.compute(json.loads(row[0]))
        except Exception:  # a node's bad record is that node's: unknown
            return None
        return record if self.values.check(record) else None

    def stored_class_policy(self) -> str | None:
        """What the stored class keys were derived under (``class_policy`` of the writer's
        config; None: never derived)."""
        row = self._reading("read the class policy", lambda c: c.execute(
            "SELECT value FROM collector_state WHERE name = 'class_policy'").fetchone())
        return str(row[0]) if row is not None else None

    def class_keys(self, hosts: Iterable[str] | None = None) -> dict[str, str | None]:
        """Each node's class key (None: no readable record), every node of the inventory
        when ``hosts`` is None. The stored keys when they were derived under the policy
        handed in (``values=``, :meth:`derive_classes`); derived here from the gate's
        values for the nodes whose key is missing or was derived under another policy
        (the collector has not loaded the config this reader has)."""
        classify, policy = self._classifier()
        assert self.values is not None
        version = self.values.version
        wanted = None if hosts is None else list(dict.fromkeys(hosts))

        def q(conn: sqlite3.Connection) -> tuple[Any, list[tuple[str, Any, Any]]]:
            stored = conn.execute("SELECT value FROM collector_state "
                                  "WHERE name = 'class_policy'").fetchone()
            if wanted is None:
                return stored, conn.execute(
                    "SELECT host, class_key, values_version FROM gate_nodes").fetchall()
            rows: list[tuple[str, Any, Any]] = []
            for chunk in chunks(wanted):
                rows += conn.execute(
                    "SELECT host, class_key, values_version FROM gate_nodes "
                    "WHERE host IN (SELECT value FROM json_each(?))", (json.dumps(chunk),)
                ).fetchall()
            return stored, rows

        stored, rows = self._reading("load classes", q)
        trusted = stored is not None and stored[0] == policy
        out: dict[str, str | None] = dict.fromkeys(wanted) if wanted is not None else {}
        redo: list[str] = []
        for host, key, ver in rows:
            if trusted and ver == version and isinstance(key, str) and _CLASS_KEY(key):
                out[host] = key
            else:
                redo.append(host)
        if redo:
            done: dict[int, str] = {}  # load_values shares one dict among equal records
            for host, rec in self.load_values(redo).items():
                if rec is None:
                    out[host] = None
                    continue
                key = done.get(id(rec[0]))
                if key is None:
                    key = done[id(rec[0])] = classify(rec[0])
                out[host] = key
        return out

    def classes(self, hosts: Iterable[str] | None = None) -> list[NodeClass]:
        """The nodes of the inventory (or of ``hosts``) by class (:meth:`class_keys`),
        the largest first; nodes without a readable record are left out."""
        keys = self.class_keys(hosts)
        members = [h for h, k in keys.items() if k is not None]

        def q(conn: sqlite3.Connection) -> list[tuple[str, str]]:
            rows: list[tuple[str, str]] = []
            for chunk in chunks(members):
                rows += conn.execute(
                    "SELECT host, compat_values FROM nodes "
                    "WHERE host IN (SELECT value FROM json_each(?))", (json.dumps(chunk),)
                ).fetchall()
            return rows

        # nodes of one class mostly store the same text: each distinct text decoded once
        by_key: dict[str, dict[str, list[str]]] = {}  # key -> compat_values text -> hosts
        for host, text in self._reading("load classes", q):
            key = keys[host]
            assert key is not None
            by_key.setdefault(key, {}).setdefault(text, []).append(host)
        out = []
        for key, per_text in by_key.items():
            fields: dict[str, dict[str, Any]] = {}  # field -> canonical value -> value
            for text in per_text:
                values = _decoded(text, {})
                for name, value in (values.items() if isinstance(values, dict) else ()):
                    fields.setdefault(name, {})[json.dumps(value, sort_keys=True)] = value
            shared = {n: (next(iter(v.values())) if len(v) == 1 else None)
                      for n, v in fields.items()}
            spread = {n: [v[c] for c in sorted(v)] for n, v in fields.items() if len(v) > 1}
            hosts = sorted(h for hs in per_text.values() for h in hs)
            out.append(NodeClass(key, shared, hosts, spread))
        return sorted(out, key=lambda c: (-len(c.hosts), c.key))
