"""The collector: only records signed by the named node's own munged, by the publisher
uid, fresh and well-formed, reach the inventory. Real munged daemons (one per node, each
signing from its own address, one key), real spool files, a real SQLite inventory.

Node addresses come from the static ``[collector.addresses]`` map here; the Slurm path
(NodeAddr on the real dev cluster) is in ``test_gate_e2e.py``.

Over 500 lines: every test here runs the real collector against real munged signers and
a real spool with one set of fixtures (tests/helpers/collector.py); the bounds and the
load tests are in test_collector_bounds.py and test_collector_load.py.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.collector import NODES, as_nobody, config, publish, sign, snapshot
from helpers.fingerprints import fingerprint
from helpers.munge import MungeSet
from helpers.wait import wait_until

from inventoryd.controller.collector import Collector
from inventoryd.controller.verify import wrong_address
from ncclguard import config as configmod
from ncclguard import munge, spool
from ncclguard.fingerprint.canonical import fingerprint_hash
from ncclguard.policy import GATE_VALUES, node_values
from ncclguard.store import Inventory

REPO = Path(__file__).resolve().parents[1]
@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    lg = logging.getLogger("ncclguard.collector")
    lg.addHandler(caplog.handler)
    old, propagate = lg.level, lg.propagate
    lg.setLevel(logging.INFO)
    lg.propagate = False  # caplog's own handler sits on the root logger: count once
    try:
        yield caplog
    finally:
        lg.removeHandler(caplog.handler)
        lg.setLevel(old)
        lg.propagate = propagate


def history_len(db: Path) -> int:
    with Inventory(db, readonly=True) as inv:
        return len(inv.history())


def test_accepts_each_nodes_own_record_with_the_encode_time_as_heartbeat(
        collector_env: Any) -> None:
    ms, d, db = collector_env
    def fp(h: str) -> dict:
        return fingerprint(h, "2.18.3" if h == "n3" else "2.21.5", plugin_abi=8)

    creds = {h: publish(ms, d, h, fp(h)) for h in NODES}
    c = Collector(config(ms, d), db=db)
    try:
        res = c.scan()
        assert res.accepted == dict.fromkeys(NODES, "inserted") and not res.rejected
        again = c.scan()  # each file is read once more after a change: a hash, no write
        assert again.read == len(NODES) and not again.accepted and not again.rejected
        assert c.scan().read == 0  # nothing changed: nothing read again
    finally:
        c.close()
    got = snapshot(db)
    for h, cred in creds.items():
        signed = munge.decode(cred, socket_path=str(ms.extra("probe", "127.42.250.1").socket))
        assert got[h] == (fingerprint_hash(fp(h)), float(signed.encoded_at))
    with Inventory(db, readonly=True, values=GATE_VALUES) as inv:
        values = inv.load_values(["n1", "n3"])
        assert values["n1"][0] == node_values(fp("n1"))  # type: ignore[index]
        assert values["n3"][0] == node_values(fp("n3"))  # type: ignore[index]
        pubs = inv.publishers()
        assert pubs["n1.rec"]["origin"] == ms.addr("n1") and pubs["n1.rec"]["uid"] == os.getuid()
    # a restarted collector decodes nothing that it already accepted
    c = Collector(config(ms, d), db=db)
    try:
        res = c.scan()
        assert res.read == len(NODES) and not res.accepted and not res.rejected
        assert c.scan().read == 0
    finally:
        c.close()


def _reject_case(env: Any, logs: pytest.LogCaptureFixture, write: Any, cause: str,
                 text: str, **spool_kw: Any) -> None:
    """Every node has a good record; ``write`` then puts a bad one in place. The bad
    record is rejected for ``cause``, logged once with ``text``, listed; the inventory
    is unchanged."""
    ms, d, db = env
    for h in NODES:
        publish(ms, d, h)
    c = Collector(config(ms, d, **spool_kw), db=db)
    try:
        c.scan()
        c.scan()
        before, hist = snapshot(db), history_len(db)
        logs.clear()
        file = write(ms, d)
        res = c.scan()
        assert res.rejected == {file: cause} and not res.accepted
        assert snapshot(db) == before and history_len(db) == hist
        lines = [r for r in logs.records if "rejected" in r.getMessage()]
        assert len(lines) == 1 and f"({cause})" in lines[0].getMessage()
        assert text in lines[0].getMessage() and file in lines[0].getMessage()
        # the same bad file: read once more, then not at all; never logged or counted again
        again = c.scan()
        assert again.read == 1 and not again.rejected and not again.accepted
        assert c.scan().read == 0
        touched = stat.S_ISREG(os.lstat(d / file).st_mode)
        if touched:  # touched: read again; judged again only if the verdict was unread
            os.utime(d / file)
            assert c.scan().read == 1 and c.scan().read == 1 and c.scan().read == 0
        assert len([r for r in logs.records if "rejected" in r.getMessage()]) == 1
        assert snapshot(db) == before and history_len(db) == hist
        with Inventory(db, readonly=True) as inv:
            (row,) = [r for r in inv.rejections() if r["file"] == file]
        # the count is of judgments: a verdict on what a stat shows (the size) is made
        # again for a new stat; one on the content, only for new content
        again_judged = touched and cause == "oversized"
        assert row["cause"] == cause and row["resolved_at"] is None
        assert row["count"] == (2 if again_judged else 1)
    finally:
        c.close()


def test_a_forged_record_is_rejected(collector_env: Any, logs: pytest.LogCaptureFixture) -> None:
    """Node n1's publisher writes n2's file: signed from n1's address, not n2's."""
    def forge(ms: MungeSet, d: Path) -> str:
        publish(ms, d, "n2", fingerprint("n2", "2.18.3", plugin_abi=8), signer="n1")
        return "n2.rec"

    _reject_case(collector_env, logs, forge, "wrong-address",
                 "signed from 127.42.0.1, which is not n2's")


def test_one_machine_whose_name_is_loopback_only_is_told_what_to_set(
    collector_env: Any, logs: pytest.LogCaptureFixture
) -> None:
    """The one-machine default: the node's name resolves to a loopback address only (here
    localhost; 127.0.1.1 on Debian), which never counts, and munged signs from it. The
    rejection says so and what to set (docs/install.md)."""
    ms, d, db = collector_env
    publish(ms, d, "n1")
    cfg = config(ms, d)
    cfg = cfg.replace(collector=cfg.collector.replace(addresses={"n1": ("localhost",)}))
    c = Collector(cfg, db=db)
    try:
        assert c.scan().rejected == {"n1.rec": "wrong-address"}
    finally:
        c.close()
    (line,) = [r.getMessage() for r in logs.records if "rejected" in r.getMessage()]
    assert (f"signed from {ms.addr('n1')}, which is not n1's (no address resolved: its "
            "names resolve only to loopback addresses") in line, line
    assert f"name {ms.addr('n1')} for n1 in [collector.addresses]" in line, line
    assert wrong_address("n1", "10.0.0.9", frozenset()) == (
        "signed from 10.0.0.9, which is not n1's (no address resolved)")
    assert wrong_address("n1", "127.0.0.9", frozenset({"10.0.0.1"})) == (
        "signed from 127.0.0.9, which is not n1's (10.0.0.1)")


def test_a_record_in_another_nodes_file_is_rejected(
    collector_env: Any, logs: pytest.LogCaptureFixture
) -> None:
    """n1 signs its own record truthfully but writes it as n2's file."""
    def misplace(ms: MungeSet, d: Path) -> str:
        # signed from n2's address (the file's node) but naming n1 inside
        publish(ms, d, "n1", fingerprint("n1", "2.18.3", plugin_abi=8), signer="n2", file="n2.rec")
        return "n2.rec"

    _reject_case(collector_env, logs, misplace, "name-mismatch", "holds the record of 'n1'")


