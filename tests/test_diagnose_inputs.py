"""diagnose: bad input gets a defined outcome and an error naming the file and the cause;
the NCCL prefix parser; the catalog's validation and merging; the inventory correlation
(a real SQLite store with history, the real policy); the CLI; the Epilog hook."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import pytest
from helpers.cli import run_cli
from helpers.fingerprints import fingerprint

from ncclguard.diagnose import load_catalog, run
from ncclguard.diagnose.catalog import CatalogError, needles_of
from ncclguard.diagnose.diagnosis import version_of_code
from ncclguard.diagnose.logparse import MAX_LINE, LogError, LogReader, parse_prefix
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory

CORPUS = Path(__file__).parent / "diagnose_logs"
MISMATCH = CORPUS / "version-differs-16-hosts.log"


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


# ------------------------------------------------------------------ the prefix parser
@pytest.mark.parametrize(
    ("line", "host", "pid", "dev", "level", "src", "rank", "msg"),
    [
        ("vm:7260:7260 [32766] NCCL INFO Bootstrap : Using eth0:192.0.2.2<0>",
         "vm", 7260, 32766, "INFO", None, None, "Bootstrap : Using eth0:192.0.2.2<0>"),
        ("n1:13331:13331 [-1] init.cc:1631 NCCL WARN Cuda failure 'x'",
         "n1", 13331, -1, "WARN", "init.cc:1631", None, "Cuda failure 'x'"),
        ("[2026-11-30 02:18:45] vm:7321:7321 [0] misc/cudawrap.cc:217 NCCL WARN Cuda failure",
         "vm", 7321, 0, "WARN", "misc/cudawrap.cc:217", None, "Cuda failure"),
        ("12: node01.cluster:4:5 [3] NCCL INFO NCCL version 2.21.5+cuda12.4",
         "node01.cluster", 4, 3, "INFO", None, 12, "NCCL version 2.21.5+cuda12.4"),
        ("[rank7]: gpu-a02:1:1 [7] NCCL INFO x", "gpu-a02", 1, 7, "INFO", None, 7, "x"),
        ("[1,5]<stderr>:h:1:2 [0] NCCL INFO y\r\n", "h", 1, 0, "INFO", None, 5, "y"),
    ],
)  # fmt: skip
def test_prefix(line, host, pid, dev, level, src, rank, msg):
    p = parse_prefix(line)
    assert p is not None
    assert (p.host, p.pid, p.dev, p.level, p.src, p.rank, p.message) == (
        host, pid, dev, level, src, rank, msg,
    )  # fmt: skip


@pytest.mark.parametrize(
    "line",
    ["NCCL INFO no prefix", "n1:x:1 [0] NCCL INFO bad pid", "n1:1:1 NCCL CALL ncclAllReduce",
     "RuntimeError: NCCL error in: x.cpp:1, unhandled system error", ""],
)  # fmt: skip
def test_not_a_prefix(line):
    assert parse_prefix(line) is None


def test_version_codes():
    assert version_of_code(22105) == "2.21.5"
    assert version_of_code(22605) == "2.26.5"
    assert version_of_code(2804) == "2.8.4"


# ------------------------------------------------------------------ reading logs
def test_missing_log_names_the_file(catalog, tmp_path):
    with pytest.raises(LogError, match=r"nope\.log: log file not found"):
        run([tmp_path / "nope.log"], catalog=catalog)


def test_directory_is_not_a_log(tmp_path):
    with pytest.raises(LogError, match="is a directory"):
        LogReader(tmp_path)


def test_gzip_is_detected_by_content_not_name(catalog, tmp_path):
    gz = tmp_path / "job.out"  # no .gz suffix
    gz.write_bytes(gzip.compress(MISMATCH.read_bytes()))
    report = run([gz], catalog=catalog)
    assert report.diagnoses[0].signature.id == "nccl-version-differs"


def test_truncated_gzip_is_diagnosed_as_far_as_read_and_says_so(catalog, tmp_path):
    data = gzip.compress(MISMATCH.read_bytes() * 50)
    cut = tmp_path / "cut.log.gz"
    cut.write_bytes(data[: len(data) // 2])
    report = run([cut], catalog=catalog)
    assert report.evidence.problems, "a truncated gzip must be reported"
    problem = report.evidence.problems[0]
    assert str(cut) in problem and "truncated gzip" in problem
    assert report.diagnoses[0].signature.id == "nccl-version-differs"  # banners come first
    assert "warning: " + problem in report.text()


def test_corrupt_gzip_names_the_file_and_the_cause(catalog, tmp_path):
    data = bytearray(gzip.compress(MISMATCH.read_bytes()))
    data[30:60] = b"\xff" * 30
    bad = tmp_path / "bad.gz"
    bad.write_bytes(bytes(data))
    report = run([bad], catalog=catalog)
    assert any(str(bad) in p and "gzip" in p for p in report.evidence.problems)


def test_binary_garbage_and_long_lines_are_bounded(catalog, tmp_path):
    f = tmp_path / "odd.log"
    with open(f, "wb") as fh:
        fh.write(b"\x00\xff\xfe garbage \x80\n")
        fh.write(b"x" * (3 * MAX_LINE) + b" NCCL WARN Message truncated : received 1 bytes\n")
        fh.write(b"n1:1:1 [0] NCCL INFO NET/IB : No device found.\n")
        fh.write(b"y" * (MAX_LINE + 10))  # the last line, no newline, too long
    reader = LogReader(f)
    lines = list(reader)
    assert len(lines) == 4
    assert all(len(raw) <= MAX_LINE for _, raw in lines)
    assert reader.truncated_lines == 2
    report = run([f], catalog=catalog)
    assert [d.signature.id for d in report.diagnoses] == ["ib-no-device"]
    assert any("longer than 64 KiB" in p for p in report.evidence.problems)


def test_deadline_stops_reading_and_says_so(catalog, tmp_path):
    big = tmp_path / "big.log"
    big.write_bytes(MISMATCH.read_bytes() * 2000)
    report = run([big], catalog=catalog, deadline=0.0)
    assert any("time limit reached" in p for p in report.evidence.problems)


# ------------------------------------------------------------------ the catalog
def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "sigs.toml"
    p.write_text(text)
    return p


GOOD = """
[[signature]]
id = "site-fabric-flap"
title = "Fabric manager restarted"
patterns = ['fabricmanager: restarting']
meaning = "m"
cause = "c"
fix = "f"
rules = ["transport"]
"""


def test_admin_catalog_adds_overrides_and_disables(tmp_path):
    extra = _write(
        tmp_path,
        GOOD
        + """
