"""The inventory's schema: its migrations, and the gate's narrow tables.

Tables (docs/store.md): ``nodes`` (one row per host: the fingerprint, its hash, its
compatibility key and the query columns), ``libraries``, ``plugins``, ``rdma_ports``
(one row per item, for queries), ``history`` (every change, with its field diff), and
the gate's ``gate_nodes`` / ``policy_values``.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from typing import Any, Protocol

from ncclguard.fingerprint.canonical import canonical_json

__all__ = [
    "MIGRATIONS", "SCHEMA_VERSION", "GateValues", "gate_record", "record_key", "write_gate_row",
]

# Each migration takes the schema from version i to i+1. They run inside one
# BEGIN IMMEDIATE transaction together with the user_version bump, so a
# migration runs exactly once even when many writers start on a fresh file.


def _migrate_0_to_1(conn: sqlite3.Connection, values: GateValues) -> None:
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


def _migrate_1_to_2(conn: sqlite3.Connection, values: GateValues) -> None:
    """Add the gate's narrow tables: ``gate_nodes`` and ``policy_values``.

    The gate loads up to 16,384 nodes per job. Reading them from ``nodes`` cost it
    seconds: every column stored after the fingerprint sits behind that blob's overflow
    pages. ``gate_nodes`` holds per host only the key of its policy values
    (:func:`ncclguard.policy.node_values`) and its heartbeat; ``policy_values`` holds each
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
        key, text, _ = gate_record(values, fp)  # the class key's column comes with v7
        conn.execute("INSERT OR REPLACE INTO gate_nodes VALUES (?, ?, ?, ?)",
                     (host, key, heartbeat, values.version))
        conn.execute("INSERT OR IGNORE INTO policy_values VALUES (?, ?)", (key, text))


class GateValues(Protocol):
    """What the gate reads of one fingerprint, computed where the fingerprint is written.

    The policy owns it (``ncclguard.policy.GATE_VALUES``: its ``node_values`` and their
    version); the store's callers hand it in, so that the store never imports the policy.
    ``marker`` is a key that every record holds; ``check`` tells a record of the right
    shape and types from one that is not (a check on what is decoded). With the classes
    of a policy (``ncclguard.policy.schedule.class_values``): ``classify`` gives a
    record's class key, ``class_policy`` names what the keys are derived under.
    """

    @property
    def version(self) -> int: ...
    @property
    def marker(self) -> str: ...
    @property
    def compute(self) -> Callable[[dict[str, Any]], dict[str, Any]]: ...
    @property
    def check(self) -> Callable[[Any], bool]: ...
    @property
    def classify(self) -> Callable[[dict[str, Any]], str] | None: ...
    @property
    def class_policy(self) -> str | None: ...


def _sha256() -> Callable[[bytes], Any]:
    """SHA-256 without importing OpenSSL where CPython has its own (the gate reads keys
    on every job: hashlib costs it about 3 ms, the builtin module 1.5): ``_sha256`` up
    to 3.11, ``_sha2`` from 3.12, else hashlib."""
    import importlib

    for name in ("_sha256", "_sha2", "hashlib"):
        try:
            return importlib.import_module(name).sha256  # type: ignore[no-any-return,unused-ignore]
        except (ImportError, AttributeError):
            continue
    raise ImportError("no SHA-256 implementation")


def record_key(version: int, text: str) -> str:
    """The key of a stored ``policy_values`` record: it names its text, so that a reader
    can tell a record whose text was changed under its key."""
    return str(_sha256()(f"{version}:{text}".encode()).hexdigest()[:32])


def gate_record(values: GateValues, fp: dict[str, Any]) -> tuple[str, str, str | None]:
    """``(key, canonical JSON, class key)`` of what the policy reads of one fingerprint
    (the class key None without ``values.classify``: readers derive it then)."""
    record = values.compute(fp)
    text = canonical_json(record)
    klass = values.classify(record) if values.classify is not None else None
    return record_key(values.version, text), text, klass


