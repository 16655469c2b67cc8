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
import dataclasses
import os
import re
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
    regrouped: list[tuple[str, str, str]] = field(default_factory=list)  # (job, old, new)
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
                verified: float, default: str | None = None) -> classfile.ClassFile:
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
        default=default,
        partitions=table,
    )


def in_slurm(nodes: Sequence[NodeInfo]) -> dict[str, str | None]:
    """Each node's class feature as Slurm has it now (the first ``nc_`` one active)."""
    return {n.name: next((f for f in n.active_features if is_class_feature(f)), None)
            for n in nodes}


@contextlib.contextmanager
def _locked(path: Path, wait_s: float = 30.0) -> Iterator[None]:
    """One sync at a time (daemon, hooks, admins): an flock on ``<file>.lock``."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    lock_path = Path(f"{path}.lock")
    try:  # read-only: flock needs no more, and a lock file root created still opens
        fd = os.open(lock_path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise classfile.ClassFileError(f"{lock_path}: cannot open: {e.strerror or e}") from None
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
    propagate. While features move, the file names only classes Slurm has before and
    after; a failed update is reported in ``errors``, and the file then names only what
    Slurm reports it has. Then pending jobs whose group names a class gone (or too small
    now) get the current group (:func:`regroup_pending`).
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
        default = slurm.default_partition()
        before = in_slurm(nodes)
        if any(before.get(h) != c for h, c in p.classes.items()):
            # while features move, the lua may only name classes Slurm has before and after
            kept = {f for f in before.values() if f} & {f for f in p.classes.values() if f}
            classfile.write(path, class_table(config, nodes, {h: (c if c in kept else None)
                                                     for h, c in p.classes.items()}, now,
                                     default))
        for u in p.updates:
            try:
                slurm.set_features(u.hosts, u.available, u.active)
                result.applied.append(u)
            except SlurmError as e:
                result.errors.append(f"{compress(u.hosts)}: {e}")
        if result.errors:
            # some updates failed: the file names what Slurm reports it has, nothing else
            try:
                nodes = slurm.nodes()
            except SlurmError as e:
                result.errors.append(f"reading the nodes again: {e}")
                path.unlink(missing_ok=True)  # no file: the lua adds nothing, the gate checks
                return result
            classfile.write(path, class_table(config, nodes, in_slurm(nodes), now, default))
            return result
        cf = class_table(config, nodes, p.classes, now, default)
        classfile.write(path, cf)
        result.written = path
        result.regrouped = regroup_pending(slurm, cf, result.errors)
        return result


_GROUP = re.compile(r"(?:\((?P<user>[^()\[\]*]*)\)&)?\[(?P<group>[^\[\]]*)\]")


def regroup_pending(slurm: Slurm, cf: classfile.ClassFile, errors: list[str]
                    ) -> list[tuple[str, str, str]]:
    """Pending jobs whose class group (as job_submit.lua wrote it) names a class the file no
    longer lists, or one now smaller than the job, get the group the lua would give them
    now (``scontrol update jobid=J Features=...``): class names follow the NCCL stack, and
    a job holding only vanished ones would wait for ever. ``(job, old, new)`` for each."""
    sizes = {name: {k.feature: k.nodes for k in lst} for name, lst in cf.partitions.items()}
    changed = []
    for job, features, partition, need in slurm.pending_features():
        m = _GROUP.fullmatch(features)
        if not m:
            continue
        group = m["group"].split("|")
        if not all(is_class_feature(g) for g in group):
            continue  # a user's own bracket group
        name = partition if partition in sizes else (cf.default if cf.default in sizes
                                                     else classfile.ALL)
        here = sizes.get(name, {})
        if all(here.get(g, 0) >= need for g in group):
            continue  # every class it names still exists and fits
        fits = [f for f, n in here.items() if n >= need][: cf.max_alternatives]
        if not fits:
            continue  # nothing fits now: it waits, and the gate checks it when it starts
        new = (f"({m['user']})&" if m["user"] else "") + "[" + "|".join(fits) + "]"
        try:
            slurm.update_job(job, Features=new)
            changed.append((job, features, new))
        except SlurmError as e:
            errors.append(f"job {job}: {e}")
    return changed


def mark_verified(config: Config, now: float | None = None) -> bool:
    """Rewrite the file with ``verified = now`` (Slurm was just seen holding its
    features); False when there is no readable file to confirm."""
    path = Path(config.features.classes_file)
    with _locked(path):
        try:
            cf = classfile.read(path)
        except classfile.ClassFileError:
            return False
        classfile.write(path, dataclasses.replace(
            cf, verified=int(time.time() if now is None else now)))
        return True
