"""The cluster as the controller's metrics see it: one read of the inventory (its classes,
heartbeats, unresolved rejections) and Slurm's partitions, into plain values
(:class:`ClusterSnapshot`). The baseline is :func:`ncclguard.policy.baseline.choose_baseline`,
the one ``ncclguard classes`` uses."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inventoryd.controller.labels import _SIGNATURE, OTHER, _label
from ncclguard import config as configmod
from ncclguard.policy.baseline import choose_baseline
from ncclguard.policy.freshness import is_stale

log = logging.getLogger("ncclguard.collector")

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
    adds: dict[str, int] = field(default_factory=dict)  # net plugin a job's NCCL gets -> nodes
    partitions: dict[str, PartitionView] | None = None  # None: Slurm's map is not known
    rejections: dict[str, int] = field(default_factory=dict)  # cause -> unresolved files
    written_at: float | None = None  # the collector's last write stamp
    #: what running job steps loaded (docs/runtime.md): steps watched, mixed ones running
    #: and kept, by what differs
    loaded_steps: int = 0
    mixed_running: dict[str, int] = field(default_factory=dict)
    mixed_kept: dict[str, int] = field(default_factory=dict)
    #: the canary's nodes per state, its longest hold and its events (docs/canary.md,
    #: :meth:`ncclguard.store.Inventory.canary_counts`); None while ``[canary]`` is off
    canary: dict[str, Any] | None = None
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
        plug = (("-", "-") if v.get("nccl") == "none" else
                (_label(v.get("net_plugin"), "none"), _label(v.get("net_abi"), "none")))
        snap.plugins[plug] = snap.plugins.get(plug, 0) + n
        adds = _label(v.get("adds"))
        snap.adds[adds] = snap.adds.get(adds, 0) + n
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
    """One read of the inventory (read-only, its own connection) into a snapshot: the
    classes by their names (ncclguard/sched/classes.py), as ``ncclguard classes`` and
    Slurm's features name them."""
    from ncclguard.sched.classes import open_classes, read_classes

    t0 = time.monotonic()
    now = time.time() if now is None else now
    with open_classes(config.policy, config.inventory, db) as inv:
        view = read_classes(inv)
        beats = inv.heartbeats()
        rejected = [r["cause"] for r in inv.rejections()]
        written_at, _ = inv.writer_state()
        runtime = inv.runtime_counts()
        canary = inv.canary_counts(now) if config.canary.enabled else None
    snap = snapshot(((view.name(c.key), c.values, c.hosts) for c in view.classes), beats,
                    config, now, partitions, rejected)
    snap.written_at = written_at
    snap.loaded_steps, snap.mixed_running, snap.mixed_kept = runtime
    snap.canary = canary
    snap.seconds = time.monotonic() - t0
    return snap


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
    """Partition -> node names, as Slurm lists them (partitions that hold nodes): one
    narrow read (``Slurm.partitions``: each partition's compressed node list), never the
    whole node list (21 MB of JSON at 16,384 nodes on 22.05)."""
    from ncclguard.hostlist import expand
    from ncclguard.slurm import Slurm

    lists = Slurm.from_config(config.gate, timeout=30.0).partitions()
    return {p: expand(text) for p, text in lists.items() if text}
