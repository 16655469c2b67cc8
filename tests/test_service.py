"""inventoryd's service loop: the notify protocol on a real AF_UNIX datagram socket,
signals to a real child process publishing through a real munged, an unreachable spool,
the textfile metrics."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.fingerprints import fingerprint
from helpers.munge import MungeSet
from helpers.notify import Listener
from helpers.wait import wait_until
from prometheus_client.parser import text_string_to_metric_families

from inventoryd.node import daemon as service
from inventoryd.node.publish import Publisher, PublishError
from inventoryd.node.textfile import write_textfile
from inventoryd.sdnotify import Notifier
from ncclguard import config as configmod
from ncclguard import munge, spool

REPO = Path(__file__).resolve().parents[1]

# The daemon's loop, run in a real child process; the fingerprint comes from a file the
# test edits, in place of the probes (which have their own tests).
_DRIVER = r"""
import json, sys
from inventoryd.node import daemon as service
from ncclguard import config
path = sys.argv[1]
cfg = config.load(sys.argv[2])
def collect(root, hostname, conf):
    with open(path) as f:
        return json.load(f)
sys.exit(service.run("/", None, sys.argv[2], cfg, collector=collect))
"""


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[Listener]:
    lst = Listener(str(tmp_path / "notify.sock"))
    yield lst
    lst.close()


@pytest.fixture
def notify_sock(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    addr = str(tmp_path / "notify.sock")
    s.bind(addr)
    s.settimeout(10)
    yield s, addr
    s.close()


def _record(d: Path, host: str, mungeds: MungeSet) -> dict | None:
    """The fingerprint in ``host``'s published record, checked as the collector does
    (decoded on the controller's munged, signed from the node's address), or None."""
    try:
        data = spool.read(d / f"{host}.rec", max_bytes=1 << 20)
    except spool.RecordError:
        return None
    cred = munge.decode(data, socket_path=str(mungeds.controller.socket))
    assert cred.origin == mungeds.addr(host) and cred.uid == os.getuid()
    return spool.parse_payload(cred.payload, max_bytes=1 << 23).fingerprint


def _config(path: Path, d: Path, sock: Path, textfile: Path | None, interval: float = 0.2
            ) -> Path:
    lines = [
        "[spool]", f'dir = "{d}"', f'munge_socket = "{sock}"',
        "[inventoryd]", f"interval_s = {interval}", "jitter = 0.1", "heartbeat_s = 0.5",
    ]
    if textfile is not None:
        lines.append(f'textfile_dir = "{textfile}"')
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- the notify protocol


def test_notifier_sends_datagrams_to_a_path_socket(notify_sock: tuple[socket.socket, str]) -> None:
    s, addr = notify_sock
    n = Notifier({"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "3000000"})
    assert n.ready("collecting")
    msg = s.recv(4096).decode().split("\n")
    assert msg[0] == "READY=1" and f"MAINPID={os.getpid()}" in msg and "STATUS=collecting" in msg
    assert n.watchdog() and s.recv(4096) == b"WATCHDOG=1"
    assert n.ping_interval() == 1.5
    assert n.stopping() and s.recv(4096) == b"STOPPING=1"


def test_notifier_abstract_namespace() -> None:
    name = f"ncclguard-test-{os.getpid()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(5)
    try:
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).ready()
        assert s.recv(4096).startswith(b"READY=1\n")
    finally:
        s.close()


def test_notifier_outside_systemd_and_foreign_watchdog(tmp_path: Path) -> None:
    assert not Notifier({}).enabled and Notifier({}).ready() is False
    n = Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"})
    assert n.ping_interval() is None  # the watchdog is another process's
    gone = Notifier({"NOTIFY_SOCKET": str(tmp_path / "missing.sock")})
    assert gone.ready() is False and "missing.sock" in (gone.last_error or "")


# ---- the daemon as a real child process


def _start(fp_file: Path, cfg: Path, sock: str, watchdog_usec: int = 200_000) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NCCLGUARD_DB", "NCCLGUARD_CONFIG", "NCCLGUARD_SPOOL")}
    env.update(NOTIFY_SOCKET=sock, WATCHDOG_USEC=str(watchdog_usec), PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", _DRIVER, str(fp_file), str(cfg)], cwd=REPO,
                            env=env, stderr=subprocess.PIPE, text=True)


def test_daemon_ready_watchdog_change_reload_and_sigterm(
    tmp_path: Path, listener: Listener, mungeds: MungeSet
) -> None:
    addr = listener.addr
    d = tmp_path / "spool"
    prom1, prom2 = tmp_path / "prom1", tmp_path / "prom2"
    prom1.mkdir()
    prom2.mkdir()
    fp_file = tmp_path / "fp.json"
    fp_file.write_text(json.dumps(fingerprint("n7", "2.21.5", plugin_abi=8)))
    sock = mungeds.node("n7").socket
    cfg = _config(tmp_path / "config.toml", d, sock, prom1)
    child = _start(fp_file, cfg, addr)
    rec = d / "n7.rec"
    try:
        listener.wait_for("READY=1")
        listener.wait_for("WATCHDOG=1")
        wait_until(lambda: _record(d, "n7", mungeds) is not None
                   and (prom1 / "ncclguard.prom").exists(), 10,
                   "n7's first record and its metrics file", interval=0.05)
        # a change on the node is published at the next cycle
        fp_file.write_text(json.dumps(fingerprint("n7", "2.23.4", plugin_abi=8)))
        wait_until(lambda: (_record(d, "n7", mungeds) or {}).get("libnccl", [{}])[0].get(
                   "version") == "2.23.4", 10, "n7's record of NCCL 2.23.4", interval=0.05)
        # the same fingerprint is signed again every heartbeat_s (0.5 s): a new credential
        before = rec.read_bytes()
        wait_until(lambda: rec.read_bytes() != before, 5, "n7's record signed again",
                   interval=0.05)
        assert _record(d, "n7", mungeds)["libnccl"][0]["version"] == "2.23.4"  # type: ignore[index]
        # SIGHUP reloads the config: the metrics move to the new directory
        _config(cfg, d, sock, prom2)
        child.send_signal(signal.SIGHUP)
        listener.wait_for("RELOADING=1")
        wait_until((prom2 / "ncclguard.prom").exists, 10,
                   "the metrics file in the reloaded config's directory", interval=0.05)
        text = (prom2 / "ncclguard.prom").read_text()
        assert 'version="2.23.4"' in text and "ncclguard_publish_up 1.0" in text
        # SIGTERM: a clean stop, between cycles
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=10) == 0
        listener.wait_for("STOPPING=1")
    finally:
        if child.poll() is None:
            child.kill()
        _, err = child.communicate(timeout=10)
    assert err.count(f"n7: fingerprint published to {rec}") == 2, err
    assert "config reloaded from" in err and "n7: stopped" in err
    assert not list(tmp_path.glob("prom*/*.tmp*"))  # only the renamed file remains
    assert sorted(p.name for p in d.iterdir()) == ["n7.rec"]  # no temporary file left


def _through_a_fault(fp_file: Path, cfg: Path, listener: Listener, *,
                     mend: Callable[[], object], mended: Callable[[], bool]) -> list[str]:
    """Run the daemon for about 20 cycles (0.05 s each) against a fault, mend it, wait
    until ``mended()`` and a few cycles more, stop it with SIGTERM: its log lines."""
    child = _start(fp_file, cfg, listener.addr)
    try:
        listener.wait_for("READY=1")
        time.sleep(1.0)  # about 20 cycles against the fault
        assert child.poll() is None  # still running
        mend()
        wait_until(mended, 10, "the daemon past the mended fault", interval=0.05)
        time.sleep(0.3)  # a few more cycles that work
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=10) == 0
    finally:
        if child.poll() is None:
            child.kill()
        _, err = child.communicate(timeout=10)
    return err.splitlines()


def test_unreachable_spool_logs_once_and_publishes_when_it_can(
    tmp_path: Path, listener: Listener, mungeds: MungeSet
) -> None:
    mount = tmp_path / "mnt"  # not there yet: a missing mount
    d = mount / "ncclguard" / "spool"
    fp_file = tmp_path / "fp.json"
    fp_file.write_text(json.dumps(fingerprint("n8", plugin_abi=8)))
    cfg = _config(tmp_path / "config.toml", d, mungeds.node("n8").socket, None, interval=0.05)
    lines = _through_a_fault(
        fp_file, cfg, listener,
        mend=lambda: (mount / "ncclguard").mkdir(parents=True),  # the mount appears
        mended=lambda: _record(d, "n8", mungeds) is not None)
    failed = [x for x in lines if "record not published" in x]
    assert len(failed) == 1, lines
    assert f"spool {d}" in failed[0] and "missing mount" in failed[0]
    assert failed[0].startswith("ERROR n8:")
    assert sum("works again" in x for x in lines) == 1


def test_unwritable_textfile_dir_logs_once_and_its_recovery_once(
    tmp_path: Path, listener: Listener, mungeds: MungeSet
) -> None:
    """A textfile directory that cannot be written (read-only under the unit's
    ProtectSystem=strict without its drop-in; here a file where the directory should be)
    is one error line however many cycles fail, one line when it works again, and never
    a "collection works again" (collection never failed)."""
    d = tmp_path / "spool"
    d.mkdir()
    # the configured path is a link, so that the fault is mended in one step: unlinking a
    # file and making a directory in its place let a cycle meet the gap between them (a
    # second cause, "No such file or directory", logged as such: CI's forky run, 2026-12-02)
    prom = tmp_path / "prom"
    (tmp_path / "a-file").write_text("not a directory\n")
    prom.symlink_to(tmp_path / "a-file")
    fp_file = tmp_path / "fp.json"
    fp_file.write_text(json.dumps(fingerprint("n9", plugin_abi=8)))
    cfg = _config(tmp_path / "config.toml", d, mungeds.node("n9").socket, prom, interval=0.05)

    def mend() -> None:
        (tmp_path / "a-dir").mkdir()
        (tmp_path / "prom.new").symlink_to(tmp_path / "a-dir")
        os.replace(tmp_path / "prom.new", prom)  # one rename: the fault is gone at once

    lines = _through_a_fault(fp_file, cfg, listener, mend=mend,
                             mended=lambda: (prom / "ncclguard.prom").exists())
    failed = [x for x in lines if "cannot write metrics" in x]
    assert len(failed) == 1, lines
    assert failed[0].startswith(f"ERROR n9: cannot write metrics to {prom}: "), failed
    again = [x for x in lines if "again" in x]
    assert again == [x for x in lines if f"n9: metrics written to {prom}/ncclguard.prom again"
                     in x], lines
    assert len(again) == 1, lines


def test_publisher_republishes_a_replaced_or_deleted_record(
    tmp_path: Path, mungeds: MungeSet
) -> None:
    sock = str(mungeds.node("n3").socket)
    cfg = configmod.SpoolConfig(dir=str(tmp_path / "s"), munge_socket=sock)
    pub = Publisher(cfg, heartbeat_s=300)
    fp = fingerprint("n3", plugin_abi=8)
    assert pub.due(fp, 1000.0)
    path = pub.publish(fp, 1000.0)
    assert not pub.due(fp, 1001.0)  # the same fingerprint, heartbeat not due
    assert pub.due(fingerprint("n3", "2.18.3", plugin_abi=8), 1001.0)  # changed
    assert pub.due(fp, 1300.0)  # heartbeat due
    assert pub.due(fp, 999.0)  # the clock went back
    flaky = fingerprint("n3", plugin_abi=8)
    flaky["errors"] = [{"probe": "rdma", "field": "x", "path": "/x", "error": "EIO"}]
    assert pub.due(flaky, 1001.0)  # new errors: published (shown), though not a change
    path.write_bytes(b"MUNGE:someone else's:\n")  # replaced (e.g. another node's forgery)
    assert pub.due(fp, 1001.0)
    pub.publish(fp, 1001.0)
    path.unlink()
    assert pub.due(fp, 1002.0)
    assert (tmp_path / "s").stat().st_mode & 0o777 == 0o755  # created, not writable by others


def test_publisher_names_a_munged_that_is_down_and_an_unsafe_spool(tmp_path: Path) -> None:
    cfg = configmod.SpoolConfig(dir=str(tmp_path), munge_socket=str(tmp_path / "gone.socket"))
    with pytest.raises(PublishError) as e:
        Publisher(cfg, 300).publish(fingerprint("n1", plugin_abi=8))
    assert e.value.kind == "munge" and "gone.socket" in str(e.value)
    os.chmod(tmp_path, 0o777)
    with pytest.raises(PublishError) as e:
        Publisher(cfg, 300).publish(fingerprint("n1", plugin_abi=8))
    assert e.value.kind == "spool" and "writable by others" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_store_once(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                    monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "inv" / "inventory.db"
    monkeypatch.setenv("NCCLGUARD_DB", str(db))
    cfg = configmod.Config()
    assert service.store_once(fingerprint("n1", plugin_abi=8), cfg) == 0
    assert "n1: inserted in" in capsys.readouterr().err
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"garbage" * 1000)
    os.chmod(bad, 0o644)
    monkeypatch.setenv("NCCLGUARD_DB", str(bad))
    assert service.store_once(fingerprint("n1", plugin_abi=8), cfg) == 1
    assert f"corrupt inventory at {bad}" in capsys.readouterr().err


def test_run_in_process_survives_a_failing_collector(tmp_path: Path, mungeds: MungeSet,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def collect(root: str, hostname: str | None, conf: configmod.InventorydConfig) -> dict:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("probe exploded")
        return fingerprint("n9", plugin_abi=8)

    monkeypatch.delenv("NCCLGUARD_SPOOL", raising=False)
    cfg = configmod.from_dict({
        "spool": {"dir": str(tmp_path / "s"), "munge_socket": str(mungeds.node("n9").socket)},
        "inventoryd": {"interval_s": 0.01},
    })
    assert service.run("/", None, None, cfg, collector=collect, notifier=Notifier({}),
                       max_cycles=3) == 0
    assert _record(tmp_path / "s", "n9", mungeds)["host"]["hostname"] == "n9"  # type: ignore[index]


# ---- metrics


def test_textfile_metrics(tmp_path: Path) -> None:
    fp = fingerprint("n1", hcas=2, plugin_abi=8)
    fp["errors"] = [{"probe": "rdma", "field": "rdma.x", "path": "/x", "error": "EINVAL"}]
    path = write_textfile(tmp_path, fp, last_change=123.0, publish_ok=True, last_publish=456.0)
    assert path == tmp_path / "ncclguard.prom"
    fams = {f.name: f for f in text_string_to_metric_families(path.read_text())}
    lib = fams["ncclguard_libnccl_info"].samples[0]
    assert lib.labels["version"] == "2.21.5" and lib.labels["default"] == "true"
    plug = fams["ncclguard_plugin_info"].samples[0]
    assert plug.labels["kind"] == "net" and plug.labels["abi"] == "8"
    ports = fams["ncclguard_rdma_port_info"].samples
    assert {(p.labels["device"], p.labels["state"]) for p in ports} == {
        ("mlx5_0", "ACTIVE"), ("mlx5_1", "ACTIVE")}
    assert fams["ncclguard_probe_errors"].samples[0].value == 1
    assert fams["ncclguard_fingerprint_last_change_timestamp_seconds"].samples[0].value == 123
    assert fams["ncclguard_publish_up"].samples[0].value == 1
    assert fams["ncclguard_record_last_publish_timestamp_seconds"].samples[0].value == 456
    assert [p.name for p in tmp_path.iterdir()] == ["ncclguard.prom"]


def test_notifier_never_blocks_on_a_full_socket(notify_sock: tuple[socket.socket, str]) -> None:
    _, addr = notify_sock  # nobody reads: the queue fills up
    n = Notifier({"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "1000000"})
    t0 = time.monotonic()
    results = [n.watchdog() for _ in range(2000)]
    assert time.monotonic() - t0 < 5
    assert results[0] is True and results[-1] is False
    assert n.last_error == f"{addr}: Resource temporarily unavailable"  # EAGAIN, named
