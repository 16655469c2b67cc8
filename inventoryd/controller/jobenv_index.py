"""The job environments the gate saw: which libnccl each makes a job load, and what it
is, resolved in a thread of the collector (issue 40, docs/jobs.md, docs/collector.md).

The gate appends to its audit record of a batch job ``"job_env": {"key", "vars",
"uid"}`` (the job's loading variables, ``ncclguard.fingerprint.jobenv.loading_vars``,
and their ``env_key``). This worker tails the trail (its own
:class:`~inventoryd.controller.audit_tail.AuditTail`), and for each key it has not
resolved, or last resolved more than ``max_age_s`` before a job used it again:
``locate(vars, is_file)`` with :class:`~inventoryd.controller.jobaccess.Access` (a file
both the job's uid and this collector may read), then the library read by
``read-nccl`` in a child process within ``timeout_s``
(:func:`ncclguard.fingerprint.jobread.read_library`), never in this process. The rows go
to the loop (:meth:`JobEnvIndex.drain`), which writes them (the inventory's one
writer): ``job_envs`` (``ncclguard/store/jobenvs.py``), which the gate reads by key.

Strict about the trail: a ``job_env`` that is not a dict of the right types, holds a
variable the gate does not hand on, a value ``loading_vars`` would not keep, no loading
variable, or a key other than ``env_key(vars)`` (recomputed here) is ignored and counted
(:attr:`JobEnvIndex.ignored`). Bounded and fair: at most ``max_pending`` keys wait (past
it, the oldest of the uid holding most is dropped, counted in :attr:`JobEnvIndex.dropped`;
a job using it again brings it back); keys are taken in turns by uid, the uid served
least recently first, so one user's thousand environments cannot starve another's one;
a pass spends at most ``budget_s``; at most ``max_pending`` rows wait for the writer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inventoryd.controller.audit_tail import AuditTail
from inventoryd.controller.jobaccess import Access
from ncclguard.config import InventoryConfig
from ncclguard.fingerprint.jobenv import INPUTS, NCCL_VARS, env_key, loading_vars, locate
from ncclguard.fingerprint.jobread import read_library
from ncclguard.store.images import image_identity
from ncclguard.store.jobenvs import MAX_JOB_ENVS

__all__ = ["JobEnvIndex", "parse_job_env", "write_job_envs"]

log = logging.getLogger("ncclguard.collector.jobenv")

#: Keys waiting for resolution at most (a row each in the worst case: see MAX_JOB_ENVS).
MAX_PENDING = 1024
#: A key used again later than this after its resolution is resolved again: a venv is
#: rebuilt or a module's library replaced within minutes of a job's start, and the gate
#: checks the file's identity at every read (load_job_env's check_file) meanwhile.
MAX_AGE_S = 600.0
#: One read of one library at most (the reader child is killed past it).
READ_TIMEOUT_S = 60.0
#: A pass's budget: what is left waits for the next pass (every IDLE_S).
PASS_BUDGET_S = 60.0
IDLE_S = 5.0
_NAMES = frozenset(INPUTS + NCCL_VARS)


@dataclass
class Pending:
    vars: dict[str, str]
    uid: int | None
    used_at: float


def parse_job_env(value: Any) -> tuple[str, dict[str, str], int | None] | None:
    """``(key, vars, uid)`` of an audit record's ``job_env``, or None when it is not
    what the gate writes (module doc: strict)."""
    if not isinstance(value, dict):
        return None
    key, variables, uid = value.get("key"), value.get("vars"), value.get("uid")
    if not isinstance(key, str) or not isinstance(variables, dict):
        return None
    if uid is not None and (type(uid) is not int or not 0 <= uid < 1 << 32):
        return None
    if not variables or not all(isinstance(k, str) and k in _NAMES and isinstance(v, str)
                                for k, v in variables.items()):
        return None
    kept, problems = loading_vars(variables)
    if problems or kept != variables or not any(k in variables for k in INPUTS):
        return None
    if env_key(variables) != key:
        return None
    return key, dict(variables), uid


class JobEnvIndex:
    """The worker and what it hands the writer (module doc)."""

    def __init__(self, audit_path: Path | str, db: Path | None = None,
                 inv_config: InventoryConfig | None = None, *,
                 max_pending: int = MAX_PENDING, max_age_s: float = MAX_AGE_S,
                 timeout_s: float = READ_TIMEOUT_S,
                 reader: Callable[..., tuple[dict[str, Any] | None, str | None]] = read_library,
                 ) -> None:
        self.db, self.inv_config = db, inv_config
        self.max_pending, self.max_age_s, self.timeout_s = max_pending, max_age_s, timeout_s
        self.reader = reader
        self.pending: dict[int | None, OrderedDict[str, Pending]] = {}
        self.resolved: dict[str, float] | None = None  # key -> resolved_at (None: unread)
        self.ignored = 0  # job_env values not as the gate writes them
        self.dropped = 0  # pending keys dropped for the bound
        self._served: dict[int | None, int] = {}  # uid -> when last served (a sequence)
        self._seq = 0
        self._lock = threading.Lock()
        self._rows: list[dict[str, Any]] = []
        self._used: dict[str, float] = {}  # key -> a job's later use (for the writer)
        self._tail = AuditTail(audit_path, sink=self.seen)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the loop's side ------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ncclguard-jobenv",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def drain(self) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """The rows resolved and the later uses seen since the last call."""
        with self._lock:
            rows, used = self._rows, self._used
            self._rows, self._used = [], {}
        return rows, used

    # ---- the worker -----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_pass()
            except Exception:  # a bug must not end the thread: the next pass tries again
                log.exception("job environments: the pass failed; tried again")
            self._stop.wait(IDLE_S)

    def _known(self) -> dict[str, float]:
        """key -> resolved_at, read from the inventory once (what a restart knew)."""
        if self.resolved is None:
            from ncclguard.store import Inventory, InventoryError

            try:
                with Inventory(self.db, readonly=True, config=self.inv_config) as inv:
                    self.resolved = {k: v[0] for k, v in inv.job_env_states().items()}
            except InventoryError as e:
                log.warning("job environments: the inventory cannot be read (%s): every "
                            "key is resolved anew", e)
                self.resolved = {}
        return self.resolved

    def seen(self, rec: Mapping[str, Any]) -> None:
        """The audit tail's sink: one record of the gate's."""
        if "job_env" not in rec:
            return
        got = parse_job_env(rec.get("job_env"))
        if got is None:
            self.ignored += 1
            return
        key, variables, uid = got
        ts = rec.get("ts")
        when = float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) \
            else time.time()
        resolved = self._known().get(key)
        if resolved is not None and when - resolved <= self.max_age_s:
            with self._lock:
                self._used[key] = max(self._used.get(key, 0.0), when)
            return
        queue = self.pending.get(uid)
        if queue is not None and key in queue:
            queue[key].used_at = max(queue[key].used_at, when)
            return
        if sum(len(q) for q in self.pending.values()) >= self.max_pending:
            most = max(self.pending, key=lambda u: len(self.pending[u]))
            self.pending[most].popitem(last=False)
            self.dropped += 1
            if not self.pending[most]:
                del self.pending[most]
        self.pending.setdefault(uid, OrderedDict())[key] = Pending(variables, uid, when)

    def _next(self) -> tuple[str, Pending]:
        uid = min(self.pending, key=lambda u: self._served.get(u, -1))
        self._seq += 1
        self._served[uid] = self._seq
        if len(self._served) > 4 * self.max_pending:  # forget uids served long ago
            self._served = {u: s for u, s in self._served.items() if u in self.pending}
        queue = self.pending[uid]
        key, p = queue.popitem(last=False)
        if not queue:
            del self.pending[uid]
        return key, p

    def run_pass(self, now: float | None = None, *, budget_s: float = PASS_BUDGET_S,
                 max_keys: int | None = None) -> int:
        """Read the trail's new records, then resolve waiting keys in turns by uid while
        the budget lasts (and at most ``max_keys``); returns how many were resolved."""
        self._tail.poll()
        deadline = time.monotonic() + budget_s
        n = 0
        while self.pending and not self._stop.is_set() and time.monotonic() < deadline:
            if max_keys is not None and n >= max_keys:
                break
            with self._lock:
                if len(self._rows) >= self.max_pending:
                    break  # the writer takes none now (disk pressure): wait for it
            key, p = self._next()
            row = self.resolve(key, p)
            with self._lock:
                self._rows.append(row)
            known = self._known()
            known[key] = time.time() if now is None else now
            if len(known) > 2 * MAX_JOB_ENVS:  # the table holds no more: forget the oldest
                for k in sorted(known, key=known.__getitem__)[: len(known) // 2]:
                    del known[k]
            n += 1
        return n

    def resolve(self, key: str, p: Pending) -> dict[str, Any]:
        """One key's row (``Inventory.write_job_envs``)."""
        access = Access(p.uid)
        found = locate(p.vars, access.is_file)
        row: dict[str, Any] = {
            "key": key, "vars": p.vars, "uid": p.uid, "source": found.source,
            "path": found.path, "why": found.why,
            "problems": [*found.problems, *access.named()], "library": None, "ident": None,
            "error": None, "used_at": p.used_at}
        if found.path is None:
            if found.source != "host":  # the rules could not decide: not a library
                row["error"] = found.why
            return row
        try:
            before = image_identity(os.stat(found.path))
        except OSError as e:
            row["error"] = f"{found.path}: cannot be looked at ({e.strerror or e})"
            return row
        library, error = self.reader(found.path, found.source, timeout_s=self.timeout_s)
        try:
            after: tuple[int, int, int] | None = image_identity(os.stat(found.path))
        except OSError:
            after = None
        if error is None and after != before:
            error = f"{found.path}: changed while it was read: read again when next used"
        row.update(library=library if error is None else None, ident=before, error=error)
        return row


def write_job_envs(inv: Any, index: JobEnvIndex) -> int:
    """Write what the worker resolved since the last call (the loop's side)."""
    rows, used = index.drain()
    if rows or used:
        inv.write_job_envs(rows, used)
    return len(rows)
