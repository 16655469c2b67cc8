"""What every comparison rule shares: per-node values, and findings from value groups.

A rule turns one fingerprint into ``{aspect: value}`` (strings; ``None`` = unknown, which
is never a difference). The key ``"*"`` gives the value of every aspect that the node does
not list (a library path it lacks: ``"missing"``; a setting it lacks: ``"unset"``; or
``None`` when the whole source was unreadable). Nodes that show two or more known values
for one aspect make a finding, with the nodes grouped by value.

Rules compare *classes* (``(values, hosts)``), not nodes, so N identical nodes cost one
comparison.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from ncclguard.policy.verdict import Finding

__all__ = ["ANY", "PLAIN_LABEL", "Rule", "Values", "check_rule", "compare"]

ANY = "*"
Values = dict[str, str | None]


def _label(aspect: str, value: str) -> str:
    return f"{aspect} {value}"


#: The label of a rule that gives none: ``"{aspect} {value}"``.
PLAIN_LABEL = _label


class Rule:
    """A named comparison: ``values(fp)`` per node, ``message(aspect)`` for the finding.

    Each rule also carries what the rest of ncclguard needs to know of it, in this one
    place: ``severity`` (its default; ``[policy.severity]`` overrides it), ``fields``
    (regular expressions on the fingerprint's field names, as ``ncclguard diff`` and
    ``history`` name them, whose differences this rule judges) and ``baseline_keys``
    (the keys of the config's ``[baseline]`` it compares).

    ``explain(aspect, values)``, where given, writes a finding's message from the values
    that differ (smallest group first), in place of ``message(aspect)``.

    Aspects in ``warn_only`` are reported at most as warnings, never count for the odd
    nodes, and are left out when another aspect of the same rule already differs.

    Rules of one family that read the same fields share a ``source``: one function that
    returns the values of all of them, so that the policy reads each fingerprint once per
    family; such a rule's ``values`` are the ``pick`` aspects of its source.
    """

    __slots__ = (
        "baseline_keys",
        "explain",
        "fields",
        "label",
        "message",
        "name",
        "pick",
        "severity",
        "source",
        "values",
        "warn_only",
    )

    def __init__(
        self,
        name: str,
        values: Callable[[dict], Values] | None,
        message: Callable[[str], str],
        label: Callable[[str, str], str] = _label,
        warn_only: Iterable[str] = (),
        source: Callable[[dict], Values] | None = None,
        pick: Iterable[str] = (),
        *,
        severity: str = "warn",
        fields: Iterable[str] = (),
        baseline_keys: Iterable[str] = (),
        explain: Callable[[str, list[str]], str] | None = None,
    ) -> None:
        self.name = name
        self.explain = explain
        self.severity = severity
        self.fields = tuple(fields)
        self.baseline_keys = tuple(baseline_keys)
        self.message = message
        self.label = label
        self.warn_only = frozenset(warn_only)
        self.source = source
        self.pick = tuple(pick)
        if values is None:
            if source is None:
                raise ValueError(f"rule {name}: give values or source")
            values = self.project
        self.values: Callable[[dict], Values] = values

    def project(self, fp_or_source_values: dict, computed: bool = False) -> Values:
        """This rule's values from a fingerprint (or, ``computed``, from its source's)."""
        src = fp_or_source_values if computed else self.source(fp_or_source_values)  # type: ignore[misc]
        return {k: src.get(k) for k in self.pick}

    def __repr__(self) -> str:
        return f"Rule({self.name!r})"


def value_of(values: Values, aspect: str) -> str | None:
    return values[aspect] if aspect in values else values.get(ANY)


def aspects(classes: Iterable[tuple[Values, Sequence[str]]]) -> list[str]:
    """Every aspect that some class names, sorted."""
    names: set[str] = set()
    for values, _ in classes:
        names.update(values)
    names.discard(ANY)
    return sorted(names)


def compare(
    rule: Rule, severity: str, classes: Sequence[tuple[Values, Sequence[str]]]
) -> list[Finding]:
    """Findings of ``rule`` at ``severity`` over ``(values, hosts)`` classes."""
    findings: list[Finding] = []
    deferred: list[Finding] = []
    for aspect in aspects(classes):
        groups: dict[str, list[str]] = {}
        unknown: list[str] = []
        for values, hosts in classes:
            v = value_of(values, aspect)
            if v is None:
                unknown.extend(hosts)
            else:
                groups.setdefault(v, []).extend(hosts)
        if len(groups) < 2:
            continue
        ordered = sorted(groups.items(), key=lambda kv: (len(set(kv[1])), kv[0]))
        pairs = [(rule.label(aspect, v), hosts) for v, hosts in ordered]
        if unknown:
            pairs.append((f"{aspect} unknown", unknown))
        msg = (rule.explain(aspect, [v for v, _ in ordered]) if rule.explain is not None
               else rule.message(aspect))
        if aspect in rule.warn_only:
            sev = "warn" if severity == "refuse" else severity
            deferred.append(Finding.from_hosts(rule.name, sev, msg, pairs))
        else:
            findings.append(Finding.from_hosts(rule.name, severity, msg, pairs))
    return findings or deferred


def classes_of(rule: Rule, fingerprints: Mapping[str, dict]) -> list[tuple[Values, list[str]]]:
    """Group nodes by ``rule.values``: one class per distinct set of values."""
    by_key: dict[tuple, tuple[Values, list[str]]] = {}
    for host, fp in fingerprints.items():
        values = rule.values(fp)
        key = tuple(sorted(values.items(), key=lambda kv: kv[0]))
        by_key.setdefault(key, (values, []))[1].append(host)
    return list(by_key.values())


def check_rule(rule: Rule, fingerprints: Mapping[str, dict], severity: str) -> list[Finding]:
    """One rule over ``{host: fingerprint}`` (no unknown nodes): its findings."""
    return compare(rule, severity, classes_of(rule, fingerprints))
