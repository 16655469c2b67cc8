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
  rejections; with ``[canary] enabled``, the canary's nodes per state, its longest hold
  and its events (docs/canary.md). Recomputed at most every ``metrics_cache_s``, so
  that a second Prometheus server, or a fast scrape, costs no more reads;
- **the collector's own counters** (this process): records accepted and rejected by cause,
  scans, the last scan's duration, the time since it ended;
- **the features daemon's status file** (``<features.classes_file>.status``,
  :func:`ncclguard.sched.status.read`), read at the inventory's pace: how many nodes'
  class feature updates Slurm refuses (retried with back-off) and how many flapping
  nodes are held without a class; a file missing or unreadable counts 0 of each, and
  ``ncclguard_features_status_up`` says so;
- **the gate's audit trail** (``gate.audit_log``), tailed: the gate (one process per job)
  only appends the line it always wrote; this side reads the new lines and counts
  decisions by outcome, action and rule, follow-ups (steering, holds) by result, and the
  epilog's diagnoses by signature. The gate imports nothing of this.

Over 500 lines: one collector class serves every family of the one registry, each read
at its source's pace under one lock and one cache; what each source is (the cluster's
view, the audit trail's tail, the labels' rules, the HTTP server) lives in its own module
beside it.

Cardinality is bounded: labels are classes by their 16-hex-digit key, Slurm partitions,
versions, plugin names, ABIs, transports, rejection causes, rule names and signature ids;
never a job or a node. Each family keeps at most :data:`MAX_SERIES` label sets (the
largest), and folds the rest into ``other``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inventoryd.controller.audit_tail import (
    DIAGNOSE_OUTCOMES,
    FOLLOWUP_RESULTS,
    GATE_OUTCOMES,
    PATHS,
    AuditCounts,
    AuditTail,
    _signature_ids,
)
from inventoryd.controller.cluster_view import (
    ClusterSnapshot,
    Partitions,
    PartitionView,
    read_snapshot,
    slurm_partitions,
    snapshot,
)
from inventoryd.controller.container_records import CAUSES as CONTAINER_CAUSES
from inventoryd.controller.labels import MAX_SERIES, OTHER, _capped, _label
from inventoryd.controller.metrics_server import BoundedServer
from ncclguard import config as configmod
from ncclguard.policy.canary import HELD_STATES
from ncclguard.policy.loaded import PLUGIN_KINDS
from ncclguard.sched import status as features_status
from ncclguard.spool import CAUSES

__all__ = [
    "MAX_SERIES",
    "AuditCounts",
    "AuditTail",
    "ClusterSnapshot",
    "Exporter",
    "PartitionView",
    "Partitions",
    "read_snapshot",
    "slurm_partitions",
    "snapshot",
]

log = logging.getLogger("ncclguard.collector")

#: the collector's textfile (its cluster metrics, docs/metrics.md)
COLLECTOR_FILE_NAME = "ncclguard-collector.prom"
# ----------------------------------------------------------------- the exporter


