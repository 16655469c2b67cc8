"""devtools.devcluster's ports: outside the ephemeral range, and tried again when taken."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from helpers.slurm import require_slurm

from devtools import devcluster
from devtools.devcluster import DevCluster, port_range


@pytest.mark.parametrize("local", ["32768 60999", "1024 65000", "15000 60999", "40000 65535",
                                   "60000 61000"])
def test_ports_are_chosen_outside_the_ephemeral_range(local: str) -> None:
    first, last = port_range(5, local)
    lo, hi = map(int, local.split())
    assert 1024 < first <= last and last + 5 - 1 <= 65535
    assert last + 5 - 1 < lo or first > hi  # every block it can give is outside [lo, hi]
    assert last - first >= 95  # room to choose


@pytest.mark.parametrize("local", ["1024 65535", "10500 65530"])
def test_when_almost_every_port_is_ephemeral_any_will_do(local: str) -> None:
    assert port_range(5, local) == (1024, 65530)  # start() tries again if one was taken


@pytest.mark.slurm
def test_a_port_taken_after_the_check_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_slurm()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    real = devcluster._free_port_block
    calls: list[int] = []

    def first_one_taken(count: int) -> int:
        calls.append(count)
        return port if len(calls) == 1 else real(count)  # slurmctld's port is in use

    monkeypatch.setattr(devcluster, "_free_port_block", first_one_taken)
    try:
        with DevCluster(tmp_path / "c", nodes=1, prolog=False) as c:
            assert c.ctld_port != port
            assert [n.name for n in c.slurm().nodes()] == ["n1"]
    finally:
        taken.close()
    assert len(calls) == 2
