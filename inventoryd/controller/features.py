"""``ncclguard-inventoryd features``: keeps Slurm's class features and the lua's file
current, on the controller, as SlurmUser (``scontrol update`` of node features needs
root, SlurmUser or a Slurm admin). docs/scheduling.md.

Each ``[features] interval_s`` (2 s):

1. the classes from the inventory (the gate's values and freshness test), with flapping
   nodes held (:class:`Flaps`): when they differ from those last applied, a full
   :func:`~ncclguard.sched.sync.sync`;
2. else, when a refused update's back-off has run out (:class:`Backoff`), a full sync
   that tries it again;
3. else one sentinel node (``scontrol show node -o``, one node only): when it lacks its
   class feature, Slurm lost the runtime features (``scontrol reconfigure``, a plain
   restart): a full sync puts them back;
4. else, every ``verify_s`` (60 s), one grouped read of every partition's nodes by their
   active features (``sinfo -o "%P|%N|%b"``: a line per partition and feature list, about
   32 at 16,384 nodes in 32 classes) is compared with what the last full sync left in
   Slurm; a difference (an admin's ``scontrol update`` of some nodes' features, a node
   added or gone, a node moved between partitions, another default partition) runs a
   full sync, which reads every node;
5. else, when the image index changed (a squashfs file scanned, a registry tag resolved:
   one cheap query, :meth:`~ncclguard.store.Inventory.image_mark`), the collector
   resolved a job environment (``[features] own_nccl``) or ``verify_s`` passed, the
   file's ``image`` lines are judged again (:func:`~ncclguard.sched.imagelines.image_groups`,
   the classes as last applied), and its ``env`` lines
   (:func:`~ncclguard.sched.envlines.env_groups`), and, when they differ, rewritten in
   place: no Slurm call. With ``own_nccl``, every ``verify_s`` the second family of
   classes is read again too, and a change is a full sync;
6. then the file's ``verified`` is set to now, so that job_submit.lua keeps trusting it
   (it trusts a file verified since its own slurmctld started, and recently); a file
   that cannot be read is written again by a full sync.

One node cannot stop or drive the sync: an update Slurm refuses (its own features, a node
gone) is narrowed down in halves within the pass, so that the other nodes of the same
call are updated; a node still refused is logged once, retried with back-off and shown in
the status file (``ncclguard features check``, the collector's metrics) while the other
nodes' updates go on; a node whose class changes again within ``settle_s``
of its last change is held without a class until it has kept one stack that long, so 15
flips cost three updates.

A full sync also moves pending jobs whose group names a class that is gone
(:func:`~ncclguard.sched.sync.regroup_pending`).

Over 500 lines: the pass above is one object's state (what was applied, held, backing off
and last read), and each step reads or changes it; the flapping and back-off rules are
classes of their own here because only this pass uses them.

A failure of the whole pass (Slurm down, the inventory unreadable) is logged once and
retried; the lua stops trusting the file ``FRESH_S`` after the last verification, and
the gate checks every job meanwhile.

The hooks Slurm runs (``SlurmctldPrimaryOnProg``, ``strigger --reconfig``) are
:func:`hook_main`: it returns at once and syncs from a detached process once slurmctld
answers (slurmctld 26.05 runs ``SlurmctldPrimaryOnProg`` before it serves any RPC, and
waits for it: a hook that asked slurmctld anything would wait for itself).
"""

from __future__ import annotations

import argparse
import json
import logging
import logging.handlers
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

from inventoryd.loop import Outcome, SafeFormatter, log_to_stderr, serve
from inventoryd.sdnotify import Notifier
from ncclguard import config as configmod
from ncclguard.hostlist import compress, expand
from ncclguard.policy import GATE_VALUES, load_config
from ncclguard.policy.schedule import is_host_class
from ncclguard.sched import classfile, status
from ncclguard.sched.envlines import env_groups
from ncclguard.sched.imagelines import image_groups, write_images
from ncclguard.sched.sync import (
    SyncResult,
    desired,
    desired_adds,
    mark_verified,
    sync,
    without_held,
)
from ncclguard.slurm import Slurm, SlurmError
from ncclguard.store import Inventory, InventoryError

log = logging.getLogger("ncclguard.features")

__all__ = ["Backoff", "FeatureKeeper", "Flaps", "hook_main", "run"]

RETRY_FIRST_S = 2.0  # a refused update is first tried again this soon, then twice as late
HOOK_WAIT_S = 120.0  # how long the hook's detached process waits for slurmctld to answer


