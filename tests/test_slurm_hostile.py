"""Garbled Slurm answers: the adapter raises SlurmError (so the gate's fall-backs apply:
requeue without steering, name order for the tie-break), never another exception and
never a typed result read from a wrong shape (``"partitions": 5`` is no partition "5").

Every real and recorded answer (tests/data/slurm) is the seed: hypothesis replaces one
field of one record with arbitrary JSON, and the whole answer with arbitrary text, and
the readers must either read typed values or refuse with SlurmSchemaError.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ncclguard.slurm import JobInfo, NodeInfo, Slurm, SlurmError, SlurmSchemaError
from ncclguard.slurm.schema import parse_jobs, parse_nodes

DATA = Path(__file__).parent / "data" / "slurm"
NODE_FILES = [*DATA.glob("*/*/scontrol_show_nodes.json"), *DATA.glob("real/22.05*/sinfo.json")]
NODE_ANSWERS = [json.loads(p.read_text()) for p in sorted(NODE_FILES)]
JOB_ANSWERS = [json.loads(p.read_text()) for p in sorted(DATA.glob("*/*/squeue.json"))]

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _typed_node(n: NodeInfo) -> None:
    assert isinstance(n.name, str) and isinstance(n.state, str) and isinstance(n.reason, str)
    assert all(isinstance(x, str) for x in (*n.flags, *n.partitions, *n.features))
    assert isinstance(n.cpus, int)


def _typed_job(j: JobInfo) -> None:
    for v in (j.state, j.user, j.partition, j.nodes, j.required_nodes, j.excluded_nodes,
              j.state_reason, j.admin_comment, j.comment, j.name, j.work_dir, j.batch_host,
              j.std_out, j.std_err):  # fmt: skip
        assert isinstance(v, str)
    assert isinstance(j.job_id, int) and isinstance(j.node_count, int)
    assert isinstance(j.batch, bool) and isinstance(j.restart_count, int)
    assert j.user_id is None or isinstance(j.user_id, int)
    assert j.start_time is None or isinstance(j.start_time, float)


@settings(max_examples=400, deadline=None)
@given(which=st.integers(0, 10**6), key=st.sampled_from(
    ["name", "state", "state_flags", "reason", "partitions", "features", "cpus", "hostname"]),
    value=JSON)  # fmt: skip
def test_a_garbled_node_field_is_read_or_refused(which: int, key: str, value: Any) -> None:
    data = copy.deepcopy(NODE_ANSWERS[which % len(NODE_ANSWERS)])
    data["nodes"][which % len(data["nodes"])][key] = value
    try:
        nodes = parse_nodes(data)
    except SlurmSchemaError:
        return
    for n in nodes:
        _typed_node(n)
    if key == "partitions" and not isinstance(value, (list, str)):
        pytest.fail(f"partitions={value!r} was read as {nodes}")


JOB_KEYS = ["job_id", "job_state", "user_name", "user_id", "partition", "nodes", "node_count",
            "required_nodes", "excluded_nodes", "batch_flag", "comment", "admin_comment",
            "start_time", "end_time", "array_task_id", "array_job_id", "standard_output",
            "standard_error", "current_working_directory", "restart_cnt", "priority"]  # fmt: skip


@settings(max_examples=600, deadline=None)
@given(which=st.integers(0, 10**6), key=st.sampled_from(JOB_KEYS), value=JSON)
def test_a_garbled_job_field_is_read_or_refused(which: int, key: str, value: Any) -> None:
    data = copy.deepcopy(JOB_ANSWERS[which % len(JOB_ANSWERS)])
    data["jobs"][which % len(data["jobs"])][key] = value
    try:
        jobs = parse_jobs(data)
    except SlurmSchemaError:
        return
    for j in jobs:
        _typed_job(j)


@settings(max_examples=300, deadline=None)
@given(which=st.integers(0, 10**6), key=st.sampled_from(["meta", "jobs", "errors", "nodes"]),
       value=JSON)  # fmt: skip
def test_a_garbled_answer_is_read_or_refused(which: int, key: str, value: Any) -> None:
    data = copy.deepcopy(JOB_ANSWERS[which % len(JOB_ANSWERS)])
    data[key] = value
    try:
        for j in parse_jobs(data):
            _typed_job(j)
    except SlurmSchemaError:
        pass


def _fake(tmp_path: Path, output: bytes, version: str = "24.11.5") -> Slurm:
    (tmp_path / "out").write_bytes(output)
    for name in ("scontrol", "squeue", "sinfo"):
        p = tmp_path / name
        p.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo "slurm {version}"; exit 0; }}\n'
                     f"cat {tmp_path / 'out'}\n")  # fmt: skip
        p.chmod(0o700)
    return Slurm(tmp_path)


@pytest.mark.parametrize(
    "output",
    [b"[" * 100_000 + b"]" * 100_000,  # nested past Python's recursion limit
     b'{"jobs": [], "errors": 5}', b'{"errors": "x"}', b"\xff\xfe garbage", b"",
     b'{"nodes": [{"name": "n1", "state": ["IDLE"], "partitions": 5, "features": [],'
     b' "reason": ""}], "meta": {"plugin": {"data_parser": "data_parser/v0.0.42"},'
     b' "slurm": {"release": "24.11.5", "version": {"major": "24", "minor": "11",'
     b' "micro": "5"}}}}',
     b'{"meta": {"slurm": {"version": {"major": Infinity, "minor": 1}}}, "nodes": []}'],
    ids=["deep", "errors-int", "errors-str", "not-utf8", "empty", "partitions-int", "inf"],
)
def test_garbled_output_of_the_commands_is_a_slurm_error(tmp_path: Path, output: bytes) -> None:
    s = _fake(tmp_path, output)
    with pytest.raises(SlurmError):
        s.nodes()
    with pytest.raises(SlurmError):
        s.job(7)
