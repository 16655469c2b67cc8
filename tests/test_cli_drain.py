"""``drain-recommend`` through the CLI on generated inventories, node set given by --nodes:
the rolling-upgrade split, the cap and --force, a pinned baseline, output parsed back."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from click.testing import Result
from helpers.cli import run_cli
from helpers.inventory import NodeSpec, build, standard


def run(tmp_path: Path, specs: dict[str, NodeSpec], config: str, *args: str) -> Result:
    db = tmp_path / "inv.db"
    if not db.exists():
        build(db, specs)
    cfg = tmp_path / "config.toml"
    cfg.write_text(config)
    return run_cli("drain-recommend", *args, db=db, config=cfg)


def js(r: Result) -> dict:
    assert r.exit_code == 0, (r.output, r.exception)
    return json.loads(r.stdout)


def test_recommendations_grouped_by_reason(tmp_path: Path) -> None:
    doc = js(run(tmp_path, standard(), "[drain]\nmax_share = 0.25\n", "--nodes", "n[01-16]",
                 "--json"))
    (ns,) = doc["node_sets"]
    assert ns["source"] == "--nodes" and ns["size"] == 16 and not ns["capped"]
    assert ns["baseline"]["values"]["nccl"] == "2.21.5" and not ns["baseline"]["pinned"]
    groups = {g["kind"]: g for g in ns["groups"]}
    assert groups["class"]["hosts"] == "n14"
    assert "nccl-version" in groups["class"]["reason"] and "2.18.3" in groups["class"]["reason"]
    assert groups["ports"]["hosts"] == "n15" and "3/4" in groups["ports"]["reason"]
    assert groups["stale"]["hosts"] == "n16"
    assert groups["stale"]["reason"].startswith("ncclguard: no heartbeat since ")
    assert sorted(doc["drain"]) == ["n14", "n15", "n16"]
    assert all(r.startswith("ncclguard: ") for r in doc["drain"].values())
    # n12 (older driver, warn level; unreadable rate) is not recommended
    assert "n12" not in doc["drain"]


def test_table_and_csv(tmp_path: Path) -> None:
    cfg = "[drain]\nmax_share = 0.25\n"
    text = run(tmp_path, standard(), cfg, "--nodes", "n[01-16]").stdout
    assert "node set: --nodes, 16 nodes, from --nodes" in text
    assert "baseline: class" in text and "recommend drain: 3 of 16 nodes" in text
    assert "n14" in text and "ncclguard: RDMA ports down" in text
    rows = list(csv.DictReader(io.StringIO(
        run(tmp_path, standard(), cfg, "--nodes", "n[01-16]", "--csv").stdout)))
    assert {(r["kind"], r["hosts"], r["withheld"]) for r in rows} == {
        ("class", "n14", "no"), ("ports", "n15", "no"), ("stale", "n16", "no")}


def test_nodes_missing_from_the_inventory(tmp_path: Path) -> None:
    doc = js(run(tmp_path, standard(), "[drain]\nmax_share = 0.5\n", "--nodes", "n[01-20]",
                 "--json"))
    missing = [g for g in doc["node_sets"][0]["groups"] if g["kind"] == "missing"]
    assert missing[0]["hosts"] == "n[17-20]" and "not in the inventory" in missing[0]["reason"]


def test_rolling_upgrade_split_recommends_nothing(tmp_path: Path) -> None:
    specs = {f"n{i:02d}": NodeSpec(nccl="2.21.5" if i <= 8 else "2.26.2")
             for i in range(1, 17)}
    r = run(tmp_path, specs, "[drain]\nmax_share = 1.0\n", "--nodes", "n[01-16]")
    assert r.exit_code == 0
    assert "no clear majority" in r.stdout and "nothing to drain" in r.stdout
    doc = js(run(tmp_path, specs, "[drain]\nmax_share = 1.0\n", "--nodes", "n[01-16]",
                 "--json"))
    (ns,) = doc["node_sets"]
    assert ns["no_majority"] and ns["baseline"] is None
    assert ns["groups"] == [] and doc["drain"] == {}
    assert "8 of 16" in ns["note"]


def test_cap_withholds_without_force(tmp_path: Path) -> None:
    specs = {f"n{i:02d}": NodeSpec(nccl="2.18.3" if i > 16 else "2.21.5")
             for i in range(1, 21)}  # 4 of 20 = 20% > 10%
    doc = js(run(tmp_path, specs, "", "--nodes", "n[01-20]", "--json"))
    (ns,) = doc["node_sets"]
    assert ns["capped"] and ns["cap"] == 2
    assert doc["drain"] == {} and ns["recommended"] == []
    assert ns["withheld"] == ["n17", "n18", "n19", "n20"]
    assert "--force" in ns["note"] and "10%" in ns["note"]
    text = run(tmp_path, specs, "", "--nodes", "n[01-20]").stdout
    assert "WITHHELD (cap)" in text
    forced = js(run(tmp_path, specs, "", "--nodes", "n[01-20]", "--force", "--json"))
    assert sorted(forced["drain"]) == ["n17", "n18", "n19", "n20"]
    assert not forced["node_sets"][0]["capped"]


def test_pinned_baseline(tmp_path: Path) -> None:
    specs = {f"n{i:02d}": NodeSpec(nccl="2.21.5" if i <= 3 else "2.26.2")
             for i in range(1, 11)}
    cfg = '[baseline]\nnccl = "2.21.5"\n[drain]\nmax_share = 1.0\n'
    doc = js(run(tmp_path, specs, cfg, "--nodes", "n[01-10]", "--json"))
    (ns,) = doc["node_sets"]
    assert ns["baseline"]["pinned"] and ns["baseline"]["values"]["nccl"] == "2.21.5"
    assert sorted(doc["drain"]) == [f"n{i:02d}" for i in range(4, 11)]
    assert "pinned 2.21.5" in doc["drain"]["n04"]


def test_apply_needs_slurm(tmp_path: Path) -> None:
    (tmp_path / "nobin").mkdir()
    no_slurm = f'[gate]\nslurm_bin_dir = "{tmp_path / "nobin"}"\n'
    r = run(tmp_path, standard(), no_slurm, "--apply")
    assert r.exit_code == 3 and "Slurm" in r.stderr and "--apply" in r.stderr
    # without --apply it falls back to the whole inventory and says so
    r = run(tmp_path, standard(), no_slurm + "[drain]\nmax_share = 0.25\n")
    assert r.exit_code == 0 and "from the whole inventory (Slurm not reachable" in r.stdout
