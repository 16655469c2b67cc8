"""The image index: find the squashfs images under the admin's roots, scan the new and
changed ones within a time budget, and hand the results to the inventory's one writer
(the collector, :meth:`ncclguard.store.Inventory.write_images`).

An image is known by its path and identified by (inode, size, ctime: ``image_identity``,
which no user can set): an image that is replaced or rewritten is scanned again; one whose
identity did not change is not.
Symlinks are not followed (a user could point one anywhere), neither by the walk nor when
an image is opened to be read (from the root, ``O_NOFOLLOW`` at each component, checked
against the walk's identity: :func:`.squashfs.open_image`), nor are directories deeper
than ``[images] max_depth`` searched. An image that cannot be read is stored with its
cause (``ncclguard images`` shows it; the gate calls a job using it "unknown").
"""

from __future__ import annotations

import heapq
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inventoryd.controller.images.fingerprint import scan_image
from inventoryd.controller.images.squashfs import ImageError, open_image
from inventoryd.controller.images.tree import ImageStopped
from ncclguard.config import ImagesConfig
from ncclguard.store import Inventory
from ncclguard.store.images import image_identity

log = logging.getLogger("ncclguard.collector.images")  # the collector's log, escaped

SUFFIXES = (".sqsh", ".squashfs", ".sqfs")
MIN_SLICE_S = 1.0  # no image is started with less of the pass's budget left
MAX_BACKOFF_S = 86400.0  # an image failing again and again is still tried once a day


@dataclass
class IndexResult:
    scanned: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    gone: list[str] = field(default_factory=list)
    left: int = 0  # changed images left for the next cycle (budget spent)
    seconds: float = 0.0


#: entries (files, directories, anything) looked at under the roots in one walk, per
#: image that may be indexed
SEEN_PER_IMAGE = 10
WARN_CUT = 5  # directories not read whole named in the log, per walk (then a count)


@dataclass
class _Share:
    """Entries shared in turn among ``items``: the directories at ``depth`` (each a path),
    or groups of them (one file owner's subdirectories). Each item is given what is left
    over the items still to go; what it does not use is left for the next."""

    items: list[str | list[str]]
    depth: int
    given: int
    left: int
    next: int = 0


def find_images(cfg: ImagesConfig) -> tuple[list[tuple[str, os.stat_result]], bool]:
    """``(images, complete)``: (path, stat) of every regular ``*.sqsh`` file under the
    roots, without following symlinks, at most ``max_depth`` levels down, looking at no
    more than ``SEEN_PER_IMAGE * max_images`` directory entries of any kind
    (``complete``: every directory reached was read whole within that).

    The walk's entries are shared, not spent first come first served (issue 48): the
    roots share them in turn, each given what is left over the roots still to go, and
    what one does not use goes to the next; a directory lists at most what it was given
    less ``max_images`` (or half of it, when that is less), read lazily (never listed
    whole: a directory of 1M hard links with long names cost 835 MB) and kept in name
    order; what is left of its share is shared the same way among the subdirectories it
    listed, by file owner first (each owner's subdirectories one share, the owners in
    turn by the name of their first), then among one owner's subdirectories in name
    order. So each of N users' directories under a root gets at least about 1/N of what
    the root's listing left, whatever the others hold (a deep tree of many directories
    used up the whole walk before: another user's directory beside it was never listed).

    Still not fair: one directory shared by many users (a root that anyone may write,
    with everyone's images in it, flat) is read no further than its share, in the order
    the file system gives, and cannot be made fair without listing it whole: a user who
    fills it with names can keep the images the listing does not reach from being
    found. Within one user's directories, any layout is that user's own concern."""
    found: list[tuple[str, os.stat_result]] = []
    total = SEEN_PER_IMAGE * cfg.max_images
    cut: list[str] = []  # directories not read whole
    unlisted = 0  # directories not listed at all: nothing left of their share
    shares = [_Share(list(cfg.roots), 0, total, total)]
    while shares:
        top = shares[-1]
        if top.next == len(top.items):
            shares.pop()
            if shares:  # what the share used is its parent's no more
                shares[-1].left -= top.given - top.left
            continue
        item = top.items[top.next]
        give = top.left // (len(top.items) - top.next)
        top.next += 1
        if isinstance(item, list):
            shares.append(_Share(list(item), top.depth, give, give))
            continue
        if give <= 0:
            unlisted += 1
            continue
        used, subdirs = _list_dir(item, top.depth, give, cfg, found, cut)
        top.left -= used
        if subdirs:
            shares.append(_Share(_by_owner(subdirs), top.depth + 1, give - used, give - used))
    complete = not cut and not unlisted
    if not complete:
        log.warning("images: more than %d entries under the roots: %d directories not read "
                    "whole, %d not listed; the images there may be missed", total, len(cut),
                    unlisted)
    return found, complete


