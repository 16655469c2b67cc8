"""Reading Slurm's ``--json`` answers by what they say they are.

Every answer carries a ``meta`` block that names the Slurm release and the data parser
that wrote it (22.05: ``meta.plugin.type = "openapi/v0.0.38"``; 23.02 on:
``meta.plugin.data_parser = "data_parser/v0.0.39"`` and later). The parser decides the
shape, not the release: a 24.11 asked for ``--json=v0.0.41`` answers in v0.0.41's shape.
Two schema families cover every parser from 22.05 to 25.11 (docs/slurm-versions.md):

- ``flat`` (v0.0.38, Slurm 22.05): plain numbers, a job's state as a string, a node's base
  state as a lower-case string with its flags apart (``state_flags``), features as one
  comma-separated string, ``standard_output`` as the user wrote the pattern.
- ``typed`` (v0.0.39 to v0.0.44, Slurm 23.02 to 25.11): numbers that may be unset as
  ``{"set", "infinite", "number"}``, states as lists (base state first, then flags),
  features as lists. ``standard_output`` comes expanded by Slurm (``%j %x %u %A %a``;
  ``%N`` left) from v0.0.39 to v0.0.42, and raw again from v0.0.43 (25.05), which adds
  ``stdout_expanded`` with ``%N`` as the batch host (``(null)`` while pending): we expand
  the raw pattern ourselves there, as on 22.05.

An answer from an unknown parser, or one whose records lack what we read, raises
:class:`SlurmSchemaError` naming the release and the parser, so that every caller's
fall-back for a failed Slurm call applies; nothing is guessed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ncclguard.slurm.model import JobInfo, NodeInfo, Release, SlurmError, SlurmSchemaError
from ncclguard.slurm.paths import output_path

NO_VAL = 4294967294  # Slurm's "not set" for 32-bit numbers (array_task_id of a plain job)


@dataclass(frozen=True)
class Meta:
    """An answer's ``meta``: who wrote it."""

    release: Release | None
    parser: str  # "v0.0.38" ... "v0.0.44"; "" when the answer names none

    def describe(self) -> str:
        who = f"Slurm {self.release}" if self.release else "a Slurm that names no release"
        return f"{who} ({f'data parser {self.parser}' if self.parser else 'no data parser'})"


def read_meta(data: Mapping[str, Any]) -> Meta:
    """The ``meta`` block of an answer, in any release's spelling."""
    meta = data.get("meta")
    if not isinstance(meta, dict):
        return Meta(None, "")
    # "plugin" (22.05, 23.11 on) or "plugins" (23.02)
    plugin = next((p for p in (meta.get("plugin"), meta.get("plugins")) if isinstance(p, dict)), {})
    parser = str(plugin.get("data_parser") or "")
    if not parser and str(plugin.get("type") or "").startswith("openapi/v0.0.3"):
        parser = str(plugin["type"])  # 22.05 names its openapi plugin only
    parser = parser.rpartition("/")[2]
    slurm = meta.get("slurm") or meta.get("Slurm")  # 23.11 on: "slurm"; before: "Slurm"
    release: Release | None = None
    if isinstance(slurm, dict):
        v = slurm.get("version")
        if isinstance(v, dict):  # numbers (22.05, 23.02) or strings (23.11 on)
            try:
                release = Release(int(v["major"]), int(v["minor"]), int(v.get("micro") or 0))
            except (KeyError, TypeError, ValueError, OverflowError):
                release = None
        if release is None and isinstance(slurm.get("release"), str):
            try:
                release = Release.parse(slurm["release"])
            except SlurmError:
                release = None
    return Meta(release, parser)


# ------------------------------------------------------------ value shapes
class _BadShape(ValueError):
    """A field of a record is not of any shape a known parser writes (the message names
    the field); parse_nodes/parse_jobs turn it into a SlurmSchemaError."""


_NUMBER_KEYS = frozenset({"set", "infinite", "number"})


class _Fields:
    """The fields of one record, each read strictly: a value of another shape than the
    parsers write is a :class:`_BadShape`, never a guess (``"partitions": 5`` is not a
    partition named "5")."""

    def __init__(self, record: Mapping[str, Any]) -> None:
        self.record = record

    def _bad(self, key: str, want: str) -> _BadShape:
        got = self.record.get(key)
        return _BadShape(f"{key!r} is {type(got).__name__} {str(got)[:60]!r}, not {want}")

    def text(self, key: str) -> str:
        v = self.record.get(key)
        if v is None:
            return ""
        if isinstance(v, str):
            return v
        raise self._bad(key, "a string")

    def number(self, key: str) -> int | None:
        """A plain number, or v0.0.39+'s ``{"set": true, "infinite": false, "number": 5}``;
        None when absent, unset or infinite."""
        v = self.record.get(key)
        if isinstance(v, dict) and v.keys() <= _NUMBER_KEYS:
            if v.get("set") is False or v.get("infinite") is True:
                return None
            v = v.get("number")
        if v is None:
            return None
        if isinstance(v, int):  # bool included: some parsers write flags as numbers
            return int(v)
        raise self._bad(key, "a number")

    def int(self, key: str) -> int:
        n = self.number(key)
        return 0 if n is None else n

    def epoch(self, key: str) -> float | None:
        n = self.number(key)
        return float(n) if n is not None and n > 0 else None

    def flag(self, key: str) -> bool:
        v = self.record.get(key)
        if v is None or isinstance(v, (bool, int)):
            return bool(v)
        raise self._bad(key, "a boolean")

    def words(self, key: str) -> tuple[str, ...]:
        """A list of strings, or one comma-separated string."""
        v = self.record.get(key)
        if v is None:
            return ()
        if isinstance(v, str):
            return tuple(w for w in v.split(",") if w)
        if isinstance(v, list) and all(isinstance(x, str) for x in v):
            return tuple(x for x in v if x)
        raise self._bad(key, "a list of strings")


