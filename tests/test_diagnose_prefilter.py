"""diagnose's block prefilter: a log is searched a block (about 1 MiB of whole lines) at a
time for the catalog's literals, and only the lines holding one get per-line work.

Every test here compares what the scanner kept with the prefilter and without it (every
line tried), or asserts a diagnosis on input shaped to hit one of the prefilter's edges:
a line across a read boundary, CRLF, gzip, an admin signature without a literal.
"""

from __future__ import annotations

import gzip
import random
from pathlib import Path

import pytest

from ncclguard.diagnose import load_catalog, logparse, run
from ncclguard.diagnose.catalog import cover, needle_options, needles_of
from ncclguard.diagnose.logparse import MAX_LINE, LogReader
from ncclguard.diagnose.scanner import Scanner

CORPUS = Path(__file__).parent / "diagnose_logs"
REAL = Path(__file__).parent / "data" / "diagnose_real"  # logs from public threads
MISMATCH = CORPUS / "version-differs-16-hosts.log"
CHUNK = 1 << 20

NOISE = [
    b"epoch 3 step 17 loss 1.0017 lr 3.0e-04 tokens/s 181234 grad_norm 0.017",
    b"n2:1001:1041 [1] NCCL INFO Channel 01/0 : 1 [1] -> 2 [2] [send] via NET/IB/1/GDRDMA",
    b"[rank9]:[W1130 01:02:03.000009 ProcessGroupNCCL.cpp:4561] heartbeat ok",
    b"3: n4:1003:1003 [0] NCCL INFO comm 0x5f00 rank 3 nranks 16 cudaDev 0 - Init COMPLETE",
    b"[2026-11-30 02:18:45] n5:7:7 [0] misc/socket.cc:1 NCCL WARN something else",
    b"n6:1:1 [0] NCCL BOGUS not a level NCCL prints",
    b" NCCL INFO a line that starts with the separator",
    b"n7:2:2 [0] NCCL INFO NCCL INFO twice NCCL WARN on one line",
    b"[1,12]<stderr>:n8:5:5 [3] NCCL INFO Using network IB",
    b"12: Traceback (most recent call last):",
    b"",
]


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def _kept(scanner: Scanner) -> dict:
    """Everything the scanner kept, as plain values."""
    ev = scanner.evidence()
    states = {
        sid: (
            st.count,
            [vars(r) for r in st.samples],
            {k: vars(r) for k, r in st.printers.items()},
            {v: {k: vars(r) for k, r in hs.items()} for v, hs in st.values.items()},
            sorted(st.weak),
        )
        for sid, st in ev.states.items()
    }
    return {
        "lines": ev.lines,
        "hosts": ev.hosts,
        "problems": ev.problems,
        "states": states,
        "tag_host": dict(scanner._tag_host),
        "pid_rank": dict(scanner._pid_rank),
    }


def _both(catalog, *paths: Path) -> tuple[dict, dict]:
    fast, slow = Scanner(catalog), Scanner(catalog, prefilter=False)
    assert fast.fast and not slow.fast
    for p in paths:
        fast.feed(p)
        slow.feed(p)
    return _kept(fast), _kept(slow)


def _random_log(seed: int) -> bytes:
    """Corpus lines (every signature, banners, plugin lines) among noise and near-misses,
    with random end-of-lines and an over-long line now and then."""
    rng = random.Random(seed)
    logs = [*sorted(CORPUS.glob("*.log")), *sorted(REAL.glob("*.log"))]
    corpus = [line for p in logs for line in p.read_bytes().splitlines()]
    out = []
    for _ in range(3000):
        pick = rng.random()
        if pick < 0.4:
            line = rng.choice(corpus)
        elif pick < 0.5:  # 2.26's timestamp: a new prefix every second
            ts = f"[2026-11-30 02:{rng.randrange(60):02d}:{rng.randrange(60):02d}] "
            host = f"n{rng.randrange(1, 20)}:{rng.randrange(3)}:4 [0] "
            line = (ts + host).encode() + rng.choice([b"NCCL INFO x", b"NCCL WARN y", b"NCCL Z"])
        elif pick < 0.55:  # PyTorch's copy of NCCL's last WARN, after "Last error:"
            line = rng.choice([b"[rank2]: Last error:", b"Last error:  ", b"Last error:"])
            line += b"\n" + rng.choice([*corpus, b"[rank2]: Cuda failure 'launch failed'"])
        elif pick < 0.995:
            line = rng.choice(NOISE)
        else:
            line = b"z" * (MAX_LINE + rng.randrange(1, 5000)) + b" NCCL WARN unhandled cuda error"
        out.append(line + (b"\r\n" if rng.random() < 0.2 else b"\n"))
    data = b"".join(out)
    return data if seed % 2 else data.rstrip(b"\n")  # with and without a final newline


