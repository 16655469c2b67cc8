"""The layering contract (pyproject.toml, ``[tool.importlinter]``): it holds on the tree,
and it fails when a lower layer imports a higher one, inside a function too."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")
PACKAGES = ("ncclguard", "prolog", "inventoryd", "devtools")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the packages and the contract, importable from ``tmp_path`` alone."""
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, tmp_path / pkg,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_tree_keeps_the_contract(tree: Path) -> None:
    r = _lint(tree)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 kept, 0 broken" in r.stdout


@pytest.mark.parametrize(
    ("module", "line", "upward"),
    [
        # the store may not import the policy (one layer, two independent packages)
        ("ncclguard/store/rows.py", "    from ncclguard.policy import node_values\n",
         "ncclguard.store.rows -> ncclguard.policy"),
        # the core may not import an application, not even inside a function
        ("ncclguard/config.py", "    import prolog.gate\n", "ncclguard.config -> prolog.gate"),
        # an application may not import another one
        ("prolog/steer.py", "    from ncclguard.cli import main\n",
         "prolog.steer -> ncclguard.cli"),
    ],
)
def test_an_upward_import_breaks_the_contract(
    tree: Path, module: str, line: str, upward: str
) -> None:
    path = tree / module
    path.write_text(path.read_text() + f"\n\ndef _upward() -> None:\n{line}")
    r = _lint(tree)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "0 kept, 1 broken" in r.stdout
    assert upward in r.stdout.replace("\n", " ")
