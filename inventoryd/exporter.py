"""The controller's Prometheus exporter: the cluster's NCCL drift, the collector's own state,
and the gate's and diagnose's counters, in one registry (docs/metrics.md).

The collector (``ncclguard-inventoryd collect``) sees every node, so it serves the cluster's
metrics: on an HTTP endpoint (``[collector] metrics_port``, on ``metrics_address``,
loopback by default) and/or in the node_exporter textfile directory
(``[collector] textfile_dir``). ``ncclguard-inventoryd metrics`` prints them once.

Three sources, each read where it costs nothing on anybody's hot path:

- **the inventory** (read-only, a connection of its own per refresh, in whichever thread
  asks): nodes per compatibility class, per partition, per libnccl version, per net
  plugin and ABI, per transport; the baseline's share (:func:`ncclguard.policy.baseline.
  choose_baseline`, the one ``ncclguard classes`` uses); stale nodes; unresolved
  rejections. Recomputed at most every ``metrics_cache_s``, so that a second Prometheus
  server, or a fast scrape, costs no more reads;
- **the collector's own counters** (this process): records accepted and rejected by cause,
  scans, the last scan's duration, the time since it ended;
- **the gate's audit trail** (``gate.audit_log``), tailed: the gate (one process per job)
  only appends the line it always wrote; this side reads the new lines and counts
  decisions by outcome, action and rule, follow-ups (steering, holds) by result, and the
  epilog's diagnoses by signature. The gate imports nothing of this.

Cardinality is bounded: labels are classes by their 16-hex-digit key, Slurm partitions,
versions, plugin names, ABIs, transports, rejection causes, rule names and signature ids;
never a job or a node. Each family keeps at most :data:`MAX_SERIES` label sets (the
largest), and folds the rest into ``other``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ncclguard import config as configmod
from ncclguard.policy.baseline import choose_baseline
from ncclguard.policy.freshness import is_stale
from ncclguard.spool import CAUSES

__all__ = [
    "MAX_SERIES",
    "AuditCounts",
    "AuditTail",
    "ClusterSnapshot",
    "Exporter",
    "snapshot",
]

log = logging.getLogger("ncclguard.collector")

MAX_SERIES = 64  # label sets per family at most; the rest are summed under "other"
OTHER = "other"
AUDIT_BACKLOG_BYTES = 16 * 1024 * 1024  # at start, the audit trail's last 16 MiB are counted
AUDIT_READ_MAX = 64 * 1024 * 1024  # read at most this much of the trail per refresh
_MAX_LINE = 256 * 1024  # a partial line longer than this is dropped (audit lines are <= 64 KiB)
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+:/ -]{0,63}")
_SIGNATURE = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")

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


def _label(value: Any, unknown: str = "unknown") -> str:
    """A node-reported value as a label: short, printable, or ``unknown``."""
    if value is None or value == "":
        return unknown
    text = str(value)
    return text if _LABEL.fullmatch(text) else OTHER


def _capped(counts: Mapping[Any, float]) -> dict[Any, float]:
    """At most MAX_SERIES label sets: the largest; the rest summed under ("other", ...)."""
    if len(counts) <= MAX_SERIES:
        return dict(counts)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    keep = dict(ranked[: MAX_SERIES - 1])
    width = len(ranked[0][0])
    rest = (OTHER,) * width
    keep[rest] = keep.get(rest, 0) + sum(v for _, v in ranked[MAX_SERIES - 1 :])
    return keep


# ----------------------------------------------------------------- the inventory's view


@dataclass
class PartitionView:
    nodes: int = 0  # of the partition's nodes (Slurm), those in the inventory
    missing: int = 0  # in the partition, not in the inventory
    stale: int = 0
    classes: dict[str, int] = field(default_factory=dict)  # class -> nodes
    baseline: str | None = None
    baseline_share: float = 0.0


@dataclass
class ClusterSnapshot:
    """Everything the exporter says about the inventory, as plain values."""

    nodes: int = 0
    stale: int = 0
    oldest_heartbeat: float | None = None
    classes: dict[str, int] = field(default_factory=dict)  # class -> nodes
    class_values: dict[str, dict[str, Any]] = field(default_factory=dict)
    baseline: str | None = None
    baseline_pinned: bool = False
    baseline_share: float = 0.0
    nccl: dict[str, int] = field(default_factory=dict)  # version -> nodes
    plugins: dict[tuple[str, str], int] = field(default_factory=dict)  # (plugin, abi) -> nodes
    transports: dict[str, int] = field(default_factory=dict)
    partitions: dict[str, PartitionView] | None = None  # None: Slurm's map is not known
    rejections: dict[str, int] = field(default_factory=dict)  # cause -> unresolved files
    at: float = 0.0
    seconds: float = 0.0


def snapshot(
    classes: Iterable[tuple[str, Mapping[str, Any], list[str]]],
    heartbeats: Mapping[str, float | None],
    config: configmod.Config,
    now: float,
    partitions: Mapping[str, Iterable[str]] | None = None,
    rejections: Iterable[str] = (),
) -> ClusterSnapshot:
    """The cluster's view from the inventory's classes (``(key, values, hosts)``), each
    node's heartbeat, and Slurm's partitions (partition -> node names; None: unknown).

    Only nodes with a current heartbeat count towards a baseline, as in ``ncclguard
    classes``; every node of the inventory counts in the class and version totals."""
    ttl = config.inventory.stale_after_s
    snap = ClusterSnapshot(at=now)
    key_of: dict[str, str] = {}
    fresh_of: dict[str, int] = {}
    stale: set[str] = set()
    for key, values, hosts in classes:
        v = dict(values) if isinstance(values, Mapping) else {}
        snap.classes[key] = len(hosts)
        snap.class_values[key] = v
        for h in hosts:
            key_of[h] = key
            if is_stale(heartbeats.get(h), now, ttl):
                stale.add(h)
        fresh_of[key] = len(hosts) - sum(1 for h in hosts if h in stale)
        n = len(hosts)
        nccl = _label(v.get("nccl"))
        snap.nccl[nccl] = snap.nccl.get(nccl, 0) + n
        plug = (_label(v.get("net_plugin"), "none"), _label(v.get("net_abi"), "none"))
        snap.plugins[plug] = snap.plugins.get(plug, 0) + n
        tr = _label(v.get("transport"))
        snap.transports[tr] = snap.transports.get(tr, 0) + n
    snap.nodes = len(key_of)
    snap.stale = len(stale)
    known = [hb for h, hb in heartbeats.items() if h in key_of and hb is not None]
    snap.oldest_heartbeat = min(known) if known else None
    base = choose_baseline(fresh_of, snap.class_values, config)
    snap.baseline, snap.baseline_pinned = base.key, base.pinned
    snap.baseline_share = base.share if base.key else 0.0
    if partitions is not None:
        snap.partitions = {}
        for part, members in partitions.items():
            pv = PartitionView()
            fresh: dict[str, int] = {}
            for h in set(members):
                ck = key_of.get(h)
                if ck is None:
                    pv.missing += 1
                    continue
                pv.nodes += 1
                pv.classes[ck] = pv.classes.get(ck, 0) + 1
                if h in stale:
                    pv.stale += 1
                else:
                    fresh[ck] = fresh.get(ck, 0) + 1
            pb = choose_baseline({k: fresh.get(k, 0) for k in pv.classes},
                                 snap.class_values, config)
            pv.baseline = pb.key
            pv.baseline_share = pb.share if pb.key else 0.0
            snap.partitions[part] = pv
    for cause in rejections:
        c = cause if _SIGNATURE.fullmatch(cause) else OTHER
        snap.rejections[c] = snap.rejections.get(c, 0) + 1
    return snap


def read_snapshot(
    config: configmod.Config,
    db: Path | None,
    partitions: Mapping[str, Iterable[str]] | None,
    now: float | None = None,
) -> ClusterSnapshot:
    """One read of the inventory (read-only, its own connection) into a snapshot."""
    from ncclguard.store import Inventory

    t0 = time.monotonic()
    now = time.time() if now is None else now
    with Inventory(db, readonly=True, config=config.inventory) as inv:
        cls = inv.classes()
        beats = inv.heartbeats()
        rejected = [r["cause"] for r in inv.rejections()]
    snap = snapshot(((c.compat_key, c.values, c.hosts) for c in cls), beats, config, now,
                    partitions, rejected)
    snap.seconds = time.monotonic() - t0
    return snap


# ----------------------------------------------------------------- the audit trail


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
                 read_max: int = AUDIT_READ_MAX) -> None:
        from ncclguard.policy.rules import RULES

        self.path = Path(path)
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


# ----------------------------------------------------------------- Slurm's partitions


class Partitions:
    """Partition -> its nodes, from Slurm (asked again after ``refresh_s``, at most every
    ``retry_s`` after a failure; the last answer is kept)."""

    def __init__(self, ask: Callable[[], Mapping[str, Iterable[str]]] | None,
                 refresh_s: float, retry_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ask = ask
        self.refresh_s = refresh_s
        self.retry_s = retry_s
        self.clock = clock
        self.map: dict[str, tuple[str, ...]] | None = None
        self._at: float | None = None
        self._ok = False
        self.error: str | None = None

    def refresh(self) -> None:
        if self.ask is None:
            return
        now = self.clock()
        if self._at is not None and now - self._at < (self.refresh_s if self._ok
                                                       else self.retry_s):
            return
        self._at = now
        try:
            got = {p: tuple(sorted(set(h))) for p, h in self.ask().items()}
        except Exception as e:  # a Slurm call: keep the last answer
            self._ok = False
            why = f"{type(e).__name__}: {'; '.join(str(e).splitlines())}"
            if self.error is None:
                log.warning("metrics: Slurm's partitions are unknown (no partition "
                            "metrics until Slurm answers): %s", why)
            self.error = why
            return
        self._ok, self.error = True, None
        self.map = got


def slurm_partitions(config: configmod.Config) -> dict[str, list[str]]:
    """Partition -> node names, as Slurm lists them."""
    from ncclguard.slurm import Slurm

    out: dict[str, list[str]] = {}
    for n in Slurm.from_config(config.gate, timeout=30.0).nodes():
        for p in n.partitions:
            out.setdefault(p, []).append(n.name)
    return out


# ----------------------------------------------------------------- the exporter


@dataclass
class ScanStats:
    """What the collector's loop reports after each scan."""

    counts: Mapping[str, int] = field(default_factory=dict)  # "accepted", causes
    files: int = 0
    seconds: float = 0.0
    deferred: int = 0
    spool_ok: bool = True
    scans: int = 0
    last_scan: float | None = None  # wall clock, when it ended


