"""A real Prometheus server (Debian's `prometheus`, on loopback) scrapes the collector of the
real dev cluster (slurmctld, slurmd, a munged per node) and evaluates the shipped rules:
after one node's NCCL changes, the partition-split alert goes pending through Prometheus's
own API. Without the `prometheus` package this test skips, or fails under
NCCLGUARD_REQUIRE_PARTS=1 (scripts/test.sh)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.fingerprints import fingerprint
from helpers.parts import unavailable
from helpers.wait import wait_until

from devtools.devcluster import DevCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "prometheus" / "ncclguard.rules.yml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        body = r.read().decode()
    return json.loads(body) if body.startswith("{") else body


def stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def tail(path: Path, n: int = 25) -> str:
    try:
        return f"--- {path}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"--- {path}: none"


@pytest.fixture
def collector(cluster: DevCluster) -> Iterator[tuple[int, Path]]:
    """Every node on NCCL 2.21.5; the collector service of the cluster's controller
    serving its metrics on a free loopback port."""
    port = free_port()
    cluster.write_gate_config(
        f'[gate]\naudit_log = "{cluster.audit_path}"\n'
        f'[collector]\npublisher = "{os.getuid()}"\nscan_interval_s = 0.5\n'
        f"metrics_port = {port}\nmetrics_cache_s = 0\n"
    )
    for host in cluster.node_names:
        cluster.publish_fingerprint(host, fingerprint(host, nccl="2.21.5"))
    log = cluster.root / "log" / "collector-service.out"
    env = {**cluster.env, "NCCLGUARD_CONFIG": str(cluster.config_path),
           "NCCLGUARD_DB": str(cluster.db)}
    with open(log, "wb") as out:
        p = subprocess.Popen([sys.executable, "-m", "inventoryd.main", "collect"], env=env,
                             stdout=out, stderr=subprocess.STDOUT, cwd=cluster.root / "tmp")
    try:
        yield port, log
    finally:
        stop(p)


@pytest.fixture
def prometheus(collector: tuple[int, Path], tmp_path: Path) -> Iterator[str]:
    """Prometheus on a free loopback port: scrapes the collector every second, evaluates
    the project's rule file every second."""
    exe = shutil.which("prometheus")
    if exe is None:
        unavailable("prometheus is not installed (apt-get install prometheus)")
    port, _ = collector
    conf = tmp_path / "prometheus.yml"
    conf.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files: ['{RULES}']\n"
        "scrape_configs:\n  - job_name: ncclguard\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
    )
    log = tmp_path / "prometheus.log"
    for _attempt in range(3):  # the port may be taken between the check and the start
        web = free_port()
        with open(log, "wb") as out:
            p = subprocess.Popen([exe, f"--config.file={conf}",
                                  f"--storage.tsdb.path={tmp_path / 'data'}",
                                  f"--web.listen-address=127.0.0.1:{web}"],
                                 stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
        base = f"http://127.0.0.1:{web}"
        try:
            wait_until(lambda p=p, base=base: p.poll() is not None or "Ready" in get(
                       f"{base}/-/ready"), 60, "prometheus to be ready", interval=0.5,
                       detail=lambda: tail(log), ignore=(OSError,))
        except BaseException:
            stop(p)
            raise
        if p.poll() is None:
            break
    else:
        raise AssertionError(f"prometheus did not start:\n{tail(log)}")
    try:
        yield base
    finally:
        stop(p)


def query(base: str, expr: str) -> list[dict[str, Any]]:
    doc = get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert doc["status"] == "success", doc
    return list(doc["data"]["result"])


def split_alerts(base: str) -> list[dict[str, Any]]:
    doc = get(f"{base}/api/v1/alerts")
    return [a for a in doc["data"]["alerts"]
            if a["labels"].get("alertname") == "NcclguardPartitionSplit"]


def test_a_partition_split_alerts_through_prometheus(
    cluster: DevCluster, collector: tuple[int, Path], prometheus: str
) -> None:
    base = prometheus
    _, collector_log = collector
    why = lambda: tail(collector_log) + "\n" + tail(cluster.root / "log" / "slurmctld.log", 5)  # noqa: E731
    # the rules are loaded, and the collector is scraped: one class in partition debug
    groups = get(f"{base}/api/v1/rules")["data"]["groups"]
    assert any(r["name"] == "NcclguardPartitionSplit" for g in groups for r in g["rules"])
    one = wait_until(lambda: query(base, 'ncclguard_partition_classes{partition="debug"} == 1'),
                     60, "Prometheus to scrape one class in partition debug", interval=0.5,
                     detail=why, ignore=(OSError,))
    assert one[0]["metric"]["job"] == "ncclguard"
    nodes = query(base, 'ncclguard_partition_nodes{partition="debug"}')
    assert nodes[0]["value"][1] == str(len(cluster.node_names))
    time.sleep(3)  # three evaluations of the rules on that: nothing to alert
    assert split_alerts(base) == []

    # n3 gets another NCCL: its node publishes, the collector accepts it
    cluster.publish_fingerprint("n3", fingerprint("n3", nccl="2.18.3"))
    alert = wait_until(lambda: split_alerts(base), 60, "NcclguardPartitionSplit in /api/v1/alerts",
                       interval=0.5, detail=why, ignore=(OSError,))[0]
    assert alert["state"] in ("pending", "firing")
    assert alert["labels"]["partition"] == "debug"
    assert alert["labels"]["severity"] == "warning"
    assert alert["annotations"]["summary"] == \
        "Partition debug is split into 2 NCCL compatibility classes"
    assert "ncclguard classes --partition debug" in alert["annotations"]["description"]
    two = query(base, 'ncclguard_partition_class_nodes{partition="debug"}')
    assert sorted(int(s["value"][1]) for s in two) == [1, len(cluster.node_names) - 1]
