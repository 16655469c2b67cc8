"""Each ``ncclguard`` command on a generated inventory: tables read for content, JSON and
CSV parsed back, errors named with exit code 3."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import time
from pathlib import Path

import pytest
from helpers.cli import Run, js, ok, run_cli, runner, table_rows
from helpers.inventory import NodeSpec, build, standard

from ncclguard import audit
from ncclguard.hostlist import expand
from ncclguard.timeparse import parse_iso


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("cli")
    history = {"n05": [NodeSpec(nccl="2.18.3"), NodeSpec(nccl="2.18.3", driver="535.104.05")]}
    db = build(d / "inv.db", standard(), history=history)
    cfg = d / "config.toml"
    cfg.write_text(f'[drain]\nmax_share = 0.25\n[gate]\naudit_log = "{d / "audit.jsonl"}"\n')
    return db, cfg


@pytest.fixture
def run(env: tuple[Path, Path]) -> Run:
    return runner(*env)





# --------------------------------------------------------------------------- nodes


def test_nodes_table_has_every_node_and_its_facts(run: Run) -> None:
    r = ok(run("nodes"))
    rows = table_rows(r.stdout)
    assert {f"n{i:02d}" for i in range(1, 17)} <= set(rows)
    assert "2.18.3" in rows["n14"]
    assert "3/4" in rows["n15"]
    assert "stale" in rows["n16"] and "ok" in rows["n01"]
    assert "errors" in rows["n12"] and "535.104.05" in rows["n12"]
    header = r.stdout.splitlines()[0]
    for col in ("NCCL", "PLUGIN", "ABI", "TRANSPORT", "RDMA", "DRIVER", "AGE"):
        assert col in header
    header = ok(run("nodes", "--wide")).stdout.splitlines()[0]  # AGE is the narrow view's
    assert "LAST HEARTBEAT" in header and "ERRORS" in header


def test_nodes_json_schema(run: Run) -> None:
    doc = js(run("nodes", "--json"))
    assert doc["count"] == 16 and doc["node_set"] is None
    by = {n["host"]: n for n in doc["nodes"]}
    n14 = by["n14"]
    assert set(n14) >= {"host", "nccl_version", "nccl_versions", "net_plugin_name", "net_abi",
                        "transport", "rdma_ports_up", "rdma_ports_total", "driver",
                        "last_heartbeat", "age_s", "error_count", "class", "stale",
                        "status"}
    assert n14["nccl_version"] == "2.18.3" and n14["net_abi"] == 6
    assert by["n15"]["rdma_ports_up"] == 3 and by["n15"]["rdma_ports_total"] == 4
    assert by["n16"]["stale"] is True and by["n16"]["age_s"] > 3000
    assert by["n01"]["last_heartbeat"].endswith("Z")
    # each node's class is the one ncclguard classes names
    classes = js(run("classes", "--json"))["classes"]
    assert {h: n["class"] for h, n in by.items()} == {
        h: c["class"] for c in classes for h in expand(c["hosts"])}


@pytest.mark.parametrize(
    ("args", "hosts"),
    [
        (["--where", "nccl=2.18.3"], ["n14"]),
        (["--where", "nccl_any=2.18.3"], ["n14"]),
        (["--where", "abi=6"], ["n14"]),
        (["--where", "driver=535.104.05"], ["n12"]),
        (["--where", "plugin=none"], []),
        (["--where", "nccl=2.18.3,2.21.5", "--where", "driver=535.104.05"], ["n12"]),
        (["--where", "rdma_ports_up=3"], ["n15"]),
        (["--stale"], ["n16"]),
        (["--errors"], ["n12"]),
        (["--where", "abi=8", "--stale"], ["n16"]),
        (["--nodes", "n[01-02]"], ["n01", "n02"]),
    ],
)
def test_nodes_filters(run: Run, args: list[str], hosts: list[str]) -> None:
    doc = js(run("nodes", "--json", *args))
    assert [n["host"] for n in doc["nodes"]] == hosts


def test_nodes_where_transport_and_plugin(run: Run) -> None:
    # the values come from the fixture's fingerprints, not from the output under test
    assert js(run("nodes", "--json", "--where", "transport=IBext_v8"))["count"] == 16
    assert js(run("nodes", "--json", "--where", "plugin=IBext_v8"))["count"] == 16
    assert js(run("nodes", "--json", "--where", "transport=Socket"))["count"] == 0


def test_nodes_node_set_shows_missing_nodes(run: Run) -> None:
    doc = js(run("nodes", "--json", "--nodes", "n[15-17]"))
    assert doc["node_set"]["source"] == "--nodes" and doc["node_set"]["size"] == 3
    status = {n["host"]: n["status"] for n in doc["nodes"]}
    assert status == {"n15": "ok", "n16": "stale", "n17": "missing"}
    text = ok(run("nodes", "--nodes", "n[15-17]")).stdout
    assert "from --nodes" in text and "missing" in table_rows(text.split("\n", 1)[1])["n17"]


def test_nodes_csv_parses(run: Run) -> None:
    r = ok(run("nodes", "--csv", "--where", "nccl=2.18.3"))
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert len(rows) == 1
    assert rows[0]["host"] == "n14" and rows[0]["nccl_version"] == "2.18.3"
    assert rows[0]["rdma_ports_up"] == "4"
    # the group-level flag works too
    r2 = ok(run("--csv", "nodes", "--where", "nccl=2.18.3"))
    again = list(csv.DictReader(io.StringIO(r2.stdout)))
    # the same rows; an age may have moved by a tenth of a second between the two runs
    assert [{k: v for k, v in row.items() if "age" not in k} for row in again] == [
        {k: v for k, v in row.items() if "age" not in k} for row in rows]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--where", "bogus=1"], ["bogus", "unknown field", "nccl"]),
        (["--where", "nccl"], ["FIELD=VALUE"]),
        (["--where", "abi=eight"], ["integer", "eight"]),
        (["--nodes", "n[1-"], ["--nodes", "n[1-"]),
        (["--json", "--csv"], ["exclude"]),
    ],
)
def test_nodes_errors_name_the_problem(run: Run, args: list[str], words: list[str]) -> None:
    r = ok(run("nodes", *args), 3)
    for w in words:
        assert w in r.stderr


def test_missing_inventory_and_bad_config(tmp_path: Path) -> None:
    r = run_cli("nodes", db=tmp_path / "none.db")
    assert r.exit_code == 3 and "none.db" in r.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[drain]\nmax_share = 2\n")
    r = run_cli("nodes", config=bad)
    assert r.exit_code == 3 and "max_share" in r.stderr and "bad.toml" in r.stderr


def test_usage_error_exits_3(run: Run) -> None:
    r = ok(run("nodes", "--no-such-option"), 3)
    assert "--no-such-option" in r.stderr


# --------------------------------------------------------------------------- classes


def test_classes_json(run: Run) -> None:
    doc = js(run("classes", "--json"))
    assert doc["total"] == 16 and len(doc["classes"]) == 2
    big, small = doc["classes"]
    assert big["count"] == 15 and big["hosts"] == "n[01-13,15-16]" and big["baseline"]
    assert big["values"]["nccl"] == "2.21.5" and big["stale"] == 1
    assert small["hosts"] == "n14" and small["values"]["nccl"] == "2.18.3"
    assert not small["baseline"]
    assert doc["baseline"]["class"] == big["class"]
    assert doc["baseline"]["class_key"] == big["class_key"]
    assert abs(big["share"] + small["share"] - 1) < 1e-6
    # each class is named by its Slurm feature (docs/scheduling.md); its key is the digest
    assert re.fullmatch(r"nc_[0-9a-f]{8}", big["class"]) and big["class_key"][:8] == big[
        "class"][3:]
    assert re.fullmatch(r"nc_[0-9a-f]{8}", small["class"]) and small["class"] != big["class"]
    # the refuse-level rules' values make the class; nccl-version is one of them
    assert small["rules"]["nccl-version"] != big["rules"]["nccl-version"]


def test_classes_table_and_csv(run: Run) -> None:
    text = ok(run("classes")).stdout
    assert "16 nodes in 2 classes" in text
    assert "n[01-13,15-16]" in text and "2.18.3" in text and "majority" in text
    rows = list(csv.DictReader(io.StringIO(ok(run("classes", "--csv")).stdout)))
    assert [(r["count"], r["nccl"], r["hosts"]) for r in rows] == [
        ("15", "2.21.5", "n[01-13,15-16]"), ("1", "2.18.3", "n14")]


def test_classes_node_set_with_missing(run: Run) -> None:
    doc = js(run("classes", "--json", "--nodes", "n[13-14,40-41]"))
    assert doc["total"] == 2 and doc["missing"] == {"count": 2, "hosts": "n[40-41]"}
    # 1 of 2: no clear majority
    assert doc["baseline"]["class"] is None and "majority" in doc["baseline"]["why"]


def test_classes_partition_without_slurm_is_an_error(env: tuple[Path, Path],
                                                     tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[gate]\nslurm_bin_dir = "{tmp_path}"\n')  # no sinfo there
    r = run_cli("classes", "--partition", "gpu", db=env[0], config=cfg)
    assert r.exit_code == 3
    assert "--partition gpu" in r.stderr and "--nodes" in r.stderr


# --------------------------------------------------------------------------- show


def test_show_table_has_sections_and_probe_errors(run: Run) -> None:
    text = ok(run("show", "n12", "--wide")).stdout  # each value whole, on one line
    for part in ("node n12", "libnccl", "plugins", "rdma", "gpu", "probe errors (1)",
                 "/sys/class/infiniband/mlx5_0/ports/1/rate", "Invalid argument",
                 "535.104.05", "mlx5_3", "IBext_v8"):
        assert part in text


def test_show_json_is_the_fingerprint(run: Run) -> None:
    doc = js(run("show", "n14", "--json"))
    assert doc["host"] == "n14" and doc["stale"] is False
    assert doc["fingerprint"]["libnccl"][0]["version"] == "2.18.3"
    assert doc["errors"] == []
    assert re.fullmatch(r"nc_[0-9a-f]{8}", doc["class"])


def test_show_unknown_node_and_csv(run: Run) -> None:
    r = ok(run("show", "n99"), 3)
    assert "n99" in r.stderr and "not in the inventory" in r.stderr
    assert "--csv" in ok(run("show", "n01", "--csv"), 3).stderr


# --------------------------------------------------------------------------- diff


def test_diff_two_nodes_rule_and_severity(run: Run) -> None:
    doc = js(run("diff", "n01", "n14", "--json"))
    assert doc["worst"] == "refuse"
    by = {d["field"]: d for d in doc["differences"]}
    nccl = by["compat.nccl"]
    assert nccl["rule"] == "nccl-version" and nccl["severity"] == "refuse"
    assert {(v["value"], v["hosts"]) for v in nccl["values"]} == {("2.21.5", "n01"),
                                                                  ("2.18.3", "n14")}
    assert by["compat.net_abi"]["rule"] == "net-plugin"
    assert "host.hostname" not in by and not any("node_guid" in f for f in by)
    text = ok(run("diff", "n01", "n14")).stdout
    row = table_rows(text)["compat.nccl"]
    assert row[1:] == ["2.21.5", "2.18.3", "nccl-version", "refuse"]


def test_diff_hostlist_warn_and_unknown(run: Run) -> None:
    doc = js(run("diff", "n[10-13]", "--json"))
    by = {d["field"]: d for d in doc["differences"]}
    assert doc["worst"] == "warn"
    assert by["gpu.driver_version"]["severity"] == "warn"
    values = {v["value"]: v["hosts"] for v in by["gpu.driver_version"]["values"]}
    assert values == {"550.54.15": "n[10-11,13]", "535.104.05": "n12"}
    # the rate n12 could not read is unknown, not different
    unknown = {d["field"]: d for d in doc["unknown"]}
    assert unknown["rdma.devices[mlx5_0].ports[1].rate_gbps"]["unknown_on"] == "n12"
    assert "rdma.devices[mlx5_0].ports[1].rate_gbps" not in by


def test_diff_ports_and_rules_only(run: Run) -> None:
    doc = js(run("diff", "n01", "n15", "--json", "--rules-only"))
    rules = {d["field"]: d["rule"] for d in doc["differences"]}
    assert rules["rdma.active_ports"] == "rdma-port-count"
    assert rules["rdma.devices[mlx5_3].ports[1].state"] == "rdma-port-count"
    assert all(d["rule"] for d in doc["differences"])


def test_diff_identical_csv_and_errors(run: Run) -> None:
    assert "no differences" in ok(run("diff", "n01", "n02")).stdout
    rows = list(csv.DictReader(io.StringIO(ok(run("diff", "n01", "n14", "--csv")).stdout)))
    assert {"field": "compat.nccl", "value": "2.18.3", "hosts": "n14", "count": "1",
            "rule": "nccl-version", "severity": "refuse"} in rows
    assert "at least two" in ok(run("diff", "n01"), 3).stderr
    assert "n77" in ok(run("diff", "n01", "n77"), 3).stderr


# --------------------------------------------------------------------------- check


def test_check_exit_codes_and_text(run: Run) -> None:
    r = ok(run("check", "n[01-04]"), 0)
    assert r.stdout.startswith("ncclguard: accept")
    r = ok(run("check", "n[01-04,12]"), 1)
    assert "warn gpu-driver" in r.stdout
    r = ok(run("check", "n[01-04,14]"), 2)
    assert "refuse nccl-version" in r.stdout and "odd nodes: n14" in r.stdout


def test_check_json_is_the_gates_verdict(run: Run, env: tuple[Path, Path]) -> None:
    from ncclguard import config as configmod
    from ncclguard.policy import evaluate, stale_hosts
    from ncclguard.store import Inventory

    doc = json.loads(ok(run("check", "n[01-04,14,16,99]", "--json"), 2).stdout)
    assert doc["decision"] == "refuse" and doc["odd_nodes"]
    rules = {f["rule"] for f in doc["findings"]}
    assert {"nccl-version", "unknown-node"} <= rules
    # the same engine: evaluate() on the same records gives the same dict
    db, cfg = env
    hosts = ["n01", "n02", "n03", "n04", "n14", "n16", "n99"]
    recs = Inventory(db, readonly=True).load(hosts)
    fps = {h: (r.fingerprint if r else None) for h, r in recs.items()}
    conf = configmod.load(cfg)
    stale = stale_hosts({h: r.last_heartbeat for h, r in recs.items() if r}, time.time(),
                        conf.inventory.stale_after_s)
    assert list(stale) == ["n16"]
    verdict = evaluate(fps, conf.policy, stale=stale)
    assert verdict.to_dict() == doc


def test_check_breaks_a_tie_like_the_gate(run: Run) -> None:
    """n14 (2.18.3) with n15 (baseline class): either could be "the odd one" in these two
    nodes, and host-name order alone would keep n14; like the gate, check keeps the
    inventory's majority class and names n14."""
    for order in ("n[14-15]", "n15,n14"):
        doc = json.loads(ok(run("check", order, "--json"), 2).stdout)
        assert doc["odd_nodes"] == "n14", doc
        assert doc["tie_break"].startswith("majority class of the inventory")
    doc = json.loads(ok(run("check", "n[01-04,14]", "--json"), 2).stdout)
    assert doc["odd_nodes"] == "n14" and "tie_break" not in doc  # no tie: no look-up


