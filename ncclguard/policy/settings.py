"""The config as the policy reads it: rule severities and the pinned baseline's keys.

``ncclguard.config`` parses and types the file; the names in ``[policy.severity]`` and
``[baseline]`` are the rules' (:data:`ncclguard.policy.rules.RULES`), so they are checked
here. Every program loads its config with :func:`load_config`.

Standard library only: the gate's path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ncclguard.config import Config, ConfigError, PolicyConfig, load
from ncclguard.policy.rules import BY_NAME, RULES

__all__ = [
    "BASELINE_KEYS",
    "DEFAULT_SEVERITY",
    "check_config",
    "load_config",
    "severity_of",
]

#: Each rule's default severity.
DEFAULT_SEVERITY: dict[str, str] = {r.name: r.severity for r in RULES}

#: The keys of ``[baseline]``, each with the rule that compares it.
BASELINE_KEYS: dict[str, str] = {k: r.name for r in RULES for k in r.baseline_keys}


def severity_of(config: PolicyConfig, rule: str) -> str:
    """The configured severity of ``rule``, else its default (``warn`` for a name that is
    not a rule: a severity table built in code may name none)."""
    sev = config.severity.get(rule)
    if sev is not None:
        return sev
    known = BY_NAME.get(rule)
    return known.severity if known is not None else "warn"


def severity_table(config: PolicyConfig) -> Mapping[str, str]:
    """``{rule: severity}`` for every rule."""
    return {r.name: severity_of(config, r.name) for r in RULES}


def check_config(config: Config) -> Config:
    """``config`` with every rule's severity filled in; :class:`ConfigError` (naming the
    file) for a rule or a baseline key that does not exist."""
    where = config.source
    for rule in config.policy.severity:
        if rule not in BY_NAME:
            known = ", ".join(BY_NAME)
            raise ConfigError(f"{where}: policy.severity: unknown rule {rule!r} (known: {known})")
    for key in config.baseline:
        if key not in BASELINE_KEYS:
            known = ", ".join(BASELINE_KEYS)
            raise ConfigError(f"{where}: baseline.{key}: unknown key (known: {known})")
    policy = config.policy.replace(severity=dict(severity_table(config.policy)))
    return config.replace(policy=policy)


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """:func:`ncclguard.config.load`, then :func:`check_config`."""
    return check_config(load(path))
