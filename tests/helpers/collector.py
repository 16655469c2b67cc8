"""What the collector's tests share (a plugin of tests/conftest.py): a spool and an
inventory path beside the real munged daemons (``collector_env``), the collector's config
for them, a node's signed record, and reading the inventory back, also as another user."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from helpers import REPO
from helpers.fingerprints import fingerprint
from helpers.munge import MungeSet

if TYPE_CHECKING:
    from ncclguard import config as configmod

# A plugin is loaded by every session: what it imports from the product is imported where
# it is used, so that a module broken by work under way fails the tests that use it, not
# every test.

NODES = ("n1", "n2", "n3", "n4")


@pytest.fixture
def collector_env(tmp_path: Path, mungeds: MungeSet) -> Iterator[tuple[MungeSet, Path, Path]]:
    """The munged daemons, a spool directory (0755) and an inventory path (not created)."""
    d = tmp_path / "spool"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    yield mungeds, d, tmp_path / "inventory.db"


def config(ms: MungeSet, d: Path, *, nodes: tuple[str, ...] = NODES, **spool_kw: Any
           ) -> configmod.Config:
    """The collector's config: spool ``d``, this uid publishes, each node at its address."""
    from ncclguard import config as configmod

    return configmod.from_dict({
        "spool": {"dir": str(d), "munge_socket": str(ms.controller.socket), **spool_kw},
        "collector": {
            "publisher": str(os.getuid()),
            "addresses": {n: [ms.addr(n)] for n in nodes},
        },
    })


def sign(ms: MungeSet, signer: str, payload: bytes, ttl: int | None = None) -> bytes:
    """A credential from node ``signer``'s own munged."""
    from ncclguard import munge

    return munge.encode(payload, socket_path=str(ms.node(signer).socket), ttl=ttl)


def publish(ms: MungeSet, d: Path, host: str, fp: dict | None = None, *,
            signer: str | None = None, file: str | None = None) -> bytes:
    """What ``host``'s publisher writes (or, with ``signer``/``file``, a forgery); the
    fingerprint is ``fingerprint(host, plugin_abi=8)`` unless given."""
    from ncclguard import spool

    fp = fp or fingerprint(host, plugin_abi=8)
    cred = sign(ms, signer or host, spool.payload(fp))
    (d / (file or f"{host}.rec")).write_bytes(cred + b"\n")
    return cred


def snapshot(db: Path) -> dict[str, tuple[str, float]]:
    """Each stored node's (fingerprint hash, last heartbeat)."""
    from ncclguard.store import Inventory

    with Inventory(db, readonly=True) as inv:
        return {h: (r.fp_hash, r.last_heartbeat) for h, r in inv.load(inv.hosts()).items()
                if r is not None}


# A process of its own that drops to uid 65534 for good before it opens the file (an
# in-process seteuid would share SQLite's descriptors of the file with the collector).
_AS_NOBODY = r"""
import os, sys
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory
import sqlite3, json, contextlib, time, urllib.parse
from ncclguard.store.schema import record_key
record_key(1, "")  # its lazy import, while this Python (under /root here) is readable
os.setgroups([]); os.setgid(65534); os.setuid(65534)
if sys.argv[2] == "read":
    with Inventory(sys.argv[1], readonly=True, values=GATE_VALUES) as inv:
        got = inv.load_values(["n1", "n2"])
        print(sorted(h for h, v in got.items() if v is not None))
else:
    c = sqlite3.connect(f"file:{sys.argv[1]}?mode=rw", uri=True)
    c.execute("DELETE FROM nodes")
    c.commit()
"""


def as_nobody(db: Path, what: str) -> subprocess.CompletedProcess[str]:
    """``what`` (``read``: n1's and n2's gate values; ``write``: delete every node) done
    by uid 65534 on the inventory ``db``."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": "/nonexistent"}
    return subprocess.run([sys.executable, "-c", _AS_NOBODY, str(db), what], env=env,
                          capture_output=True, text=True, timeout=60, cwd="/")
