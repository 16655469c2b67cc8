"""Real munged daemons for the tests: one per simulated node, each signing from its own
address, all with one key (as every node of a cluster holds the same key), plus the
controller's (the ``mungeds`` and ``node_munged`` fixtures: a plugin of
tests/conftest.py). A test that needs them fails under ``NCCLGUARD_REQUIRE_PARTS=1``
when munged is not installed, and is skipped with the reason otherwise."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devtools.devcluster import CONTROLLER_ORIGIN, Munged, find_program, node_addr, write_munge_key
from helpers.parts import unavailable


class MungeSet:
    """``key``, the controller's munged (``controller``) and one munged per node, started
    on first use: ``node("n3")`` signs from ``node_addr(3)``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.key = write_munge_key(directory / "munge.key")
        self._daemons: dict[str, Munged] = {}
        self.controller = self._start("controller", CONTROLLER_ORIGIN)

    def _start(self, name: str, origin: str) -> Munged:
        # 0755: other users (a publisher of the wrong uid) may reach the sockets
        m = Munged(self.directory, name, self.key, origin, mode=0o755).start()
        self._daemons[name] = m
        return m

    def node(self, name: str) -> Munged:
        m = self._daemons.get(name)
        if m is None:
            m = self._start(name, self.addr(name))
        return m

    def extra(self, name: str, origin: str) -> Munged:
        """Another munged with the same key (a second controller, or a stranger)."""
        return self._daemons.get(name) or self._start(name, origin)

    @staticmethod
    def addr(name: str) -> str:
        return node_addr(int(name.lstrip("n")))

    def stop(self) -> None:
        for m in self._daemons.values():
            m.stop()


@pytest.fixture(scope="session")
def mungeds() -> Iterator[MungeSet]:
    if find_program("munged") is None:
        unavailable("munged is not installed (apt-get install munge)")
    d = Path(tempfile.mkdtemp(prefix="ncclguard-munge-"))  # others may reach the sockets
    os.chmod(d, 0o755)
    ms = MungeSet(d)
    try:
        yield ms
    finally:
        ms.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def node_munged(mungeds: MungeSet) -> Callable[[str], Munged]:
    return mungeds.node
