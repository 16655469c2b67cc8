"""The controller's exporter (inventoryd/controller/exporter.py): what it says about a real
inventory, the counters it derives from the gate's audit trail, its label bounds, its HTTP endpoint
and the collector service that serves it. Real SQLite, real audit files, real HTTP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.cli import run_cli
from helpers.exporter import exporter, series, value

from inventoryd.controller.exporter import (
    MAX_SERIES,
    AuditTail,
    Exporter,
    Partitions,
    Served,
    snapshot,
)
from ncclguard import audit
from ncclguard import config as configmod
from ncclguard.sched import status as features_status

REPO = Path(__file__).resolve().parents[1]


def test_the_cluster_view_of_a_real_inventory(exporter_inventory: Path, tmp_path: Path) -> None:
    text = Served(exporter(exporter_inventory, tmp_path)).text()
    assert value(text, "ncclguard_inventory_nodes") == 8
    assert value(text, "ncclguard_inventory_stale_nodes") == 1
    age = value(text, "ncclguard_inventory_oldest_heartbeat_age_seconds")
    assert age is not None and 99_000 < age < 101_000
    assert value(text, "ncclguard_classes") == 3
    classes = series(text, "ncclguard_class_nodes")
    assert sorted(classes.values()) == [1, 1, 6]
    # the versions, plugins and transports of the classes, summed over nodes
    assert value(text, "ncclguard_nccl_version_nodes", version="2.21.5") == 7
    assert value(text, "ncclguard_nccl_version_nodes", version="2.18.3") == 1
    assert value(text, "ncclguard_net_plugin_nodes", plugin="IBext_v8", abi="8") == 7
    assert sum(series(text, "ncclguard_net_plugin_nodes").values()) == 8
    assert sum(series(text, "ncclguard_transport_nodes").values()) == 8
    # the baseline: the majority class, counted on current nodes only (5 of 7)
    big = next(dict(k)["class"] for k, v in classes.items() if v == 6)
    assert value(text, "ncclguard_baseline_info", **{"class": big, "pinned": "false"}) == 1
    assert value(text, "ncclguard_baseline_share") == pytest.approx(5 / 7)
    info = series(text, "ncclguard_class_info")
    assert {dict(k)["nccl"] for k in info} == {"2.21.5", "2.18.3"}
    # per partition: gpu is split in 3, cpu is one class
    assert value(text, "ncclguard_partitions_known") == 1
    assert value(text, "ncclguard_partition_classes", partition="gpu") == 3
    assert value(text, "ncclguard_partition_classes", partition="cpu") == 1
    assert value(text, "ncclguard_partition_nodes", partition="gpu") == 6
    assert value(text, "ncclguard_partition_missing_nodes", partition="gpu") == 1
    assert value(text, "ncclguard_partition_stale_nodes", partition="gpu") == 1
    assert value(text, "ncclguard_partition_baseline_share", partition="gpu") == \
        pytest.approx(3 / 5)
    assert value(text, "ncclguard_partition_baseline_share", partition="cpu") == 1
    assert value(text, "ncclguard_partition_class_nodes", partition="gpu", **{"class": big}) == 4
    assert value(text, "ncclguard_exporter_inventory_up") == 1


def test_the_baseline_is_the_one_ncclguard_classes_names(exporter_inventory: Path, tmp_path: Path
                                                         ) -> None:
    """The same choose_baseline: a pin in [baseline] moves it, as it does for the CLI."""
    r = run_cli("classes", "--json", db=exporter_inventory, env={"NCCLGUARD_CONFIG": "/dev/null"})
    doc = json.loads(r.stdout)
    text = Served(exporter(exporter_inventory, tmp_path)).text()
    (labels,) = series(text, "ncclguard_baseline_info")
    assert dict(labels)["class"] == doc["baseline"]["class"]
    cfg = configmod.from_dict({"baseline": {"nccl": "2.18.3"}})
    ex = exporter(exporter_inventory, tmp_path)
    ex.config = cfg
    text = Served(ex).text()
    (labels,) = series(text, "ncclguard_baseline_info")
    assert dict(labels)["pinned"] == "true" and dict(labels)["class"] != doc["baseline"]["class"]
    assert value(text, "ncclguard_baseline_share") == pytest.approx(1 / 7)


def test_no_clear_majority_is_a_share_of_zero_and_no_baseline() -> None:
    now = time.time()
    classes = [("a" * 16, {"nccl": "2.21.5"}, ["n1", "n2"]),
               ("b" * 16, {"nccl": "2.18.3"}, ["n3", "n4"])]
    snap = snapshot(classes, dict.fromkeys(["n1", "n2", "n3", "n4"], now),
                    configmod.Config(), now, {"p": ["n1", "n2", "n3", "n4"]})
    assert snap.baseline is None and snap.baseline_share == 0
    assert snap.partitions is not None
    assert snap.partitions["p"].baseline is None and snap.partitions["p"].baseline_share == 0
    assert len(snap.partitions["p"].classes) == 2


def test_without_slurm_there_are_no_partition_series(exporter_inventory: Path,
                                                     tmp_path: Path) -> None:
    def fail() -> dict:
        raise OSError("scontrol: not found")

    p = Partitions(fail, refresh_s=600)
    p.refresh()
    ex = Exporter(configmod.Config(), db=exporter_inventory, partitions=p,
                  audit_path=tmp_path / "none.jsonl", cache_s=0)
    text = Served(ex).text()
    assert value(text, "ncclguard_partitions_known") == 0
    assert not series(text, "ncclguard_partition_classes")
    assert value(text, "ncclguard_classes") == 3


def test_labels_are_bounded_at_16k_nodes() -> None:
    """16,384 nodes that each claim their own NCCL version (each node can publish what
    it likes for itself): no family holds more than MAX_SERIES series; the rest is
    'other'; totals are kept; a value that is not a short printable word is 'other'."""
    now = time.time()
    n = 16_384
    classes = [(f"{i:016x}", {"nccl": f"2.{i}.0", "net_plugin": "x\ny" if i == 0 else "IB",
                              "transport": "IB"}, [f"n{i}"]) for i in range(n)]
    snap = snapshot(classes, {f"n{i}": now for i in range(n)}, configmod.Config(), now,
                    {"all": [f"n{i}" for i in range(n)]})
    ex = Exporter(configmod.Config(), audit_path="/nonexistent/x", cache_s=3600)
    ex._snap = snap  # the snapshot as the inventory would give it
    text = Served(ex).text()
    for name in ("ncclguard_class_nodes", "ncclguard_nccl_version_nodes",
                 "ncclguard_partition_class_nodes", "ncclguard_net_plugin_nodes"):
        got = series(text, name)
        assert 0 < len(got) <= MAX_SERIES, name
        assert sum(got.values()) == n, name
    assert value(text, "ncclguard_nccl_version_nodes", version="other") == n - MAX_SERIES + 1
    assert value(text, "ncclguard_net_plugin_nodes", plugin="other", abi="none") == 1
    assert len(series(text, "ncclguard_class_info")) <= MAX_SERIES
    assert value(text, "ncclguard_partition_classes", partition="all") == n


# ---------------------------------------------------------------- the audit trail


def _decision(job: int, decision: str, action: str, rules: tuple[str, ...] = ()) -> dict:
    return {"job": job, "decision": decision, "action": action,
            "findings": [{"rule": r, "severity": "refuse"} for r in rules]}


def test_gate_counters_come_from_the_audit_trail(tmp_path: Path) -> None:
    d = tmp_path / "log"
    d.mkdir(mode=0o750)
    path = d / "decisions.jsonl"
    tail = AuditTail(path)
    assert tail.poll() == 0 and tail.up  # no trail yet: nothing decided
    audit.append(path, _decision(1, "refuse", "steer", ("nccl-version", "net-plugin")))
    audit.append(path, {"job": 1, "decision": "followup", "action": "steer",
                        "result": "done"})
    audit.append(path, _decision(1, "accept", "none"))
    audit.append(path, _decision(2, "error", "accept"))
    audit.append(path, _decision(3, "refuse", "hold", ("transport", "no-such-rule")))
    audit.append(path, {"job": 4, "action": "diagnose", "decision": "diagnosis",
                        "diagnoses": [{"id": "nccl-version-mismatch"},
                                      {"id": "nccl-version-differs"}]})
    audit.append(path, {"job": 5, "action": "diagnose", "decision": "diagnosis",
                        "diagnoses": []})
    audit.append(path, _decision(6, "refuse\nforged", "x" * 500))
    assert tail.poll() == 8
    c = tail.counts
    assert c.decisions == {("refuse", "steer"): 1, ("accept", "none"): 1,
                           ("error", "accept"): 1, ("refuse", "hold"): 1,
                           ("other", "other"): 1}
    assert c.rules == {("refuse", "nccl-version"): 1, ("refuse", "net-plugin"): 1,
                       ("refuse", "transport"): 1, ("refuse", "other"): 1}
    assert c.followups == {("steer", "done"): 1}
    assert c.diagnoses == {"nccl-version-mismatch": 1, "nccl-version-differs": 1}
    assert c.diagnose_jobs == {"diagnosed": 1, "clean": 1}
    # only what is new is read; a torn line waits for its end
    with open(path, "a") as f:
        f.write('{"job": 7, "decision": "refuse", "act')
    assert tail.poll() == 0
    with open(path, "a") as f:
        f.write('ion": "requeue"}\nnot json\n')
    assert tail.poll() == 1
    assert c.decisions[("refuse", "requeue")] == 1
    # rotated: the new file is read from its start, the counters go on
    path.rename(d / "decisions.jsonl.1")
    audit.append(path, _decision(8, "refuse", "steer"))
    assert tail.poll() == 1
    assert c.decisions[("refuse", "steer")] == 2
    # truncated in place: read again from the start
    path.write_text("")
    audit.append(path, _decision(9, "warn", "none"))
    assert tail.poll() == 1 and c.decisions[("warn", "none")] == 1
    assert c.records == 11


def test_a_long_trail_is_counted_from_its_tail_at_start(tmp_path: Path) -> None:
    d = tmp_path / "log"
    d.mkdir(mode=0o750)
    path = d / "decisions.jsonl"
    line = json.dumps(_decision(1, "accept", "none")) + "\n"
    path.write_text(line * 1000)
    tail = AuditTail(path, backlog_bytes=len(line) * 10 + 5)
    assert tail.poll() == 10  # the partial line at the cut is not counted
    path.write_text(line * 3)  # shorter: truncated, read from the start
    assert tail.poll() == 3


def test_an_unreadable_trail_is_reported_not_fatal(tmp_path: Path) -> None:
    d = tmp_path / "log"
    d.mkdir()
    (d / "decisions.jsonl").mkdir()  # reading a directory fails
    tail = AuditTail(d / "decisions.jsonl")
    tail.poll()
    assert not tail.up and tail.error


def test_gate_and_diagnose_series(exporter_inventory: Path, tmp_path: Path) -> None:
    ex = exporter(exporter_inventory, tmp_path)
    path = ex.audit.path
    audit.append(path, _decision(1, "refuse", "hold", ("nccl-version",)))
    audit.append(path, _decision(2, "error", "accept"))
    audit.append(path, {"job": 1, "decision": "followup", "action": "hold", "result": "done"})
    audit.append(path, {**_decision(4, "accept", "none"), "path": "features"})
    audit.append(path, {"job": 3, "action": "diagnose", "decision": "diagnosis",
                        "diagnoses": [{"id": "nccl-version-mismatch"}]})
    text = Served(ex).text()
    assert value(text, "ncclguard_gate_decisions_total", decision="refuse", action="hold") == 1
    assert value(text, "ncclguard_gate_decisions_total", decision="error", action="accept") == 1
    assert value(text, "ncclguard_gate_rule_decisions_total", decision="refuse",
                 rule="nccl-version") == 1
    assert value(text, "ncclguard_gate_followups_total", action="hold", result="done") == 1
    assert value(text, "ncclguard_diagnoses_total", signature="nccl-version-mismatch") == 1
    assert value(text, "ncclguard_diagnose_jobs_total", outcome="diagnosed") == 1
    assert value(text, "ncclguard_audit_up") == 1
    assert value(text, "ncclguard_audit_records_total") == 5
    # which check placed each job (docs/scheduling.md); older records have no path
    assert value(text, "ncclguard_gate_paths_total", path="features", decision="accept") == 1
    assert value(text, "ncclguard_gate_paths_total", path="other", decision="refuse") == 1
    assert value(text, "ncclguard_gate_paths_total", path="gate", decision="refuse") == 0
    # what has not happened yet is there at 0, so that increase() sees its first time
    assert value(text, "ncclguard_gate_decisions_total", decision="refuse", action="steer") == 0
    assert value(text, "ncclguard_diagnoses_total", signature="nccl-version-differs") == 0
    assert value(text, "ncclguard_collector_records_rejected_total", cause="wrong-uid") == 0
    assert value(text, "ncclguard_gate_rule_decisions_total", decision="warn",
                 rule="gpu-driver") == 0


def test_the_inventory_is_read_at_most_every_cache_s(exporter_inventory: Path,
                                                     tmp_path: Path) -> None:
    clock = [1000.0]
    ex = exporter(exporter_inventory, tmp_path, cache_s=10, clock=lambda: clock[0])
    first = ex.refresh()
    assert ex.refresh() is first
    clock[0] += 11
    assert ex.refresh() is not first


def test_an_unreadable_inventory_is_a_metric_not_a_failed_scrape(tmp_path: Path) -> None:
    ex = exporter(tmp_path / "missing.db", tmp_path)
    text = Served(ex).text()
    assert value(text, "ncclguard_exporter_inventory_up") == 0
    assert value(text, "ncclguard_collector_scans_total") == 0
    assert value(text, "ncclguard_classes") is None


def test_the_features_daemons_status_file_as_metrics(exporter_inventory: Path,
                                                     tmp_path: Path) -> None:
    """What the features daemon holds back (its status file, written by the daemon's own
    writer): nodes Slurm refuses, flapping nodes held; a file missing, of another shape,
    or a FIFO (never blocks the scrape) counts 0 and says it could not be read."""
    classes = tmp_path / "features" / "classes"
    classes.parent.mkdir(mode=0o755)
    cfg = configmod.Config(features=configmod.FeaturesConfig(classes_file=str(classes)))
    ex = Exporter(cfg, db=exporter_inventory, audit_path=tmp_path / "audit.jsonl", cache_s=0)

    def gauges() -> tuple[float | None, ...]:
        text = Served(ex).text()
        return tuple(value(text, f"ncclguard_features_{n}")
                     for n in ("status_up", "failing_nodes", "held_nodes"))

    assert gauges() == (0, 0, 0)  # no status yet: the daemon not running (or not used)
    now = time.time()
    features_status.write(cfg, {
        "time": now,
        "failing": [{"host": h, "error": "Invalid feature specification", "since": now - 600,
                     "attempts": 7, "next_try": now + 300} for h in ("g1", "g2")],
        "held": [{"host": "g3", "until": now + 60}]})
    assert gauges() == (1, 2, 1)
    features_status.write(cfg, {"time": now, "failing": [], "held": []})
    assert gauges() == (1, 0, 0)
    for junk in (b"not json", b"[]", b'{"failing": 5, "held": []}',
                 b'{"failing": [{"host": 5}], "held": []}', b"[" * 100_000):
        features_status.path(cfg).write_bytes(junk)
        assert gauges() == (0, 0, 0), junk[:40]
    features_status.path(cfg).unlink()
    os.mkfifo(features_status.path(cfg))
    assert gauges() == (0, 0, 0)


def test_the_canarys_nodes_hold_and_events_as_metrics(exporter_inventory: Path,
                                                       tmp_path: Path) -> None:
    """[canary] enabled (docs/canary.md): every state at 0 from the start, the longest
    hold in seconds, the events counted from the inventory's history; absent while off."""
    from ncclguard.policy import GATE_VALUES
    from ncclguard.policy.canary import HELD_STATES, held_row, ok_row
    from ncclguard.store import Inventory

    off = Served(exporter(exporter_inventory, tmp_path)).text()
    assert not [n for n in off.splitlines() if n.startswith("ncclguard_canary")]
    cfg = configmod.Config(canary=configmod.CanaryConfig(enabled=True, command=("true",)))
    ex = exporter(exporter_inventory, tmp_path, config=cfg)
    text = Served(ex).text()
    assert series(text, "ncclguard_canary_nodes") == {
        (("state", s),): 0 for s in ("ok", *HELD_STATES)}
    assert value(text, "ncclguard_canary_held_max_seconds") == 0
    assert series(text, "ncclguard_canary_events_total") == {
        (("event", e),): 0 for e in ("submitted", "passed", "failed", "approved")}
    now = time.time()
    rows = [ok_row(h, "k1", now) for h in ("g1", "g2", "g3")]
    rows += [held_row("g4", "k1", "k2", now, "its stack changed", since=now - 7200,
                      state="failed"),
             held_row("g5", "k1", "k2", now, "its stack changed", since=now - 60)]
    events = [{"at": now, "host": h, "event": e, "detail": "", "by": "ncclguard"}
              for h, e in (("g4", "submitted"), ("g4", "failed"), ("g1", "submitted"),
                           ("g1", "passed"), ("g2", "approved"), ("g5", "held"))]
    with Inventory(exporter_inventory, values=GATE_VALUES) as inv:
        inv.canary_write(rows, events)
    text = Served(ex).text()
    assert value(text, "ncclguard_canary_nodes", state="ok") == 3
    assert value(text, "ncclguard_canary_nodes", state="failed") == 1
    assert value(text, "ncclguard_canary_nodes", state="settling") == 1
    assert value(text, "ncclguard_canary_nodes", state="running") == 0
    held = value(text, "ncclguard_canary_held_max_seconds")
    assert held is not None and 7190 < held < 7300  # g4's, the longest
    assert series(text, "ncclguard_canary_events_total") == {
        (("event", "submitted"),): 2, (("event", "passed"),): 1, (("event", "failed"),): 1,
        (("event", "approved"),): 1}


