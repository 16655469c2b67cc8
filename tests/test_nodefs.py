"""NodeFS: root-prefixed reads that never block and never cost more than one field."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from inventoryd.nodefs import ErrorLog, NodeFS


def test_resolve_stays_inside_the_root(tmp_path: Path) -> None:
    lib = tmp_path / "usr/lib"
    lib.mkdir(parents=True)
    (lib / "libx.so.1.2.3").write_bytes(b"")
    os.symlink("/usr/lib/libx.so.1.2.3", lib / "libx.so.1")  # absolute: the node's /usr
    os.symlink("../../../../../../usr/lib/libx.so.1", lib / "libx.so")  # '..' past the root
    fs = NodeFS(tmp_path)
    assert fs.resolve("/usr/lib/libx.so.1") == "/usr/lib/libx.so.1.2.3"
    assert fs.resolve("/usr/lib/libx.so") == "/usr/lib/libx.so.1.2.3"
    assert fs.resolve("/usr/lib/missing/../libx.so.1") == "/usr/lib/libx.so.1.2.3"


def test_resolve_loop_is_eloop(tmp_path: Path) -> None:
    os.symlink("b", tmp_path / "a")
    os.symlink("a", tmp_path / "b")
    with pytest.raises(OSError, match="Too many levels"):
        NodeFS(tmp_path).resolve("/a")


def test_read_bytes_bounded(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 10)
    fs = NodeFS(tmp_path)
    assert fs.read_bytes("/f", 10) == (b"x" * 10, False)
    assert fs.read_bytes("/f", 4) == (b"xxxx", True)


def test_read_text_errors_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "bad").write_bytes(b"\xff\xfe")
    fs, errors = NodeFS(tmp_path), ErrorLog()
    assert fs.read_text("/bad", errors, "p", "p.bad") is None
    assert fs.read_text("/missing", errors, "p", "p.missing") is None  # missing_ok
    assert fs.read_text("/missing", errors, "p", "p.m2", missing_ok=False) is None
    assert [(e["field"], e["path"], e["error"][:12]) for e in errors.entries] == [
        ("p.bad", "/bad", "not UTF-8 te"), ("p.m2", "/missing", "[Errno 2] No")]


def test_list_dir(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    for n in ("b", "a"):
        (tmp_path / "d" / n).write_text("")
    (tmp_path / "f").write_text("")
    fs, errors = NodeFS(tmp_path), ErrorLog()
    assert fs.list_dir("/d") == ["a", "b"]
    assert fs.list_dir("/nope", errors) is None
    assert fs.list_dir("/f", errors, "p", "p.f") is None
    assert errors.entries == [{"probe": "p", "field": "p.f", "path": "/f",
                               "error": "[Errno 20] Not a directory"}]
