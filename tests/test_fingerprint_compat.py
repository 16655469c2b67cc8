"""compat_values / compat_key: the refuse-level fields the store groups nodes by."""

from __future__ import annotations

import copy
import re

from helpers.fingerprints import error, fingerprint, libnccl, plugin

from ncclguard.fingerprint.compat import COMPAT_FIELDS, compat_key, compat_values


def test_values_of_a_plain_ib_node() -> None:
    assert compat_values(fingerprint()) == {
        "nccl": "2.21.5",
        "nccl_paths": {},
        "net_plugin": "none",
        "net_abi": 0,
        "env_plugin": "none",
        "transport": "IB",
        "adds": None,  # a record without the offers part (a daemon before issue 39)
    }
    assert tuple(compat_values(fingerprint())) == COMPAT_FIELDS
    assert compat_values(fingerprint(offers=True))["adds"] == "none"


def test_values_with_plugin_and_configured_paths() -> None:
    fp = fingerprint(
        libs=[
            libnccl("2.21.5"),
            libnccl("2.18.3", path="/opt/nccl/lib/libnccl.so.2", default=False, origin="config"),
        ],
        plugins=[plugin("IBext_v8", abis=[8, 7])],
    )
    assert compat_values(fp) == {
        "nccl": "2.21.5",
        "nccl_paths": {"/opt/nccl/lib/libnccl.so.2": "2.18.3"},
        "net_plugin": "IBext_v8",
        "net_abi": 8,
        "env_plugin": "none",
        "transport": "IBext_v8",
        "adds": None,
    }
    # what a job's own NCCL gets: v8 from 2.20.5, v7 with 2.19.3 (issue 39)
    assert compat_values(fingerprint(plugins=[plugin("IBext_v8", abis=[8, 7])],
                                     offers=True))["adds"] == "IBext_v8 v8..v7"
    # the plugin's highest ABI that the older library knows
    fp = fingerprint(libs=[libnccl("2.18.3")], plugins=[plugin("IBext_v8", abis=[8, 7, 6])])
    assert compat_values(fp)["net_abi"] == 6


def test_unknown_is_none_and_absent_is_explicit() -> None:
    fp = fingerprint(libs=[])
    assert compat_values(fp)["nccl"] == "none"
    fp = fingerprint(libs=[libnccl(None)])  # a stub without a banner
    assert compat_values(fp)["nccl"] is None
    fp = fingerprint(errors=[error("libnccl", probe="nccl")])
    fp["libnccl"] = None
    values = compat_values(fp)
    assert values["nccl"] is None
    assert values["nccl_paths"] is None


def test_key_is_short_stable_and_ignores_identity() -> None:
    a = fingerprint("n1")
    b = fingerprint("n2", boot_id="x")
    b["host"]["collected_at"] = "2027-01-01T00:00:00Z"
    b["rdma"]["devices"][0]["node_guid"] = "0000:0000:0000:0001"
    assert re.fullmatch(r"[0-9a-f]{16}", compat_key(a))
    assert compat_key(a) == compat_key(b)
    assert compat_key(a) == compat_key(copy.deepcopy(a))


def test_key_changes_with_each_refuse_field() -> None:
    base = compat_key(fingerprint())
    variants = [
        fingerprint(nccl="2.18.3"),
        fingerprint(plugins=[plugin()]),
        fingerprint(conf={"NCCL_IB_DISABLE": "1"}),
        fingerprint(
            libs=[libnccl(), libnccl("2.21.5", path="/opt/l/libnccl.so.2", default=False,
                                      origin="config")]
        ),
    ]
    keys = {compat_key(fp) for fp in variants}
    assert base not in keys
    assert len(keys) == len(variants)
    # a warn-level difference does not change the key
    assert compat_key(fingerprint(driver="535.104.05")) == base


def test_env_plugin_unknown_on_a_record_without_the_effective_part() -> None:
    """A daemon before issue 13 wrote no ``effective`` part: its env plugin is unknown
    (never a difference), not "none"."""
    fp = fingerprint()
    del fp["effective"]
    assert compat_values(fp)["env_plugin"] is None
