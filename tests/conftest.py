"""The suite's hooks and its shared fixtures.

The fixtures and helpers live in ``tests/helpers/`` (docs/development.md, "The tests");
the modules that hold fixtures are loaded here as plugins (``pytest_plugins``), so that
every test module sees them without importing them. Here: which files are collected, and
the rule that under ``NCCLGUARD_REQUIRE_PARTS=1`` any skip fails the run.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

# the helpers' own asserts get pytest's messages too (before the first import of them)
pytest.register_assert_rewrite("helpers")
from helpers.parts import REQUIRE_PARTS  # noqa: E402

pytest_plugins = ["helpers.parts", "helpers.munge", "helpers.slurm", "helpers.collector",
                  "helpers.exporter"]

# The install test boots its own Debian root with systemd-nspawn, which does not run in the
# chroot of the second Slurm (scripts/slurm-root.sh): it runs once per CI run, in the
# first pass on the host, and is not collected in the chroot (not a skip: it is not there).
collect_ignore = (["test_install_systemd.py"] if os.environ.get("NCCLGUARD_IN_SLURM_ROOT")
                  else [])

# A part that cannot be had (helpers.parts.unavailable) fails the test under
# NCCLGUARD_REQUIRE_PARTS=1 (scripts/test.sh, so CI), and any skip at all fails the run,
# so that a missing part can never turn tests into skips and the run green.
_SKIPPED: list[str] = []


def _note_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        _SKIPPED.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _note_skip(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _note_skip(report)  # a whole module skipped (allow_module_level, importorskip)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if REQUIRE_PARTS and _SKIPPED:
        terminalreporter.section("NCCLGUARD_REQUIRE_PARTS=1: skipped, so the run fails")
        for line in _SKIPPED:
            terminalreporter.line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if REQUIRE_PARTS and _SKIPPED and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
