"""The corpus in tests/diagnose_logs: every log has an expected diagnosis next to it.

``NAME.log`` (or ``.log.gz``) and ``NAME.expect.toml``: ``primary`` (the first
diagnosis' id, or "none"), ``found`` (the exact set of signatures), ``odd_nodes`` (the
primary's, as a hostlist), ``summary_contains`` (texts the primary's summary holds) and,
where given, the primary's ``verdict`` and ``family`` (issue 44: a fault every host shows
alike is no node difference).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from ncclguard.diagnose import NO_SIGNATURE, load_catalog, run

CORPUS = Path(__file__).parent / "diagnose_logs"
LOGS = sorted(p for p in CORPUS.iterdir() if p.name.endswith((".log", ".log.gz")))


def _expect(log: Path) -> dict:
    base = log.name.split(".log")[0]
    return tomllib.loads((CORPUS / f"{base}.expect.toml").read_text())


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def test_every_log_has_an_expectation():
    assert len(LOGS) >= 15
    for log in LOGS:
        assert (CORPUS / f"{log.name.split('.log')[0]}.expect.toml").is_file(), log


@pytest.mark.parametrize("log", LOGS, ids=lambda p: p.name)
def test_corpus_log(log: Path, catalog):
    want = _expect(log)
    report = run([log], catalog=catalog)
    got = [d.signature.id for d in report.diagnoses]
    assert sorted(got) == sorted(want["found"]), report.text()
    if want["primary"] == "none":
        assert got == []
        assert NO_SIGNATURE in report.text()
        assert report.to_dict()["result"] == "none"
        return
    primary = report.diagnoses[0]
    assert primary.signature.id == want["primary"], report.text()
    d = primary.to_dict()
    assert d["odd_nodes"] == want.get("odd_nodes", ""), report.text()
    for text in want.get("summary_contains", []):
        assert text in primary.summary, primary.summary
    for key in ("verdict", "family"):
        if key in want:
            assert d[key] == want[key], report.text()
    # evidence points at real lines of the file
    for e in primary.evidence:
        assert e.file == str(log) and e.line >= 1
    text = report.text()
    assert "1. [most likely cause]" in text
    if primary.verdict == "not-stack":
        assert "verdict: not a node-stack problem" in text
    else:
        assert primary.confirm_command in text


def test_every_builtin_signature_is_exercised(catalog):
    """Each built-in signature is expected here, or found on a real log
    (tests/data/diagnose_real, tests/test_diagnose_real.py)."""
    seen: set[str] = set()
    for log in LOGS:
        seen.update(_expect(log)["found"])
    real = Path(__file__).parent / "data" / "diagnose_real"
    for log in sorted(real.glob("*.log")):
        seen.update(d.signature.id for d in run([log], catalog=catalog).diagnoses)
    assert {s.id for s in catalog} <= seen, {s.id for s in catalog} - seen


def test_captured_lines_are_kept_as_they_came():
    """The captured files are NCCL's own output: the prefix and texts of real libraries."""
    cap = CORPUS / "captured"
    files = sorted(cap.glob("*.log"))
    assert {f.name.split("-")[0] for f in files} >= {"2.18.3", "2.21.5", "2.26.2"}
    text = (cap / "2.18.3-n1-noplugin.log").read_text()
    assert "NET/Plugin : Plugin load (libnccl-net.so) returned 2" in text
    assert "NET/Plugin : No plugin found, using internal implementation" in text
    assert "[2026-" in (cap / "2.26.2-n1-noplugin.log").read_text()  # 2.26's timestamp