def test_check_errors_exit_3(run: Run) -> None:
    assert ok(run("check", "n[1-"), 3).stderr
    assert "--csv" in ok(run("check", "n[01-02]", "--csv"), 3).stderr


# --------------------------------------------------------------------------- history


def test_history_changes_with_rules(run: Run) -> None:
    doc = js(run("history", "n05", "--json"))
    changes = doc["changes"]
    assert len(changes) == 3 and changes[0]["first"] is True
    fields = {f["field"]: f for f in changes[1]["fields"]}
    assert fields["gpu.driver_version"]["new"] == "535.104.05"
    assert fields["gpu.driver_version"]["rule"] == "gpu-driver"
    last = {f["field"]: f for f in changes[2]["fields"]}
    ver = last["libnccl[/usr/lib/x86_64-linux-gnu/libnccl.so.2].version"]
    assert (ver["old"], ver["new"], ver["rule"], ver["severity"]) == (
        "2.18.3", "2.21.5", "nccl-version", "refuse")
    text = ok(run("history", "n05")).stdout
    assert "(first seen)" in text and "2.18.3" in text and "gpu.driver_version" in text


def test_history_since(run: Run) -> None:
    all_hosts = js(run("history", "--json"))["changes"]
    assert len(all_hosts) == 16 + 2
    recent = js(run("history", "n05", "--since", "2h", "--json"))["changes"]
    assert len(recent) == 1 and not recent[0]["first"]
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 1.5 * 86400))
    assert len(js(run("history", "n05", "--since", iso, "--json"))["changes"]) == 2
    rows = list(csv.DictReader(io.StringIO(ok(run("history", "n05", "--csv")).stdout)))
    assert any(r["field"] == "gpu.driver_version" for r in rows)


