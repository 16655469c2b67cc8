"""image-stack and image-unknown: a job that runs in a container image (issue 15).

With pyxis/enroot a job's libnccl comes from its image, and its net plugin from the node
(an injected one: enroot's ``mounts.d``, hooks, Apptainer binds) or from the image. On
each node the effective stack is the image's libnccl with that plugin, used at the highest
ABI both know, or, when they share none, NCCL's own transport of that node (NCCL logs
``Failed to find ncclNetPlugin_vN symbol`` and falls back: docs/nccl.md, "Plugins NCCL
loads"). Nothing in
NCCL compares the transports across ranks: a node on IB meeting one on a plugin hangs or
fails with ``wrong type``.

- **image-stack** (refuse by default): the image's NCCL cannot use the plugin some nodes
  inject (it falls back there), or the nodes would end up on different transports.
- **image-unknown** (warn by default): the image cannot be checked: a registry
  reference (imported on each node for each step; a tag can move between imports), an
  image not (yet) indexed or unreadable, or nodes whose record predates issue 15. A site
  that wants pinned, indexed images sets ``image-unknown = "refuse"``.

The host's libnccl (and its ``/etc/nccl.conf``, its own plugins) is not what such a job
loads: :data:`HOST_RULES` are not applied to it.
"""

from __future__ import annotations

from collections.abc import Mapping

from ncclguard.config import RegistryConfig
from ncclguard.fingerprint.image import effective_stack
from ncclguard.policy.rules.base import Rule, Values
from ncclguard.policy.verdict import Finding

STACK = "image-stack"
UNKNOWN = "image-unknown"
#: Rules about the host's own NCCL stack: a container does not load it.
#: node-adds too: a container sees the node's plugins only where the node injects them,
#: which image-stack judges.
HOST_RULES = frozenset({"nccl-version", "net-plugin", "node-adds", "env-plugin", "transport",
                        "nccl-conf",
                        "tuner", "gin-rma"})


def _none(fp: dict) -> Values:
    return {}  # not a comparison of node values: check() judges the image on each node


STACK_RULE = Rule(STACK, _none, lambda _: "the image's NCCL stack differs between nodes",
                  severity="refuse")
UNKNOWN_RULE = Rule(UNKNOWN, _none, lambda _: "the job's container image cannot be checked")


def is_path_image(ref: str) -> bool:
    """pyxis reads an image whose first character is ``/`` or ``.`` as a squashfs file;
    anything else is a registry reference (pyxis v0.24.0 ``pyxis_slurmstepd.c``:
    ``strspn(image, "./") > 0``)."""
    return ref.startswith(("/", "."))


def configured_registries(refs: tuple[str, ...]) -> tuple[str, ...]:
    """The registries of ``[registry] refs`` (those that parse)."""
    from ncclguard.fingerprint.imageref import RefError, parse

    out = []
    for text in refs:
        try:
            out.append(parse(text).registry)
        except RefError:
            continue
    return tuple(out)


def registry_reason(cfg: RegistryConfig, registry: str) -> str | None:
    """Why the collector does not read references on ``registry`` (None: it does)."""
    if not cfg.enabled:
        return "[registry] enabled is false: registry images are not read"
    if not cfg.allows(registry, configured_registries(cfg.refs)):
        return (f"registry {registry} is neither in [registry] registries nor a refs entry's: "
                "the collector does not contact it")
    return None


def registry_image(row: Mapping[str, object] | None, now: float, cfg: RegistryConfig,
                   registry: str) -> tuple[dict | None, str | None] | None:
    """What the gate (and ``check --image``) judges a registry reference by: the
    inventory's row (``Inventory.load_registry_values``) as
    :func:`ncclguard.policy.evaluate_image`'s ``image``: None (not in the index),
    ``(values, None)`` (the image of the digest the tag resolved to, resolved at most
    ``max_age_s`` ago), or ``(None, why)``."""
    why = registry_reason(cfg, registry)
    if why is not None:
        return None, why
    max_age_s = cfg.max_age_s
    if row is None:
        return None
    digest, resolved = row.get("digest"), row.get("resolved_at")
    if not digest or not isinstance(resolved, int | float):
        return None, f"not resolved yet: {row.get('state')}: {row.get('error')}"
    age = now - float(resolved)
    if age > max_age_s:
        last = f"; the last attempt: {row.get('state')}: {row.get('error')}" if row.get(
            "state") != "ok" else ""
        return None, (f"resolved {age:.0f}s ago, more than [registry] max_age_s "
                      f"({max_age_s:.0f}s): the tag may have moved{last}")
    if not row.get("read"):
        return None, f"its digest {digest} is not read yet (the collector reads it next)"
    if row.get("values") is None:
        return None, f"{digest} unreadable: {row.get('image_error')}"
    return row["values"], None  # type: ignore[return-value]


def checkable(values: Mapping | None) -> bool:
    """Whether the gate judges a job by these image values (``image-stack``): the image
    holds a libnccl the job would load, with its net ABIs; otherwise ``image-unknown``."""
    return bool(values and values.get("nccl_version") and values.get("net_abis"))


def class_samples(records: Mapping[str, dict | None], classes: Mapping[str, str | None]
                  ) -> dict[str, list[dict]]:
    """class feature -> one gate record for each distinct container value among its nodes
    (``records``: by host; ``classes``: host -> its class). :func:`runnable_classes` judges
    these, so that its cost follows the distinct records, not the nodes."""
    distinct: dict[str, dict[str, dict]] = {}
    for host, cls in classes.items():
        if cls is None:
            continue
        by_value = distinct.setdefault(cls, {})
        rec = records.get(host)
        if rec is not None:
            c = rec.get("container")
            by_value.setdefault(repr(sorted(c.items())) if isinstance(c, dict) else "", rec)
    return {cls: list(by_value.values()) for cls, by_value in distinct.items()}


