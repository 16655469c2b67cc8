"""The diagnosis: which signatures fired, what they say about which hosts, ranked.

    LogEvidence (scanner.py) ──diagnose()──▶ [Diagnosis] ──correlate()──▶ (correlate.py)

A ``line`` signature names the hosts that printed it (and, with ``odd = "printers"``,
calls them odd when others did not); a ``differs`` signature groups the hosts by the
value each printed and calls the minority odd. Scores order the list: most likely first.

No stack verdict without a difference between hosts (issue 44, :func:`_judge`): a stack
cause stands only when the log shows the nodes differ (two values, a line that says two
ranks differ, printers that are not every host, or a corroborating one of those; the
inventory, later, in correlate.py). A fault every host of the job shows alike is reported
as what it is: no node difference explains it (a release's bug, a setting or a fabric
they share). Where the log shows only some hosts, it says that this cannot be told.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ncclguard.hostlist import compress

from .catalog import Catalog, Signature
from .scanner import MAX_SAMPLES, Evidence, LogEvidence, RawMatch, SignatureState, short

__all__ = ["Diagnosis", "diagnose", "host_values", "version_of_code"]


def version_of_code(code: int) -> str:
    """NCCL_VERSION_CODE → "X.Y.Z" (new scheme from 2.9: X*10000+Y*100+Z; docs/nccl.md)."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


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
    # the signature's verdict, or "neutral" when a signature that needs corroboration
    # (catalog field `corroborate`) got none from the log, or when the log does not show
    # the nodes differ; "not-stack" when every host shows it alike (:func:`_judge`)
    verdict: str = ""
    # the family it is reported under when that is not the signature's (a stack fault
    # every host shows alike: NO_DIFFERENCE; a version symptom under one release:
    # RELEASE_BUG)
    family_as: str = ""
    fix_as: str = ""  # the fix that goes with family_as
    # a stack verdict the log could not support (kept, for the inventory to restore)
    demoted: bool = False

    def __post_init__(self) -> None:
        if not self.verdict:
            self.verdict = self.signature.verdict

    @property
    def family(self) -> str:
        return self.family_as or self.signature.family or self.signature.id

    @property
    def fix(self) -> str:
        return self.fix_as or self.signature.fix

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
            "family": self.family,
            "verdict": self.verdict,
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
            "fix": self.fix,
            "confirm_command": self.confirm_command,
            "confirm_fields": list(s.confirm),
            "rules": list(s.rules),
            "inventory": self.inventory,
            "confirmed": self.confirmed,
        }


def diagnose(ev: LogEvidence, catalog: Catalog,
             job_hosts: Iterable[str] | None = None) -> list[Diagnosis]:
    """The signatures that fired, most likely cause first. ``job_hosts``: the job's nodes,
    when known (a log that shows fewer cannot say that every host showed a fault)."""
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
    job = None if job_hosts is None else {short(h) for h in job_hosts}
    _corroborate(out, ev, job)
    _borrow_odd_nodes(out)
    _judge(out, ev, job)
    out.sort(
        key=lambda d: (
            -d.score,
            d.evidence[0].file if d.evidence else "",
            d.evidence[0].line if d.evidence else 0,
        )
    )
    return out


UNCORROBORATED_PENALTY = 40  # below every not-stack verdict's weight less its own


def _corroborate(diags: list[Diagnosis], ev: LogEvidence,
                 job_hosts: set[str] | None = None) -> None:
    """A stack diagnosis that needs another one to stand (``corroborate``: a symptom of a
    version split needs the log to show two versions) becomes neutral, ranked lower and
    says so, when none of those fired. When every host of the log printed one and the
    same NCCL version, the symptom is that release's own (a bootstrap bug: NCCL 2.19.3's
    ``Message truncated``, issue 44), reported as such."""
    fired = {d.signature.id for d in diags}
    one = _one_release(ev, job_hosts)  # the same for every diagnosis: read once
    for d in diags:
        need = d.signature.corroborate
        if not need or fired & set(need):
            continue
        d.verdict = "neutral"
        d.score -= UNCORROBORATED_PENALTY
        if one is not None and d.signature.family == "nccl-version":
            version, hosts = one
            d.verdict, d.family_as, d.fix_as = "not-stack", RELEASE_BUG, RELEASE_BUG_FIX
            d.summary += (
                f" Not a version split: every host of the log ({compress(hosts)}) printed "
                f"NCCL {version}. The same release on every node failing so is that "
                f"release's own fault, which no node difference explains."
            )
            continue
        if d.signature.kind == "differs":  # the hosts differ; no failure it explains
            d.summary += (
                f" Not shown by this log to be the cause: the hosts differ, but none of "
                f"{', '.join(need)} was found (no failure the difference explains)."
            )
            continue
        d.summary += (
            f" Not shown by this log to be a node-stack difference: none of "
            f"{', '.join(need)} was found (the log shows no two hosts that differ)."
        )