#: what a mixed step's nodes differ in (ncclguard.policy.loaded.judge), and what
#: [runtime] on_mixed = "requeue" did (inventoryd.controller.runtime): always exported
MIXED_KINDS = ("nccl", "net-missing", *(f"{k}-plugin" for k in PLUGIN_KINDS))
MIXED_RESULTS = ("requeued", "cancelled", "exempt", "skipped", "failed", "none")
#: the canary's states (ok, or held: ncclguard.policy.canary) and the events counted from
#: its history (docs/canary.md): always exported while [canary] is enabled
CANARY_STATES = ("ok", *HELD_STATES)
CANARY_EVENTS = ("submitted", "passed", "failed", "approved")


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
    postponed: int = 0  # files naming no known node, left for later scans
    unwritten: int = 0  # records judged but not written (the inventory cannot grow)
    pressure: bool = False  # free space below collector.min_free_bytes, or a write failing
    writable: bool = True  # the last write of the inventory worked
    free_bytes: int | None = None  # on the inventory's filesystem
    containers: Mapping[str, int] = field(default_factory=dict)  # "accepted", causes
    mixed_found: int = 0  # running job steps found mixed (docs/runtime.md)
    mixed_actions: Mapping[str, int] = field(default_factory=dict)  # result -> jobs


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
        self._features: dict[str, Any] | None = None  # the features daemon's status
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
            self._features = features_status.read(self.config)
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
            if snap.canary is not None:
                yield from _canary_families(snap.canary, CounterMetricFamily,
                                            GaugeMetricFamily)
        yield from self._features_families(GaugeMetricFamily)
        yield from self._audit_families(CounterMetricFamily, GaugeMetricFamily)

    def _features_families(self, gauge: Any) -> Iterator[Any]:
        doc = self._features
        for name, text, value in (
            ("ncclguard_features_status_up", "1 if the features daemon's status file could "
             "be read (0: missing, not a regular file, or not a status)",
             0 if doc is None else 1),
            ("ncclguard_features_failing_nodes", "Nodes whose class feature update Slurm "
             "refuses, retried with back-off (the features daemon's status file; 0 when "
             "it cannot be read)", len(doc["failing"]) if doc else 0),
            ("ncclguard_features_held_nodes", "Nodes held without a class feature because "
             "their stack keeps changing (the features daemon's status file; 0 when it "
             "cannot be read)", len(doc["held"]) if doc else 0),
        ):
            g = gauge(name, text)
            g.add_metric([], value)
            yield g

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
        acc = counter("ncclguard_collector_container_records_accepted",
                      "The enroot hook's container records kept since the collector started")
        acc.add_metric([], s.containers.get("accepted", 0))
        yield acc
        rej = counter("ncclguard_collector_container_records_rejected",
                      "Container records rejected since the collector started, by cause "
                      "(docs/containers.md)", labels=["cause"])
        for cause, n in sorted((dict.fromkeys(CONTAINER_CAUSES, 0) | {
                k: v for k, v in s.containers.items() if k in CONTAINER_CAUSES}).items()):
            rej.add_metric([cause], n)
        yield rej
        found = counter("ncclguard_mixed_steps_found", "Running job steps whose nodes loaded "
                        "different NCCL libraries or plugins, found since the collector "
                        "started (docs/runtime.md)")
        found.add_metric([], s.mixed_found)
        yield found
        acts = counter("ncclguard_mixed_job_actions", "What [runtime] on_mixed did to mixed "
                       "jobs since the collector started, by result", labels=["result"])
        for result, n in sorted((dict.fromkeys(MIXED_RESULTS, 0) | dict(s.mixed_actions)).items()):
            acts.add_metric([result], n)
        yield acts
        if s.free_bytes is not None:
            g = gauge("ncclguard_collector_disk_free_bytes", "Free bytes on the inventory's "
                      "filesystem at the last scan")
            g.add_metric([], s.free_bytes)
            yield g
        for name, text, value in (
            ("ncclguard_collector_spool_records", "Record files in the spool at the last "
             "scan", s.files),
            ("ncclguard_collector_scan_seconds", "Duration of the last scan", s.seconds),
            ("ncclguard_collector_records_deferred", "Records left for the next scan at the "
             "last scan (munged or Slurm unavailable)", s.deferred),
            ("ncclguard_collector_spool_up", "1 if the spool could be listed at the last scan",
             1 if s.spool_ok else 0),
            ("ncclguard_collector_records_postponed", "Spool files that name no known node, "
             "left for later scans at the last scan (at most 256 are judged a scan)",
             s.postponed),
            ("ncclguard_collector_records_unwritten", "Records judged at the last scan but "
             "not written: the inventory cannot grow (they are read again)", s.unwritten),
            ("ncclguard_collector_disk_pressure", "1 while the inventory cannot grow (free "
             "space below collector.min_free_bytes, or a failed write): no history is "
             "kept, images and container records wait", 1 if s.pressure else 0),
            ("ncclguard_collector_inventory_writable", "1 if the last write of the inventory "
             "worked", 1 if s.writable else 0),
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
    yield one("ncclguard_loaded_steps", "Running job steps that loaded NCCL, as the nodes' "
              "last records say (docs/runtime.md)", snap.loaded_steps)
    yield many("ncclguard_mixed_steps", "Running job steps whose nodes loaded different "
               "NCCL libraries or plugins, by what differs", ["kind"],
               {(k,): n for k, n in (dict.fromkeys(MIXED_KINDS, 0) | snap.mixed_running).items()})
    yield many("ncclguard_mixed_steps_kept", "Job steps found mixed, running or not, kept "
               "for [runtime] keep_days, by what differs", ["kind"],
               {(k,): n for k, n in (dict.fromkeys(MIXED_KINDS, 0) | snap.mixed_kept).items()})
    yield one("ncclguard_inventory_stale_nodes", "Nodes whose heartbeat is not current "
              "(older than inventory.stale_after_s, or dated ahead)", snap.stale)
    if snap.oldest_heartbeat is not None:
        yield one("ncclguard_inventory_oldest_heartbeat_timestamp_seconds",
                  "The oldest heartbeat in the inventory: an outage of the record path "
                  "shows as this falling behind", snap.oldest_heartbeat)
        yield one("ncclguard_inventory_oldest_heartbeat_age_seconds",
                  "Age of the oldest heartbeat in the inventory", now - snap.oldest_heartbeat)
    if snap.written_at is not None:
        yield one("ncclguard_inventory_written_timestamp_seconds", "When the collector last "
                  "wrote the inventory (it stamps it at least every minute): the gate reads "
                  "records as of then", snap.written_at)
    yield one("ncclguard_classes", "Compatibility classes in the inventory", len(snap.classes))
    yield many("ncclguard_class_nodes", "Nodes per compatibility class", ["class"],
               {(k,): n for k, n in snap.classes.items()})
    info = {}
    for k in _capped({(k,): n for k, n in snap.classes.items()}):
        v = snap.class_values.get(k[0], {})
        hostless = v.get("nccl") == "none"  # no libnccl: no plugin in force, see "adds"
        info[(k[0], _label(v.get("nccl")),
              "-" if hostless else _label(v.get("net_plugin"), "none"),
              "-" if hostless else _label(v.get("net_abi"), "none"),
              _label(v.get("adds")), _label(v.get("transport")))] = 1
    yield many("ncclguard_class_info", "A compatibility class's defining values (always 1): "
               "net_plugin and net_abi as the host's libnccl uses them (-: the nodes have "
               "none), adds the net plugin the nodes add to a job's own NCCL",
               ["class", "nccl", "net_plugin", "net_abi", "adds", "transport"], info)
    yield one("ncclguard_baseline_share", "Share of the current nodes in the baseline class "
              "(as ncclguard classes marks it); 0 when there is no baseline",
              snap.baseline_share)
    if snap.baseline is not None:
        yield many("ncclguard_baseline_info", "The baseline class (always 1)",
                   ["class", "pinned"], {(snap.baseline, str(snap.baseline_pinned).lower()): 1})
    yield many("ncclguard_nccl_version_nodes", "Nodes per version of their default libnccl",
               ["version"], {(k,): n for k, n in snap.nccl.items()})
    yield many("ncclguard_net_plugin_nodes", "Nodes per default net plugin and its net ABI "
               "with the node's own libnccl (none: no plugin, NCCL's internal IB or Socket; "
               "-: the node has no libnccl)", ["plugin", "abi"], snap.plugins)
    yield many("ncclguard_adds_nodes", "Nodes per net plugin they add to a job's own NCCL, "
               "whatever their libnccl (each name with the ABIs some release uses; none)",
               ["plugin"], {(k,): n for k, n in snap.adds.items()})
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


def _canary_families(counts: Mapping[str, Any], counter: Any, gauge: Any) -> Iterator[Any]:
    """The canary's tables ([canary] enabled, docs/canary.md): nodes per state, the
    longest hold, and its events, counted from the inventory's history (so they survive a
    restart of the collector; a state or event of another version is ``other``)."""
    states = dict.fromkeys(CANARY_STATES, 0)
    for state, n in counts.get("states", {}).items():
        key = state if state in states else OTHER
        states[key] = states.get(key, 0) + n
    g = gauge("ncclguard_canary_nodes", "Nodes the canary service has seen, by state (ok: "
              "vetted in its class; settling, waiting, running, failed, approval: held out "
              "of multi-node jobs until a canary passes)", labels=["state"])
    for state, n in states.items():
        g.add_metric([state], n)
    yield g
    g = gauge("ncclguard_canary_held_max_seconds", "Seconds the longest-held node has been "
              "held by the canary (0: none is held)")
    g.add_metric([], counts.get("held_max_s", 0.0))
    yield g
    c = counter("ncclguard_canary_events", "The canary's events in the inventory's history, "
                "by event (submitted: a canary job; passed, failed: its result; approved: "
                "an admin let a held node in)", labels=["event"])
    events = counts.get("events", {})
    for event in CANARY_EVENTS:
        c.add_metric([event], events.get(event, 0))
    yield c


# ----------------------------------------------------------------- serving


class Served:
    """The exporter's registry, its HTTP endpoint (if any) and its textfile (if any)."""

    def __init__(self, exporter: Exporter, *, address: str = "", port: int = 0,
                 textfile_dir: str = "", max_connections: int = 64,
                 timeout_s: float = 5.0) -> None:
        from prometheus_client import CollectorRegistry, generate_latest

        from inventoryd.loop import WriteLog

        self.exporter = exporter
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(exporter)
        self.textfile_dir = textfile_dir
        self.write_log = WriteLog(log)  # a failing textfile is logged once, and its recovery
        self._server: BoundedServer | None = None
        self.port = 0
        if port:  # bounded connections, time and threads (inventoryd/controller/metrics_server.py)
            self._server = BoundedServer(address or "127.0.0.1", port,
                                         lambda: generate_latest(self.registry),
                                         max_connections=max_connections, timeout_s=timeout_s)
            self.port = self._server.port
            log.info("metrics on http://%s:%d/metrics", address or "127.0.0.1", self.port)

    def text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def write_textfile(self) -> Path | None:
        if not self.textfile_dir:
            return None
        from prometheus_client import write_to_textfile

        path = Path(self.textfile_dir) / COLLECTOR_FILE_NAME
        write_to_textfile(str(path), self.registry)
        return path

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


def from_config(config: configmod.Config, db: Path | None,
                ask_partitions: bool = True) -> Exporter:
    """The collector's exporter: partitions from Slurm, the gate's audit trail."""
    parts = Partitions((lambda: slurm_partitions(config)) if ask_partitions else None,
                       refresh_s=config.collector.address_refresh_s)
    return Exporter(config, db=db, partitions=parts)
