"""The scanner: log files in, :class:`LogEvidence` out (the first step of a diagnosis).

    log files ──Scanner.feed──▶ LogEvidence ──diagnose()──▶ [Diagnosis]   (diagnosis.py)

It keeps only bounded state: for each signature a count, the first :data:`MAX_SAMPLES`
evidence lines, the hosts that printed it and, for ``differs`` signatures, the hosts of
each value (an evidence line for the first :data:`MAX_LINES_KEPT` of each). Memory grows
with the number of hosts, never with the log's size, and the hosts are bounded too (issue
47: a 108 MB log of distinct hosts and values held 752 MB): only the job's nodes when
they are known (at most :data:`MAX_HOSTS` names or twice the job's nodes), at most
:data:`MAX_VALUES` values a signature; what falls outside is counted and reported
(:attr:`Scanner.cut`), never attributed.
How a log is read (blocks, NCCL's prefix, the bounds) is :mod:`.logparse`.

Over 500 lines: the per-line reading of NCCL's prefixes, the attribution of lines that
lost theirs and the bounded evidence per signature share one pass over each block;
splitting them would read each block twice.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .catalog import Catalog, Signature
from .logparse import _BARE, _PREFIX, LogReader, ReadProblem, launcher_rank, strip_tag

__all__ = ["MAX_HOSTS", "MAX_SAMPLES", "MAX_VALUES", "Evidence", "LogEvidence", "RawMatch",
           "Scanner", "SignatureState", "short"]

MAX_SAMPLES = 5  # evidence lines kept per signature
MAX_TEXT = 400  # characters kept of one evidence line
MAX_HOSTS = 4096  # distinct host names (and launcher ranks) attributed, job's nodes unknown
MAX_VALUES = 16  # distinct values of one ``differs`` signature (a real job shows 2 or 3)
MAX_LINES_KEPT = 64  # evidence lines kept per value (and per signature's printers)
MAX_PIDS = 65536  # (host, pid) -> rank entries, of attributed hosts only
MAX_RANKS = 65536  # launcher tags (ranks) mapped to their host
#: ``#rankN`` keys attributed (a rank whose host is known only at the end): apart from the
#: host names, so that a job's ranks never crowd out its hosts (issue 47's review: 8,192
#: ranks of 1,024 nodes did, and 384 healthy nodes were named odd)
MAX_RANK_KEYS = 16384
# ranks and sizes of at most 9 digits: a longer one is no NCCL line, and int() of over
# 4,300 digits raises (a hostile log stopped diagnose with a ValueError)
_INIT = re.compile(rb"\bcomm 0x[0-9a-f]+ rank (?P<rank>\d{1,9}) nr?anks (?P<nranks>\d{1,9})\b",
                   re.I)


def short(host: str) -> str:
    """The short host name (the inventory's key): ``n3.cluster`` → ``n3``; a name that
    starts with a dot (a poster's "...-48") is kept whole."""
    return host.split(".", 1)[0] or host


@dataclass(frozen=True)
class Evidence:
    file: str
    line: int
    text: str
    host: str | None = None
    pid: int | None = None
    rank: int | None = None

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file, "line": self.line, "host": self.host,
            "rank": self.rank, "text": self.text,
        }  # fmt: skip


@dataclass
class RawMatch:
    """What the scanner saw of one match, before hosts and ranks are resolved."""

    file: str
    line: int
    text: str
    host: str | None
    pid: int | None
    tag_rank: int | None


@dataclass
class SignatureState:
    count: int = 0
    samples: list[RawMatch] = field(default_factory=list)
    # value -> host -> its first line (None past MAX_LINES_KEPT hosts of the value)
    values: dict[str, dict[str | None, RawMatch | None]] = field(default_factory=dict)
    printers: dict[str | None, RawMatch | None] = field(default_factory=dict)  # host → line
    weak: set[str] = field(default_factory=set)  # values from weak patterns


@dataclass
class LogEvidence:
    """Everything the scanner kept, resolved to hosts and ranks."""

    files: list[str]
    lines: int
    bytes: int
    hosts: list[str]  # short names of every host that printed an NCCL-prefixed line
    problems: list[str]
    states: dict[str, SignatureState]
    resolve: Callable[[RawMatch], Evidence]
    #: matching lines not attributed (hosts past the bounds, values past MAX_VALUES): a
    #: diagnosis then names no odd node by who did not print a line, or by a minority
    cut: int = 0
    #: the most ranks any of the log's communicators has (NCCL's ``comm … nranks N``
    #: lines; 0: none seen), and the ranks seen among them: what a log of only some hosts
    #: cannot tell (issue 44)
    nranks: int = 0
    ranks_seen: int = 0


MAX_KEY = 512  # a prefix longer than this is no NCCL prefix: never cached
# on a reversed block: a line's text before " NCCL ", at most MAX_KEY + 1 bytes of it (a
# longer one is no prefix; capturing it whole cost 1.15 GB of cache on a 1 GiB log)
_REV_KEY = re.compile(rb" LCCN ([^\n]{0,%d})" % (MAX_KEY + 1))
_SEP = b" NCCL "
_RANKS = b"anks "  # in NCCL's "comm 0x… rank R nranks N" / "nRanks N" lines
# PyTorch's NCCL errors end with "\nLast error:\n" and NCCL's last WARN message
# (ncclGetLastError: the message without NCCL's prefix; torch/csrc/distributed/c10d
# NCCLUtils getNcclErrorDetailStr, NCCL src/debug.cc ncclLastError); a flattened paste
# has it on the same line. That message is read as an NCCL WARN line (an "echo").
_LAST = b"Last error:"
# NCCL's own banner as releases before its debug prefix on it printed it (printf, rank 0):
# the one unprefixed line of NCCL's own format that is not a "NCCL INFO/WARN" line
_BANNER = re.compile(rb"NCCL version [0-9][^\s]*\s*")
_CACHE = 50_000  # entries kept in each prefix cache before it is emptied
_CACHE_BYTES = 8 << 20  # key bytes the three prefix caches hold together before emptied
_MANY_NEW = 64  # new prefixes in one block past which its lines are registered one by one


class Scanner:
    """Feed it log files, one after the other; it keeps bounded state.

    A log is read in blocks of whole lines (about 1 MiB). When every catalog pattern
    has a required literal (:meth:`Catalog.literals`), a block is searched for those
    literals with ``bytes.find`` and only the lines that hold one (and NCCL's ``comm …
    nranks`` lines, for the ranks, and the line after PyTorch's ``Last error:``) get
    per-line work; the hosts are read from the distinct NCCL prefixes of the block,
    found by one regex over it. Otherwise every line gets the per-line work (the slow
    path, never a missed line).
    """

    def __init__(self, catalog: Catalog, prefilter: bool = True,
                 hosts: Iterable[str] | None = None) -> None:
        """``prefilter=False``: every line gets the per-line work (for comparison).
        ``hosts``: the job's nodes, when known: lines of other hosts are counted, not
        attributed (a log can name any number of hosts)."""
        self.catalog = catalog
        self._sigs: list[Signature] = list(catalog)
        self._combined = catalog.combined()
        self._gate = catalog.gate()
        self._prefilter = self._gate or self._combined  # one regex per line before the rest
        lits = catalog.literals() if prefilter else None
        self._literals: tuple[bytes, ...] | None = (
            None if lits is None else tuple(dict.fromkeys((*lits, _RANKS)))
        )
        self._states: dict[str, SignatureState] = {s.id: SignatureState() for s in self._sigs}
        self._hosts: set[str] = set()
        self._tag_host: dict[int, str] = {}  # launcher rank → host
        self._pid_rank: dict[tuple[str, int], int] = {}  # (host, pid) → NCCL rank
        self._nranks = 0  # the largest communicator's size seen
        self._pid_size: dict[tuple[str, int], int] = {}  # the size of _pid_rank's comm
        # NCCL's prefix repeats for every line of a process: parse each distinct one once.
        # Keyed by the line up to 5 bytes past " NCCL " (what the prefix regex reads).
        self._prefixes: dict[bytes, tuple[str, int, int | None] | None] = {}
        self._first_of: dict[bytes, bytes] = {}  # reversed text before the last " NCCL "
        self._settled: set[bytes] = set()  # prefixes whose host is registered (or none)
        self._cached = 0  # key bytes in the three caches above (_spend)
        # (host, pid) of the last NCCL-prefixed line of the file at hand before the block
        # at hand (every line read: the last read): the host of an NCCL line that lost
        # its prefix, when nothing nearer is
        self._tail: tuple[str, int] | None = None
        self._cursor_block: bytes | None = None  # _host_above's place in a block
        self._cursor_pos = 0
        self._cursor_host: tuple[str, int] | None = None
        self._echo_next = False  # the next line of the file is the message after "Last error:"
        self.files: list[str] = []
        self.lines = 0
        self.bytes = 0
        self.problems: list[ReadProblem] = []
        self.long_lines = 0
        self._nodes = None if hosts is None else frozenset(short(h) for h in hosts)
        self._max_keys = max(MAX_HOSTS, 2 * len(self._nodes or ()))
        self._keys: set[str] = set()  # host keys attributed so far
        self._rank_key_of: dict[int, str] = {}  # #rank keys attributed, one string a rank
        #: matches not attributed: their host past the bounds (or not the job's), their
        #: value past MAX_VALUES
        self.cut = {"hosts": 0, "values": 0}

    @property
    def fast(self) -> bool:
        """Whether blocks are prefiltered by literals (else every line is tried)."""
        return self._literals is not None

    def feed(
        self,
        path: str | os.PathLike[str],
        label: str | None = None,
        deadline: float | None = None,
        owner_uid: int | None = None,
        progress: Callable[[int, int], object] | None = None,
    ) -> None:
        """Scan one log. Raises :class:`~.logparse.LogError` when it cannot be opened.
        ``progress(bytes, lines)``: called after each block with what this file has given
        so far (a caller's progress line; it rate-limits itself).

        ``deadline`` (a ``time.monotonic()`` value): stop reading there, keep what was
        read and record it as a problem (the Epilog's bound). It is checked between
        blocks, after the first. ``owner_uid``: see :class:`~.logparse.LogReader`.
        """
        reader = LogReader(path, owner_uid=owner_uid, deadline=deadline)
        name = label or str(path)
        self.files.append(name)
        fast = self._literals is not None
        line = self._line
        self._tail = None
        self._cursor_block = None
        self._echo_next = False
        stopped = False
        lineno = 0
        blocks = reader.blocks()
        for before, count, block in blocks:
            if deadline is not None and before and time.monotonic() > deadline:
                stopped = True
                break
            if count == 1:
                line(name, before + 1, block)
            elif fast:
                self._block(name, before, block)
                self._tail = self._last_prefixed(block) or self._tail
            else:
                for n, raw in enumerate(block.split(b"\n"), before + 1):
                    line(name, n, raw)
            lineno = before + count
            if progress is not None:
                progress(reader.bytes_read, lineno)
        self.lines += lineno
        self.bytes += reader.bytes_read
        self.long_lines += reader.truncated_lines
        if stopped:
            blocks.close()
            self.problems.append(ReadProblem(name, lineno, "time limit reached"))
        elif reader.problem is not None:
            self.problems.append(ReadProblem(name, reader.problem.line, reader.problem.cause))

    # -------------------------------------------------------------- the fast path
    def _block(self, name: str, before: int, block: bytes) -> None:
        """A block of several lines: hosts from its NCCL prefixes, then only the lines
        that hold a literal of the catalog."""
        if _SEP in block:
            self._register_hosts(block)
        starts: set[int] = set()
        echoes: set[int] = set()  # lines that are the message after a "Last error:"
        if self._echo_next:
            self._echo_next = False
            echoes.add(0)
        find = block.find
        rfind = block.rfind
        p = find(_LAST)
        while p >= 0:
            starts.add(rfind(b"\n", 0, p) + 1)
            e = find(b"\n", p)
            if not block[p + len(_LAST) : e if e >= 0 else len(block)].strip():
                if e < 0:  # the message is the next block's first line
                    self._echo_next = True
                    break
                echoes.add(e + 1)
            if e < 0:
                break
            p = find(_LAST, e + 1)
        for lit in self._literals or ():
            p = find(lit)
            while p >= 0:
                starts.add(rfind(b"\n", 0, p) + 1)
                e = find(b"\n", p + len(lit))
                if e < 0:
                    break
                p = find(lit, e + 1)
        if not starts and not echoes:
            return
        n = before + 1
        at = 0
        for s in sorted(starts | echoes):
            n += block.count(b"\n", at, s)
            at = s
            e = find(b"\n", s)
            self._line(name, n, block[s:e] if e >= 0 else block[s:], block, s, s in echoes)

    def _first_prefix(self, block: bytes, start: int, end: int) -> tuple[str, int] | None:
        """(host, pid) of the line ``block[start:end]`` if it carries NCCL's prefix (its
        first " NCCL " decides, as in :meth:`_line`)."""
        i = block.find(_SEP, start, end)
        if i <= start:
            return None
        info = self._prefix(block[start : min(i + 11, end)])
        return (info[0], info[1]) if info is not None else None

    def _last_prefixed(self, block: bytes) -> tuple[str, int] | None:
        """(host, pid) of the last NCCL-prefixed line of ``block``, or None."""
        p = len(block)
        while p > 0:
            i = block.rfind(_SEP, 0, p)
            if i < 0:
                return None
            start = block.rfind(b"\n", 0, i) + 1
            end = block.find(b"\n", i)
            got = self._first_prefix(block, start, len(block) if end < 0 else end)
            if got is not None:
                return got
            p = start
        return None

    def _host_above(self, block: bytes, at: int) -> str | None:
        """The host of the nearest NCCL-prefixed line above offset ``at`` of ``block``
        (else of the blocks before it): read forward from where the last call stopped,
        so that a block's lines are read once however many need it."""
        if self._cursor_block is not block:
            self._cursor_block, self._cursor_pos, self._cursor_host = block, 0, self._tail
        p = self._cursor_pos
        host = self._cursor_host
        while p < at:
            i = block.find(_SEP, p, at)
            if i < 0:
                break
            start = block.rfind(b"\n", 0, i) + 1
            end = block.find(b"\n", i)
            end = len(block) if end < 0 else end
            if start >= p:  # the line's first " NCCL "
                host = self._first_prefix(block, start, end) or host
            p = end + 1
        self._cursor_pos = max(p, self._cursor_pos)
        self._cursor_host = host
        return host[0] if host is not None else None

    def _register_hosts(self, block: bytes) -> None:
        """Register the host (and launcher tag) of every distinct NCCL prefix in
        ``block``, in the order of the lines that first carry each, as the per-line
        path would."""
        first_of = self._first_of
        settled = self._settled
        found: dict[bytes, tuple[int, bytes]] = {}
        rev_block = bytearray(block)
        rev_block.reverse()
        for rev in set(_REV_KEY.findall(rev_block)):
            if len(rev) > MAX_KEY:
                continue  # no NCCL prefix is that long: neither cached nor settled
            head = first_of.get(rev)
            if head is None:
                before_last = rev[::-1]
                # the prefix is the text before the *first* " NCCL " of the line
                head = before_last[: (before_last + _SEP).find(_SEP)]
                if len(first_of) > _CACHE:
                    first_of.clear()
                first_of[rev] = head
                self._spend(len(rev) + len(head))
            if head in settled or head in found:
                continue
            if _PREFIX.match(head + b" NCCL INFO") is None:
                settled.add(head)  # no NCCL prefix, whatever follows
                self._spend(len(head))
                continue
            if len(found) >= _MANY_NEW:  # 2.26's timestamps: a new prefix every second
                self._register_each_line(block)
                return
            hit = self._first_valid(block, head)
            if hit is not None:
                found[head] = hit
        if len(settled) > _CACHE:
            settled.clear()
        for _, key in sorted(found.values()):
            self._prefix(key)
        settled.update(found)

    def _register_each_line(self, block: bytes) -> None:
        """The per-line registration, for a block with many new prefixes: each line's
        prefix up to its first " NCCL ", in order."""
        find = block.find
        prefix = self._prefix
        p = find(_SEP)
        while p >= 0:
            start = block.rfind(b"\n", 0, p) + 1
            end = find(b"\n", p)
            if p > start:
                key = block[start : p + 11]
                nl = key.find(b"\n")
                prefix(key[:nl] if nl >= 0 else key)
            if end < 0:
                break
            p = find(_SEP, end + 1)

    def _first_valid(self, block: bytes, head: bytes) -> tuple[int, bytes] | None:
        """(offset, prefix key) of the first line of ``block`` that starts with ``head``
        and NCCL's prefix (a level NCCL prints), or None."""
        lead = head + _SEP
        nl_lead = b"\n" + lead
        size = len(head) + 11
        p = 0 if block.startswith(lead) else block.find(nl_lead) + 1 or -1
        while p >= 0:
            key = block[p : p + size]
            nl = key.find(b"\n")
            if nl >= 0:
                key = key[:nl]
            if _PREFIX.match(key) is not None:
                return p, key
            p = block.find(nl_lead, p) + 1 or -1
        return None

    # -------------------------------------------------------------- one line
    def _prefix(self, key: bytes) -> tuple[str, int, int | None] | None:
        """Host, pid and launcher tag of an NCCL prefix (cached); registers the host."""
        prefixes = self._prefixes
        if key in prefixes:
            return prefixes[key]
        info = None
        m = _PREFIX.match(key) if len(key) <= MAX_KEY else None
        if m is not None:
            info = (m.group("host").decode("ascii", "replace"), int(m.group("pid")), _tag_of(m))
            if info[0] in self._hosts or len(self._hosts) < self._max_keys:
                self._hosts.add(info[0])  # seen (a host that is not the job's is news too)
            if (info[2] is not None and len(self._tag_host) < MAX_RANKS
                    and self._attributed(info[0])):
                self._tag_host.setdefault(info[2], info[0])
        if len(key) > MAX_KEY:
            return info
        if len(prefixes) > _CACHE:
            prefixes.clear()
        prefixes[key] = info
        self._spend(len(key))
        return info

    def _spend(self, n: int) -> None:
        """Count ``n`` more key bytes in the prefix caches; past :data:`_CACHE_BYTES` they
        are all emptied (each is only a cache: a prefix is parsed again when next met).
        50,000 entries of 512-byte keys held about 110 MB (issue 47's review)."""
        self._cached += n
        if self._cached > _CACHE_BYTES:
            self._prefixes.clear()
            self._first_of.clear()
            self._settled.clear()
            self._cached = 0

    def _rank_key(self, rank: int) -> str | None:
        """The key of a rank whose host is not known (yet), shared by the signatures;
        None past :data:`MAX_RANK_KEYS` ranks (not attributed)."""
        key = self._rank_key_of.get(rank)
        if key is None and len(self._rank_key_of) < MAX_RANK_KEYS:
            key = self._rank_key_of[rank] = f"#rank{rank}"
        return key

    def _attributed(self, key: str | None) -> bool:
        """Whether matches of this host are attributed: one of the job's nodes when they
        are known, and within the bound on distinct host names."""
        if key is None or key in self._keys:
            return True
        if self._nodes is not None and short(key) not in self._nodes:
            return False
        if len(self._keys) >= self._max_keys:
            return False
        self._keys.add(key)
        return True

    def _line(
        self,
        name: str,
        lineno: int,
        raw: bytes,
        block: bytes | None = None,
        at: int = 0,
        echo: bool | None = None,
    ) -> None:
        """One line. ``block`` and ``at``: the block it is in and where (the fast path,
        which reads only some lines): for the host of a line that lost NCCL's prefix,
        the nearest prefixed line above it. ``echo``: whether the line is the message
        after a "Last error:" line; None: every line is read, and this one is if the
        line before it ended so."""
        if echo is None:
            echo = self._echo_next
            self._echo_next = False
            if _LAST in raw:
                self._echo_next = not raw[raw.find(_LAST) + len(_LAST) :].strip()
        i = raw.find(_SEP)
        info = self._prefix(raw[: i + 11]) if i > 0 else None
        nccl = info is not None
        if info is not None:
            host: str | None
            pid: int | None
            host, pid, tr = info
            if block is None:  # every line is read: the last prefixed one is this
                self._tail = (host, pid)
            lv = raw[i + 6 : i + 10]
            level: str | None = "TRACE" if lv == b"TRAC" else lv.decode("ascii", "replace")
            text = raw[i + (12 if lv == b"TRAC" else 11) :].rstrip(b"\r")
            if _RANKS in text:
                im = _INIT.search(text)
                size = int(im.group("nranks")) if im is not None else 0
                self._nranks = max(self._nranks, size)
                # a process's rank in its largest communicator (the job's), not in a
                # smaller group it joins later (rank 0 of 2 in a new_group)
                if im is not None and (size >= self._pid_size.get((host, pid), 0)) and (
                        (host, pid) in self._pid_rank or (
                        len(self._pid_rank) < MAX_PIDS and self._attributed(host))):
                    self._pid_rank[(host, pid)] = int(im.group("rank"))
                    self._pid_size[(host, pid)] = size
        own = False  # NCCL's own line without its prefix: the host above is its printer's
        if info is None:
            host, pid, level = None, None, None
            bare = _BARE.match(raw) if b"NCCL " in raw else None
            if bare is not None:
                # NCCL's line without its "host:pid:tid": the launcher tag names the host,
                # else the nearest prefixed line above it does
                nccl = own = True
                level = bare.group("level").decode("ascii")
                text = bare.group("msg").rstrip(b"\r")
                tr = _tag_of(bare)
            else:
                text = strip_tag(raw) if raw[:1] in b" 0123456789[" else raw
                tr = launcher_rank(raw) if text is not raw else None
                own = _BANNER.fullmatch(text) is not None
                if echo:  # NCCL's WARN message, repeated by PyTorch
                    nccl, level = True, "WARN"
        # the views of the line that signatures are tried on: its message, and the
        # message after "Last error:" on the same line (a flattened paste)
        views = [(text, nccl, level)]
        if not nccl and _LAST in text:
            after = text[text.find(_LAST) + len(_LAST) :].strip()
            if after:
                views.append((after, True, "WARN"))
        combined = self._prefilter
        if combined is not None and not any(combined.search(v[0]) for v in views):
            return
        states = self._states
        placed = info is not None or tr is not None  # else: the nearest host above, once
        for sig in self._sigs:
            hit = None
            for vtext, vnccl, vlevel in views:
                if vnccl or sig.scope != "nccl":
                    hit = sig.match(vtext, vlevel)
                    if hit is not None:
                        break
            if hit is None:
                continue
            if not placed:
                # a line without NCCL's prefix or a launcher tag: NCCL's own (a banner
                # printed with printf, a paste that lost the prefix) is the nearest
                # NCCL-prefixed line's above it in this file; anything else (a
                # traceback, PyTorch's repeat of NCCL's error) belongs to no host:
                # printed by any rank, it would be pinned on whichever printed last
                placed = True
                if own and block is not None:
                    host = self._host_above(block, at)
                elif own and self._tail is not None:
                    host = self._tail[0]
            st = states[sig.id]
            st.count += 1
            rec = RawMatch(name, lineno, _clip(raw), host, pid, tr)
            if len(st.samples) < MAX_SAMPLES:
                st.samples.append(rec)
            if host is not None or tr is None:
                key, kept = host, self._attributed(host)
            else:  # a rank's own bound, so that ranks never crowd out the hosts
                key = self._rank_key(tr)
                kept = key is not None
            if not kept:
                self.cut["hosts"] += 1
                continue
            if key not in st.printers:
                st.printers[key] = rec if len(st.printers) < MAX_LINES_KEPT else None
            pat, pm = hit
            value = pat.render(pm)
            if value is not None:
                by_key = st.values.get(value)
                if by_key is None:
                    if len(st.values) >= MAX_VALUES:
                        self.cut["values"] += 1
                        continue
                    by_key = st.values[value] = {}
                if key not in by_key:
                    by_key[key] = rec if len(by_key) < MAX_LINES_KEPT else None
                if pat.weak:
                    st.weak.add(value)

    def evidence(self) -> LogEvidence:
        problems = [str(p) for p in self.problems]
        if self.long_lines:
            problems.append(f"{self.long_lines} line(s) longer than 64 KiB were cut")
        if self.cut["hosts"]:
            whose = ("not of the job's nodes, or past " if self._nodes is not None else
                     "past the first ")
            problems.append(f"cut: {self.cut['hosts']} matching line(s) of hosts {whose}"
                            f"{self._max_keys} host names were counted, not attributed")
        if self.cut["values"]:
            problems.append(f"cut: {self.cut['values']} matching line(s) with a value past "
                            f"the first {MAX_VALUES} of their signature were not kept")
        return LogEvidence(
            files=list(self.files),
            lines=self.lines,
            bytes=self.bytes,
            hosts=sorted({short(h) for h in self._hosts}),
            problems=problems,
            states=self._states,
            resolve=self._resolve,
            cut=self.cut["hosts"] + self.cut["values"],
            nranks=self._nranks,
            ranks_seen=len({r for k, r in self._pid_rank.items()
                            if self._pid_size[k] == self._nranks}),
        )

    def _host_of(self, key: str | None) -> str | None:
        if key is None:
            return None
        if key.startswith("#rank"):
            h = self._tag_host.get(int(key[5:]))
            return short(h) if h else None
        return short(key)

    def _resolve(self, r: RawMatch) -> Evidence:
        host = r.host
        if host is None and r.tag_rank is not None:
            host = self._tag_host.get(r.tag_rank)
        rank = r.tag_rank
        if rank is None and r.host is not None and r.pid is not None:
            rank = self._pid_rank.get((r.host, r.pid))
        return Evidence(r.file, r.line, r.text, short(host) if host else None, r.pid, rank)


def _tag_of(m: re.Match[bytes]) -> int | None:
    for g in ("task", "rrank", "mrank"):
        v = m.group(g)
        if v is not None:
            return int(v)
    return None


def _clip(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace").rstrip("\r\n")
    text = "".join(c if c.isprintable() or c == "\t" else "?" for c in text)
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 3] + "..."