RELEASE_BUG = "nccl-release-bug"
RELEASE_BUG_FIX = (
    "Read that release's notes and NVIDIA/nccl's issues for the message; move the job to a "
    "release that fixes it (the same one on every node: a pip wheel, the image, the "
    "module). Draining or excluding nodes does not help: every node runs the same NCCL."
)


def _one_release(ev: LogEvidence, job_hosts: set[str] | None = None
                 ) -> tuple[str, list[str]] | None:
    """(version, hosts) when every host of the log printed an NCCL version banner and
    all the same one, and the log shows the whole job (:func:`_whole_job`, the test
    :func:`_judge` makes before it calls hosts alike); None otherwise (no banner, two
    versions, a host without one, a log of some hosts: a node not in it may run another
    release)."""
    per_host = host_values(ev, "nccl-version-differs")
    versions = {v for vs in per_host.values() for v in vs}
    if len(versions) != 1 or not _whole_job(ev, set(per_host), job_hosts):
        return None
    return versions.pop().removeprefix("NCCL version "), sorted(per_host)


def _whole_job(ev: LogEvidence, hosts: set[str], job_hosts: set[str] | None) -> bool:
    """Whether ``hosts`` (those that printed a line) are the whole job, as far as the log
    can tell: every host of the log, two or more, nothing cut, and every one of
    ``job_hosts`` when known, else every rank of the largest communicator. The one test
    before calling a fault every host's alike, or a release every host's."""
    seen = set(ev.hosts)
    if ev.cut or len(seen) < 2 or not hosts >= seen:
        return False
    if job_hosts:
        return job_hosts <= hosts
    return not 0 < ev.ranks_seen < ev.nranks


NO_DIFFERENCE = "no-node-difference"
NO_DIFFERENCE_FIX = (
    "Every host of the job shows it alike, so no node differs from the others: look at "
    "what they share (the job's NCCL_* settings and environment, its container image, "
    "the NCCL release, the fabric and switches), not at one node. Draining a node does "
    "not help."
)


def _judge(diags: list[Diagnosis], ev: LogEvidence, job_hosts: set[str] | None) -> None:
    """No stack verdict without a difference between hosts. A stack diagnosis stands when
    the log shows one: values that differ (``differs``), a line that says two ranks differ
    (``between``), odd nodes (printers that are not every host, or borrowed from such a
    diagnosis), or one of its ``corroborate`` that shows one. Otherwise it is the fault of
    every host alike (``not-stack``, family :data:`NO_DIFFERENCE`, the signature's
    ``alike`` text as the fix) when every host of the job printed it, else ``neutral``
    and says what the log cannot tell."""
    seen = set(ev.hosts)
    missing = sorted(job_hosts - seen) if job_hosts else []
    partial_ranks = 0 < ev.ranks_seen < ev.nranks
    shown = {d.signature.id for d in diags if d.verdict == "stack" and (
        d.signature.kind == "differs" or d.signature.between)}
    for d in diags:
        sig = d.signature
        if d.verdict != "stack" or sig.kind == "differs" or sig.between or d.odd_nodes:
            continue
        if shown & set(sig.corroborate):  # a diagnosis that shows the difference backs it
            continue
        d.demoted = True
        if _whole_job(ev, set(d.hosts), job_hosts):
            d.verdict, d.family_as = "not-stack", NO_DIFFERENCE
            d.fix_as = sig.alike or NO_DIFFERENCE_FIX
            d.summary += (f" Not a node difference: all {len(seen)} hosts of the job printed "
                          "it alike.")
            continue
        d.verdict = "neutral"
        if missing:
            gap = (f"the log shows {len(seen)} of the job's {len(job_hosts or ())} nodes "
                   f"(not {compress(missing)})")
        elif partial_ranks:
            gap = f"the log shows {ev.ranks_seen} of {ev.nranks} ranks"
        elif len(seen) < 2:
            gap = f"the log shows one host ({compress(sorted(seen))})" if seen else (
                "the log names no host")
        else:
            gap = "the line names no odd node"
        d.summary += (f" Whether the nodes differ cannot be told: {gap}; compare them "
                      f"with {d.confirm_command}.")


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
            e = ev.resolve(RawMatch("", 0, "", None, None, int(key[5:])))
            return e.host
        return short(key)

    return res


