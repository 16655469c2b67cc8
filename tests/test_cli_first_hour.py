"""An admin's first hour (issue 46): usage errors in the project's form, inventories that
cannot be opened saying why, counts as English reads them, one rendering of a record."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.cli import Run, ok, run_cli, runner
from helpers.inventory import build, standard


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("cli")
    db = build(d / "inv.db", standard())
    cfg = d / "config.toml"
    cfg.write_text("")
    return db, cfg


@pytest.fixture
def run(env: tuple[Path, Path]) -> Run:
    return runner(*env)



def test_usage_errors_take_the_projects_form(run: Run) -> None:
    """Issue 46: ``check n1 n2`` gave click's usage text ("Got unexpected extra argument"),
    not the project's error form, and no hint that a HOSTLIST is one argument."""
    r = ok(run("check", "n01", "n02"), 3)
    assert r.stderr.startswith("ncclguard: error: ncclguard check: Got unexpected extra "
                               "argument (n02); a HOSTLIST is one argument: n1,n2"), r.stderr
    assert "Usage:" not in r.stderr
    r = ok(run("nodes", "--bogus"), 3)
    assert r.stderr.startswith("ncclguard: error: ncclguard nodes: No such option")
    assert "(see ncclguard nodes --help)" in r.stderr


def test_an_inventory_that_cannot_be_opened_says_why(
        env: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 46: with no config file the error named a default path but not that no
    config was read; an inventory the user may not read said "unable to open database
    file", not "permission denied" nor what to do."""
    import subprocess
    import sys

    from ncclguard import config as configmod

    monkeypatch.setattr(configmod, "DEFAULT_CONFIG_PATH", tmp_path / "none.toml")
    r = run_cli("nodes", env={"NCCLGUARD_CONFIG": None, "NCCLGUARD_DB": None,
                              "XDG_STATE_HOME": str(tmp_path / "state")})
    assert r.exit_code == 3
    assert (f"no config file was read: {tmp_path / 'none.toml'} does not exist" in r.stderr
            and "--db FILE" in r.stderr), r.stderr
    # a copy of the inventory only root may read, read by a user (uid 1000), in a
    # directory that user can reach (pytest's own is root's alone)
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="ncclguard-perm-", dir="/tmp"))
    shared.chmod(0o755)
    (shared / "config.toml").write_text("")
    db = shared / "inv.db"
    db.write_bytes(env[0].read_bytes())
    db.chmod(0o600)
    r2 = subprocess.run(
        ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", sys.executable, "-m",
         "ncclguard.cli", "--db", str(db), "--config", str(shared / "config.toml"), "nodes"],
        capture_output=True, text=True, timeout=60, cwd="/",
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert r2.returncode == 3, (r2.stdout, r2.stderr)
    import shutil

    shutil.rmtree(shared)
    assert "permission denied: this user (uid 1000) cannot read it" in r2.stderr, r2.stderr


def test_one_node_is_one_node(run: Run) -> None:
    """Issue 46: "1 nodes" in the node set line, the nodes table and the classes line."""
    for cmd in (("nodes", "--nodes", "n01"), ("classes", "--nodes", "n01")):
        text = ok(run(*cmd)).stdout
        assert "1 nodes" not in text and "1 node" in text, (cmd, text)
    assert "1 node in 1 class;" in ok(run("classes", "--nodes", "n01")).stdout


def test_a_record_in_a_cell_is_json_in_every_view() -> None:
    """Issue 46: ``history`` printed a Python dict (``{'a': 1}``) where ``diff`` printed
    JSON: one rendering, the table cell's, for both (and a list of records too)."""
    from ncclguard.cli.output import cell

    assert cell({"name": "IBext_v8", "abis": [8, 7]}) == '{"abis": [8, 7], "name": "IBext_v8"}'
    assert cell([{"b": None}, 3]) == '{"b": null},3'
