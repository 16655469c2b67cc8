"""The RDMA probe against sysfs trees laid out like real devices (tests/fixtures/sysfs)."""

from __future__ import annotations

import errno
import os
import shutil
import threading
from pathlib import Path

import pytest

from inventoryd.nodefs import ErrorLog, NodeFS
from inventoryd.probes import rdma

FIXTURES = Path(__file__).parent / "fixtures" / "sysfs"


def layout(tmp_path: Path, *names: str) -> Path:
    root = tmp_path / "node"
    for name in names:
        shutil.copytree(FIXTURES / name, root, symlinks=True, dirs_exist_ok=True)
    return root


def run(root: Path) -> tuple[dict, list[dict]]:
    errors = ErrorLog()
    return rdma.probe(NodeFS(root), errors), errors.entries


def port_of(result: dict, dev: str, n: int = 1) -> dict:
    d = next(d for d in result["devices"] if d["name"] == dev)
    return next(p for p in d["ports"] if p["port"] == n)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("400 Gb/sec (4X NDR)", 400.0),
        ("200 Gb/sec (4X HDR)", 200.0),
        ("2.5 Gb/sec (1X SDR)", 2.5),
        ("25 Gb/sec (1X EDR)", 25.0),
        ("56 Gb/sec (4X FDR)", 56.0),
        ("10 Gb/sec (4X)", 10.0),  # kernels before the " SDR" label
        ("0 GB/sec", 0.0),
        ("400 Gb/sec (4X NDR)\n", 400.0),
        ("800 Gb/sec (4X XDR)", 800.0),
    ],
)
def test_parse_rate(text: str, expected: float) -> None:
    assert rdma.parse_rate(text) == expected


@pytest.mark.parametrize(
    "text", ["N/A (no PMA)", "", "fast", "400", "Gb/sec (4X NDR)", "-1 Gb/sec"]
)
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(rdma.ParseError, match="not a rate"):
        rdma.parse_rate(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4: ACTIVE", (4, "ACTIVE")),
        ("1: DOWN", (1, "DOWN")),
        ("2: INIT", (2, "INIT")),
        ("5: ACTIVE_DEFER", (5, "ACTIVE_DEFER")),
        ("5: LinkUp", (5, "LinkUp")),
        ("3: Disabled", (3, "Disabled")),
        ("7: Phy Test", (7, "Phy Test")),
        ("0: <unknown>", (0, "<unknown>")),
        ("9: UNKNOWN", (9, "UNKNOWN")),
        ("7: unspecified", (7, "unspecified")),
    ],
)
def test_parse_state(text: str, expected: tuple[int, str]) -> None:
    assert rdma.parse_state(text) == expected
    assert rdma.parse_phys_state(text) == expected


@pytest.mark.parametrize("text", ["N/A (no PMA)", "", "ACTIVE", "x: ACTIVE", "4:"])
def test_parse_state_rejects(text: str) -> None:
    with pytest.raises(rdma.ParseError, match="N: NAME"):
        rdma.parse_state(text)


def test_mlx5_infiniband(tmp_path: Path) -> None:
    result, errors = run(layout(tmp_path, "mlx5-ib"))
    assert errors == []
    assert result["devices"] == [{
        "name": "mlx5_0", "fw_ver": "28.39.1002", "hca_type": "MT4129",
        "board_id": "MT_0000000838", "node_guid": "946d:ae03:00f3:8a3c", "node_type": "1: CA",
        "ports": [{"port": 1, "state": "ACTIVE", "state_code": 4, "phys_state": "LinkUp",
                   "phys_state_code": 5, "rate": "400 Gb/sec (4X NDR)", "rate_gbps": 400.0,
                   "link_layer": "InfiniBand"}],
    }]
    assert result["providers"] == ["mlx5"]


def test_class_entries_are_relative_links_into_devices() -> None:
    link = FIXTURES / "mlx5-ib/sys/class/infiniband/mlx5_0"
    assert link.is_symlink()
    target = os.readlink(link)
    assert target.startswith("../../devices/pci")
    assert link.resolve().is_relative_to((FIXTURES / "mlx5-ib").resolve())


