"""The effective transport and NCCL's NCCL_IB_HCA matching (docs/nccl.md, "Which transport
a node ends up on")."""

from __future__ import annotations

import pytest
from helpers.fingerprints import device, error, fingerprint, libnccl, plugin, port

from ncclguard.fingerprint.transport import (
    effective_transport,
    hca_matches,
    nccl_ib_ports,
    parse_ib_disable,
    parse_if_list,
)


@pytest.mark.parametrize(
    ("spec", "dev", "port_", "expected"),
    [
        (None, "mlx5_0", 1, True),  # unset: every device
        ("", "mlx5_0", 1, True),  # empty: no list, every device
        ("mlx5", "mlx5_0", 1, True),  # prefix
        ("mlx5_1", "mlx5_10", 1, True),  # prefix also matches mlx5_10
        ("=mlx5_1", "mlx5_10", 1, False),  # exact
        ("=mlx5_1", "mlx5_1", 1, True),
        ("mlx5_0:1", "mlx5_0", 1, True),
        ("mlx5_0:1", "mlx5_0", 2, False),  # another port
        ("mlx5_0:1", "mlx5_0", -1, True),  # the device as a whole
        ("^mlx5_0", "mlx5_0", 1, False),  # exclude
        ("^mlx5_0", "mlx5_1", 1, True),
        ("^mlx5_1", "mlx5_10", 1, False),  # exclusion is by prefix too
        ("^=mlx5_1", "mlx5_10", 1, True),  # exact exclusion
        ("^=mlx5_1", "mlx5_1", 1, False),
        ("^mlx5_0:1", "mlx5_0", 2, True),  # only port 1 excluded
        ("^", "mlx5_0", 1, False),  # an empty exclude list excludes everything in NCCL
        ("mlx5_0,mlx5_3", "mlx5_3", 1, True),
        ("mlx5_0,,mlx5_3", "mlx5_3", 1, True),  # empty entries are skipped
        (" mlx5_0", "mlx5_0", 1, False),  # no white space trimming
        ("=mlx5_0:1:0:0", "mlx5_0", 1, True),  # :rail:plane of 2.30.7 ignored
        ("MLX5_0", "mlx5_0", 1, False),  # case-sensitive
    ],
)
def test_hca_matches(spec: str | None, dev: str, port_: int, expected: bool) -> None:
    assert hca_matches(spec, dev, port_) is expected


def test_parse_if_list() -> None:
    assert parse_if_list("^=mlx5_0:1,mlx5_1") == (True, True, [("mlx5_0", 1), ("mlx5_1", -1)])
    assert parse_if_list("mlx5_0:x") == (False, False, [("mlx5_0", 0)])  # atoi("x") == 0
    assert parse_if_list(None) == (False, False, [])


@pytest.mark.parametrize(
    ("value", "disabled"),
    [(None, False), ("0", False), ("1", True), ("2", True), ("yes", False), (" 1", True),
     ("0x1", True), ("", False),
     # strtoll(value, NULL, 0) keeps the longest valid prefix; no trimming in nccl.conf
     ("1 # no IB", True), ("1;", True), ("1.0", True), ("2x", True), ("1\r", True),
     ("08", False), ("010", True), ("0x", False), ("-1", True), ("+0", False),
     ("99999999999999999999", False)],  # ERANGE: NCCL keeps its default, 0
)
def test_parse_ib_disable(value: str | None, disabled: bool) -> None:
    assert parse_ib_disable(value) is disabled


def test_ib_and_roce_and_mixed() -> None:
    assert effective_transport(fingerprint()) == "IB"
    roce = fingerprint(devices=[device(ports=[port(link_layer="Ethernet")])])
    assert effective_transport(roce) == "RoCE"
    mixed = fingerprint(
        devices=[device("mlx5_0"), device("mlx5_1", ports=[port(link_layer="Ethernet")])]
    )
    assert effective_transport(mixed) == "IB+RoCE"


def test_socket_when_no_port_qualifies() -> None:
    down = fingerprint(devices=[device(ports=[port(state="DOWN")])])
    assert effective_transport(down) == "Socket"
    assert effective_transport(fingerprint(devices=[])) == "Socket"
    odd_ll = fingerprint(devices=[device(ports=[port(link_layer="Unspecified")])])
    assert effective_transport(odd_ll) == "Socket"


def test_nccl_ib_hca_selects_ports() -> None:
    devs = [device("mlx5_0", ports=[port(link_layer="Ethernet")]), device("mlx5_1")]
    assert effective_transport(fingerprint(devices=devs)) == "IB+RoCE"
    assert effective_transport(fingerprint(devices=devs, conf={"NCCL_IB_HCA": "mlx5_1"})) == "IB"
    assert effective_transport(fingerprint(devices=devs, conf={"NCCL_IB_HCA": "^mlx5_1"})) == (
        "RoCE"
    )
    # prefix: mlx5_1 selects mlx5_10; '=' does not
    devs10 = [device("mlx5_10")]
    assert effective_transport(fingerprint(devices=devs10, conf={"NCCL_IB_HCA": "mlx5_1"})) == (
        "IB"
    )
    assert effective_transport(
        fingerprint(devices=devs10, conf={"NCCL_IB_HCA": "=mlx5_1"})
    ) == "Socket"
    # port selection: port 2 is the only ACTIVE one, and the list asks for port 1
    two = [device("mlx5_0", ports=[port(1, state="DOWN"), port(2)])]
    assert effective_transport(fingerprint(devices=two, conf={"NCCL_IB_HCA": "mlx5_0:1"})) == (
        "Socket"
    )
    assert effective_transport(fingerprint(devices=two, conf={"NCCL_IB_HCA": "mlx5_0:2"})) == "IB"


