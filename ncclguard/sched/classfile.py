"""The file of classes that ``slurm/job_submit.lua`` reads: lua cannot ask Slurm for nodes.

One line per fact, words split by spaces; the lua parses it with the same strict rules as
:func:`parse` (an unknown or malformed line makes the whole file unusable, and the lua
then adds no constraint: the gate stays the check)::

    ncclguard-classes 1
    verified 1764523456          # Slurm was seen holding these features at this time
    min_nodes 2                  # [policy] min_nodes: smaller jobs are not checked
    max_alternatives 64          # [features] max_alternatives
    opt_out 1                    # [gate] allow_opt_out: ncclguard=off in comment/extra
    guarded *                    # [policy] partitions ("*": every partition)
    partition * nc_1a2b3c4d:12 nc_99aa00bb:4     # every node, largest class first
    partition gpu nc_1a2b3c4d:8 nc_99aa00bb:4
    end

``verified`` is rewritten by the sync daemon each time it has seen Slurm holding the
features; the lua trusts the file only while ``verified`` is recent and not older than
its own start (a restarted slurmctld lost the runtime features, docs/scheduling.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ncclguard.audit import check_dir
from ncclguard.policy.schedule import MAX_ALTERNATIVES, ClassCount
from ncclguard.spool import atomic_write

__all__ = ["MAGIC", "ClassFile", "ClassFileError", "parse", "read", "render", "write"]

MAGIC = "ncclguard-classes 1"
FILE_MODE = 0o644  # slurmctld (SlurmUser) reads it; the sync (SlurmUser) writes it
MAX_BYTES = 1 << 20
#: job_submit.lua's FRESH_S: it ignores a file verified longer ago than this
#: (tests/test_sched.py checks that the two agree).
LUA_FRESH_S = 60
ALL = "*"  # the partition entry for every node, and "every partition is guarded"

_FEATURE = re.compile(r"nc_(?:unknown|[0-9a-f]{8,64})")
_PARTITION = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_DIGITS = re.compile(r"[0-9]{1,18}")
_SPACE = re.compile(r"[ \t\r\v\f]+")


class ClassFileError(ValueError):
    """The file cannot be read or written (the message names it and the cause)."""


@dataclass(frozen=True)
class ClassFile:
    verified: int
    min_nodes: int = 2
    max_alternatives: int = MAX_ALTERNATIVES
    opt_out: bool = True
    guarded: tuple[str, ...] = ()  # () = every partition
    default: str | None = None  # Slurm's default partition: for jobs that name none
    partitions: dict[str, tuple[ClassCount, ...]] = field(default_factory=dict)


def render(cf: ClassFile) -> bytes:
    lines = [
        MAGIC,
        f"verified {int(cf.verified)}",
        f"min_nodes {cf.min_nodes}",
        f"max_alternatives {cf.max_alternatives}",
        f"opt_out {int(cf.opt_out)}",
        "guarded " + (" ".join(cf.guarded) if cf.guarded else ALL),
    ]
    bad = [p for p in cf.guarded if not _PARTITION.fullmatch(p)]
    if bad:
        raise ClassFileError(f"[policy] partitions: {bad[0]!r} is not a partition name "
                             "job_submit.lua can match (letters, digits, _ . -; 64 at most)")
    if cf.default is not None and _PARTITION.fullmatch(cf.default):
        lines.append(f"default {cf.default}")
    for name, classes in cf.partitions.items():
        if name != ALL and not _PARTITION.fullmatch(name):
            continue  # not a name the lua would match: Slurm's own are plain words
        lines.append(" ".join(["partition", name, *(f"{c.feature}:{c.nodes}" for c in classes)]))
    lines.append("end")
    return ("\n".join(lines) + "\n").encode()


def parse(text: str, where: str = "classes file") -> ClassFile:
    """:class:`ClassFile` from the file's text; :class:`ClassFileError` naming the line."""
    if not text.endswith("\n"):
        raise ClassFileError(f"{where}: cut short (no final newline)")
    lines = text.split("\n")
    if not lines or lines[0] != MAGIC:
        raise ClassFileError(f"{where}: line 1 is not {MAGIC!r}")
    values: dict[str, str] = {}
    partitions: dict[str, tuple[ClassCount, ...]] = {}
    ended = False
    for n, line in enumerate(lines[1:], start=2):
        words = [w for w in _SPACE.split(line) if w]  # ASCII white space, as lua's %s
        if not words:
            continue
        if ended:
            raise ClassFileError(f"{where}: line {n}: text after 'end'")
        key = words[0]
        if key == "end" and len(words) == 1:
            ended = True
        elif key in ("verified", "min_nodes", "max_alternatives", "opt_out") and len(words) == 2:
            if not _DIGITS.fullmatch(words[1]) or key in values:
                raise ClassFileError(f"{where}: line {n}: {line[:80]!r}")
            values[key] = words[1]
        elif key == "default" and len(words) == 2 and _PARTITION.fullmatch(words[1]) \
                and key not in values:
            values[key] = words[1]
        elif key == "guarded" and len(words) >= 2 and key not in values:
            if words[1:] != [ALL] and not all(_PARTITION.fullmatch(w) for w in words[1:]):
                raise ClassFileError(f"{where}: line {n}: not a partition name in {line[:80]!r}")
            values[key] = " ".join(words[1:])
        elif key == "partition" and len(words) >= 2:
            name = words[1]
            if (name != ALL and not _PARTITION.fullmatch(name)) or name in partitions:
                raise ClassFileError(f"{where}: line {n}: partition {name[:80]!r}")
            partitions[name] = tuple(_class(w, where, n) for w in words[2:])
        else:
            raise ClassFileError(f"{where}: line {n}: not understood: {line[:80]!r}")
    if not ended:
        raise ClassFileError(f"{where}: no 'end' line (cut short?)")
    missing = [k for k in ("verified", "min_nodes", "max_alternatives", "opt_out", "guarded")
               if k not in values]
    if missing:
        raise ClassFileError(f"{where}: missing {', '.join(missing)}")
    alternatives = int(values["max_alternatives"])
    if not 1 <= alternatives <= MAX_ALTERNATIVES:
        raise ClassFileError(f"{where}: max_alternatives {alternatives}: not 1 to 64")
    guarded = values["guarded"].split()
    return ClassFile(
        verified=int(values["verified"]),
        min_nodes=int(values["min_nodes"]),
        max_alternatives=alternatives,
        opt_out=values["opt_out"] == "1",
        guarded=() if guarded == [ALL] else tuple(guarded),
        default=values.get("default"),
        partitions=partitions,
    )


def _class(word: str, where: str, n: int) -> ClassCount:
    feature, _, count = word.partition(":")
    if not _FEATURE.fullmatch(feature) or not _DIGITS.fullmatch(count):
        raise ClassFileError(f"{where}: line {n}: not a class: {word[:80]!r}")
    return ClassCount(feature, int(count))


def write(path: Path, cf: ClassFile) -> None:
    """Replace the file atomically, in a directory only we (or root) can write: the lua
    trusts what it reads there. :class:`ClassFileError` names the path and the cause."""
    try:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        check_dir(path.parent, "the file of classes")
        atomic_write(path, render(cf), FILE_MODE)
    except OSError as e:
        raise ClassFileError(f"{path}: cannot write: {e.strerror or e}") from None


def read(path: Path) -> ClassFile:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise ClassFileError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(data) > MAX_BYTES:
        raise ClassFileError(f"{path}: larger than {MAX_BYTES} bytes")
    try:
        return parse(data.decode("utf-8"), str(path))
    except UnicodeDecodeError as e:
        raise ClassFileError(f"{path}: not UTF-8 ({e.reason})") from None
