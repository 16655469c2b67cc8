"""A job's own NCCL_* variables applied to each node (issue 40, ncclguard/policy/jobvars.py).

NCCL applies /etc/nccl.conf only where the environment does not set a variable: a job
that sets NCCL_IB_DISABLE=1 runs on Socket on every node, whatever the nodes' IB ports.
The gate derives each node's transport again with the job's values, from the inputs a
node's record keeps; what a record cannot tell keeps the node's own value and is named
(job-vars), so that no variable of a user's can hide a difference.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.cli import runner
from helpers.fingerprints import device, error, fingerprint, port
from hypothesis import given, settings
from hypothesis import strategies as st

from ncclguard.config import PolicyConfig
from ncclguard.fingerprint.transport import (
    effective_transport,
    transport_inputs,
    transport_under,
)
from ncclguard.policy import evaluate_env, evaluate_nccl, evaluate_values, node_values
from ncclguard.policy.schedule import class_values
from ncclguard.store import Inventory

# ---- the transport from a record's inputs is the fingerprint's -----------------------

VALUES = {
    "NCCL_IB_HCA": ["mlx5_0", "^mlx5_0", "=mlx5_1", "mlx5_1:1", "", "^"],
    "NCCL_IB_DISABLE": ["0", "1", "0x0", " 2"],
    "NCCL_NET": ["IB", "socket", "IBext_v8", "Foo", ""],
    "NCCL_SOCKET_IFNAME": ["ib0", "^lo", "=eth0", "^ib"],
}
SETTINGS = st.fixed_dictionaries({}, optional={k: st.sampled_from(v) for k, v in VALUES.items()})
PORT = st.builds(port, st.integers(1, 2), st.sampled_from(["ACTIVE", "DOWN", None]),
                 st.sampled_from(["InfiniBand", "Ethernet", None, "IB-but-not"]))
DEVICE = st.builds(lambda i, ports: device(f"mlx5_{i}", ports=ports), st.integers(0, 2),
                   st.one_of(st.none(), st.lists(PORT, max_size=2)))
NETIF = st.fixed_dictionaries({"name": st.sampled_from(["ib0", "eth0", "lo"]),
                               "up": st.sampled_from([True, False, None]),
                               "addresses": st.sampled_from([[], ["10.0.0.1"]])})
ERRORS = st.lists(st.sampled_from([
    error("rdma.devices"), error("rdma.devices.mlx5_0.ports.1.state"),
    error("rdma.devices.mlx5_1.ports.1.link_layer"), error("rdma.libibverbs"),
    error("rdma", probe="rdma"), error("netifs", probe="netifs"),
    error("nccl_conf", probe="nccl_conf"), error("plugins", probe="plugins"),
    error("gpu.driver_version", probe="gpu")]), max_size=3)


@st.composite
def fingerprints(draw: Any) -> dict[str, Any]:
    fp = fingerprint(devices=draw(st.lists(DEVICE, max_size=3)),
                     netifs=draw(st.lists(NETIF, max_size=3)),
                     conf=draw(SETTINGS), errors=draw(ERRORS),
                     plugin_abi=draw(st.sampled_from([None, 8, 4])))
    if draw(st.booleans()):
        fp["rdma"]["libibverbs"] = None
    return fp


@settings(max_examples=400, deadline=None)
@given(fingerprints(), SETTINGS)
def test_the_transport_from_a_records_inputs_is_the_fingerprints(fp: dict, job: dict) -> None:
    """For any node and any job settings: the transport derived at the gate from the
    record's inputs is the one derived from the whole fingerprint with the job's values
    over /etc/nccl.conf's (NCCL's order), with and without the net plugin."""
    inputs = transport_inputs(fp)
    for with_plugin in (True, False):
        want_fp = copy.deepcopy(fp)
        want_fp["nccl_conf"]["settings"] = {**fp["nccl_conf"]["settings"], **job}
        want_fp["nccl_conf"]["present"] = True
        want = effective_transport(want_fp, with_plugin)
        assert transport_under(inputs, job, with_plugin) == want, (with_plugin, job)
        assert transport_under(inputs, {}, with_plugin) == effective_transport(fp, with_plugin)
    assert len(inputs) < 2048  # a few fields of a few ports: kept with every record


def test_inputs_that_are_not_a_records_are_unknown() -> None:
    for bad in (None, "", "[]", "{", '{"nccl_conf": 5}', '{"nccl_conf": {"settings": []}}',
                "1" * 10_000, '{"nccl_conf": {"present": true, "settings": {}}, '
                '"rdma": {"devices": [{"name": 5, "ports": "x"}]}, "plugin": [1]}'):
        assert transport_under(bad, {"NCCL_IB_DISABLE": "0"}) is None, bad


# ---- the verdict of a job on the host's NCCL ----------------------------------------

POLICY = PolicyConfig()


def _mixed_ib() -> dict[str, dict]:
    """n1 and n2 with their IB port up, n3 with it down: n3 falls back to Socket."""
    return {h: node_values(fingerprint(h, ports_up=0 if h == "n3" else 1))
            for h in ("n1", "n2", "n3")}


def test_ib_disabled_by_the_job_runs_on_socket_everywhere() -> None:
    records = _mixed_ib()
    v = evaluate_values(records, POLICY)
    refusing = [f.rule for f in v.findings if f.severity == "refuse"]
    assert v.decision == "refuse" and refusing == ["transport"], v.format_text()
    for job in ({"NCCL_IB_DISABLE": "1"}, {"NCCL_NET": "Socket"},
                {"NCCL_IB_HCA": "mlx9_"}):  # a filter no port passes: Socket everywhere
        v = evaluate_env(records, POLICY, job)
        # the port's own rules (rdma-*) still warn: they are the node's, not the job's
        assert v.decision == "warn", (job, v.format_text())
        assert all(f.rule.startswith("rdma-") for f in v.findings), v.format_text()
        assert any("applied on each node" in n for n in v.notes), v.notes
    # settings that leave n3 on Socket and the others on IB: refused as before
    for job in ({"NCCL_IB_DISABLE": "0"}, {"NCCL_IB_HCA": "mlx5_0"}, {"NCCL_NET": "IB"},
                {"NCCL_ALGO": "Ring"}):
        v = evaluate_env(records, POLICY, job)
        assert v.decision == "refuse" and v.odd_nodes == ["n3"], (job, v.format_text())
    assert not any(f.rule == "job-vars" for f in v.findings)
    # the job's variables change nothing in the records the gate shares between nodes
    assert records == _mixed_ib()


def test_a_record_that_cannot_tell_keeps_the_nodes_value_and_says_so() -> None:
    """An older daemon's record has no inputs: the job's NCCL_IB_DISABLE=1 cannot be
    applied there, so n3 keeps its own transport (Socket) against the others' IB:
    still refused, and job-vars names the variable and the nodes. A user's variable never
    turns a difference the records show into an accept."""
    records = _mixed_ib()
    for rec in records.values():
        del rec["job"]["inputs"]
    v = evaluate_env(records, POLICY, {"NCCL_IB_DISABLE": "1"})
    assert v.decision == "refuse" and v.odd_nodes == ["n3"], v.format_text()
    (found,) = [f for f in v.findings if f.rule == "job-vars"]
    assert found.severity == "warn"
    (label, hosts, count), = found.groups
    assert label.startswith("NCCL_IB_DISABLE=1: these nodes' records cannot tell")
    assert (hosts, count) == ("n[1-3]", 3)
    silent = evaluate_env(records, PolicyConfig(severity={"job-vars": "ignore"}),
                          {"NCCL_IB_DISABLE": "1"})
    assert silent.decision == "refuse" and "job-vars" not in {f.rule for f in silent.findings}


def test_a_hostile_value_is_cut_and_escaped_in_what_the_gate_says() -> None:
    records = _mixed_ib()
    for rec in records.values():
        del rec["job"]["inputs"]
    value = "\x1b[31m" + "A" * 5000 + "\n"
    v = evaluate_env(records, POLICY, {"NCCL_SOCKET_IFNAME": value})
    (found,) = [f for f in v.findings if f.rule == "job-vars"]
    label = found.groups[0][0]
    assert "\x1b" not in label and "\n" not in label and len(label) < 400, label
    assert "NCCL_SOCKET_IFNAME=\\x1b[31mAAA" in label and "..." in label


def test_a_setting_the_job_makes_is_not_compared_between_nodes_files() -> None:
    """n1's /etc/nccl.conf sets NCCL_TUNER_PLUGIN, n2's does not: nccl-conf warns. A job
    that sets it itself has the same value on both: nccl-conf says nothing; n2's tuner
    under that value is not in its record, so job-vars names n2 (not n1)."""
    records = {"n1": node_values(fingerprint("n1", conf={"NCCL_TUNER_PLUGIN": "t"})),
               "n2": node_values(fingerprint("n2"))}
    assert {f.rule for f in evaluate_values(records, POLICY).findings} == {"nccl-conf"}
    v = evaluate_env(records, POLICY, {"NCCL_TUNER_PLUGIN": "t"})
    assert [f.rule for f in v.findings] == ["job-vars"], v.format_text()
    assert v.findings[0].groups[0][1] == "n2"
    # NCCL_CONF_FILE: its settings are not read; the verdict notes it and stays the nodes'
    v = evaluate_env(records, POLICY, {"NCCL_CONF_FILE": "/home/a/nccl.conf"})
    assert {f.rule for f in v.findings} == {"nccl-conf"}
    assert any("NCCL_CONF_FILE=/home/a/nccl.conf: that file's settings" in n
               for n in v.notes), v.notes


# ---- the verdict of a job with its own NCCL ------------------------------------------

def _plugins(abis: dict[str, int], nccl: str | None = "2.21.5") -> dict[str, dict]:
    return {h: node_values(fingerprint(h, nccl=nccl, plugin_abi=a, offers=True))
            for h, a in abis.items()}


@pytest.mark.parametrize("host_nccl", ["2.21.5", None])  # None: no system libnccl
def test_nccl_net_ib_keeps_a_jobs_own_nccl_off_every_nodes_plugin(host_nccl: str | None
                                                                  ) -> None:
    """The plugin offers v8 on n[1-3] and v10 only on n4: NCCL 2.23.4 (v8..v5) uses it on
    n[1-3] and falls back to IB on n4: refused. With NCCL_NET=IB the job takes NCCL's own
    IB on every node: accepted. Alike on nodes that have no libnccl of their own."""
    records = _plugins({"n1": 8, "n2": 8, "n3": 8, "n4": 10}, host_nccl)
    job = {"nccl_version": "2.23.4", "net_abis": [8, 7, 6, 5], "path": "/v/libnccl.so.2",
           "source": "VIRTUAL_ENV"}
    v = evaluate_nccl(records, POLICY, job)
    assert v.decision == "refuse" and v.odd_nodes == ["n4"], v.format_text()
    v = evaluate_nccl(records, POLICY, job, variables={"NCCL_NET": "IB"})
    assert v.decision == "accept", v.format_text()
    # a plugin named by the job that the records do not describe: judged by what the
    # nodes' files give, and named
    v = evaluate_nccl(records, POLICY, job, variables={"NCCL_NET_PLUGIN": "ofi"})
    assert v.decision == "refuse" and v.odd_nodes == ["n4"]
    (found,) = [f for f in v.findings if f.rule == "job-vars"]
    assert found.groups[0][0].startswith("NCCL_NET_PLUGIN=ofi: which library it opens")


def test_nccl_net_plugin_none_is_no_plugin_from_2_28_3_and_a_name_before() -> None:
    """n4's plugin is a legacy one (v5 only). NCCL 2.28.9 (v11..v6) cannot use it:
    refused. NCCL_NET_PLUGIN=none empties 2.28.3's list: no plugin anywhere, IB on every
    node: accepted. For NCCL 2.18.3 "none" is a name (libnccl-net-none.so) that the
    records cannot follow: refused, and named."""
    records = _plugins({"n1": 8, "n2": 8, "n3": 8, "n4": 5})
    new = {"nccl_version": "2.28.9", "net_abis": [11, 10, 9, 8, 7, 6], "path": "/v/l",
           "source": "VIRTUAL_ENV"}
    assert evaluate_nccl(records, POLICY, new).decision == "refuse"
    v = evaluate_nccl(records, POLICY, new, variables={"NCCL_NET_PLUGIN": "none"})
    assert v.decision == "accept", v.format_text()
    old = {**new, "nccl_version": "2.18.3", "net_abis": [6, 5, 4]}
    records = _plugins({"n1": 6, "n2": 6, "n3": 6, "n4": 8})
    v = evaluate_nccl(records, POLICY, old, variables={"NCCL_NET_PLUGIN": "none"})
    assert v.decision == "refuse" and "job-vars" in {f.rule for f in v.findings}


def test_a_value_equal_to_the_nodes_file_is_the_record() -> None:
    conf = {"NCCL_NET_PLUGIN": "IBext"}
    records = {h: node_values(fingerprint(h, plugin_abi=8, offers=True, conf=conf))
               for h in ("n1", "n2")}
    job = {"nccl_version": "2.23.4", "net_abis": [8, 7, 6, 5], "path": "/v/l",
           "source": "VIRTUAL_ENV"}
    v = evaluate_nccl(records, POLICY, job, variables=dict(conf))
    assert v.decision == "accept" and not v.findings, v.format_text()


def test_check_var_gives_the_gates_verdict(tmp_path: Path) -> None:
    """``ncclguard check HOSTLIST --var NCCL_NAME=VALUE``: what the gate says of a job
    whose environment sets it (the same functions); bad options are named."""
    db, cfg = tmp_path / "inv.db", tmp_path / "ncclguard.toml"
    cfg.write_text("")
    with Inventory(db, values=class_values(PolicyConfig())) as inv:
        for h in ("n1", "n2", "n3"):
            inv.upsert(fingerprint(h, ports_up=0 if h == "n3" else 1), now=time.time())
    run = runner(db, cfg)
    assert run("check", "n[1-3]").exit_code == 2
    r = run("check", "n[1-3]", "--var", "NCCL_IB_DISABLE=1", "--json")
    assert r.exit_code == 1, r.output  # the ports' own rules still warn
    doc = json.loads(r.stdout)
    assert "transport" not in {f["rule"] for f in doc["findings"]}
    for bad, said in ((["--var", "NCCL_IB_DISABLE"], "give NCCL_NAME=VALUE"),
                      (["--var", "NCCL_ALGO=Ring"], "not one the gate reads"),
                      (["--var", "NCCL_NET=IB", "--image", "/x.sqsh"], "--image and --var")):
        r = run("check", "n[1-3]", *bad)
        assert r.exit_code == 3 and said in r.output, (bad, r.output)
