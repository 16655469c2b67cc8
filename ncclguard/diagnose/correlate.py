"""The inventory's view of a job's nodes at its start, and where it meets the logs.

    job nodes + start ──Inventory.fingerprint_at──▶ fingerprints ──policy──▶ Verdict
    [Diagnosis] + Verdict ──correlate()──▶ confirmed or not, and the disagreements

A diagnosis on policy rules is *confirmed* when the policy finds a difference on one of
its rules among the same nodes (and a stack verdict the log alone could not support, for
want of a difference between hosts, stands again); the disagreements are where the log
and the inventory say different things about one host (another NCCL loaded, a plugin
the job's environment brought or hid).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ncclguard.hostlist import compress
from ncclguard.timeparse import iso_utc

from .diagnosis import Diagnosis, host_values
from .scanner import LogEvidence

__all__ = [
    "InventoryView",
    "correlate",
    "disagreements",
    "finding_text",
    "findings_of",
    "inventory_view",
]

_VERSION = re.compile(r"\d+\.\d+\.\d+")


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


def finding_text(f: Mapping[str, Any]) -> str:
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
            d.inventory = "; ".join(f"{f.get('rule')}: {finding_text(f)}" for f in hits)
            d.score += 50
            if d.demoted:  # the inventory shows the difference the log could not
                d.verdict, d.family_as, d.fix_as, d.demoted = "stack", "", "", False
                d.summary += " The inventory shows the job's nodes differ on it."
        elif known:
            d.confirmed = False
            d.inventory = (
                f"the inventory as of {view.when_text} shows no {'/'.join(d.signature.rules)} "
                f"difference between {compress(known)}"
            )
    return disagreements(ev, view)


MAX_NAMED = 8  # hosts that are not the job's named one by one (a log may name thousands)


def disagreements(ev: LogEvidence, view: InventoryView) -> list[str]:
    """Where the log says one thing and the inventory another, host by host."""
    from ncclguard.fingerprint.fields import ABSENT, nccl_version, net_plugin

    out: list[str] = []
    when = view.when_text
    others = sorted(set(ev.hosts) - set(view.nodes)) if view.nodes else []
    for h in others[:MAX_NAMED]:
        out.append(f"{h} printed NCCL lines but is not one of the job's nodes")
    if len(others) > MAX_NAMED:
        out.append(f"{len(others) - MAX_NAMED} more host(s) printed NCCL lines but are not "
                   "among the job's nodes")
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