class Flaps:
    """Hold-down of nodes whose class keeps changing.

    A node's first class, and a change after ``settle_s`` without one, apply at once. A
    change within ``settle_s`` of the last one holds the node without a class (no job with
    the group is placed on it) until its class has stayed the same for ``settle_s``."""

    def __init__(self, settle_s: float) -> None:
        self.settle_s = settle_s
        self.last: dict[str, str | None] = {}
        self.changed_at: dict[str, float] = {}
        self.hold_until: dict[str, float] = {}

    def damp(self, classes: Mapping[str, str | None], now: float) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for host, cls in classes.items():
            if host not in self.last:
                self.last[host], self.changed_at[host] = cls, -math.inf
            elif cls != self.last[host]:
                if now - self.changed_at[host] < self.settle_s:
                    self.hold_until[host] = now + self.settle_s
                self.last[host], self.changed_at[host] = cls, now
            out[host] = None if now < self.hold_until.get(host, 0.0) else cls
        for gone in set(self.last) - set(classes):  # nodes Slurm no longer has
            for d in (self.last, self.changed_at, self.hold_until):
                d.pop(gone, None)
        return out

    def held(self, now: float) -> dict[str, float]:
        """``{host: held until}`` for the nodes held now."""
        return {h: t for h, t in self.hold_until.items() if t > now}


@dataclass
class Failure:
    error: str
    since: float
    attempts: int
    next_try: float


class Backoff:
    """Node updates Slurm refused: each node tried again after ``RETRY_FIRST_S``, then
    twice as late each time, up to ``max_s``."""

    def __init__(self, max_s: float, first_s: float = RETRY_FIRST_S) -> None:
        self.max_s = max_s
        self.first_s = first_s
        self.failing: dict[str, Failure] = {}

    def waiting(self, now: float) -> set[str]:
        return {h for h, f in self.failing.items() if f.next_try > now}

    def due(self, now: float) -> list[str]:
        return sorted(h for h, f in self.failing.items() if f.next_try <= now)

    def record(self, res: SyncResult, now: float) -> tuple[dict[str, str], list[str]]:
        """Take a sync's outcome: ``({host: error} newly failing or failing otherwise now,
        [hosts that work again])``."""
        failed = {h: why for u, why in res.failed for h in u.hosts}
        new: dict[str, str] = {}
        for host, why in failed.items():
            f = self.failing.get(host)
            if f is not None and f.next_try > now:
                continue  # skipped: still backing off
            attempts = f.attempts + 1 if f else 1
            delay = min(self.max_s, self.first_s * 2 ** (attempts - 1))
            if f is None or f.error != why:
                new[host] = why
            self.failing[host] = Failure(why, f.since if f else now, attempts, now + delay)
        recovered = sorted(h for h in self.failing if h not in failed)
        for host in recovered:
            del self.failing[host]
        return new, recovered


