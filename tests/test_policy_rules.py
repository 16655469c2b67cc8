"""Each rule on schema-shaped fingerprints (the real-probe versions: test_policy_probes.py)."""

from __future__ import annotations

from helpers.fingerprints import device, error, fingerprint, libnccl, plugin, port

from ncclguard.fingerprint.compat import compat_values
from ncclguard.policy.rules import (
    gpu,
    nccl_conf,
    nccl_version,
    net_plugin,
    rdma,
    transport,
    unknown_node,
)


def groups(findings: list) -> list[list[tuple[str, str]]]:
    return [[(label, hosts) for label, hosts, _ in f.groups] for f in findings]


def test_nccl_version_default_library() -> None:
    fps = {f"n{i}": fingerprint(f"n{i}") for i in (1, 2, 4)}
    fps["n3"] = fingerprint("n3", nccl="2.18.3")
    found = nccl_version.check(fps)
    assert len(found) == 1
    assert found[0].rule == "nccl-version" and found[0].severity == "refuse"
    assert found[0].groups_text() == "nccl 2.18.3: n3 | nccl 2.21.5: n[1-2,4]"


def test_nccl_version_patch_level_counts() -> None:
    fps = {"a1": fingerprint("a1", nccl="2.26.2"), "a2": fingerprint("a2", nccl="2.26.5")}
    assert groups(nccl_version.check(fps)) == [[("nccl 2.26.2", "a1"), ("nccl 2.26.5", "a2")]]


def test_nccl_version_unknown_is_not_different() -> None:
    fps = {"n1": fingerprint("n1"), "n2": fingerprint("n2", libs=[libnccl(None)])}
    assert nccl_version.check(fps) == []
    broken = fingerprint("n3", errors=[error("libnccl", probe="nccl")])
    broken["libnccl"] = None
    assert nccl_version.check({"n1": fingerprint("n1"), "n3": broken}) == []
    # but a node without any libnccl.so.2 differs
    found = nccl_version.check({"n1": fingerprint("n1"), "n2": fingerprint("n2", libs=[])})
    assert groups(found) == [[("nccl 2.21.5", "n1"), ("nccl none", "n2")]]


def test_nccl_version_configured_paths() -> None:
    opt = "/opt/nccl/lib/libnccl.so.2"

    def fp(host: str, opt_version: str | None) -> dict:
        libs = [libnccl("2.21.5")]
        if opt_version:
            libs.append(libnccl(opt_version, path=opt, default=False, origin="config"))
        return fingerprint(host, libs=libs)

    found = nccl_version.check({"n1": fp("n1", "2.18.3"), "n2": fp("n2", "2.21.5")})
    assert groups(found) == [[(f"{opt} 2.18.3", "n1"), (f"{opt} 2.21.5", "n2")]]
    # a path on some nodes only
    found = nccl_version.check({"n1": fp("n1", "2.18.3"), "n2": fp("n2", None)})
    assert groups(found) == [[(f"{opt} 2.18.3", "n1"), (f"{opt} missing", "n2")]]
    assert nccl_version.check({"n1": fp("n1", "2.18.3"), "n2": fp("n2", "2.18.3")}) == []


def test_net_plugin_presence_abi_name_and_sha() -> None:
    with_plugin = fingerprint("n1", plugins=[plugin()])
    found = net_plugin.check({"n1": with_plugin, "n2": fingerprint("n2")})
    assert groups(found) == [[("net plugin IBext_v8 v8", "n1"), ("net plugin none", "n2")]]
    assert found[0].severity == "refuse"
    # same plugin file, but the older libnccl on n2 speaks only v6
    old = fingerprint("n2", libs=[libnccl("2.18.3")], plugins=[plugin(abis=[8, 7, 6])])
    found = net_plugin.check({"n1": with_plugin, "n2": old})
    assert groups(found) == [[("net plugin IBext_v8 v6", "n2"), ("net plugin IBext_v8 v8", "n1")]]
    # other name
    other = fingerprint("n2", plugins=[plugin("Libfabric")])
    assert len(net_plugin.check({"n1": with_plugin, "n2": other})) == 1
    # same name and ABI, other build: a warning only
    rebuilt = fingerprint("n2", plugins=[plugin(sha256="bbbb")])
    found = net_plugin.check({"n1": with_plugin, "n2": rebuilt})
    assert [(f.rule, f.severity) for f in found] == [("net-plugin", "warn")]
    # ... and not repeated when the ABI differs too
    rebuilt_old = fingerprint("n2", libs=[libnccl("2.18.3")], plugins=[plugin(sha256="bbbb")])
    found = net_plugin.check({"n1": with_plugin, "n2": rebuilt_old})
    assert [(f.rule, f.severity) for f in found] == [("net-plugin", "refuse")]


def test_net_plugin_without_common_abi_is_as_absent_but_warned() -> None:
    """NCCL ignores a plugin that shares no ABI with it: for the job that is no plugin."""
    ignored = fingerprint("n1", libs=[libnccl("2.18.3")], plugins=[plugin(abis=[9, 8])])
    found = net_plugin.check({"n1": ignored, "n2": fingerprint("n2")})
    assert [(f.rule, f.severity) for f in found] == [("net-plugin", "warn")]
    assert "ignores" in found[0].message
    assert compat_values(ignored)["net_plugin"] == "none"
    assert compat_values(ignored) == compat_values(fingerprint("n1", libs=[libnccl("2.18.3")]))