# ------------------------------------------------------------ the two families
@dataclass(frozen=True)
class Family:
    """How one family of data parsers spells the fields the adapter reads: its node
    record, and which of its parsers expand output paths. Job records of both families
    differ only in value shapes, which :func:`_job` reads both ways."""

    name: str
    parsers: tuple[str, ...]
    node: Callable[[Mapping[str, Any]], NodeInfo]
    expanded: tuple[str, ...] = ()  # parsers whose standard_output Slurm expanded
    mod10: tuple[str, ...] = ()  # parsers of releases (24.11+) whose nodes expand %b


def _node(f: _Fields, state: str, flags: tuple[str, ...]) -> NodeInfo:
    """A node record: the fields both families spell alike, and its state as read."""
    return NodeInfo(
        name=f.text("name") or f.text("hostname"),
        state=state.lower(),
        flags=tuple(x.upper() for x in flags),
        reason=f.text("reason"),
        partitions=f.words("partitions"),
        features=f.words("features"),
        active_features=f.words("active_features"),
        cpus=f.int("cpus"),
        address=f.text("address"),
        hostname=f.text("hostname"),
    )


def _flat_node(n: Mapping[str, Any]) -> NodeInfo:
    f = _Fields(n)
    return _node(f, f.text("state"), f.words("state_flags"))


def _typed_node(n: Mapping[str, Any]) -> NodeInfo:
    f = _Fields(n)
    states = f.words("state")  # ["IDLE", "DRAIN"]: the base state, then flags
    return _node(f, states[0] if states else "", states[1:])


def _comments(f: _Fields) -> tuple[str, str]:
    """(the job's comment, the admin comment): two strings, or 23.02-style
    ``"comment": {"job", "administrator", "system"}``."""
    c = f.record.get("comment")
    if isinstance(c, dict):
        inner = _Fields(c)
        return inner.text("job"), inner.text("administrator")
    return f.text("comment"), f.text("admin_comment")


# Slurm's job_state_string(): a flag, when set, names the state before the base does.
# v0.0.38 and v0.0.39 give that string; v0.0.40+ give [base, flags...]: read alike.
_STATE_FLAGS = ("COMPLETING", "STAGE_OUT", "CONFIGURING", "RESIZING", "REQUEUED",
                "REQUEUE_FED", "REQUEUE_HOLD", "SPECIAL_EXIT", "STOPPED", "REVOKED",
                "RESV_DEL_HOLD", "SIGNALING")  # fmt: skip


def _job_state(states: tuple[str, ...]) -> str:
    upper = [s.upper() for s in states]
    for flag in _STATE_FLAGS:
        if flag in upper[1:]:
            return flag
    return upper[0] if upper else ""


def _job(j: Mapping[str, Any], expanded: bool, mod10: bool) -> JobInfo:
    """One job record of either family (the two differ only in value shapes, which
    :class:`_Fields` reads both ways)."""
    f = _Fields(j)
    task = f.number("array_task_id")
    array_task = None if task is None or task >= NO_VAL else task
    # the fields output_path() needs are JobInfo fields too: read them once
    where: dict[str, Any] = {
        "job_id": f.int("job_id"),
        "name": f.text("name"),
        "user": f.text("user_name"),
        "array_job_id": f.int("array_job_id"),
        "array_task_id": array_task,
        "work_dir": f.text("current_working_directory"),
        "batch": f.flag("batch_flag"),
    }
    out, err = f.text("standard_output"), f.text("standard_error")
    if expanded:  # Slurm expanded the patterns itself (and named the default files)
        std_out, std_err = out, err or out
    else:
        std_out = output_path(out, **where, array_mod10=mod10)
        # no --error: the same file as StdOut
        std_err = output_path(err or out, **where, array_mod10=mod10)
    comment, admin_comment = _comments(f)
    return JobInfo(
        **where,
        state=_job_state(f.words("job_state")),
        user_id=f.number("user_id"),
        partition=f.text("partition"),
        nodes=f.text("nodes"),
        node_count=f.int("node_count"),
        required_nodes=f.text("required_nodes"),
        excluded_nodes=f.text("excluded_nodes"),
        state_reason=f.text("state_reason"),
        restart_count=f.int("restart_cnt"),
        admin_comment=admin_comment,
        comment=comment,
        priority=f.int("priority"),
        start_time=f.epoch("start_time"),
        end_time=f.epoch("end_time"),
        batch_host=f.text("batch_host"),
        std_out=std_out,
        std_err=std_err,
        raw=dict(j),
    )


