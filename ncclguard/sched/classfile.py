"""The file of classes that ``slurm/job_submit.lua`` reads: lua cannot ask Slurm for nodes.

One line per fact, words split by spaces; the lua parses it with the same strict rules as
:func:`parse` (an unknown or malformed line makes the whole file unusable, and the lua
then adds no constraint: the gate stays the check; ``tests/test_lua_submit.py`` runs one
corpus of files through both)::

    ncclguard-classes 4
    verified 1764523456          # Slurm was seen holding these features at this time
    min_nodes 2                  # [policy] min_nodes: smaller jobs are not checked
    max_alternatives 64          # [features] max_alternatives
    opt_out 1                    # [gate] allow_opt_out: ncclguard=off in comment/extra
    required_nodes refuse        # [features] required_nodes: -w across classes
    guarded *                    # [policy] partitions ("*": every partition)
    default debug                # Slurm's default partition (optional)
    partition * nc_1a2b3c4d:12 nc_99aa00bb:4     # every node, largest class first
    partition gpu nc_1a2b3c4d:8 nc_99aa00bb:4
    members nc_1a2b3c4d n[1-12]                  # each class's nodes (all classes)
    members nc_99aa00bb gpu[01-04]
    image nvcr.io/nvidia/pytorch:25.01-py3 1764527000 nc_1a2b3c4d   # runs on these only
    image /images/old.sqsh 0                                         # runs on no class
    adds * nc_j5e6f7a8b:16                       # the second family ([features] own_nccl)
    env VIRTUAL_ENV=venv%20a nc_j5e6f7a8b        # a known environment: runs on these
    end

Line 1 and line 2 are fixed: the sync rewrites ``verified`` every few seconds, and the
lua parses the rest again only when it changed (its cost per submission does not grow
with the file). ``verified`` is trusted only while recent and not older than the lua's
own start (a restarted slurmctld lost the runtime features, docs/scheduling.md).

``members`` lists use one bracket set per item, over trailing digits only
(:func:`ncclguard.hostlist.compress`), which the lua expands; every host is in one class
at most. They let the lua refuse, at submit, a job whose required nodes (``-w``) span
classes (Slurm gives a job its required nodes whatever its constraint). Where they
would make the file larger than :data:`MAX_BYTES`, they are left out and
``required_nodes`` says ``gate``.

``image`` lines (version 3) name a container image by the key the gate looks it up by (a
path as given, or a registry reference's :attr:`~ncclguard.fingerprint.imageref.Reference.key`),
the time after which the line no longer holds (a registry tag's resolution plus
``[registry] max_age_s``; 0: none), and the classes whose nodes run it without an
``image-stack`` finding (:func:`ncclguard.policy.rules.container.runnable_classes`); a
job in that image is offered only those (none: it runs on no class, and is refused at
submit). Only images that some class cannot run are listed, at most
:data:`MAX_IMAGES`, and only as many as keep the file within :data:`MAX_BYTES`.

``adds`` and ``env`` lines (version 4, issue 40, only with ``[features] own_nccl``): the
classes of the second family (``nc_j...``: what nodes give a job that brings its own
NCCL, :func:`ncclguard.policy.schedule.adds_key`) per partition, ranked as ``partition``
lines are, and for each environment the collector resolved to a libnccl of the job's own
(``job_envs``), the key job_submit.lua builds from a batch job's environment
(:func:`ncclguard.fingerprint.jobenv.submit_key`) and the second-family classes whose
nodes run that NCCL without a ``job-stack`` finding. A job whose key has a line is
offered those classes instead of the host's (docs/scheduling.md). At most
:data:`MAX_ENVS` lines, the environments jobs used last first.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ncclguard.audit import AuditError, check_dir, lock
from ncclguard.policy.schedule import MAX_ALTERNATIVES, ClassCount
from ncclguard.sched.group import ADDS_FEATURE
from ncclguard.sched.group import HOST_FEATURE as FEATURE
from ncclguard.spool import atomic_write

__all__ = [
    "MAGIC",
    "REQUIRED_NODES",
    "ClassFile",
    "ClassFileError",
    "ImageGroup",
    "decode_key",
    "encode_key",
    "env_lines",
    "expand_members",
    "image_line",
    "image_lines",
    "locked",
    "our_body",
    "parse",
    "read",
    "read_bytes",
    "render",
    "write",
    "write_bytes",
]

MAGIC = "ncclguard-classes 4"
FILE_MODE = 0o644  # slurmctld (SlurmUser) reads it; the sync (SlurmUser) writes it
MAX_BYTES = 1 << 20  # job_submit.lua's MAX_FILE
#: job_submit.lua's FRESH_S: it ignores a file verified longer ago than this
#: (tests/test_lua_submit.py checks that the two agree).
LUA_FRESH_S = 60
ALL = "*"  # the partition entry for every node, and "every partition is guarded"
#: ``[features] required_nodes``: a job whose -w nodes span classes is refused at submit
#: (``refuse``), or left to the gate (``gate``).
REQUIRED_NODES = ("refuse", "gate")
#: The most hosts the members lines may name (the lua expands them).
MAX_MEMBERS = 1 << 18
#: The most ``image`` lines the file holds (the lua reads each one when the body changes).
MAX_IMAGES = 256
#: An image key: printable ASCII without spaces, as long as a reference may be
#: (ncclguard/fingerprint/imageref.py MAX_REF); the lua checks the same.
IMAGE_KEY = re.compile(r"[!-~]{1,1024}")
#: The most ``env`` lines the file holds. Their keys
#: (:func:`ncclguard.fingerprint.jobenv.submit_key`, at most 4,096 bytes) are written with
#: every byte but ``!`` to ``~`` (and ``%`` itself) as ``%XX``: a NUL, a space.
MAX_ENVS = 256
ENV_KEY = re.compile(r"(?:[!-$&-~]|%[0-7][0-9A-F])+")  # %XX: ASCII only, as keys are
_ENV_WORD = 3 * 4096  # the longest written key the lua decodes

_PARTITION = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_DIGITS = re.compile(r"[0-9]{1,18}")
_SPACE = re.compile(r"[ \t\r\v\f]+")
_ITEM = r"[^\[\],\s]*\[[0-9,-]+\]|[^\[\],\s]+"
_HOSTLIST = re.compile(rf"(?:{_ITEM})(?:,(?:{_ITEM}))*")
_HOSTLIST_ITEM = re.compile(
    r"(?P<prefix>[^\[\],\s]*)\[(?P<ranges>[0-9,-]+)\]|(?P<name>[^\[\],\s]+)")
_RANGE = re.compile(r"(?P<lo>[0-9]{1,9})(?:-(?P<hi>[0-9]{1,9}))?")
_NUMBERS = ("verified", "min_nodes", "max_alternatives", "opt_out")
#: the one-word settings, and what their word may be
_WORDS = {
    "required_nodes": REQUIRED_NODES.__contains__,
    "default": lambda w: _PARTITION.fullmatch(w) is not None,
}


class ClassFileError(ValueError):
    """The file cannot be read or written (the message names it and the cause)."""


class ImageGroup(NamedTuple):
    """The classes that run one container image, and until when that holds (0: no end)."""

    until: int
    classes: tuple[str, ...]


@dataclass(frozen=True)
class ClassFile:
    verified: int
    min_nodes: int = 2
    max_alternatives: int = MAX_ALTERNATIVES
    opt_out: bool = True
    required_nodes: str = "refuse"
    guarded: tuple[str, ...] = ()  # () = every partition
    default: str | None = None  # Slurm's default partition: for jobs that name none
    partitions: dict[str, tuple[ClassCount, ...]] = field(default_factory=dict)
    members: dict[str, str] = field(default_factory=dict)  # class -> compressed hostlist
    images: dict[str, ImageGroup] = field(default_factory=dict)  # image key -> its classes
    # the second family (issue 40): partition -> its classes, ranked; and for each known
    # environment (its submit key) the classes of that family that run its NCCL
    adds: dict[str, tuple[ClassCount, ...]] = field(default_factory=dict)
    envs: dict[str, tuple[str, ...]] = field(default_factory=dict)


def render(cf: ClassFile) -> bytes:
    bad = [p for p in cf.guarded if not _PARTITION.fullmatch(p)]
    if bad:
        raise ClassFileError(f"[policy] partitions: {bad[0]!r} is not a partition name "
                             "job_submit.lua can match (letters, digits, _ . -; 64 at most)")
    head = [
        MAGIC,
        f"verified {int(cf.verified)}",
        f"min_nodes {cf.min_nodes}",
        f"max_alternatives {cf.max_alternatives}",
        f"opt_out {int(cf.opt_out)}",
    ]
    rest = ["guarded " + (" ".join(cf.guarded) if cf.guarded else ALL)]
    if cf.default is not None and _PARTITION.fullmatch(cf.default):
        rest.append(f"default {cf.default}")
    for name, classes in cf.partitions.items():
        if name != ALL and not _PARTITION.fullmatch(name):
            continue  # not a name the lua would match: Slurm's own are plain words
        rest.append(" ".join(["partition", name, *(f"{c.feature}:{c.nodes}" for c in classes)]))
    for name, classes in cf.adds.items():
        if (name == ALL or _PARTITION.fullmatch(name)) and all(
                ADDS_FEATURE.fullmatch(c.feature) for c in classes):
            rest.append(" ".join(["adds", name, *(f"{c.feature}:{c.nodes}" for c in classes)]))
    members = [f"members {f} {hosts}" for f, hosts in sorted(cf.members.items())]
    required = cf.required_nodes
    size = sum(len(line) + 1 for line in (*head, *rest, *members)) + 40
    if size > MAX_BYTES or sum(len(expand_members(h)) for h in cf.members.values()) \
            > MAX_MEMBERS:
        members, required = [], "gate"  # too many nodes for the lua: -w is the gate's
    lines = [*head, f"required_nodes {required}", *rest, *members]
    room = MAX_BYTES - sum(len(line) + 1 for line in lines) - 4  # "end\n"
    images = image_lines(cf.images, room)
    room -= sum(len(line) + 1 for line in images)
    return ("\n".join([*lines, *images, *env_lines(cf.envs, room), "end"]) + "\n").encode()


def env_lines(envs: Mapping[str, tuple[str, ...]], room: int) -> list[str]:
    """The ``env`` lines of ``envs`` (submit key -> second-family classes), chosen in their
    order (the environments jobs used last first), at most :data:`MAX_ENVS` and as many
    as fit in ``room`` bytes, written by key. A key or class the lua could not read is
    left out (the job is offered the host classes, and the gate judges it)."""
    out: list[str] = []
    for key, classes in envs.items():
        if len(out) == MAX_ENVS:
            break
        written = encode_key(key)
        if written is None or not all(ADDS_FEATURE.fullmatch(f) for f in classes):
            continue
        line = " ".join(["env", written, *classes])
        room -= len(line) + 1
        if room < 0:
            break
        out.append(line)
    return sorted(out)


def image_lines(images: Mapping[str, ImageGroup], room: int) -> list[str]:
    """The ``image`` lines of ``images``: chosen in their order (the caller's: the images
    jobs used last first), at most :data:`MAX_IMAGES` and as many as fit in ``room``
    bytes, then written by key, so that the body changes only when what it says does
    (each change costs the lua a parse). An image whose key or time the lua could not
    read is left out (the gate judges it)."""
    out: list[str] = []
    for key, g in images.items():
        if len(out) == MAX_IMAGES:
            break
        if not IMAGE_KEY.fullmatch(key) or not all(FEATURE.fullmatch(f) for f in g.classes) \
                or not 0 <= int(g.until) < 10**18:
            continue
        line = " ".join(["image", key, str(int(g.until)), *g.classes])
        room -= len(line) + 1
        if room < 0:
            break  # the rest stay the gate's
        out.append(line)
    return sorted(out)


def encode_key(key: str) -> str | None:
    """An env line's key as the file writes it (None: not ASCII, or empty)."""
    if not key or not key.isascii():
        return None
    return "".join(c if "!" <= c <= "~" and c != "%" else f"%{ord(c):02X}" for c in key)


