"""diagnose: every built-in signature names the source lines (NCCL's, PyTorch's, a net
plugin's) whose output it matches (``[[signature.source]]`` in signatures.toml), and
matches them as those programs print them.

Each record's format is rendered here as its program would print it (printf conversions
filled from the record's ``args`` or generic values, then NCCL's own prefix for its
level) and the lines go through the real diagnose path. No expected line is written by
hand: every line is derived from a recorded format.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.diagnose_sources import sources_markdown

from ncclguard.diagnose import load_catalog, run
from ncclguard.diagnose.catalog import Signature, SourceLine

CATALOG = load_catalog()
SIGS = {s.id: s for s in CATALOG}
RECORDS = [(s, i, r) for s in CATALOG for i, r in enumerate(s.sources)]

# Lines one family's record prints that a signature of another family is meant to match
# as well (a wrapper reading the same text for another purpose). (record's signature,
# the other signature) pairs:
ALLOWED = {
    # nccl-version-differs reads the version PyTorch appends to its NCCL error line; that
    # line is also PyTorch's wrapper of NCCL's error string
    ("python-nccl-error", "nccl-version-differs"),
    ("nccl-version-differs", "unhandled-system-error"),
    # PyTorch's "ncclUnhandledCudaError: ..." detail line is an ncclXxxError: line too
    ("cuda-error-reported", "python-nccl-error"),
    # IB's device line ends with its out-of-band interface: its device count is one
    # reading, the interface another (issue 44)
    ("net-device-count-differs", "bootstrap-interface-differs"),
    ("bootstrap-interface-differs", "net-device-count-differs"),
    ("socket-interface-virtual", "net-device-count-differs"),
    # an interface line naming lo or docker0 is also an interface a host used
    ("socket-interface-virtual", "bootstrap-interface-differs"),
}

# printf conversions (flags, width, precision, length, type) and fmt's "{}"
_CONV = re.compile(r"%([-+ #0]*)(\d+)?(?:\.\d+)?(hh|h|ll|l|z|j|t)?([diouxXsfcp%])|\{\}")
_TAG = re.compile(r"\b(?:v\d+\.\d+\.\d+(?:-\d+)?|hpcx-v\d+\.\d+\.\d+)\b")


def render(fmt: str, args: tuple[str, ...], host: int) -> str:
    """``fmt`` with its conversions filled: from ``args`` in order when given, else a
    generic value of the conversion's type (``host`` 0 and 1 get different ones)."""
    it = iter(args)
    used = {"n": 0}

    def fill(m: re.Match[str]) -> str:
        if m.group(0) == "%%":
            return "%"
        used["n"] += 1
        if args:
            return next(it)
        flags, width, _length, conv = m.group(1) or "", m.group(2), m.group(3), m.group(4)
        if m.group(0) == "{}" or conv == "s":
            return f"tok{host}"
        if conv == "p":
            return f"0x7f3a2c00123{host}"
        if conv in "xX":
            return f"{26 + host:x}"
        if conv == "f":
            return f"{1.5 + host:f}"
        if conv == "c":
            return "c"
        value = str(3 + 2 * host)
        if width and "0" in flags:
            value = value.zfill(int(width))
        return value

    out = _CONV.sub(fill, fmt)
    if args:
        assert used["n"] == len(args), f"{fmt!r}: {len(args)} args for {used['n']} conversions"
    return out


def nccl_line(rec: SourceLine, message: str, host: int, since_2_30_6: bool = False) -> str:
    """The message as NCCL's logger prints it at the record's level (src/debug.cc; from
    2.30.6 a WARN names its function after file:line); a ``frame`` record as gdb prints
    a frame of that function."""
    prefix = f"n{host + 1}:{4242 + host}:{4243 + host} [0]"
    if rec.level == "INFO":
        return f"{prefix} NCCL INFO {message}"
    if rec.level == "WARN" and since_2_30_6:
        return f"{prefix} {Path(rec.file).name}:123 (ncclFn) NCCL WARN {message}"
    if rec.level == "WARN":
        return f"{prefix} {Path(rec.file).name}:123 NCCL WARN {message}"
    if rec.level == "frame":
        return f"#2  0x00007f00ad990a6e in {message} (comm=0x7f0018001060) at x.cc:106"
    if rec.level == "TRACE":
        return f"{prefix} 0.000000 fn:123 NCCL TRACE {message}"
    return message  # printf, an exception's text


def _diagnosed(tmp_path: Path, lines: list[str], name: str = "job.log") -> set[str]:
    log = tmp_path / name
    log.write_text("\n".join(lines) + "\n")
    return {d.signature.id for d in run([log], catalog=CATALOG).diagnoses}


