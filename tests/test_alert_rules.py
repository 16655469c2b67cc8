"""The shipped alerting rules (prometheus/ncclguard.rules.yml), with Prometheus's own
promtool: they load, their unit tests pass, every alert has series that must fire it and
series that must not, those tests can fail, and every metric a rule reads is one the
exporter serves. promtool comes with Debian's `prometheus` package; without it these
tests skip, or fail under NCCLGUARD_REQUIRE_PARTS=1 (scripts/test.sh)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers.exporter import exporter
from helpers.exporter import samples as exported
from helpers.parts import unavailable

from inventoryd.controller.exporter import Served
from ncclguard import audit
from ncclguard import config as configmod

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "prometheus" / "ncclguard.rules.yml"
TESTS = REPO / "prometheus" / "ncclguard.rules.test.yml"


def promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        unavailable("promtool is not installed (apt-get install prometheus)")
    return exe


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def alerts() -> list[str]:
    return re.findall(r"^\s+- alert: (\w+)$", RULES.read_text(), re.M)


def test_the_rules_load() -> None:
    r = run("check", "rules", str(RULES), cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in r.stdout


def test_the_rules_unit_tests_pass() -> None:
    r = run("test", "rules", TESTS.name, cwd=TESTS.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_has_series_that_fire_it_and_series_that_must_not() -> None:
    text = TESTS.read_text()
    cases = re.findall(r"alertname: (\w+)\n\s+exp_alerts:( \[\])?", text)
    fires = {a for a, empty in cases if not empty}
    silent = {a for a, empty in cases if empty}
    names = set(alerts())
    assert len(names) == 20
    assert names == fires, names ^ fires
    assert names == silent, names ^ silent
    # and each one names what to run next
    for block in RULES.read_text().split("- alert: ")[1:]:
        assert any(f"`{cmd} " in block for cmd in ("ncclguard", "systemctl", "journalctl")), \
            block[:60]
        assert "summary:" in block and "description:" in block and "runbook_url:" in block


def _mutated(tmp_path: Path, alert: str, expr: str) -> subprocess.CompletedProcess[str]:
    """The unit tests against a copy of the rules where ``alert`` has ``expr``."""
    text = RULES.read_text()
    head, sep, rest = text.partition(f"- alert: {alert}\n")
    # the expression: one line, or a folded block (each of its lines indented deeper)
    body, n = re.subn(r"^( +)expr: (?:>-\n(?:\1 +\S.*\n)+|.*\n)",
                      lambda m: f"{m.group(1)}expr: {expr}\n", rest, count=1, flags=re.M)
    assert n == 1
    (tmp_path / RULES.name).write_text(head + sep + body)
    check = run("check", "rules", RULES.name, cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr  # fails for the expression
    shutil.copy(TESTS, tmp_path / TESTS.name)
    return run("test", "rules", TESTS.name, cwd=tmp_path)


@pytest.mark.parametrize("alert", alerts())
def test_the_unit_tests_catch_an_alert_that_always_or_never_fires(
    alert: str, tmp_path: Path
) -> None:
    always = _mutated(tmp_path, alert, "vector(1)")
    assert always.returncode != 0 and f"alertname: {alert}" in always.stdout + always.stderr
    never = _mutated(tmp_path, alert, "vector(1) > 2")
    assert never.returncode != 0 and f"alertname: {alert}" in never.stdout + never.stderr


def test_every_metric_a_rule_reads_is_one_the_exporter_serves(exporter_inventory: Path,
                                                               tmp_path: Path) -> None:
    # every optional part on: the canary's metrics are served while [canary] is enabled
    cfg = configmod.Config(canary=configmod.CanaryConfig(enabled=True, command=("true",)))
    ex = exporter(exporter_inventory, tmp_path, config=cfg)
    audit.append(ex.audit.path, {"job": 1, "decision": "refuse", "action": "steer"})
    ex.stats.last_scan = 0.0  # as after a scan: the lag is served
    served = {name for name, _ in exported(Served(ex).text())}
    read = set(re.findall(r"\bncclguard_[a-z_]+", "\n".join(
        line for line in RULES.read_text().splitlines() if "expr:" in line or
        line.strip().startswith(("sum", "or "))
    )))
    assert read, "no metric found in the rules"
    assert read <= served, read - served
