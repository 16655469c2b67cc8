"""The metrics endpoint cannot hurt the collector (issue 25): a real collector process
with its endpoint on loopback, a real client process holding 2,000 idle and 200 slow
connections (half send a request a byte at a time, half send one and never read the
answer). A record change still reaches the inventory within 2 scans; the collector's
threads and descriptors (``/proc/<pid>/task``, ``/proc/<pid>/fd``) stay bounded; a
scrape is still answered.

Before: prometheus_client's server took a thread per connection with no timeout: 1,021
idle connections gave the collector 1,017 threads and ``Too many open files``, and it
ingested nothing. Bounded in count (2,200 connections, loopback only) and time (the
client gives up after LOAD_S)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from helpers import REPO
from helpers.collector import publish
from helpers.exporter import value
from helpers.fingerprints import fingerprint
from helpers.load import CLIENT, IDLE, SLOW
from helpers.munge import MungeSet
from helpers.wait import wait_until

from ncclguard.store import Inventory

LOAD_S = 90  # the client holds its connections at most this long
MAX_CONNECTIONS = 64
THREADS_MAX = 8  # the main loop, the metrics thread, and what Python and libraries start
FDS_MAX = MAX_CONNECTIONS + 48  # the connections, the inventory, munge, logs, the listener


def _count(pid: int, what: str) -> int:
    return len(os.listdir(f"/proc/{pid}/{what}"))


def _scans(textfile: Path) -> float:
    try:
        return value(textfile.read_text(), "ncclguard_collector_scans_total") or 0.0
    except OSError:
        return 0.0


def test_2000_idle_and_200_slow_connections_do_not_delay_ingestion(
        mungeds: MungeSet, tmp_path: Path) -> None:
    ms = mungeds
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o755)
    os.chmod(spool, 0o755)
    texts = tmp_path / "textfile"
    texts.mkdir()
    db = tmp_path / "inventory.db"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hosts = ("n1", "n2", "n3", "n4")
    conf = tmp_path / "collector.toml"
    conf.write_text("\n".join([
        "[spool]", f'dir = "{spool}"', f'munge_socket = "{ms.controller.socket}"',
        "[collector]", f'publisher = "{os.getuid()}"', "scan_interval_s = 1.0",
        f"metrics_port = {port}", f"metrics_max_connections = {MAX_CONNECTIONS}",
        "metrics_timeout_s = 5.0", f'textfile_dir = "{texts}"', "[collector.addresses]",
        *(f'{h} = ["{ms.addr(h)}"]' for h in hosts),
        "[gate]", f'audit_log = "{tmp_path / "audit.jsonl"}"']) + "\n")
    for h in hosts:
        publish(ms, spool, h)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("NCCLGUARD_DB", None)
    log = open(tmp_path / "collector.log", "wb")  # noqa: SIM115 - closed below
    collector = subprocess.Popen(
        [sys.executable, "-m", "inventoryd.main", "collect", "--config", str(conf), "--db",
         str(db)], cwd=REPO, env=env, stderr=log)
    textfile = texts / "ncclguard-collector.prom"
    client = None
    try:
        wait_until(lambda: _scans(textfile) >= 2, 60, "the collector's second scan",
                   interval=0.1, detail=(tmp_path / "collector.log").read_text)
        client = subprocess.Popen(
            [sys.executable, "-c", CLIENT, str(port), str(IDLE), str(SLOW), str(LOAD_S)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "ready"
        threads = [_count(collector.pid, "task")]
        fds = [_count(collector.pid, "fd")]
        # under the load (the client opens again each connection the server closes, so
        # that the server keeps taking new ones and closing the oldest idle): one change,
        # ingested within 2 scans of its publication
        time.sleep(6)  # past the server's 5 s timeouts: the first round closed, reopened
        before = _scans(textfile)
        publish(ms, spool, "n2", fingerprint("n2", "2.18.3", plugin_abi=8))
        published = time.monotonic()

        def changed() -> bool:  # counted while it waits
            threads.append(_count(collector.pid, "task"))
            fds.append(_count(collector.pid, "fd"))
            with Inventory(db, readonly=True) as inv:
                rec = inv.load(["n2"])["n2"]
            return rec is not None and rec.fingerprint["libnccl"][0]["version"] == "2.18.3"

        wait_until(changed, 60, "n2's change in the inventory", interval=0.05,
                   detail=lambda: (tmp_path / "collector.log").read_text()[-2000:])
        took = time.monotonic() - published
        after = _scans(textfile)
        assert after - before <= 2, (before, after)
        # 2 scans of 1 s each, with room for a loaded machine: not a scan slowed by the load
        assert took < 10, took
        assert client.poll() is None  # the load went on all along
        # a scrape still answered, and the endpoint still bounded, after some seconds
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200 and b"ncclguard_collector_scans_total" in r.read()
        for _ in range(20):
            threads.append(_count(collector.pid, "task"))
            fds.append(_count(collector.pid, "fd"))
            time.sleep(0.25)
        assert max(threads) <= THREADS_MAX, threads
        assert max(fds) <= FDS_MAX, fds
        assert collector.poll() is None
    finally:
        if client is not None:
            client.kill()
            client.wait(timeout=30)
        collector.terminate()
        try:
            collector.wait(timeout=30)
        finally:
            if collector.poll() is None:
                collector.kill()
            log.close()
    text = (tmp_path / "collector.log").read_text()
    assert "Too many open files" not in text and "spool unavailable" not in text, text[-2000:]
