"""From log lines to ranked diagnoses, and the inventory's view of the same nodes.

Data flows one way, each step a plain value:

    log files ──Scanner.feed──▶ LogEvidence ──diagnose()──▶ [Diagnosis]
    job nodes + start ──Inventory.fingerprint_at──▶ fingerprints ──policy──▶ Verdict
    [Diagnosis] + Verdict ──correlate()──▶ Report (to_dict / text)

The scanner keeps only bounded state: for each signature a count, the first
:data:`MAX_SAMPLES` evidence lines, the hosts that printed it and, for
``differs`` signatures, one evidence line per (value, host). Memory grows with the
number of hosts, never with the log's size.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ncclguard.hostlist import compress
from ncclguard.timeparse import iso_utc

from .catalog import Catalog, Signature
from .logparse import _PREFIX, LogReader, ReadProblem, launcher_rank, strip_tag

MAX_SAMPLES = 5  # evidence lines kept per signature
MAX_TEXT = 400  # characters kept of one evidence line
_VERSION = re.compile(r"\d+\.\d+\.\d+")
NO_SIGNATURE = "no communication-stack signature found"
_INIT = re.compile(rb"\bcomm 0x[0-9a-f]+ rank (?P<rank>\d+) nr?anks (?P<nranks>\d+)", re.I)


def short(host: str) -> str:
    """The short host name (the inventory's key): ``n3.cluster`` → ``n3``."""
    return host.split(".", 1)[0]


def version_of_code(code: int) -> str:
    """NCCL_VERSION_CODE → "X.Y.Z" (new scheme from 2.9: X*10000+Y*100+Z)."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


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
class _Raw:
    """What the scanner saw of one match, before hosts and ranks are resolved."""

    file: str
    line: int
    text: str
    host: str | None
    pid: int | None
    tag_rank: int | None


@dataclass
class _SigState:
    count: int = 0
    samples: list[_Raw] = field(default_factory=list)
    values: dict[str, dict[str | None, _Raw]] = field(default_factory=dict)
    printers: dict[str | None, _Raw] = field(default_factory=dict)  # host → first line
    weak: set[str] = field(default_factory=set)  # values from weak patterns


@dataclass
class LogEvidence:
    """Everything the scanner kept, resolved to hosts and ranks."""

    files: list[str]
    lines: int
    bytes: int
    hosts: list[str]  # short names of every host that printed an NCCL-prefixed line
    problems: list[str]
    states: dict[str, _SigState]
    resolve: Callable[[_Raw], Evidence]


_REV_KEY = re.compile(rb" LCCN ([^\n]*)")  # on a reversed block: a line's text before " NCCL "
_SEP = b" NCCL "
_RANKS = b"anks "  # in NCCL's "comm 0x… rank R nranks N" / "nRanks N" lines
_CACHE = 50_000  # entries kept in each prefix cache before it is emptied
_MANY_NEW = 64  # new prefixes in one block past which its lines are registered one by one


class Scanner:
    """Feed it log files, one after the other; it keeps bounded state.

    A log is read in blocks of whole lines (about 1 MiB). When every catalog pattern
    has a required literal (:meth:`Catalog.literals`), a block is searched for those
    literals with ``bytes.find`` and only the lines that hold one (and NCCL's ``comm …
    nranks`` lines, for the ranks) get per-line work; the hosts are read from the
    distinct NCCL prefixes of the block, found by one regex over it. Otherwise every
    line gets the per-line work (the slow path, never a missed line).
    """

    def __init__(self, catalog: Catalog, prefilter: bool = True) -> None:
        """``prefilter=False``: every line gets the per-line work (for comparison)."""
        self.catalog = catalog
        self._sigs: list[Signature] = list(catalog)
        self._combined = catalog.combined()
        self._gate = catalog.gate()
        self._prefilter = self._gate or self._combined  # one regex per line before the rest
        lits = catalog.literals() if prefilter else None
        self._literals: tuple[bytes, ...] | None = (
            None if lits is None else tuple(dict.fromkeys((*lits, _RANKS)))
        )
        self._states: dict[str, _SigState] = {s.id: _SigState() for s in self._sigs}
        self._hosts: set[str] = set()
        self._tag_host: dict[int, str] = {}  # launcher rank → host
        self._pid_rank: dict[tuple[str, int], int] = {}  # (host, pid) → NCCL rank
        # NCCL's prefix repeats for every line of a process: parse each distinct one once.
        # Keyed by the line up to 5 bytes past " NCCL " (what the prefix regex reads).
        self._prefixes: dict[bytes, tuple[str, int, int | None] | None] = {}
        self._first_of: dict[bytes, bytes] = {}  # reversed text before the last " NCCL "
        self._settled: set[bytes] = set()  # prefixes whose host is registered (or none)
        self.files: list[str] = []
        self.lines = 0
        self.bytes = 0
        self.problems: list[ReadProblem] = []
        self.long_lines = 0

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
    ) -> None:
        """Scan one log. Raises :class:`~.logparse.LogError` when it cannot be opened.

        ``deadline`` (a ``time.monotonic()`` value): stop reading there, keep what was
        read and record it as a problem (the Epilog's bound). It is checked between
        blocks, after the first. ``owner_uid``: see :class:`~.logparse.LogReader`.
        """
        reader = LogReader(path, owner_uid=owner_uid, deadline=deadline)
        name = label or str(path)
        self.files.append(name)
        fast = self._literals is not None
        line = self._line
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
            else:
                for n, raw in enumerate(block.split(b"\n"), before + 1):
                    line(name, n, raw)
            lineno = before + count
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
        find = block.find
        rfind = block.rfind
        for lit in self._literals or ():
            p = find(lit)
            while p >= 0:
                starts.add(rfind(b"\n", 0, p) + 1)
                e = find(b"\n", p + len(lit))
                if e < 0:
                    break
                p = find(lit, e + 1)
        if not starts:
            return
        n = before + 1
        at = 0
        for s in sorted(starts):
            n += block.count(b"\n", at, s)
            at = s
            e = find(b"\n", s)
            self._line(name, n, block[s:e] if e >= 0 else block[s:])

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
            head = first_of.get(rev)
            if head is None:
                before_last = rev[::-1]
                # the prefix is the text before the *first* " NCCL " of the line
                head = before_last[: (before_last + _SEP).find(_SEP)]
                if len(first_of) > _CACHE:
                    first_of.clear()
                first_of[rev] = head
            if head in settled or head in found:
                continue
            if _PREFIX.match(head + b" NCCL INFO") is None:
                settled.add(head)  # no NCCL prefix, whatever follows
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
        m = _PREFIX.match(key)
        if m is not None:
            info = (m.group("host").decode("ascii", "replace"), int(m.group("pid")), _tag_of(m))
            self._hosts.add(info[0])
            if info[2] is not None:
                self._tag_host.setdefault(info[2], info[0])
        if len(prefixes) > _CACHE:
            prefixes.clear()
        prefixes[key] = info
        return info

    def _line(self, name: str, lineno: int, raw: bytes) -> None:
        i = raw.find(_SEP)
        info = self._prefix(raw[: i + 11]) if i > 0 else None
        if info is not None:
            host, pid, tr = info
            lv = raw[i + 6 : i + 10]
            level = "TRACE" if lv == b"TRAC" else lv.decode("ascii", "replace")
            text = raw[i + (12 if lv == b"TRAC" else 11) :].rstrip(b"\r")
            if _RANKS in text:
                im = _INIT.search(text)
                if im is not None:
                    self._pid_rank[(host, pid)] = int(im.group("rank"))
        else:
            host, pid, level = None, None, None
            text = strip_tag(raw) if raw[:1] in b" 0123456789[" else raw
            tr = launcher_rank(raw) if text is not raw else None
        combined = self._prefilter
        if combined is not None and combined.search(text) is None:
            return
        states = self._states
        for sig in self._sigs:
            if info is None and sig.scope == "nccl":
                continue
            if sig.level is not None and level != sig.level:
                continue
            hit = sig.match(text)
            if hit is None:
                continue
            st = states[sig.id]
            st.count += 1
            rec = _Raw(name, lineno, _clip(raw), host, pid, tr)
            if len(st.samples) < MAX_SAMPLES:
                st.samples.append(rec)
            key = host if host is not None else (f"#rank{tr}" if tr is not None else None)
            st.printers.setdefault(key, rec)
            pat, pm = hit
            value = pat.render(pm)
            if value is not None:
                st.values.setdefault(value, {}).setdefault(key, rec)
                if pat.weak:
                    st.weak.add(value)

    def evidence(self) -> LogEvidence:
        problems = [str(p) for p in self.problems]
        if self.long_lines:
            problems.append(f"{self.long_lines} line(s) longer than 64 KiB were cut")
        return LogEvidence(
            files=list(self.files),
            lines=self.lines,
            bytes=self.bytes,
            hosts=sorted({short(h) for h in self._hosts}),
            problems=problems,
            states=self._states,
            resolve=self._resolve,
        )

    def _host_of(self, key: str | None) -> str | None:
        if key is None:
            return None
        if key.startswith("#rank"):
            h = self._tag_host.get(int(key[5:]))
            return short(h) if h else None
        return short(key)

    def _resolve(self, r: _Raw) -> Evidence:
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


# ----------------------------------------------------------------------------- diagnoses


@dataclass
class Diagnosis:
    signature: Signature
    summary: str
    evidence: list[Evidence]
    count: int
    hosts: list[str]  # hosts that printed it
    odd_nodes: list[str]
    values: dict[str, list[str]] = field(default_factory=dict)  # differs: value → hosts
    score: int = 0
    inventory: str | None = None  # what the inventory says about it
    all_hosts: list[str] = field(default_factory=list)  # every host seen in the logs
    confirmed: bool | None = None  # by a policy finding (None: no inventory / no rules)

    @property
    def confirm_command(self) -> str:
        odd = self.odd_nodes[0] if self.odd_nodes else None
        others = [h for h in (self.all_hosts or self.hosts) if h not in self.odd_nodes]
        if odd and others:
            return f"ncclguard diff {odd} {others[0]}"
        if odd:
            return f"ncclguard show {odd}"
        if len(self.hosts) >= 2:
            return f"ncclguard diff {self.hosts[0]} {self.hosts[1]}"
        if self.hosts:
            return f"ncclguard show {self.hosts[0]}"
        return "ncclguard classes"

    def to_dict(self) -> dict[str, Any]:
        s = self.signature
        return {
            "id": s.id,
            "title": s.title,
            "summary": self.summary,
            "score": self.score,
            "count": self.count,
            "hosts": compress(self.hosts) if self.hosts else "",
            "odd_nodes": compress(self.odd_nodes) if self.odd_nodes else "",
            "values": {v: compress(h) if h else "" for v, h in self.values.items()},
            "evidence": [e.to_dict() for e in self.evidence],
            "meaning": s.meaning,
            "cause": s.cause,
            "fix": s.fix,
            "confirm_command": self.confirm_command,
            "confirm_fields": list(s.confirm),
            "rules": list(s.rules),
            "inventory": self.inventory,
            "confirmed": self.confirmed,
        }


def diagnose(ev: LogEvidence, catalog: Catalog) -> list[Diagnosis]:
    """The signatures that fired, most likely cause first."""
    out: list[Diagnosis] = []
    for sig in catalog:
        st = ev.states.get(sig.id)
        if st is None or st.count == 0:
            continue
        d = _differs(sig, st, ev) if sig.kind == "differs" else _line(sig, st, ev)
        if d is not None:
            out.append(d)
    for d in out:
        d.all_hosts = list(ev.hosts)
    _borrow_odd_nodes(out)
    out.sort(
        key=lambda d: (
            -d.score,
            d.evidence[0].file if d.evidence else "",
            d.evidence[0].line if d.evidence else 0,
        )
    )
    return out


def _borrow_odd_nodes(diags: list[Diagnosis]) -> None:
    """A line signature that cannot name the odd nodes (``odd = "none"``) takes them from
    another diagnosis on the same policy rules that can (the banners, the networks)."""
    for d in diags:
        if d.odd_nodes or not d.signature.rules:
            continue
        for other in sorted(diags, key=lambda o: -o.score):
            if other is d or not other.odd_nodes:
                continue
            if set(other.signature.rules) & set(d.signature.rules):
                d.odd_nodes = list(other.odd_nodes)
                d.summary += f" Odd nodes from {other.signature.id}: {compress(d.odd_nodes)}."
                break


def _resolved_hosts(
    keys: Iterable[str | None], ev: LogEvidence, resolve_key: Callable[[str | None], str | None]
) -> list[str]:
    return sorted({h for k in keys if (h := resolve_key(k)) is not None})


def _key_resolver(ev: LogEvidence) -> Callable[[str | None], str | None]:
    def res(key: str | None) -> str | None:
        if key is None:
            return None
        if key.startswith("#rank"):
            e = ev.resolve(_Raw("", 0, "", None, None, int(key[5:])))
            return e.host
        return short(key)

    return res


def _line(sig: Signature, st: _SigState, ev: LogEvidence) -> Diagnosis:
    res = _key_resolver(ev)
    printers = _resolved_hosts(st.printers, ev, res)
    evidence = [ev.resolve(r) for r in st.samples]
    odd: list[str] = []
    score = sig.weight
    where = f"{st.count} line(s)"
    if printers:
        where += f" from {compress(printers)}"
    summary = f"{sig.title}: {where}."
    others = [h for h in ev.hosts if h not in printers]
    if sig.odd == "printers" and printers:
        if others:
            odd = printers
            summary += f" The other {len(others)} host(s) ({compress(others)}) did not print it."
            score += 5
        elif len(ev.hosts) > 1:
            summary += f" All {len(ev.hosts)} hosts printed it."
            score -= 10
    detail = _line_detail(sig, st)
    if detail:
        summary += " " + detail
    return Diagnosis(sig, summary, evidence, st.count, printers, odd, score=score)


def _line_detail(sig: Signature, st: _SigState) -> str:
    """Numbers that make a line signature readable (version codes, socket types)."""
    if not st.samples:
        return ""
    for p in sig.patterns:
        m = p.regex.search(st.samples[0].text.encode("utf-8", "replace"))
        if m is None:
            continue
        g = {k: v.decode() for k, v in m.groupdict().items() if v is not None}
        if "code_a" in g and "code_b" in g:
            return (
                f"rank {g['rank_a']} runs NCCL {version_of_code(int(g['code_a']))}, "
                f"rank {g['rank_b']} runs {version_of_code(int(g['code_b']))}."
            )
        if "local" in g and "remote" in g:
            return (
                f"this rank runs NCCL {version_of_code(int(g['local']))}, "
                f"peer {g['peer']} runs {version_of_code(int(g['remote']))}."
            )
        if "own" in g and "got" in g:
            names = {"3": "NET/Socket", "4": "NET/IB"}
            return (
                f"a rank on {names.get(g['own'], g['own'])} was contacted by a peer on "
                f"{names.get(g['got'], g['got'])}."
            )
        break
    return ""


def _differs(sig: Signature, st: _SigState, ev: LogEvidence) -> Diagnosis | None:
    res = _key_resolver(ev)
    per_host: dict[str, set[str]] = {}
    first: dict[tuple[str, str], _Raw] = {}
    for value, by_key in st.values.items():
        for key, rec in by_key.items():
            h = res(key)
            if h is None:
                continue
            per_host.setdefault(h, set()).add(value)
            first.setdefault((h, value), rec)
    per_host = _drop_weak(per_host, st.weak)
    host_value = {h: " + ".join(sorted(vs)) for h, vs in per_host.items()}
    groups: dict[str, list[str]] = {}
    for h, v in sorted(host_value.items()):
        groups.setdefault(v, []).append(h)
    if len(groups) < 2:
        return None
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    major_v, major_h = ordered[0]
    tie = len(ordered[1][1]) == len(major_h)
    parts = []
    odd: list[str] = []
    for v, hs in ordered[1:] if not tie else ordered:
        parts.append(f"{compress(hs)} printed {v}")
        if not tie:
            odd.extend(hs)
    if tie:
        summary = f"{sig.title}: " + "; ".join(parts) + " (no majority)."
    else:
        summary = (
            f"{sig.title}: "
            + "; ".join(parts)
            + f"; the other {len(major_h)} host(s) printed {major_v}."
        )
    evidence: list[Evidence] = []
    for v, hs in ordered:
        for h in hs[:2]:
            found = first.get((h, v)) or next(
                (first[(h, x)] for x in per_host[h] if (h, x) in first), None
            )
            if found is not None:
                evidence.append(ev.resolve(found))
    evidence.sort(key=lambda e: (e.file, e.line))
    hosts = sorted(host_value)
    values = {v: hs for v, hs in ordered}
    return Diagnosis(
        sig, summary, evidence[: 2 * MAX_SAMPLES], st.count, hosts, sorted(odd), values, sig.weight
    )


def host_values(ev: LogEvidence, sig_id: str) -> dict[str, set[str]]:
    """For a ``differs`` signature: host → the values it printed (even when all agree)."""
    st = ev.states.get(sig_id)
    if st is None:
        return {}
    res = _key_resolver(ev)
    out: dict[str, set[str]] = {}
    for value, by_key in st.values.items():
        for key in by_key:
            h = res(key)
            if h is not None:
                out.setdefault(h, set()).add(value)
    return _drop_weak(out, st.weak)


def _drop_weak(per_host: dict[str, set[str]], weak: set[str]) -> dict[str, set[str]]:
    """A host's weak values go when it also printed a strong one."""
    if not weak:
        return per_host
    out = {}
    for h, vs in per_host.items():
        strong = vs - weak
        out[h] = strong or vs
    return out


# ----------------------------------------------------------------------------- inventory


@dataclass
class InventoryView:
    """The inventory's view of the job's nodes at the job's start, and the policy's verdict."""

    when: float
    nodes: list[str]
    fingerprints: dict[str, dict | None]
    verdict: Any  # ncclguard.policy.Verdict
    error: str | None = None

    @property
    def when_text(self) -> str:
        return iso_utc(self.when)


def inventory_view(
    nodes: Sequence[str],
    when: float,
    inventory: Any,
    policy_config: Any,
    evaluate: Callable[..., Any],
    partition: str | None = None,
) -> InventoryView:
    """Fingerprints as of ``when`` (the history table) and the policy's verdict on them."""
    fps: dict[str, dict | None] = {h: inventory.fingerprint_at(h, when) for h in nodes}
    verdict = evaluate(fps, policy_config, stale=(), partition=partition)
    return InventoryView(when, list(nodes), fps, verdict)


def findings_of(verdict: Any) -> list[dict[str, Any]]:
    """The verdict's findings as plain dicts (``rule``, ``message``, ``nodes``...)."""
    if verdict is None:
        return []
    data = verdict.to_dict() if hasattr(verdict, "to_dict") else dict(verdict)
    out = []
    for f in data.get("findings") or []:
        if not isinstance(f, Mapping):
            f = f.to_dict() if hasattr(f, "to_dict") else vars(f)
        out.append(dict(f))
    return out


def _finding_text(f: Mapping[str, Any]) -> str:
    text = str(f.get("message") or f.get("rule") or "?")
    groups = f.get("groups") or []
    parts = [f"{g.get('value')}: {g.get('nodes')}" for g in groups if isinstance(g, Mapping)]
    return f"{text} [{' | '.join(parts)}]" if parts else text


def correlate(diagnoses: list[Diagnosis], ev: LogEvidence, view: InventoryView) -> list[str]:
    """Mark each diagnosis confirmed or not by the policy; return the disagreements."""
    findings = findings_of(view.verdict)
    known = [h for h in view.nodes if view.fingerprints.get(h) is not None]
    for d in diagnoses:
        if not d.signature.rules:
            continue
        hits = [f for f in findings if f.get("rule") in d.signature.rules]
        if hits:
            d.confirmed = True
            d.inventory = "; ".join(f"{f.get('rule')}: {_finding_text(f)}" for f in hits)
            d.score += 50
        elif known:
            d.confirmed = False
            d.inventory = (
                f"the inventory as of {view.when_text} shows no {'/'.join(d.signature.rules)} "
                f"difference between {compress(known)}"
            )
    return disagreements(ev, view)


def disagreements(ev: LogEvidence, view: InventoryView) -> list[str]:
    """Where the log says one thing and the inventory another, host by host."""
    from ncclguard.fingerprint.fields import ABSENT, nccl_version, net_plugin

    out: list[str] = []
    when = view.when_text
    for h in sorted(set(ev.hosts) - set(view.nodes)):
        if view.nodes:
            out.append(f"{h} printed NCCL lines but is not one of the job's nodes")
    for h in view.nodes:
        if view.fingerprints.get(h) is None:
            out.append(f"{h}: no fingerprint in the inventory as of {when} (unknown node)")
    versions = {
        h: {m.group(0) for v in vs if (m := _VERSION.search(v))}
        for h, vs in host_values(ev, "nccl-version-differs").items()
    }
    for h, vs in sorted(versions.items()):
        fp = view.fingerprints.get(h)
        if not fp:
            continue
        inv = nccl_version(fp)
        if inv is None:
            continue
        installed = {lib.get("version") for lib in fp.get("libnccl") or () if lib.get("version")}
        for v in sorted(vs):
            if v == inv:
                continue
            if v in installed:
                out.append(
                    f"{h}: the job loaded NCCL {v}, which is installed but not the default "
                    f"libnccl ({inv}) as of {when}: LD_LIBRARY_PATH or a module chose it"
                )
            else:
                have = "no libnccl" if inv == ABSENT else f"NCCL {inv}"
                out.append(
                    f"{h}: the job loaded NCCL {v}, but the inventory as of {when} has {have} "
                    f"there: a container, a conda env or a pip wheel brought its own NCCL"
                )
    plugins = host_values(ev, "net-plugin-differs")
    for h, vs in sorted(plugins.items()):
        fp = view.fingerprints.get(h)
        if not fp:
            continue
        state = net_plugin(fp)
        if state is None:
            continue
        name, abi = state
        loaded = sorted(v for v in vs if v.startswith("loaded "))
        if loaded and (name == ABSENT or abi == 0):
            out.append(
                f"{h}: the job {loaded[0]}, but the inventory as of {when} has no usable "
                f"default net plugin there: the job's environment brought one"
            )
        elif not loaded and name != ABSENT and abi > 0:
            out.append(
                f"{h}: the job used no net plugin ({sorted(vs)[0]}), but the inventory as of "
                f"{when} has {name} (v{abi}) as the default: the job's environment hid it"
            )
        elif loaded:
            m = re.match(r"loaded (.+) \(v(\d+)\)$", loaded[0])
            if m and (m.group(1) != name or int(m.group(2)) != abi):
                out.append(
                    f"{h}: the job {loaded[0]}, but the inventory as of {when} has "
                    f"{name} (v{abi}): the job's environment chose another plugin"
                )
    return out


# ----------------------------------------------------------------------------- report


@dataclass
class Report:
    evidence: LogEvidence
    diagnoses: list[Diagnosis]
    view: InventoryView | None = None
    inventory_note: str | None = None  # why there is no inventory view
    disagreements: list[str] = field(default_factory=list)
    job: dict[str, Any] | None = None

    @property
    def found(self) -> bool:
        return bool(self.diagnoses)

    def to_dict(self) -> dict[str, Any]:
        ev = self.evidence
        inv: dict[str, Any] | None = None
        if self.view is not None:
            v = self.view
            verdict = v.verdict.to_dict() if hasattr(v.verdict, "to_dict") else v.verdict
            inv = {
                "as_of": v.when_text,
                "nodes": compress(v.nodes) if v.nodes else "",
                "unknown_nodes": compress([h for h in v.nodes if v.fingerprints.get(h) is None]),
                "verdict": verdict,
            }
        return {
            "result": "found" if self.found else "none",
            "message": None if self.found else NO_SIGNATURE,
            "job": self.job,
            "files": ev.files,
            "lines": ev.lines,
            "hosts": compress(ev.hosts) if ev.hosts else "",
            "problems": ev.problems,
            "diagnoses": [d.to_dict() for d in self.diagnoses],
            "inventory": inv,
            "inventory_note": self.inventory_note,
            "disagreements": self.disagreements,
        }

    def text(self) -> str:
        ev = self.evidence
        lines: list[str] = []
        hosts = f", {len(ev.hosts)} host(s) {compress(ev.hosts)}" if ev.hosts else ""
        head = f"read {len(ev.files)} file(s), {ev.lines} line(s){hosts}"
        if self.job:
            head = f"job {self.job.get('id')}: " + head
        lines.append(head)
        for p in ev.problems:
            lines.append(f"warning: {p}")
        if not self.diagnoses:
            lines.append(NO_SIGNATURE)
        for i, d in enumerate(self.diagnoses, 1):
            s = d.signature
            lines.append("")
            tag = "most likely cause" if i == 1 else "also found"
            lines.append(f"{i}. [{tag}] {s.title}  ({s.id})")
            lines.append(f"   {d.summary}")
            lines.append("   evidence:")
            for e in d.evidence:
                lines.append(f"     {e.where}: {e.text}")
            if d.count > len(d.evidence):
                lines.append(f"     ... {d.count} matching line(s) in all")
            if d.odd_nodes:
                lines.append(f"   odd nodes: {compress(d.odd_nodes)}")
            lines.append(f"   what it means: {s.meaning}")
            lines.append(f"   likely cause: {s.cause}")
            lines.append(f"   fix: {s.fix}")
            lines.append(f"   confirm: {d.confirm_command}")
            if s.confirm:
                lines.append(f"     (fields: {', '.join(s.confirm)})")
            if d.inventory:
                mark = (
                    "confirmed by the inventory"
                    if d.confirmed
                    else "not confirmed by the inventory"
                )
                lines.append(f"   {mark}: {d.inventory}")
        if self.view is not None:
            v = self.view
            lines.append("")
            verdict = v.verdict
            decision = getattr(verdict, "decision", None) or (
                verdict.get("decision") if isinstance(verdict, Mapping) else None
            )
            nodes = compress(v.nodes) if v.nodes else "(no nodes)"
            lines.append(f"inventory as of {v.when_text} for {nodes}: policy decision {decision}")
            odd = getattr(verdict, "odd_nodes", None)
            if odd:
                lines.append(f"  odd nodes: {compress(odd)}")
            for f in findings_of(verdict):
                where = ""
                lines.append(
                    f"  - {f.get('rule')} ({f.get('severity', '?')}){where}: {_finding_text(f)}"
                )
        elif self.inventory_note:
            lines.append("")
            lines.append(f"inventory: {self.inventory_note}")
        if self.disagreements:
            lines.append("")
            lines.append("the log and the inventory disagree (itself a finding):")
            for x in self.disagreements:
                lines.append(f"  - {x}")
        return "\n".join(lines)