# ------------------------------------------------------------------ the reader's blocks
@pytest.mark.parametrize("chunk", [7, 333, 4096, MAX_LINE + 1, CHUNK])
def test_blocks_are_the_lines_cut_at_max_line(tmp_path, monkeypatch, chunk):
    data = _random_log(3)
    f = tmp_path / "r.log"
    f.write_bytes(data)
    monkeypatch.setattr(logparse, "_CHUNK", chunk)
    want = data.split(b"\n")
    if want[-1] == b"":
        want.pop()
    reader = LogReader(f)
    got: list[bytes] = []
    for before, count, block in reader.blocks():
        assert before == len(got)
        lines = block.split(b"\n")
        assert len(lines) == count
        got.extend(lines)
    assert got == [w[:MAX_LINE] for w in want]
    assert reader.truncated_lines == sum(len(w) > MAX_LINE for w in want) > 0
    assert reader.lines == len(want)


# ------------------------------------------------------------------ same evidence
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("chunk", [97, 4096, CHUNK])
def test_prefilter_keeps_what_every_line_tried_keeps(catalog, tmp_path, monkeypatch, seed, chunk):
    f = tmp_path / "j.log"
    f.write_bytes(_random_log(seed))
    monkeypatch.setattr(logparse, "_CHUNK", chunk)
    fast, slow = _both(catalog, f)
    assert fast == slow
    assert fast["hosts"] and fast["tag_host"] and fast["pid_rank"]
    assert sum(st[0] for st in fast["states"].values()) > 0


def test_corpus_logs_keep_the_same_evidence(catalog):
    logs = sorted(p for p in CORPUS.iterdir() if p.name.endswith((".log", ".log.gz")))
    for log in [*logs, *sorted(REAL.glob("*.log"))]:
        fast, slow = _both(catalog, log)
        assert fast == slow, log.name