def decode_key(word: str) -> str | None:
    """An env line's key as the lua decodes it (None: not :data:`ENV_KEY`)."""
    if len(word) > _ENV_WORD or not ENV_KEY.fullmatch(word):
        return None
    return re.sub(r"%([0-7][0-9A-F])", lambda m: chr(int(m[1], 16)), word)


def image_line(words: list[str]) -> tuple[str, ImageGroup] | None:
    """One ``image`` line's words (``image KEY UNTIL CLASS...``) as the lua reads them, or
    None where it would refuse the file for them."""
    if len(words) < 3 or words[0] != "image" or not IMAGE_KEY.fullmatch(words[1]) \
            or not _DIGITS.fullmatch(words[2]) \
            or not all(FEATURE.fullmatch(w) for w in words[3:]):
        return None
    return words[1], ImageGroup(int(words[2]), tuple(words[3:]))


def parse(text: str, where: str = "classes file") -> ClassFile:
    """:class:`ClassFile` from the file's text; :class:`ClassFileError` naming the line.
    ``images`` keeps the file's order."""
    if not text.endswith("\n"):
        raise ClassFileError(f"{where}: cut short (no final newline)")
    lines = text.split("\n")
    if lines[0] != MAGIC:
        raise ClassFileError(f"{where}: line 1 is not {MAGIC!r}")
    m = re.fullmatch(r"verified ([0-9]{1,18})", lines[1]) if len(lines) > 2 else None
    if m is None:
        raise ClassFileError(f"{where}: line 2 is not 'verified <seconds>'")
    values: dict[str, str] = {"verified": m[1]}
    partitions: dict[str, tuple[ClassCount, ...]] = {}
    members: dict[str, str] = {}
    images: dict[str, ImageGroup] = {}
    adds: dict[str, tuple[ClassCount, ...]] = {}
    envs: dict[str, tuple[str, ...]] = {}
    seen: set[str] = set()
    ended = False
    for n, line in enumerate(lines[2:], start=3):
        words = [w for w in _SPACE.split(line) if w]  # ASCII white space, as lua's %s
        if not words:
            continue
        if ended:
            raise ClassFileError(f"{where}: line {n}: text after 'end'")
        key = words[0]
        if key == "end" and len(words) == 1:
            ended = True
        elif key in _NUMBERS and len(words) == 2:
            if not _DIGITS.fullmatch(words[1]) or key in values:
                raise ClassFileError(f"{where}: line {n}: {line[:80]!r}")
            values[key] = words[1]
        elif key in _WORDS and len(words) == 2 and _WORDS[key](words[1]) and key not in values:
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
        elif key == "members" and len(words) == 3:
            feature, hosts = words[1], words[2]
            if not FEATURE.fullmatch(feature) or feature in members:
                raise ClassFileError(f"{where}: line {n}: not a class: {feature[:80]!r}")
            try:
                names = expand_members(hosts, MAX_MEMBERS - len(seen))
            except ValueError as e:
                raise ClassFileError(f"{where}: line {n}: {e}") from None
            if seen.intersection(names) or len(set(names)) != len(names):
                raise ClassFileError(f"{where}: line {n}: a host in two classes")
            seen.update(names)
            members[feature] = hosts
        elif key == "image" and len(words) >= 3:
            found = image_line(words)
            if found is None or found[0] in images or len(images) >= MAX_IMAGES:
                raise ClassFileError(f"{where}: line {n}: image {line[:80]!r}")
            images[found[0]] = found[1]
        elif key == "adds" and len(words) >= 2:
            name = words[1]
            if (name != ALL and not _PARTITION.fullmatch(name)) or name in adds:
                raise ClassFileError(f"{where}: line {n}: adds {name[:80]!r}")
            adds[name] = tuple(_class(w, where, n, ADDS_FEATURE) for w in words[2:])
        elif key == "env" and len(words) >= 2:
            name = decode_key(words[1])
            if name is None or name in envs or len(envs) >= MAX_ENVS \
                    or not all(ADDS_FEATURE.fullmatch(w) for w in words[2:]):
                raise ClassFileError(f"{where}: line {n}: env {line[:80]!r}")
            envs[name] = tuple(words[2:])
        else:
            raise ClassFileError(f"{where}: line {n}: not understood: {line[:80]!r}")
    if not ended:
        raise ClassFileError(f"{where}: no 'end' line (cut short?)")
    missing = [k for k in (*_NUMBERS, "required_nodes", "guarded") if k not in values]
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
        required_nodes=values["required_nodes"],
        guarded=() if guarded == [ALL] else tuple(guarded),
        default=values.get("default"),
        partitions=partitions,
        members=members,
        images=images,
        adds=adds,
        envs=envs,
    )