class Exporter:
    """A prometheus_client collector: ``collect()`` is called per scrape (HTTP thread) or
    per textfile write, and reads the inventory at most every ``cache_s``."""

    def __init__(
        self,
        config: configmod.Config,
        *,
        db: Path | None = None,
        partitions: Partitions | None = None,
        audit_path: Path | str | None = None,
        cache_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.db = db
        self.partitions = partitions
        path = audit_path if audit_path is not None else config.gate.audit_path(
            config.inventory)
        self.audit = AuditTail(path)
        self.audit.signatures = _signature_ids(config)
        self.cache_s = config.collector.metrics_cache_s if cache_s is None else cache_s
        self.clock = clock
        self.stats = ScanStats()
        self.started = clock()
        self._snap: ClusterSnapshot | None = None
        self._snap_error: str | None = None
        self._lock = threading.Lock()

    # -- fed by the collector's loop
    def scanned(self, stats: ScanStats) -> None:
        self.stats = stats
        if self.partitions is not None:
            self.partitions.refresh()

    # -- read per scrape
    def refresh(self) -> ClusterSnapshot | None:
        """The snapshot, read again when older than ``cache_s``; the audit trail's new
        lines are counted at the same pace."""
        with self._lock:
            now = self.clock()
            if self._snap is not None and now - self._snap.at < self.cache_s:
                return self._snap
            self.audit.poll()
            parts = self.partitions.map if self.partitions is not None else None
            try:
                self._snap = read_snapshot(self.config, self.db, parts, now)
                if self._snap_error is not None:
                    log.info("metrics: the inventory is readable again")
                self._snap_error = None
            except Exception as e:  # the inventory's errors, and any other: keep serving
                why = f"{type(e).__name__}: {e}"
                if why != self._snap_error:
                    log.error("metrics: cannot read the inventory: %s", why)
                self._snap_error = why
                self._snap = None
            return self._snap

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self.refresh()
        now = self.clock()
        yield from self._collector_families(now, CounterMetricFamily, GaugeMetricFamily)
        up = GaugeMetricFamily("ncclguard_exporter_inventory_up",
                               "1 if the last read of the inventory for these metrics worked")
        up.add_metric([], 0 if snap is None else 1)
        yield up
        if snap is not None:
            yield from _inventory_families(snap, now, GaugeMetricFamily)
        yield from self._audit_families(CounterMetricFamily, GaugeMetricFamily)

    def _collector_families(self, now: float, counter: Any, gauge: Any) -> Iterator[Any]:
        s = self.stats
        acc = counter("ncclguard_collector_records_accepted",
                      "Signed records accepted since the collector started")
        acc.add_metric([], s.counts.get("accepted", 0))
        yield acc
        rej = counter("ncclguard_collector_records_rejected",
                      "Signed records rejected since the collector started, by cause",
                      labels=["cause"])
        causes = dict.fromkeys(CAUSES, 0) | {k: n for k, n in s.counts.items()
                                             if k != "accepted"}
        for cause, n in sorted(causes.items()):
            rej.add_metric([cause], n)
        yield rej
        scans = counter("ncclguard_collector_scans", "Scans of the spool since start")
        scans.add_metric([], s.scans)
        yield scans
        for name, text, value in (
            ("ncclguard_collector_spool_records", "Record files in the spool at the last "
             "scan", s.files),
            ("ncclguard_collector_scan_seconds", "Duration of the last scan", s.seconds),
            ("ncclguard_collector_records_deferred", "Records left for the next scan at the "
             "last scan (munged or Slurm unavailable)", s.deferred),
            ("ncclguard_collector_spool_up", "1 if the spool could be listed at the last scan",
             1 if s.spool_ok else 0),
        ):
            g = gauge(name, text)
            g.add_metric([], value)
            yield g
        if s.last_scan is not None:
            g = gauge("ncclguard_collector_last_scan_timestamp_seconds",
                      "When the last scan of the spool ended")
            g.add_metric([], s.last_scan)
            yield g
            g = gauge("ncclguard_collector_lag_seconds",
                      "Seconds since the last scan ended: grows when the collector's loop "
                      "is stuck")
            g.add_metric([], max(0.0, now - s.last_scan))
            yield g

    def _audit_families(self, counter: Any, gauge: Any) -> Iterator[Any]:
        a = self.audit.counts
        g = gauge("ncclguard_audit_up", "1 if the gate's audit trail could be read (a trail "
                  "not yet written counts as read)")
        g.add_metric([], 1 if self.audit.up else 0)
        yield g
        c = counter("ncclguard_audit_records", "Audit records read since start")
        c.add_metric([], a.records)
        yield c
        if a.last_ts is not None:
            g = gauge("ncclguard_audit_last_record_timestamp_seconds",
                      "The time of the newest audit record read")
            g.add_metric([], a.last_ts)
            yield g
        rules = sorted(self.audit.rules)
        for name, text, labels, zeros, values in (
            ("ncclguard_gate_decisions", "The gate's decisions by outcome and action "
             "(error with action accept: the gate failed open)", ["decision", "action"],
             GATE_OUTCOMES, a.decisions),
            ("ncclguard_gate_rule_decisions", "Gate decisions in which a rule found a "
             "difference, by outcome and rule", ["decision", "rule"],
             [(d, r) for d in ("warn", "refuse") for r in rules], a.rules),
            ("ncclguard_gate_paths", "The gate's accept/warn/refuse decisions by the check "
             "that placed the job (features: Slurm placed it on one class; gate: no class "
             "group, or its class no longer held)", ["path", "decision"],
             [(x, d) for x in PATHS[:2] for d in ("accept", "warn", "refuse")], a.paths),
            ("ncclguard_gate_followups", "The gate's detached follow-ups (steer: "
             "ExcNodeList set; hold: job held) by result", ["action", "result"],
             [(x, r) for x in ("steer", "hold") for r in FOLLOWUP_RESULTS], a.followups),
            ("ncclguard_diagnoses", "Failed jobs' logs that matched a signature, by "
             "signature id (EpilogSlurmctld hook)", ["signature"],
             [(sig,) for sig in self.audit.signatures], {(k,): n for k, n in
                                                         a.diagnoses.items()}),
            ("ncclguard_diagnose_jobs", "Jobs the epilog hook diagnosed, by outcome "
             "(diagnosed, clean, error)", ["outcome"], [(o,) for o in DIAGNOSE_OUTCOMES],
             {(k,): n for k, n in a.diagnose_jobs.items()}),
        ):
            c = counter(name, text, labels=labels)
            for key, n in sorted(_capped(dict.fromkeys(zeros, 0) | dict(values)).items()):
                c.add_metric(list(key), n)
            yield c


def _inventory_families(snap: ClusterSnapshot, now: float, gauge: Any) -> Iterator[Any]:
    def one(name: str, text: str, value: float) -> Any:
        g = gauge(name, text)
        g.add_metric([], value)
        return g

    def many(name: str, text: str, labels: list[str],
             values: Mapping[Any, float]) -> Any:
        g = gauge(name, text, labels=labels)
        for key, v in sorted(_capped(values).items()):
            g.add_metric(list(key), v)
        return g

    yield one("ncclguard_exporter_snapshot_seconds", "How long the last read of the "
              "inventory for these metrics took", snap.seconds)
    yield one("ncclguard_inventory_nodes", "Nodes in the inventory", snap.nodes)
    yield one("ncclguard_inventory_stale_nodes", "Nodes whose heartbeat is not current "
              "(older than inventory.stale_after_s, or dated ahead)", snap.stale)
    if snap.oldest_heartbeat is not None:
        yield one("ncclguard_inventory_oldest_heartbeat_timestamp_seconds",
                  "The oldest heartbeat in the inventory: an outage of the record path "
                  "shows as this falling behind", snap.oldest_heartbeat)
        yield one("ncclguard_inventory_oldest_heartbeat_age_seconds",
                  "Age of the oldest heartbeat in the inventory", now - snap.oldest_heartbeat)
    yield one("ncclguard_classes", "Compatibility classes in the inventory", len(snap.classes))
    yield many("ncclguard_class_nodes", "Nodes per compatibility class", ["class"],
               {(k,): n for k, n in snap.classes.items()})
    info = {}
    for k in _capped({(k,): n for k, n in snap.classes.items()}):
        v = snap.class_values.get(k[0], {})
        info[(k[0], _label(v.get("nccl")), _label(v.get("net_plugin"), "none"),
              _label(v.get("net_abi"), "none"), _label(v.get("transport")))] = 1
    yield many("ncclguard_class_info", "A compatibility class's defining values (always 1)",
               ["class", "nccl", "net_plugin", "net_abi", "transport"], info)
    yield one("ncclguard_baseline_share", "Share of the current nodes in the baseline class "
              "(as ncclguard classes marks it); 0 when there is no baseline",
              snap.baseline_share)
    if snap.baseline is not None:
        yield many("ncclguard_baseline_info", "The baseline class (always 1)",
                   ["class", "pinned"], {(snap.baseline, str(snap.baseline_pinned).lower()): 1})
    yield many("ncclguard_nccl_version_nodes", "Nodes per version of their default libnccl",
               ["version"], {(k,): n for k, n in snap.nccl.items()})
    yield many("ncclguard_net_plugin_nodes", "Nodes per default net plugin and its net ABI "
               "(none: no plugin, NCCL's internal IB or Socket)", ["plugin", "abi"],
               snap.plugins)
    yield many("ncclguard_transport_nodes", "Nodes per transport NCCL would pick",
               ["transport"], {(k,): n for k, n in snap.transports.items()})
    yield many("ncclguard_collector_rejections_unresolved", "Spool files whose last record "
               "was rejected, by cause (ncclguard rejections lists them)", ["cause"],
               {(k,): 0 for k in CAUSES} | {(k,): n for k, n in snap.rejections.items()})
    yield one("ncclguard_partitions_known", "1 if Slurm's partitions are known (else the "
              "partition metrics are absent)", 0 if snap.partitions is None else 1)
    if snap.partitions is None:
        return
    parts = snap.partitions
    yield many("ncclguard_partition_nodes", "Nodes of the partition in the inventory",
               ["partition"], {(p,): v.nodes for p, v in parts.items()})
    yield many("ncclguard_partition_missing_nodes", "Nodes of the partition not in the "
               "inventory", ["partition"], {(p,): v.missing for p, v in parts.items()})
    yield many("ncclguard_partition_stale_nodes", "Nodes of the partition with a stale "
               "heartbeat", ["partition"], {(p,): v.stale for p, v in parts.items()})
    yield many("ncclguard_partition_classes", "Compatibility classes among the partition's "
               "nodes (more than 1: a multi-node job there can be refused)", ["partition"],
               {(p,): len(v.classes) for p, v in parts.items()})
    yield many("ncclguard_partition_class_nodes", "Nodes of the partition per compatibility "
               "class", ["partition", "class"],
               {(p, k): n for p, v in parts.items() for k, n in v.classes.items()})
    yield many("ncclguard_partition_baseline_share", "Share of the partition's current nodes "
               "in its baseline class; 0 when it has none", ["partition"],
               {(p,): v.baseline_share for p, v in parts.items()})


# ----------------------------------------------------------------- serving


class Served:
    """The exporter's registry, its HTTP endpoint (if any) and its textfile (if any)."""

    def __init__(self, exporter: Exporter, *, address: str = "", port: int = 0,
                 textfile_dir: str = "") -> None:
        from prometheus_client import CollectorRegistry

        self.exporter = exporter
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(exporter)
        self.textfile_dir = textfile_dir
        self._server: Any = None
        self.port = 0
        if port:
            from prometheus_client import start_http_server

            self._server, _ = start_http_server(port, addr=address or "127.0.0.1",
                                                registry=self.registry)
            self.port = int(self._server.server_port)
            log.info("metrics on http://%s:%d/metrics", address or "127.0.0.1", self.port)

    def text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def write_textfile(self) -> Path | None:
        if not self.textfile_dir:
            return None
        from prometheus_client import write_to_textfile

        from inventoryd.metrics import COLLECTOR_FILE_NAME

        path = Path(self.textfile_dir) / COLLECTOR_FILE_NAME
        write_to_textfile(str(path), self.registry)
        return path

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def from_config(config: configmod.Config, db: Path | None,
                ask_partitions: bool = True) -> Exporter:
    """The collector's exporter: partitions from Slurm, the gate's audit trail."""
    parts = Partitions((lambda: slurm_partitions(config)) if ask_partitions else None,
                       refresh_s=config.collector.address_refresh_s)
    return Exporter(config, db=db, partitions=parts)
