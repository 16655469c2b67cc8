"""docs/diagnose.md's listing of each built-in signature's source records, generated from
the catalog (tests/test_diagnose_sources.py keeps the two in step)."""

from __future__ import annotations

BEGIN = "<!-- signature sources: generated from signatures.toml, begin -->"
END = "<!-- signature sources: end -->"


def sources_markdown(catalog) -> str:
    """One bullet per signature, one sub-bullet per source record."""
    out = [BEGIN, ""]
    for sig in catalog:
        out.append(f"- `{sig.id}`")
        for r in sig.sources:
            fmt = r.format.replace("\n", "\\n")
            where = r.file if r.project == "nccl" else f"{r.project} {r.file}"
            out.append(f"  - {r.level}: `{fmt}` ({where}; {r.releases})")
    out += ["", END]
    return "\n".join(out)
