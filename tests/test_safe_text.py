"""Safe text (issue 25): no string from a node, a record, an image or a job reaches a
terminal or a log raw. Terminal sequences (ESC, OSC), newlines, bidirectional overrides
and the like from a stored fingerprint are shown escaped in every CLI table; JSON stays
JSON (the raw value round-trips); the gate's own log line cannot be forged, nor the
collector's.

Before: a plugin name holding ``\\nncclguard-prolog[job 1]: accept n[1-6]: all nodes
agree`` produced that line in the controller's log, and ``nodes``, ``show``, ``classes``,
``diff``, ``check`` and ``decisions`` wrote ESC/OSC sequences to the terminal."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.cli import run_cli
from helpers.fingerprints import fingerprint
from helpers.gate import run_gate
from hypothesis import given
from hypothesis import strategies as st

from inventoryd.loop import SafeFormatter
from ncclguard import audit
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory
from ncclguard.text import safe

FORGED = "ncclguard-prolog[job 1]: accept n[1-6]: all nodes agree"
#: what a hostile value holds: a newline and a forged line, an OSC title, a colour, a
#: bell, a right-to-left override and a line separator
HOSTILE = f"IBext_v8\n{FORGED}\x1b]0;owned\x07\x1b[31mred\u202eevil\u2028x"
#: no raw control or layout character in shown text (newlines between lines aside)
_RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2028\u2029\u2066-\u2069]")


def test_safe_escapes_what_a_terminal_or_a_log_would_act_on() -> None:
    assert safe("2.21.5 /usr/lib/libnccl.so.2 é ü 日本") == "2.21.5 /usr/lib/libnccl.so.2 é ü 日本"
    assert safe("a\nb\r\tc") == "a\\nb\\r\\tc"
    assert safe("\x1b]0;t\x07\x1b[31m") == "\\x1b]0;t\\x07\\x1b[31m"
    assert safe("\u202eabc\u2028\u200b\ufeff") == "\\u202eabc\\u2028\\u200b\\ufeff"
    assert safe("\x9b\x7f") == "\\x9b\\x7f"  # C1's CSI, DEL
    assert safe("a\\nb") == "a\\\\nb"  # a backslash written out is told from an escape
    assert safe("x\ud800") == "x\\ud800"  # a lone surrogate
    assert safe("a\nb\x1b[2J", keep_newlines=True) == "a\nb\\x1b[2J"
    assert "\n" not in safe(HOSTILE) and not _RAW.search(safe(HOSTILE))


def _hostile_fp(host: str) -> dict[str, Any]:
    # nccl.conf: raw text, and a setting X = HOSTILE
    fp = fingerprint(host, conf={"X": HOSTILE}, plugin_abi=8)
    fp["nccl_conf"]["settings"][HOSTILE] = "1"  # a key, too
    fp["plugins"][0]["name"] = fp["plugins"][0]["names"]["net"] = HOSTILE
    fp["plugins"][0]["path"] = f"/opt/{HOSTILE}.so"
    fp["libnccl"][0]["path"] = f"/opt/lib\n{FORGED}/libnccl.so.2"
    fp["gpu"]["models"] = [HOSTILE]
    fp["errors"] = [{"probe": "rdma", "field": HOSTILE, "path": HOSTILE, "error": HOSTILE}]
    return fp


@pytest.fixture
def hostile_db(tmp_path: Path) -> Path:
    db = tmp_path / "inventory.db"
    with Inventory(db, values=GATE_VALUES) as inv:
        inv.upsert(fingerprint("n1", plugin_abi=8), now=1000)
        inv.upsert(fingerprint("n1", "2.18.3", plugin_abi=8), now=2000)  # a history row
        inv.upsert(fingerprint("n2", plugin_abi=8), now=1000)
        inv.upsert(_hostile_fp("n2"), now=2000)  # a change to the hostile values
        inv.upsert(fingerprint("n3", plugin_abi=8), now=1000)
        inv.write_container_runs([{"job": "7", "step": "0", "host": "n2", "encoded_at": 2000.0,
                                   "uid": 0, "origin": "10.0.0.2", "file_state": "1:1:1",
                                   "nccl_version": HOSTILE, "record": {
                                       "libnccl": [{"path": HOSTILE, "realpath": None,
                                                    "version": HOSTILE, "sha256": None,
                                                    "default": True}],
                                       "net": {"plugin": None, "name": HOSTILE, "abi": 8,
                                               "reason": None}}}])
    audit.append(tmp_path / "audit.jsonl", {"job": 7, "decision": "refuse", "action": "steer",
                                            "nodes": "n[1-2]", "summary": HOSTILE})
    return db


COMMANDS = [
    ["nodes"], ["nodes", "--csv"], ["classes"], ["show", "n2"], ["diff", "n1", "n2"],
    ["diff", "n[1-3]"], ["history"], ["history", "n2"], ["check", "n[1-3]"],
    ["decisions", "--job", "7"], ["decisions"], ["drain-recommend", "--nodes", "n[1-3]"],
    ["rejections"],
]


@given(st.text(), st.booleans())
def test_the_fast_path_for_plain_text_agrees_with_the_patterns(text: str, block: bool) -> None:
    """Printable ASCII is returned without a regex (the gate's usual line): it must be
    exactly what the patterns would give, for every text."""
    from ncclguard import text as textmod

    pattern = textmod._pattern(block)
    assert safe(text, keep_newlines=block) == pattern.sub(textmod._escape, text)


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a))
def test_every_table_shows_hostile_strings_escaped(hostile_db: Path, args: list[str]) -> None:
    r = run_cli(*args, db=hostile_db, config=_config(hostile_db))
    assert r.exit_code in (0, 1, 2), r.output
    assert not _RAW.search(r.output), repr(r.output[:2000])
    assert not any(line.startswith(FORGED) for line in r.output.splitlines())


@pytest.mark.parametrize("args", [["show", "n2"], ["nodes"], ["check", "n[1-3]"],
                                  ["decisions", "--job", "7"], ["history", "n2"]],
                         ids=lambda a: " ".join(a))
def test_json_stays_json_and_keeps_the_raw_value(hostile_db: Path, args: list[str]) -> None:
    r = run_cli(*args, "--json", db=hostile_db, config=_config(hostile_db))
    assert r.exit_code in (0, 1, 2), r.output
    assert not _RAW.search(r.output.rstrip("\n"))  # json.dumps escapes control characters
    assert any(HOSTILE in v for v in _strings(json.loads(r.output)))


def _strings(x: Any) -> list[str]:
    if isinstance(x, str):
        return [x]
    if isinstance(x, dict):
        return [s for k, v in x.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(x, list):
        return [s for v in x for s in _strings(v)]
    return []


def _config(db: Path) -> Path:
    p = db.with_name("config.toml")
    p.write_text(f'[gate]\naudit_log = "{db.with_name("audit.jsonl")}"\n')
    return p


def test_the_gates_log_line_cannot_be_forged(tmp_path: Path) -> None:
    """A node's plugin name holding a newline and a whole accept line: the gate's own
    line shows it escaped, and no line of stderr (the controller's log) is forged."""
    with Inventory(tmp_path / "inventory.db", values=GATE_VALUES) as inv:
        inv.upsert(_hostile_fp("n1"))
        inv.upsert(fingerprint("n2", plugin_abi=8))
        inv.upsert(fingerprint("n3", plugin_abi=8))
    empty = tmp_path / "bin"
    empty.mkdir()
    r, _ = run_gate(tmp_path, f'slurm_bin_dir = "{empty}"',
                    env={"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-3]"})
    lines = r.stderr.splitlines()
    assert lines and all(line.startswith("ncclguard-prolog[job 1]: ") for line in lines), lines
    assert not [line for line in lines if line.startswith(FORGED)], lines
    assert any("\\nncclguard-prolog[job 1]: accept" in line for line in lines), lines
    assert not _RAW.search(r.stderr.replace("\n", ""))


def test_the_daemons_log_lines_cannot_be_forged() -> None:
    """The collector's and the node daemon's log (inventoryd/loop.py): one line per
    record whatever its arguments hold; a traceback's lines are indented under it."""
    record = logging.LogRecord("ncclguard.collector", logging.ERROR, __file__, 1,
                               "n2: record %s rejected (%s)", (HOSTILE, "x\nINFO forged"),
                               None)
    out = SafeFormatter("%(levelname)s %(message)s").format(record)
    assert "\n" not in out and not _RAW.search(out)
    try:
        raise ValueError(f"bad\nERROR {FORGED}")
    except ValueError:
        record.exc_info = sys.exc_info()
        record.exc_text = None
    lines = SafeFormatter("%(levelname)s %(message)s").format(record).splitlines()
    assert lines[0].startswith("ERROR n2: record ") and "\\n" in lines[0]
    assert all(line.startswith("  | ") for line in lines[1:]) and len(lines) > 2


def test_the_features_hooks_log_lines_cannot_be_forged(tmp_path: Path) -> None:
    """The hook Slurm runs logs to its own file (or syslog), escaped as the daemons' are:
    what Slurm said of a node cannot start a line of its own (before: a plain
    formatter)."""
    from inventoryd.controller import features

    path = tmp_path / "hook.log"
    handlers = list(features.log.handlers)
    features._hook_log(str(path))
    try:
        features.log.error("hook: %s", f"Slurm said n1\nERROR {FORGED}\x1b]0;x\x07")
    finally:
        for h in features.log.handlers[len(handlers):]:
            features.log.removeHandler(h)
            h.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 1 and "ERROR hook: Slurm said n1\\n" in lines[0], lines
    assert not _RAW.search(lines[0])


def test_the_collectors_log_is_escaped_end_to_end(tmp_path: Path) -> None:
    """The collector service's stderr: a spool file name with a newline and an escape
    sequence is logged on one line."""
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o755)
    (spool / f"x\n{FORGED}\x1b[2J.rec").write_bytes(b"x")
    conf = tmp_path / "c.toml"
    conf.write_text(f'[inventory]\ndb = "{tmp_path / "inv.db"}"\n[spool]\ndir = "{spool}"\n'
                    '[collector]\npublisher = "0"\n[collector.addresses]\nn1 = ["10.0.0.1"]\n')
    r = subprocess.run([sys.executable, "-m", "inventoryd.main", "collect", "--once",
                        "--config", str(conf)], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parents[1])
    assert "rejected" in r.stderr, r.stderr
    assert not [ln for ln in r.stderr.splitlines() if ln.startswith(FORGED)]
    assert "\x1b" not in r.stderr