def runnable_classes(image: Mapping, samples: Mapping[str, list[dict]]) -> tuple[str, ...] | None:
    """The classes (of :func:`class_samples`) on whose nodes a job in ``image`` meets no
    ``image-stack`` finding (:func:`check_stack`, the gate's own comparison), for
    job_submit.lua to offer an image job only those (docs/containers.md, "Prevention at
    submit").

    A class runs the image when no node of it falls back and all use one transport, or
    when its nodes' records do not say what they inject (the gate then warns, and
    decides); it does not when every node of it falls back. None when the answer is not
    the same for all nodes of some class (some fall back, others not, or two transports):
    one class feature cannot say that, so the caller offers no image group and the gate
    decides, as before.
    """
    able = []
    for cls, recs in sorted(samples.items()):
        sample = {str(i): rec for i, rec in enumerate(recs)}
        found, odd, _unsaid = check_stack("", image, sample, "refuse")
        if not found:
            able.append(cls)
        elif set(odd) != set(sample):
            return None  # some of the class would run it, some not
    return tuple(able)


def _injected(text: str | None) -> dict | None:
    if not text:
        return None
    name, _, abis = text.rpartition("|")
    return {"name": name, "abis": [int(a) for a in abis.split(",") if a.isdigit()]}


def _abis(abis: list[int]) -> str:
    return f"v{abis[0]}..v{abis[-1]}" if len(abis) > 1 else (f"v{abis[0]}" if abis else "none")


def stacks(image: Mapping, records: Mapping[str, dict | None]) -> dict[str, dict | None]:
    """host -> its effective stack (:func:`ncclguard.fingerprint.image.effective_stack`),
    None when the node's record does not say what it injects."""
    out: dict[str, dict | None] = {}
    for host, rec in records.items():
        c = (rec or {}).get("container")
        if not isinstance(c, dict) or c.get("injected") is None:
            out[host] = None
            continue
        out[host] = effective_stack(dict(image), _injected(c["injected"]), c.get("internal"))
    return out


def label(image: Mapping, st: dict, ref: str = "") -> str:
    """One node group in the user's terms: the image's NCCL (and the image's file name,
    so that the one-line AdminComment names it) with the plugin it uses there."""
    name = ref.rstrip("/").rsplit("/", 1)[-1]
    nccl = f"NCCL {image.get('nccl_version') or 'unknown'}" + (f" ({name})" if name else "")
    plugin = st.get("plugin")
    if plugin is None:
        return f"{nccl}, no net plugin: {st.get('transport') or 'transport unknown'}"
    who = "the node's" if st.get("source") == "node" else "the image's"
    name = plugin.get("name") or "plugin"
    if st.get("fallback"):
        return (f"{nccl} cannot use {who} {name} ({_abis(plugin.get('abis') or [])}; "
                f"it wants {_abis(list(image.get('net_abis') or []))}): falls back to "
                f"{st.get('transport') or 'an unknown transport'}")
    return f"{nccl} with {who} {name} v{st.get('abi')}"


def check_stack(ref: str, image: Mapping, records: Mapping[str, dict | None],
                severity: str, *, rule: str = STACK, subject: str | None = None
                ) -> tuple[list[Finding], list[str], list[str]]:
    """``(findings, odd hosts, hosts whose record does not say)`` of the image on these
    nodes. Odd: every node outside the largest group that uses its plugin (a group that
    falls back is odd even when it is the largest). ``rule`` and ``subject`` (``image
    REF``) name the finding: a job's own NCCL is judged the same way (issue 40,
    :mod:`ncclguard.policy.rules.jobnccl`)."""
    per_host = stacks(image, records)
    unknown = sorted(h for h, st in per_host.items() if st is None and records.get(h))
    groups: dict[str, list[str]] = {}
    fallback: set[str] = set()
    transports: dict[str, str | None] = {}
    for host, st in per_host.items():
        if st is None:
            continue
        lab = label(image, st, ref)
        groups.setdefault(lab, []).append(host)
        transports[lab] = st.get("transport")
        if st.get("fallback"):
            fallback.add(lab)
    if not groups:
        return [], [], unknown
    differ = len({transports[lab] for lab in groups}) > 1
    if not fallback and not differ:
        return [], [], unknown
    nccl = image.get("nccl_version") or "(unknown)"
    parts = []
    if fallback:
        parts.append(f"its NCCL {nccl} cannot use the net plugin on some nodes and falls back "
                     "to its own transport there")
    if differ:
        parts.append(("so " if fallback else f"its NCCL {nccl} ") + "the nodes would use "
                     "different transports (NCCL does not compare them: the job hangs or "
                     "fails with 'wrong type')")
    msg = f"{subject or 'image ' + ref}: " + ", ".join(parts)
    ordered: list[tuple[str, list[str]]] = sorted(groups.items(),
                                                  key=lambda g: (len(g[1]), g[0]))
    finding = Finding.from_hosts(rule, severity, msg, ordered)
    good = [lab for lab in groups if lab not in fallback]
    keep = max(good, key=lambda lab: (len(groups[lab]), lab)) if good else None
    odd = sorted(h for lab, hs in groups.items() if lab != keep for h in hs)
    return [finding], odd, unknown


def unknown_finding(ref: str, why: str, hosts: list[str], severity: str) -> Finding:
    return Finding.from_hosts(UNKNOWN, severity, f"image {ref} cannot be checked: {why}",
                              [(why, hosts)])