def write_gate_row(
    conn: sqlite3.Connection, host: str, record: tuple[str, str, str | None], heartbeat: float,
    version: int,
) -> None:
    key, text, klass = record
    old = conn.execute("SELECT policy_key FROM gate_nodes WHERE host = ?", (host,)).fetchone()
    conn.execute("INSERT OR IGNORE INTO policy_values VALUES (?, ?)", (key, text))
    conn.execute(
        "INSERT OR REPLACE INTO gate_nodes (host, policy_key, last_heartbeat, values_version, "
        "class_key) VALUES (?, ?, ?, ?, ?)",
        (host, key, heartbeat, version, klass),
    )
    if old is not None and old[0] != key:  # drop a record that no node uses any more
        conn.execute(
            "DELETE FROM policy_values WHERE policy_key = ? AND NOT EXISTS "
            "(SELECT 1 FROM gate_nodes WHERE policy_key = ?)",
            (old[0], old[0]),
        )


def _migrate_2_to_3(conn: sqlite3.Connection, values: GateValues) -> None:
    """Add the collector's tables (docs/collector.md): ``publishers``, the record it last
    accepted from each spool file, and ``rejections``, one row per file and cause; and
    ``nodes.errors_hash``, the hash of the probes' error list, which the fingerprint hash
    leaves out (a transient error is not a change: docs/store.md)."""
    conn.execute("ALTER TABLE nodes ADD COLUMN errors_hash TEXT")
    conn.execute(
        "CREATE TABLE publishers (host TEXT PRIMARY KEY, file TEXT NOT NULL, "
        "file_state TEXT NOT NULL, digest TEXT NOT NULL, encoded_at REAL NOT NULL, "
        "seq INTEGER NOT NULL, origin TEXT NOT NULL, uid INTEGER NOT NULL, "
        "accepted_at REAL NOT NULL) WITHOUT ROWID"
    )
    conn.execute(
        "CREATE TABLE rejections (file TEXT NOT NULL, cause TEXT NOT NULL, host TEXT, "
        "detail TEXT NOT NULL, file_state TEXT NOT NULL, first_at REAL NOT NULL, "
        "last_at REAL NOT NULL, count INTEGER NOT NULL, resolved_at REAL, "
        "PRIMARY KEY (file, cause)) WITHOUT ROWID"
    )


def _migrate_3_to_4(conn: sqlite3.Connection, values: GateValues) -> None:
    """Add the query columns of the plugins in force per kind (issue 13: tuner, profiler,
    env, GIN, RMA; ``ncclguard.store.rows.PLUGIN_COLUMNS``) and fill them from each stored
    fingerprint. A fingerprint from a daemon before issue 13 has no ``effective`` part:
    its columns stay NULL (unknown) until that node publishes again."""
    from ncclguard.store.rows import PLUGIN_COLUMNS, plugin_columns

    for col in PLUGIN_COLUMNS:
        kind = "INTEGER" if col.endswith("_abi") else "TEXT"
        conn.execute(f"ALTER TABLE nodes ADD COLUMN {col} {kind}")
    sets = ", ".join(f"{c} = ?" for c in PLUGIN_COLUMNS)
    for host, fp_json in conn.execute("SELECT host, fingerprint FROM nodes").fetchall():
        try:
            fp = json.loads(fp_json)
            cols = plugin_columns(fp) if isinstance(fp, dict) else None
        except (ValueError, TypeError, AttributeError):
            cols = None  # an unreadable or damaged fingerprint: unknown
        if cols is not None:
            conn.execute(f"UPDATE nodes SET {sets} WHERE host = ?",  # noqa: S608 - fixed names
                         (*(cols[c] for c in PLUGIN_COLUMNS), host))


def _migrate_4_to_5(conn: sqlite3.Connection, values: GateValues) -> None:
    """Add the image index (issue 15, docs/containers.md): one row per squashfs image
    under the admin's roots, keyed by path and identified by inode, size and mtime; the
    image record (NULL when the image could not be read, with ``error``) and the gate's
    narrow ``image_values`` (:func:`ncclguard.fingerprint.image.image_values`); and
    ``container_runs``, the enroot hook's records of what each container had."""
    conn.execute(
        "CREATE TABLE images (path TEXT PRIMARY KEY, inode INTEGER NOT NULL, "
        "size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, scanned_at REAL NOT NULL, "
        "record TEXT, record_hash TEXT, image_values TEXT, nccl_version TEXT, "
        "error TEXT) WITHOUT ROWID"
    )
    # what each node's container really had (the enroot hook's signed records)
    conn.execute(
        "CREATE TABLE container_runs (job TEXT NOT NULL, step TEXT NOT NULL, "
        "host TEXT NOT NULL, encoded_at REAL NOT NULL, uid INTEGER NOT NULL, "
        "origin TEXT NOT NULL, file_state TEXT NOT NULL, nccl_version TEXT, "
        "record TEXT NOT NULL, PRIMARY KEY (job, step, host)) WITHOUT ROWID"
    )


