"""``ncclguard-inventoryd features``: keeps Slurm's class features and the lua's file
current, on the controller, as SlurmUser (``scontrol update`` of node features needs
root, SlurmUser or a Slurm admin). docs/scheduling.md.

Each ``[features] interval_s`` (2 s):

1. the classes from the inventory (the gate's values and freshness test): when they
   differ from those last applied, a full :func:`~ncclguard.sched.sync.sync`;
2. else one sentinel node (``scontrol show node -o``, one node only): when it lacks its
   class feature, Slurm lost the runtime features (``scontrol reconfigure``, a plain
   restart): a full sync puts them back;
3. else, every ``verify_s`` (60 s), a full sync compares every node (an admin's
   ``scontrol update`` of some nodes' features, a node gone);
4. then the file's ``verified`` is set to now, so that job_submit.lua keeps trusting it
   (it trusts a file verified since its own slurmctld started, and recently); a file
   that cannot be read is written again by a full sync.

A full sync also moves pending jobs whose group names a class that is gone
(:func:`~ncclguard.sched.sync.regroup_pending`).

A failure (Slurm down, the inventory unreadable) is logged once and retried; the lua
stops trusting the file ``FRESH_S`` after the last verification, and the gate checks
every job meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from inventoryd.loop import Signals, log_to_stderr
from inventoryd.sdnotify import Notifier
from ncclguard import config as configmod
from ncclguard.policy import load_config
from ncclguard.sched import classfile
from ncclguard.sched.sync import desired, mark_verified, sync
from ncclguard.slurm import Slurm, SlurmError
from ncclguard.store import InventoryError

log = logging.getLogger("ncclguard.features")

__all__ = ["FeatureKeeper", "run"]


class FeatureKeeper:
    """The loop's state: the classes last applied, and when Slurm was last compared."""

    def __init__(self, config: configmod.Config, slurm: Slurm | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = config
        self.slurm = slurm or Slurm.from_config(config.gate)
        self.clock = clock
        self.applied: dict[str, str | None] | None = None
        self.last_full = 0.0
        self.syncs = 0

    def _sentinel(self) -> tuple[str, str] | None:
        """A node of the largest class, and its feature (None when no node has one)."""
        if not self.applied:
            return None
        counts = Counter(f for f in self.applied.values() if f)
        if not counts:
            return None
        feature = counts.most_common(1)[0][0]
        host = min(h for h, f in self.applied.items() if f == feature)
        return host, feature

    def _features_lost(self) -> bool:
        sentinel = self._sentinel()
        if sentinel is None:
            return False
        host, feature = sentinel
        active = self.slurm.active_features(host)
        return active is None or feature not in active

    def step(self) -> str:
        """One pass; what it did, in words (for the log and the tests)."""
        now = self.clock()
        hosts = list(self.applied) if self.applied is not None else None
        if hosts is None:
            why = "first pass"
        else:
            classes = desired(self.cfg, hosts, now)
            if classes != self.applied:
                why = "the inventory's classes changed"
            elif self._features_lost():
                why = "Slurm lost the class features (reconfigure or restart)"
            elif now - self.last_full >= self.cfg.features.verify_s:
                why = "periodic verification"
            else:
                why = ""
        if why:
            res = sync(self.cfg, self.slurm, now=now)
            self.syncs += 1
            if res.errors:
                raise SlurmError("; ".join(res.errors))
            self.applied, self.last_full = dict(res.plan.classes), now
            changed = len(res.plan.changed_hosts)
            moved = "".join(f"; job {j}: {old} -> {new}" for j, old, new in res.regrouped)
            return f"{why}: {changed} nodes updated in {len(res.applied)} calls{moved}"
        if not mark_verified(self.cfg, now):  # the file is gone or damaged: write it again
            self.last_full = 0.0
            return self.step()
        return ""


def run(config_path: str | None, config: configmod.Config, *,
        notifier: Notifier | None = None, max_passes: int | None = None,
        keeper: FeatureKeeper | None = None) -> int:
    """The service: a pass every ``interval_s`` until SIGTERM/SIGINT; SIGHUP reloads."""
    log_to_stderr(log)
    notifier = notifier or Notifier()
    keeper = keeper or FeatureKeeper(config)
    log.info("features started (config %s, classes file %s)", config.source,
             config.features.classes_file)
    notifier.ready("keeping class features")
    passes = 0
    last_failure: str | None = None
    with Signals() as flags:
        while not flags.stop:
            if flags.reload:
                flags.reload = False
                try:
                    keeper = FeatureKeeper(load_config(config_path))
                    log.info("config reloaded from %s", keeper.cfg.source)
                except configmod.ConfigError as e:
                    log.error("config not reloaded, keeping the previous one: %s", e)
            try:
                did = keeper.step()
                failure = None
            except (SlurmError, InventoryError, classfile.ClassFileError) as e:
                did, failure = "", f"{type(e).__name__}: {e}"
            except Exception as e:  # a bug must not stop the loop: the gate stays on
                did, failure = "", f"unexpected {type(e).__name__}: {e}"
            if did:
                log.info("%s", did)
            if failure != last_failure:
                if failure:
                    log.error("cannot keep the class features, retrying: %s", failure)
                elif last_failure:
                    log.info("class features kept again")
                last_failure = failure
            notifier.watchdog()
            passes += 1
            if max_passes is not None and passes >= max_passes:
                break
            flags.sleep(keeper.cfg.features.interval_s, notifier)
    notifier.stopping()
    log.info("features stopped")
    return 0