def test_roce_and_down_port_and_many_devices_sorted(tmp_path: Path) -> None:
    result, errors = run(layout(tmp_path, "mlx5-down", "hfi1", "efa"))
    assert errors == []
    assert [d["name"] for d in result["devices"]] == ["efa_0", "hfi1_0", "mlx5_1"]
    down = port_of(result, "mlx5_1")
    assert (down["state"], down["state_code"], down["phys_state"]) == ("DOWN", 1, "Disabled")
    efa = next(d for d in result["devices"] if d["name"] == "efa_0")
    assert efa["node_type"] == "7: unspecified"
    assert efa["hca_type"] is None  # not exposed by efa: absent, no error
    assert port_of(result, "efa_0")["link_layer"] == "Unknown"
    assert result["providers"] == ["efa", "hfi1verbs", "mlx5"]

    roce, errors = run(layout(tmp_path / "r", "mlx5-roce"))
    assert errors == []
    assert port_of(roce, "mlx5_0")["link_layer"] == "Ethernet"
    assert port_of(roce, "mlx5_0")["rate_gbps"] == 200.0


def test_captured_layout_values(tmp_path: Path) -> None:
    """Values transcribed from prometheus/procfs testdata (see the fixtures README)."""
    result, errors = run(layout(tmp_path, "mlx4", "mlx5-edr-capture"))
    assert errors == []
    mlx4 = next(d for d in result["devices"] if d["name"] == "mlx4_0")
    assert [p["rate_gbps"] for p in mlx4["ports"]] == [40.0, 40.0]
    mlx5 = next(d for d in result["devices"] if d["name"] == "mlx5_0")
    assert mlx5["node_guid"] == "0a7f:bc12:45ef:d23b"  # the file has no trailing newline
    assert port_of(result, "mlx5_0")["phys_state"] == "ACTIVE"  # odd, but as captured


def test_no_pma_counters_cost_nothing(tmp_path: Path) -> None:
    root = layout(tmp_path, "i40iw-nopma")
    counters = next(root.glob("sys/devices/**/ports/1/counters"))
    assert (counters / "link_downed").read_text() == "N/A (no PMA)\n"
    result, errors = run(root)
    assert errors == []
    assert port_of(result, "i40iw0")["rate_gbps"] == 10.0


def _einval_here() -> bool:
    try:
        with open("/sys/class/net/lo/speed", "rb") as f:
            f.read()
    except OSError as e:
        return e.errno == errno.EINVAL
    return False


@pytest.mark.skipif(not _einval_here(), reason="this kernel's lo/speed does not fail with EINVAL")
def test_mana_rate_einval_costs_one_field(tmp_path: Path) -> None:
    """The fixture's mana_0 ``rate`` is a link to the real ``/sys/class/net/lo/speed``,
    which the kernel fails with EINVAL as MANA's ``rate`` does; nothing is injected."""
    result, errors = run(layout(tmp_path, "mana", "mlx5-ib"))
    port = port_of(result, "mana_0")
    assert port["rate"] is None and port["rate_gbps"] is None
    assert port["state"] == "ACTIVE" and port["link_layer"] == "Ethernet"
    assert port_of(result, "mlx5_0")["rate_gbps"] == 400.0
    assert errors == [{
        "probe": "rdma", "field": "rdma.devices.mana_0.ports.1.rate",
        "path": "/sys/class/infiniband/mana_0/ports/1/rate",
        "error": "[Errno 22] Invalid argument",
    }]


def _port_dir(root: Path, dev: str) -> Path:
    return (root / "sys/class/infiniband" / dev).resolve() / "ports" / "1"


def test_directory_where_a_file_belongs_is_eisdir(tmp_path: Path) -> None:
    root = layout(tmp_path, "mlx5-ib")
    rate = _port_dir(root, "mlx5_0") / "rate"
    rate.unlink()
    rate.mkdir()
    result, errors = run(root)
    assert port_of(result, "mlx5_0")["rate"] is None
    assert port_of(result, "mlx5_0")["state"] == "ACTIVE"
    assert [(e["field"], e["error"]) for e in errors] == [
        ("rdma.devices.mlx5_0.ports.1.rate", "[Errno 21] Is a directory")]


def test_fifo_where_a_file_belongs_does_not_hang(tmp_path: Path) -> None:
    root = layout(tmp_path, "mlx5-ib")
    state = _port_dir(root, "mlx5_0") / "state"
    state.unlink()
    os.mkfifo(state)
    box: list = []
    t = threading.Thread(target=lambda: box.append(run(root)), daemon=True)
    t.start()
    t.join(10)
    assert box, "the probe blocked on a FIFO"
    result, errors = box[0]
    assert port_of(result, "mlx5_0")["state"] is None
    assert port_of(result, "mlx5_0")["rate_gbps"] == 400.0
    assert errors[0]["path"] == "/sys/class/infiniband/mlx5_0/ports/1/state"
    assert "not a regular file (a FIFO)" in errors[0]["error"]


