"""The image index: find the squashfs images under the admin's roots, scan the new and
changed ones within a time budget, and hand the results to the inventory's one writer
(the collector, :meth:`ncclguard.store.Inventory.write_images`).

An image is known by its path and identified by (inode, size, mtime_ns): an image that
is replaced or rewritten is scanned again; one whose identity did not change is not.
Symlinks are not followed (a user could point one anywhere), nor are directories deeper
than ``[images] max_depth`` searched. An image that cannot be read is stored with its
cause (``ncclguard images`` shows it; the gate calls a job using it "unknown").
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from inventoryd.images.fingerprint import scan_image
from inventoryd.images.squashfs import ImageError
from ncclguard.config import ImagesConfig
from ncclguard.store import Inventory

log = logging.getLogger(__name__)

SUFFIXES = (".sqsh", ".squashfs", ".sqfs")


@dataclass
class IndexResult:
    scanned: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    gone: list[str] = field(default_factory=list)
    left: int = 0  # changed images left for the next cycle (budget spent)
    seconds: float = 0.0


def find_images(cfg: ImagesConfig) -> Iterator[tuple[str, os.stat_result]]:
    """(path, stat) of every regular ``*.sqsh`` file under the roots, without following
    symlinks, at most ``max_depth`` levels down and ``max_images`` in all."""
    count = 0
    for root in cfg.roots:
        stack: list[tuple[str, int]] = [(root, 0)]
        while stack:
            d, depth = stack.pop()
            try:
                with os.scandir(d) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError as err:
                log.warning("images: cannot list %s: %s", d, err.strerror or err)
                continue
            for ent in reversed(entries):
                try:
                    st = ent.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    if depth < cfg.max_depth:
                        stack.append((ent.path, depth + 1))
                elif stat.S_ISREG(st.st_mode) and ent.name.endswith(SUFFIXES):
                    count += 1
                    if count > cfg.max_images:
                        log.warning("images: more than %d images under the roots; the rest "
                                    "are not indexed", cfg.max_images)
                        return
                    yield ent.path, st


def _passing(cause: str) -> bool:
    """A failure that says nothing about the image's content (unsquashfs missing, a time
    limit on a loaded machine, a signal): the image is scanned again at the next pass
    instead of staying unreadable until it changes."""
    return (cause.startswith("cannot run ") or cause.endswith("time limit reached")
            or "signal" in cause or "killed" in cause.lower())


def update_index(inv: Inventory, cfg: ImagesConfig, budget_s: float | None = None) -> IndexResult:
    """One pass: scan what changed (until the budget is spent), drop what is gone."""
    t0 = time.monotonic()
    budget = cfg.scan_budget_s if budget_s is None else budget_s
    res = IndexResult()
    known = inv.image_states()
    present: set[str] = set()
    rows: list[dict[str, Any]] = []
    for path, st in find_images(cfg):
        present.add(path)
        # the later of mtime and ctime: a user who can write the roots can set an image's
        # mtime back after changing it (touch -d), never its ctime
        changed_ns = max(st.st_mtime_ns, st.st_ctime_ns)
        ident = (st.st_ino, st.st_size, changed_ns)
        if known.get(path) == ident:
            continue
        if rows and time.monotonic() - t0 > budget:  # at least one per pass: progress
            res.left += 1
            continue
        row: dict[str, Any] = {"path": path, "inode": st.st_ino, "size": st.st_size,
                               "mtime_ns": changed_ns}
        try:
            row["record"] = scan_image(path, unsquashfs=cfg.unsquashfs, timeout_s=cfg.timeout_s,
                                       tmpdir=cfg.tmp_dir or None)
            res.scanned.append(path)
        except ImageError as e:
            row["error"] = e.cause
            res.failed[path] = e.cause
            log.warning("image %s not indexed: %s", path, e.cause)
            if _passing(e.cause):  # not about the image: try it again next pass
                row["mtime_ns"] = -1
        except OSError as e:
            row["error"] = f"cannot read: {e.strerror or e}"
            res.failed[path] = row["error"]
        except Exception as e:  # a bug on one image must not stop the index (nor the collector)
            row["error"] = f"internal error reading the image: {type(e).__name__}: {e}"
            res.failed[path] = row["error"]
            log.exception("image %s: internal error", path)
        rows.append(row)
    res.gone = sorted(set(known) - present)
    if rows or res.gone:
        inv.write_images(rows, res.gone)
    res.seconds = time.monotonic() - t0
    return res
