"""The gate (PrologSlurmctld) run as Slurm runs it, without a cluster: a real process
(``python -I -m prolog.gate``) with a job's environment, a config and an inventory under
the test's directory."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from helpers.fingerprints import fingerprint
from ncclguard import audit
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory

#: the job's environment, as slurmctld gives it to PrologSlurmctld
ENV = {
    "SLURM_JOB_ID": "77",
    "SLURM_JOB_NODELIST": "n[1-3]",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_JOB_PARTITION": "debug",
    "SLURM_JOB_USER": "alice",
    "SLURM_JOB_UID": "1000",
}


def run_gate(
    tmp_path: Path, config: str = "", env: dict[str, str] | None = None, timeout: float = 30
) -> tuple[subprocess.CompletedProcess[str], float]:
    """The gate on job 77 (``ENV``, updated by ``env``), its ``[gate]`` section ``config``,
    the inventory ``tmp_path/inventory.db``, its audit file ``tmp_path/audit.jsonl``;
    what it did and the seconds it took."""
    conf = tmp_path / "gate.toml"
    conf.write_text(f'[gate]\naudit_log = "{tmp_path / "audit.jsonl"}"\n{config}\n')
    full = {
        "PATH": "/usr/bin:/bin",
        "NCCLGUARD_CONFIG": str(conf),
        "NCCLGUARD_DB": str(tmp_path / "inventory.db"),
        **ENV,
        **(env or {}),
    }
    t = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-I", "-m", "prolog.gate"],
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return r, time.monotonic() - t


def inventory(tmp_path: Path, odd: dict[str, str] | None = None) -> None:
    """n1..n4 on NCCL 2.21.5, but for the versions in ``odd``, in ``tmp_path/inventory.db``."""
    with Inventory(tmp_path / "inventory.db", values=GATE_VALUES) as inv:
        for h in ("n1", "n2", "n3", "n4"):
            inv.upsert(fingerprint(h, nccl=(odd or {}).get(h, "2.21.5")))


def last(tmp_path: Path) -> dict:
    """The last record of the gate's audit file."""
    return audit.read(tmp_path / "audit.jsonl")[-1]
