"""ncclguard/slurm/conf.py: one setting of slurm.conf as slurmctld reads it (the gate's
StateSaveLocation), bounded and never blocking."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ncclguard.slurm.conf import MAX_CONF_BYTES, conf_path, setting


def test_the_last_setting_wins_keys_are_case_insensitive_and_comments_are_not_read(
    tmp_path: Path,
) -> None:
    conf = tmp_path / "slurm.conf"
    conf.write_text("# StateSaveLocation=/commented\n"
                    "ClusterName=c StateSaveLocation=/first\n"
                    "statesavelocation=\"/var/spool/slurm ctld\"  # quoted\n"
                    "NodeName=n[1-4] Features=a StateSaveLocationX=/not-it\n")
    assert setting(str(conf), "StateSaveLocation") == ("/var/spool/slurm ctld", None)
    conf.write_text("StateSaveLocation=/a\nStateSaveLocation=/b # later\n")
    assert setting(str(conf), "StateSaveLocation") == ("/b", None)
    conf.write_text("SlurmUser=slurm\n")
    assert setting(str(conf), "StateSaveLocation") == (None, None)


def test_a_fifo_a_directory_a_huge_file_and_a_missing_one_are_named(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[tuple[str | None, str | None]] = []
    t = threading.Thread(target=lambda: got.append(setting(str(fifo), "StateSaveLocation")))
    t.start()
    t.join(5)
    assert not t.is_alive(), "a FIFO held the read"
    assert got == [(None, f"{fifo}: not a regular file")]
    assert setting(str(tmp_path), "X") == (None, f"{tmp_path}: not a regular file")
    huge = tmp_path / "huge.conf"
    with huge.open("wb") as f:
        f.truncate(MAX_CONF_BYTES + 1)
    assert setting(str(huge), "X") == (
        None, f"{huge}: {MAX_CONF_BYTES + 1} bytes, more than {MAX_CONF_BYTES} read")
    value, why = setting(str(tmp_path / "none"), "X")
    assert value is None and why is not None and why.startswith(f"{tmp_path / 'none'}: cannot open")


def test_the_conf_path_is_the_gates_then_slurm_conf_then_slurms(monkeypatch) -> None:
    monkeypatch.setenv("SLURM_CONF", "/env/slurm.conf")
    assert conf_path("/cfg/slurm.conf") == "/cfg/slurm.conf"
    assert conf_path("") == "/env/slurm.conf"
    monkeypatch.delenv("SLURM_CONF")
    assert conf_path("") == "/etc/slurm/slurm.conf"