def test_history_errors(run: Run) -> None:
    r = ok(run("history", "--since", "yesterday"), 3)
    assert "yesterday" in r.stderr and "7d" in r.stderr
    assert "n99" in ok(run("history", "n99"), 3).stderr


def _forms(ago: float) -> list[str]:
    """One point in time, ``ago`` seconds back, in every form that a TIME option takes."""
    t = int(time.time() - ago)
    return [f"{int(ago)}s", f"{t}", f"@{t}",
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))]


def test_every_time_option_takes_the_same_forms(run: Run, tmp_path: Path) -> None:
    """``history --since``, ``decisions --since`` and ``diagnose --at`` all parse TIME with
    ncclguard.timeparse: an age, epoch seconds (bare or @) and an ISO time alike."""
    for form in _forms(7200):
        recent = js(run("history", "n05", "--since", form, "--json"))["changes"]
        assert len(recent) == 1 and not recent[0]["first"], form
    path = tmp_path / "audit.jsonl"  # its own trail: the module's is test_decisions'
    for ago, job in ((5 * 86400, 7), (60, 8)):
        audit.append(path, {**audit.now_fields(time.time() - ago), "job": job,
                            "decision": "accept", "action": "none"})
    for form in _forms(86400):
        doc = js(run("decisions", "--audit-log", str(path), "--since", form, "--json"))
        assert [d["job"] for d in doc["decisions"]] == [8], form
    log = Path(__file__).parent / "diagnose_logs" / "clean-4-hosts.log"
    as_of = set()
    for form in _forms(3600)[1:]:  # the absolute forms name the same second
        r = ok(run("diagnose", str(log), "--nodes", "n[01-02]", "--at", form, "--json"))
        as_of.add(json.loads(r.stdout)["inventory"]["as_of"])
    assert len(as_of) == 1
    r = ok(run("diagnose", str(log), "--nodes", "n[01-02]", "--at", "1h", "--json"))
    relative = parse_iso(json.loads(r.stdout)["inventory"]["as_of"])
    assert relative is not None and abs(relative - (parse_iso(as_of.pop()) or 0)) < 60
    for cmd in (["history", "--since"], ["decisions", "--since"],
                ["diagnose", str(log), "--at"]):
        r = ok(run(*cmd, "yesterday"), 3)
        assert "'yesterday': expected an age" in r.stderr, cmd


