"""Keep Slurm's node features equal to the inventory's classes, and write the lua's file.

    Slurm's nodes ──┐
                    ├─▶ plan: each node's features = its own + its class ─▶ updates
    inventory ──────┘   (scheduling_classes: the gate's values, refuse-level rules)
                                                                  │
      one ``scontrol update NodeName=<hostlist>`` per distinct new list, only for
      nodes whose lists differ; then the file of classes (verified = now)

Every caller goes through :func:`sync`: the CLI (``ncclguard features sync``), the daemon
(``ncclguard-inventoryd features``) and the hooks Slurm runs after a restart or a
reconfigure (``SlurmctldPrimaryOnProg``, ``strigger --reconfig``). A lock file beside the
class file keeps two of them from interleaving; each changes only what differs, so a
hook that fires on its own update finds nothing left to do.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ncclguard.audit import AuditError, lock
from ncclguard.config import Config
from ncclguard.hostlist import compress
from ncclguard.policy import GATE_VALUES, stale_hosts
from ncclguard.policy.schedule import (
    ClassCount,
    is_class_feature,
    rank_classes,
    scheduling_classes,
)
from ncclguard.sched import classfile
from ncclguard.slurm import NodeInfo, Slurm, SlurmError
from ncclguard.store import Inventory

__all__ = ["Plan", "SyncResult", "Update", "class_table", "desired", "plan", "sync"]


@dataclass(frozen=True)
class Update:
    """One ``scontrol update``: these hosts get exactly these feature lists."""

    hosts: tuple[str, ...]
    available: tuple[str, ...]
    active: tuple[str, ...]

    def describe(self) -> str:
        return (f"scontrol update NodeName={compress(self.hosts)} "
                f"AvailableFeatures={','.join(self.available)} "
                f"ActiveFeatures={','.join(self.active)}")


@dataclass
class Plan:
    classes: dict[str, str | None]  # Slurm node -> its class feature (None: none)
    updates: list[Update]
    nodes: list[NodeInfo]  # Slurm's nodes, as read

    @property
    def changed_hosts(self) -> list[str]:
        return sorted(h for u in self.updates for h in u.hosts)


@dataclass
class SyncResult:
    plan: Plan
    applied: list[Update] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    written: Path | None = None
    dry_run: bool = False


def desired(config: Config, hosts: Sequence[str], now: float | None = None,
            inventory: Inventory | None = None) -> dict[str, str | None]:
    """Each host's class feature, from the gate's own view of the inventory: its values,
    and the same freshness test (stale nodes follow ``unknown-node``)."""
    now = time.time() if now is None else now
    if inventory is not None:  # the caller's, left open
        records = inventory.load_values(hosts)
    else:
        with Inventory(readonly=True, values=GATE_VALUES, config=config.inventory) as inv:
            records = inv.load_values(hosts)
    stale = stale_hosts({h: r[1] for h, r in records.items() if r is not None}, now,
                        config.inventory.stale_after_s)
    values = {h: (r[0] if r is not None else None) for h, r in records.items()}
    return scheduling_classes(values, config.policy, stale)


def plan(nodes: Sequence[NodeInfo], classes: Mapping[str, str | None]) -> Plan:
    """The updates that give each node its own features plus its class feature (any
    other ``nc_`` feature removed), grouped by the new lists: one call per group."""
    groups: dict[tuple[tuple[str, ...], tuple[str, ...]], list[str]] = {}
    wanted: dict[str, str | None] = {}
    for n in nodes:
        cls = classes.get(n.name)
        wanted[n.name] = cls
        tail = (cls,) if cls else ()
        available = tuple(f for f in n.features if not is_class_feature(f)) + tail
        active = tuple(f for f in n.active_features if not is_class_feature(f)) + tail
        if set(available) == set(n.features) and set(active) == set(n.active_features):
            continue
        groups.setdefault((available, active), []).append(n.name)
    updates = [Update(tuple(hosts), avail, act) for (avail, act), hosts in groups.items()]
    return Plan(wanted, updates, list(nodes))


def class_table(config: Config, nodes: Sequence[NodeInfo], classes: Mapping[str, str | None],
                verified: float) -> classfile.ClassFile:
    """The lua's file: for every node and for each partition, the classes in preference
    order (largest first), those of at least two nodes, at most ``max_alternatives``."""
    limit = config.features.max_alternatives
    members: dict[str, list[str]] = {classfile.ALL: [n.name for n in nodes]}
    for n in nodes:
        for p in n.partitions:
            members.setdefault(p, []).append(n.name)
    table: dict[str, tuple[ClassCount, ...]] = {
        p: tuple(rank_classes(classes, hosts, limit=limit)) for p, hosts in members.items()
    }
    return classfile.ClassFile(
        verified=int(verified),
        min_nodes=config.policy.min_nodes,
        max_alternatives=limit,
        opt_out=config.gate.allow_opt_out,
        guarded=tuple(config.policy.partitions),
        partitions=table,
    )


@contextlib.contextmanager
def _locked(path: Path, wait_s: float = 30.0) -> Iterator[None]:
    """One sync at a time (daemon, hooks, admins): an flock on ``<file>.lock``."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    lock_path = Path(f"{path}.lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            lock(fd, lock_path, wait_s, "no sync", poll_s=0.05)
        except AuditError as e:
            raise classfile.ClassFileError(str(e)) from None
        yield
    finally:
        os.close(fd)


def sync(config: Config, slurm: Slurm, *, dry_run: bool = False, now: float | None = None,
         inventory: Inventory | None = None) -> SyncResult:
    """Read Slurm's nodes and the inventory, apply the updates (unless ``dry_run``), and
    write the file of classes when Slurm holds every feature it names.

    ``inventory``: an open one to read (the CLI's), else the configured one.
    ``SlurmError`` from reading the nodes, ``ClassFileError`` or ``InventoryError``
    propagate; a failed update is reported in ``errors`` and the file is not written.
    """
    now = time.time() if now is None else now
    path = Path(config.features.classes_file)
    lock = contextlib.nullcontext() if dry_run else _locked(path)
    with lock:
        nodes = slurm.nodes()
        classes = desired(config, [n.name for n in nodes], now, inventory)
        p = plan(nodes, classes)
        result = SyncResult(p, dry_run=dry_run)
        if dry_run:
            return result
        for u in p.updates:
            try:
                slurm.set_features(u.hosts, u.available, u.active)
                result.applied.append(u)
            except SlurmError as e:
                result.errors.append(f"{compress(u.hosts)}: {e}")
        if result.errors:
            return result  # Slurm may lack some features: the lua must not name them
        classfile.write(path, class_table(config, nodes, p.classes, now))
        result.written = path
        return result


def mark_verified(config: Config, now: float | None = None) -> bool:
    """Rewrite the file with ``verified = now`` (Slurm was just seen holding its
    features); False when there is no readable file to confirm."""
    path = Path(config.features.classes_file)
    with _locked(path):
        try:
            cf = classfile.read(path)
        except classfile.ClassFileError:
            return False
        classfile.write(path, classfile.ClassFile(
            verified=int(time.time() if now is None else now), min_nodes=cf.min_nodes,
            max_alternatives=cf.max_alternatives, opt_out=cf.opt_out, guarded=cf.guarded,
            partitions=cf.partitions))
        return True