def _class(word: str, where: str, n: int, family: re.Pattern[str] = FEATURE) -> ClassCount:
    feature, _, count = word.partition(":")
    if not family.fullmatch(feature) or not _DIGITS.fullmatch(count):
        raise ClassFileError(f"{where}: line {n}: not a class: {word[:80]!r}")
    return ClassCount(feature, int(count))


def expand_members(hostlist: str, limit: int = MAX_MEMBERS) -> list[str]:
    """The hosts of a ``members`` list, as the lua expands them: comma-separated items,
    each a name or ``prefix[ranges]`` (the width of ``lo`` sets the zero padding).
    ``ValueError`` past ``limit`` hosts or for anything else."""
    if _HOSTLIST.fullmatch(hostlist) is None:
        raise ValueError(f"not a list of names and prefix[ranges]: {hostlist[:80]!r}")
    out: list[str] = []
    for m in _HOSTLIST_ITEM.finditer(hostlist):
        if m["ranges"] is None:
            out.append(m["name"])
        else:
            for r in m["ranges"].split(","):
                rm = _RANGE.fullmatch(r)
                if rm is None:
                    raise ValueError(f"not a range: {r[:80]!r}")
                lo = int(rm["lo"])
                hi = int(rm["hi"]) if rm["hi"] is not None else lo
                if hi < lo or len(out) + hi - lo + 1 > limit:
                    raise ValueError(f"range {r!r}: backwards or more than {limit} hosts")
                width = len(rm["lo"])
                out.extend(f"{m['prefix']}{i:0{width}d}" for i in range(lo, hi + 1))
        if len(out) > limit:
            raise ValueError(f"more than {limit} hosts")
    return out