def _migrate_5_to_6(conn: sqlite3.Connection, values: GateValues) -> None:
    """Bounds (issue 25, docs/collector.md): ``history.bytes`` (the row's fingerprint and
    diff) and ``history.stored_at`` (the writer's clock) behind the covering index
    ``idx_history_usage``, for the per-node quota and change rate; ``images.attempts``
    and ``images.retry_at``, the image index's back-off; ``collector_state``, when the
    collector last wrote (``written``) and why the inventory cannot grow
    (``pressure``); an index on ``container_runs.encoded_at`` for pruning by age."""
    conn.execute("ALTER TABLE history ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0")
    conn.execute("ALTER TABLE history ADD COLUMN stored_at REAL NOT NULL DEFAULT 0")
    conn.execute("UPDATE history SET bytes = length(CAST(fingerprint AS BLOB)) + "
                 "length(CAST(diff AS BLOB)), stored_at = at")
    conn.execute("CREATE INDEX idx_history_usage ON history (host, stored_at, bytes)")
    conn.execute("ALTER TABLE images ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0")
    conn.execute("ALTER TABLE images ADD COLUMN retry_at REAL")
    conn.execute("CREATE TABLE collector_state (name TEXT PRIMARY KEY, value TEXT, "
                 "at REAL NOT NULL) WITHOUT ROWID")
    conn.execute("CREATE INDEX idx_container_runs_at ON container_runs (encoded_at)")


def _migrate_6_to_7(conn: sqlite3.Connection, values: GateValues) -> None:
    """One class (issue 27, docs/store.md): ``gate_nodes.class_key``, each node's class
    under the configured refuse-level rules (``ncclguard.policy.schedule.class_key``),
    which ``ncclguard classes``, drains, the metrics and Slurm's features all name. The
    column starts empty: the first writer that hands in a policy's classes derives every
    node's (:meth:`ncclguard.store.Inventory.derive_classes`), and records under which
    policy in ``collector_state`` (``class_policy``); until then readers derive them."""
    conn.execute("ALTER TABLE gate_nodes ADD COLUMN class_key TEXT")


def _migrate_7_to_8(conn: sqlite3.Connection, values: GateValues) -> None:
    """Registry images (issue 30, docs/containers.md): ``registry_tags``, each reference
    jobs use (``registry/repository:tag``) with the manifest digest it last resolved to,
    when (``resolved_at``), when that digest last changed (``moved_at``), the state of
    the last attempt and its error, and when a job last used it (``used_at``);
    ``registry_images``, one row per image manifest
    digest with its record and the gate's ``image_values``; ``registry_layers``, each
    layer's summary by its digest (a new tag reads only the layers it does not share)."""
    conn.execute(
        "CREATE TABLE registry_tags (ref TEXT PRIMARY KEY, digest TEXT, index_digest TEXT, "
        "resolved_at REAL, moved_at REAL, checked_at REAL NOT NULL, state TEXT NOT NULL, "
        "error TEXT, attempts INTEGER NOT NULL DEFAULT 0, retry_at REAL, "
        "source TEXT NOT NULL, used_at REAL) WITHOUT ROWID")
    conn.execute(
        "CREATE TABLE registry_images (digest TEXT PRIMARY KEY, platform TEXT NOT NULL, "
        "scanned_at REAL NOT NULL, size INTEGER, record TEXT, record_hash TEXT, "
        "image_values TEXT, nccl_version TEXT, error TEXT) WITHOUT ROWID")
    conn.execute(
        "CREATE TABLE registry_layers (digest TEXT PRIMARY KEY, size INTEGER NOT NULL, "
        "summary TEXT NOT NULL, read_at REAL NOT NULL) WITHOUT ROWID")


