"""``drain-recommend --apply`` and ``--resume`` against a real slurmctld (its own cluster).

The cluster is private to this module (six nodes, partition ``gpu``), so the drains it
makes never disturb the shared session cluster of the other Slurm tests.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import Result
from helpers.cli import run_cli
from helpers.inventory import NodeSpec, base_fingerprint, build
from helpers.slurm import require_slurm

from devtools.devcluster import DevCluster
from ncclguard.policy import GATE_VALUES
from ncclguard.slurm import NodeInfo
from ncclguard.store import Inventory

pytestmark = pytest.mark.slurm

HAND_REASON = "bad DIMM, ticket 42"


@pytest.fixture(scope="module")
def cl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    require_slurm()
    root = tmp_path_factory.mktemp("drainslurm")
    with DevCluster(root, nodes=6, prolog=False, partitions={"gpu": "n[1-6]"}) as cluster:
        yield cluster


def nodes_now(cluster: DevCluster) -> dict[str, NodeInfo]:
    return {n.name: n for n in cluster.slurm().nodes()}


def test_apply_and_resume(cl: DevCluster, tmp_path: Path) -> None:
    # n1-n3 fine; n4 and n6 on an old NCCL; n5 silent for an hour.
    # n3 and n6 were drained by hand: both must keep their drain and reason.
    specs = {f"n{i}": NodeSpec() for i in range(1, 7)}
    specs["n4"] = NodeSpec(nccl="2.18.3")
    specs["n6"] = NodeSpec(nccl="2.18.3")
    specs["n5"] = NodeSpec(age_s=3600)
    db = build(tmp_path / "inv.db", specs)
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[drain]\nmax_share = 0.5\n[gate]\nslurm_conf = "{cl.conf}"\n')
    cl.run(["scontrol", "update", "NodeName=n3,n6", "State=DRAIN", f"Reason={HAND_REASON}"])

    def run(*args: str) -> Result:
        r = run_cli(*args, db=db, config=cfg)
        assert r.exit_code == 0, (r.output, r.exception)
        return r

    def js(*args: str) -> dict:
        return json.loads(run(*args, "--json").stdout)

    try:
        # the recommendation alone changes nothing
        doc = js("drain-recommend")
        (ns,) = doc["node_sets"]
        assert (ns["name"], ns["source"], ns["size"]) == ("gpu", "slurm", 6)
        assert set(doc["drain"]) == {"n4", "n5", "n6"}
        assert not nodes_now(cl)["n4"].drained

        text = run("drain-recommend", "--apply").stdout
        assert "nodes, from Slurm" in text and "drain" in text
        # the report says what Slurm shows after the drain (it said "not drained")
        assert "not drained" not in text and "drained now" in text, text
        now = nodes_now(cl)
        assert now["n4"].drained and now["n4"].reason.startswith("ncclguard: nccl-version")
        assert "2.18.3" in now["n4"].reason
        assert now["n5"].drained and now["n5"].reason.startswith("ncclguard: no heartbeat since")
        for hand in ("n3", "n6"):
            assert now[hand].drained and now[hand].reason == HAND_REASON
        assert not now["n1"].drained and not now["n2"].drained

        # idempotent: a second --apply does nothing
        doc = js("drain-recommend", "--apply")
        acts = {a["host"]: a for a in doc["actions"]}
        assert {a["action"] for a in acts.values()} == {"skip"}
        assert "someone else" in acts["n6"]["detail"]
        assert nodes_now(cl)["n4"].reason == now["n4"].reason

        # fix n4 (new NCCL) and n5 (heartbeat back); n6 is still old
        with Inventory(db, values=GATE_VALUES) as inv:
            inv.upsert(base_fingerprint("n4", NodeSpec()), now=time.time())
            inv.upsert(base_fingerprint("n5", NodeSpec()), now=time.time())
        doc = js("drain-recommend", "--resume")
        assert {a["host"]: a["detail"] for a in doc["actions"]}["n4"] == "resumed now (cause gone)"
        acts = {a["host"]: a["action"] for a in doc["actions"]}
        assert acts["n4"] == "resume" and acts["n5"] == "resume"
        assert acts.get("n3", "skip") == "skip" and acts.get("n6", "skip") == "skip"
        now = nodes_now(cl)
        assert not now["n4"].drained and not now["n5"].drained
        for hand in ("n3", "n6"):
            assert now[hand].drained and now[hand].reason == HAND_REASON

        # idempotent: nothing more to resume
        doc = js("drain-recommend", "--resume")
        assert [a for a in doc["actions"] if a["action"] == "resume"] == []
    finally:
        cl.run(["scontrol", "update", "NodeName=n[1-6]", "State=RESUME"], check=False)


def test_partition_filter_and_unknown_partition(cl: DevCluster, tmp_path: Path) -> None:
    db = build(tmp_path / "inv.db", {f"n{i}": NodeSpec() for i in range(1, 7)})
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[gate]\nslurm_conf = "{cl.conf}"\n')
    run: Callable[..., Result] = lambda *a: run_cli(*a, db=db, config=cfg)  # noqa: E731
    r = run("classes", "--partition", "gpu", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["node_set"]["source"] == "slurm" and doc["classes"][0]["hosts"] == "n[1-6]"
    r = run("drain-recommend", "--partition", "nope")
    assert r.exit_code == 3 and "nope" in r.stderr and "gpu" in r.stderr
    # issue 46: check took an unknown partition silently, and --nodes with --partition
    # judged the one node against itself, --partition ignored
    r = run("check", "n[1-4]", "--partition", "nope")
    assert r.exit_code == 3 and "no such partition in Slurm (known: gpu)" in r.stderr, r.output
    assert run("check", "n[1-4]", "--partition", "gpu").exit_code == 0
    for cmd in ("drain-recommend", "classes", "nodes"):
        r = run(cmd, "--partition", "gpu", "--nodes", "n1")
        assert r.exit_code == 3 and "give one node set" in r.stderr, (cmd, r.output)
