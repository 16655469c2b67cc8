"""The canary's decisions (issue 43, docs/canary.md): which nodes are held, and which
canary jobs to start. Pure: rows, classes, Slurm's node states and the clock in; rows to
write, events and canaries to submit out. The service (``inventoryd.controller.canary``)
does the reading and the writing; ``ncclguard canary`` shows the same rows.

A node's **class** here is its host class key (:func:`~ncclguard.policy.schedule.
class_key`): what the refuse-level rules read from it. A change of NCCL, of a plugin or its
ABI, of the config, of a port's transport moves it; a change the gate would not refuse
(a warn-level aspect) does not, and holds nothing.

- **Held**: a node seen for the first time (after the service's first pass, which takes
  every node as vetted), or whose class differs from the one it was last vetted in
  (``accepted``). It is ``settling`` until its class has stayed the same ``settle_s``.
- **Back without a canary**: a held node whose class returns to its vetted one (a
  rolled-back upgrade).
- **Canary**: ``waiting`` nodes of one class, up to ``max_nodes``, with ``peers``
  known-good nodes of that class (``ok`` and vetted in it), all idle in the canary's
  partition; at most ``max_running`` canaries at once. A class with no known-good node
  (the first of a new combination) pairs two or more of its waiting nodes; a lone one
  waits for a second or an admin's ``approve`` (state ``approval``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple

from ncclguard.config import CanaryConfig
from ncclguard.hostlist import compress
from ncclguard.policy.verdict import Finding, Verdict

__all__ = ["HELD_STATES", "JOB_NAME", "RULE", "Launch", "Plan", "gate_holds", "held_row",
           "observe", "plan", "short", "submitted_by_service"]

RULE = "canary-hold"  # the finding of a job refused for a held node
JOB_NAME = "ncclguard-canary"  # the canary job's name (sbatch -J)

HELD_STATES = ("settling", "waiting", "running", "failed", "approval")
#: states a canary may be started from (a lone ``approval`` node joins a second one)
READY_STATES = ("waiting", "approval")


def short(key: str | None) -> str:
    """A class key as people read it: its first 10 hex digits (``none``: no record)."""
    return key[:10] if key else "none"


class Launch(NamedTuple):
    """One canary to submit: the changed nodes it vets, the known-good peers beside them
    (none for a new class) and their class."""

    nodes: tuple[str, ...]
    peers: tuple[str, ...]
    class_key: str


class Plan(NamedTuple):
    launches: list[Launch]
    rows: dict[str, dict[str, Any]]  # rows whose state or reason changed


def held_row(host: str, accepted: str | None, key: str | None, now: float, reason: str,
             since: float | None = None, state: str = "settling") -> dict[str, Any]:
    """A node's row, held."""
    return {"host": host, "accepted": accepted, "class_key": key, "state": state,
            "changed_at": now, "held_since": now if since is None else since,
            "reason": reason, "job_id": None, "job_nodes": None, "submitted_at": None,
            "attempts": 0, "updated_at": now}


def ok_row(host: str, key: str | None, now: float) -> dict[str, Any]:
    """A node's row, vetted in ``key`` and not held."""
    return {"host": host, "accepted": key, "class_key": key, "state": "ok",
            "changed_at": now, "held_since": None, "reason": "", "job_id": None,
            "job_nodes": None, "submitted_at": None, "attempts": 0, "updated_at": now}


def _event(host: str, at: float, event: str, key: str | None, detail: str,
           job: int | None = None, by: str = "ncclguard") -> dict[str, Any]:
    return {"at": at, "host": host, "event": event, "class_key": key, "job_id": job,
            "detail": detail, "by": by}


