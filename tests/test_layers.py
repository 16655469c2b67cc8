"""The layering contract (pyproject.toml, ``[tool.importlinter]``): it holds on the tree,
and it fails when a lower layer imports a higher one, inside a function too, or when the
node's programs and the controller's services import each other."""

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
        [str(LINT), "--no-cache", str(root / "pyproject.toml")],
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
    assert "2 kept, 0 broken" in r.stdout


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
        # the controller's services may not import the node's programs
        ("inventoryd/controller/features.py", "    from inventoryd.node import daemon\n",
         "inventoryd.controller.features -> inventoryd.node.daemon"),
    ],
)
def test_an_upward_import_breaks_the_contract(
    tree: Path, module: str, line: str, upward: str
) -> None:
    path = tree / module
    path.write_text(path.read_text() + f"\n\ndef _upward() -> None:\n{line}")
    r = _lint(tree)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 kept, 1 broken" in r.stdout
    assert upward in r.stdout.replace("\n", " ")


# ------------------------------------------------------------------------- long files

#: a file this long says why it is one file, in its module docstring (or, for lua and
#: shell, its first comment block): a paragraph that starts with this
LONG_LINES = 500
LONG_REASON = "Over 500 lines:"


def long_files_without_a_reason(root: Path = REPO) -> list[str]:
    """``path (N lines)`` of each Python, lua and shell file of the repository longer than
    :data:`LONG_LINES` whose head does not give its reason (:data:`LONG_REASON`)."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z", "--", "*.py",
                          "*.lua", "*.sh"], cwd=root, capture_output=True, check=True,
                         timeout=60).stdout.decode()
    bad = []
    for name in filter(None, out.split("\0")):
        path = root / name
        if name.startswith("tests/data/") or not path.is_file():
            continue
        lines = path.read_text(errors="replace").splitlines()
        if len(lines) > LONG_LINES and LONG_REASON not in "\n".join(lines[:80]):
            bad.append(f"{name} ({len(lines)} lines)")
    return bad


def test_every_long_file_says_why_it_is_one_file() -> None:
    assert not long_files_without_a_reason(), long_files_without_a_reason()


def test_a_long_file_without_a_reason_is_found(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, timeout=60)
    (tmp_path / "long.py").write_text('"""A module."""\n' + "x = 1\n" * LONG_LINES)
    (tmp_path / "why.py").write_text(f'"""A module.\n\n{LONG_REASON} a reason."""\n'
                                     + "x = 1\n" * LONG_LINES)
    (tmp_path / "short.py").write_text("x = 1\n" * 10)
    assert long_files_without_a_reason(tmp_path) == [f"long.py ({LONG_LINES + 1} lines)"]