def test_a_record_from_an_unexpected_uid_is_rejected(
    collector_env: Any, logs: pytest.LogCaptureFixture
) -> None:
    def other_uid(ms: MungeSet, d: Path) -> str:
        data = spool.payload(fingerprint("n3", "2.18.3", plugin_abi=8))
        r = subprocess.run(["munge", "-S", str(ms.node("n3").socket), "-z", "zlib"],
                           input=data, capture_output=True, user=65534, check=True)
        (d / "n3.rec").write_bytes(r.stdout)
        return "n3.rec"

    _reject_case(collector_env, logs, other_uid, "wrong-uid", "signed by uid 65534")


def test_an_expired_record_is_rejected(collector_env: Any, logs: pytest.LogCaptureFixture) -> None:
    def expired(ms: MungeSet, d: Path) -> str:
        cred = sign(ms, "n4", spool.payload(fingerprint("n4", "2.18.3", plugin_abi=8)), ttl=1)
        time.sleep(2.2)
        (d / "n4.rec").write_bytes(cred)
        return "n4.rec"

    _reject_case(collector_env, logs, expired, "expired", "ttl 1 s")


def test_a_replayed_record_is_ignored(collector_env: Any, logs: pytest.LogCaptureFixture) -> None:
    """An older record of the node put back (by anyone who could read the spool)."""
    ms = collector_env[0]
    old = sign(ms, "n2", spool.payload(fingerprint("n2", "2.18.3", plugin_abi=8)))
    time.sleep(1.1)  # encode times are whole seconds
    saved: dict[str, bytes] = {}

    def replay(ms: MungeSet, d: Path) -> str:
        saved["new"] = (d / "n2.rec").read_bytes()
        (d / "n2.rec").write_bytes(old)
        return "n2.rec"

    _reject_case(collector_env, logs, replay, "replayed", "not newer than the record accepted")
    assert [r.levelname for r in logs.records if "rejected" in r.getMessage()] == ["WARNING"]


