"""The gate's audit trail, tailed by the collector's exporter: the gate (one process per
job) only appends the line it always wrote (ncclguard/audit.py); this side reads the new
lines and counts decisions by outcome, action and rule, follow-ups (steering, holds) by
result, and the epilog's diagnoses by signature. Bounded: the last
:data:`AUDIT_BACKLOG_BYTES` at start, at most :data:`AUDIT_READ_MAX` a refresh."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inventoryd.controller.labels import _SIGNATURE, MAX_SERIES, OTHER
from ncclguard import config as configmod

log = logging.getLogger("ncclguard.collector")

AUDIT_BACKLOG_BYTES = 16 * 1024 * 1024  # at start, the audit trail's last 16 MiB are counted
AUDIT_READ_MAX = 64 * 1024 * 1024  # read at most this much of the trail per refresh
_MAX_LINE = 256 * 1024  # a partial line longer than this is dropped (audit lines are <= 64 KiB)
#: audit values counted by name; anything else is "other" (the trail is the gate's, but a
#: label must never take a value from outside a known, short list)
DECISIONS = ("accept", "warn", "refuse", "error")
ACTIONS = ("none", "steer", "requeue", "hold", "kill", "opt-out", "skip", "accept", "refuse")
FOLLOWUP_RESULTS = ("done", "skipped", "failed")
#: which check placed a job (the audit's ``path``; "other": records written before it)
PATHS = ("features", "gate", OTHER)
#: the (decision, action) pairs the gate writes (prolog/gate.py): exported at 0 from the
#: start, so that Prometheus's increase() sees a first refusal (a series that appears
#: at 1 has no increase)
GATE_OUTCOMES = (
    ("accept", "none"), ("accept", "opt-out"), ("accept", "skip"), ("warn", "none"),
    ("refuse", "steer"), ("refuse", "requeue"), ("refuse", "hold"), ("refuse", "kill"),
    ("error", "accept"), ("error", "refuse"), ("error", "hold"),
)
DIAGNOSE_OUTCOMES = ("diagnosed", "clean", "error")

@dataclass
class AuditCounts:
    """Counters from the gate's audit trail, since this process started reading it."""

    records: int = 0
    decisions: dict[tuple[str, str], int] = field(default_factory=dict)  # (decision, action)
    rules: dict[tuple[str, str], int] = field(default_factory=dict)  # (decision, rule)
    followups: dict[tuple[str, str], int] = field(default_factory=dict)  # (action, result)
    paths: dict[tuple[str, str], int] = field(default_factory=dict)  # (path, decision)
    diagnoses: dict[str, int] = field(default_factory=dict)  # signature id
    diagnose_jobs: dict[str, int] = field(default_factory=dict)  # diagnosed | clean | error
    last_ts: float | None = None

    def add(self, rec: Mapping[str, Any], rules: frozenset[str]) -> None:
        self.records += 1
        ts = rec.get("ts")
        if isinstance(ts, int | float) and not isinstance(ts, bool):
            self.last_ts = max(self.last_ts or 0.0, float(ts))
        decision = rec.get("decision")
        action = rec.get("action")
        if decision == "followup":
            key = (_one_of(action, ("steer", "hold")), _one_of(rec.get("result"),
                                                               FOLLOWUP_RESULTS))
            self.followups[key] = self.followups.get(key, 0) + 1
            return
        if decision == "diagnosis" or action == "diagnose":
            self._diagnosis(rec)
            return
        d = _one_of(decision, DECISIONS)
        key = (d, _one_of(action, ACTIONS))
        self.decisions[key] = self.decisions.get(key, 0) + 1
        if d in ("accept", "warn", "refuse"):  # which check placed it (docs/scheduling.md)
            path = (_one_of(rec.get("path"), PATHS), d)
            self.paths[path] = self.paths.get(path, 0) + 1
        findings = rec.get("findings")
        seen: set[str] = set()
        for f in findings if isinstance(findings, list) else []:
            rule = f.get("rule") if isinstance(f, Mapping) else None
            r = rule if isinstance(rule, str) and rule in rules else OTHER
            if r not in seen:
                seen.add(r)
                self.rules[(d, r)] = self.rules.get((d, r), 0) + 1

    def _diagnosis(self, rec: Mapping[str, Any]) -> None:
        diags = rec.get("diagnoses")
        found = [d.get("id") for d in diags if isinstance(d, Mapping)] \
            if isinstance(diags, list) else []
        outcome = "error" if rec.get("error") else ("diagnosed" if found else "clean")
        self.diagnose_jobs[outcome] = self.diagnose_jobs.get(outcome, 0) + 1
        for sig in dict.fromkeys(found):
            s = sig if isinstance(sig, str) and _SIGNATURE.fullmatch(sig) else OTHER
            if s not in self.diagnoses and len(self.diagnoses) >= MAX_SERIES - 1:
                s = OTHER
            self.diagnoses[s] = self.diagnoses.get(s, 0) + 1