def test_ib_disable_and_nccl_net() -> None:
    assert effective_transport(fingerprint(conf={"NCCL_IB_DISABLE": "1"})) == "Socket"
    assert effective_transport(fingerprint(conf={"NCCL_IB_DISABLE": "0"})) == "IB"
    assert effective_transport(fingerprint(conf={"NCCL_NET": "Socket"})) == "Socket"
    assert effective_transport(fingerprint(conf={"NCCL_NET": "ib"})) == "IB"
    # NCCL_NET=IB with IB disabled: NCCL finds no network and fails
    assert effective_transport(
        fingerprint(conf={"NCCL_NET": "IB", "NCCL_IB_DISABLE": "1"})
    ) == "none (NCCL_NET=IB)"
    assert effective_transport(fingerprint(conf={"NCCL_NET": "Libfabric"})) == (
        "none (NCCL_NET=Libfabric)"
    )


def test_no_ip_interface_or_verbs_means_socket() -> None:
    assert effective_transport(fingerprint(netifs=[])) == "Socket"
    down = [{"name": "ib0", "up": False, "addresses": ["10.0.0.1"]}]
    assert effective_transport(fingerprint(netifs=down)) == "Socket"
    only_eth = [{"name": "eth0", "up": True, "addresses": ["10.1.0.1"]}]
    assert effective_transport(fingerprint(netifs=only_eth)) == "IB"
    assert effective_transport(
        fingerprint(netifs=only_eth, conf={"NCCL_SOCKET_IFNAME": "ib"})
    ) == "Socket"
    fp = fingerprint()
    fp["rdma"]["libibverbs"] = None
    assert effective_transport(fp) == "Socket"


def test_plugin_wins_when_loaded() -> None:
    fp = fingerprint(plugins=[plugin("IBext_v8")])
    assert effective_transport(fp) == "IBext_v8"
    # no common ABI: NCCL ignores the plugin and falls back to IB
    old = fingerprint(libs=[libnccl("2.18.3")], plugins=[plugin("AWS Libfabric", abis=[12, 11])])
    assert effective_transport(old) == "IB"
    # NCCL_NET picks a network by name, case-insensitively
    assert effective_transport(fingerprint(plugins=[plugin()], conf={"NCCL_NET": "IB"})) == "IB"
    assert effective_transport(
        fingerprint(plugins=[plugin()], conf={"NCCL_NET": "ibext_v8"})
    ) == "IBext_v8"


def test_unknown_only_where_it_could_change_the_result() -> None:
    # the state of the only port is unreadable: unknown
    fp = fingerprint(
        devices=[device(ports=[port(state=None)])],
        errors=[error("rdma.devices.mlx5_0.ports.1.state")],
    )
    assert effective_transport(fp) is None
    # another ACTIVE IB port already makes it IB; an unreadable IB port changes nothing
    fp = fingerprint(devices=[device("mlx5_0"), device("mlx5_1", ports=[port(state=None)])])
    assert effective_transport(fp) == "IB"
    # ... but an unreadable link layer could make it IB+RoCE
    fp = fingerprint(devices=[device("mlx5_0"), device("mlx5_1", ports=[port(link_layer=None)])])
    assert effective_transport(fp) is None
    # an unreadable port that NCCL_IB_HCA excludes does not matter
    fp = fingerprint(
        devices=[device("mlx5_0"), device("mlx5_1", ports=[port(link_layer=None)])],
        conf={"NCCL_IB_HCA": "=mlx5_0"},
    )
    assert effective_transport(fp) == "IB"
    # an unreadable rate is not something the transport needs
    fp = fingerprint(devices=[device(ports=[port(rate_gbps=None)])])
    assert effective_transport(fp) == "IB"
    # no device list at all: unknown, unless IB is disabled anyway
    fp = fingerprint(errors=[error("rdma.devices")])
    fp["rdma"]["devices"] = None
    assert effective_transport(fp) is None
    fp["nccl_conf"].update(present=True, settings={"NCCL_IB_DISABLE": "1"})
    assert effective_transport(fp) == "Socket"
    # unreadable nccl.conf: unknown
    fp = fingerprint()
    fp["nccl_conf"] = None
    assert effective_transport(fp) is None
    # unreadable plugin list: unknown (a plugin would win)
    fp = fingerprint(errors=[error("plugins", probe="plugins")])
    fp["plugins"] = None
    fp["net"] = None
    assert effective_transport(fp) is None


def test_nccl_ib_ports() -> None:
    devs = [device("mlx5_0"), device("mlx5_1", ports=[port(1, state="DOWN"), port(2)])]
    ports = nccl_ib_ports(fingerprint(devices=devs))
    assert ports is not None
    assert [(p["device"], p["port"]) for p in ports] == [("mlx5_0", 1), ("mlx5_1", 2)]
    only = nccl_ib_ports(fingerprint(devices=devs, conf={"NCCL_IB_HCA": "=mlx5_1"}))
    assert only is not None
    assert [(p["device"], p["port"]) for p in only] == [("mlx5_1", 2)]