def _match(sig: Signature, rec: SourceLine, message: str):
    if rec.level == "frame":
        return sig.match(nccl_line(rec, message, 0).encode(), None)
    level = None if rec.level == "none" else rec.level
    got = None
    for part in message.split("\n"):
        got = got or sig.match(part.encode(), level)
    return got


def _args(rec: SourceLine, host: int) -> tuple[str, ...]:
    return rec.other_args if host and rec.other_args else rec.args


def _id(item) -> str:
    sig, i, _rec = item
    return f"{sig.id}#{i}"


def test_every_builtin_signature_names_its_sources():
    for sig in CATALOG:
        assert sig.sources, f"{sig.id}: no [[signature.source]] record"
        for rec in sig.sources:
            assert _TAG.search(rec.releases) or rec.releases.startswith("untagged:"), (
                sig.id, rec.releases)
            # only PyTorch's lines were read from the source index, not at a release tag
            assert _TAG.search(rec.releases) or rec.project == "pytorch", (sig.id, rec)
            if rec.other_args:
                assert sig.kind == "differs" and len(rec.other_args) == len(rec.args)


@pytest.mark.parametrize("item", RECORDS, ids=_id)
def test_signature_matches_its_rendered_source(item, tmp_path):
    sig, _i, rec = item
    message = render(rec.format, _args(rec, 0), 0)
    hit = _match(sig, rec, message)
    assert hit is not None, f"{sig.id} does not match {rec.project} {rec.file}: {message!r}"
    if sig.kind == "line":
        assert sig.id in _diagnosed(tmp_path, [nccl_line(rec, message, 0)])
        if rec.level == "WARN" and "v2.30" in rec.releases:
            assert sig.id in _diagnosed(tmp_path, [nccl_line(rec, message, 0, True)], "2.30")
        if rec.level == "frame":  # py-spy --native prints the function and its library
            assert sig.id in _diagnosed(tmp_path, [f"    {message} (libnccl.so.2)"], "py")
        return
    pattern, m = hit
    if pattern.value is None:  # evidence only: it gives its host no value
        return
    value_a = pattern.render(m)
    other = render(rec.format, _args(rec, 1), 1)
    hit_b = _match(sig, rec, other)
    assert hit_b is not None, other
    b_rec, b_msg = rec, other
    if hit_b[0].render(hit_b[1]) == value_a:
        # a value without fields (no plugin found): another record of the signature gives
        # the other host a different value
        for r in sig.sources:
            msg = render(r.format, r.args, 1)
            h = _match(sig, r, msg)
            if h is not None and h[0].value is not None and h[0].render(h[1]) != value_a:
                b_rec, b_msg = r, msg
                break
        else:
            pytest.fail(f"{sig.id}: no record gives another value than {value_a!r}")
    if "none" in (rec.level, b_rec.level):
        # a line without NCCL's prefix names no host: the scanner gives it the host of
        # the NCCL lines around it, which a one-line log lacks
        return
    fired = _diagnosed(tmp_path, [nccl_line(rec, message, 0), nccl_line(b_rec, b_msg, 1)])
    assert sig.id in fired, (message, b_msg)
    same = _diagnosed(tmp_path, [nccl_line(rec, message, 0), nccl_line(rec, message, 1)],
                      "same.log")
    assert sig.id not in same


@pytest.mark.parametrize("item", RECORDS, ids=_id)
def test_other_families_do_not_match_the_source(item, tmp_path):
    sig, _i, rec = item
    message = render(rec.format, _args(rec, 0), 0)
    for other in CATALOG:
        if other.family == sig.family or (sig.id, other.id) in ALLOWED:
            continue
        if other.scope == "nccl" and rec.level == "none":
            continue  # it sees only lines with NCCL's prefix
        assert _match(other, rec, message) is None, f"{other.id} matches {message!r}"
    fired = _diagnosed(tmp_path, [nccl_line(rec, message, 0)])
    stray = {i for i in fired if SIGS[i].family != sig.family and (sig.id, i) not in ALLOWED}
    assert not stray, (message, stray)


def test_render_fills_conversions():
    rec = SourceLine("nccl", "src/x.cc", "a %d b %s c %02d %p %lx %zu %%", "INFO", "v2.4.8-1")
    assert render(rec.format, (), 0) == "a 3 b tok0 c 03 0x7f3a2c001230 1a 3 %"
    assert render(rec.format, (), 1) != render(rec.format, (), 0)
    assert nccl_line(rec, "m", 0) == "n1:4242:4243 [0] NCCL INFO m"


def test_docs_list_every_source_record():
    """docs/diagnose.md, "Source lines of each signature": generated from the catalog."""
    doc = (Path(__file__).parent.parent / "docs" / "diagnose.md").read_text()
    assert sources_markdown(CATALOG) in doc
