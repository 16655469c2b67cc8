"""/etc/nccl.conf parsed as NCCL's setEnvFile parses it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from inventoryd.nodefs import ErrorLog, NodeFS
from inventoryd.probes import ncclconf


@pytest.mark.parametrize(
    ("data", "settings", "comments"),
    [
        (b"NCCL_IB_HCA=mlx5\n", {"NCCL_IB_HCA": "mlx5"}, {}),
        (b"A=1\nA=2\n", {"A": "1"}, {}),  # first occurrence wins
        (b" A = 1 \n", {" A ": " 1 "}, {}),  # no trimming
        (b"A=1\r\n", {"A": "1\r"}, {}),  # only \n is dropped
        (b"A=b=c\n", {"A": "b=c"}, {}),  # split at the first '='
        (b"no equals sign\n\n", {}, {}),
        (b"=value\n", {}, {}),  # empty name: setenv fails
        (b"A=\n", {"A": ""}, {}),
        (b"A=1", {"A": "1"}, {}),  # no final newline
        (b"#NCCL_IB_HCA=mlx4\nNCCL_IB_HCA=mlx5\n", {"NCCL_IB_HCA": "mlx5"},
         {"#NCCL_IB_HCA": "mlx4"}),
        (b" #A=1\n", {" #A": "1"}, {}),  # '#' only counts in column 1
        (b"# a comment\n", {}, {}),
        (b"A=x\x00y\n", {"A": "x"}, {}),  # C strings end at NUL
        (b"A=\xff\n", {"A": "\ufffd"}, {}),
    ],
)
def test_parse(data: bytes, settings: dict, comments: dict) -> None:
    assert ncclconf.parse(data) == (settings, comments)


def test_names_and_values_cut_at_1023_bytes() -> None:
    settings, _ = ncclconf.parse(b"N" * 2000 + b"=" + b"v" * 2000 + b"\n")
    [(name, value)] = settings.items()
    assert (len(name), len(value)) == (1023, 1023)


def _node(tmp_path: Path, data: bytes | None) -> NodeFS:
    (tmp_path / "etc").mkdir(exist_ok=True)
    if data is not None:
        (tmp_path / "etc/nccl.conf").write_bytes(data)
    return NodeFS(tmp_path)


def test_probe_present(tmp_path: Path) -> None:
    errors = ErrorLog()
    out = ncclconf.probe(_node(tmp_path, b"NCCL_IB_HCA=mlx5\n#NCCL_NET=IB\n"), errors)
    assert out["present"] is True and out["truncated"] is False
    assert out["raw"] == "NCCL_IB_HCA=mlx5\n#NCCL_NET=IB\n"
    assert out["settings"] == {"NCCL_IB_HCA": "mlx5"}
    assert out["comment_settings"] == {"#NCCL_NET": "IB"}
    assert len(out["sha256"]) == 64
    assert errors.entries == []


def test_probe_absent_is_not_an_error(tmp_path: Path) -> None:
    errors = ErrorLog()
    out = ncclconf.probe(_node(tmp_path, None), errors)
    assert (out["present"], out["settings"], out["raw"]) == (False, {}, None)
    assert errors.entries == []


def test_huge_file_is_bounded(tmp_path: Path) -> None:
    line = b"NCCL_X" + b"=" + b"y" * 100 + b"\n"
    data = b"NCCL_FIRST=1\n" + line * 200_000  # ~21 MB
    errors = ErrorLog()
    out = ncclconf.probe(_node(tmp_path, data), errors)
    assert out["truncated"] is True
    assert len(out["raw"]) == ncclconf.MAX_RAW
    assert out["settings"]["NCCL_FIRST"] == "1"
    assert out["sha256"] is None  # the whole file was not read
    assert errors.entries[0]["path"] == "/etc/nccl.conf"
    assert "parsed the first" in errors.entries[0]["error"]


def test_fifo_does_not_hang(tmp_path: Path) -> None:
    node = _node(tmp_path, None)
    os.mkfifo(tmp_path / "etc/nccl.conf")
    box: list = []
    errors = ErrorLog()
    t = threading.Thread(target=lambda: box.append(ncclconf.probe(node, errors)), daemon=True)
    t.start()
    t.join(10)
    assert box, "blocked on a FIFO"
    assert box[0]["present"] is True and box[0]["settings"] is None
    assert "a FIFO" in errors.entries[0]["error"]


def test_directory_and_device(tmp_path: Path) -> None:
    node = _node(tmp_path, None)
    (tmp_path / "etc/nccl.conf").mkdir()
    errors = ErrorLog()
    assert ncclconf.probe(node, errors)["settings"] is None
    assert errors.entries[0]["error"] == "[Errno 21] Is a directory"
    (tmp_path / "etc/nccl.conf").rmdir()
    os.symlink("/dev/zero", tmp_path / "etc/nccl.conf")  # endless: refused, not read
    errors = ErrorLog()
    assert ncclconf.probe(node, errors)["settings"] is None
    assert "a character device" in errors.entries[0]["error"]


def test_dangling_link_is_present_but_unreadable(tmp_path: Path) -> None:
    node = _node(tmp_path, None)
    os.symlink("/nonexistent/nccl.conf", tmp_path / "etc/nccl.conf")
    errors = ErrorLog()
    out = ncclconf.probe(node, errors)
    assert out["present"] is True and out["settings"] is None
    assert errors.entries[0]["error"] == "[Errno 2] No such file or directory"
