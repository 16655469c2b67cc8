"""A job's own ``NCCL_*`` variables, applied to the nodes' records (issue 40, docs/jobs.md).

NCCL puts ``/etc/nccl.conf`` into its environment with ``setenv(..., 0)``: a variable
that the job's environment sets wins over the file on every node (docs/nccl.md, "Config
files"). The gate reads a batch job's variables from its saved environment
(``prolog/ownnccl.py``); :func:`apply` turns each node's record (``node_values``) into
what that job meets there:

- **nccl-conf** does not compare a setting the job sets: the job's value holds on every
  node alike.
- **The transport** (``NCCL_NET``, ``NCCL_IB_DISABLE``, ``NCCL_IB_HCA``,
  ``NCCL_SOCKET_IFNAME``) is derived again on each node, with the job's values over the
  file's, from the inputs its record keeps
  (:func:`ncclguard.fingerprint.transport.transport_under`): the ``transport`` rule's
  value for a job on the host's NCCL, the node's own transport (``container.internal``)
  for a job with its own NCCL.
- **A plugin variable** (``NCCL_NET_PLUGIN``, ...): a node records what the value of its
  ``/etc/nccl.conf`` opens, not what any other value would. Where the job's value names
  the same libraries as the file's (for the job's own release: the same
  :func:`ncclguard.fingerprint.loading.own_names`; for the host's NCCL: the same text),
  the record holds. For a job's own NCCL, a value that names no library at all (``none``
  from 2.28.3, an empty list from 2.27.3) means no net plugin on any node: exact without
  the node. Any other value is not known.

What a record cannot tell is never taken as "the same": the node keeps the value its
record has (what ``/etc/nccl.conf`` gives it), and **job-vars** (warn by default) names
the variable and the nodes. A user's variable can so remove a difference only where its
effect on every node is known, never hide one.

``NCCL_CONF_FILE``: the settings of the job's own file also win over ``/etc/nccl.conf``;
the gate does not read users' files, so the verdict notes it and judges by the nodes'.

Pure and standard library only, like :mod:`ncclguard.policy.evaluation`: the gate's path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from ncclguard.fingerprint.loading import own_names, parse_version, rules_for
from ncclguard.fingerprint.offers import NONE
from ncclguard.fingerprint.transport import TRANSPORT_SETTINGS, transport_under
from ncclguard.policy.rules.base import ANY

__all__ = ["PLUGIN_VARS", "Applied", "apply", "shown"]

#: The variable naming each plugin kind's library, and whether a rule compares that kind
#: for a job on the host's NCCL (net-plugin, env-plugin, tuner, gin-rma; no rule compares
#: profilers). A job with its own NCCL is compared by its net plugin only (job-stack).
PLUGIN_VARS = {"NCCL_NET_PLUGIN": "net", "NCCL_ENV_PLUGIN": "env",
               "NCCL_TUNER_PLUGIN": "tuner", "NCCL_GIN_PLUGIN": "gin",
               "NCCL_RMA_PLUGIN": "rma"}
CONF_FILE = "NCCL_CONF_FILE"
#: ``NCCL_NET`` values that name NCCL's own networks (compared case-insensitively).
_INTERNAL = ("ib", "socket")


class Applied(NamedTuple):
    """The records a job meets (``records``), what could not be applied (``unapplied``:
    ``(why, hosts)`` in the variables' order) and the verdict's ``notes``."""

    records: dict[str, dict | None]
    unapplied: list[tuple[str, list[str]]]
    notes: list[str]


def shown(name: str, value: str) -> str:
    """``NAME=value`` for a message: the value cut (:func:`ncclguard.text.cut`) and every
    character that is not printable ASCII escaped (the value is the user's)."""
    from ncclguard.text import cut, safe

    return f"{name}={safe(cut(value))}"


def apply(records: Mapping[str, dict | None], variables: Mapping[str, str],
          release: str | None = None) -> Applied:
    """``records`` (``node_values``) as the job with these ``NCCL_*`` ``variables`` meets
    them (module doc). ``release``: the job's own NCCL's release (a label of the offers
    table, :func:`ncclguard.fingerprint.offers.release_for`), None for a job on the
    host's NCCL. Records are copied where changed, never changed in place (the gate shares
    one decoded record between equal nodes)."""
    if not any(k.startswith("NCCL_") for k in variables):
        return Applied(dict(records), [], [])
    own = release is not None
    transport = {k: v for k, v in variables.items() if k in TRANSPORT_SETTINGS}
    plugins = {k: v for k, v in variables.items() if k in PLUGIN_VARS
               and (PLUGIN_VARS[k] == "net" or not own)}
    out: dict[str, dict | None] = {}
    missed: dict[str, list[str]] = {}
    # nodes with equal records share one decoded object (Inventory.load_values): each is
    # worked out once, so the cost follows the distinct records, not the nodes
    done: dict[int, tuple[dict, list[str]]] = {}
    for host, rec in records.items():
        if not isinstance(rec, dict):
            out[host] = rec
            continue
        seen = done.get(id(rec))
        if seen is None:
            whys: list[str] = []
            seen = done[id(rec)] = (_node(rec, variables, transport, plugins, release, own,
                                          whys), whys)
        out[host] = seen[0]
        for why in seen[1]:
            missed.setdefault(why, []).append(host)
    notes = []
    applied = sorted(k for k in variables if k.startswith("NCCL_") and k != CONF_FILE)
    if applied:
        notes.append(f"the job's own {', '.join(applied)} applied on each node where the "
                     "nodes' records can tell their effect (the job's environment wins "
                     "over /etc/nccl.conf)")
    if CONF_FILE in variables:
        notes.append(f"{shown(CONF_FILE, variables[CONF_FILE])}: that file's settings win "
                     "over /etc/nccl.conf, and the gate does not read users' files: "
                     "judged by the nodes' settings")
    return Applied(out, list(missed.items()), notes)


def _node(rec: dict, variables: Mapping[str, str], transport: Mapping[str, str],
          plugins: Mapping[str, str], release: str | None, own: bool,
          missed: list[str]) -> dict:
    """One node's record as the job meets it; what cannot be applied is added to
    ``missed``."""
    rules = rec.get("rules")
    if not isinstance(rules, dict):
        return rec
    new = dict(rec)
    new_rules = dict(rules)
    new["rules"] = new_rules
    conf = rules.get("nccl-conf")
    known = isinstance(conf, dict) and conf.get(ANY) is not None
    if isinstance(conf, dict):
        new_rules["nccl-conf"] = {a: v for a, v in conf.items() if a not in variables}
    got_job = rec.get("job")
    job: dict = got_job if isinstance(got_job, dict) else {}
    for name, value in plugins.items():
        here = conf.get(name) if known and isinstance(conf, dict) else None
        if known and value == here:
            continue
        if own and known and release is not None:
            outcome = _own_net(value, here, release)
            if outcome == "same":
                continue
            if outcome == "none":
                job = new["job"] = {**job, "net": NONE}
                continue
        why = (f"{shown(name, value)}: which library it opens on these nodes is not in their "
               "records (they record what their /etc/nccl.conf's value opens): judged by "
               "that" if known else
               f"{shown(name, value)}: these nodes' /etc/nccl.conf could not be read: "
               "judged by their records")
        missed.append(why)
    if transport:
        got = transport_under(job.get("inputs"), transport, with_plugin=not own)
        if got is None:
            why = (", ".join(shown(k, v) for k, v in sorted(transport.items())) +
                   ": these nodes' records cannot tell which transport that gives them "
                   "(a node daemon before this release, or a value the node could not "
                   "read): judged by their own settings")
            missed.append(why)
        elif own:
            got_container = rec.get("container")
            container: dict = got_container if isinstance(got_container, dict) else {}
            new["container"] = {**container, "internal": got}
            if str(transport.get("NCCL_NET", "")).lower() in _INTERNAL:
                # NCCL takes the network so named: its own, never a plugin's (the
                # transport's rule 1, ncclguard/fingerprint/transport.py)
                new["job"] = {**job, "net": NONE}
        else:
            before = rules.get("transport")
            new_rules["transport"] = {**(before if isinstance(before, dict) else {}),
                                      "transport": got}
    return new


def _own_net(value: str, conf: str | None, release: str) -> str:
    """For a job's own NCCL of ``release``: ``"same"`` when ``value`` of
    ``NCCL_NET_PLUGIN`` names the libraries the node's ``conf`` value names, ``"none"``
    when it names none at all, else ``"other"``."""
    rules = rules_for(parse_version(release))
    mine = own_names("net", value, rules)
    if mine == own_names("net", conf, rules):
        return "same"
    return "none" if not mine else "other"
