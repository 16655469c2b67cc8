"""The collector under load and when killed: 64 publishers (each its own real munged)
changing and heartbeating 200 times into one spool while a real collector process
ingests; a collector killed with SIGKILL inside a batch, then restarted."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO
from helpers.collector import as_nobody, snapshot
from helpers.fingerprints import fingerprint
from helpers.munge import MungeSet
from helpers.wait import wait_until

from ncclguard import config as configmod
from ncclguard import munge
from ncclguard.fingerprint.canonical import fingerprint_hash
from ncclguard.store import Inventory

PUBLISHERS = 64
ROUNDS = 200


def _fp(host: str, i: int) -> dict[str, Any]:
    """Round i of a node: even rounds change the fingerprint, odd ones heartbeat it."""
    return fingerprint(host, f"2.{i // 2}.0", plugin_abi=8)


def _publisher(host: str, spool_dir: str, sock: str) -> str:
    from inventoryd.node.publish import Publisher

    pub = Publisher(configmod.SpoolConfig(dir=spool_dir, munge_socket=sock), heartbeat_s=0)
    for i in range(ROUNDS):
        pub.publish(_fp(host, i))
    return fingerprint_hash(_fp(host, ROUNDS - 1))


def _toml(ms: MungeSet, d: Path, hosts: list[str], signer_of: Any, path: Path,
          batch_max: int = 2000) -> Path:
    lines = [
        "[spool]", f'dir = "{d}"', f'munge_socket = "{ms.controller.socket}"',
        "[collector]", f'publisher = "{os.getuid()}"', "scan_interval_s = 0.1",
        # 100 changes a node here: no change rate (the quota test is test_collector_bounds)
        f"batch_max = {batch_max}", "max_changes_per_hour = 0", "[collector.addresses]",
        *(f'{h} = ["{ms.addr(signer_of(h))}"]' for h in hosts),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _collector(cfg: Path, db: Path, log: Path) -> subprocess.Popen[bytes]:
    """The collector service in a process of its own; its log (one line per change, so
    thousands here) goes to ``log``: a pipe nobody drains would stall it."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("NCCLGUARD_DB", None)
    with open(log, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "inventoryd.main", "collect", "--config", str(cfg),
             "--db", str(db)], cwd=REPO, env=env, stderr=f,
        )


@pytest.fixture
def spool_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ncclguard-load-"))
    os.chmod(d, 0o755)
    (d / "spool").mkdir(mode=0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d)


def test_64_publishers_200_rounds_the_collector_ends_with_every_last_record(
    mungeds: MungeSet, spool_dir: Path
) -> None:
    ms, d, db = mungeds, spool_dir / "spool", spool_dir / "inventory.db"
    hosts = [f"n{i}" for i in range(1, PUBLISHERS + 1)]
    socks = {h: str(ms.node(h).socket) for h in hosts}
    cfg = _toml(ms, d, hosts, lambda h: h, spool_dir / "collector.toml")
    log = spool_dir / "collector.log"
    collector = _collector(cfg, db, log)
    try:
        ctx = mp.get_context("fork")
        with ctx.Pool(PUBLISHERS) as pool:
            last = dict(zip(hosts, pool.starmap(
                _publisher, [(h, str(d), socks[h]) for h in hosts]), strict=True))
        # the last record of each node: the heartbeat of its last fingerprint
        probe = str(ms.extra("probe", "127.42.250.1").socket)
        signed = {h: float(munge.decode((d / f"{h}.rec").read_bytes().strip(),
                                        socket_path=probe).encoded_at) for h in hosts}
        want = {h: (last[h], signed[h]) for h in hosts}

        def stored() -> dict[str, tuple[str, float]]:
            return snapshot(db) if db.exists() else {}

        wait_until(lambda: stored() == want, 120, "every node's last record in the inventory",
                   interval=0.5, detail=lambda: "not (yet) as published: " + ", ".join(
                       sorted(h for h in want if stored().get(h) != want[h])))
        collector.send_signal(signal.SIGTERM)
        assert collector.wait(timeout=30) == 0
    finally:
        if collector.poll() is None:
            collector.kill()
            collector.wait(timeout=30)
    err = log.read_text()
    assert "rejected" not in err and "ERROR" not in err, err[-3000:]
    assert sorted(p.name for p in d.iterdir()) == sorted(f"{h}.rec" for h in hosts)
    with Inventory(db, readonly=True) as inv:
        assert inv.integrity_check() == "ok"
        assert {r["host"] for r in inv.history()} == set(hosts)