# --------------------------------------------------------------------------- decisions


def test_decisions(run: Run, env: tuple[Path, Path]) -> None:
    path = env[1].parent / "audit.jsonl"
    now = time.time()
    audit.append(path, {**audit.now_fields(now - 7200), "job": 11, "partition": "gpu",
                        "nodes": "n[01-02]", "decision": "accept", "action": "none",
                        "summary": "ncclguard: accept: 2 nodes compatible"})
    audit.append(path, {**audit.now_fields(now - 60), "job": 12, "partition": "gpu",
                        "nodes": "n[01,14]", "decision": "refuse", "action": "steer",
                        "summary": "ncclguard: refuse, odd n14: nccl-version"})
    doc = js(run("decisions", "--json"))
    assert [d["job"] for d in doc["decisions"]] == [11, 12]
    assert [d["job"] for d in js(run("decisions", "--refused", "--json"))["decisions"]] == [12]
    assert [d["job"] for d in js(run("decisions", "--job", "11", "--json"))["decisions"]] == [11]
    assert [d["job"] for d in js(run("decisions", "--since", "1h", "--json"))["decisions"]] == [12]
    text = ok(run("decisions")).stdout
    rows = table_rows(text)
    assert any("refuse" in r and "n[01,14]" in r and "steer" in r for r in rows.values())
    rows = list(csv.DictReader(io.StringIO(ok(run("decisions", "--csv")).stdout)))
    assert [(r["job"], r["decision"]) for r in rows] == [("11", "accept"), ("12", "refuse")]
    assert "--job" in ok(run("decisions", "--job", "x1"), 3).stderr
    # issue 46: a mistyped --audit-log read as an empty trail, and so did random bytes
    missing = env[1].parent / "nonexistent.jsonl"
    assert "--audit-log " + str(missing) + ": no such file" in ok(
        run("decisions", "--audit-log", str(missing)), 3).stderr
    junk = env[1].parent / "junk.jsonl"
    junk.write_bytes(bytes(range(256)) * 64 + b"\n" + b"\x00garbage\n" * 3)
    assert "not an audit trail (none of its " in ok(
        run("decisions", "--audit-log", str(junk)), 3).stderr
    with open(path, "a") as f:
        f.write("torn {\n")
    r = ok(run("decisions", "--json"))
    assert json.loads(r.stdout)["skipped_lines"] == 1
    assert "1 line(s) that are not audit records were skipped" in r.stderr
    fifo = env[1].parent / "fifo.jsonl"
    os.mkfifo(fifo)
    assert "not a regular file" in ok(run("decisions", "--audit-log", str(fifo)), 3).stderr
