"""The spool's pieces: MUNGE credentials through libmunge (real munged daemons), the record
format, the bounded file reader, and where the collector gets node addresses from."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from helpers.fingerprints import fingerprint
from helpers.munge import MungeSet

from inventoryd.controller.addresses import ADDRESS_RETRY_S, Addresses, resolve
from ncclguard import config as configmod
from ncclguard import munge, spool

# ---- munge.py against real munged daemons


def test_a_credential_carries_payload_uid_origin_and_time(mungeds: MungeSet) -> None:
    t0 = int(time.time())
    cred = munge.encode(b"x" * 50_000, socket_path=str(mungeds.node("n5").socket), ttl=120)
    assert cred.startswith(b"MUNGE:") and len(cred) < 5_000  # zlib inside
    got = munge.decode(cred, socket_path=str(mungeds.controller.socket))
    assert got.payload == b"x" * 50_000 and got.status == 0 and got.status_name == "ok"
    assert (got.uid, got.gid) == (os.getuid(), os.getgid())
    assert got.origin == mungeds.addr("n5") == "127.42.0.5"
    # munged's encode time is its own clock's second: seen one before t0 in a CI run
    # (2026-12-03, the forky root), cause not known; a second either way is allowed
    assert t0 - 1 <= got.encoded_at <= time.time() and got.ttl == 120


def test_replayed_expired_and_rewound_are_decoded_with_their_status(mungeds: MungeSet) -> None:
    sock = str(mungeds.controller.socket)
    cred = munge.encode(b"once", socket_path=str(mungeds.node("n1").socket))
    assert munge.decode(cred, socket_path=sock).status == 0
    again = munge.decode(cred, socket_path=sock)  # munged's own replay cache
    assert again.status == munge.REPLAYED and again.payload == b"once"
    # another munged with the same key decodes it as new (each has its own cache)
    other = munge.decode(cred, socket_path=str(mungeds.node("n2").socket))
    assert other.status == 0
    short = munge.encode(b"short", socket_path=str(mungeds.node("n1").socket), ttl=1)
    time.sleep(2.1)
    late = munge.decode(short, socket_path=sock)
    assert late.status == munge.EXPIRED and late.payload == b"short"


@pytest.mark.parametrize(
    ("cred", "name"),
    [(b"MUNGE:not-base64:", "bad-cred"), (b"garbage", "bad-cred"), (b"", "bad-cred"),
     (b"MUNGE:\0:", "bad-cred")],
)
def test_garbage_is_a_munge_error(mungeds: MungeSet, cred: bytes, name: str) -> None:
    with pytest.raises(munge.MungeError) as e:
        munge.decode(cred, socket_path=str(mungeds.controller.socket))
    assert e.value.name == name


def test_another_key_does_not_decode(mungeds: MungeSet, tmp_path: Path) -> None:
    from devtools.devcluster import Munged, write_munge_key

    stranger = Munged(tmp_path / "m", "stranger", write_munge_key(tmp_path / "k2"),
                      "127.42.250.9")
    with stranger:
        cred = munge.encode(b"hi", socket_path=str(stranger.socket))
    with pytest.raises(munge.MungeError) as e:
        munge.decode(cred, socket_path=str(mungeds.controller.socket))
    assert e.value.name in ("bad-mac", "cred-invalid", "bad-cred")


def test_an_absent_munged_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(munge.MungeUnavailable) as e:
        munge.encode(b"x", socket_path=str(tmp_path / "none.socket"))
    assert "none.socket" in str(e.value) and e.value.name == "socket"


def test_decoding_is_thread_safe(mungeds: MungeSet) -> None:
    creds = [munge.encode(str(i).encode(), socket_path=str(mungeds.node("n1").socket))
             for i in range(200)]
    got: list[bytes] = []
    errors: list[Exception] = []
    sock = str(mungeds.node("n3").socket)  # started before the threads

    def work(part: list[bytes]) -> None:
        for c in part:
            try:
                got.append(munge.decode(c, socket_path=sock).payload)
            except Exception as e:  # reported below: a thread's exception is lost
                errors.append(e)

    threads = [threading.Thread(target=work, args=(creds[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(got, key=int) == [str(i).encode() for i in range(200)]


# ---- the record format


def test_payload_round_trip_and_names() -> None:
    fp = fingerprint("gpu-001.a", plugin_abi=8)
    t0 = time.time_ns()
    rec = spool.parse_payload(spool.payload(fp), max_bytes=1 << 20)
    assert rec.host == "gpu-001.a" and rec.fingerprint == fp and t0 <= rec.seq <= time.time_ns()
    assert spool.parse_payload(spool.payload(fp, seq=7), max_bytes=1 << 20).seq == 7
    assert spool.record_name("n1") == "n1.rec" and spool.host_of("n1.rec") == "n1"
    for bad in ("", ".n1", "../n1", "n/1", "n 1", "a" * 200):
        with pytest.raises(ValueError):
            spool.record_name(bad)
    for bad in (".n1.rec.abc", "n1.rec.tmp", "n1", "..rec", "-x.rec"):
        assert spool.host_of(bad) is None


def test_payload_bounds_and_types() -> None:
    big = spool.payload(fingerprint("n1", plugin_abi=8))
    with pytest.raises(spool.RecordError) as e:
        spool.parse_payload(big, max_bytes=len(big) - 1)
    assert e.value.cause == "oversized"
    for data, text in [
        (b"[" * 200_000, "not JSON"),
        (b"[]", "not a JSON object"),
        (b'{"ncclguard_record": true, "host": "n1", "fingerprint": {}}', "record version True"),
        (b'{"ncclguard_record": 1, "host": 5, "fingerprint": {}}', "not a node name"),
        (b'{"ncclguard_record": 1, "host": "n1", "seq": 1, "fingerprint": []}',
         "no fingerprint object"),
        (b'{"ncclguard_record": 1, "host": "n1", "seq": true, "fingerprint": {}}',
         "record seq True is not a count"),
    ]:
        with pytest.raises(spool.RecordError) as e:
            spool.parse_payload(data, max_bytes=1 << 22)
        assert e.value.cause == "malformed" and text in e.value.detail, e.value.detail
    fp = fingerprint("n2", plugin_abi=8)
    doc = spool.payload(fp).replace(b'"host":"n2"', b'"host":"n1"', 1)
    with pytest.raises(spool.RecordError) as e:
        spool.parse_payload(doc, max_bytes=1 << 22)
    assert e.value.cause == "name-mismatch"


_POISONS = [  # (the value's JSON text as a node may write it, what the error says)
    (b"9223372036854775808", "integer outside 64 bits"),     # 2**63
    (b"-9223372036854775809", "integer outside 64 bits"),
    (b"18446744073709551616", "integer outside 64 bits"),
    (b"1e400", "not finite"), (b"-1E999", "not finite"),
    (b"1" + b"0" * 400 + b".5", "not finite"),
    (b"NaN", "not finite"), (b"Infinity", "not finite"), (b"-Infinity", "not finite"),
    (b'"\\ud800"', "not valid UTF-8"), (b'"x\\uDFFFy"', "not valid UTF-8"),
    (b'"\xed\xa0\x80"', "not valid UTF-8"),                  # a surrogate's own bytes
]


@pytest.mark.parametrize(("poison", "text"), _POISONS)
def test_a_value_sqlite_cannot_hold_is_found_in_any_spelling(
        poison: bytes, text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each is refused as before the byte screen (spool._MAYBE_UNSTORABLE) was put in
    front of the value-by-value check, in UTF-8 and in UTF-16 (json.loads reads both); and
    an honest record is never checked value by value (a third of a heartbeat's walk)."""
    fp = fingerprint("n1", plugin_abi=8)
    fp["libnccl"][0]["version_code"] = 0
    doc = spool.payload(fp).replace(b'"version_code":0', b'"version_code":' + poison, 1)
    assert poison in doc
    for data in (doc, doc.decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass")):
        with pytest.raises(spool.RecordError) as e:
            spool.parse_payload(data, max_bytes=1 << 22)
        assert e.value.cause == "malformed" and text in e.value.detail, e.value.detail
    calls = []
    real = spool._storable
    monkeypatch.setattr(spool, "_storable", lambda v: calls.append(1) or real(v))
    spool.parse_payload(spool.payload(fingerprint("n1", plugin_abi=8)), max_bytes=1 << 22)
    assert calls == []
    fp["libnccl"][0]["version_code"] = "NaN, 1e400 and 2**64 as text: only a look, no error"
    spool.parse_payload(spool.payload(fp), max_bytes=1 << 22)
    assert calls == [1]


# ---- files


def test_write_is_atomic_and_private_to_the_writer(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)
    p = spool.write(tmp_path, "n1", b"MUNGE:a:\n")
    assert p.read_bytes() == b"MUNGE:a:\n" and (p.stat().st_mode & 0o777) == 0o644
    ino = p.stat().st_ino
    spool.write(tmp_path, "n1", b"MUNGE:b:\n")
    assert p.read_bytes() == b"MUNGE:b:\n" and p.stat().st_ino != ino  # replaced, not edited
    assert [x.name for x in tmp_path.iterdir()] == ["n1.rec"]
    # a dead publisher's temporary file is cleaned up by its node, not by others
    left = tmp_path / ".n1.rec.deadbeef0000"
    left.write_bytes(b"x")
    os.utime(left, (1, 1))
    (tmp_path / ".n2.rec.deadbeef0000").write_bytes(b"x")
    assert spool.remove_leftovers(tmp_path, "n1", 3600, time.time()) == 1
    assert sorted(x.name for x in tmp_path.iterdir()) == [".n2.rec.deadbeef0000", "n1.rec"]
    assert [n for n, _ in spool.scan(tmp_path)] == ["n1.rec"]  # temporary files: not records


def test_read_is_bounded_and_never_follows_or_blocks(tmp_path: Path) -> None:
    (tmp_path / "ok.rec").write_bytes(b"  MUNGE:x:\n")
    assert spool.read(tmp_path / "ok.rec", max_bytes=100) == b"MUNGE:x:"
    with open(tmp_path / "big.rec", "wb") as f:
        f.truncate(10 << 30)  # 10 GiB, sparse
    t0 = time.monotonic()
    with pytest.raises(spool.RecordError) as e:
        spool.read(tmp_path / "big.rec", max_bytes=1 << 20)
    assert e.value.cause == "oversized" and time.monotonic() - t0 < 1
    (tmp_path / "link.rec").symlink_to(tmp_path / "ok.rec")
    os.mkfifo(tmp_path / "fifo.rec")
    (tmp_path / "dir.rec").mkdir()
    for name in ("link.rec", "fifo.rec", "dir.rec"):
        with pytest.raises(spool.RecordError) as e:
            spool.read(tmp_path / name, max_bytes=100)
        assert e.value.cause == "not-a-file", name
    with pytest.raises(spool.RecordError) as e:
        spool.read(tmp_path / "gone.rec", max_bytes=100)
    assert e.value.cause == "unreadable" and "gone.rec" in e.value.detail
    states = dict(spool.scan(tmp_path))
    assert states["link.rec"] is None and states["fifo.rec"] is None
    assert states["ok.rec"] is not None and states["ok.rec"].size == 11


def test_check_dir_refuses_missing_mounts_and_unsafe_dirs(tmp_path: Path) -> None:
    with pytest.raises(spool.SpoolError, match="missing mount"):
        spool.check_dir(tmp_path / "a" / "spool", create=True)
    spool.check_dir(tmp_path / "spool", create=True)  # the last component only
    assert (tmp_path / "spool").stat().st_mode & 0o777 == 0o755
    os.chmod(tmp_path / "spool", 0o777)
    with pytest.raises(spool.SpoolError, match="writable by others"):
        spool.check_dir(tmp_path / "spool")
    (tmp_path / "file").write_text("")
    with pytest.raises(spool.SpoolError, match="not a directory"):
        spool.check_dir(tmp_path / "file")


# ---- node addresses


def test_resolve_keeps_ipv4_and_drops_loopback_found_by_name() -> None:
    """munged's default origin is its host name's address, which many images map to
    loopback: a name resolving there proves nothing. A literal is the admin's word."""
    assert resolve(["10.1.2.3", "", "::1", "localhost", "0.0.0.0"]) == {"10.1.2.3"}
    assert resolve(["127.42.0.7"]) == {"127.42.0.7"}
    assert resolve(["no-such-host.invalid"]) == frozenset()


def test_addresses_from_slurm_are_refreshed_and_rate_limited() -> None:
    now = [1000.0]
    calls: list[float] = []
    answer = [("n1", "10.0.0.1", "n1"), ("n2", "10.0.0.2", "localhost")]

    def slurm() -> list[tuple[str, str, str]]:
        calls.append(now[0])
        if answer is None:
            raise RuntimeError("slurmctld down")
        return list(answer)

    a = Addresses(configmod.CollectorConfig(address_refresh_s=600), slurm, lambda: now[0])
    assert a.of("n1") == {"10.0.0.1"} and a.of("n2") == {"10.0.0.2"}  # localhost: nothing
    assert len(calls) == 1
    assert a.of("n9") is None and len(calls) == 1  # just asked: not again at once
    now[0] += ADDRESS_RETRY_S
    answer.append(("n9", "10.0.0.9", "n9"))
    assert a.of("n9") == {"10.0.0.9"} and len(calls) == 2  # a new node, asked again
    now[0] += 600
    answer.clear()
    answer.append(("n1", "10.0.0.11", "n1"))
    assert a.of("n1") == {"10.0.0.11"} and len(calls) == 3  # refreshed: n1 moved
    assert a.of("n2") is None


def test_addresses_keep_the_last_answer_when_slurm_fails() -> None:
    now = [0.0]
    ok = [True]
    calls = []

    def slurm() -> list[tuple[str, str, str]]:
        calls.append(now[0])
        if not ok[0]:
            raise RuntimeError("slurmctld down")
        return [("n1", "10.0.0.1", "n1")]

    a = Addresses(configmod.CollectorConfig(), slurm, lambda: now[0])
    assert not a.known and a.of("n1") == {"10.0.0.1"} and a.known
    ok[0] = False
    now[0] += 10_000
    assert a.of("n1") == {"10.0.0.1"} and a.error == "RuntimeError: slurmctld down"
    # Slurm never answered: asked once, then at most every ADDRESS_RETRY_S, not per record
    calls.clear()
    never = Addresses(configmod.CollectorConfig(), slurm, lambda: now[0])
    assert [never.of(f"n{i}") for i in range(100)] == [None] * 100 and not never.known
    assert len(calls) == 1
    now[0] += ADDRESS_RETRY_S
    ok[0] = True
    assert never.of("n1") == {"10.0.0.1"} and len(calls) == 2


def test_a_static_map_is_the_whole_truth() -> None:
    def slurm() -> list[tuple[str, str, str]]:
        raise AssertionError("Slurm must not be asked")

    cfg = configmod.from_dict({"collector": {"addresses": {
        "gpu1": ["10.0.0.1", "localhost"], "gpu2": ["10.0.0.2", "10.0.0.9"], "gpu3": ["10.0.0.9"],
    }}})
    a = Addresses(cfg.collector, slurm)
    assert a.of("gpu1") == {"10.0.0.1"} and a.of("gpu4") is None and a.known
    # an address two nodes share proves nothing about which one signed: dropped for both
    assert a.of("gpu2") == {"10.0.0.2"} and a.of("gpu3") == frozenset()
    assert a.shared == {"10.0.0.9": ["gpu2", "gpu3"]}
    with pytest.raises(configmod.ConfigError, match="expected a list of addresses"):
        configmod.from_dict({"collector": {"addresses": {"gpu1": "10.0.0.1"}}})