class FeatureKeeper:
    """The service's state (:class:`inventoryd.loop.Service`): the classes last applied,
    when Slurm was last compared, the nodes held down and the updates backing off. A pass
    that fails as a whole (Slurm down, the inventory unreadable) raises: the loop logs it
    once and tries again at the next pass."""

    label = "features"
    what = "pass"

    def __init__(self, config: configmod.Config, slurm: Slurm | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = config
        self.slurm = slurm or Slurm.from_config(config.gate)
        self.clock = clock
        self.applied: dict[str, str | None] | None = None
        self.last_full = 0.0  # the last full sync, or check that found Slurm as expected
        # (partition, node) -> the class feature Slurm holds after the last full sync
        self.expected: dict[tuple[str, str], str | None] = {}
        self.default: str | None = None  # the default partition, as the first check saw it
        self.syncs = 0
        self.flaps = Flaps(config.features.settle_s)
        self.backoff = Backoff(config.features.retry_max_s)
        self._status: str | None = None
        # the file's image lines as last written, the index's mark and when they were read
        self.images: dict[str, classfile.ImageGroup] = {}
        self.image_mark: str | None = None
        self.images_at = 0.0
        self._image_error: str | None = None
        # [features] own_nccl: each node's class of the second family as last applied, when
        # it was computed, and the job environments' mark the env lines were read at
        self.adds: dict[str, str | None] = {}
        self.adds_at = 0.0
        self.env_mark: tuple[int, float] | None = None

    @classmethod
    def resumed(cls, config: configmod.Config, slurm: Slurm | None = None) -> FeatureKeeper:
        """A keeper that goes on from the daemon's status file (:mod:`ncclguard.sched.status`):
        the nodes it holds stay held until their time, and its refused updates keep their
        back-off. The hooks' sync is one: a fresh keeper gave held nodes their class back
        (the daemon took it away again at its next check: a reconfigure on 26.05 then left
        classes moving for 16 s) and wrote a status file without what ``features check``
        shows. Entries of the wrong types are left out."""
        keeper = cls(config, slurm)
        doc = status.read(config) or {"held": [], "failing": []}
        for e in doc["held"]:
            if isinstance(e.get("until"), (int, float)):
                keeper.flaps.hold_until[e["host"]] = float(e["until"])
        for e in doc["failing"]:
            try:
                keeper.backoff.failing[e["host"]] = Failure(
                    str(e["error"]), float(e["since"]), int(e["attempts"]),
                    float(e["next_try"]))
            except (KeyError, TypeError, ValueError):
                continue
        return keeper

    def _sentinel(self) -> tuple[str, str] | None:
        """A node of the largest class, and its feature (None when no node has one)."""
        if not self.applied:
            return None
        ok = {h: f for h, f in self.applied.items() if f and h not in self.backoff.failing}
        counts = Counter(ok.values())
        if not counts:
            return None
        feature = counts.most_common(1)[0][0]
        host = min(h for h, f in ok.items() if f == feature)
        return host, feature

    def _features_lost(self) -> bool:
        sentinel = self._sentinel()
        if sentinel is None:
            return False
        host, feature = sentinel
        active = self.slurm.active_features(host)
        return active is None or feature not in active

    def _drift(self) -> str:
        """What differs between Slurm now and what the last full sync left there ("" if
        nothing), from one grouped read (:meth:`ncclguard.slurm.Slurm.feature_groups`):
        each partition's nodes and their class feature. Nodes whose update is backing off
        are left to their retries."""
        seen: dict[tuple[str, str], str | None] = {}
        default = None
        for part, is_default, hosts, feats in self.slurm.feature_groups():
            default = part if is_default else default
            cls = next((f for f in feats if is_host_class(f)), None)  # not nc_j: own_nccl's
            for host in expand(hosts):
                seen[(part, host)] = cls
        if self.default is None:
            self.default = default
        elif default != self.default:
            return f"the default partition is {default or 'none'}, was {self.default}"
        failing = self.backoff.failing
        got = {k: v for k, v in seen.items() if k[1] not in failing}
        want = {k: v for k, v in self.expected.items() if k[1] not in failing}
        moved = sorted({h for _, h in got.keys() ^ want.keys()})
        if moved:
            return f"{compress(moved)} added, gone or moved between partitions"
        changed = sorted({host for (part, host), cls in want.items() if got[(part, host)] != cls})
        if changed:
            return f"the class feature of {compress(changed)} differs from the one set"
        return ""

    def classes(self, hosts: Sequence[str], now: float) -> dict[str, str | None]:
        """Each host's class as the daemon applies it: the inventory's, flapping ones held,
        then the nodes the canary holds without one. A canary's hold is not a flap: a node
        held and let go within ``settle_s`` gets its class back at once."""
        return without_held(self.cfg, self.flaps.damp(desired(self.cfg, hosts, now,
                                                                held=False), now))

    def started(self) -> str:
        return f"config {self.cfg.source}, classes file {self.cfg.features.classes_file}"

    def step(self, should_stop: Callable[[], bool] = lambda: False) -> Outcome:
        """One pass (:meth:`apply`)."""
        return Outcome(note=self.apply() or None)

    def delay(self, ok: bool) -> float:
        return self.cfg.features.interval_s

    def reloaded(self, config: configmod.Config) -> FeatureKeeper:
        return FeatureKeeper(config)

    def close(self, *, replaced: bool = False) -> None:
        pass

    def apply(self) -> str:
        """One pass; what it did, in words (for the log and the tests)."""
        now = self.clock()
        why = ""
        if self.applied is None:
            why = "first pass"
        elif self.classes(list(self.applied), now) != self.applied:
            why = "the inventory's classes changed"
        elif self._adds_changed(now):
            why = "the classes of what nodes give a job's own NCCL changed"
        elif due := self.backoff.due(now):
            why = f"trying refused updates again ({compress(due)})"
        elif self._features_lost():
            why = "Slurm lost the class features (reconfigure or restart)"
        elif now - self.last_full >= self.cfg.features.verify_s:
            drift = self._drift()
            if drift:
                why = f"periodic verification: {drift}"
            else:
                self.last_full = now
        if why:
            return self._sync(why, now)
        note = self._refresh_images(now)
        if note is not None:
            if note:
                return note
            self.last_full = 0.0  # the file is gone or damaged: write it again
            return self._sync("the file of classes is missing or damaged", now)
        if not mark_verified(self.cfg, now):  # the file is gone or damaged: write it again
            self.last_full = 0.0
            return self._sync("the file of classes is missing or damaged", now)
        self._write_status(now)
        return ""

    def _adds(self, hosts: Sequence[str], now: float) -> dict[str, str | None]:
        """Each host's class of the second family (``[features] own_nccl``; else none)."""
        self.adds_at = now
        return desired_adds(self.cfg, hosts, now)

    def _adds_changed(self, now: float) -> bool:
        """Whether the second family changed, looked at every ``verify_s`` (a read of every
        node's record): a change that moves a node's host class is a full sync anyway."""
        if not self.cfg.features.own_nccl or self.applied is None \
                or now - self.adds_at < self.cfg.features.verify_s:
            return False
        try:
            return self._adds(list(self.applied), now) != self.adds
        except InventoryError as e:
            log.error("the classes of what nodes add cannot be read: %s", e)
            return False

    def _env_mark(self, inv: Inventory) -> tuple[int, float] | None:
        """What changes when the collector resolves a job environment (None: own_nccl off)."""
        if not self.cfg.features.own_nccl:
            return None
        states = inv.job_env_states()
        return len(states), max((r for r, _ in states.values()), default=0.0)

    def _refresh_images(self, now: float) -> str | None:
        """The file's image lines judged again when the image index changed or
        ``verify_s`` passed, and written where the file's differ: what was done ("" when
        there is no file to change), or None when nothing was due or nothing changed. An
        inventory that cannot be read is logged once and takes the lines out (as a full
        sync then writes none): the lua offers image jobs every class, the gate judges."""
        if self.applied is None:
            return None
        try:
            with Inventory(readonly=True, values=GATE_VALUES, config=self.cfg.inventory) as inv:
                mark, env_mark = inv.image_mark(), self._env_mark(inv)
                if mark == self.image_mark and env_mark == self.env_mark \
                        and now - self.images_at < self.cfg.features.verify_s:
                    return None
                images = image_groups(self.cfg, inv, self.applied, now)
                envs = env_groups(self.cfg, inv, self.adds) if self.adds else None
                self.env_mark = env_mark
        except InventoryError as e:
            if str(e) != self._image_error:
                log.error("image groups cannot be judged, the file has none until they can: %s",
                          e)
            self._image_error, self.image_mark = str(e), None
            images, envs = {}, ({} if self.adds else None)
        else:
            self._image_error = None
            self.image_mark, self.images_at = mark, now
        written = write_images(self.cfg, images, now, envs)
        if written is None:
            return ""
        def classes(g: classfile.ImageGroup | None) -> tuple[str, ...] | None:
            return None if g is None else g.classes

        changed = sorted(k for k in images.keys() | self.images.keys()
                         if classes(images.get(k)) != classes(self.images.get(k)))
        self.images = images
        if not written:
            return None
        what = (", ".join(changed[:4]) + (" and more" if len(changed) > 4 else "") if changed
                else "none: their ends moved, or the file had other lines")
        return f"image groups: {len(images)} images some class cannot run; changed: {what}"

    def _sync(self, why: str, now: float) -> str:
        res = sync(self.cfg, self.slurm, now=now,
                   classes=lambda names: self.classes(names, now),
                   adds=lambda names: self._adds(names, now),
                   skip=self.backoff.waiting(now))
        self.syncs += 1
        self.applied, self.last_full = dict(res.plan.classes), now
        self.adds = dict(res.plan.adds)
        self.images, self.image_mark, self.images_at = res.images, res.image_mark, now
        if res.image_error is not None and res.image_error != self._image_error:
            log.error("%s; the file has no image lines until it can be read", res.image_error)
        self._image_error = res.image_error
        self.expected = {(part, n.name): res.plan.classes.get(n.name)
                         for n in res.plan.nodes for part in n.partitions}
        self.default = None
        new, recovered = self.backoff.record(res, now)
        for error, hosts in _by_error(new).items():
            log.error("Slurm refused the class feature update of %s; the other nodes are "
                      "kept, and it is tried again with back-off (at most every %.0f s): %s",
                      compress(hosts), self.cfg.features.retry_max_s, error)
        if recovered:
            log.info("class feature updates of %s work again", compress(recovered))
        others = [e for e in res.errors if not any(
            e.startswith(compress(u.hosts) + ":") for u, _ in res.failed)]
        self._write_status(now)
        if others:  # not a node's own update: the pass itself (reading Slurm again)
            raise SlurmError("; ".join(others))
        changed = len(res.plan.changed_hosts)
        moved = "".join(f"; job {j}: {old} -> {new}" for j, old, new in res.regrouped)
        held = self.flaps.held(now)
        notes = (f"; {len(self.backoff.failing)} nodes backing off" if self.backoff.failing
                 else "") + (f"; {len(held)} flapping nodes held" if held else "")
        return (f"{why}: {changed} nodes updated in {len(res.applied)} calls"
                f"{notes}{moved}")

    def _write_status(self, now: float) -> None:
        """The status file, when what it says changed: what the daemon holds back."""
        doc = {
            "failing": [{"host": h, **asdict(f)} for h, f in sorted(self.backoff.failing.items())],
            "held": [{"host": h, "until": t} for h, t in sorted(self.flaps.held(now).items())],
        }
        text = json.dumps(doc, sort_keys=True)
        if text == self._status:
            return
        try:
            status.write(self.cfg, {**doc, "time": now})
        except OSError as e:
            log.error("cannot write %s: %s", status.path(self.cfg), e.strerror or e)
        self._status = text  # a failure is logged once; tried again when the status changes


def _by_error(failing: Mapping[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for host, error in failing.items():
        out.setdefault(error, []).append(host)
    return out


def run(config_path: str | None, config: configmod.Config, *,
        notifier: Notifier | None = None, max_passes: int | None = None,
        keeper: FeatureKeeper | None = None) -> int:
    """The service (:func:`inventoryd.loop.serve`): a pass every ``interval_s`` until
    SIGTERM/SIGINT; SIGHUP reloads."""
    log_to_stderr(log)
    return serve(keeper or FeatureKeeper(config), log, config_path=config_path,
                 notifier=notifier, max_steps=max_passes)


# ----------------------------------------------------------------- the hooks
def hook_main(argv: Sequence[str] | None = None) -> int:
    """``ncclguard-features-hook``: what ``SlurmctldPrimaryOnProg`` and the permanent
    ``strigger --reconfig`` run. It returns 0 at once; a detached process (its own
    session, no descriptor of slurmctld's) waits until slurmctld answers (at most
    ``HOOK_WAIT_S``) and then runs one sync, as ``features --once`` would. Its log goes
    to syslog (the journal), or to ``--log FILE``."""
    p = argparse.ArgumentParser(prog="ncclguard-features-hook", description=hook_main.__doc__)
    p.add_argument("--config", default=None, help="config file (default: $NCCLGUARD_CONFIG "
                   "or /etc/ncclguard/config.toml)")
    p.add_argument("--log", default=None, help="append the detached sync's log here "
                   "instead of syslog")
    p.add_argument("--wait", type=float, default=HOOK_WAIT_S, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not _detach():
        return 0  # the caller's side: back to slurmctld at once
    try:
        _hook_log(args.log)
        _hook_sync(args.config, args.wait)
    finally:
        os._exit(0)


def _detach() -> bool:
    """Fork twice: False in the caller (after the first child exits), True in the
    grandchild, which has a session of its own and none of the caller's descriptors."""
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        return False
    os.setsid()
    if os.fork():
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024)
    return True


def _hook_log(path: str | None) -> None:
    log.setLevel(logging.INFO)
    log.propagate = False
    handler: logging.Handler
    if path:
        handler = logging.FileHandler(path)
        handler.setFormatter(SafeFormatter("%(asctime)s %(levelname)s %(message)s"))
    elif os.path.exists("/dev/log"):
        handler = logging.handlers.SysLogHandler(address="/dev/log")
        handler.setFormatter(SafeFormatter("ncclguard-features-hook: %(message)s"))
    else:
        handler = logging.NullHandler()
    log.addHandler(handler)


def _hook_sync(config_path: str | None, wait_s: float) -> None:
    try:
        cfg = load_config(config_path)
    except configmod.ConfigError as e:
        log.error("hook: %s", e)
        return
    slurm = Slurm.from_config(cfg.gate, timeout=5.0)
    end = time.monotonic() + wait_s
    while not slurm.ping():
        if time.monotonic() > end:
            log.error("hook: slurmctld did not answer within %.0f s; the features daemon "
                      "puts the class features back when it does", wait_s)
            return
        time.sleep(0.5)
    try:
        did = FeatureKeeper.resumed(cfg, Slurm.from_config(cfg.gate)).apply()
        log.info("hook: %s", did)
    except (SlurmError, InventoryError, classfile.ClassFileError) as e:
        log.error("hook: cannot put the class features back: %s", e)