# The collector in a process of its own: "kill" dies just before the COMMIT of its second
# batch; "run" scans until killed; "once" scans once. 1,200 nodes sign from the one
# address of n1's munged here (1,200 munged would prove nothing more about a crash), so
# the map is installed without the guard against a shared address.
_DRIVER = r"""
import os, signal, sys
from pathlib import Path
from inventoryd.controller import addresses as addressmod, collector
from ncclguard.policy import load_config
cfg = load_config(sys.argv[1])
addresses = addressmod.Addresses(cfg.collector)
addresses._map = {n: frozenset(a) for n, a in cfg.collector.addresses.items()}
c = collector.Collector(cfg, db=Path(sys.argv[2]), addresses=addresses)
batches = []
def before_commit(conn):
    batches.append(1)
    if sys.argv[3] == "kill" and len(batches) == 2:  # the second batch written, uncommitted
        os.kill(os.getpid(), signal.SIGKILL)
c.inv._before_commit = before_commit
while True:
    res = c.scan()
    print(len(res.accepted), len(res.rejected), res.deferred, flush=True)
    if sys.argv[3] != "run":
        break
c.close()
"""


def test_a_collector_killed_mid_batch_loses_nothing_in_the_spool(
    mungeds: MungeSet, spool_dir: Path
) -> None:
    ms, d, db = mungeds, spool_dir / "spool", spool_dir / "inventory.db"
    hosts = [f"h{i:04d}" for i in range(1, 1201)]
    sock = str(ms.node("n1").socket)  # these nodes all sign from n1's address (the map)
    from inventoryd.node.publish import Publisher

    for h in hosts:
        Publisher(configmod.SpoolConfig(dir=str(d), munge_socket=sock), 300).publish(
            fingerprint(h, "2.18.3" if h.endswith("7") else "2.21.5", plugin_abi=8))
    cfg = _toml(ms, d, hosts, lambda h: "n1", spool_dir / "collector.toml", batch_max=300)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    driver = [sys.executable, "-c", _DRIVER, str(cfg), str(db)]
    # 1. killed inside its second transaction, just before COMMIT
    r = subprocess.run([*driver, "kill"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert len(snapshot(db)) == 300  # the first batch only
    assert Path(f"{db}-wal").exists()  # left behind by the kill
    r = as_nobody(db, "read")  # readers still read what was committed
    assert r.returncode == 0, r.stderr
    # 2. a running collector killed at some moment of its ingest
    collector = subprocess.Popen([*driver, "run"], cwd=REPO, env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(snapshot(db)) >= 600, 60, "600 nodes stored before the kill",
                   interval=0.02)
        collector.kill()
        collector.wait(timeout=30)
    finally:
        if collector.poll() is None:
            collector.kill()
            collector.wait(timeout=30)
    assert len(snapshot(db)) >= 600  # (if it finished before the kill, step 1 still was one)
    # 3. restarted: every record still in the spool is in the inventory
    r = subprocess.run([*driver, "once"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    accepted, rejected, deferred = map(int, r.stdout.split())
    assert accepted > 0 and rejected == 0 and deferred == 0, r.stdout + r.stderr
    got = snapshot(db)
    assert {h: v[0] for h, v in got.items()} == {
        h: fingerprint_hash(fingerprint(h, "2.18.3" if h.endswith("7") else "2.21.5", plugin_abi=8))
        for h in hosts
    }
    with Inventory(db, readonly=True) as inv:
        assert inv.integrity_check() == "ok"
        assert len(inv.publishers()) == len(hosts)