def write(path: Path, cf: ClassFile) -> None:
    """Replace the file atomically, in a directory only we (or root) can write: the lua
    trusts what it reads there. Written by root (an admin's ``ncclguard features sync``),
    it is given to the directory's owner (SlurmUser), whose slurmctld opens it read-write
    (job_submit.lua: that open never blocks). :class:`ClassFileError` names the path and
    the cause."""
    write_bytes(path, render(cf))


def write_bytes(path: Path, data: bytes) -> None:
    """:func:`write` of a rendered file."""
    try:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        check_dir(path.parent, "the file of classes")
        atomic_write(path, data, FILE_MODE)
        if os.geteuid() == 0:
            st = os.stat(path.parent)
            if st.st_uid != 0:
                os.chown(path, st.st_uid, st.st_gid, follow_symlinks=False)
    except OSError as e:
        raise ClassFileError(f"{path}: cannot write: {e.strerror or e}") from None


def read(path: Path) -> ClassFile:
    """The file, parsed (:func:`read_bytes`)."""
    data = read_bytes(path)
    try:
        return parse(data.decode("utf-8"), str(path))
    except UnicodeDecodeError as e:
        raise ClassFileError(f"{path}: not UTF-8 ({e.reason})") from None


def read_bytes(path: Path) -> bytes:
    """The file's bytes; only a regular file is read, and opening never blocks (a FIFO put
    there would otherwise hold the reader until something writes it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ClassFileError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ClassFileError(f"{path}: not a regular file; not reading it")
        if st.st_size > MAX_BYTES:
            raise ClassFileError(f"{path}: larger than {MAX_BYTES} bytes")
        with contextlib.closing(os.fdopen(fd, "rb", closefd=False)) as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise ClassFileError(f"{path}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise ClassFileError(f"{path}: larger than {MAX_BYTES} bytes")
    return data


def our_body(path: Path) -> bytes | None:
    """The file's lines after ``verified`` (to ``end``, included), when it is a file of
    classes of this version, whole; else None. Not parsed: at 16,384 nodes a parse costs
    more than a pass's one Slurm call."""
    try:
        data = read_bytes(path)
    except ClassFileError:
        return None
    head, _, rest = data.partition(b"\n")
    line2, _, body = rest.partition(b"\n")
    if head != MAGIC.encode() or not line2.startswith(b"verified ") \
            or not body.endswith(b"\nend\n"):
        return None
    return body


@contextlib.contextmanager
def locked(path: Path, wait_s: float = 30.0) -> Iterator[None]:
    """One sync at a time (daemon, hooks, admins): an flock on ``<file>.lock``."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    lock_path = Path(f"{path}.lock")
    try:  # read-only: flock needs no more, and a lock file root created still opens;
        # O_NONBLOCK: a FIFO put there must not hold the sync (and the hooks) for ever
        fd = os.open(lock_path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                     | os.O_NONBLOCK, 0o644)
    except OSError as e:
        raise ClassFileError(f"{lock_path}: cannot open: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ClassFileError(f"{lock_path}: not a regular file; no sync")
        try:
            lock(fd, lock_path, wait_s, "no sync", poll_s=0.05)
        except AuditError as e:
            raise ClassFileError(str(e)) from None
        yield
    finally:
        os.close(fd)
