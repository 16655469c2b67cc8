"""Publishing a node's record: sign the fingerprint with the local munged, write it to the
spool atomically (:mod:`ncclguard.spool`). The node never opens the inventory.

:class:`Publisher` keeps what it last wrote, so that ``run`` publishes only when the
fingerprint changed, when ``heartbeat_s`` has passed, or when its file is no longer the
one it wrote (deleted, or replaced by someone else: the collector rejected that, and the
node's own record is put back at once).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ncclguard import munge, spool
from ncclguard.config import SpoolConfig

__all__ = ["PublishError", "Publisher", "publish_state"]

LEFTOVER_S = 3600.0  # a temporary file of ours older than this is a dead write's


def publish_state(fp: Mapping[str, Any], loaded: Mapping[str, Any] | None = None) -> str:
    """What makes a publish due: the stack (the fingerprint hash), the probes' errors,
    which the hash leaves out but the inventory shows, and the steps of what running jobs
    loaded (not when they were scanned)."""
    import hashlib

    from ncclguard.fingerprint.canonical import canonical_json, errors_hash, fingerprint_hash

    out = fingerprint_hash(dict(fp)) + errors_hash(dict(fp))
    if loaded is not None:
        out += hashlib.sha256(canonical_json(loaded.get("steps")).encode()).hexdigest()
    return out


class PublishError(Exception):
    """The record could not be published; ``kind`` is "spool" or "munge"."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        super().__init__(message)


class Publisher:
    def __init__(self, config: SpoolConfig, heartbeat_s: float) -> None:
        self.config = config
        self.heartbeat_s = heartbeat_s
        self.last_hash: str | None = None
        self.last_at: float | None = None
        self.written: tuple[int, int, int] | None = None  # (ino, size, mtime_ns) we wrote
        self.cleaned = False
        #: why the last record went without what running jobs loaded, or None
        self.loaded_left_out: str | None = None

    @property
    def dir(self) -> Path:
        return self.config.spool_path()

    def _in_place(self, host: str) -> bool:
        try:
            st = os.stat(self.dir / spool.record_name(host), follow_symlinks=False)
        except OSError:
            return False
        return (st.st_ino, st.st_size, st.st_mtime_ns) == self.written

    def _sign(self, data: bytes) -> bytes:
        try:
            return munge.encode(
                data, socket_path=self.config.munge_socket or None, ttl=self.config.record_ttl_s
            )
        except munge.MungeError as e:
            raise PublishError("munge", str(e)) from None

    def due(self, fp: Mapping[str, Any], now: float,
            loaded: Mapping[str, Any] | None = None) -> bool:
        from ncclguard.fingerprint.model import hostname

        if self.last_at is None or publish_state(fp, loaded) != self.last_hash:
            return True
        if now - self.last_at >= self.heartbeat_s or now < self.last_at:
            return True
        return not self._in_place(hostname(fp))

    def publish(self, fp: Mapping[str, Any], now: float | None = None,
                loaded: Mapping[str, Any] | None = None) -> Path:
        """Sign and write ``fp`` now (with ``loaded``: what its running job steps loaded).
        :class:`PublishError` when it cannot be done; ``ValueError`` for a fingerprint
        without a usable host name."""
        from ncclguard.fingerprint.model import hostname

        now = time.time() if now is None else now
        record = dict(fp)
        host = hostname(record)
        d = self.dir
        try:
            spool.check_dir(d, create=True)
        except spool.SpoolError as e:
            raise PublishError("spool", str(e)) from None
        self.loaded_left_out = None
        cred = None
        if loaded is not None:
            # what running jobs loaded never costs the node its fingerprint: a record that
            # would be too large with it (or that munged refuses) is published without it
            data = spool.payload(record, loaded=dict(loaded))
            try:
                cred = self._sign(data)
            except PublishError as e:
                self.loaded_left_out = f"munged refused the record with it: {e}"
            else:
                if len(cred) + 1 > self.config.max_record_bytes:
                    self.loaded_left_out = (f"the record with it is {len(cred) + 1} bytes, over "
                                            f"[spool] max_record_bytes "
                                            f"({self.config.max_record_bytes})")
                    cred = None
        if cred is None:
            cred = self._sign(spool.payload(record))
        try:
            if not self.cleaned:
                spool.remove_leftovers(d, host, LEFTOVER_S, now)
                self.cleaned = True
            spool.clear_the_way(d, host)
            path = spool.write(d, host, cred + b"\n")
            st = os.stat(path, follow_symlinks=False)
        except OSError as e:
            raise PublishError("spool", f"cannot write {d / spool.record_name(host)}: "
                               f"{e.strerror or e}") from None
        self.written = (st.st_ino, st.st_size, st.st_mtime_ns)
        self.last_hash = publish_state(record, loaded)
        self.last_at = now
        return path
