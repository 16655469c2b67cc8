"""Reading every Slurm release's ``--json`` answers (ncclguard.slurm.schema), offline.

The answers are in ``tests/data/slurm/``:

- ``real/<release>/``: recorded from the real commands by ``devtools/record_slurm.py``
  (22.05.8 on the host, 24.11.5 in the Debian 13 root of ``scripts/slurm-root.sh``)
- ``recorded/<release>/``: written by hand from Slurm's source for releases that cannot
  run here (23.02, 23.11, 24.05, 25.05, 25.11); their README says from which files

Each directory's ``scene.json`` says what was set up; every release must read back as it.
The live tests (``test_slurm_adapter.py``) run the same reads against the real cluster.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from ncclguard.slurm import JobInfo, Release, Slurm, SlurmError, SlurmSchemaError, output_path
from ncclguard.slurm.schema import (
    FAMILIES,
    KNOWN_PARSERS,
    NEWEST_PARSER,
    parse_jobs,
    parse_nodes,
    parser_for,
    read_meta,
)

DATA = Path(__file__).parent / "data" / "slurm"
DIRS = sorted(p.parent for p in DATA.glob("*/*/scene.json"))
IDS = [f"{d.parent.name}-{d.name}" for d in DIRS]


def _load(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    assert isinstance(data, dict)
    return data


def _scene(d: Path) -> dict[str, Any]:
    return _load(d / "scene.json")


def test_every_release_from_2205_to_2511_has_answers() -> None:
    real = {d.name[:5] for d in DIRS if d.parent.name == "real"}
    recorded = {d.name[:5] for d in DIRS if d.parent.name == "recorded"}
    assert {"22.05", "24.11"} <= real  # the two that run here
    assert {"23.02", "23.11", "24.05", "25.05", "25.11"} <= recorded | real


@pytest.mark.parametrize("d", DIRS, ids=IDS)
def test_meta_names_the_release_and_a_known_parser(d: Path) -> None:
    for f in d.glob("*.json"):
        if f.name == "scene.json":
            continue
        meta = read_meta(_load(f))
        assert meta.release == Release.parse(_scene(d)["release"]), f
        assert meta.parser in KNOWN_PARSERS, f


@pytest.mark.parametrize("d", DIRS, ids=IDS)
@pytest.mark.parametrize("answer", ["sinfo", "scontrol_show_nodes"])
def test_nodes_read_back_as_set_up(d: Path, answer: str) -> None:
    f = d / f"{answer}.json"
    if not f.exists():
        assert answer == "scontrol_show_nodes" and d.name.startswith("22.05"), f"{f} missing"
        return  # 22.05's scontrol has no --json
    if answer == "sinfo" and not d.name.startswith("22.05"):
        # 23.02 on: sinfo --json lists groups of nodes; the adapter asks scontrol there
        with pytest.raises(SlurmSchemaError, match="groups of nodes"):
            parse_nodes(_load(f))
        return
    scene = _scene(d)
    nodes = {n.name: n for n in parse_nodes(_load(f))}
    assert sorted(nodes) == scene["nodes"]
    for name, n in nodes.items():
        assert n.partitions == (scene["partition"],), name
        assert n.drained == (name in scene["drained"]), name
        assert n.reason == scene["drained"].get(name, ""), name
        assert n.state in {"idle", "allocated", "mixed"}, (name, n.state)
        assert n.cpus > 0
        # NodeAddr and NodeHostname: the dev cluster's of the time, or Slurm's defaults
        assert (n.address, n.hostname) in {("127.0.0.1", "localhost"), (name, name)}, name
    for name, feats in scene["features"].items():
        assert nodes[name].features == tuple(feats), name


def _jobs(d: Path, answer: str) -> dict[int, JobInfo]:
    return {j.job_id: j for j in parse_jobs(_load(d / f"{answer}.json"))}


def _check_batch(job: JobInfo, want: dict[str, Any]) -> None:
    assert job.batch
    assert job.state == want["state"] and job.state_reason == want["state_reason"]
    assert (job.name, job.node_count) == (want["name"], want["node_count"])
    assert job.excluded_nodes == want["excluded_nodes"]
    assert (job.comment, job.admin_comment) == (want["comment"], want["admin_comment"])
    assert job.std_out == job.std_err == want["std_out"]  # %j, %x expanded, %N left
    assert job.start_time is None and job.nodes == "" and job.batch_host == ""
    assert job.array_task_id is None and job.array_job_id == 0
    assert job.user and job.user_id is not None


@pytest.mark.parametrize("d", DIRS, ids=IDS)
def test_jobs_read_back_as_set_up(d: Path) -> None:
    scene = _scene(d)
    jobs = _jobs(d, "squeue")
    batch, inter = scene["batch_job"], scene["interactive_job"]
    _check_batch(jobs[batch["job_id"]], batch)
    i = jobs[inter["job_id"]]
    assert not i.batch and i.state == inter["state"]
    assert (i.nodes, i.node_count) == (inter["nodes"], inter["node_count"])
    assert i.start_time is not None and i.end_time is not None and i.end_time > i.start_time
    assert i.std_out == i.std_err == ""  # interactive: no output file
    for answer in ("scontrol_show_job_7", "squeue_j7"):
        if (d / f"{answer}.json").exists():
            _check_batch(_jobs(d, answer)[batch["job_id"]], batch)


def test_families_cover_each_parser_once() -> None:
    parsers = [p for f in FAMILIES for p in f.parsers]
    assert len(parsers) == len(set(parsers)) and parsers[-1] == NEWEST_PARSER == "v0.0.44"


# ------------------------------------------------------------ answers we cannot read
def _some_answer() -> dict[str, Any]:
    real = sorted((DATA / "real").glob("24.11*/squeue.json"))
    assert real, "the 24.11 answers are missing"
    return _load(real[0])


def test_unknown_parser_names_the_release() -> None:
    data = _some_answer()
    data["meta"]["plugin"]["data_parser"] = "data_parser/v0.0.47"
    data["meta"]["slurm"]["release"] = "27.05.1"
    data["meta"]["slurm"]["version"] = {"major": "27", "minor": "05", "micro": "1"}
    with pytest.raises(SlurmSchemaError, match=r"Slurm 27\.05\.1 \(data parser v0\.0\.47\)"):
        parse_jobs(data, "squeue --json")


def test_answer_without_meta_is_refused() -> None:
    data = _some_answer()
    del data["meta"]
    with pytest.raises(SlurmSchemaError, match="names no release"):
        parse_jobs(data)


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d.pop("jobs"),
        lambda d: d.__setitem__("jobs", {"7": {}}),
        lambda d: d["jobs"][0].pop("job_state"),
        lambda d: d["jobs"].__setitem__(0, "job 7"),
    ],
    ids=["no-jobs", "jobs-not-a-list", "record-without-state", "record-not-an-object"],
)
def test_damaged_answers_are_schema_errors(damage: Any) -> None:
    data = copy.deepcopy(_some_answer())
    damage(data)
    with pytest.raises(SlurmSchemaError, match=r"Slurm 24\.11\.5"):
        parse_jobs(data, "squeue --json")


def test_release_parse() -> None:
    assert Release.parse("slurm-wlm 22.05.8") == Release(22, 5, 8)
    assert Release.parse("slurm 25.11.0-0rc1") == Release(25, 11, 0)
    assert str(Release(24, 11, 5)) == "24.11.5" and Release(23, 2) < Release(23, 11)
    with pytest.raises(Exception, match="not a Slurm version"):
        Release.parse("scontrol: error: no config")


# ------------------------------------------------------------ the call for each release
@pytest.mark.parametrize(
    ("release", "parser"),
    [("22.05.8", None), ("23.02.8", None), ("23.11.0", "v0.0.40"), ("24.05.8", "v0.0.41"),
     ("24.11.5", "v0.0.42"), ("25.05.0", "v0.0.43"), ("25.11.7", "v0.0.44"),
     ("26.05.1", "v0.0.44")],
)  # fmt: skip
def test_parser_selected_for_each_release(release: str, parser: str | None) -> None:
    assert parser_for(Release.parse(release)) == parser
    assert parser is None or parser in KNOWN_PARSERS


def _fake_scontrol(tmp_path: Path, version: str, answer: dict[str, Any]) -> Path:
    """Stand-in scontrol and squeue for a release that cannot run here: they log their
    arguments (squeue's with a "squeue " prefix), print ``version`` for --version and
    ``answer`` for anything else."""
    (tmp_path / "answer.json").write_text(json.dumps(answer))
    for name, prefix in (("scontrol", ""), ("squeue", "squeue ")):
        p = tmp_path / name
        p.write_text(
            "#!/bin/sh\n"
            f'echo "{prefix}$*" >> {tmp_path}/calls.log\n'
            f'[ "$1" = --version ] && {{ echo "slurm {version}"; exit 0; }}\n'
            f"cat {tmp_path}/answer.json\n"
        )
        p.chmod(0o700)
    return tmp_path


def test_a_newer_slurm_is_asked_for_the_newest_parser_we_read(tmp_path: Path) -> None:
    answer = _load(DATA / "recorded" / "25.11" / "scontrol_show_nodes.json")
    s = Slurm(_fake_scontrol(tmp_path, "26.05.1", answer))
    assert sorted(n.name for n in s.nodes()) == ["n1", "n2", "n3", "n4"]
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert calls == ["--version", "show nodes --json=v0.0.44"]


def test_an_answer_we_cannot_read_fails_as_a_slurm_error_naming_the_release(
    tmp_path: Path,
) -> None:
    answer = _load(DATA / "recorded" / "25.11" / "scontrol_show_job_7.json")
    answer["meta"]["plugin"]["data_parser"] = "data_parser/v0.0.46"
    answer["meta"]["slurm"]["release"] = "26.11.0"
    answer["meta"]["slurm"]["version"] = {"major": "26", "minor": "11", "micro": "0"}
    s = Slurm(_fake_scontrol(tmp_path, "26.11.0", answer))
    with pytest.raises(SlurmError) as err:  # the callers' fall-backs catch SlurmError
        s.job(7)
    assert isinstance(err.value, SlurmSchemaError)
    assert "Slurm 26.11.0 (data parser v0.0.46)" in str(err.value)
    assert "squeue --json" in str(err.value)
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert calls == ["--version", "squeue -j 7 -t all --json=v0.0.44"]


def test_the_release_is_asked_once_per_process(tmp_path: Path) -> None:
    """The gate makes several Slurm objects in one run: one --version between them."""
    answer = _load(DATA / "recorded" / "25.11" / "scontrol_show_nodes.json")
    bin_dir = _fake_scontrol(tmp_path, "25.11.7", answer)
    for _ in range(3):
        Slurm(bin_dir, conf="/etc/slurm/slurm.conf").nodes()
    Slurm(bin_dir, conf="/other/slurm.conf").nodes()  # another cluster: asked again
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert calls.count("--version") == 2 and calls.count("show nodes --json=v0.0.44") == 4


# ------------------------------------------------------------ states and flags, alike
def _real(release: str, name: str) -> dict[str, Any]:
    found = sorted((DATA / "real").glob(f"{release}*/{name}.json"))
    assert found, f"no real {release} {name}"
    return _load(found[0])


@pytest.mark.parametrize(
    ("typed", "flat"),
    [(["RUNNING", "CONFIGURING"], "CONFIGURING"), (["COMPLETED", "COMPLETING"], "COMPLETING"),
     (["PENDING", "REQUEUE_HOLD"], "REQUEUE_HOLD"), (["PENDING"], "PENDING"),
     (["CANCELLED"], "CANCELLED")],
)  # fmt: skip
def test_a_job_state_reads_as_squeue_names_it_on_every_release(
    typed: list[str], flat: str
) -> None:
    """22.05 and 23.02 give job_state_string() (a flag before the base); v0.0.40+ give
    [base, flags...]: both read as the string squeue's %T prints."""
    new, old = _real("24.11", "squeue"), _real("22.05", "squeue")
    new["jobs"][0]["job_state"] = typed
    old["jobs"][0]["job_state"] = flat
    assert parse_jobs(new)[0].state == parse_jobs(old)[0].state == flat


def test_node_flags_read_alike() -> None:
    new, old = _real("24.11", "scontrol_show_nodes"), _real("22.05", "sinfo")
    new["nodes"][0]["state"] = ["DOWN", "DRAIN", "NOT_RESPONDING"]
    old["nodes"][0]["state"], old["nodes"][0]["state_flags"] = "down", ["DRAIN", "NOT_RESPONDING"]
    a, b = parse_nodes(new)[0], parse_nodes(old)[0]
    assert (a.state, a.flags, a.drained) == (b.state, b.flags, b.drained)
    assert (a.state, a.flags, a.drained) == ("down", ("DRAIN", "NOT_RESPONDING"), True)


@pytest.mark.parametrize("key", ["partitions", "features", "reason"])
def test_a_node_record_without_what_decisions_read_is_refused(key: str) -> None:
    """Without partitions a node would silently be in none (an empty partition holds the
    job): a record that lacks a key every parser writes is a schema error."""
    for data in (_real("24.11", "scontrol_show_nodes"), _real("22.05", "sinfo")):
        del data["nodes"][0][key]
        with pytest.raises(SlurmSchemaError, match=f"without {key}"):
            parse_nodes(data)


@pytest.mark.parametrize("key", ["nodes", "batch_flag", "excluded_nodes", "standard_output"])
def test_a_job_record_without_what_decisions_read_is_refused(key: str) -> None:
    for data in (_real("24.11", "squeue"), _real("22.05", "squeue")):
        del data["jobs"][0][key]
        with pytest.raises(SlurmSchemaError, match=f"without {key}"):
            parse_jobs(data)


def test_percent_b_as_the_nodes_of_each_release_expand_it() -> None:
    """%b (array task id modulo 10) is expanded by the node from 24.11: read from the raw
    patterns of 25.05+ (v0.0.43+) it is expanded; from 22.05's it stays as written."""
    assert output_path("/o/%A_%a-%b-%3b.log", job_id=9, array_job_id=5,
                       array_task_id=23, array_mod10=True) == "/o/5_23-3-003.log"  # fmt: skip
    assert output_path("/o/%b.log", job_id=9) == "/o/%b.log"
    new, old = _real("24.11", "squeue"), _real("22.05", "squeue")
    new["meta"]["plugin"]["data_parser"] = "data_parser/v0.0.43"  # as 25.05 writes it
    for data in (new, old):
        j = data["jobs"][0]
        j["standard_output"], j["standard_error"] = "/o/out-%j-%b.log", ""
    jid = parse_jobs(new)[0].job_id
    assert parse_jobs(new)[0].std_out == f"/o/out-{jid}-4.log"  # NO_VAL % 10, as Slurm
    assert parse_jobs(old)[0].std_out == f"/o/out-{parse_jobs(old)[0].job_id}-%b.log"
