"""The job environments the collector resolved (v9, issue 40; docs/store.md, the table
``job_envs``; docs/jobs.md): for each set of loading variables the gate saw a job start with, which
``libnccl.so.2`` it makes the job load and what that library is. The collector is the
only writer (``inventoryd/controller/jobenv_index.py``); the gate reads one row per job
(:meth:`JobEnvTables.load_job_env`)."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from ncclguard.store.connection import Database
from ncclguard.store.images import _not_the_indexed_file

__all__ = ["MAX_JOB_ENVS", "JobEnv", "JobEnvTables"]

#: At most this many rows; past it the least recently used (``used_at``, else
#: ``resolved_at``) are dropped. Every distinct set of a job's loading variables is a
#: row, and any user makes one at will (a new VIRTUAL_ENV per sbatch): unbounded, the
#: table would be a disk cost any user controls. 4,096 covers the environments a site's
#: jobs use at once many times over; a dropped key is resolved again when a job uses it
#: (the gate meanwhile finds it unknown: the job's NCCL cannot be read, a warning).
MAX_JOB_ENVS = 4096
#: A row's ``vars`` text at most (the key is over the full variables; the stored copy is
#: for people): past it each value is cut to ``_VALUE_KEPT`` characters.
MAX_VARS_TEXT = 16 << 10
_VALUE_KEPT = 1024
MAX_PROBLEMS = 16  # problems kept per row, each at most 500 characters


class JobEnv(NamedTuple):
    """What the collector resolved for one key (``load_job_env``)."""

    source: str  # LD_PRELOAD, VIRTUAL_ENV, CONDA_PREFIX, LD_LIBRARY_PATH or host
    path: str | None  # the library (None: the host's)
    library: dict[str, Any] | None  # evaluate_nccl's job dict; None: see error
    why: str  # the rule that chose it, in words
    error: str | None  # why the library is None (not read, or no longer the file read)
    problems: tuple[str, ...]  # what was not looked at, and why
    resolved_at: float


def _vars_text(variables: Mapping[str, str]) -> str:
    text = json.dumps(dict(sorted(variables.items())), separators=(",", ":"))
    if len(text) <= MAX_VARS_TEXT:
        return text
    return json.dumps({k: v[:_VALUE_KEPT] for k, v in sorted(variables.items())},
                      separators=(",", ":"))[:MAX_VARS_TEXT * 4]


class JobEnvTables(Database):
    """The ``job_envs`` table of an :class:`~ncclguard.store.Inventory`."""

    def write_job_envs(self, rows: Sequence[Mapping[str, Any]],
                       used: Mapping[str, float] | None = None, now: float | None = None,
                       max_rows: int = MAX_JOB_ENVS) -> None:
        """One transaction: each of ``rows`` (``{"key", "vars", "uid", "source", "path",
        "why", "problems", "library", "ident", "error", "used_at"}``, ``ident`` the
        library's (inode, size, ctime) when it was read) replaces its key's row,
        resolved ``now``; ``used`` (key -> when a job used it) moves the keys' ``used_at``
        forward; then the table is cut to ``max_rows`` (:data:`MAX_JOB_ENVS`)."""
        self._require_rw()
        now = time.time() if now is None else float(now)
        out: list[tuple[Any, ...]] = []
        for r in rows:
            ident = r.get("ident") or (None, None, None)
            library = r.get("library")
            out.append((
                str(r["key"]), _vars_text(r.get("vars") or {}),
                r["uid"] if isinstance(r.get("uid"), int) else None, str(r["source"]),
                r.get("path"), str(r.get("why") or ""),
                json.dumps([str(p)[:500] for p in (r.get("problems") or ())][:MAX_PROBLEMS]),
                json.dumps(library, sort_keys=True) if library is not None else None,
                *ident, str(r["error"])[:1000] if r.get("error") else None, now,
                r.get("used_at")))
        touched = [(float(t), k) for k, t in (used or {}).items()]

        def body(conn: sqlite3.Connection) -> None:
            conn.executemany(
                "INSERT INTO job_envs (key, vars, uid, source, path, why, problems, library, "
                "inode, size, mtime_ns, error, resolved_at, used_at) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT (key) DO UPDATE SET "
                "vars = excluded.vars, uid = excluded.uid, source = excluded.source, "
                "path = excluded.path, why = excluded.why, problems = excluded.problems, "
                "library = excluded.library, inode = excluded.inode, size = excluded.size, "
                "mtime_ns = excluded.mtime_ns, error = excluded.error, "
                "resolved_at = excluded.resolved_at, "
                "used_at = max(coalesce(used_at, 0), coalesce(excluded.used_at, 0))", out)
            conn.executemany("UPDATE job_envs SET used_at = max(coalesce(used_at, 0), ?) "
                             "WHERE key = ?", touched)
            conn.execute(
                "DELETE FROM job_envs WHERE key IN (SELECT key FROM job_envs ORDER BY "
                "coalesce(used_at, resolved_at) DESC, key LIMIT -1 OFFSET ?)", (max_rows,))

        self._retrying(self._conn, body, f"write {len(out)} job environments")

    def job_env_states(self) -> dict[str, tuple[float, float | None]]:
        """key -> (resolved_at, used_at) of every row (the collector's worker, at start)."""
        rows = self._reading("read job environments", lambda c: c.execute(
            "SELECT key, resolved_at, used_at FROM job_envs").fetchall())
        return {r[0]: (r[1], r[2]) for r in rows}

    def job_envs(self, limit: int = -1) -> list[dict[str, Any]]:
        """Every row (at most ``limit``), most recently used first (library and problems
        decoded)."""
        keys = ("key", "vars", "uid", "source", "path", "why", "problems", "library",
                "error", "resolved_at", "used_at")
        rows = self._reading("read job environments", lambda c: c.execute(
            f"SELECT {', '.join(keys)} FROM job_envs "  # noqa: S608 - fixed names
            "ORDER BY coalesce(used_at, resolved_at) DESC LIMIT ?", (limit,)).fetchall())
        out = [dict(zip(keys, r, strict=True)) for r in rows]
        for r in out:
            for k in ("vars", "problems", "library"):
                try:
                    r[k] = json.loads(r[k]) if r[k] is not None else None
                except (TypeError, ValueError, RecursionError):
                    r[k] = None
        return out

    def load_job_env(self, key: str, *, check_file: bool = True) -> JobEnv | None:
        """The gate's read of one job environment (its :func:`~ncclguard.fingerprint.
        jobenv.env_key`): None when the collector has not resolved it, else a
        :class:`JobEnv`. ``check_file``: the library at ``path`` must still be the file
        read (its inode, size and ctime, as the image index compares them:
        ``ncclguard/store/images.py``), else ``library`` is None and ``error`` says why.
        One indexed SELECT and one stat."""
        row = self._reading("read job environment", lambda c: c.execute(
            "SELECT source, path, library, why, error, problems, inode, size, mtime_ns, "
            "resolved_at FROM job_envs WHERE key = ?", (key,)).fetchone())
        if row is None:
            return None
        source, path, text, why, error, problems_text, inode, size, ctime, resolved = row
        try:
            problems = tuple(str(p) for p in json.loads(problems_text or "[]"))
        except (TypeError, ValueError, RecursionError):
            problems = ()
        library: dict[str, Any] | None = None
        if error is None and path is not None:
            try:
                library = json.loads(text) if text is not None else None
            except (TypeError, ValueError, RecursionError):
                library = None
            if not isinstance(library, dict):
                library, error = None, "the stored library cannot be read"
            elif check_file:
                changed = _not_the_indexed_file(path, (inode, size, ctime))
                if changed is not None:
                    library, error = None, f"{path}: {changed}"
        return JobEnv(str(source), path, library, str(why or ""),
                      None if error is None else str(error), problems, float(resolved))
