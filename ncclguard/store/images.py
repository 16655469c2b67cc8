"""The image index and the container runs (v5, v6; docs/containers.md): one row per
squashfs image under the admin's roots with the gate's ``image_values``, and the enroot
hook's verified records of what each container really had."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from ncclguard.store.connection import Database, chunks
from ncclguard.store.decoding import decoded as _decoded
from ncclguard.store.errors import database_failure


class ImageState(NamedTuple):
    """What the image index stored of one image (``image_states``)."""

    ident: tuple[int, int, int]  # (inode, size, mtime_ns) when it was last scanned
    attempts: int  # failures of this path in a row (0 once it was read)
    retry_at: float | None  # when a failure not about its content is tried again
    error: str | None


class ImageTables(Database):
    """The image and container tables of an :class:`~ncclguard.store.Inventory`."""

    def write_images(self, scanned: Sequence[dict[str, Any]], gone: Sequence[str] = (),
                     now: float | None = None) -> None:
        """Write image rows in one transaction: each item is ``{"path", "inode", "size",
        "mtime_ns", "record"}`` (a record of ``scan_image``) or the same with ``"error"``
        instead of a record, and then ``"attempts"`` (failures of that path in a row)
        and ``"retry_at"`` (when to try again; None: when it changes); ``gone``: paths
        no longer under the roots."""
        import hashlib  # not on the gate's path (3 ms)

        from ncclguard.fingerprint.canonical import canonical_json
        from ncclguard.fingerprint.image import image_values

        self._require_rw()
        now = time.time() if now is None else float(now)
        rows: list[tuple[Any, ...]] = []
        for item in scanned:
            record = item.get("record")
            head = (item["path"], item["inode"], item["size"], item["mtime_ns"], now)
            tail = (int(item.get("attempts") or 0), item.get("retry_at"))
            if record is not None:
                text = canonical_json(record)
                values = image_values(record)
                rows.append((*head, text, hashlib.sha256(text.encode()).hexdigest(),
                             canonical_json(values), values["nccl_version"], None, 0, None))
            else:
                rows.append((*head, None, None, None, None,
                             str(item.get("error") or "unreadable"), *tail))

        def body(conn: sqlite3.Connection) -> None:
            conn.executemany(
                "INSERT OR REPLACE INTO images (path, inode, size, mtime_ns, scanned_at, "
                "record, record_hash, image_values, nccl_version, error, attempts, retry_at) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", rows)
            for chunk in chunks(list(gone)):
                conn.execute("DELETE FROM images WHERE path IN (SELECT value FROM json_each(?))",
                             (json.dumps(chunk),))

        self._retrying(self._conn, body, f"write {len(rows)} images")

    def image_states(self) -> dict[str, ImageState]:
        """path -> what the scanner knows of every indexed image: its identity, its
        failures in a row and when to try it again."""
        rows = self._reading("read images", lambda c: c.execute(
            "SELECT path, inode, size, mtime_ns, attempts, retry_at, error FROM images"
        ).fetchall())
        return {r[0]: ImageState((r[1], r[2], r[3]), r[4], r[5], r[6]) for r in rows}

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
        out["record"] = _decoded(out["record"], None) if out["record"] else None
        return out

    def load_image_values(self, path: str, *, check_file: bool = False
                          ) -> tuple[dict[str, Any] | None, str | None] | None:
        """The gate's read of one image: None when it is not indexed, else
        ``(image_values, error)`` (values None with the cause when it was unreadable).
        A record that fails the check is computed again from the stored record.
        ``check_file`` (the gate, ``ncclguard check``): the file at ``path`` must still be
        the one indexed (:func:`image_identity`, as the index keys
        it), else values None with the cause (issue 48: a replaced image was judged by
        the old file's NCCL until the collector read it again)."""
        from ncclguard.fingerprint.image import image_values, valid_image_values

        row = self._reading("read image", lambda c: c.execute(
            "SELECT image_values, error, record, inode, size, mtime_ns FROM images "
            "WHERE path = ?", (path,)).fetchone())
        if row is None:
            return None
        text, error, record, inode, size, mtime_ns = row
        if error is not None:
            return None, str(error)
        if check_file:
            why = _not_the_indexed_file(path, (inode, size, mtime_ns))
            if why is not None:
                return None, why
        try:
            values = json.loads(text)
            if valid_image_values(values):
                return values, None
            values = image_values(json.loads(record))
        except (TypeError, ValueError, RecursionError, AttributeError):
            return None, "the stored record cannot be read"
        return (values, None) if valid_image_values(values) else (
            None, "the stored record cannot be read")

    def write_container_runs(self, runs: Sequence[dict[str, Any]], *,
                             max_steps: int = 0) -> list[str]:
        """Store verified container records: each ``{"job", "step", "host", "encoded_at",
        "uid", "origin", "file_state", "nccl_version", "record"}``; a newer one replaces
        an older one. Each in a savepoint: one that cannot be stored ("invalid: ...") or
        that would be more than ``max_steps`` steps of its job on its node
        ("over-quota: ...") is left out alone. Returns one status per run, "written" for
        the others."""
        from ncclguard.fingerprint.canonical import canonical_json

        self._require_rw()

        def body(conn: sqlite3.Connection) -> list[str]:
            out = []
            for r in runs:
                conn.execute("SAVEPOINT run")
                try:
                    version = r.get("nccl_version")
                    row = (str(r["job"]), str(r["step"]), str(r["host"]),
                           float(r["encoded_at"]), int(r["uid"]), str(r["origin"]),
                           str(r["file_state"]), version if isinstance(version, str) else None,
                           canonical_json(r["record"]))
                    if max_steps and conn.execute(
                            "SELECT count(*) >= ? AND NOT EXISTS (SELECT 1 FROM container_runs "
                            "WHERE job = ? AND step = ? AND host = ?) FROM container_runs "
                            "WHERE job = ? AND host = ?",
                            (max_steps, row[0], row[1], row[2], row[0], row[2])).fetchone()[0]:
                        out.append(f"over-quota: job {row[0]} already has {max_steps} steps "
                                   f"recorded on {row[2]}")
                    else:
                        conn.execute(
                            "INSERT INTO container_runs VALUES (?,?,?,?,?,?,?,?,?) "
                            "ON CONFLICT (job, step, host) DO UPDATE SET "
                            "encoded_at = excluded.encoded_at, uid = excluded.uid, "
                            "origin = excluded.origin, file_state = excluded.file_state, "
                            "nccl_version = excluded.nccl_version, record = excluded.record "
                            "WHERE excluded.encoded_at >= container_runs.encoded_at", row)
                        out.append("written")
                except Exception as e:
                    if database_failure(e):
                        raise
                    conn.execute("ROLLBACK TO run")
                    out.append(f"invalid: {type(e).__name__}: {str(e)[:200]}")
                conn.execute("RELEASE run")
            return out

        return self._retrying(self._conn, body, f"write {len(runs)} container records")

    def prune_container_runs(self, now: float, keep_days: float) -> int:
        """Delete container records signed more than ``keep_days`` ago (0: none)."""
        self._require_rw()
        if keep_days <= 0:
            return 0
        return int(self._retrying(self._conn, lambda conn: conn.execute(
            "DELETE FROM container_runs WHERE encoded_at < ?",
            (now - keep_days * 86400,)).rowcount, "prune container records"))

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
            r["record"] = _decoded(r["record"], None)  # None: unreadable (its shape: spool)
        return out


class RegistryTag(NamedTuple):
    """What the registry index knows of one reference (``registry_tags``)."""

    ref: str
    digest: str | None  # the manifest digest it last resolved to (None: never)
    resolved_at: float | None  # when it last resolved
    moved_at: float | None  # when that digest last changed
    checked_at: float  # the last attempt
    state: str  # of the last attempt (registry.STATES)
    error: str | None
    attempts: int  # failures in a row
    retry_at: float | None
    source: str  # "config" (registry.refs) or "audit" (a job used it)
    used_at: float | None  # when the gate last saw a job use it


class RegistryTables(Database):
    """The registry index of an :class:`~ncclguard.store.Inventory` (v8,
    docs/containers.md, "Registry images")."""

    def write_registry(self, tags: Sequence[dict[str, Any]],
                       images: Sequence[dict[str, Any]] = (),
                       layers: Sequence[dict[str, Any]] = (), now: float | None = None) -> None:
        """One transaction: ``tags`` (``{"ref", "digest", "index_digest", "state",
        "error", "attempts", "retry_at", "source", "used_at"}``; a tag whose digest changed gets
        ``moved_at`` now, an ``ok`` one ``resolved_at`` now, a failed one keeps what it
        had resolved to), ``images`` (``{"digest", "platform", "record"}`` or with
        ``"error"``), ``layers`` (summaries of :mod:`inventoryd.controller.images.layers`)."""
        import hashlib

        from ncclguard.fingerprint.canonical import canonical_json
        from ncclguard.fingerprint.image import image_values

        self._require_rw()
        now = time.time() if now is None else float(now)
        image_rows: list[tuple[Any, ...]] = []
        for item in images:
            record = item.get("record")
            size = ((record or {}).get("image") or {}).get("size")
            if record is not None:
                text = canonical_json(record)
                values = image_values(record)
                image_rows.append((item["digest"], item["platform"], now, size, text,
                                   hashlib.sha256(text.encode()).hexdigest(),
                                   canonical_json(values), values["nccl_version"], None))
            else:
                image_rows.append((item["digest"], item["platform"], now, None, None, None,
                                   None, None, str(item.get("error") or "unreadable")))
        layer_rows = [(s["digest"], int(s["size"]), canonical_json(s), now) for s in layers]

        def body(conn: sqlite3.Connection) -> None:
            for t in tags:
                ok = t["state"] == "ok"
                old = conn.execute("SELECT digest, resolved_at, moved_at FROM registry_tags "
                                   "WHERE ref = ?", (t["ref"],)).fetchone()
                digest, resolved, moved = old if old else (None, None, None)
                index_digest = t.get("index_digest")
                if ok:
                    if t["digest"] != digest:
                        moved = now
                    digest, resolved = t["digest"], now
                conn.execute(
                    "INSERT INTO registry_tags (ref, digest, index_digest, resolved_at, "
                    "moved_at, checked_at, state, error, attempts, retry_at, source, used_at) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT (ref) DO UPDATE SET "
                    "digest = excluded.digest, index_digest = coalesce(excluded.index_digest,"
                    " CASE WHEN excluded.state = 'ok' THEN NULL ELSE index_digest END), "
                    "resolved_at = excluded.resolved_at, moved_at = excluded.moved_at, "
                    "checked_at = excluded.checked_at, state = excluded.state, "
                    "error = excluded.error, attempts = excluded.attempts, "
                    "retry_at = excluded.retry_at, source = excluded.source, "
                    "used_at = max(coalesce(used_at, 0), coalesce(excluded.used_at, 0))",
                    (t["ref"], digest, index_digest, resolved, moved, now, t["state"],
                     t.get("error"), int(t.get("attempts") or 0), t.get("retry_at"),
                     str(t.get("source") or "audit"), t.get("used_at")))
            conn.executemany("INSERT OR REPLACE INTO registry_images VALUES (?,?,?,?,?,?,?,?,?)",
                             image_rows)
            conn.executemany("INSERT OR REPLACE INTO registry_layers VALUES (?,?,?,?)",
                             layer_rows)

        self._retrying(self._conn, body, f"write {len(tags)} registry tags")

    def forget_registry(self, refs: Sequence[str], *, layer_grace_s: float = 86400.0,
                        now: float | None = None) -> None:
        """Drop tags no job used for long and that the config no longer lists, then the
        images and layers no tag reaches any longer: a layer summary no stored image's
        record holds, read more than ``layer_grace_s`` ago (a younger one may be of an
        image whose read failed part-way, and is read again next)."""
        self._require_rw()
        cutoff = (time.time() if now is None else float(now)) - layer_grace_s

        def body(conn: sqlite3.Connection) -> None:
            for chunk in chunks(list(refs)):
                conn.execute("DELETE FROM registry_tags WHERE ref IN "
                             "(SELECT value FROM json_each(?))", (json.dumps(chunk),))
            conn.execute("DELETE FROM registry_images WHERE digest NOT IN "
                         "(SELECT digest FROM registry_tags WHERE digest IS NOT NULL)")
            conn.execute(
                "DELETE FROM registry_layers WHERE read_at <= ? AND digest NOT IN ("
                "SELECT json_extract(l.value, '$.digest') FROM registry_images i, "
                "json_each(i.record, '$.image.layers') l WHERE i.record IS NOT NULL "
                "AND json_valid(i.record))", (cutoff,))

        self._retrying(self._conn, body, f"forget {len(refs)} registry tags")

    def image_mark(self) -> str:
        """A cheap mark of the image and registry index: it changes whenever an image is
        scanned or a tag resolved or tried, so that the features daemon reads the images
        again only then (its ``image`` lines, docs/scheduling.md)."""
        row = self._reading("read the image index's mark", lambda c: c.execute(
            "SELECT (SELECT count(*) || ':' || coalesce(max(scanned_at), 0) FROM images), "
            "(SELECT count(*) || ':' || coalesce(max(checked_at), 0) || ':' || "
            "coalesce(max(resolved_at), 0) FROM registry_tags), "
            "(SELECT count(*) || ':' || coalesce(max(scanned_at), 0) FROM registry_images)"
        ).fetchone())
        return "|".join(str(x) for x in row)

    def registry_tags(self) -> dict[str, RegistryTag]:
        rows = self._reading("read registry tags", lambda c: c.execute(
            "SELECT ref, digest, resolved_at, moved_at, checked_at, state, error, attempts, "
            "retry_at, source, used_at FROM registry_tags ORDER BY ref").fetchall())
        return {r[0]: RegistryTag(*r) for r in rows}

    def registry_layer(self, digest: str) -> dict[str, Any] | None:
        """A layer's stored summary (None: not read yet, or unreadable as stored)."""
        row = self._reading("read registry layer", lambda c: c.execute(
            "SELECT summary FROM registry_layers WHERE digest = ?", (digest,)).fetchone())
        return _decoded(row[0], None) if row else None

    def registry_images(self) -> list[dict[str, Any]]:
        """Every tag with its image: ref, digest, resolved_at, moved_at, state, error
        (the tag's), nccl_version, image_error, size."""
        rows = self._reading("read registry images", lambda c: c.execute(
            "SELECT t.ref, t.digest, t.resolved_at, t.moved_at, t.checked_at, t.state, "
            "t.error, i.nccl_version, i.error, i.size, i.record_hash FROM registry_tags t "
            "LEFT JOIN registry_images i ON i.digest = t.digest ORDER BY t.ref").fetchall())
        keys = ("ref", "digest", "resolved_at", "moved_at", "checked_at", "state", "error",
                "nccl_version", "image_error", "size", "record_hash")
        return [dict(zip(keys, r, strict=True)) for r in rows]

    def registry_image(self, ref: str) -> dict[str, Any] | None:
        """One tag's row with its image's full ``record`` (None: not in the index)."""
        row = self._reading("read registry image", lambda c: c.execute(
            "SELECT t.ref, t.digest, t.resolved_at, t.moved_at, t.checked_at, t.state, "
            "t.error, i.nccl_version, i.error, i.size, i.scanned_at, i.record "
            "FROM registry_tags t LEFT JOIN registry_images i ON i.digest = t.digest "
            "WHERE t.ref = ?", (ref,)).fetchone())
        if row is None:
            return None
        keys = ("ref", "digest", "resolved_at", "moved_at", "checked_at", "state", "error",
                "nccl_version", "image_error", "size", "scanned_at", "record")
        out = dict(zip(keys, row, strict=True))
        out["record"] = _decoded(out["record"], None) if out["record"] else None
        return out

    def registry_record(self, digest: str) -> dict[str, Any] | None:
        """The image record of one manifest digest (None: not read, or unreadable)."""
        row = self._reading("read registry image", lambda c: c.execute(
            "SELECT record FROM registry_images WHERE digest = ?", (digest,)).fetchone())
        return _decoded(row[0], None) if row and row[0] else None

    def load_registry_values(self, ref: str) -> dict[str, Any] | None:
        """The gate's read of one reference: None when the index does not know it, else
        ``{"digest", "resolved_at", "moved_at", "state", "error", "values",
        "image_error", "read"}`` (``read``: whether its image was read, well or not)."""
        from ncclguard.fingerprint.image import valid_image_values

        row = self._reading("read registry image", lambda c: c.execute(
            "SELECT t.digest, t.resolved_at, t.moved_at, t.state, t.error, i.image_values, "
            "i.error, i.digest IS NOT NULL FROM registry_tags t LEFT JOIN registry_images i "
            "ON i.digest = t.digest WHERE t.ref = ?", (ref,)).fetchone())
        if row is None:
            return None
        values = None
        if row[5]:
            try:
                v = json.loads(row[5])
                values = v if valid_image_values(v) else None
            except (TypeError, ValueError, RecursionError):
                values = None
        image_error = row[6] if values is None and row[7] else None
        if row[7] and values is None and image_error is None:
            image_error = "the stored record cannot be read"
        return {"digest": row[0], "resolved_at": row[1], "moved_at": row[2], "state": row[3],
                "error": row[4], "values": values, "image_error": image_error,
                "read": bool(row[7])}


def image_identity(st: os.stat_result) -> tuple[int, int, int]:
    """An image file's identity, the one the index keys and the gate compares: (inode,
    size, change time). The change time (ctime), never the mtime: a user who can write a
    root sets an image's mtime at will (``touch -d``), back, or forward past any later
    write (issue 48's hostile review: mtime set to 2100, the file rewritten in place
    with another NCCL, and the later of the two never moved); every write, rename, link
    and chmod moves the ctime, which only the kernel sets. Stored in the ``images``
    table's ``mtime_ns`` column."""
    return st.st_ino, st.st_size, st.st_ctime_ns


def _not_the_indexed_file(path: str, indexed: tuple[Any, Any, Any]) -> str | None:
    """Why the file at ``path`` is not the one indexed as :func:`image_identity`, or
    None."""
    try:
        st = os.stat(path)
    except OSError as e:
        return (f"the file cannot be looked at ({e.strerror or e}): it may not be the one "
                "indexed")
    if image_identity(st) != tuple(indexed):
        return ("the file changed since it was indexed: read again at the collector's "
                "next pass")
    return None