def observe(rows: Mapping[str, Mapping[str, Any]], keys: Mapping[str, str | None],
            now: float, settle_s: float, *, first: bool
            ) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]], set[int]]:
    """Compare each node's class now (``keys``; None: no readable record, left alone)
    with its row. Returns the rows to write, the events, and the canary jobs to cancel
    (their nodes' stack moved while they ran: they no longer test it). ``first``: the
    service's first pass; every node is taken as vetted in its class."""
    out: dict[str, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    cancel: set[int] = set()
    for host, key in keys.items():
        if key is None:
            continue
        row = rows.get(host)
        if row is None:
            if first:
                out[host] = ok_row(host, key, now)
            else:
                why = f"first seen (class {short(key)}): held until its canary passes"
                out[host] = held_row(host, None, key, now, why)
                events.append(_event(host, now, "held", key, why))
            continue
        state, accepted = row["state"], row["accepted"]
        if state == "ok":
            if key != accepted:
                why = (f"its stack changed (class {short(accepted)} -> {short(key)}): held "
                       "until its canary passes")
                out[host] = held_row(host, accepted, key, now, why)
                events.append(_event(host, now, "held", key, why))
            continue
        if key == row["class_key"]:
            if state == "settling" and now - float(row["changed_at"]) >= settle_s:
                new = dict(row, state="waiting", updated_at=now,
                           reason=f"settled (class {short(key)}): its canary is next")
                out[host] = new
            continue
        # a held node whose class moved again
        if row["state"] == "running" and row["job_id"] is not None:
            cancel.add(int(row["job_id"]))
        if key == accepted:
            out[host] = ok_row(host, key, now)
            events.append(_event(host, now, "released", key,
                                 f"back in its vetted class {short(key)}: no canary needed"))
        else:
            why = (f"its stack changed again (class {short(row['class_key'])} -> "
                   f"{short(key)}): held until its canary passes")
            out[host] = held_row(host, accepted, key, now, why, since=row["held_since"])
            events.append(_event(host, now, "held", key, why))
    return out, events, cancel


def plan(rows: Mapping[str, Mapping[str, Any]], keys: Mapping[str, str | None],
         idle: Collection[str], why_busy: Mapping[str, str], running: int,
         cfg: CanaryConfig, now: float, stale: Collection[str] = ()) -> Plan:
    """The canaries to start now, and the waiting nodes' reasons. ``idle``: the nodes
    Slurm has idle (not drained, not reserved) in the canary's partition; ``why_busy``:
    for the others, why not (an admin's drain and its reason, their state); ``running``:
    canaries running now; ``stale``: nodes whose record is too old to vouch for."""
    slots = max(cfg.max_running - running, 0)
    changed: dict[str, dict[str, Any]] = {}
    ready: dict[str, list[str]] = {}
    for host in sorted(rows, key=lambda h: (rows[h]["held_since"] or 0.0, h)):
        row = rows[host]
        if row["state"] in READY_STATES and keys.get(host) == row["class_key"]:
            ready.setdefault(str(row["class_key"]), []).append(host)
    good: dict[str, list[str]] = {}
    for host, row in sorted(rows.items()):
        if row["state"] == "ok" and keys.get(host) == row["accepted"] and host not in stale:
            good.setdefault(str(row["accepted"]), []).append(host)
    # each class's running canaries, read once (not once per class: a pass over thousands
    # of held nodes in as many classes stays linear)
    running_of: dict[str, list[int]] = {}
    for r in rows.values():
        if r["state"] == "running" and r["job_id"]:
            running_of.setdefault(str(r["class_key"]), []).append(int(r["job_id"]))
    launches: list[Launch] = []
    taken: set[str] = set()

    def say(hosts: Sequence[str], reason: str, state: str = "waiting") -> None:
        for h in hosts:
            row = rows[h]
            if row["reason"] != reason or row["state"] != state:
                changed[h] = dict(row, reason=reason, state=state, updated_at=now)

    for key, hosts in ready.items():
        free: list[str] = []
        for h in hosts:
            if h in stale:
                say([h], "waiting: its record is stale (its daemon is not publishing)")
            elif h not in idle:
                say([h], f"waiting: {why_busy.get(h, 'not idle')}; its canary runs when it "
                    "is idle")
            else:
                free.append(h)
        peers_of = good.get(key, [])
        need = min(cfg.peers, len(peers_of))
        first = list(running_of.get(key, ()))
        while free:
            peers: list[str] = []
            if peers_of:
                cand = [p for p in peers_of if p in idle and p not in taken]
                if cand:  # a canary tried again starts from another peer (one that changed
                    # under it, or failed it, is not asked first again)
                    turn = int(rows[free[0]]["attempts"] or 0) % len(cand)
                    cand = cand[turn:] + cand[:turn]
                peers = cand[:need]
                if len(peers) < need:
                    n = len(peers_of)
                    say(free, f"waiting: no idle known-good peer of its class {short(key)} "
                        f"({n} such node{'s' if n != 1 else ''}, not idle in the canary's "
                        "partition)")
                    break
            elif len(free) < 2:
                if first:
                    job = f"job {first[0]}" if first[0] else "submitted now"
                    say(free, f"waiting: the first canary of its class {short(key)} runs "
                        f"({job}); then it has a known-good peer")
                else:
                    say(free, f"the first node of class {short(key)}, which no node has run: "
                        "its canary needs a second node of that class, or an admin's "
                        "`ncclguard canary approve`", state="approval")
                break
            if slots <= 0:
                say(free, f"waiting: {cfg.max_running} canaries run at once "
                    "([canary] max_running)")
                break
            size = cfg.max_nodes if peers_of else max(cfg.max_nodes, 2)
            group, free = tuple(free[:size]), free[size:]
            launches.append(Launch(group, tuple(peers), key))
            taken.update(peers)
            slots -= 1
            if not peers_of:
                first.append(0)
    return Plan(launches, changed)


def time_limit_minutes(seconds: float) -> int:
    """Slurm's ``--time`` in minutes: ``seconds`` rounded up, at least 1."""
    return max(1, math.ceil(seconds / 60))


def describe(launch: Launch) -> str:
    """``n[3-4] with peer n1 (class 1a2b3c4d5e)``"""
    peers = f" with peer{'s' if len(launch.peers) > 1 else ''} {compress(launch.peers)}" \
        if launch.peers else " (a new class: no known-good peer)"
    return f"{compress(launch.nodes)}{peers} (class {short(launch.class_key)})"


def submitted_by_service(name: str, uid: int | None, owner: int | None) -> bool:
    """Whether a job can be the canary service's: named :data:`JOB_NAME` and run by the
    inventory's owner (the service writes the inventory, and submits as itself) or root.
    A user's job never is, whatever its id: a row that still names an ended canary's id
    (the service was down, Slurm's ids wrapped or restarted) vouches for no other job."""
    return name == JOB_NAME and uid is not None and owner is not None and uid in (owner, 0)


def gate_holds(verdict: Verdict, holds: Mapping[str, Mapping[str, Any]], job_id: int
               ) -> tuple[Verdict, bool]:
    """The gate's verdict for a multi-node job with held nodes (``holds``: their rows):
    unchanged for the canary job the inventory names for every one of them (its own
    verdict still stands: a canary of a mixed set is refused like any job); else refused,
    the held nodes odd, each with its reason. Returns the verdict and whether the job
    is that canary."""
    if not holds:
        return verdict, False
    if all(r["state"] == "running" and r["job_id"] == job_id for r in holds.values()):
        return verdict, True
    by_reason: dict[str, list[str]] = {}
    for host, r in sorted(holds.items()):
        by_reason.setdefault(f"held ({r['state']}): {r['reason']}"[:200], []).append(host)
    finding = Finding.from_hosts(
        RULE, "refuse", f"{len(holds)} node{'s' if len(holds) != 1 else ''} held until a "
        "canary passes (their stack changed; ncclguard canary status)", by_reason.items())
    return Verdict("refuse", [finding, *verdict.findings],
                   odd_nodes=[*verdict.odd_nodes, *holds], nodes=verdict.nodes,
                   notes=verdict.notes, partition=verdict.partition), False