def test_a_truncated_record_is_rejected(collector_env: Any, logs: pytest.LogCaptureFixture) -> None:
    def truncate(ms: MungeSet, d: Path) -> str:
        cred = sign(ms, "n1", spool.payload(fingerprint("n1", "2.18.3", plugin_abi=8)))
        (d / "n1.rec").write_bytes(cred[: len(cred) // 2])
        return "n1.rec"

    _reject_case(collector_env, logs, truncate, "undecodable", "munge decode")


def test_an_oversized_record_is_rejected_unread(
        collector_env: Any, logs: pytest.LogCaptureFixture) -> None:
    def huge(ms: MungeSet, d: Path) -> str:
        with open(d / "n1.rec", "wb") as f:
            f.truncate(64 << 20)  # sparse: 64 MiB of nothing
        return "n1.rec"

    _reject_case(collector_env, logs, huge, "oversized", "limit 1048576")


def test_a_malformed_payload_is_rejected(
        collector_env: Any, logs: pytest.LogCaptureFixture) -> None:
    def garbage(ms: MungeSet, d: Path) -> str:
        (d / "n3.rec").write_bytes(sign(ms, "n3", b"[" * 100_000))  # deep nesting
        return "n3.rec"

    _reject_case(collector_env, logs, garbage, "malformed", "payload is not JSON")


@pytest.mark.parametrize(
    ("payload", "text"),
    [
        (b'{"ncclguard_record": 2, "host": "n3", "fingerprint": {}}', "record version 2"),
        (b'{"ncclguard_record": 1, "host": "../n3", "fingerprint": {}}', "not a node name"),
        (b'{"ncclguard_record": 1, "host": "n3", "seq": -1, "fingerprint": {}}',
         "record seq -1 is not a count"),
        (b'{"ncclguard_record": 1, "host": "n3", "seq": 1, "fingerprint": {"schema": 1, '
         b'"host": {"hostname": "n3"}, "libnccl": {}}}', "part 'libnccl' is dict"),
        (b'{"ncclguard_record": 1, "host": "n3", "seq": 1, "fingerprint": {"schema": 7}}',
         "fingerprint schema '7'"),
    ],
)
def test_payloads_of_the_wrong_shape_are_rejected(
    collector_env: Any, logs: pytest.LogCaptureFixture, payload: bytes, text: str
) -> None:
    def write(ms: MungeSet, d: Path) -> str:
        (d / "n3.rec").write_bytes(sign(ms, "n3", payload))
        return "n3.rec"

    _reject_case(collector_env, logs, write, "malformed", text)


@pytest.mark.parametrize(
    ("part", "value"),
    [  # the policy's values cannot be computed; a query row cannot be bound
        ("libnccl", [{"path": ["x"], "version": {"a": 1}, "default": "yes"}]),
        ("plugins", [{"kind": "net", "path": "/x.so", "name": ["a"], "abis": {}}]),
    ],
)
def test_a_fingerprint_the_store_cannot_read_is_rejected_alone(
    collector_env: Any, logs: pytest.LogCaptureFixture, part: str, value: Any
) -> None:
    """Right shape at the top, wrong types inside: that record alone is rolled back; a
    good record in the same batch is written."""
    def poisoned(ms: MungeSet, d: Path) -> str:
        fp = fingerprint("n4", "2.18.3", plugin_abi=8)
        fp[part] = value
        publish(ms, d, "n4", fp)
        return "n4.rec"

    ms, d, db = collector_env
    for h in NODES:
        publish(ms, d, h)
    c = Collector(config(ms, d), db=db)
    try:
        c.scan()
        before = snapshot(db)
        poisoned(ms, d)
        publish(ms, d, "n1", fingerprint("n1", "2.23.4", plugin_abi=8))
        res = c.scan()
    finally:
        c.close()
    assert res.rejected == {"n4.rec": "malformed"} and res.accepted == {"n1": "changed"}
    after = snapshot(db)
    assert after["n4"] == before["n4"] and after["n1"] != before["n1"]
    (msg,) = [r.getMessage() for r in logs.records if "rejected" in r.getMessage()]
    assert "n4.rec rejected (malformed)" in msg and "invalid: " in msg


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_entries_that_are_not_files_are_rejected_without_blocking(
    collector_env: Any, logs: pytest.LogCaptureFixture, kind: str
) -> None:
    def make(ms: MungeSet, d: Path) -> str:
        (d / "n2.rec").unlink()
        if kind == "symlink":
            (d / "n2.rec").symlink_to(d / "n1.rec")  # a valid record, of n1
        elif kind == "fifo":
            os.mkfifo(d / "n2.rec")  # no writer: a blocking open would hang here
        else:
            (d / "n2.rec").mkdir()
        return "n2.rec"

    _reject_case(collector_env, logs, make, "not-a-file", "n2.rec")


def test_an_unknown_node_and_a_bad_file_name_are_rejected(
    collector_env: Any, logs: pytest.LogCaptureFixture
) -> None:
    ms, d, db = collector_env
    publish(ms, d, "n9")  # signed by n9's own munged, but n9 is no node of ours
    (d / "..rec").write_bytes(b"x")  # a name no node has (a dot file: skipped)
    (d / "n 1.rec").write_bytes(publish(ms, d, "n1"))
    c = Collector(config(ms, d), db=db)
    try:
        res = c.scan()
    finally:
        c.close()
    # an odd name is shown as its repr in logs and tables
    assert res.rejected == {"n9.rec": "unknown-node", "'n 1.rec'": "name-mismatch"}
    assert set(res.accepted) == {"n1"} and snapshot(db).keys() == {"n1"}


def test_a_later_good_record_resolves_the_rejection(
        collector_env: Any, logs: pytest.LogCaptureFixture) -> None:
    ms, d, db = collector_env
    publish(ms, d, "n2", signer="n1")
    c = Collector(config(ms, d), db=db)
    try:
        assert c.scan().rejected == {"n2.rec": "wrong-address"}
        publish(ms, d, "n2")  # n2's own publisher puts its record back
        assert c.scan().accepted == {"n2": "inserted"}
    finally:
        c.close()
    assert any("n2.rec accepted again" in r.getMessage() for r in logs.records)
    with Inventory(db, readonly=True) as inv:
        assert inv.rejections() == []
        (row,) = inv.rejections(include_resolved=True)
    assert row["cause"] == "wrong-address" and row["resolved_at"] is not None


def test_munged_down_defers_the_records_and_rejects_nothing(
        collector_env: Any, tmp_path: Path) -> None:
    ms, d, db = collector_env
    publish(ms, d, "n1")
    cfg = config(ms, d)
    cfg = cfg.replace(spool=cfg.spool.replace(munge_socket=str(tmp_path / "down.socket")))
    c = Collector(cfg, db=db)
    try:
        res = c.scan()
        assert res.deferred == 1 and not res.rejected and not res.accepted
    finally:
        c.close()
    with Inventory(db, readonly=True) as inv:
        assert inv.rejections(include_resolved=True) == []
    c = Collector(config(ms, d), db=db)  # munged back: the record is read then
    try:
        assert c.scan().accepted == {"n1": "inserted"}
    finally:
        c.close()


def test_an_unsafe_or_missing_spool_is_refused(
        collector_env: Any, logs: pytest.LogCaptureFixture) -> None:
    ms, d, db = collector_env
    publish(ms, d, "n1")
    os.chmod(d, 0o777)
    c = Collector(config(ms, d), db=db)
    try:
        res = c.scan()
        assert res.files == 0 and not res.accepted
        os.chmod(d, 0o755)
        assert c.scan().accepted == {"n1": "inserted"}
    finally:
        c.close()
    msgs = [r.getMessage() for r in logs.records]
    assert any("writable by others" in m for m in msgs)
    assert any("readable again" in m for m in msgs)


def test_two_collectors_end_with_the_same_inventory(collector_env: Any, tmp_path: Path) -> None:
    """Primary and backup controller: each its own munged (same key) and inventory."""
    ms, d, db = collector_env
    backup = ms.extra("backup", "127.42.250.2")
    for h in NODES:
        publish(ms, d, h)
    cfg_b = config(ms, d)
    cfg_b = cfg_b.replace(spool=cfg_b.spool.replace(munge_socket=str(backup.socket)))
    a = Collector(config(ms, d), db=db)
    b = Collector(cfg_b, db=tmp_path / "backup.db")
    try:
        a.scan()
        publish(ms, d, "n2", fingerprint("n2", "2.23.4", plugin_abi=8))
        b.scan()
        a.scan()
    finally:
        a.close()
        b.close()
    left, right = snapshot(db), snapshot(tmp_path / "backup.db")
    assert left == right and len(left) == 4
    assert left["n2"][0] == fingerprint_hash(fingerprint("n2", "2.23.4", plugin_abi=8))


# ---- readers without write access, as the gate (SlurmUser) and an admin read it

@pytest.fixture
def controller_dir() -> Iterator[Path]:
    """The controller's state dir: its writer's, mode 0755 (pytest's are 0700)."""
    d = Path(tempfile.mkdtemp(prefix="ncclguard-ctl-"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d)


def test_readers_without_write_access_read_it_while_it_runs_and_after_it_stops(
    collector_env: Any, controller_dir: Path
) -> None:
    ms, d, _ = collector_env
    db = controller_dir / "inventory.db"
    for h in ("n1", "n2"):
        publish(ms, d, h)
    c = Collector(config(ms, d), db=db)
    try:
        c.scan()
        assert Path(f"{db}-wal").exists()  # WAL while the collector runs
        r = as_nobody(db, "read")
        assert r.returncode == 0 and r.stdout.strip() == "['n1', 'n2']", r.stderr
    finally:
        c.close()  # a clean stop: back to a rollback journal
    assert not Path(f"{db}-wal").exists()
    r = as_nobody(db, "read")
    assert r.returncode == 0 and r.stdout.strip() == "['n1', 'n2']", r.stderr
    w = as_nobody(db, "write")
    assert w.returncode != 0 and "readonly database" in w.stderr, w.stderr
    assert snapshot(db).keys() == {"n1", "n2"}


def test_the_service_writes_its_metrics(collector_env: Any, tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from inventoryd.controller import collector_service as collector
    from inventoryd.sdnotify import Notifier

    ms, d, db = collector_env
    publish(ms, d, "n1")
    publish(ms, d, "n2", signer="n1")
    prom = tmp_path / "prom"
    prom.mkdir()
    cfg = config(ms, d)
    cfg = cfg.replace(collector=cfg.collector.replace(textfile_dir=str(prom)))
    assert collector.run(None, cfg, db=db, notifier=Notifier({}), max_scans=1) == 0
    fams = {f.name: f for f in text_string_to_metric_families(
        (prom / "ncclguard-collector.prom").read_text())}
    assert fams["ncclguard_collector_records_accepted"].samples[0].value == 1
    rejected = {x.labels["cause"]: x.value
                for x in fams["ncclguard_collector_records_rejected"].samples
                if x.name.endswith("_total")}
    # every cause is there from the start (at 0), so that increase() sees its first one
    assert rejected == {**dict.fromkeys(spool.CAUSES, 0), "wrong-address": 1}
    assert fams["ncclguard_collector_spool_records"].samples[0].value == 2
    assert fams["ncclguard_collector_spool_up"].samples[0].value == 1
    # the inventory's freshness: an outage of the record path shows in minutes
    assert fams["ncclguard_inventory_stale_nodes"].samples[0].value == 0
    oldest = fams["ncclguard_inventory_oldest_heartbeat_timestamp_seconds"].samples[0].value
    assert time.time() - 60 < oldest <= time.time()


def test_an_unwritable_textfile_dir_is_logged_once_and_its_recovery_once(
    collector_env: Any, tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    """Every scan writes the textfile: a directory that cannot be written (read-only under
    the unit without its drop-in; here a file in its place) is one error line, not one
    per scan, and one line when it works again."""
    import threading

    from inventoryd.controller import collector_service as collector
    from inventoryd.sdnotify import Notifier

    ms, d, db = collector_env
    publish(ms, d, "n1")
    # a link, mended in one rename: a file unlinked and a directory made in its place let
    # a scan meet the gap (a second cause, logged as such; tests/test_service.py too)
    prom = tmp_path / "prom"
    (tmp_path / "a-file").write_text("not a directory\n")
    prom.symlink_to(tmp_path / "a-file")
    cfg = config(ms, d)
    cfg = cfg.replace(collector=cfg.collector.replace(textfile_dir=str(prom),
                                                      scan_interval_s=0.02))

    def mend() -> None:
        time.sleep(0.5)  # scans that fail
        (tmp_path / "a-dir").mkdir()
        (tmp_path / "prom.new").symlink_to(tmp_path / "a-dir")
        os.replace(tmp_path / "prom.new", prom)

    t = threading.Thread(target=mend)
    t.start()
    try:
        assert collector.run(None, cfg, db=db, notifier=Notifier({}), max_scans=60) == 0
    finally:
        t.join()
    assert (prom / "ncclguard-collector.prom").is_file()
    lines = [r.getMessage() for r in logs.records]
    failed = [x for x in lines if "cannot write metrics" in x]
    assert len(failed) == 1 and f"cannot write metrics to {prom}: " in failed[0], lines
    again = [x for x in lines if "again" in x]
    assert len(again) == 1 and f"metrics written to {prom}/ncclguard-collector.prom again" in (
        again[0]), lines


# ---- found by a hostile review: each failed (crash, hang, forgery, rollback) before


def _raw_payload(host: str, fp: dict, seq: int = 1) -> bytes:
    """A payload as a hostile publisher may write it: json.dumps escapes what it likes."""
    import json

    return json.dumps({"ncclguard_record": 1, "host": host, "seq": seq,
                       "fingerprint": fp}).encode()


@pytest.mark.parametrize(
    ("poison", "text"),
    [("\ud800", "not valid UTF-8"), (2**64, "integer outside 64 bits"),
     (float("nan"), "not finite")],
    ids=["lone-surrogate", "int-2**64", "nan"],
)
def test_a_node_cannot_crash_the_collector_with_its_own_record(
    collector_env: Any, logs: pytest.LogCaptureFixture, poison: Any, text: str
) -> None:
    """Values Python reads but SQLite or UTF-8 cannot hold: that record is rejected, an
    honest change in the same batch is written, and a restart does not trip on it."""
    ms, d, db = collector_env
    for h in NODES:
        publish(ms, d, h)
    c = Collector(config(ms, d), db=db)
    try:
        c.scan()
        fp = fingerprint("n1", "2.18.3", plugin_abi=8)
        fp["libnccl"][0]["version_code"] = poison
        (d / "n1.rec").write_bytes(sign(ms, "n1", _raw_payload("n1", fp)))
        publish(ms, d, "n2", fingerprint("n2", "2.23.4", plugin_abi=8))
        res = c.scan()
    finally:
        c.close()
    assert res.rejected == {"n1.rec": "malformed"} and res.accepted == {"n2": "changed"}
    assert any(text in r.getMessage() for r in logs.records)
    c = Collector(config(ms, d), db=db)
    try:
        assert not c.scan().accepted  # and no exception
    finally:
        c.close()


def test_a_dead_munged_defers_the_scan_once_not_per_record(
        collector_env: Any, tmp_path: Path) -> None:
    """A stale socket (munged killed): libmunge retries for seconds per call; the scan
    stops at the first and leaves every record for the next."""
    ms, d, db = collector_env
    for h in NODES:
        publish(ms, d, h)
    from devtools.devcluster import Munged

    dead = Munged(tmp_path / "m", "dead", ms.key, "127.42.250.3").start()
    dead.proc.kill()  # type: ignore[union-attr]
    dead.proc.wait()  # type: ignore[union-attr]
    assert dead.socket.exists()  # left behind
    cfg = config(ms, d)
    cfg = cfg.replace(spool=cfg.spool.replace(munge_socket=str(dead.socket)))
    c = Collector(cfg, db=db)
    try:
        t0 = time.monotonic()
        res = c.scan()
        assert res.deferred == len(NODES) and not res.accepted and not res.rejected
        assert time.monotonic() - t0 < 8  # one libmunge timeout, not one per record
        assert c.defer_state is not None and "munged" in c.defer_state
        assert c.spool_state == "ok"  # the spool is fine: munged is not
    finally:
        c.close()


def test_two_records_of_one_second_keep_their_order(
        collector_env: Any, logs: pytest.LogCaptureFixture) -> None:
    """Encode times are whole seconds; the signed seq orders records within one."""
    ms, d, db = collector_env
    first = sign(ms, "n2", spool.payload(fingerprint("n2", "2.18.3", plugin_abi=8), seq=100))
    second = sign(ms, "n2", spool.payload(fingerprint("n2", "2.21.5", plugin_abi=8), seq=200))
    assert munge.decode(first, socket_path=str(ms.extra("probe", "127.42.250.1").socket)
                        ).encoded_at == munge.decode(
        second, socket_path=str(ms.extra("probe", "127.42.250.1").socket)).encoded_at
    c = Collector(config(ms, d), db=db)
    try:
        (d / "n2.rec").write_bytes(second)
        assert c.scan().accepted == {"n2": "inserted"}
        (d / "n2.rec").write_bytes(first)  # the older one of the same second, put back
        assert c.scan().rejected == {"n2.rec": "replayed"}
        (d / "n2.rec").write_bytes(second)
        res = c.scan()
        assert not res.accepted and not res.rejected  # the accepted one: nothing to do
    finally:
        c.close()
    assert snapshot(db)["n2"][0] == fingerprint_hash(fingerprint("n2", "2.21.5", plugin_abi=8))
    assert history_len(db) == 1


@pytest.fixture(scope="module")
def clock_shift(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An LD_PRELOAD library, built by gcc here, that moves time(2) by $SHIFT_S: a
    node whose clock is ahead, for its munged alone."""
    d = tmp_path_factory.mktemp("shift")
    (d / "shift.c").write_text(
        "#define _GNU_SOURCE\n#include <time.h>\n#include <stdlib.h>\n"
        "time_t time(time_t *t) {\n  struct timespec ts; clock_gettime(CLOCK_REALTIME, &ts);\n"
        "  const char *o = getenv(\"SHIFT_S\"); time_t v = ts.tv_sec + (o ? atol(o) : 0);\n"
        "  if (t) *t = v; return v;\n}\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(d / "shift.so"),
                    str(d / "shift.c")], check=True, capture_output=True, timeout=60)
    os.chmod(d, 0o755)
    return d / "shift.so"


@pytest.mark.parametrize(("shift", "verdict"), [(3000, "rewound"), (10, "accepted")])
def test_a_node_clock_ahead_is_bounded(
        collector_env: Any, clock_shift: Path, monkeypatch: pytest.MonkeyPatch,
                                        shift: int, verdict: str) -> None:
    """munged accepts a credential from the future up to its time to live (an hour):
    the collector accepts 30 s, and never stores a heartbeat in the future."""
    from devtools.devcluster import Munged

    ms, d, db = collector_env
    monkeypatch.setenv("LD_PRELOAD", str(clock_shift))
    monkeypatch.setenv("SHIFT_S", str(shift))
    fast = Munged(ms.directory, f"fast{shift}", ms.key, ms.addr("n2"), mode=0o755).start()
    monkeypatch.delenv("LD_PRELOAD")
    try:
        cred = munge.encode(spool.payload(fingerprint("n2", plugin_abi=8)),
                            socket_path=str(fast.socket))
    finally:
        fast.stop()
    (d / "n2.rec").write_bytes(cred)
    c = Collector(config(ms, d), db=db)
    try:
        res = c.scan()
    finally:
        c.close()
    if verdict == "rewound":
        assert res.rejected == {"n2.rec": "rewound"} and "n2" not in snapshot(db)
    else:
        assert res.accepted == {"n2": "inserted"}
        assert snapshot(db)["n2"][1] <= time.time()  # clamped: never a future heartbeat


def test_a_future_mtime_is_read_twice_not_for_ever(collector_env: Any) -> None:
    ms, d, db = collector_env
    (d / "n3.rec").write_bytes(b"garbage")
    future = time.time() + 10 * 365 * 86400
    os.utime(d / "n3.rec", (future, future))
    c = Collector(config(ms, d), db=db)
    try:
        reads = [c.scan().read for _ in range(5)]
    finally:
        c.close()
    assert reads == [1, 1, 0, 0, 0]
    with Inventory(db, readonly=True) as inv:
        assert [r["count"] for r in inv.rejections()] == [1]


def test_files_that_go_away_are_forgotten_and_resolved(collector_env: Any) -> None:
    """2,000 junk files, then removed: nothing of them stays in memory, their
    rejections are resolved; a file removed between listing and read is no rejection.
    They name no node: each scan judges at most UNKNOWN_PER_SCAN of them (each twice:
    judged, then confirmed), unread."""
    from inventoryd.controller.collector import UNKNOWN_PER_SCAN

    ms, d, db = collector_env
    for i in range(2000):
        (d / f"junk{i}.rec").write_bytes(b"x")
    c = Collector(config(ms, d), db=db)
    try:
        rejected: dict[str, str] = {}
        for _ in range(2 * (2000 // UNKNOWN_PER_SCAN + 1)):
            res = c.scan()
            assert len(res.rejected) <= UNKNOWN_PER_SCAN
            rejected.update(res.rejected)
        assert len(rejected) == 2000 and set(rejected.values()) == {"unknown-node"}
        assert c.scan().read == 0  # every one judged and confirmed
        for i in range(2000):
            (d / f"junk{i}.rec").unlink()
        c.scan()
        assert not c.seen and not c.judged and not c.logged
        with Inventory(db, readonly=True) as inv:
            assert inv.rejections() == [] and len(inv.rejections(include_resolved=True)) == 2000
        publish(ms, d, "n1")
        st = next(s for n, s in spool.scan(d) if n == "n1.rec")
        (d / "n1.rec").unlink()
        assert c.judge("n1.rec", st) is None
    finally:
        c.close()


def test_file_names_cannot_forge_log_lines(
        collector_env: Any, logs: pytest.LogCaptureFixture) -> None:
    ms, d, db = collector_env
    (d / "x\nERROR n1: record n1.rec rejected (wrong-address) FAKE\n.rec").write_bytes(b"x")
    c = Collector(config(ms, d), db=db)
    try:
        c.scan()
    finally:
        c.close()
    for r in logs.records:
        assert "\n" not in r.getMessage()
    with Inventory(db, readonly=True) as inv:
        (row,) = inv.rejections()
    assert "\n" not in row["file"] and row["file"].startswith("'x\\n")


def test_a_directory_at_a_nodes_name_does_not_block_its_publisher(
    collector_env: Any, logs: pytest.LogCaptureFixture
) -> None:
    from inventoryd.node.publish import Publisher

    ms, d, db = collector_env
    (d / "n2.rec").mkdir()
    (d / "n2.rec" / "filler").write_bytes(b"x")
    cfg = configmod.SpoolConfig(dir=str(d), munge_socket=str(ms.node("n2").socket))
    Publisher(cfg, 300).publish(fingerprint("n2", plugin_abi=8))
    assert (d / "n2.rec").is_file()
    aside = [p.name for p in d.iterdir() if p.name.startswith(".n2.rec.blocked.")]
    assert len(aside) == 1
    c = Collector(config(ms, d), db=db)
    try:
        assert c.scan().accepted == {"n2": "inserted"}
    finally:
        c.close()


def test_close_with_a_reader_holding_the_file_is_quick_and_leaves_it_readable(
    collector_env: Any, controller_dir: Path, logs: pytest.LogCaptureFixture
) -> None:
    ms, d, _ = collector_env
    db = controller_dir / "inventory.db"
    publish(ms, d, "n1")
    c = Collector(config(ms, d), db=db)
    c.scan()
    reader = Inventory(db, readonly=True)
    reader._conn.execute("BEGIN")
    reader._conn.execute("SELECT count(*) FROM nodes").fetchone()  # holds a read lock
    t0 = time.monotonic()
    c.close()
    took = time.monotonic() - t0
    reader.close()
    assert took < 5
    assert any("stays in WAL mode" in r.getMessage() for r in logs.records)
    r = as_nobody(db, "read")
    assert r.returncode == 0 and "n1" in r.stdout, r.stderr


def test_a_failed_reload_keeps_the_running_collector(collector_env: Any, tmp_path: Path) -> None:
    ms, d, db = collector_env
    conf = tmp_path / "collector.toml"
    good = (f'[spool]\ndir = "{d}"\nmunge_socket = "{ms.controller.socket}"\n'
            f'[collector]\npublisher = "{os.getuid()}"\nscan_interval_s = 0.1\n'
            "[collector.addresses]\n" + "".join(f'{h} = ["{ms.addr(h)}"]\n' for h in NODES))
    conf.write_text(good)
    log = tmp_path / "collector.log"
    env_ = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log, "wb") as out:
        p = subprocess.Popen([sys.executable, "-m", "inventoryd.main", "collect", "--config",
                              str(conf), "--db", str(db)], cwd=REPO, env=env_, stderr=out)
    try:
        publish(ms, d, "n1")
        wait_until(lambda: "n1: fingerprint inserted" in log.read_text(), 20,
                   "n1's record in the log", interval=0.05)
        conf.write_text(good.replace(f'publisher = "{os.getuid()}"',
                                     'publisher = "no-such-user-xyz"'))
        p.send_signal(signal.SIGHUP)
        wait_until(lambda: "config not reloaded" in log.read_text(), 20,
                   "the refused reload in the log", interval=0.05)
        publish(ms, d, "n1", fingerprint("n1", "2.18.3", plugin_abi=8))
        wait_until(lambda: "n1: fingerprint changed" in log.read_text(), 20,
                   "n1's change in the log", interval=0.05)
    finally:
        p.terminate()
        p.wait(timeout=30)
    text = log.read_text()
    assert "no such user" in text and "closed database" not in text and p.returncode == 0
