"""The tests' shared code lives in ``tests/helpers/`` (docs/development.md, "The tests"): no
file under tests/ or bench/ imports a test module (``test_*``) or a conftest, nor the
shared code by another name than ``helpers.*`` (``tests.helpers.x`` would be a second copy
of ``helpers.x``, with its own state). What two tests share is a helper or a fixture of a
plugin that ``tests/conftest.py`` loads, never one test module reaching into another.

:func:`problems` reads each file with ``ast``: imports at the top and inside functions,
``importlib.import_module``/``__import__`` of a constant name, and the scripts a test
runs in a child Python (string constants, read line by line). And the one wait-until
(``helpers.wait``) says what it waited for when it gives up.
"""

from __future__ import annotations

import ast
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from helpers.wait import wait_until

REPO = Path(__file__).resolve().parents[1]
#: the code that may import only helpers.*: the tests, their helpers and the benchmarks
ROOTS = ("tests", "bench")
#: an import in a script held in a string: ``from test_x import y``, ``import conftest``
SCRIPT_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import\b|import\s+([\w., ]+))", re.M)


def forbidden(module: str) -> str | None:
    """Why importing ``module`` breaks the rule, or None."""
    first, _, _ = module.partition(".")
    last = module.rsplit(".", 1)[-1]
    if last.startswith("test_") or first.startswith("test_"):
        return f"imports the test module {module}"
    if first.startswith("conftest") or last.startswith("conftest"):
        return f"imports {module} (a conftest: its fixtures come as plugins, its helpers " \
               "from helpers.*)"
    if first == "tests":
        return f"imports {module} (the shared code is imported as helpers.*, once)"
    return None


def _imported(tree: ast.AST, scripts: bool = True) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                yield node.lineno, node.module
            elif node.level:  # from . import test_x: each name may be a module
                yield from ((node.lineno, a.name) for a in node.names)
                if node.module:
                    yield node.lineno, node.module
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and _is_import_call(node.func):
            yield node.lineno, node.args[0].value
        elif scripts and isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and "import" in node.value:
            for m in SCRIPT_IMPORT.finditer(node.value):
                line = node.lineno + node.value.count("\n", 0, m.start())
                names = [m[1]] if m[1] else [n.split()[0] for n in m[2].split(",") if n.strip()]
                for name in names:
                    yield line, name


def _is_import_call(func: ast.expr) -> bool:
    """``importlib.import_module(...)``, ``import_module(...)``, ``__import__(...)``."""
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name in ("import_module", "__import__")


def problems(files: Iterable[Path], root: Path = REPO) -> list[str]:
    """``path:line: why`` for each import in ``files`` that breaks the rule. The strings
    of this file are examples of what it forbids, not scripts: its imports alone count."""
    out = []
    for path in files:
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except SyntaxError as e:
            out.append(f"{path.relative_to(root)}:{e.lineno}: not Python: {e.msg}")
            continue
        for line, module in _imported(tree, scripts=path.resolve() != Path(__file__).resolve()):
            why = forbidden(module)
            if why:
                out.append(f"{path.relative_to(root)}:{line}: {why}")
    return out


def python_files(root: Path = REPO) -> list[Path]:
    return sorted(p for top in ROOTS for p in (root / top).rglob("*.py")
                  if "__pycache__" not in p.parts)


def test_no_test_or_benchmark_imports_a_test_module() -> None:
    files = python_files()
    assert len(files) > 80 and REPO / "tests" / "helpers" / "fingerprints.py" in files
    found = problems(files)
    assert not found, "share it through tests/helpers/ instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("code", "why"),
    [
        ("from test_store import make_fp\n", "1: imports the test module test_store"),
        ("import test_collector\n", "1: imports the test module test_collector"),
        ("def f():\n    from test_exporter import exporter as e\n",
         "2: imports the test module test_exporter"),
        ("from tests.test_gate_units import run_gate\n",
         "1: imports the test module tests.test_gate_units"),
        ("from conftest import unavailable\n", "1: imports conftest (a conftest"),
        ("from tests.conftest import build_plugin\n", "1: imports tests.conftest (a conftest"),
        ("from tests.helpers.fingerprints import fingerprint\n",
         "1: imports tests.helpers.fingerprints (the shared code is imported as helpers.*"),
        ("import importlib\nm = importlib.import_module('test_sched')\n",
         "2: imports the test module test_sched"),
        ('SCRIPT = """\nimport os, sys\nfrom test_store import make_fp\n"""\n',
         "3: imports the test module test_store"),
        ('SCRIPT = "import json, test_spool as s"\n', "1: imports the test module test_spool"),
        ("from . import test_cli_inventory\n", "1: imports the test module test_cli_inventory"),
    ],
    ids=["from", "import", "in-a-function", "tests.test_x", "conftest", "tests.conftest",
         "tests.helpers", "import_module", "script", "script-line", "relative"],
)
def test_an_import_of_a_test_module_is_found(tmp_path: Path, code: str, why: str) -> None:
    bad = tmp_path / "tests" / "test_bad.py"
    bad.parent.mkdir()
    bad.write_text(code)
    (got,) = problems(python_files(tmp_path), tmp_path)
    assert got.startswith(f"tests/test_bad.py:{why}"), got


def test_imports_of_helpers_and_other_modules_pass(tmp_path: Path) -> None:
    ok = tmp_path / "bench" / "bench_ok.py"
    ok.parent.mkdir()
    ok.write_text("import test\nimport testing\nfrom helpers.fingerprints import fingerprint\n"
                  "from helpers import REPO\nimport contest_x\nfrom . import helpers_x\n"
                  "from ncclguard.store import Inventory\n"
                  'TEXT = "nothing to import here; a test_store.py is a file"\n')
    assert problems(python_files(tmp_path), tmp_path) == []


def test_wait_until_returns_what_it_waited_for_and_names_it_when_it_times_out() -> None:
    calls: list[int] = []

    def third() -> list[int] | None:
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionRefusedError  # not listening yet: counts as false
        return calls if len(calls) >= 3 else None

    assert wait_until(third, 5, "the third call", interval=0.01, ignore=(OSError,)) == [1, 1, 1]
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"^timed out after 0.2 s waiting for the flag\n"
                                             r"the flag is still down$"):
        wait_until(lambda: False, 0.2, "the flag", interval=0.05,
                   detail=lambda: "the flag is still down")
    assert 0.2 <= time.monotonic() - t0 < 5

    def refused() -> bool:
        raise ConnectionRefusedError

    with pytest.raises(ConnectionRefusedError):  # not ignored unless asked
        wait_until(refused, 5, "a server")
