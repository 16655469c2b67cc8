"""The policy's answer for one allocation: accept, warn or refuse, and why.

A :class:`Verdict` is a plain value: it prints (:meth:`Verdict.summary` for an
AdminComment, :meth:`Verdict.format_text` for logs and ``ncclguard check``) and round-trips
through JSON (:meth:`Verdict.to_dict` / :meth:`Verdict.from_dict`) for the audit trail and
``--json``. Node sets are kept as sorted lists and written as compressed hostlists.

No dataclasses: this is on the prolog's hot path (standard library + hostlist only).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

from ncclguard.hostlist import compress as _compress
from ncclguard.hostlist import expand

__all__ = ["DECISIONS", "SUMMARY_MAX", "Finding", "Verdict"]

DECISIONS = ("accept", "warn", "refuse")
SEVERITY_RANK = {"ignore": 0, "warn": 1, "refuse": 2}
SUMMARY_MAX = 250  # Slurm's AdminComment is a free string; keep it one short line


@lru_cache(maxsize=128)
def _compress_set(names: frozenset[str]) -> str:
    return _compress(names)


def compress(names: Iterable[str]) -> str:
    """A Slurm hostlist of ``names`` (``ncclguard.hostlist.compress``), memoised: one
    verdict names the same node sets in several findings, the summary and the JSON."""
    return _compress_set(frozenset(names))


class Finding:
    """One rule that found a difference: ``groups`` are ``(value label, hostlist, count)``.

    Groups are ordered smallest first (the odd ones lead), then by label; a group of
    nodes whose value is unknown comes last.
    """

    __slots__ = ("groups", "message", "rule", "severity")

    def __init__(
        self, rule: str, severity: str, message: str, groups: Sequence[tuple[str, str, int]]
    ) -> None:
        self.rule = rule
        self.severity = severity
        self.message = message
        self.groups: list[tuple[str, str, int]] = [(g[0], g[1], g[2]) for g in groups]

    @classmethod
    def from_hosts(
        cls, rule: str, severity: str, message: str, groups: Iterable[tuple[str, Iterable[str]]]
    ) -> Finding:
        """Build from ``(label, host names)`` pairs; names are compressed here."""
        out = []
        for label, hosts in groups:
            names = frozenset(hosts)
            out.append((label, _compress_set(names), len(names)))
        return cls(rule, severity, message, out)

    def groups_text(self) -> str:
        """``nccl 2.18.3: n3 | nccl 2.21.5: n[1-2,4]``"""
        return " | ".join(f"{label}: {hosts}" for label, hosts, _ in self.groups)

    def hosts(self) -> list[str]:
        """Every host named in the finding, sorted."""
        names: set[str] = set()
        for _, hosts, _ in self.groups:
            names.update(expand(hosts))
        return sorted(names)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "severity": self.severity,
            "message": self.message,
            "groups": [{"value": v, "nodes": h, "count": n} for v, h, n in self.groups],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finding:
        return cls(
            d["rule"],
            d["severity"],
            d["message"],
            [(g["value"], g["nodes"], int(g["count"])) for g in d.get("groups", ())],
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Finding) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash((self.rule, self.severity, self.message, tuple(self.groups)))

    def __repr__(self) -> str:
        return f"Finding({self.rule!r}, {self.severity!r}, {self.message!r}, {self.groups!r})"


class Verdict:
    """``decision`` ("accept" | "warn" | "refuse"), ``findings`` (refuse first),
    ``odd_nodes`` (the fewest nodes whose removal leaves no refuse-level finding),
    ``nodes`` (all nodes judged), ``notes`` (e.g. why the allocation was not checked).

    ``odd_tie``: several minimum odd sets existed, and ``odd_nodes`` is the one chosen by
    the caller's preference, then by name. It is a hint for the caller (the gate then
    asks which nodes to prefer); it is not part of :meth:`to_dict` or equality."""

    __slots__ = ("decision", "findings", "nodes", "notes", "odd_nodes", "odd_tie", "partition")

    def __init__(
        self,
        decision: str,
        findings: Sequence[Finding] = (),
        odd_nodes: Iterable[str] = (),
        nodes: Iterable[str] = (),
        notes: Sequence[str] = (),
        partition: str | None = None,
        odd_tie: bool = False,
    ) -> None:
        if decision not in DECISIONS:
            raise ValueError(f"decision {decision!r}: expected one of {', '.join(DECISIONS)}")
        self.decision = decision
        self.findings = list(findings)
        self.odd_nodes = sorted(set(odd_nodes))
        self.nodes = sorted(set(nodes))
        self.notes = list(notes)
        self.partition = partition
        self.odd_tie = odd_tie

    @property
    def accepted(self) -> bool:
        """Whether the job may run (accept or warn)."""
        return self.decision != "refuse"

    def summary(self, limit: int = SUMMARY_MAX) -> str:
        """One line starting ``ncclguard:``, at most ``limit`` characters.

        ``ncclguard: refuse, odd n3: nccl-version [nccl 2.18.3: n3 | nccl 2.21.5: n[1-2,4]]``
        """
        head = f"ncclguard: {self.decision}"
        if self.odd_nodes:
            head += f", odd {compress(self.odd_nodes)}"
        if self.findings:
            body = "; ".join(f"{f.rule} [{f.groups_text()}]" for f in self.findings)
        elif self.notes:
            body = "; ".join(self.notes)
        else:
            body = f"{len(self.nodes)} nodes compatible"
        text = f"{head}: {body}"
        if len(text) > limit:
            text = text[: max(limit - 1, 0)].rstrip() + "…"
        return text

    def format_text(self) -> str:
        """Several lines for logs and ``ncclguard check``."""
        lines = [
            f"ncclguard: {self.decision} ({len(self.nodes)} nodes"
            + (f": {compress(self.nodes)}" if self.nodes else "")
            + (f"; partition {self.partition}" if self.partition else "")
            + ")"
        ]
        if self.odd_nodes:
            lines.append(f"  odd nodes: {compress(self.odd_nodes)} ({len(self.odd_nodes)})")
        from ncclguard.text import safe  # a node's value never starts a line of its own

        for f in self.findings:
            lines.append(f"  {f.severity} {f.rule}: {safe(f.message)}")
            for label, hosts, count in f.groups:
                lines.append(f"      {safe(label)}: {safe(hosts)} ({count})")
        for note in self.notes:
            lines.append(f"  note: {safe(note)}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision": self.decision,
            "summary": self.summary(),
            "partition": self.partition,
            "nodes": compress(self.nodes),
            "node_count": len(self.nodes),
            "odd_nodes": compress(self.odd_nodes),
            "findings": [f.to_dict() for f in self.findings],
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        return cls(
            d["decision"],
            [Finding.from_dict(f) for f in d.get("findings", ())],
            expand(d.get("odd_nodes") or ""),
            expand(d.get("nodes") or ""),
            d.get("notes", ()),
            d.get("partition"),
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Verdict) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Verdict({self.summary()!r})"
