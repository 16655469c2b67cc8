"""Every rule on fingerprints that the real probes produce from node trees.

Each node is a root tree from ``devtools.nodetree.build_node`` with real files (real
``libnccl.so.2`` from the NCCL wheels, gcc-built net plugins, the sysfs layouts); the
fingerprint is ``inventoryd.node.fingerprint.collect`` on it, exactly what inventoryd stores.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from devtools.nodetree import LIBDIR, build_node
from inventoryd.node.fingerprint import collect
from ncclguard.config import InventorydConfig, PolicyConfig
from ncclguard.fingerprint.compat import compat_key, compat_values
from ncclguard.fingerprint.transport import effective_transport
from ncclguard.policy import DEFAULT_SEVERITY, evaluate, evaluate_values, node_values

PLUGIN_PATH = f"{LIBDIR}/libnccl-net.so"


@pytest.fixture
def node(
    tmp_path: Path, nccl_lib: Callable[[str], Path], cache_dir: Path
) -> Callable[..., dict[str, Any]]:
    """``node("n1", nccl="2.21.5", **build_node_kwargs)`` -> the collected fingerprint."""

    def make(
        host: str, nccl: str | None = "2.21.5", config: InventorydConfig | None = None,
        **kw: Any,
    ) -> dict[str, Any]:
        root = build_node(
            tmp_path / host, libnccl=nccl_lib(nccl) if nccl else None, hostname=host, **kw
        )
        return collect(str(root), host, config or InventorydConfig())

    return make


def rules_found(verdict: Any) -> list[tuple[str, str, str]]:
    return [(f.rule, f.severity, f.groups_text()) for f in verdict.findings]


DEFAULT = PolicyConfig()


def test_identical_real_nodes_accept(node: Callable[..., dict]) -> None:
    fps = {h: node(h) for h in ("n1", "n2", "n3")}
    assert {compat_key(fp) for fp in fps.values()} == {compat_key(fps["n1"])}
    assert compat_values(fps["n1"]) == {
        "nccl": "2.21.5", "nccl_paths": {}, "net_plugin": "none", "net_abi": 0,
        "env_plugin": "none", "transport": "IB", "adds": "none",
    }
    v = evaluate(fps, DEFAULT)
    assert v.decision == "accept", v.format_text()


def test_nccl_version_from_real_libraries(node: Callable[..., dict]) -> None:
    fps = {"n1": node("n1"), "n2": node("n2"), "n3": node("n3", nccl="2.18.3"),
           "n4": node("n4")}
    v = evaluate(fps, DEFAULT)
    # the per-node records the store can keep give the same verdict, through JSON
    records = {h: json.loads(json.dumps(node_values(fp))) for h, fp in fps.items()}
    assert evaluate_values(records, DEFAULT) == v
    assert v.decision == "refuse"
    assert rules_found(v)[0] == (
        "nccl-version", "refuse", "nccl 2.18.3: n3 | nccl 2.21.5: n[1-2,4]"
    )
    assert v.odd_nodes == ["n3"]


def test_configured_library_path_on_some_nodes_only(
    node: Callable[..., dict], nccl_lib: Callable[[str], Path]
) -> None:
    cfg = InventorydConfig(nccl_search_paths=("/opt/nccl/lib",))
    extra = {"/opt/nccl/lib/libnccl.so.2": nccl_lib("2.26.2")}
    fps = {
        "n1": node("n1", config=cfg, extra_files=extra),
        "n2": node("n2", config=cfg),
    }
    assert compat_values(fps["n1"])["nccl_paths"] == {"/opt/nccl/lib/libnccl.so.2": "2.26.2"}
    v = evaluate(fps, DEFAULT)
    assert ("nccl-version", "refuse",
            "/opt/nccl/lib/libnccl.so.2 2.26.2: n1 | /opt/nccl/lib/libnccl.so.2 missing: n2"
            ) in rules_found(v)


def test_net_plugin_present_on_some_nodes_only(
    node: Callable[..., dict], compile_plugin: Callable[..., Path], tmp_path: Path
) -> None:
    so = compile_plugin(tmp_path / "plug", net_abis=[8, 7, 6], name="IBext_v8")
    fps = {
        "n1": node("n1", extra_files={PLUGIN_PATH: so}),
        "n2": node("n2", extra_files={PLUGIN_PATH: so}),
        "n3": node("n3"),
    }
    assert compat_values(fps["n1"])["net_plugin"] == "IBext_v8"
    assert compat_values(fps["n1"])["net_abi"] == 8
    assert effective_transport(fps["n1"]) == "IBext_v8"
    v = evaluate(fps, DEFAULT)
    found = rules_found(v)
    assert ("net-plugin", "refuse", "net plugin none: n3 | net plugin IBext_v8 v8: n[1-2]") in found
    assert ("transport", "refuse", "transport IB: n3 | transport IBext_v8: n[1-2]") in found
    assert v.odd_nodes == ["n3"]


def test_net_plugin_abi_depends_on_the_nodes_libnccl(
    node: Callable[..., dict], compile_plugin: Callable[..., Path], tmp_path: Path
) -> None:
    so = compile_plugin(tmp_path / "plug", net_abis=[8, 7, 6], name="IBext_v8")
    fps = {
        "n1": node("n1", extra_files={PLUGIN_PATH: so}),
        "n2": node("n2", nccl="2.18.3", extra_files={PLUGIN_PATH: so}),
    }
    assert compat_values(fps["n2"])["net_abi"] == 6  # 2.18.3 looks for v6..v4
    found = rules_found(evaluate(fps, DEFAULT))
    assert ("net-plugin", "refuse", "net plugin IBext_v8 v6: n2 | net plugin IBext_v8 v8: n1"
            ) in found


def test_net_plugin_other_build_same_abi_warns_and_node_adds_names_the_release(
    node: Callable[..., dict], compile_plugin: Callable[..., Path], tmp_path: Path
) -> None:
    """v8..v7 against v8..v6: the node's libnccl 2.21.5 uses v8 of both (another build: a
    warning), but a job that brings NCCL 2.18.3 (v6..v4) would use the plugin on n2 only
    (issue 39: node-adds refuses, naming that release)."""
    a = compile_plugin(tmp_path / "a", net_abis=[8, 7], name="IBext_v8")
    b = compile_plugin(tmp_path / "b", net_abis=[8, 7, 6], name="IBext_v8")
    fps = {"n1": node("n1", extra_files={PLUGIN_PATH: a}),
           "n2": node("n2", extra_files={PLUGIN_PATH: b})}
    v = evaluate(fps, DEFAULT)
    assert [(r, s) for r, s, _ in rules_found(v)] == [("node-adds", "refuse"),
                                                     ("net-plugin", "warn")]
    assert "(2.18.3, of the releases ncclguard knows)" in v.findings[0].message
    v = evaluate(fps, DEFAULT.replace(severity={"node-adds": "ignore"}))
    assert v.decision == "warn", v.format_text()
    assert [(r, s) for r, s, _ in rules_found(v)] == [("net-plugin", "warn")]


def test_transport_roce_socket_and_nccl_conf(node: Callable[..., dict]) -> None:
    fps = {
        "n1": node("n1"),
        "n2": node("n2", rdma="mlx5-roce"),
        "n3": node("n3", nccl_conf="NCCL_IB_DISABLE=1\n"),
        "n4": node("n4", rdma="mlx5-down"),
        "n5": node("n5", rdma="mlx5-roce", nccl_conf="NCCL_IB_HCA=^mlx5\n"),
    }
    got = {h: effective_transport(fp) for h, fp in fps.items()}
    assert got == {"n1": "IB", "n2": "RoCE", "n3": "Socket", "n4": "Socket", "n5": "Socket"}
    v = evaluate(fps, DEFAULT)
    assert rules_found(v)[0] == (
        "transport", "refuse", "transport IB: n1 | transport RoCE: n2 | transport Socket: n[3-5]"
    )
    assert v.odd_nodes == ["n1", "n2"]


def test_nccl_ib_hca_prefix_on_real_sysfs(node: Callable[..., dict]) -> None:
    # mlx5-ib has mlx5_0 (ACTIVE), mlx5-down has mlx5_1 (DOWN)
    both = ["mlx5-ib", "mlx5-down"]
    assert effective_transport(node("a", rdma=both, nccl_conf="NCCL_IB_HCA=mlx5\n")) == "IB"
    assert effective_transport(node("b", rdma=both, nccl_conf="NCCL_IB_HCA=mlx5_1\n")) == (
        "Socket"
    )
    assert effective_transport(node("c", rdma=both, nccl_conf="NCCL_IB_HCA==mlx5_0:1\n")) == "IB"
    assert effective_transport(node("d", rdma=both, nccl_conf="NCCL_IB_HCA=^mlx5_0\n")) == (
        "Socket"
    )
    assert effective_transport(node("e", netifs={})) == "IB"  # lo is always there
    assert effective_transport(node("f", libibverbs=None)) == "Socket"


def test_nccl_conf_rule(node: Callable[..., dict]) -> None:
    fps = {"n1": node("n1", nccl_conf="NCCL_ALGO=Ring\n"), "n2": node("n2")}
    v = evaluate(fps, DEFAULT)
    assert rules_found(v) == [("nccl-conf", "warn", "NCCL_ALGO=Ring: n1 | NCCL_ALGO unset: n2")]
    assert v.decision == "warn" and v.odd_nodes == []


def test_rdma_rate_and_firmware(node: Callable[..., dict]) -> None:
    fps = {"n1": node("n1"), "n2": node("n2", rdma="mlx5-edr-capture")}
    v = evaluate(fps, DEFAULT)
    found = {r: (s, g) for r, s, g in rules_found(v)}
    assert found["rdma-rate"] == ("warn", "rate 25 Gb/s: n2 | rate 400 Gb/s: n1")
    assert found["rdma-firmware"][0] == "warn"
    assert "rdma-port-count" not in found
    assert v.decision == "warn"


def test_rdma_port_count(node: Callable[..., dict]) -> None:
    fps = {"n1": node("n1", rdma="mlx5-ib"),
           "n2": node("n2", rdma=["mlx4"])}
    found = {r: g for r, _, g in rules_found(evaluate(fps, DEFAULT))}
    assert found["rdma-port-count"] == "ports 1: n1 | ports 2: n2"


def test_unreadable_rate_is_unknown_not_different(node: Callable[..., dict]) -> None:
    mana = node("n2", rdma="mana")
    if not any(e["field"].endswith(".rate") for e in mana["errors"]):
        pytest.skip("this kernel does not fail the read of /sys/class/net/lo/speed")
    fps = {"n1": node("n1", rdma="mana"), "n2": mana}
    assert "rdma-rate" not in {r for r, _, _ in rules_found(evaluate(fps, DEFAULT))}


def test_gpu_driver_and_gpudirect(node: Callable[..., dict]) -> None:
    fps = {
        "n1": node("n1"),
        "n2": node("n2", driver="535.104.05"),
        "n3": node("n3", peermem=False),
    }
    v = evaluate(fps, DEFAULT)
    found = {r: (s, g) for r, s, g in rules_found(v)}
    assert found["gpu-driver"] == ("warn", "driver 535.104.05: n2 | driver 550.54.15: n[1,3]")
    assert found["gpudirect"] == ("warn", "peermem none: n3 | peermem nvidia_peermem: n[1-2]")
    assert v.decision == "warn"


def test_missing_and_stale_nodes(node: Callable[..., dict]) -> None:
    fps: dict[str, dict | None] = {"n1": node("n1"), "n2": node("n2"), "n3": None}
    v = evaluate(fps, DEFAULT, stale={"n2"})
    assert rules_found(v) == [("unknown-node", "warn", "no record: n3 | stale heartbeat: n2")]
    strict = PolicyConfig(severity={**DEFAULT_SEVERITY, "unknown-node": "refuse"})
    v = evaluate(fps, strict, stale={"n2"})
    assert v.decision == "refuse" and v.odd_nodes == ["n2", "n3"]


def test_stub_library_is_unknown_not_different(
    node: Callable[..., dict], tmp_path: Path
) -> None:
    stub = tmp_path / "stub.so"
    stub.write_bytes(b"\x7fELF not really a library")
    fps = {"n1": node("n1"),
           "n2": node("n2", nccl=None, extra_files={f"{LIBDIR}/libnccl.so.2": stub})}
    assert compat_values(fps["n2"])["nccl"] is None
    v = evaluate(fps, DEFAULT)
    assert "nccl-version" not in {r for r, _, _ in rules_found(v)}