# ---------------------------------------------------------------- serving


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_http_endpoint_on_loopback(exporter_inventory: Path, tmp_path: Path) -> None:
    served = Served(exporter(exporter_inventory, tmp_path), address="127.0.0.1", port=free_port())
    try:
        url = f"http://127.0.0.1:{served.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain")
            text = r.read().decode()
        assert value(text, "ncclguard_partition_classes", partition="gpu") == 3
    finally:
        served.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)


def test_the_collector_service_serves_its_metrics(tmp_path: Path, exporter_inventory: Path) -> None:
    """`ncclguard-inventoryd collect` with metrics_port: the endpoint answers while it
    runs, with its scans counted; a port already taken is logged and it collects on."""
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o755)
    port = free_port()
    conf = tmp_path / "c.toml"
    conf.write_text(f'[inventory]\ndb = "{exporter_inventory}"\n[spool]\ndir = "{spool}"\n'
                    f'[collector]\npublisher = "{os.getuid()}"\nscan_interval_s = 0.2\n'
                    f'metrics_port = {port}\nmetrics_cache_s = 0\n'
                    f'[collector.addresses]\ng1 = ["10.0.0.1"]\n'
                    f'[gate]\naudit_log = "{tmp_path / "log" / "d.jsonl"}"\n')
    env = {**os.environ, "NCCLGUARD_CONFIG": str(conf)}
    env.pop("NCCLGUARD_DB", None)
    argv = [sys.executable, "-m", "inventoryd.main", "collect"]
    p = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True, cwd=REPO)
    blocked = None
    try:
        text = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                            timeout=5) as r:
                    text = r.read().decode()
                if (value(text, "ncclguard_collector_scans_total") or 0) >= 2:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        assert (value(text, "ncclguard_collector_scans_total") or 0) >= 2, text
        assert value(text, "ncclguard_inventory_nodes") == 8
        lag = value(text, "ncclguard_collector_lag_seconds")
        assert lag is not None and 0 <= lag < 5
        # a second collector cannot have the port: it says so and collects on
        blocked = subprocess.run([*argv, "--once"], env=env, capture_output=True, text=True,
                                 timeout=60)
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert f"metrics on http://127.0.0.1:{port}/metrics" in err
    assert blocked is not None and blocked.returncode == 0  # --once serves nothing
    conf.write_text(conf.read_text().replace("scan_interval_s = 0.2", "scan_interval_s = 30"))
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the TIME_WAIT
        s.bind(("127.0.0.1", port))
        s.listen()
        r = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True, cwd=REPO)
        time.sleep(3)
        r.terminate()
        _, err = r.communicate(timeout=30)
    assert r.returncode == 0, err
    assert f"metrics: cannot listen on 127.0.0.1:{port}" in err
    assert "collector stopped" in err


def test_metrics_command_prints_them_once(exporter_inventory: Path, tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text(f'[inventory]\ndb = "{exporter_inventory}"\n'
                    f'[gate]\naudit_log = "{tmp_path / "log" / "d.jsonl"}"\n')
    r = subprocess.run([sys.executable, "-m", "inventoryd.main", "metrics", "--no-slurm",
                        "--config", str(conf)], capture_output=True, text=True, timeout=60,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert value(r.stdout, "ncclguard_classes") == 3
    assert value(r.stdout, "ncclguard_partitions_known") == 0
    missing = tmp_path / "c2.toml"
    missing.write_text(f'[inventory]\ndb = "{tmp_path / "none.db"}"\n')
    r = subprocess.run([sys.executable, "-m", "inventoryd.main", "metrics", "--no-slurm",
                        "--config", str(missing)], capture_output=True, text=True, timeout=60,
                       cwd=REPO)
    assert r.returncode == 1
    assert value(r.stdout, "ncclguard_exporter_inventory_up") == 0
