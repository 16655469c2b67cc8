"""The report: the evidence, the ranked diagnoses and the inventory's view, as JSON
(:meth:`Report.to_dict`) or as the text ``ncclguard diagnose`` prints (:meth:`Report.text`).

    [Diagnosis] + InventoryView (correlate.py) ──▶ Report (to_dict / text)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ncclguard.hostlist import compress

from .correlate import InventoryView, finding_text, findings_of
from .diagnosis import Diagnosis
from .scanner import LogEvidence

__all__ = ["NO_SIGNATURE", "Report"]

NO_SIGNATURE = "no communication-stack signature found"


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
            lines.append(f"   fix: {d.fix}")
            if d.verdict == "not-stack":
                # nothing of the nodes' stacks to compare
                lines.append("   verdict: not a node-stack problem")
            else:
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
                    f"  - {f.get('rule')} ({f.get('severity', '?')}){where}: {finding_text(f)}"
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