[[signature]]
id = "python-nccl-error"
disabled = true
""",
    )
    cat = load_catalog([extra])
    ids = {s.id for s in cat}
    assert "site-fabric-flap" in ids and "python-nccl-error" not in ids
    log = tmp_path / "j.log"
    log.write_text("fabricmanager: restarting\nRuntimeError: NCCL error in: x, internal error\n")
    report = run([log], catalog=cat)
    assert [d.signature.id for d in report.diagnoses] == ["site-fabric-flap"]


@pytest.mark.parametrize(
    ("text", "cause"),
    [
        ("[[signature]]\nid = 'Bad Id'\n", "expected lower-case words"),
        (GOOD.replace("patterns = ['fabricmanager: restarting']", "patterns = ['(']"),
         "invalid regex"),
        (GOOD.replace("patterns = ['fabricmanager: restarting']", "patterns = ['x?']"),
         "matches an empty line"),
        (GOOD.replace("patterns = ['fabricmanager: restarting']", "patterns = []"),
         "patterns is required"),
        (GOOD.replace('fix = "f"', ""), "fix is required"),
        (GOOD.replace('rules = ["transport"]', 'rules = ["bogus"]'), "unknown rule 'bogus'"),
        (GOOD + "weight = 500\n", "expected an integer from 1 to 100"),
        (GOOD + "colour = 'red'\n", "unknown key"),
        (GOOD.replace("title", "kind = 'differs'\ntitle"), "needs at least one pattern with a"),
        (GOOD.replace("patterns = ['fabricmanager: restarting']",
                      "patterns = [{regex = 'a(?P<x>b)', value = '{y}'}]"),
         "not named groups of the regex"),
        (GOOD.replace("patterns = ['fabricmanager: restarting']",
                      "patterns = [{regex = 'abcd', level = 'ERROR'}]"),
         "level = 'ERROR': expected one of INFO, WARN, TRACE"),
        (GOOD.replace("patterns = ['fabricmanager: restarting']",
                      "level = 'INFO'\npatterns = [{regex = 'abcd', level = 'WARN'}]"),
         "but the signature's level is 'INFO'"),
        (GOOD + GOOD, "duplicate id"),
        ("signature = 3\n", "must be an array of tables"),
        ("[[signature]\n", "not valid TOML"),
    ],
)  # fmt: skip
def test_malformed_catalog_entry_names_file_entry_and_cause(tmp_path, text, cause):
    p = _write(tmp_path, text)
    with pytest.raises(CatalogError) as e:
        load_catalog([p])
    assert str(p) in str(e.value)
    assert cause in str(e.value)


@pytest.mark.parametrize("template", ["{v:d}", "{v!z}", "{v:{v}}", "{v!r}", "{v:>9}"])
def test_a_value_template_is_bare_names_only(tmp_path, template):
    """A conversion or format spec in a value was accepted, then applied to each match:
    '{v:d}' and '{v!z}' raised ValueError from run() (diagnose stopped with a traceback,
    the Epilog lost the diagnosis) and '{v:{v}}' padded to a width the log chose
    ('cudaDriverVersion 999999999': a 1 GB string per line)."""
    p = _write(tmp_path, GOOD.replace(
        "patterns = ['fabricmanager: restarting']",
        f"kind = 'differs'\npatterns = [{{regex = 'driver (?P<v>\\d+)', value = '{template}'}}]"))
    with pytest.raises(CatalogError, match=r"a bare \{name\}") as e:
        load_catalog([p])
    assert str(p) in str(e.value) and template in str(e.value)


def test_missing_catalog_file(tmp_path):
    with pytest.raises(CatalogError, match=r"none\.toml: signature catalog not found"):
        load_catalog([tmp_path / "none.toml"])


def test_needles_are_required_literals():
    assert needles_of(r"^NET/IB : No device found\.") == (b"NET/IB : No device found.",)
    assert needles_of(r"(?:RuntimeError|DistBackendError): .*NCCL") == (
        b"RuntimeError", b"DistBackendError",
    )  # fmt: skip
    assert needles_of(r"(?i)mismatch") is None
    assert needles_of(r"\d+") is None


def test_builtin_catalog_is_package_data():
    from importlib import resources

    text = resources.files("ncclguard.diagnose").joinpath("signatures.toml").read_text()
    assert "socketFinalizeAccept" in text


# ------------------------------------------------------------------ the inventory
def _inventory(tmp_path: Path, fps_then: dict, fps_now: dict | None = None) -> Path:
    db = tmp_path / "inv.db"
    inv = Inventory(db, values=GATE_VALUES)
    for fp in fps_then.values():
        inv.upsert(fp, now=1000.0)
    for fp in (fps_now or {}).values():
        inv.upsert(fp, now=5000.0)
    return db


def _fps(versions: dict[str, str]) -> dict:
    return {h: fingerprint(host=h, nccl=v) for h, v in versions.items()}


def test_inventory_as_of_job_start_confirms_the_log(catalog, tmp_path):
    hosts = {f"n{i}": "2.21.5" for i in range(1, 17)}
    then = _fps({**hosts, "n3": "2.18.3"})
    now = _fps(hosts)  # n3 was fixed after the job: the history must be used
    db = _inventory(tmp_path, then, now)
    report = run(
        [MISMATCH], catalog=catalog, nodes=list(hosts), when=2000.0,
        open_inventory=lambda: Inventory(db, readonly=True), policy_config=_policy(),
    )  # fmt: skip
    first = report.diagnoses[0]
    assert first.signature.id == "nccl-version-differs"
    assert first.confirmed is True and "nccl-version" in (first.inventory or "")
    assert report.view is not None and report.view.verdict.decision == "refuse"
    assert report.view.verdict.odd_nodes == ["n3"]
    assert report.disagreements == []
    text = report.text()
    assert "confirmed by the inventory" in text and "policy decision refuse" in text

    later = run(
        [MISMATCH], catalog=catalog, nodes=list(hosts), when=6000.0,
        open_inventory=lambda: Inventory(db, readonly=True), policy_config=_policy(),
    )  # fmt: skip
    assert later.diagnoses[0].confirmed is False
    assert any("n3: the job loaded NCCL 2.18.3" in d and "brought its own NCCL" in d
               for d in later.disagreements)  # fmt: skip


def test_log_and_inventory_disagree_container_nccl(catalog, tmp_path):
    hosts = {f"n{i}": "2.21.5" for i in range(1, 17)}
    db = _inventory(tmp_path, _fps(hosts))
    report = run(
        [MISMATCH], catalog=catalog, when=2000.0,
        open_inventory=lambda: Inventory(db, readonly=True), policy_config=_policy(),
    )  # fmt: skip
    assert report.view is not None and set(report.view.nodes) == set(hosts)  # the log's hosts
    assert report.diagnoses[0].confirmed is False
    assert "the log and the inventory disagree" in report.text()
    assert any(d.startswith("n3: the job loaded NCCL 2.18.3") for d in report.disagreements)


def test_unavailable_inventory_is_a_note_not_a_failure(catalog, tmp_path):
    report = run(
        [MISMATCH], catalog=catalog, when=1.0,
        open_inventory=lambda: Inventory(tmp_path / "missing.db", readonly=True),
        policy_config=_policy(),
    )  # fmt: skip
    assert report.diagnoses[0].signature.id == "nccl-version-differs"
    assert report.inventory_note and "inventory unavailable" in report.inventory_note
    assert "missing.db" in report.inventory_note


def _policy():
    from ncclguard.config import PolicyConfig

    return PolicyConfig()


# ------------------------------------------------------------------ the CLI
def test_cli_json_and_exit_codes(tmp_path):
    r = run_cli("diagnose", str(MISMATCH), "--json", "--no-inventory")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["result"] == "found" and d["diagnoses"][0]["odd_nodes"] == "n3"
    assert d["diagnoses"][0]["confirm_command"] == "ncclguard diff n3 n1"
    r = run_cli("diagnose", str(CORPUS / "clean-4-hosts.log"), "--no-inventory")
    assert r.exit_code == 0 and "no communication-stack signature found" in r.output
    r = run_cli("diagnose", str(tmp_path / "x.log"))
    assert r.exit_code == 3 and "x.log: log file not found" in r.output
    r = run_cli("diagnose", "--no-inventory")
    assert r.exit_code == 3 and "no log files" in r.output


def test_cli_bad_admin_catalog_from_config(tmp_path):
    bad = _write(tmp_path, "[[signature]]\nid = 'x'\n")
    conf = tmp_path / "c.toml"
    conf.write_text(f'[diagnose]\nsignature_files = ["{bad}"]\n')
    r = run_cli("diagnose", str(MISMATCH), "--config", str(conf))
    assert r.exit_code == 3 and str(bad) in r.output and "title is required" in r.output


def test_cli_with_inventory(tmp_path):
    db = _inventory(tmp_path, _fps({"n1": "2.21.5", "n2": "2.21.5", "n3": "2.18.3"}))
    r = run_cli("diagnose", str(MISMATCH), "--db", str(db), "--nodes", "n[1-3]",
                "--at", "1970-01-01T00:33:20Z", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["inventory"]["as_of"] == "1970-01-01T00:33:20Z"
    assert d["inventory"]["verdict"]["decision"] == "refuse"
    assert any("not one of the job's nodes" in x for x in d["disagreements"])


# ------------------------------------------------------------------ the Epilog hook
def test_epilog_records_the_diagnosis_in_the_audit_trail(tmp_path):
    from ncclguard import audit
    from prolog import epilog

    audit_path = tmp_path / "state" / "decisions.jsonl"
    conf = tmp_path / "c.toml"
    conf.write_text(f'[gate]\naudit_log = "{audit_path}"\n[inventory]\ndb = "{tmp_path}/no.db"\n')
    out = tmp_path / "slurm-77.out"
    shutil.copy(MISMATCH, out)
    env = {
        "SLURM_JOB_ID": "77", "SLURM_JOB_EXIT_CODE": "256", "SLURM_JOB_NODELIST": "n[1-16]",
        "SLURM_JOB_STDOUT": str(out), "SLURM_JOB_STDERR": str(out),
        "SLURM_JOB_START_TIME": "2000", "SLURM_JOB_UID": str(os.getuid()),
    }  # fmt: skip
    assert epilog.main(["--config", str(conf)], env=env) == 0
    recs = audit.read(audit_path, job=77)
    assert len(recs) == 1
    rec = recs[0]
    assert rec["action"] == "diagnose"
    assert rec["diagnoses"][0]["id"] == "nccl-version-differs"
    assert rec["odd_nodes"] == "n3"
    assert rec["summary"].startswith("ncclguard diagnose: nccl-version-differs")

    # a successful job is left alone; a broken config never fails the hook
    ok = {**env, "SLURM_JOB_ID": "78", "SLURM_JOB_EXIT_CODE": "0"}
    assert epilog.main(["--config", str(conf)], env=ok) == 0
    assert audit.read(audit_path, job=78) == []
    assert epilog.main(["--config", str(tmp_path / "missing.toml")], env=env) == 0


def test_epilog_reads_only_the_job_users_own_files(tmp_path):
    """The Epilog runs as SlurmUser on paths the user chose: never through a symlink, never
    a file of another user (here: a 'secret' of uid 65534 and a link to it)."""
    from ncclguard import audit
    from prolog import epilog

    audit_path = tmp_path / "state" / "decisions.jsonl"
    conf = tmp_path / "c.toml"
    conf.write_text(f'[gate]\naudit_log = "{audit_path}"\n[inventory]\ndb = "{tmp_path}/no.db"\n')
    secret = tmp_path / "secret.out"
    shutil.copy(MISMATCH, secret)
    os.chown(secret, 65534, 65534)
    link = tmp_path / "slurm-79.out"
    link.symlink_to(secret)
    base = {"SLURM_JOB_EXIT_CODE": "256", "SLURM_JOB_NODELIST": "n[1-16]",
            "SLURM_JOB_START_TIME": "2000", "SLURM_JOB_UID": str(os.getuid())}
    for job, path, why in ((79, link, "a symbolic link"), (80, secret, "owned by uid 65534")):
        env = {**base, "SLURM_JOB_ID": str(job), "SLURM_JOB_STDOUT": str(path)}
        assert epilog.main(["--config", str(conf)], env=env) == 0
        (rec,) = audit.read(audit_path, job=job)
        assert why in rec["error"] and "diagnoses" not in rec, rec
    # one refused file does not cost the other's diagnosis
    good = tmp_path / "slurm-82.out"
    shutil.copy(MISMATCH, good)
    env = {**base, "SLURM_JOB_ID": "82", "SLURM_JOB_STDOUT": str(good),
           "SLURM_JOB_STDERR": str(link)}
    assert epilog.main(["--config", str(conf)], env=env) == 0
    (rec,) = audit.read(audit_path, job=82)
    assert rec["diagnoses"][0]["id"] == "nccl-version-differs"
    assert any(str(link) in p and "a symbolic link" in p for p in rec["problems"]), rec
    # no uid at all: nothing is trusted
    env = {**base, "SLURM_JOB_ID": "81", "SLURM_JOB_STDOUT": str(secret)}
    del env["SLURM_JOB_UID"]
    assert epilog.main(["--config", str(conf)], env=env) == 0
    assert "not by the job's user (uid -1)" in audit.read(audit_path, job=81)[0]["error"]


def test_epilog_failed_detection():
    from prolog.epilog import failed

    assert failed({"SLURM_JOB_EXIT_CODE": "0", "SLURM_JOB_DERIVED_EC": "0"}) is False
    assert failed({"SLURM_JOB_EXIT_CODE": "256"}) is True
    assert failed({"SLURM_JOB_EXIT_CODE2": "0:9"}) is True
    assert failed({}) is None
