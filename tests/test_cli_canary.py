"""What ``ncclguard nodes`` and ``show`` say of a node the canary holds (issue 43,
docs/canary.md, docs/cli.md): the state and why, in the table, JSON and CSV, the same
words as ``ncclguard canary status``; nothing while ``[canary]`` is off."""

from __future__ import annotations

import csv
import io
import time
from pathlib import Path

import pytest
from helpers.cli import js, ok, runner, table_rows
from helpers.inventory import build, standard

from ncclguard.config import PolicyConfig


@pytest.fixture(scope="module")
def held_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The standard inventory with [canary] enabled: n14 failed its canary, n15 settles,
    n03's row is ok (vetted); docs/canary.md."""
    from ncclguard.policy.canary import held_row, ok_row
    from ncclguard.policy.schedule import class_values
    from ncclguard.store import Inventory

    d = tmp_path_factory.mktemp("canary")
    db = build(d / "inv.db", standard())
    now = time.time()
    failed = held_row("n14", "k1", "k2", now, "its canary job 812 ended FAILED on n[01,14]: "
                      "NCCL WARN NET/IB : No device found.", since=now - 3600, state="failed")
    failed["job_id"] = 812
    with Inventory(db, values=class_values(PolicyConfig())) as inv:
        inv.canary_write([failed, held_row("n15", "k1", "k3", now, "its stack changed"),
                          ok_row("n03", "k1", now)])
    cfg = d / "config.toml"
    cfg.write_text('[canary]\nenabled = true\ncommand = ["/usr/local/sbin/nccl-canary"]\n')
    return db, cfg


def test_nodes_say_held_by_the_canary_and_why(held_env: tuple[Path, Path]) -> None:
    run = runner(*held_env)
    text = ok(run("nodes")).stdout
    assert "CANARY" in text.splitlines()[0]
    rows = table_rows(text)
    assert "failed" in rows["n14"] and "settling" in rows["n15"]
    assert "failed" not in rows["n03"] and "settling" not in rows["n01"]
    assert "n14: held by canary (failed) since " in text
    assert "its canary job 812 ended FAILED" in text and "n15: held by canary (settling)" in text
    assert all(len(line) <= 100 for line in text.splitlines())
    by = {n["host"]: n for n in js(run("nodes", "--json"))["nodes"]}
    n14 = by["n14"]["canary"]
    assert (n14["state"], n14["job_id"]) == ("failed", 812) and n14["held_since"].endswith("Z")
    assert "No device found" in n14["reason"]
    assert by["n14"]["held"] == n14["text"] and n14["text"].startswith("held by canary")
    assert by["n03"]["canary"] is None and by["n03"]["held"] is None  # vetted: not held
    assert by["n01"]["canary"] is None
    table = csv.DictReader(io.StringIO(ok(run("nodes", "--csv")).stdout))
    got = {r["host"]: r["held"] for r in table}
    assert got["n14"].startswith("held by canary (failed)") and got["n01"] == ""


def test_show_says_held_by_the_canary_and_why(held_env: tuple[Path, Path]) -> None:
    run = runner(*held_env)
    text = ok(run("show", "n14")).stdout
    assert "canary" in text and "held by canary (failed) since" in text
    assert "its canary job 812 ended FAILED" in " ".join(text.split())  # wrapped
    assert all(len(line) <= 100 for line in text.splitlines())
    doc = js(run("show", "n14", "--json"))
    assert doc["canary"]["state"] == "failed" and doc["canary"]["job_id"] == 812
    assert doc["held"] == doc["canary"]["text"]
    doc = js(run("show", "n01", "--json"))
    assert doc["canary"] is None and doc["held"] is None
    assert "held by canary" not in ok(run("show", "n01")).stdout


def test_held_rows_hold_nothing_while_the_canary_is_off(held_env: tuple[Path, Path],
                                                        tmp_path: Path) -> None:
    """The gate and the features daemon ignore the rows while [canary] is off; so do the
    views (``ncclguard canary status`` still lists them, and says so)."""
    cfg = tmp_path / "off.toml"
    cfg.write_text("")
    run = runner(held_env[0], cfg)
    text = ok(run("nodes")).stdout
    assert "CANARY" not in text and "held by canary" not in text
    assert js(run("show", "n14", "--json"))["held"] is None
    status = ok(run("canary", "status")).stdout
    assert "n14" in status and "enabled = false" in status