def _list_dir(d: str, depth: int, give: int, cfg: ImagesConfig,
              found: list[tuple[str, os.stat_result]],
              cut: list[str]) -> tuple[int, list[tuple[str, int]]]:
    """``(entries pulled, subdirectories to walk (path, owner))`` of one directory given
    ``give`` entries (at least 1): at most ``give`` pulled, the last of them only to learn
    that there are more; its images are added to ``found``, in name order."""
    keep = give - max(1, min(give // 2, cfg.max_images))
    entries: list[os.DirEntry[str]] = []
    used = 0
    try:
        with os.scandir(d) as it:
            for ent in it:
                used += 1
                if len(entries) >= keep:
                    cut.append(d)
                    if len(cut) <= WARN_CUT:
                        log.warning("images: more than %d entries in %s: the rest of it "
                                    "not looked at", keep, d)
                    break
                entries.append(ent)
    except OSError as err:
        log.warning("images: cannot list %s: %s", d, err.strerror or err)
        return used, []
    entries.sort(key=lambda e: e.name)
    subdirs: list[tuple[str, int]] = []
    for ent in entries:
        try:
            st = ent.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            if depth < cfg.max_depth:
                subdirs.append((ent.path, st.st_uid))
        elif stat.S_ISREG(st.st_mode) and ent.name.endswith(SUFFIXES):
            found.append((ent.path, st))
    return used, subdirs


def _by_owner(subdirs: list[tuple[str, int]]) -> list[str | list[str]]:
    """The items one directory's share is split among: its subdirectories, or, when they
    have more than one file owner, each owner's subdirectories as one item (the owners in
    the name order of their first): a user who makes many directories beside another's
    splits only their own part."""
    groups: dict[int, list[str]] = {}
    for path, uid in subdirs:
        groups.setdefault(uid, []).append(path)
    if len(groups) == 1:
        return [path for path, _ in subdirs]
    return [paths[0] if len(paths) == 1 else paths for paths in groups.values()]


def _passing(cause: str) -> bool:
    """A failure that says nothing about the image's content (unsquashfs missing, a time
    limit on a loaded machine, a signal): the image is tried again after a back-off
    instead of staying unreadable until it changes."""
    return (cause.startswith("cannot run ") or cause.endswith("time limit reached")
            or cause.endswith("read again at the next pass")
            or "signal" in cause or "killed" in cause.lower())


def backoff_s(attempts: int, cfg: ImagesConfig) -> float:
    """How long after its ``attempts``-th failure in a row an image waits: the next pass
    after the first, then ``scan_interval_s`` doubling, at most :data:`MAX_BACKOFF_S`."""
    if attempts <= 1:
        return 0.0
    return min(cfg.scan_interval_s * 2.0 ** (attempts - 2), MAX_BACKOFF_S)


def _order(todo: list[tuple[str, os.stat_result, int]]) -> list[tuple[str, os.stat_result, int]]:
    """The order new images are let into the index in, when there is not room for all:
    images never failed first, then by failures in a row; among equals, one image of
    each owner in turn (a user with many images waits behind everyone else's), then by
    path. (The order images are scanned in is :class:`_Turns`'.)"""
    rank: dict[int, int] = {}
    keyed = []
    for path, st, attempts in sorted(todo, key=lambda t: (t[2], t[0])):
        n = rank.get(st.st_uid, 0)
        rank[st.st_uid] = n + 1
        keyed.append(((attempts, n, path), (path, st, attempts)))
    return [item for _, item in sorted(keyed, key=lambda kv: kv[0])]


def _shares(owners: list[int], total: int) -> dict[int, int]:
    """How many images each file owner may have in the index: a max-min fair share of
    ``total`` over the owners of the images found (an owner needing less than an equal
    share leaves the rest to the others). One user filling ``max_images`` first kept
    every later user's image out, for good (issue 48)."""
    demand: dict[int, int] = {}
    for uid in owners:
        demand[uid] = demand.get(uid, 0) + 1
    out: dict[int, int] = {}
    left = total
    order = sorted(demand, key=lambda u: (demand[u], u))
    for i, uid in enumerate(order):
        out[uid] = min(demand[uid], left // (len(order) - i))
        left -= out[uid]
    return out


#: how long the time an owner's images took to scan counts against the owner: halved
#: every hour (the collector's default pass comes every 5 minutes)
OWNER_HALF_LIFE_S = 3600.0


class OwnerTime:
    """The seconds each file owner's images took to scan, across passes, halved every
    ``half_life_s``: the caller keeps one (the collector, for its life, reloads
    included) and hands it to every :func:`update_index`, which scans the images of the
    owner who used least first (:class:`_Turns`).

    An image that is new at every pass (renamed, or copied under a new name) has no
    failures to count, so only its owner's time can put it behind the others'. Kept in
    memory only: after a restart of the collector every owner starts at 0."""

    def __init__(self, half_life_s: float = OWNER_HALF_LIFE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.half_life_s = half_life_s
        self.clock = clock
        self._spent: dict[int, float] = {}
        self._at = clock()

    def spent(self) -> dict[int, float]:
        """Each owner's decayed seconds now (owners under a millisecond left out)."""
        now = self.clock()
        if now > self._at:
            f = 0.5 ** ((now - self._at) / self.half_life_s)
            self._spent = {u: s * f for u, s in self._spent.items() if s * f >= 0.001}
            self._at = now
        return dict(self._spent)

    def charge(self, uid: int, seconds: float) -> None:
        self.spent()  # decayed to now first
        self._spent[uid] = self._spent.get(uid, 0.0) + max(seconds, 0.0)


class _Turns:
    """The images of a pass, to scan one at a time: the next is the first image (fewest
    failures in a row, then by path) of the file owner whose images took least time,
    counting the earlier passes' (``spent``: :class:`OwnerTime`) and this one's as it
    goes (ties: the image with fewer failures, then by path). Owners who used nothing
    take turns; a user whose image took the whole of a pass goes after every other
    user's images until that time has decayed below theirs."""

    def __init__(self, todo: list[tuple[str, os.stat_result, int]],
                 spent: dict[int, float]) -> None:
        self.spent = spent
        self.queues: dict[int, list[tuple[str, os.stat_result, int]]] = {}
        for item in sorted(todo, key=lambda t: (t[2], t[0]), reverse=True):
            self.queues.setdefault(item[1].st_uid, []).append(item)  # the first last
        self.heap = [self._key(uid) for uid in self.queues]
        heapq.heapify(self.heap)
        self.size = len(todo)

    def _key(self, uid: int) -> tuple[float, int, str, int]:
        path, _, attempts = self.queues[uid][-1]
        return (self.spent.get(uid, 0.0), attempts, path, uid)

    def next(self) -> tuple[str, os.stat_result, int] | None:
        """The next image (None: no more); its owner is charged (:meth:`charge`) before
        the next is asked for."""
        if not self.heap:
            return None
        uid = heapq.heappop(self.heap)[3]
        self.size -= 1
        return self.queues[uid].pop()

    def charge(self, uid: int, seconds: float) -> None:
        self.spent[uid] = self.spent.get(uid, 0.0) + max(seconds, 0.0)
        if self.queues[uid]:
            heapq.heappush(self.heap, self._key(uid))


def update_index(inv: Inventory, cfg: ImagesConfig, budget_s: float | None = None,
                 now: float | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 owners: OwnerTime | None = None) -> IndexResult:
    """One pass: scan what changed and what is due again, fairly, within the budget, and
    drop what is gone.

    The images are scanned in :class:`_Turns`' order: the owner whose images took least
    time so far first (``owners``, kept by the caller across passes; without it, this
    pass's time only), and each owner's images by failures in a row, then by path. The
    pass never runs past ``scan_budget_s``: each image may take what is left of it (at
    most ``timeout_s``), and none is started with less than :data:`MIN_SLICE_S` left,
    except the first of a pass, which may take the whole budget. Every image's time,
    failed or cut short, is charged to its owner: a user's image that always reaches its
    limit, renamed before every pass (new each time, so no failure counted), is first
    only while its owner has used less time than the others, not every pass as before
    (issue 48). An image cut short by the budget rather than by its own ``timeout_s`` is
    left for the next pass, not counted as a failure. ``should_stop`` (the collector's
    SIGTERM) is checked in every loop of the image being read: once it says stop, the
    read is given up within about a second, nothing is stored for that image, and the
    pass ends with what it wrote."""
    t0 = time.monotonic()
    wall = time.time() if now is None else now
    budget = cfg.scan_budget_s if budget_s is None else budget_s
    res = IndexResult()
    known = inv.image_states()
    todo: list[tuple[str, os.stat_result, int]] = []
    found, complete = find_images(cfg)
    present = {path for path, _ in found}
    if not complete:
        # what a walk cut short did not reach is looked at by its path: one replaced
        # meanwhile is read again, never judged by the old file's record (issue 48)
        for path in sorted(known.keys() - present):
            try:
                st = os.lstat(path)
            except OSError:
                continue  # gone, or not reachable: decided below
            if stat.S_ISREG(st.st_mode) and path.endswith(SUFFIXES) and any(
                    path.startswith(r.rstrip("/") + "/") for r in cfg.roots):
                found.append((path, st))
                present.add(path)
    # at most max_images in the index: images already in it are kept (and read again
    # when they change) within their owner's share; new ones fill the room left, one
    # file owner's at a time, each owner up to its share
    new = [(p, st) for p, st in found if p not in known]
    room = cfg.max_images - len(present & known.keys())
    evicted: list[str] = []
    if len(new) > room:
        shares = _shares([st.st_uid for _, st in found], cfg.max_images)
        held: dict[int, int] = {}
        for p, st in sorted(found, key=lambda f: f[0]):
            if p in known:
                held[st.st_uid] = held.get(st.st_uid, 0) + 1
                if held[st.st_uid] > shares[st.st_uid]:
                    evicted.append(p)  # over its owner's share: room for one waiting
        room += len(evicted)
        log.warning("images: %d new images and room for %d under max_images (%d): one file "
                    "owner's at a time in turn, each up to its share, the rest not indexed; "
                    "%d indexed images over their owner's share dropped", len(new),
                    max(room, 0), cfg.max_images, len(evicted))
        admitted: set[str] = set()
        for p, st, _ in _order([(p, st, 0) for p, st in new]):
            if len(admitted) >= room:
                break
            if held.get(st.st_uid, 0) < shares[st.st_uid]:
                held[st.st_uid] = held.get(st.st_uid, 0) + 1
                admitted.add(p)
        out = set(evicted)
        found = [(p, st) for p, st in found
                 if (p in known and p not in out) or p in admitted]
    for path, st in found:
        ident = image_identity(st)  # the gate compares the same
        old = known.get(path)
        if old is not None and old.ident == ident and (
                old.retry_at is None or old.retry_at > wall):
            continue  # read as it is, or failed for its content, or not due again yet
        todo.append((path, st, old.attempts if old is not None else 0))
    rows: list[dict[str, Any]] = []
    owners = OwnerTime() if owners is None else owners
    turns = _Turns(todo, owners.spent())
    while (item := turns.next()) is not None:
        path, st, attempts = item
        left = budget - (time.monotonic() - t0)
        first = not rows
        if (should_stop is not None and should_stop()) or (not first and left < MIN_SLICE_S):
            res.left += 1 + turns.size  # the rest: the next pass
            break
        slice_s = cfg.timeout_s if first and budget <= 0 else min(cfg.timeout_s, max(left, 0.0))
        # the first image of a pass had the whole budget: its time limit is a failure
        t = time.monotonic()
        row = _scan_one(path, st, attempts, slice_s, cfg, res, can_defer=not first,
                        stop=should_stop)
        took = time.monotonic() - t
        owners.charge(st.st_uid, took)
        turns.charge(st.st_uid, took)
        if row is None:  # cut short by the budget: the next pass
            res.left += 1
            continue
        if row.get("error") is not None and row["retry_at"] is not None:
            row["retry_at"] = wall + backoff_s(row["attempts"], cfg)
        rows.append(row)
    # gone: not found; when the walk stopped short, only what is really no longer there
    res.gone = sorted([*(p for p in set(known) - present
                         if complete or not os.path.lexists(p)), *evicted])
    if rows or res.gone:
        inv.write_images(rows, res.gone)
    res.seconds = time.monotonic() - t0
    return res


def _scan_one(path: str, st: os.stat_result, attempts: int, slice_s: float,
              cfg: ImagesConfig, res: IndexResult, *, can_defer: bool,
              stop: Callable[[], bool] | None = None) -> dict[str, Any] | None:
    """The row of one image scanned within ``slice_s``; None (``can_defer``) when it ran
    out of a slice shorter than its own ``timeout_s``: what was left of the pass's
    budget, not the image, was short."""
    row: dict[str, Any] = {"path": path, "inode": st.st_ino, "size": st.st_size,
                           "mtime_ns": image_identity(st)[2],
                           "attempts": attempts + 1, "retry_at": None}
    root = next((r for r in cfg.roots if path.startswith(r.rstrip("/") + "/")), None)
    fd = None
    try:
        if root is None:
            raise ImageError(path, "not under any of [images] roots")
        # opened from the root without following a symlink, and checked to be the file
        # the walk saw: a directory swapped for a link to a decoy is refused (issue 48)
        fd = open_image(root, path, st)
        row["record"] = scan_image(path, unsquashfs=cfg.unsquashfs, timeout_s=slice_s,
                                   tmpdir=cfg.tmp_dir or None,
                                   max_read_bytes=cfg.max_read_bytes, stop=stop, fd=fd)
        row["attempts"] = 0
        res.scanned.append(path)
        return row
    except ImageStopped:
        return None  # the collector is stopping: read again after its restart
    except ImageError as e:
        if can_defer and e.cause.endswith("time limit reached") and slice_s < cfg.timeout_s:
            return None
        row["error"] = e.cause
        if _passing(e.cause):  # not about the image: tried again after a back-off
            row["retry_at"] = 0.0
    except OSError as e:
        row["error"] = f"cannot read: {e.strerror or e}"
    except Exception as e:  # a bug on one image must not stop the index (nor the collector)
        row["error"] = f"internal error reading the image: {type(e).__name__}: {e}"
        log.exception("image %s: internal error", path)
    finally:
        if fd is not None:
            os.close(fd)
    res.failed[path] = row["error"]
    log.warning("image %s not indexed (failure %d in a row): %s", path, row["attempts"],
                row["error"])
    return row
