"""Host facts read under --root."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

from inventoryd.nodefs import ErrorLog, NodeFS
from inventoryd.probes import host
from ncclguard import __version__


def _kernel(root: Path, **files: str) -> None:
    d = root / "proc/sys/kernel"
    (d / "random").mkdir(parents=True)
    for name, text in files.items():
        (d / name.replace("__", "/")).write_text(text)


def test_probe_reads_the_node_not_this_machine(tmp_path: Path) -> None:
    _kernel(tmp_path, hostname="gpu-n017.cluster.example\n", osrelease="6.1.0-18-amd64\n",
            random__boot_id="3f0c8e3a-1f6b-4b8e-9a51-8d9e1c2b7a44\n")
    before = datetime.now(UTC).replace(microsecond=0)
    errors = ErrorLog()
    out = host.probe(NodeFS(tmp_path), errors, None)
    after = datetime.now(UTC)
    assert out["hostname"] == "gpu-n017"
    assert out["kernel"] == "6.1.0-18-amd64"
    assert out["boot_id"] == "3f0c8e3a-1f6b-4b8e-9a51-8d9e1c2b7a44"
    assert out["tool_version"] == __version__
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", out["collected_at"])
    at = datetime.strptime(out["collected_at"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert before <= at <= after
    assert errors.entries == []


def test_hostname_argument_wins_and_etc_hostname_fallback(tmp_path: Path) -> None:
    _kernel(tmp_path, osrelease="6.1.0\n", random__boot_id="x\n")
    assert host.probe(NodeFS(tmp_path), ErrorLog(), "n1")["hostname"] == "n1"
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/hostname").write_text("n2.example\n")
    assert host.probe(NodeFS(tmp_path), ErrorLog(), None)["hostname"] == "n2"


def test_missing_files_are_errors(tmp_path: Path) -> None:
    errors = ErrorLog()
    out = host.probe(NodeFS(tmp_path), errors, None)
    assert (out["hostname"], out["kernel"], out["boot_id"]) == (None, None, None)
    assert {e["field"] for e in errors.entries} == {"host.hostname", "host.kernel",
                                                     "host.boot_id"}


def test_real_root_matches_uname() -> None:
    import os

    out = host.probe(NodeFS("/"), ErrorLog(), None)
    assert out["kernel"] == os.uname().release
    assert out["hostname"] == os.uname().nodename.split(".")[0]
