"""The shipped systemd files: verify clean, security exposure <= 2.0, sysusers/tmpfiles apply."""

from __future__ import annotations

import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

SYSTEMD = Path(__file__).resolve().parents[1] / "systemd"
UNIT = SYSTEMD / "ncclguard-inventoryd.service"
COLLECTOR = SYSTEMD / "ncclguard-collector.service"
FEATURES = SYSTEMD / "ncclguard-features.service"
UNITS = {UNIT: "run", COLLECTOR: "collect", FEATURES: "features"}

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze is not installed")


def _unit_copy(tmp_path: Path, unit: Path = UNIT) -> Path:
    """The unit with ExecStart pointing at a file that exists here (verify checks it)."""
    text = unit.read_text()
    assert f"ExecStart=/usr/local/bin/ncclguard-inventoryd {UNITS[unit]}\n" in text
    exe = tmp_path / "ncclguard-inventoryd"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    out = tmp_path / unit.name
    out.write_text(text.replace("/usr/local/bin/ncclguard-inventoryd", str(exe)))
    return out


@needs_analyze
@pytest.mark.parametrize("unit", list(UNITS), ids=lambda u: u.name)
def test_systemd_analyze_verify_is_clean(tmp_path: Path, unit: Path) -> None:
    r = subprocess.run(["systemd-analyze", "verify", str(_unit_copy(tmp_path, unit))],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "", r.stderr


@needs_analyze
@pytest.mark.parametrize("unit", list(UNITS), ids=lambda u: u.name)
def test_security_exposure_at_most_2(tmp_path: Path, unit: Path) -> None:
    r = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(_unit_copy(tmp_path, unit))],
        capture_output=True, text=True, timeout=60,
    )
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout)
    assert m, r.stdout + r.stderr
    assert float(m.group(1)) <= 2.0, r.stdout


def test_unit_runs_as_the_sysusers_user_with_one_readwrite_path() -> None:
    unit = UNIT.read_text()
    lines = [x.strip() for x in unit.splitlines() if x.strip() and not x.startswith("#")]
    assert "Type=notify" in lines and "User=ncclguard" in lines
    assert [x for x in lines if x.startswith("ReadWritePaths=")] == [
        "ReadWritePaths=/var/lib/ncclguard"]
    assert any(x.startswith("WatchdogSec=") for x in lines)
    collector = [x.strip() for x in COLLECTOR.read_text().splitlines()
                 if x.strip() and not x.startswith("#")]
    assert "User=ncclguard" in collector and "ProtectHome=yes" in collector
    assert [x for x in collector if x.startswith("ReadWritePaths=")] == [
        "ReadWritePaths=/var/lib/ncclguard"]  # the spool is only read
    sysusers = (SYSTEMD / "ncclguard.sysusers.conf").read_text()
    assert re.search(r"^u ncclguard ", sysusers, re.M)


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None
                    or shutil.which("systemd-tmpfiles") is None,
                    reason="systemd-sysusers/systemd-tmpfiles not installed")
def test_sysusers_and_tmpfiles_apply_to_an_empty_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    for kind in ("sysusers", "tmpfiles"):
        d = root / "usr/lib" / f"{kind}.d"
        d.mkdir(parents=True)
        shutil.copy(SYSTEMD / f"ncclguard.{kind}.conf", d / "ncclguard.conf")
    subprocess.run(["systemd-sysusers", f"--root={root}"], check=True, capture_output=True,
                   timeout=60)
    passwd = (root / "etc/passwd").read_text()
    assert re.search(r"^ncclguard:x:\d+:\d+:.*:/usr/sbin/nologin$", passwd, re.M)
    r = subprocess.run(["systemd-tmpfiles", "--create", f"--root={root}"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for d in ("var/lib/ncclguard", "var/lib/ncclguard/spool"):
        st = (root / d).stat()
        assert stat.S_IMODE(st.st_mode) == 0o755  # readable by the gate, never o+w
        assert not st.st_mode & stat.S_IWOTH