FLAT = Family("flat", ("v0.0.38",), _flat_node)
TYPED = Family(
    "typed",
    ("v0.0.39", "v0.0.40", "v0.0.41", "v0.0.42", "v0.0.43", "v0.0.44"),
    _typed_node,
    expanded=("v0.0.39", "v0.0.40", "v0.0.41", "v0.0.42"),
    mod10=("v0.0.42", "v0.0.43", "v0.0.44"),
)
FAMILIES = (FLAT, TYPED)
KNOWN_PARSERS = tuple(p for f in FAMILIES for p in f.parsers)
NEWEST_PARSER = KNOWN_PARSERS[-1]

# The parser to ask for (``--json=vX``, which 23.11 introduced): each release's own
# newest, which it always carries; past 25.11, v0.0.44 (26.05 carries v0.0.42-v0.0.45).
# Asking keeps the shape fixed whatever a site's DataParserParameters (24.11+) says.
_SELECT_FROM = (
    (Release(25, 11), "v0.0.44"),
    (Release(25, 5), "v0.0.43"),
    (Release(24, 11), "v0.0.42"),
    (Release(24, 5), "v0.0.41"),
    (Release(23, 11), "v0.0.40"),
)


def parser_for(release: Release) -> str | None:
    """The data parser to select on ``release``'s command line; None before 23.11, where
    ``--json`` takes no argument (22.05: openapi/v0.0.38; 23.02: v0.0.39 only)."""
    for since, parser in _SELECT_FROM:
        if release >= since:
            return parser
    return None


def family_of(meta: Meta, what: str) -> Family:
    for fam in FAMILIES:
        if meta.parser in fam.parsers:
            return fam
    raise SlurmSchemaError(
        f"{what}: {meta.describe()} answered in a shape this ncclguard cannot read "
        f"(it reads the data parsers {KNOWN_PARSERS[0]} to {NEWEST_PARSER}: "
        "Slurm 22.05 to 25.11, see docs/slurm-versions.md)"
    )


# What every parser from v0.0.38 to v0.0.44 writes in each record, and a missing one
# would silently change a decision (no partitions: an empty partition; no nodes: none).
NODE_KEYS = ("name", "state", "partitions", "features", "reason")
JOB_KEYS = ("job_id", "job_state", "nodes", "batch_flag", "excluded_nodes", "required_nodes",
            "standard_output", "current_working_directory", "partition")  # fmt: skip


def _records(data: Mapping[str, Any], key: str, meta: Meta, what: str) -> list[dict[str, Any]]:
    records = data.get(key)
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise SlurmSchemaError(f"{what}: {meta.describe()} answered without a list of {key!r}")
    return records


def _require(record: Mapping[str, Any], keys: tuple[str, ...], meta: Meta, what: str) -> None:
    missing = [k for k in keys if record.get(k) is None]  # absent or null
    if missing:
        raise SlurmSchemaError(
            f"{what}: {meta.describe()} answered a record without {', '.join(missing)}"
        )


def parse_nodes(data: Mapping[str, Any], what: str = "nodes") -> list[NodeInfo]:
    """Node records, one per node: 22.05's ``sinfo --json``, or ``scontrol show nodes
    --json`` (23.02+). From 23.02 ``sinfo --json`` lists groups of nodes (``sinfo``), whose
    reason and features are one member's: not read here."""
    meta = read_meta(data)
    fam = family_of(meta, what)
    if "sinfo" in data and "nodes" not in data:
        raise SlurmSchemaError(
            f"{what}: {meta.describe()} lists groups of nodes, not nodes "
            "(read scontrol show nodes --json there)"
        )
    out = []
    for n in _records(data, "nodes", meta, what):
        _require(n, NODE_KEYS, meta, what)
        try:
            out.append(fam.node(n))
        except _BadShape as e:
            raise SlurmSchemaError(f"{what}: {meta.describe()} answered a node with {e}") from None
    return out


def parse_jobs(data: Mapping[str, Any], what: str = "jobs") -> list[JobInfo]:
    """Job records from ``squeue --json`` or ``scontrol show job --json`` (23.02+)."""
    meta = read_meta(data)
    fam = family_of(meta, what)
    expanded, mod10 = meta.parser in fam.expanded, meta.parser in fam.mod10
    out = []
    for j in _records(data, "jobs", meta, what):
        _require(j, JOB_KEYS, meta, what)
        try:
            out.append(_job(j, expanded, mod10))
        except _BadShape as e:
            raise SlurmSchemaError(f"{what}: {meta.describe()} answered a job with {e}") from None
    return out
