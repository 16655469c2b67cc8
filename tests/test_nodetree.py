"""build_node composes node roots that the probes read back as built."""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools.nodetree import NodeTreeError, build_node, layouts
from inventoryd.nodefs import ErrorLog, NodeFS
from inventoryd.probes import gpu, host, ncclconf, netifs, rdma


def read_all(root: Path) -> tuple[dict, list[dict]]:
    fs, errors = NodeFS(root), ErrorLog()
    out = {
        "host": host.probe(fs, errors, None),
        "rdma": rdma.probe(fs, errors),
        "netifs": netifs.probe(fs, errors),
        "nccl_conf": ncclconf.probe(fs, errors),
        "gpu": gpu.probe(fs, errors),
    }
    return out, errors.entries


def test_default_node(tmp_path: Path) -> None:
    out, errors = read_all(build_node(tmp_path / "n1"))
    assert errors == []
    assert out["host"]["hostname"] == "n1"
    assert out["host"]["kernel"] == "6.1.0-18-amd64"
    assert [d["name"] for d in out["rdma"]["devices"]] == ["mlx5_0"]
    assert out["rdma"]["abi_version"] == {"verbs": "6", "mad": "5"}
    assert out["rdma"]["libibverbs"] == {"path": "/usr/lib/x86_64-linux-gnu/libibverbs.so.1",
                                         "version": "1.14.50.0"}
    assert out["rdma"]["providers"] == ["mlx5"]
    assert out["gpu"] == {"driver_version": "550.54.15", "count": 8,
                          "models": ["NVIDIA H100 80GB HBM3"] * 8, "peermem": "nvidia_peermem"}
    assert out["nccl_conf"]["present"] is False
    assert out["netifs"] == [{"name": "ib0", "up": True, "addresses": ["10.0.0.1"]},
                             {"name": "lo", "up": True, "addresses": ["127.0.0.1", "::1"]}]
    assert netifs.nccl_ip_interfaces(out["netifs"]) == ["ib0"]


def test_options_show_up_in_the_probes(tmp_path: Path) -> None:
    root = build_node(
        tmp_path / "n2", rdma=["mlx5-roce", "mlx5-down"], nccl_conf="NCCL_IB_HCA=mlx5_0\n",
        driver="535.161.08", gpus=2, gpu_model=["NVIDIA A100-SXM4-80GB", "NVIDIA H100 PCIe"],
        peermem="nv_peer_mem",
        netifs={"eth0": ["192.0.2.7/24", "fd00::7/64"], "ib0": "10.0.0.2/16"},
        netifs_down=["ib0"], hostname="gpu-7", libibverbs=None,
        extra_files={"/etc/ncclguard/x": b"hello"},
    )
    out, errors = read_all(root)
    assert errors == []
    assert out["host"]["hostname"] == "gpu-7"
    assert [d["name"] for d in out["rdma"]["devices"]] == ["mlx5_0", "mlx5_1"]
    assert out["rdma"]["libibverbs"] is None
    assert out["nccl_conf"]["settings"] == {"NCCL_IB_HCA": "mlx5_0"}
    assert out["gpu"] == {"driver_version": "535.161.08", "count": 2,
                          "models": ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 PCIe"],
                          "peermem": "nv_peer_mem"}
    assert netifs.nccl_ip_interfaces(out["netifs"]) == ["eth0"]
    eth0 = next(n for n in out["netifs"] if n["name"] == "eth0")
    assert eth0["addresses"] == ["192.0.2.7", "fd00::7"]
    assert (root / "etc/ncclguard/x").read_bytes() == b"hello"


def test_bare_node(tmp_path: Path) -> None:
    out, errors = read_all(build_node(tmp_path / "bare", rdma=[], driver=None, peermem=False,
                                      netifs={}))
    assert errors == []
    assert out["rdma"]["devices"] == [] and out["rdma"]["abi_version"]["verbs"] is None
    assert out["gpu"] == {"driver_version": None, "count": 0, "models": [], "peermem": None}
    assert netifs.nccl_ip_interfaces(out["netifs"]) == []


def test_libnccl_placed_with_link(tmp_path: Path) -> None:
    lib = tmp_path / "libnccl.so.2"
    lib.write_bytes(b"\x7fELF fake for placement only")
    root = build_node(tmp_path / "n", libnccl=lib)
    placed = root / "usr/lib/x86_64-linux-gnu/libnccl.so.2"
    assert placed.read_bytes() == lib.read_bytes()
    assert placed.stat().st_ino == lib.stat().st_ino  # hardlinked, not copied
    link = root / "usr/lib/x86_64-linux-gnu/libnccl.so"
    assert link.is_symlink() and str(link.readlink()) == "libnccl.so.2"
    assert NodeFS(root).resolve("/usr/lib/x86_64-linux-gnu/libnccl.so") == \
        "/usr/lib/x86_64-linux-gnu/libnccl.so.2"


def test_every_layout_builds(tmp_path: Path) -> None:
    assert {"mlx5-ib", "mlx5-roce", "mlx5-down", "hfi1", "efa", "mana"} <= set(layouts())
    for name in layouts():
        out, _ = read_all(build_node(tmp_path / name, rdma=name))
        assert out["rdma"]["devices"], name


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rdma": "nope"}, "unknown rdma layout 'nope'"),
        ({"rdma": ["mlx5-ib", "mlx5-roce"]}, "both have device 'mlx5_0'"),
        ({"gpus": 2, "gpu_model": ["a"]}, "gpu_model has 1 entries for gpus = 2"),
        ({"netifs": {"eth0": "not-an-ip"}}, "netifs['eth0']"),
        ({"netifs_down": ["eth9"]}, "unknown interfaces: ['eth9']"),
        ({"extra_files": {"relative/path": b""}}, "node paths are absolute"),
        ({"libnccl": Path("/nonexistent/libnccl.so.2")}, "/nonexistent/libnccl.so.2: not a file"),
        ({"peermem": "other"}, "expected nvidia_peermem or nv_peer_mem"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(NodeTreeError) as e:
        build_node(tmp_path / "n", **kwargs)
    assert message in str(e.value)
