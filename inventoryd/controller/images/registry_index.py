"""The registry index: which references to resolve and read, in a thread of the collector
(docs/containers.md, "Registry images").

The references are those ``[registry] refs`` lists and those the gate saw jobs use (the
``image`` of its audit records that is not a path). One worker thread resolves each every
``resolve_interval_s``, and reads the image a reference resolves to when that digest
was never read well: an error about its content (its digest verified first) is read
again when the tag is next due, after its back-off, and a good read replaces it; a
registry's failure (a blob not its digest's included) is that tag's, never the
digest's. Reading a multi-GiB image takes minutes: it never runs in the collector's
loop, and the node records never wait for it. The worker only reads the inventory (its
own read-only connection); what it finds is handed to the loop
(:meth:`RegistryIndex.drain`), which writes it, the inventory's one writer.

Fair and bounded: each pass resolves every due reference first (a manifest or two, at
most RESOLVE_TIMEOUT_S each), then reads the new images, one at a time, each within
``timeout_s``, while the pass's budget (``resolve_interval_s``) lasts; both in turns, one
reference of each registry in turn and, within a registry, one of each user's in turn
(the user of the first job that named it, from the gate's audit record; ``[registry]
refs`` are one more "user"), each user's tags last resolved well first. The registries
and users whose references took least time in the last passes (halved every budget)
go first: a user whose many or slow references spent a pass's share waits, at the next,
behind another user's one, so that tag is resolved at every pass. A registry that times
out, or spends its share of the budget, is left for the next pass. A reference failing
again and again backs off (doubling from ``resolve_interval_s``, at most a day); at most
``max_refs`` references (the configured ones first, then those the index holds that a
job used within ``max_age_s``, then the others in turns by user, each one's most recent
first); one no job used for ``keep_unused_s`` and not configured is dropped. The
writer's queue holds at most QUEUE_MAX batches; under disk pressure the loop holds the
worker (:meth:`RegistryIndex.hold`).

Over 500 lines: which references a pass takes, in what order and at what cost, and
what it hands the writer are one worker's state (its users, costs, handed batches);
split, each part would pass the others that state at every call.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inventoryd.controller.audit_tail import AuditTail
from inventoryd.controller.images.registry import (
    MAX_IMAGE_KEPT_BYTES,
    Client,
    Credentials,
    Proxies,
    RegistryError,
    RegistryLimits,
    Resolved,
    default_platform,
    load_credentials,
    read_image,
    resolve,
)
from inventoryd.controller.images.tree import (
    ImageError,
    ImageStopped,
    ImageTransient,
    ImageUnverified,
)
from ncclguard import config as configmod
from ncclguard.fingerprint.imageref import RefError, parse
from ncclguard.policy.rules.container import configured_registries, is_path_image

log = logging.getLogger("ncclguard.collector.registry")  # the collector's log, escaped

MAX_BACKOFF_S = 86400.0
RESOLVE_TIMEOUT_S = 60.0  # one resolution at most (a manifest or two): cheap, or skipped
MIN_PASS_S = 60.0  # a pass's budget at least, whatever resolve_interval_s
QUEUE_MAX = 4  # batches handed to the writer and not yet drained: past it, the worker waits
SWEEP_S = 3600.0  # how often the images and layers no tag holds are dropped, at least
CACHE_LAYERS = 16  # layer summaries kept in memory between the worker's read and the write
CONFIGURED = "[refs]"  # the "user" of the references [registry] refs lists (no user name)
COST_FLOOR_S = 0.001  # a (registry, user)'s past cost below this is forgotten


@dataclass
class Batch:
    """What the worker found, for the writer."""

    tags: list[dict[str, Any]] = field(default_factory=list)
    images: list[dict[str, Any]] = field(default_factory=list)
    layers: list[dict[str, Any]] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)
    sweep: bool = False  # drop the images and layers no tag holds (forget_registry)


def backoff_s(attempts: int, interval: float) -> float:
    return 0.0 if attempts <= 0 else min(interval * 2.0 ** (attempts - 1), MAX_BACKOFF_S)


class RegistryIndex:
    """The worker thread and what it hands the writer (module docstring)."""

    def __init__(self, config: configmod.Config, db: Path | None = None) -> None:
        self.cfg = config
        self.db = db  # the inventory (None: the config's)
        self.rcfg = config.registry
        self.platform = self.rcfg.platform or default_platform()
        self.limits = RegistryLimits(
            timeout_s=self.rcfg.timeout_s, max_layer_bytes=self.rcfg.max_layer_bytes,
            max_unpacked_bytes=self.rcfg.max_unpacked_bytes,
            max_read_bytes=self.rcfg.max_read_bytes, tmp_dir=self.rcfg.tmp_dir)
        self.out: queue.Queue[Batch] = queue.Queue()  # the worker bounds it (_put)
        self._held: str | None = None  # why the writer cannot take batches now
        #: ref key -> when its batch was handed to the writer (not yet in the inventory)
        self._handed: dict[str, float] = {}
        self.used: dict[str, float] = {}  # ref key -> when a job last used it (audit)
        self.user_of: dict[str, str] = {}  # ref key -> the user whose job named it first
        self._layers: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._tail = AuditTail(config.gate.audit_path(config.inventory), sink=self._seen)
        self._thread: threading.Thread | None = None
        self._hosts: tuple[str, ...] = configured_registries(self.rcfg.refs)
        self.proxies = Proxies.from_env(self.rcfg.proxy)
        self.passes = 0
        #: (registry, user) -> seconds their references took, halved every pass's budget
        self._cost: dict[tuple[str, str], float] = {}
        self._charged_at = time.monotonic()
        self._swept = 0.0  # when the last sweep was handed to the writer

    # ---- the loop's side ------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ncclguard-registry",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def hold(self, reason: str | None) -> None:
        """The writer cannot take batches now (``reason``: disk pressure), or again
        (None): while held the worker resolves and reads nothing. Logged once a change."""
        if reason != self._held:
            if reason:
                log.warning("registry: paused: %s", reason)
            else:
                log.info("registry: resumed")
            self._held = reason
            self._wake.set()

    def drain(self) -> list[Batch]:
        out = []
        while True:
            try:
                out.append(self.out.get_nowait())
            except queue.Empty:
                return out

    # ---- the worker -----------------------------------------------------------------

    def _seen(self, rec: Mapping[str, Any]) -> None:
        image, ts = rec.get("image"), rec.get("ts")
        if not isinstance(image, str) or not image or is_path_image(image):
            return
        try:
            ref = parse(image)
        except RefError:
            return
        if not self.rcfg.allows(ref.registry, self._hosts):
            return  # a host no admin named: the controller does not contact it
        key = ref.key
        when = float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) \
            else time.time()
        self.used[key] = max(self.used.get(key, 0.0), when)
        user = rec.get("user")
        self.user_of.setdefault(key, user if isinstance(user, str) else "")
        if len(self.used) > 4 * self.rcfg.max_refs:  # the least recently used go first
            for k in sorted(self.used, key=self.used.__getitem__)[:len(self.used) // 2]:
                del self.used[k]
                self.user_of.pop(k, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._held is not None:  # the writer cannot take what a pass would find
                self._wake.wait(5.0)
                self._wake.clear()
                continue
            try:
                self.run_pass()
            except Exception:  # a bug must not end the thread: the next pass tries again
                log.exception("registry: the pass failed; tried again")
            self._wake.wait(min(5.0, self.rcfg.resolve_interval_s))
            self._wake.clear()

    def _credentials(self) -> Credentials:
        try:
            return load_credentials(self.rcfg.credentials)
        except ValueError as e:
            log.error("registry: credentials not used: %s", e)
            return Credentials()

    def run_pass(self, now: float | None = None, *, keep: bool = False) -> Batch:
        """One pass: the references due, each resolved and (when new) read; what each
        found is handed to the writer as soon as it is done (one image's summaries in
        memory at a time). Called by the thread, or by a test: ``keep`` returns all of it
        (else an empty batch)."""
        from ncclguard.store import Inventory, InventoryError

        self.passes += 1
        self._tail.poll()
        now = time.time() if now is None else now
        batch = Batch()
        try:
            with Inventory(self.db, readonly=True, config=self.cfg.inventory) as inv:
                known = inv.registry_tags()
                # the digests read well: an error stored for a digest is read again when a
                # tag of it is next due (its back-off), and a good read replaces it
                read = {r["digest"] for r in inv.registry_images() if r["digest"]
                        and r["record_hash"] is not None}
                configured = []
                hosts = []
                for text in self.rcfg.refs:
                    try:
                        ref = parse(text)
                    except RefError as e:
                        log.error("registry: refs: %r: %s", text[:200], e)
                        continue
                    configured.append(ref.key)
                    hosts.append(ref.registry)
                self._hosts = tuple(hosts)
                wanted = self._wanted(configured, known, now, batch)
                creds = self._credentials()
                # what no tag holds (an image a tag moved off, its layers) is dropped
                # with the forgotten tags, and at least once an hour
                sweep = now - self._swept >= SWEEP_S
                if (batch.forget or sweep) and self._put(Batch(forget=batch.forget,
                                                               sweep=True)):
                    self._swept = now
                due = [k for k in wanted if self._due(k, known.get(k), now)]
                self._pass(due, known, configured, read, creds, inv, now, batch, keep)
        except InventoryError as e:
            log.warning("registry: the inventory cannot be read: %s", e)
        return batch

    def _due(self, key: str, old: Any, now: float) -> bool:
        if old is not None and old.checked_at + self._interval(old) > now:
            return False
        handed = self._handed.get(key)  # queued, not written yet
        return handed is None or now - handed >= self.rcfg.resolve_interval_s

    def _pass(self, due: list[str], known: Mapping[str, Any], configured: list[str],
              read: set[str], creds: Credentials, inv: Any, now: float, batch: Batch,
              keep: bool) -> None:
        """Resolve every due reference first (cheap: a manifest each, at most
        RESOLVE_TIMEOUT_S), then read the new images while the pass's budget
        (``resolve_interval_s``, at least :data:`MIN_PASS_S`) lasts; both in turns
        (:meth:`_turns`): by registry, and within each registry by user, each user's tags
        last resolved well first, so that one user's many or slow references wait behind
        another user's one. A registry that fails a resolution by its time limit, or
        spends its share of the budget, is left for the next pass (its references stay
        due)."""
        t0 = time.monotonic()
        # resolve_interval_s, but never less than MIN_PASS_S: with 0 ("resolve every
        # pass"), a pass resolved one reference and read nothing
        budget = max(self.rcfg.resolve_interval_s, MIN_PASS_S)
        merit = sorted(due, key=lambda k: (0 if known.get(k) is not None
                                           and known[k].state == "ok" else 1))
        owner = {k: (parse(k).registry, CONFIGURED if k in configured
                     else self.user_of.get(k, "")) for k in merit}
        order = self._turns(merit, owner, budget)
        share = budget / max(len({reg for reg, _ in owner.values()}), 1)
        spent: dict[str, float] = {}
        cost: dict[tuple[str, str], float] = {}  # this pass's time, by (registry, user)
        slow: set[str] = set()
        reads: dict[str, tuple[dict[str, Any], Any, Resolved]] = {}
        try:
            for key in order:
                if self._stop.is_set() or self._held is not None:
                    return
                reg = owner[key][0]
                if reg in slow or spent.get(reg, 0.0) > share:
                    continue
                t = time.monotonic()
                old = known.get(key)
                one = Batch()
                res = self._one(key, old, key in configured, read, creds, inv, one)
                took = time.monotonic() - t
                spent[reg] = spent.get(reg, 0.0) + took
                cost[owner[key]] = cost.get(owner[key], 0.0) + took
                if one.tags and one.tags[0].get("state") == "timeout":
                    slow.add(reg)
                if res is not None:  # a new image: read in the second half, with its tag
                    reads[key] = (one.tags[0], old, res)
                    continue
                if not self._hand(key, one, now, batch, keep):
                    return
            for key in self._turns(list(reads), owner, budget):
                tag, old, res = reads[key]
                one = Batch(tags=[tag])
                if (time.monotonic() - t0 <= budget and not self._stop.is_set()
                        and self._held is None and res.digest not in read):
                    t = time.monotonic()
                    self._read(key, tag, old, res, creds, read, inv, one)
                    cost[owner[key]] = cost.get(owner[key], 0.0) + time.monotonic() - t
                if self._stop.is_set():  # stopped (its read given up): nothing handed
                    return
                if not self._hand(key, one, now, batch, keep):
                    return
        finally:
            self._charge(cost, budget)

    def _turns(self, keys: list[str], owner: Mapping[str, tuple[str, str]],
               budget: float) -> list[str]:
        """``keys`` (in their order of merit) in turns: one of each registry's in turn,
        and within a registry one of each user's in turn, each user's in their order of
        merit. The registries and users whose references cost least in the last passes
        go first (:meth:`_charge`; ties in the order of merit): a user whose tags took a
        pass's share waits, at the next pass, behind another user's one."""
        queues: dict[str, dict[str, list[str]]] = {}
        for k in keys:
            reg, user = owner[k]
            queues.setdefault(reg, {}).setdefault(user, []).append(k)
        cost = self._costs(budget)
        by_reg: dict[str, float] = {}
        for (reg, _), c in cost.items():
            by_reg[reg] = by_reg.get(reg, 0.0) + c
        rounds = []
        for reg in sorted(queues, key=lambda r: by_reg.get(r, 0.0)):  # stable: merit
            users = sorted(queues[reg], key=lambda u: cost.get((reg, u), 0.0))
            rounds.append(_interleave([queues[reg][u] for u in users]))
        return _interleave(rounds)

    def _costs(self, budget: float) -> dict[tuple[str, str], float]:
        """(registry, user) -> the seconds their references took in the last passes,
        halved every ``budget`` seconds since."""
        t = time.monotonic()
        decay = 0.5 ** ((t - self._charged_at) / budget) if budget > 0 else 0.0
        return {k: v * decay for k, v in self._cost.items() if v * decay >= COST_FLOOR_S}

    def _charge(self, cost: Mapping[tuple[str, str], float], budget: float) -> None:
        total = self._costs(budget)
        for k, v in cost.items():
            total[k] = total.get(k, 0.0) + v
        self._cost = {k: v for k, v in total.items() if v >= COST_FLOOR_S}
        self._charged_at = time.monotonic()

    def _hand(self, key: str, one: Batch, now: float, batch: Batch, keep: bool) -> bool:
        if not self._put(one):
            return False
        self._handed[key] = now
        if keep:
            batch.tags += one.tags
            batch.images += one.images
            batch.layers += one.layers
        return True

    def _put(self, batch: Batch) -> bool:
        """Hand a batch to the writer; the worker thread waits while QUEUE_MAX are not
        drained (the writer behind, or held): False when it is stopped meanwhile. A pass
        run by its caller (``collect --once``, a test) is drained after it: never waits."""
        if threading.current_thread() is self._thread:
            while self.out.qsize() >= QUEUE_MAX:
                if self._stop.wait(0.2):
                    return False
        self.out.put(batch)
        return True

    def _interval(self, old: Any) -> float:
        if old.state == "ok" and not old.attempts:
            return self.rcfg.resolve_interval_s
        return backoff_s(old.attempts, self.rcfg.resolve_interval_s)

    def _wanted(self, configured: list[str], known: Mapping[str, Any], now: float,
                batch: Batch) -> list[str]:
        used = dict(self.used)
        for key, t in known.items():
            if t.used_at:
                used[key] = max(used.get(key, 0.0), t.used_at)
        keep = self.rcfg.keep_unused_s

        def allowed(k: str) -> bool:
            return self.rcfg.allows(parse(k).registry, self._hosts)
        batch.forget = sorted(k for k, t in known.items() if k not in configured and (
            now - (used.get(k) or t.checked_at) > keep or not allowed(k)))
        # a reference the index holds and a job used within max_age_s (the gate judges
        # it now) is kept ahead of new ones, whatever their number: fresh tags named by
        # jobs must not push a tag in use out of max_refs
        # The others in turns by user (each one's most recent first): one user naming
        # many fresh tags takes one place a turn, not every place.
        in_use = self.rcfg.max_age_s
        others = sorted((k for k in used if k not in configured and k not in batch.forget
                         and now - used[k] <= keep), key=lambda k: -used[k])
        turn: dict[str, int] = {}
        rank: dict[str, int] = {}
        for k in others:
            if k in known and now - used[k] <= in_use:
                rank[k] = -1
            else:
                who = self.user_of.get(k, "")
                rank[k] = turn[who] = turn.get(who, -1) + 1
        others.sort(key=lambda k: rank[k])  # stable: by last use within a turn
        chosen = list(dict.fromkeys([*configured, *others]))[:self.rcfg.max_refs]
        self._used_now = used

        def order(k: str) -> tuple[int, float]:
            t = known.get(k)
            return (0, 0.0) if t is None else (1, t.checked_at)
        return sorted(chosen, key=order)

    def _cached(self, inv: Any, digest: str) -> dict[str, Any] | None:
        s = self._layers.get(digest)
        if s is not None:
            self._layers.move_to_end(digest)
            return s
        return inv.registry_layer(digest)

    def _keep(self, s: dict[str, Any], batch: Batch) -> None:
        batch.layers.append(s)
        self._layers[s["digest"]] = s
        # at most CACHE_LAYERS, and at most one image's bound of path bytes in all
        while len(self._layers) > CACHE_LAYERS or (
                len(self._layers) > 1 and sum(int(x.get("kept_bytes") or 0)
                                              for x in self._layers.values())
                > MAX_IMAGE_KEPT_BYTES):
            self._layers.popitem(last=False)

    def _client(self, key: str, creds: Credentials, timeout: float) -> Client:
        return Client(parse(key), deadline=time.monotonic() + timeout,
                      credentials=creds, insecure=self.rcfg.insecure,
                      ca_file=self.rcfg.ca_file, token_realms=self.rcfg.token_realms,
                      proxy=self.proxies)

    def _one(self, key: str, old: Any, configured: bool, read: set[str], creds: Credentials,
             inv: Any, batch: Batch) -> Resolved | None:
        """Resolve one reference (its tag in ``batch``); the resolution when its image
        is to be read, else None."""
        tag: dict[str, Any] = {"ref": key, "source": "config" if configured else "audit",
                               "used_at": self._used_now.get(key), "attempts": 0,
                               "retry_at": None}
        batch.tags.append(tag)
        client = self._client(key, creds, min(self.rcfg.timeout_s, RESOLVE_TIMEOUT_S))
        try:
            res = resolve(client, self.platform)
        except RegistryError as e:
            tag.update(state=e.state, error=e.cause, digest=None,
                       attempts=(old.attempts if old else 0) + 1)
            log.warning("registry: %s not resolved (%s): %s", key, e.state, e.cause)
            return None
        except Exception as e:  # a bug, or a shape nobody foresaw: this reference only
            self._internal(key, tag, old, e)
            return None
        finally:
            client.close()
        tag.update(state="ok", error=None, digest=res.digest, index_digest=res.index_digest)
        return None if res.digest in read else res

    def _internal(self, key: str, tag: dict[str, Any], old: Any, e: Exception) -> None:
        tag.update(state="invalid", error=f"internal error: {type(e).__name__}: "
                                          f"{str(e)[:300]}", digest=None,
                   attempts=(old.attempts if old else 0) + 1)
        log.error("registry: %s: internal error; tried again after a back-off", key,
                  exc_info=e)

    def _read(self, key: str, tag: dict[str, Any], old: Any, res: Resolved,
              creds: Credentials, read: set[str], inv: Any, batch: Batch) -> None:
        client = self._client(key, creds, self.rcfg.timeout_s)
        try:
            self._read_image(key, tag, old, client, res, read, inv, batch)
        except Exception as e:  # a bug, or a shape nobody foresaw: this reference only
            self._internal(key, tag, old, e)
            batch.images.clear()
            batch.layers.clear()
        finally:
            client.close()

    def _read_image(self, key: str, tag: dict[str, Any], old: Any, client: Client,
                    res: Resolved, read: set[str], inv: Any, batch: Batch) -> None:
        t0 = time.monotonic()
        try:
            record = read_image(client, self.platform, self.limits,
                                cached=lambda d: self._cached(inv, d),
                                store=lambda s: self._keep(s, batch), resolved=res,
                                stop=self._stop.is_set)
        except ImageStopped:  # the collector is stopping: nothing said of the tag
            log.info("registry: %s (%s) not read: the collector is stopping", key,
                     res.digest)
            return
        except (RegistryError, ImageTransient) as e:
            # the registry or the network, not the image: the tag has moved to this digest
            # (the gate calls it not read yet, never judges it by the old image), and it is
            # read again after a back-off
            state = e.state if isinstance(e, RegistryError) else (
                "invalid" if isinstance(e, ImageUnverified) else
                "timeout" if "time limit" in e.cause else "unreachable")
            tag.update(error=f"reading {res.digest} ({state}): {e.cause}",
                       attempts=(old.attempts if old else 0) + 1)
            log.warning("registry: %s (%s) not read (%s): %s", key, res.digest, state,
                        e.cause)
            return
        except ImageError as e:  # its content, verified: stored with the cause, read again
            # after the tag's back-off (a good read then replaces it)
            tag.update(attempts=(old.attempts if old else 0) + 1)
            batch.images.append({"digest": res.digest, "platform": self.platform,
                                 "error": e.cause})
            read.add(res.digest)
            log.warning("registry: %s (%s) unreadable: %s", key, res.digest, e.cause)
            return
        batch.images.append({"digest": res.digest, "platform": self.platform,
                             "record": record})
        read.add(res.digest)
        log.info("registry: %s read as %s in %.1fs (%d layers, %d new)", key, res.digest,
                 time.monotonic() - t0, len(record["image"]["layers"]),
                 sum(not x["cached"] for x in record["image"]["layers"]))


def _interleave(lists: list[list[str]]) -> list[str]:
    """The first of each list, then the second of each, ..."""
    out: list[str] = []
    for i in range(max(map(len, lists), default=0)):
        out += [x[i] for x in lists if i < len(x)]
    return out


def write_batches(inv: Any, batches: list[Batch]) -> int:
    """Write what the worker found (the collector's loop: the one writer); returns the
    tags written."""
    n = 0
    for b in batches:
        if b.tags or b.images or b.layers:
            inv.write_registry(b.tags, b.images, b.layers)
            n += len(b.tags)
        if b.forget or b.sweep:
            inv.forget_registry(b.forget)
    return n
