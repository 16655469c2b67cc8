"""nccl-version: the default libnccl, and every configured library path, must have the
same full version (major.minor.patch) on every node; a path on some nodes only is a finding.

NCCL fact (docs/nccl.md, "Version agreement between ranks"): ranks compare
``NCCL_VERSION_CODE`` at init only since 2.23.4, and it covers the patch level (2.26.2 vs
2.26.5 fails). Older pairs are not detected at all: the job hangs or fails later with
unrelated-looking errors. So the policy compares the full version itself. The version is
read from the library's banner, never from a file name; a library without one is unknown.
"""

from __future__ import annotations

from collections.abc import Mapping

from ncclguard.fingerprint.fields import nccl_version
from ncclguard.policy.rules.base import ANY, Rule, Values, check_rule
from ncclguard.policy.verdict import Finding

NAME = "nccl-version"
DEFAULT = "nccl"  # the aspect of the default libnccl.so.2; other aspects are paths


def values(fp: dict) -> Values:
    libs = fp.get("libnccl")
    if libs is None:
        return {ANY: None}
    out: Values = {ANY: "missing", DEFAULT: nccl_version(fp)}
    for lib in libs:
        path = lib.get("path")
        if lib.get("origin") == "config" and isinstance(path, str):
            out[path] = lib.get("version")
    return out


def message(aspect: str) -> str:
    if aspect == DEFAULT:
        return "NCCL versions differ: ranks on different versions hang or fail at init"
    return f"{aspect}: NCCL version differs, or the library is missing on some nodes"


RULE = Rule(
    NAME,
    values,
    message,
    severity="refuse",
    fields=(r"^compat\.(nccl|nccl_paths)$", r"^libnccl\[[^\]]*\]\.(version|version_code)$"),
    baseline_keys=("nccl",),
)


def check(fingerprints: Mapping[str, dict], severity: str = RULE.severity) -> list[Finding]:
    """Findings of nccl-version over ``{host: fingerprint}``."""
    return check_rule(RULE, fingerprints, severity)
