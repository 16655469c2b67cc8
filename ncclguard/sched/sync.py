"""Keep Slurm's node features equal to the inventory's classes, and write the lua's file.

    Slurm's nodes ──┐
                    ├─▶ plan: each node's features = its own + its class ─▶ updates
    inventory ──────┘   (each node's class key, its name: ncclguard/sched/classes.py)
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
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ncclguard.config import Config
from ncclguard.hostlist import compress
from ncclguard.policy import GATE_VALUES, stale_hosts
from ncclguard.policy.schedule import (
    ClassCount,
    adds_features,
    class_features,
    class_values,
    feature_names,
    is_class_feature,
    is_host_class,
    rank_classes,
)
from ncclguard.sched import classfile, group
from ncclguard.sched.imagelines import carried, image_groups, keep_s
from ncclguard.sched.submit import choose, constraints
from ncclguard.slurm import NodeInfo, Slurm, SlurmError, SlurmTimeout
from ncclguard.store import Inventory, InventoryError

__all__ = ["Plan", "SyncResult", "Update", "class_table", "desired", "mark_verified", "plan",
           "regroup_pending", "sync", "without_held"]


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
    # Slurm node -> its class of the second family ([features] own_nccl; None: none)
    adds: dict[str, str | None] = field(default_factory=dict)

    @property
    def changed_hosts(self) -> list[str]:
        return sorted(h for u in self.updates for h in u.hosts)


@dataclass
class SyncResult:
    plan: Plan
    applied: list[Update] = field(default_factory=list)
    failed: list[tuple[Update, str]] = field(default_factory=list)  # and why
    errors: list[str] = field(default_factory=list)
    written: Path | None = None
    regrouped: list[tuple[str, str, str]] = field(default_factory=list)  # (job, old, new)
    dry_run: bool = False
    images: dict[str, classfile.ImageGroup] = field(default_factory=dict)  # as written
    image_mark: str | None = None  # the image index's mark they were read at
    image_error: str | None = None  # why they could not be read (the file has none)
    envs: dict[str, tuple[str, ...]] = field(default_factory=dict)  # env lines, as written


def desired(config: Config, hosts: Sequence[str], now: float | None = None,
            inventory: Inventory | None = None, *, held: bool = True
            ) -> dict[str, str | None]:
    """Each host's class feature: its class in the inventory
    (:meth:`~ncclguard.store.Inventory.class_keys`, named over every class of the
    inventory), with the gate's freshness test (stale nodes follow ``unknown-node``).
    ``inventory``: the caller's, opened with the policy's classes, left open."""
    now = time.time() if now is None else now
    if inventory is not None:
        every, beats = inventory.class_keys(), inventory.heartbeats()
    else:
        with Inventory(readonly=True, values=class_values(config.policy),
                       config=config.inventory) as inv:
            every, beats = inv.class_keys(), inv.heartbeats()
    keys = {h: every.get(h) for h in hosts}
    stale = stale_hosts({h: beats[h] for h in hosts if keys[h] is not None and h in beats}, now,
                        config.inventory.stale_after_s)
    names = feature_names(k for k in every.values() if k is not None)
    out = class_features(keys, config.policy, stale, names=names)
    return without_held(config, out, inventory) if held else out


def without_held(config: Config, classes: dict[str, str | None],
                 inventory: Inventory | None = None) -> dict[str, str | None]:
    """``classes`` with the nodes the canary holds (``[canary] enabled``) given none: no
    multi-node job is placed on them until their canary passes (docs/canary.md)."""
    if not config.canary.enabled:
        return classes
    with (contextlib.nullcontext(inventory) if inventory is not None else
          Inventory(readonly=True, values=GATE_VALUES, config=config.inventory)) as inv:
        held = inv.canary_held()
    return {h: (None if h in held else c) for h, c in classes.items()}


def desired_adds(config: Config, hosts: Sequence[str], now: float | None = None,
                 inventory: Inventory | None = None) -> dict[str, str | None]:
    """Each host's class of the second family (:func:`~ncclguard.policy.schedule.
    adds_features` of the gate's records, with its freshness test); ``{}`` unless
    ``[features] own_nccl``. One read of every host's record: the daemon asks at a full
    sync and every ``verify_s``, not every pass."""
    if not config.features.own_nccl:
        return {}
    now = time.time() if now is None else now
    with (contextlib.nullcontext(inventory) if inventory is not None else
          Inventory(readonly=True, values=GATE_VALUES, config=config.inventory)) as inv:
        loaded = inv.load_values(list(hosts))
    records: dict[str, dict | None] = {}
    beats: dict[str, float] = {}
    for h in hosts:
        got = loaded.get(h)
        records[h] = got[0] if got else None
        if got:
            beats[h] = got[1]
    stale = stale_hosts(beats, now, config.inventory.stale_after_s)
    return without_held(config, adds_features(records, config.policy, stale), inventory)


def _env_groups(config: Config, adds: Mapping[str, str | None], result: SyncResult
                ) -> dict[str, tuple[str, ...]]:
    """:func:`~ncclguard.sched.envlines.env_groups` from the configured inventory; one
    that cannot be read gives none (such jobs get the host classes), said in ``errors``."""
    from ncclguard.sched.envlines import env_groups

    try:
        with Inventory(readonly=True, values=GATE_VALUES, config=config.inventory) as inv:
            return env_groups(config, inv, adds)
    except InventoryError as e:
        result.errors.append(f"env groups: {e}")
        return {}


def _image_groups(config: Config, classes: Mapping[str, str | None], now: float,
                  result: SyncResult) -> dict[str, classfile.ImageGroup]:
    """:func:`image_groups` from the configured inventory, into ``result``; an inventory
    that cannot be read gives none (the lua then offers image jobs every class, and the
    gate judges them), and says why."""
    try:
        with Inventory(readonly=True, values=GATE_VALUES, config=config.inventory) as inv:
            result.image_mark = inv.image_mark()
            result.images = image_groups(config, inv, classes, now)
    except InventoryError as e:
        result.image_error = f"image groups: {e}"
    return result.images


def plan(nodes: Sequence[NodeInfo], classes: Mapping[str, str | None],
         adds: Mapping[str, str | None] | None = None) -> Plan:
    """The updates that give each node its own features plus its class feature, and its
    class of the second family where ``adds`` names one (any other ``nc_`` feature
    removed), grouped by the new lists: one call per group."""
    groups: dict[tuple[tuple[str, ...], tuple[str, ...]], list[str]] = {}
    wanted: dict[str, str | None] = {}
    second = adds or {}
    for n in nodes:
        cls = classes.get(n.name)
        wanted[n.name] = cls
        tail = tuple(f for f in (cls, second.get(n.name)) if f)
        available = tuple(f for f in n.features if not is_class_feature(f)) + tail
        active = tuple(f for f in n.active_features if not is_class_feature(f)) + tail
        if set(available) == set(n.features) and set(active) == set(n.active_features):
            continue
        groups.setdefault((available, active), []).append(n.name)
    updates = [Update(tuple(hosts), avail, act) for (avail, act), hosts in groups.items()]
    return Plan(wanted, updates, list(nodes),
                {n.name: second.get(n.name) for n in nodes} if adds else {})


def class_table(config: Config, nodes: Sequence[NodeInfo], classes: Mapping[str, str | None],
                verified: float, default: str | None = None,
                images: Mapping[str, classfile.ImageGroup] | None = None,
                adds: Mapping[str, str | None] | None = None,
                envs: Mapping[str, tuple[str, ...]] | None = None,
                ) -> classfile.ClassFile:
    """The lua's file: for every node and for each partition, the classes in preference
    order (largest first), those of at least two nodes, at most ``max_alternatives``;
    ``images``: the image lines (:func:`image_groups`); ``adds``: each node's class of
    the second family, ranked per partition the same way, and ``envs`` the env lines
    (:func:`~ncclguard.sched.envlines.env_groups`), both left out without ``adds``."""
    limit = config.features.max_alternatives
    members: dict[str, list[str]] = {classfile.ALL: [n.name for n in nodes]}
    for n in nodes:
        for p in n.partitions:
            members.setdefault(p, []).append(n.name)
    table: dict[str, tuple[ClassCount, ...]] = {
        p: tuple(rank_classes(classes, hosts, limit=limit)) for p, hosts in members.items()
    }
    second: dict[str, tuple[ClassCount, ...]] = {} if not adds else {
        p: tuple(rank_classes(adds, hosts, limit=limit)) for p, hosts in members.items()
    }
    by_class: dict[str, list[str]] = {}
    for n in nodes:
        if (cls := classes.get(n.name)) is not None:
            by_class.setdefault(cls, []).append(n.name)
    return classfile.ClassFile(
        verified=int(verified),
        min_nodes=config.policy.min_nodes,
        max_alternatives=limit,
        opt_out=config.gate.allow_opt_out,
        required_nodes=config.features.required_nodes,
        guarded=tuple(config.policy.partitions),
        default=default,
        partitions=table,
        members={f: compress(hosts) for f, hosts in by_class.items()},
        images=dict(images or {}),
        adds=second,
        envs=dict(envs or {}) if second else {},
    )


def in_slurm(nodes: Sequence[NodeInfo]) -> dict[str, str | None]:
    """Each node's class feature as Slurm has it now (the first active one of the host's
    stack, ``nc_`` but not ``nc_j``)."""
    return {n.name: next((f for f in n.active_features if is_host_class(f)), None)
            for n in nodes}


def adds_in_slurm(nodes: Sequence[NodeInfo]) -> dict[str, str | None]:
    """Each node's class of the second family as Slurm has it now."""
    return {n.name: next((f for f in n.active_features
                          if is_class_feature(f) and not is_host_class(f)), None)
            for n in nodes}


NOT_TRIED = "not tried again yet (backing off)"
SPLIT_CALLS = 64  # scontrol update calls one pass may spend narrowing refused calls down


def _without(updates: Sequence[Update], skip: Collection[str]) -> tuple[list[Update],
                                                                         list[Update]]:
    """``(updates without the skip nodes, the updates of the skip nodes)``, by group."""
    calls: list[Update] = []
    later: list[Update] = []
    for u in updates:
        rest = tuple(h for h in u.hosts if h not in skip)
        wait = tuple(h for h in u.hosts if h in skip)
        if rest:
            calls.append(Update(rest, u.available, u.active))
        if wait:
            later.append(Update(wait, u.available, u.active))
    return calls, later


def _apply(slurm: Slurm, u: Update, result: SyncResult, budget: list[int]) -> None:
    """One update; when Slurm refuses a call of several nodes, its two halves are tried
    in turn, and so on down (a refused node among 16,384 costs 2 calls per halving, 28
    in all), while ``budget`` (calls) lasts. A time-out is not narrowed down: the
    controller is slow, and more calls would only add to it. What stays refused is in
    ``result.failed`` with what Slurm said (the same words whichever call it was)."""
    try:
        slurm.set_features(u.hosts, u.available, u.active)
        result.applied.append(u)
        return
    except SlurmTimeout as e:
        result.failed.append((u, str(e)))
        return
    except SlurmError as e:
        why = e.stderr[:500] or str(e)
    if len(u.hosts) == 1 or budget[0] < 2:
        result.failed.append((u, why))
        return
    budget[0] -= 2
    mid = len(u.hosts) // 2
    for part in (u.hosts[:mid], u.hosts[mid:]):
        _apply(slurm, Update(part, u.available, u.active), result, budget)


def sync(config: Config, slurm: Slurm, *, dry_run: bool = False, now: float | None = None,
         inventory: Inventory | None = None,
         classes: Callable[[Sequence[str]], Mapping[str, str | None]] | None = None,
         adds: Callable[[Sequence[str]], Mapping[str, str | None]] | None = None,
         skip: Collection[str] = (),
         progress: Callable[[str], None] | None = None) -> SyncResult:
    """Read Slurm's nodes and the inventory, apply the updates (unless ``dry_run``), and
    write the file of classes when Slurm holds every feature it names.

    ``inventory``: an open one to read (the CLI's), else the configured one. ``classes``:
    each node's class from the names of Slurm's nodes, instead of :func:`desired` (the
    daemon's, with flapping nodes held); ``adds``: the same for the second family,
    instead of :func:`desired_adds`. ``skip``: nodes whose update is not tried now
    (the daemon backs off from updates Slurm refused); they count as failed
    (:data:`NOT_TRIED`), and the other nodes of their group are updated without them.
    A call that Slurm refuses is narrowed down in halves (:func:`_apply`), so that a node
    Slurm keeps refusing never holds back another node of the same call.
    ``SlurmError`` from reading the nodes, ``ClassFileError`` or ``InventoryError``
    propagate. While features move, the file names only classes Slurm has before and
    after; a failed update is reported in ``errors``, and the file then names only what
    Slurm reports it has. Then pending jobs whose group names a class gone (or too small
    now) get the current group (:func:`regroup_pending`). ``progress`` is told each step
    (``ncclguard features sync``'s progress line: at 16,384 nodes a sync is many calls).
    """
    now = time.time() if now is None else now
    step = progress if progress is not None else _silent
    path = Path(config.features.classes_file)
    lock = contextlib.nullcontext() if dry_run else classfile.locked(path)
    with lock:
        step("reading Slurm's nodes")
        nodes = slurm.nodes()
        names = [n.name for n in nodes]
        step(f"{len(names):,} nodes: reading their classes")
        p = plan(nodes, classes(names) if classes else desired(config, names, now, inventory),
                 adds(names) if adds else desired_adds(config, names, now, inventory))
        result = SyncResult(p, dry_run=dry_run)
        if dry_run:
            return result
        default = slurm.default_partition()
        images = result.images = carried(classfile.our_body(path),
                                         _image_groups(config, p.classes, now, result),
                                         now, keep_s(config))
        envs = result.envs = _env_groups(config, p.adds, result) if p.adds else {}
        before, before_adds = in_slurm(nodes), adds_in_slurm(nodes)
        if any(before.get(h) != c for h, c in p.classes.items()) or any(
                before_adds.get(h) != c for h, c in p.adds.items()):
            # while features move, the lua may only name classes Slurm has before and
            # after, and none of the second family (its jobs get the host classes)
            kept = {f for f in before.values() if f} & {f for f in p.classes.values() if f}
            classfile.write(path, class_table(config, nodes, {h: (c if c in kept else None)
                                                     for h, c in p.classes.items()}, now,
                                     default, images))
        calls, later = _without(p.updates, skip)
        result.failed += [(u, NOT_TRIED) for u in later]
        budget = [SPLIT_CALLS]
        for k, u in enumerate(calls):
            step(f"scontrol update {k + 1:,} of {len(calls):,}")
            _apply(slurm, u, result, budget)
        result.errors += [f"{compress(u.hosts)}: {why}" for u, why in result.failed]
        if result.errors:
            # some updates failed: the file names what Slurm reports it has, nothing else
            try:
                nodes = slurm.nodes()
            except SlurmError as e:
                result.errors.append(f"reading the nodes again: {e}")
                path.unlink(missing_ok=True)  # no file: the lua adds nothing, the gate checks
                return result
            classfile.write(path, class_table(config, nodes, in_slurm(nodes), now, default,
                                              images, adds_in_slurm(nodes) if p.adds else None,
                                              envs))
            return result
        cf = class_table(config, nodes, p.classes, now, default, images, p.adds, envs)
        classfile.write(path, cf)
        result.written = path
        step("pending jobs: regrouping")
        result.regrouped = regroup_pending(slurm, cf, result.errors)
        return result


def _silent(text: str) -> None:
    """No progress to tell (the features daemon, the hooks)."""


def regroup_pending(slurm: Slurm, cf: classfile.ClassFile, errors: list[str]
                    ) -> list[tuple[str, str, str]]:
    """Pending jobs whose class group (as job_submit.lua wrote it) names a class the file no
    longer lists, or one now smaller than the job, get the group the lua would give them
    now (``scontrol update jobid=J Features=...``): class names follow the NCCL stack, and
    a job holding only vanished ones would wait for ever. ``(job, old, new)`` for each."""
    tables = {id(lists): {name: {k.feature: k.nodes for k in lst} for name, lst in lists.items()}
              for lists in (cf.partitions, cf.adds)}
    changed = []
    for job, features, partition, need in slurm.pending_features():
        parsed = group.parse(features)
        if parsed is None:
            continue  # no group, or a user's own
        user, classes = parsed
        # a group of the second family stays while its classes exist and fit; else the
        # host classes, as the lua gives a job whose environment has no line (the sync
        # does not know a pending job's environment, so not which of the second family
        # run its NCCL), and the gate judges it by its own NCCL
        second = not is_host_class(classes[0])
        sizes = tables[id(cf.adds if second else cf.partitions)]
        name = partition if partition in sizes else (cf.default if cf.default in sizes
                                                     else classfile.ALL)
        here = sizes.get(name, {})
        if all(here.get(g, 0) >= need for g in classes):
            continue  # every class it names still exists and fits
        hosts = tables[id(cf.partitions)]
        name = partition if partition in hosts else (cf.default if cf.default in hosts
                                                     else classfile.ALL)
        joined = constraints(choose(cf.partitions.get(name, ()), need, cf.max_alternatives),
                             user, None)
        if joined is None:
            continue  # nothing fits now: it waits, and the gate checks it when it starts
        new = joined[0]
        try:
            slurm.update_job(job, Features=new)
            changed.append((job, features, new))
        except SlurmError as e:
            errors.append(f"job {job}: {e}")
    return changed


def mark_verified(config: Config, now: float | None = None) -> bool:
    """Set the file's ``verified`` to now (Slurm was just seen holding its features): line 2
    rewritten, the rest as the last sync wrote it (no parse: at 16,384 nodes that would
    cost more than the pass's one Slurm call); False when there is no file of ours to
    confirm."""
    path = Path(config.features.classes_file)
    with classfile.locked(path):
        body = classfile.our_body(path)
        if body is None:
            return False
        stamp = int(time.time() if now is None else now)
        try:
            classfile.write_bytes(path, b"%s\nverified %d\n%s" % (classfile.MAGIC.encode(),
                                                                  stamp, body))
        except classfile.ClassFileError:
            return False
        return True