def _one_of(value: Any, known: tuple[str, ...]) -> str:
    return value if isinstance(value, str) and value in known else OTHER


class AuditTail:
    """Reads what was appended to the audit trail since the last call, and counts it.

    The file is identified by (device, inode): a new file (rotated) is read from its
    start, a shorter one (truncated) too. At the first read only the last
    ``backlog_bytes`` are counted (a long trail is not read whole at every start); the
    counters restart with the process, as Prometheus counters may. A torn or foreign
    line is skipped, as :func:`ncclguard.audit.iter_records` does."""

    def __init__(self, path: Path | str, *, backlog_bytes: int = AUDIT_BACKLOG_BYTES,
                 read_max: int = AUDIT_READ_MAX,
                 sink: Callable[[Mapping[str, Any]], None] | None = None) -> None:
        from ncclguard.policy.rules import RULES

        self.path = Path(path)
        self.sink = sink  # also handed each record (the registry index: the images jobs use)
        self.backlog_bytes = backlog_bytes
        self.read_max = read_max
        self.counts = AuditCounts()
        self.rules = frozenset(r.name for r in RULES)
        self.signatures: tuple[str, ...] = ()  # the catalog's ids: exported at 0
        self._id: tuple[int, int] | None = None
        self._offset = 0
        self._partial = b""
        self._started = False
        self.up = True
        self.error: str | None = None

    def poll(self) -> int:
        """Count the new complete lines; returns how many records were read."""
        try:
            f = open(self.path, "rb", buffering=0)  # noqa: SIM115
        except FileNotFoundError:
            self.up, self.error = True, None  # no decision yet (or rotated away)
            self._started = True
            return 0
        except OSError as e:
            self._fail(f"{self.path}: {e.strerror or e}")
            return 0
        with f:
            st = os.fstat(f.fileno())
            ident = (st.st_dev, st.st_ino)
            if ident != self._id or st.st_size < self._offset:
                first = not self._started and self._id is None
                self._id = ident
                self._partial = b""
                self._offset = max(0, st.st_size - self.backlog_bytes) if first else 0
                skip = self._offset > 0  # inside a line: count from the next one
            else:
                skip = False
            self._started = True
            try:
                f.seek(self._offset)
                data = f.read(min(st.st_size - self._offset, self.read_max))
            except OSError as e:
                self._fail(f"{self.path}: {e.strerror or e}")
                return 0
        self.up, self.error = True, None
        self._offset += len(data)
        if skip:
            cut = data.find(b"\n")
            data = b"" if cut < 0 else data[cut + 1 :]
            if cut < 0:
                self._partial = b""
                return 0
        buf = self._partial + data
        lines = buf.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > _MAX_LINE:
            self._partial = b""  # not a line of the gate's; its end will not parse either
        n = 0
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                self.counts.add(rec, self.rules)
                if self.sink is not None:
                    self.sink(rec)
                n += 1
        return n

    def _fail(self, why: str) -> None:
        if self.error != why:
            log.error("metrics: cannot read the audit trail: %s", why)
        self.up, self.error = False, why


def _signature_ids(config: configmod.Config) -> tuple[str, ...]:
    """The diagnose catalog's signature ids (the built-in one when the site's files
    cannot be read: the diagnoses are counted all the same)."""
    from ncclguard.diagnose import CatalogError, load_catalog

    try:
        cat = load_catalog(config.diagnose.signature_files)
    except (CatalogError, OSError):
        cat = load_catalog()
    ids = [s.id for s in cat.signatures if _SIGNATURE.fullmatch(s.id)]
    return tuple(ids[: MAX_SERIES - 1])