def _migrate_8_to_9(conn: sqlite3.Connection, values: GateValues) -> None:
    """The job environments (issue 40, docs/jobs.md): ``job_envs``, one row per set of
    loading variables the gate saw a job start with (``key``: their
    ``ncclguard.fingerprint.jobenv.env_key``), which libnccl they make a job load
    (``source``, ``path``, ``why``, ``problems``), what it is (``library``: the dict
    ``evaluate_nccl`` wants; NULL with ``error``), the file's identity when read
    (``inode``, ``size``, ``mtime_ns`` holding the ctime, as ``images`` does), when it was
    resolved and last used. The collector bounds it (ncclguard/store/jobenvs.py)."""
    conn.execute(
        "CREATE TABLE job_envs (key TEXT PRIMARY KEY, vars TEXT NOT NULL, uid INTEGER, "
        "source TEXT NOT NULL, path TEXT, why TEXT NOT NULL, problems TEXT NOT NULL, "
        "library TEXT, inode INTEGER, size INTEGER, mtime_ns INTEGER, error TEXT, "
        "resolved_at REAL NOT NULL, used_at REAL) WITHOUT ROWID")
    conn.execute("CREATE INDEX idx_job_envs_used ON job_envs "
                 "(coalesce(used_at, resolved_at))")


def _migrate_9_to_10(conn: sqlite3.Connection, values: GateValues) -> None:
    """What running job steps loaded (issue 42, docs/runtime.md): ``job_loads``, one row
    per (job, step, node) whose processes had a libnccl or an NCCL plugin mapped, from the
    node records' ``loaded`` part; ``mixed_steps``, one row per step found mixed
    (``ncclguard.policy.loaded.judge``) and what was done about its job."""
    conn.execute(
        "CREATE TABLE job_loads (job TEXT NOT NULL, step TEXT NOT NULL, host TEXT NOT NULL, "
        "uid INTEGER NOT NULL, procs INTEGER NOT NULL, since REAL, libs TEXT NOT NULL, "
        "cut INTEGER NOT NULL, seen_at REAL NOT NULL, gone_at REAL, "
        "PRIMARY KEY (job, step, host)) WITHOUT ROWID")
    conn.execute("CREATE INDEX idx_job_loads_host ON job_loads (host, seen_at)")
    conn.execute(
        "CREATE TABLE mixed_steps (job TEXT NOT NULL, step TEXT NOT NULL, "
        "found_at REAL NOT NULL, kind TEXT NOT NULL, summary TEXT NOT NULL, "
        "groups TEXT NOT NULL, odd TEXT NOT NULL, action TEXT, result TEXT, acted_at REAL, "
        "PRIMARY KEY (job, step)) WITHOUT ROWID")


def _migrate_10_to_11(conn: sqlite3.Connection, values: GateValues) -> None:
    """The canary (issue 43, docs/canary.md): ``canary_nodes``, each node's vetted class,
    its class now and whether it is held until its canary passes; ``canary_history``, what
    happened and who did it."""
    conn.execute(
        "CREATE TABLE canary_nodes (host TEXT PRIMARY KEY, accepted TEXT, class_key TEXT, "
        "state TEXT NOT NULL, changed_at REAL NOT NULL, held_since REAL, "
        "reason TEXT NOT NULL DEFAULT '', job_id INTEGER, job_nodes TEXT, submitted_at REAL, "
        "attempts INTEGER NOT NULL DEFAULT 0, updated_at REAL NOT NULL) WITHOUT ROWID")
    conn.execute("CREATE INDEX idx_canary_nodes_state ON canary_nodes (state)")
    conn.execute(
        "CREATE TABLE canary_history (id INTEGER PRIMARY KEY, at REAL NOT NULL, "
        "host TEXT NOT NULL, event TEXT NOT NULL, class_key TEXT, job_id INTEGER, "
        "detail TEXT NOT NULL, by TEXT NOT NULL)")
    conn.execute("CREATE INDEX idx_canary_history_host ON canary_history (host, id)")


MIGRATIONS: tuple[Callable[[sqlite3.Connection, GateValues], None], ...] = (
    _migrate_0_to_1,
    _migrate_1_to_2,
    _migrate_2_to_3,
    _migrate_3_to_4,
    _migrate_4_to_5,
    _migrate_5_to_6,
    _migrate_6_to_7,
    _migrate_7_to_8,
    _migrate_8_to_9,
    _migrate_9_to_10,
    _migrate_10_to_11,
)
SCHEMA_VERSION = len(MIGRATIONS)
