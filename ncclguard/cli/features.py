"""``ncclguard features``: the class features in Slurm, and the file job_submit.lua reads.

- ``features sync [--dry-run]``: make Slurm's features match the inventory (SlurmUser or a
  Slurm admin), then write the file; ``--dry-run`` prints the ``scontrol`` calls only.
- ``features check``: whether Slurm's features and the file match the inventory (exit 1
  when they do not): the check an admin runs after a reconfigure, or from monitoring.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ncclguard.cli import output as out
from ncclguard.cli.context import Ctx, format_options, get_ctx
from ncclguard.cli.errors import fail

__all__ = ["features"]

DRIFT_COLUMNS: list[out.Column] = [("host", "NODE"), ("has", "SLURM HAS"),
                                   ("want", "INVENTORY SAYS")]


@click.group()
def features() -> None:
    """Class features in Slurm (prevention at scheduling time, docs/scheduling.md)."""


def _sync(c: Ctx, dry_run: bool, quiet: bool = False) -> Any:
    import sys

    from ncclguard.progress import Progress
    from ncclguard.sched import classfile
    from ncclguard.sched.sync import sync
    from ncclguard.slurm import SlurmError
    from ncclguard.store import InventoryError

    shown = Progress(sys.stderr, "ncclguard features sync", enabled=not quiet)
    try:
        return sync(c.config, c.slurm, dry_run=dry_run, now=c.now, inventory=c.inventory,
                    progress=shown.update if shown.enabled else None)
    except (SlurmError, InventoryError, classfile.ClassFileError) as e:
        fail(str(e))
    finally:  # cleared before the output (and before an error's message)
        shown.done()


@features.command("sync")
@click.option("--dry-run", is_flag=True, help="Print the scontrol calls; change nothing.")
@click.option("--quiet", "-q", is_flag=True,
              help="No progress line (it is shown on a terminal only, on stderr).")
@format_options
def sync_cmd(dry_run: bool, quiet: bool, as_json: bool, as_csv: bool) -> None:
    """Set each node's class feature in Slurm (its own features kept), only where it
    differs, then write the file of classes for job_submit.lua."""
    c = get_ctx(as_json, as_csv)
    res = _sync(c, dry_run, quiet)
    updates = res.plan.updates
    doc = {
        "dry_run": dry_run,
        "nodes": len(res.plan.nodes),
        "changed": res.plan.changed_hosts,
        "calls": [u.describe() for u in updates],
        "applied": len(res.applied),
        "errors": res.errors,
        "classes_file": str(res.written) if res.written else None,
        "regrouped": [{"job": j, "old": o, "new": n} for j, o, n in res.regrouped],
    }
    lines = [("would run: " if dry_run else "ran: ") + u.describe() for u in updates]
    if dry_run:
        lines.append(f"{len(res.plan.changed_hosts)} of {len(res.plan.nodes)} nodes would change "
                     f"in {len(updates)} calls (dry run: nothing changed)")
    else:
        lines.append(f"{len(res.plan.changed_hosts)} of {len(res.plan.nodes)} nodes updated in "
                     f"{len(res.applied)} calls")
        lines += [f"error: {out.cell(e)}" for e in res.errors]
        lines += [f"pending job {j}: its classes changed: {out.cell(o)} -> {out.cell(n)}"
                  for j, o, n in res.regrouped]
        lines.append(f"wrote {res.written}" if res.written else
                     "an update failed: the file of classes names only what Slurm has; "
                     "run it again")
    c.emit(doc, text="\n".join(lines) + "\n", wrap=False)  # scontrol calls, whole
    if res.errors:
        raise SystemExit(3)


@features.command("check")
@format_options
def check_cmd(as_json: bool, as_csv: bool) -> None:
    """Compare Slurm's class features and the file of classes with the inventory; exit 1
    when they differ (run `ncclguard features sync`, or see why the daemon did not). A
    node the daemon holds without a class (its stack keeps changing) is listed as held,
    and is no difference while Slurm has no class feature on it."""
    from ncclguard.policy.schedule import is_class_feature
    from ncclguard.sched import classfile, status
    from ncclguard.slurm.model import clean_text

    c = get_ctx(as_json, as_csv)
    res = _sync(c, dry_run=True, quiet=True)  # one read of Slurm's nodes
    by_name = {n.name: n for n in res.plan.nodes}
    held_back = status.read(c.config) or {"failing": [], "held": []}
    failing = [f for f in held_back["failing"] if f["host"] in by_name]
    held = [h for h in held_back["held"] if h["host"] in by_name]
    # a node the daemon holds without a class on purpose (its stack keeps changing,
    # features.settle_s) is as it should be while it has no class feature in Slurm
    holding = {h["host"] for h in held if float(h.get("until") or 0) > c.now}
    rows = []
    for host in res.plan.changed_hosts:
        have = [f for f in by_name[host].active_features if is_class_feature(f)]
        if not have and host in holding:
            continue
        want = [f for f in (res.plan.classes.get(host), res.plan.adds.get(host)) if f]
        rows.append({"host": host, "has": ",".join(have) or "-",
                     "want": ",".join(want) or "-"})
    path = Path(c.config.features.classes_file)
    state: dict[str, Any] = {"path": str(path)}
    try:
        cf = classfile.read(path)
    except classfile.ClassFileError as e:
        state.update(ok=False, problem=str(e))
    else:
        age = c.now - cf.verified
        state.update(verified=out.iso(cf.verified), age_s=round(age, 1))
        named = {k.feature for lists in (cf.partitions, cf.adds) for lst in lists.values()
                 for k in lst}
        present = {f for n in res.plan.nodes for f in n.active_features}
        missing = sorted(named - present)
        if missing:
            state.update(ok=False, problem=f"names features Slurm does not have: "
                         f"{', '.join(missing[:5])}")
        elif age > classfile.LUA_FRESH_S:
            state.update(ok=False, problem=f"last verified {age:.0f} s ago: job_submit.lua "
                         f"ignores it after {classfile.LUA_FRESH_S} s (is the features "
                         "daemon running?)")
        else:
            state.update(ok=True, problem=None)
    ok = not rows and state["ok"] and not failing
    doc = {"ok": ok, "nodes": len(res.plan.nodes), "differ": rows, "classes_file": state,
           "failing": failing, "held": held}
    text = None
    if c.fmt == "table":
        text = (f"{len(rows)} of {len(res.plan.nodes)} nodes have other class features in "
                "Slurm than the inventory gives them\n")
        if rows:
            text += out.table(rows, DRIFT_COLUMNS, c.width)
        text += f"classes file {path}: " + (
            f"verified {state['age_s']:.0f} s ago" if state["ok"] else out.cell(state["problem"])
        ) + "\n"
        for f in failing:
            text += (f"update refused by Slurm, retried with back-off: {clean_text(f['host'])} "
                     f"({f.get('attempts')} tries): {clean_text(str(f.get('error')))}\n")
        for h in held:
            text += (f"held without a class (its stack keeps changing): {clean_text(h['host'])}"
                     "\n")
    c.emit(doc, rows=rows, columns=DRIFT_COLUMNS, text=text)
    if not ok:
        raise SystemExit(1)