def _line(sig: Signature, st: SignatureState, ev: LogEvidence) -> Diagnosis:
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
    if sig.odd == "printers" and printers and ev.cut:
        summary += (" Odd nodes not named: some matching lines were not attributed to a "
                    "host (see the problems).")
    elif sig.odd == "printers" and printers:
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


_LEVEL = re.compile(rb" NCCL (?:INFO|WARN|TRACE) ?")


def _line_detail(sig: Signature, st: SignatureState) -> str:
    """Numbers that make a line signature readable (version codes, socket types)."""
    if not st.samples:
        return ""
    text = st.samples[0].text.encode("utf-8", "replace")
    # a pattern anchored at NCCL's message sees the text after "NCCL INFO " / "NCCL WARN "
    lv = _LEVEL.search(text)
    message = text[lv.end():] if lv is not None else text
    for p in sig.patterns:
        m = p.regex.search(text) or p.regex.search(message)
        if m is None:
            continue
        g = {k: v.decode() for k, v in m.groupdict().items() if v is not None}
        if "code_a" in g and "code_b" in g:
            return (
                f"rank {g['rank_a']} runs NCCL {version_of_code(int(g['code_a']))}, "
                f"rank {g['rank_b']} runs {version_of_code(int(g['code_b']))}."
            )
        if "local" in g and "remote" in g:
            # 2.26 prints version codes, 2.30 "X.Y.Z" (ras.cc ncclVersionToString)
            local, remote = (v if "." in v else version_of_code(int(v))
                             for v in (g["local"], g["remote"]))
            return f"this rank runs NCCL {local}, peer {g['peer']} runs {remote}."
        if "own" in g and "got" in g:
            names = {"3": "NET/Socket", "4": "NET/IB"}
            return (
                f"a rank on {names.get(g['own'], g['own'])} was contacted by a peer on "
                f"{names.get(g['got'], g['got'])}."
            )
        if "max" in g and "min" in g:
            return f"Net device counts across ranks: min {g['min']}, max {g['max']}."
        if "max" in g and "n" in g:
            return (
                f"Rank {g['rank']} has {g['n']} Net device(s); the most any rank has is "
                f"{g['max']}."
            )
        status = g.get("err") or g.get("st")
        if status is not None:
            return f"First status: {status} ({WC_STATUS.get(int(status), 'unknown')})."
        if "event" in g:
            return f"First event: {g['event'].strip()}."
        if "frame" in g:
            return f"First NCCL frame: {g['frame']}."
        if "file" in g and "code" in g:
            return (f"First: {g['file']}:{g['line']} -> {g['code']} (ncclSystemError: a "
                    "socket call failed).")
        break
    return ""


# enum ibv_wc_status (rdma-core libibverbs/verbs.h): the status NCCL prints with an RDMA
# completion error
WC_STATUS = {
    0: "success", 1: "local length error", 2: "local QP operation error",
    3: "local EE context operation error", 4: "local protection error",
    5: "work request flushed", 6: "memory window bind error", 7: "bad response",
    8: "local access error", 9: "remote invalid request", 10: "remote access error",
    11: "remote operation error", 12: "transport retry counter exceeded",
    13: "RNR retry counter exceeded", 14: "local RDD violation",
    15: "remote invalid RD request", 16: "remote aborted", 17: "invalid EE context number",
    18: "invalid EE context state", 19: "fatal error", 20: "response timeout",
    21: "general error",
}  # fmt: skip


def _differs(sig: Signature, st: SignatureState, ev: LogEvidence) -> Diagnosis | None:
    res = _key_resolver(ev)
    per_host: dict[str, set[str]] = {}
    first: dict[tuple[str, str], RawMatch] = {}
    for value, by_key in st.values.items():
        for key, rec in by_key.items():
            h = res(key)
            if h is None:
                continue
            per_host.setdefault(h, set()).add(value)
            if rec is not None:
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
    # with lines cut, the hosts counted are not all: no minority is named odd
    tie = len(ordered[1][1]) == len(major_h) or ev.cut > 0
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