# ------------------------------------------------------------------ edges
def _filler(size: int) -> bytes:
    line = b"epoch 1 step 2 loss 0.5 lr 1e-4 tokens/s 100000\n"
    return line * (size // len(line)) + b"x" * (size % len(line) - 1) + b"\n"


def test_a_match_split_across_the_read_boundary(catalog, tmp_path):
    """The banner of n3 straddles the first 1 MiB read boundary, a WARN line the second."""
    ok = b"n1:10:10 [0] NCCL INFO NCCL version 2.21.5+cuda12.4\n"
    odd = b"n3:30:30 [0] NCCL INFO NCCL version 2.18.3+cuda12.1\n"
    warn = (
        b"n3:30:30 [0] bootstrap.cc:73 NCCL WARN Message truncated : received 2 bytes "
        b"instead of 1\n"
    )
    head = ok + _filler(CHUNK - len(ok) - 20)
    data = head + odd + _filler(CHUNK - len(odd) + 20 - 30) + warn + ok
    assert len(head) < CHUNK < len(head) + len(odd)
    warn_at = data.index(warn)
    assert warn_at < 2 * CHUNK < warn_at + len(warn)
    f = tmp_path / "split.log"
    f.write_bytes(data)
    report = run([f], catalog=catalog)
    ids = [d.signature.id for d in report.diagnoses]
    assert ids == ["nccl-version-differs", "bootstrap-message-truncated"]
    differs, truncated = report.diagnoses
    assert "n3 printed NCCL version 2.18.3" in differs.summary
    n_odd = data[: len(head)].count(b"\n") + 1
    assert any(e.line == n_odd and e.host == "n3" for e in differs.evidence)
    assert truncated.evidence[0].line == data[: data.index(warn)].count(b"\n") + 1
    assert report.evidence.hosts == ["n1", "n3"]


def test_crlf_log_gives_the_same_diagnosis(catalog, tmp_path):
    big = MISMATCH.read_bytes() * 40  # several blocks
    lf, crlf = tmp_path / "lf.log", tmp_path / "crlf.log"
    lf.write_bytes(big)
    crlf.write_bytes(big.replace(b"\n", b"\r\n"))
    a, b = run([lf], catalog=catalog), run([crlf], catalog=catalog)
    assert [d.to_dict()["summary"] for d in a.diagnoses] == [
        d.to_dict()["summary"] for d in b.diagnoses
    ]
    assert [(e.line, e.host) for e in a.diagnoses[0].evidence] == [
        (e.line, e.host) for e in b.diagnoses[0].evidence
    ]
    assert a.diagnoses[0].signature.id == "nccl-version-differs"
    fast, slow = _both(catalog, crlf)
    assert fast == slow


def test_gzip_log_gives_the_same_evidence(catalog, tmp_path):
    data = _random_log(4) * 20  # several MiB uncompressed
    plain, gz = tmp_path / "p.log", tmp_path / "p.out"
    plain.write_bytes(data)
    gz.write_bytes(gzip.compress(data))
    a, b = Scanner(catalog), Scanner(catalog)
    a.feed(plain, label="x")
    b.feed(gz, label="x")
    assert a.bytes > 2 * CHUNK
    assert _kept(a) == _kept(b)


ADMIN = """
[[signature]]
id = "site-gpu-lost"
title = "A GPU fell off the bus"
patterns = ['\\d+ (?i:gpus? lost)']
meaning = "m"
cause = "c"
fix = "f"
"""


def test_admin_signature_without_a_literal_falls_back_to_every_line(tmp_path):
    extra = tmp_path / "site.toml"
    extra.write_text(ADMIN)
    cat = load_catalog([extra])
    assert needles_of(r"\d+ (?i:gpus? lost)") is None
    assert cat.literals() is None
    assert not Scanner(cat).fast
    log = tmp_path / "j.log"
    lines = _filler(3 * CHUNK)
    log.write_bytes(lines + b"12: 2 GPUs lost on n7\n" + MISMATCH.read_bytes())
    report = run([log], catalog=cat)
    ids = [d.signature.id for d in report.diagnoses]
    assert "site-gpu-lost" in ids and "nccl-version-differs" in ids
    lost = next(d for d in report.diagnoses if d.signature.id == "site-gpu-lost")
    assert lost.evidence[0].line == lines.count(b"\n") + 1
    assert lost.evidence[0].rank == 12


def test_admin_signature_with_a_literal_keeps_the_prefilter(tmp_path):
    extra = tmp_path / "site.toml"
    extra.write_text(ADMIN.replace("\\d+ (?i:gpus? lost)", "fabricmanager: restarting"))
    cat = load_catalog([extra])
    assert b"fabricmanager: restarting" in (cat.literals() or ())
    log = tmp_path / "j.log"
    log.write_bytes(_filler(2 * CHUNK) + b"fabricmanager: restarting\n")
    report = run([log], catalog=cat)
    assert [d.signature.id for d in report.diagnoses] == ["site-gpu-lost"]


# ------------------------------------------------------------------ the literals
def test_a_pattern_is_searched_by_a_run_of_its_text_already_searched(catalog):
    """"^NET/Plugin ?: ?Could not find:" holds "NET/Plugin", which other plugin lines
    need searched: no search of its own."""
    assert needle_options(r"^NET/Plugin ?: ?Could not find: ?(?P<lib>\S+)") == [
        (b"Could not find:",), (b"NET/Plugin",)
    ]
    lits = catalog.literals() or ()
    assert b"NET/Plugin" in lits and not any(b"Could not" in lit for lit in lits)
    # a run shorter than a searched literal would pick more lines: never taken
    assert b"Got completion " in lits and b"NET/IB" not in lits


def test_needles_are_the_bytes_the_compiled_pattern_matches():
    assert needles_of(r"caf\xe9 failed") == (b"caf\xe9 failed",)
    assert needles_of("café failed") == ("café failed".encode(),)
    assert needles_of(r"(?:abcd)?efgh") == (b"efgh",)
    assert needles_of(r"(?=abcdef)\w+") is None  # a look-ahead gives none (errs to None)


def test_every_pattern_match_holds_a_searched_literal(catalog):
    lits = catalog.literals()
    assert lits is not None and len(lits) < sum(len(s.patterns) for s in catalog)
    for s in catalog:
        for p in s.patterns:
            # one of its literal sets, each literal of which holds a searched one
            assert any(all(any(lit in n for lit in lits) for n in o) for o in p.all_needles())
    # and on real evidence lines: every line a signature matched, as the scanner shows
    # it (NCCL's message at its level; the message PyTorch repeats after "Last error:"
    # as a WARN), holds a literal or follows a "Last error:" line (found by its own)
    for log in [*sorted(CORPUS.glob("*.log")), *sorted(REAL.glob("*.log"))]:
        prev = b""
        for raw in log.read_bytes().splitlines():
            for text, level in _views(raw, prev):
                if any(s.match(text, level) for s in catalog):
                    assert any(lit in raw for lit in lits) or b"Last error:" in prev, raw
            prev = raw


def _views(raw: bytes, prev: bytes) -> list[tuple[bytes, str | None]]:
    """(message, NCCL level) of one line as the scanner tries signatures on it."""
    m = logparse._PREFIX.match(raw) or logparse._BARE.match(raw)
    if m is not None:
        return [(m.group("msg"), m.group("level").decode())]
    text = logparse.strip_tag(raw) if raw[:1] in b" 0123456789[" else raw
    out: list[tuple[bytes, str | None]] = [(text, None)]
    if prev.rstrip().endswith(b"Last error:"):
        out.append((text, "WARN"))
    if b"Last error:" in raw:
        out.append((raw.split(b"Last error:", 1)[1].strip(), "WARN"))
    return out


def test_warn_patterns_share_one_search_and_see_what_pytorch_repeats(catalog, tmp_path):
    """NCCL's own warnings are WARN patterns: a block is searched once for "NCCL WARN",
    and PyTorch's copy of the last one after "Last error:" (on the next line, or on the
    same line of a flattened paste) is read as that WARN, in both paths."""
    lits = catalog.literals() or ()
    assert b"NCCL WARN" in lits
    assert not any(b"Message truncated" in lit or b"Cuda failure" in lit for lit in lits)
    log = tmp_path / "j.log"
    head = (
        b"[rank3]: torch.distributed.DistBackendError: NCCL error in: x.cpp:1, "
        b"unhandled cuda error, NCCL version 2.21.5\n[rank3]: Last error:\n"
    )
    pad = _filler(CHUNK - len(head) - 5)  # the "Last error:" line ends the first block
    log.write_bytes(
        pad
        + head
        + b"[rank3]: Cuda failure 'unspecified launch failure'\n"
        b"RuntimeError: NCCL error: remote process exited or there was a network error, "
        b"NCCL version 2.21.5 ncclRemoteError: x Last error: socketProgress: Connection "
        b"closed by remote peer n2<3>\n"
        b"a user's print: Cuda failure 'unspecified launch failure'\n"
    )
    first = next(LogReader(log).blocks())[2]
    assert first.endswith(b"[rank3]: Last error:")
    fast, slow = _both(catalog, log)
    assert fast == slow
    cuda = fast["states"]["unhandled-cuda-error"]
    assert cuda[0] == 1  # the echo; not the user's print of the same words
    assert cuda[1][0]["line"] == pad.count(b"\n") + 3 and cuda[1][0]["tag_rank"] == 3
    peer = fast["states"]["peer-exited"]
    assert [r["line"] for r in peer[1]] == [pad.count(b"\n") + 4]


def test_cover_shares_long_pieces_only():
    got = cover([b"NET/Plugin: Loaded x", b"NET/Plugin : Plugin load (", b"Error", b"NoError"])
    assert got == (b"Error", b"NET/Plugin")
    assert cover([b"abcdefg1", b"abcdefg2"]) == (b"abcdefg1", b"abcdefg2")  # 7 < MIN_COVER
    # never "NCCL INFO ", which nearly every line of a log has
    info = [b"NCCL INFO NET/Plugin", b"NCCL INFO Using network"]
    assert cover(info) == tuple(info)