def test_net_plugin_unreadable_is_unknown() -> None:
    bad = fingerprint("n2", plugins=[{**plugin(), "error": "[Errno 13] Permission denied"}])
    assert net_plugin.check({"n1": fingerprint("n1", plugins=[plugin()]), "n2": bad}) == []


def test_transport_rule() -> None:
    fps = {
        "n1": fingerprint("n1"),
        "n2": fingerprint("n2"),
        "n3": fingerprint("n3", conf={"NCCL_IB_DISABLE": "1"}),
    }
    assert groups(transport.check(fps)) == [
        [("transport Socket", "n3"), ("transport IB", "n[1-2]")]
    ]
    roce = fingerprint("n2", devices=[device(ports=[port(link_layer="Ethernet")])])
    assert groups(transport.check({"n1": fingerprint("n1"), "n2": roce})) == [
        [("transport IB", "n1"), ("transport RoCE", "n2")]
    ]


def test_nccl_conf_rule() -> None:
    fps = {
        "n1": fingerprint("n1", conf={"NCCL_ALGO": "Ring", "NCCL_IB_HCA": "mlx5_0"}),
        "n2": fingerprint("n2", conf={"NCCL_ALGO": "Tree", "NCCL_IB_HCA": "mlx5"}),
        "n3": fingerprint("n3"),
    }
    found = nccl_conf.check(fps)
    # NCCL_IB_HCA is judged by its effect (transport), not its text
    assert groups(found) == [
        [("NCCL_ALGO=Ring", "n1"), ("NCCL_ALGO=Tree", "n2"), ("NCCL_ALGO unset", "n3")]
    ]
    assert found[0].severity == "warn"
    unreadable = fingerprint("n4")
    unreadable["nccl_conf"] = None
    assert nccl_conf.check({"n1": fps["n1"], "n4": unreadable}) == []


def test_rdma_rules() -> None:
    eight = [device(f"mlx5_{i}") for i in range(8)]
    seven = [*eight[:7], device("mlx5_7", ports=[port(state="DOWN")])]
    slow = [*eight[:7], device("mlx5_7", ports=[port(rate_gbps=200.0)])]
    newfw = [*eight[:7], device("mlx5_7", fw="28.40.1000")]
    base = fingerprint("n1", devices=eight)
    assert groups(rdma.check_port_count({"n1": base, "n2": fingerprint("n2", devices=seven)})) == [
        [("ports 7", "n2"), ("ports 8", "n1")]
    ]
    assert groups(rdma.check_rate({"n1": base, "n2": fingerprint("n2", devices=slow)})) == [
        [("rate 200,400 Gb/s", "n2"), ("rate 400 Gb/s", "n1")]
    ]
    assert groups(rdma.check_firmware({"n1": base, "n2": fingerprint("n2", devices=newfw)})) == [
        [("firmware 28.39.1002", "n1"), ("firmware 28.39.1002,28.40.1000", "n2")]
    ]
    # an unreadable rate (Azure MANA: EINVAL) is unknown, not different
    norate = [*eight[:7], device("mlx5_7", ports=[port(rate_gbps=None)])]
    fp = fingerprint("n2", devices=norate, errors=[error("rdma.devices.mlx5_7.ports.1.rate")])
    assert rdma.check_rate({"n1": base, "n2": fp}) == []
    # a port NCCL_IB_HCA leaves out does not count
    capped = fingerprint("n2", devices=slow, conf={"NCCL_IB_HCA": "^=mlx5_7"})
    assert groups(rdma.check_port_count({"n1": base, "n2": capped})) == [
        [("ports 7", "n2"), ("ports 8", "n1")]
    ]
    assert rdma.check_rate({"n1": base, "n2": capped}) == []


def test_gpu_rules() -> None:
    fps = {"n1": fingerprint("n1"), "n2": fingerprint("n2", driver="535.104.05", peermem=None)}
    assert groups(gpu.check_driver(fps)) == [
        [("driver 535.104.05", "n2"), ("driver 550.54.15", "n1")]
    ]
    assert groups(gpu.check_gpudirect(fps)) == [
        [("peermem none", "n2"), ("peermem nvidia_peermem", "n1")]
    ]
    unreadable = fingerprint("n3", peermem=None, errors=[error("gpu.peermem", probe="gpu")])
    assert gpu.check_gpudirect({"n1": fps["n1"], "n3": unreadable}) == []
    assert gpu.check_driver({"n1": fps["n1"], "n3": {**fps["n1"], "gpu": None}}) == []


def test_unknown_node_rule() -> None:
    fps = {"n1": fingerprint("n1"), "n2": None, "n3": fingerprint("n3")}
    found = unknown_node.check(fps, stale={"n3"})
    assert groups(found) == [[("no record", "n2"), ("stale heartbeat", "n3")]]
    assert found[0].severity == "warn"
    assert unknown_node.check({"n1": fingerprint("n1")}) == []
