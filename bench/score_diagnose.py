#!/usr/bin/env python3
"""Score ``ncclguard diagnose`` on the corpus of real failure logs.

The corpus is ``tests/data/diagnose_real``: one ``<id>.log`` per case, copied verbatim
from a public thread, and ``cases.toml`` with where it comes from, how the thread
established the cause, the cause family expected first and whether that cause is a
node-stack or fabric one (``stack``). Each log is diagnosed alone, with the built-in
catalog and no inventory, and the first diagnosis is compared with the expectation:

  named            the first diagnosis is of the expected family (or one of ``also``)
  missed           it is not (or there is none)
  stack-accused    (cases whose cause is not a node-stack one) the first diagnosis
                   blames the node stack or the fabric (its signature's ``verdict`` is
                   "stack")

Only cases the thread established are scored (``established`` other than "partial" and
"log"); ``--all`` adds the others, in a column of their own. ``--split`` keeps the
tuning cases, the held-out ones or both (the default).

    .venv/bin/python bench/score_diagnose.py                 # the table
    .venv/bin/python bench/score_diagnose.py --split holdout --cases-out  # one line a case
    .venv/bin/python bench/score_diagnose.py --json

A catalog that predates the ``family`` and ``verdict`` fields (the baseline) is read with
the families of docs/diagnose.md and "stack" for every signature that names policy rules.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "data" / "diagnose_real"
UNSCORED = ("partial", "log")

# The families of the catalog before it had a `family` field.
_OLD_FAMILY = {
    "nccl-version-mismatch": "nccl-version",
    "nccl-version-differs": "nccl-version",
    "bootstrap-message-truncated": "nccl-version",
    "socket-family-zero": "nccl-version",
    "transport-type-mismatch": "transport",
    "net-transport-differs": "transport",
    "ib-no-device": "transport",
    "net-plugin-differs": "net-plugin",
    "no-ip-interface": "ip-interface",
    "unhandled-cuda-error": "gpu",
    "unhandled-system-error": "wrapper",
    "python-nccl-error": "wrapper",
}


def family_of(sig: Any) -> str:
    fam = getattr(sig, "family", None)
    return str(fam) if fam else _OLD_FAMILY.get(sig.id, sig.id)


def verdict_of(sig: Any) -> str:
    v = getattr(sig, "verdict", None)
    if v:
        return str(v)
    return "stack" if sig.rules else "neutral"


def load_cases(path: Path) -> list[dict[str, Any]]:
    with open(path, "rb") as f:
        cases = tomllib.load(f)["case"]
    for c in cases:
        c.setdefault("also", [])
    return list(cases)


def score_case(case: dict[str, Any], catalog: Any) -> dict[str, Any]:
    from ncclguard.diagnose import run

    log = CORPUS / f"{case['id']}.log"
    report = run([log], catalog=catalog)
    first = report.diagnoses[0] if report.diagnoses else None
    # the diagnosis's own family and verdict where it has them: the log may make a stack
    # signature neutral (not corroborated, no difference between hosts) or another
    # family (every host alike); the signature's are a baseline catalog's only answer
    fam = (getattr(first, "family", "") or family_of(first.signature)) if first else "none"
    verdict = (getattr(first, "verdict", "") or verdict_of(first.signature)) if first else "none"
    accepted = {case["family"], *case["also"]}
    named = fam in accepted
    accused = (not case["stack"]) and verdict == "stack"
    return {
        "id": case["id"],
        "family": case["family"],
        "stack": case["stack"],
        "split": case["split"],
        "established": case["established"],
        "scored": case["established"] not in UNSCORED,
        "first": first.signature.id if first else "none",
        "first_family": fam,
        "verdict": verdict,
        "named": named,
        "accused": accused,
    }


def table(results: list[dict[str, Any]]) -> list[str]:
    rows: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in results:
        row = rows[r["family"]]
        row["stack"] = int(r["stack"])
        row["cases"] += 1
        row["named"] += int(r["named"])
        row["missed"] += int(not r["named"])
        row["accused"] += int(r["accused"])
    out = [f"{'family':26s} {'kind':9s} {'cases':>5s} {'named':>5s} {'missed':>6s} {'accused':>7s}"]
    for fam in sorted(rows, key=lambda f: (-rows[f]["stack"], f)):
        row = rows[fam]
        kind = "stack" if row["stack"] else "not-stack"
        acc = str(row["accused"]) if not row["stack"] else "-"
        out.append(
            f"{fam:26s} {kind:9s} {row['cases']:5d} {row['named']:5d} {row['missed']:6d} {acc:>7s}"
        )
    return out


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    stack = [r for r in results if r["stack"]]
    other = [r for r in results if not r["stack"]]
    return {
        "cases": len(results),
        "stack_cases": len(stack),
        "stack_named": sum(r["named"] for r in stack),
        "other_cases": len(other),
        "other_named": sum(r["named"] for r in other),
        "other_accused": sum(r["accused"] for r in other),
    }


def pct(a: int, b: int) -> str:
    return f"{100.0 * a / b:.0f}%" if b else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description="score diagnose on the corpus of real logs")
    ap.add_argument("--split", choices=("tune", "holdout", "all"), default="all")
    ap.add_argument("--all", action="store_true", help="also the cases not established")
    ap.add_argument("--cases-out", action="store_true", help="one line per case")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from ncclguard.diagnose import load_catalog

    catalog = load_catalog()
    cases = load_cases(CORPUS / "cases.toml")
    if a.split != "all":
        cases = [c for c in cases if c["split"] == a.split]
    results = [score_case(c, catalog) for c in cases]
    scored = [r for r in results if r["scored"]]
    unscored = [r for r in results if not r["scored"]]
    if a.json:
        print(
            json.dumps(
                {"scored": summary(scored), "unscored": summary(unscored), "cases": results},
                indent=1,
            )
        )
        return 0
    if a.cases_out:
        for r in results:
            mark = "ok " if r["named"] else ("ACC" if r["accused"] else "-- ")
            print(
                f"{mark} {r['id']:28s} want {r['family']:22s} got {r['first']:28s} "
                f"[{r['established']}, {r['split']}]"
            )
        print()
    print(f"split: {a.split}; scored (established) cases: {len(scored)}")
    for line in table(scored):
        print("  " + line)
    s = summary(scored)
    print(
        f"stack and fabric cases: right family first {s['stack_named']}/{s['stack_cases']} "
        f"({pct(s['stack_named'], s['stack_cases'])})"
    )
    print(
        f"other cases: own verdict first {s['other_named']}/{s['other_cases']}, "
        f"stack accused {s['other_accused']}/{s['other_cases']} "
        f"({pct(s['other_accused'], s['other_cases'])})"
    )
    if a.all and unscored:
        print(f"\nnot established (not scored): {len(unscored)}")
        for line in table(unscored):
            print("  " + line)
        u = summary(unscored)
        print(
            f"stack and fabric: {u['stack_named']}/{u['stack_cases']}; "
            f"other: accused {u['other_accused']}/{u['other_cases']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
