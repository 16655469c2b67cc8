"""The shipped systemd files: verify clean, security exposure <= 2.0, sysusers/tmpfiles apply."""

from __future__ import annotations

import os
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
JOBMAPS = SYSTEMD / "ncclguard-jobmaps.service"
CANARY = SYSTEMD / "ncclguard-canary.service"
UNITS = {UNIT: "run", COLLECTOR: "collect", FEATURES: "features", JOBMAPS: "jobmaps",
         CANARY: "canary"}

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze is not installed")


def _unit_copy(tmp_path: Path, unit: Path = UNIT) -> Path:
    """The unit with ExecStart pointing at a file that exists here (verify checks it), and
    its shipped drop-ins beside it (systemd-analyze reads them from there)."""
    text = unit.read_text()
    assert f"ExecStart=/opt/ncclguard/bin/ncclguard-inventoryd {UNITS[unit]}\n" in text
    exe = tmp_path / "ncclguard-inventoryd"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    out = tmp_path / unit.name
    out.write_text(text.replace("/opt/ncclguard/bin/ncclguard-inventoryd", str(exe)))
    dropins = SYSTEMD / f"{unit.name}.d"
    if dropins.is_dir():
        shutil.copytree(dropins, tmp_path / dropins.name, dirs_exist_ok=True)
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


def test_the_jobmaps_unit_holds_cap_sys_ptrace_alone_and_never_ptrace() -> None:
    """Issue 42: the one capability (reading other users' maps) in the one unit that needs
    it; the system calls that would use it to attach are filtered out, it has no network
    and no user namespace of its own (where the capability would reach no host process)."""
    lines = [x.strip() for x in JOBMAPS.read_text().splitlines()
             if x.strip() and not x.startswith("#")]
    assert "CapabilityBoundingSet=CAP_SYS_PTRACE" in lines
    assert "AmbientCapabilities=CAP_SYS_PTRACE" in lines
    assert "NoNewPrivileges=yes" in lines and "PrivateNetwork=yes" in lines
    assert any(x.startswith("SystemCallFilter=~") and "@debug" in x for x in lines)
    assert not any(x.startswith(("PrivateUsers=yes", "ReadWritePaths=")) for x in lines)
    assert "User=ncclguard" in lines and "RuntimeDirectory=ncclguard-jobmaps" in lines
    for unit in (UNIT, COLLECTOR, FEATURES, CANARY):
        text = unit.read_text()
        assert "CAP_SYS_PTRACE" not in text, unit
        assert "\nCapabilityBoundingSet=\n" in text, unit  # none at all


def test_the_canary_unit_is_a_plain_slurm_user_on_the_controller() -> None:
    """Issue 43: the canary service submits, releases and cancels its own jobs as the
    ``ncclguard`` user (no Slurm admin, no capability), so it needs what a Slurm client
    needs and nothing more: the network to slurmctld and munged's socket (no
    ``PrivateNetwork=``, no ``IPAddressDeny=``), Slurm's config read-only; it writes only
    the inventory's directory (the canary's tables), as the collector does."""
    lines = [x.strip() for x in CANARY.read_text().splitlines()
             if x.strip() and not x.startswith("#")]
    assert "User=ncclguard" in lines and "Group=ncclguard" in lines
    assert "Type=notify" in lines and any(x.startswith("WatchdogSec=") for x in lines)
    assert [x for x in lines if x.startswith("ReadWritePaths=")] == [
        "ReadWritePaths=/var/lib/ncclguard"]
    assert "ProtectSystem=strict" in lines and "NoNewPrivileges=yes" in lines
    assert "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6" in lines
    assert not any(x.startswith(("PrivateNetwork=yes", "IPAddressDeny=")) for x in lines)
    assert "UMask=0022" in lines  # the inventory's -wal and -shm stay readable by the gate
    features = [x.strip() for x in FEATURES.read_text().splitlines()
                if x.strip() and not x.startswith("#")]
    # a Slurm client like the features daemon, with the same filter, as another user
    for kind in ("SystemCallFilter=", "RestrictAddressFamilies=", "PrivateUsers="):
        assert [x for x in lines if x.startswith(kind)] == [
            x for x in features if x.startswith(kind)], kind