def test_unlistable_ports_directory_costs_the_ports_only(tmp_path: Path) -> None:
    root = layout(tmp_path, "mlx5-ib", "hfi1")
    ports = _port_dir(root, "mlx5_0").parent
    shutil.rmtree(ports)
    ports.write_text("not a directory\n")  # ENOTDIR
    ports_hfi = _port_dir(root, "hfi1_0").parent
    shutil.rmtree(ports_hfi)
    os.symlink("ports", ports_hfi)  # a link to itself: ELOOP
    result, errors = run(root)
    mlx5 = next(d for d in result["devices"] if d["name"] == "mlx5_0")
    assert mlx5["ports"] == [] and mlx5["fw_ver"] == "28.39.1002"
    hfi = next(d for d in result["devices"] if d["name"] == "hfi1_0")
    assert hfi["ports"] == [] and hfi["fw_ver"] == "1.27.0"
    assert {(e["field"], e["error"]) for e in errors} == {
        ("rdma.devices.mlx5_0.ports", "[Errno 20] Not a directory"),
        ("rdma.devices.hfi1_0.ports", "[Errno 40] Too many levels of symbolic links"),
    }


def test_dangling_device_link(tmp_path: Path) -> None:
    root = layout(tmp_path, "mlx5-ib", "efa")
    shutil.rmtree((root / "sys/class/infiniband/efa_0").resolve())
    result, errors = run(root)
    assert [d["name"] for d in result["devices"]] == ["efa_0", "mlx5_0"]
    efa = result["devices"][0]
    assert efa["ports"] == [] and efa["fw_ver"] is None
    assert errors == [{"probe": "rdma", "field": "rdma.devices.efa_0",
                       "path": "/sys/class/infiniband/efa_0",
                       "error": "device entry is a dangling link"}]
    assert port_of(result, "mlx5_0")["rate_gbps"] == 400.0


def test_unparseable_values_keep_raw_text(tmp_path: Path) -> None:
    root = layout(tmp_path, "mlx5-ib")
    (_port_dir(root, "mlx5_0") / "rate").write_text("N/A (no PMA)\n")
    (_port_dir(root, "mlx5_0") / "state").write_text("ACTIVE\n")
    result, errors = run(root)
    port = port_of(result, "mlx5_0")
    assert (port["rate"], port["rate_gbps"]) == ("N/A (no PMA)", None)
    assert (port["state"], port["state_code"]) == ("ACTIVE", None)
    assert {e["field"] for e in errors} == {"rdma.devices.mlx5_0.ports.1.rate_gbps",
                                             "rdma.devices.mlx5_0.ports.1.state"}


def test_no_rdma_at_all(tmp_path: Path) -> None:
    result, errors = run(tmp_path)
    assert result == {"abi_version": {"verbs": None, "mad": None}, "libibverbs": None,
                      "providers": [], "devices": []}
    assert errors == []


def test_class_dir_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "sys/class").mkdir(parents=True)
    (tmp_path / "sys/class/infiniband").write_text("")
    result, errors = run(tmp_path)
    assert result["devices"] == []
    assert errors[0]["path"] == "/sys/class/infiniband"
    assert "Not a directory" in errors[0]["error"]


def test_abi_versions_and_libibverbs(tmp_path: Path) -> None:
    root = layout(tmp_path, "mlx5-ib")
    (root / "sys/class/infiniband_verbs").mkdir()
    (root / "sys/class/infiniband_verbs/abi_version").write_text("6\n")
    lib = root / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / "libibverbs.so.1.14.50.0").write_bytes(b"\x7fELF")
    os.symlink("libibverbs.so.1.14.50.0", lib / "libibverbs.so.1")
    result, errors = run(root)
    assert result["abi_version"] == {"verbs": "6", "mad": None}  # missing mad: no error
    assert result["libibverbs"] == {"path": "/usr/lib/x86_64-linux-gnu/libibverbs.so.1",
                                    "version": "1.14.50.0"}
    assert errors == []
