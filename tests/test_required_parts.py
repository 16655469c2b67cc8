"""A real part that cannot be had (here: the NCCL wheels, with an empty cache and no
package index) fails the run under NCCLGUARD_REQUIRE_PARTS=1 (scripts/test.sh, CI), and
is a skip that says why otherwise. Each case runs pytest itself, on one real-library test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ONE_TEST = "tests/test_probe_nccl.py::test_ncclgetversion_subprocess_agrees"


def _no_wheels_env(tmp_path: Path) -> dict[str, str]:
    """This environment without the NCCL wheels: an empty cache and no package index."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "NCCLGUARD_"))}
    env.update({
        "NCCLGUARD_TEST_CACHE": str(tmp_path / "empty-cache"),  # no wheel, no library
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",  # nothing listens there
        "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "",  # no pip.conf, no local wheels
        "PIP_NO_CACHE_DIR": "1", "PIP_RETRIES": "0", "PIP_DEFAULT_TIMEOUT": "3",
    })  # fmt: skip
    return env


def _run_without_wheels(tmp_path: Path, require: bool) -> subprocess.CompletedProcess[str]:
    env = _no_wheels_env(tmp_path)
    if require:
        env["NCCLGUARD_REQUIRE_PARTS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         f"--basetemp={tmp_path / 'inner'}", ONE_TEST],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_a_missing_part_fails_the_run_when_required(tmp_path: Path) -> None:
    r = _run_without_wheels(tmp_path, require=True)
    assert r.returncode == 1, r.stdout[-2000:]
    assert "cannot download nvidia-nccl" in r.stdout  # names the part
    assert "NCCLGUARD_REQUIRE_PARTS=1" in r.stdout
    assert " failed" in r.stdout and " skipped" not in r.stdout


def test_a_missing_part_is_a_skip_that_says_why_otherwise(tmp_path: Path) -> None:
    r = _run_without_wheels(tmp_path, require=False)
    assert r.returncode == 0, r.stdout[-2000:]
    assert " skipped" in r.stdout and " failed" not in r.stdout


def test_any_skip_fails_a_required_run(tmp_path: Path) -> None:
    """A skip from anywhere (a skipif marker, a kernel that lacks a behaviour) fails the
    run under NCCLGUARD_REQUIRE_PARTS=1, naming the test and its reason."""
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n\n@pytest.mark.skipif(True, reason='no such kernel here')\n"
        "def test_x():\n    pass\n\ndef test_y():\n    pass\n"
    )
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    base = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    base.pop("NCCLGUARD_REQUIRE_PARTS", None)

    def pytest_there(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
             "--rootdir", str(tmp_path), str(tmp_path / "test_skips.py")],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    r = pytest_there({**base, "NCCLGUARD_REQUIRE_PARTS": "1"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "NCCLGUARD_REQUIRE_PARTS=1: skipped, so the run fails" in r.stdout
    assert "test_skips.py::test_x: Skipped: no such kernel here" in r.stdout
    r = pytest_there(base)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_up_front_fetch_stops_naming_the_part(tmp_path: Path) -> None:
    """scripts/test.sh runs this before the tests: no wheel and no index is exit 2,
    with the library and the PyPI project named."""
    r = subprocess.run([sys.executable, "-m", "devtools.ncclwheels", "fetch"], cwd=ROOT,
                       env=_no_wheels_env(tmp_path), capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "the real part libnccl.so.2 2.18.3 (nvidia-nccl-cu12==2.18.3) cannot be had" in r.stderr