def test_every_shipped_dropin_names_a_shipped_unit_and_is_in_the_wheel() -> None:
    units = {p.name for p in SYSTEMD.glob("*.service")}
    dropins = sorted(SYSTEMD.glob("*.service.d/*.conf"))
    assert dropins
    data_files = (SYSTEMD.parent / "pyproject.toml").read_text()
    for d in dropins:
        assert d.parent.name[: -len(".d")] in units, d
        assert f'"systemd/{d.parent.name}/*.conf"' in data_files, d  # installed with the wheel


def test_the_dropins_change_what_they_say(tmp_path: Path) -> None:
    """shared-spool.conf: the spool is the node unit's one writable path (the reset line
    first); textfile.conf: node_exporter's directory is added, optional ("-")."""
    node = (SYSTEMD / "ncclguard-inventoryd.service.d" / "shared-spool.conf").read_text()
    rw = [x for x in node.splitlines() if x.startswith("ReadWritePaths=")]
    assert rw == ["ReadWritePaths=", "ReadWritePaths=/shared/ncclguard/spool"]
    assert "RequiresMountsFor=/shared/ncclguard/spool" in node
    for unit in ("ncclguard-inventoryd", "ncclguard-collector"):
        text = (SYSTEMD / f"{unit}.service.d" / "textfile.conf").read_text()
        assert [x for x in text.splitlines() if x.startswith("ReadWritePaths=")] == [
            "ReadWritePaths=-/var/lib/prometheus/node-exporter"]


def _apply_tmpfiles(root: Path, *files: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-tmpfiles", "--create", f"--root={root}", *files],
                          capture_output=True, text=True, timeout=60)


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
    # the controller's: the audit directory, owned by SlurmUser (Debian's slurm user)
    shutil.copy(SYSTEMD / "ncclguard-controller.tmpfiles.conf",
                root / "usr/lib/tmpfiles.d/ncclguard-controller.conf")
    (root / "usr/lib/sysusers.d/slurm.conf").write_text('u slurm 64030 "SLURM" /nonexistent\n')
    subprocess.run(["systemd-sysusers", f"--root={root}"], check=True, capture_output=True,
                   timeout=60)
    passwd = (root / "etc/passwd").read_text()
    assert re.search(r"^ncclguard:x:\d+:\d+:.*:/usr/sbin/nologin$", passwd, re.M)
    r = _apply_tmpfiles(root)
    assert r.returncode == 0, r.stderr
    for d in ("var/lib/ncclguard", "var/lib/ncclguard/spool"):
        st = (root / d).stat()
        assert stat.S_IMODE(st.st_mode) == 0o755  # readable by the gate, never o+w
        assert not st.st_mode & stat.S_IWOTH
    # the enroot hook's records: users add files, cannot list or remove others'
    st = (root / "var/lib/ncclguard/spool/containers").stat()
    assert stat.S_IMODE(st.st_mode) == 0o1733
    assert not (root / "var/cache/ncclguard").exists()  # nothing uses it
    ids = {ln.split(":")[0]: int(ln.split(":")[2]) for ln in passwd.splitlines()}
    groups = {ln.split(":")[0]: int(ln.split(":")[2])
              for ln in (root / "etc/group").read_text().splitlines()}
    # the audit trail: SlurmUser's, group ncclguard (the collector reads it), setgid
    st = (root / "var/log/ncclguard").stat()
    assert stat.S_IMODE(st.st_mode) == 0o2750
    assert (st.st_uid, st.st_gid) == (ids["slurm"], groups["ncclguard"])
    # an audit file of the older layout (slurm:slurm) gets the collector's group
    audit = root / "var/log/ncclguard/decisions.jsonl"
    audit.write_text("{}\n")
    os.chown(audit, ids["slurm"], groups["slurm"])
    audit.chmod(0o600)
    assert _apply_tmpfiles(root).returncode == 0
    st = audit.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o640, groups["ncclguard"])
