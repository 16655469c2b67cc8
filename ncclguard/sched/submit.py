"""What ``slurm/job_submit.lua`` decides for one job, in Python.

The lua runs inside slurmctld and cannot be imported; this is its mirror, line for line
in its decisions, so that the two cannot drift: ``tests/test_lua_submit.py`` runs one
corpus of job descriptions and files of classes through ``lua5.1`` (with a stub ``slurm``
table) and through :func:`decide`, and compares every outcome, message included. The
file's rules are :mod:`ncclguard.sched.classfile`'s, the group's format and where it may
be joined are :mod:`ncclguard.sched.group`'s; the sync's
:func:`~ncclguard.sched.sync.regroup_pending` chooses classes with :func:`choose`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ncclguard.fingerprint.imageref import RefError
from ncclguard.fingerprint.imageref import parse as parse_ref
from ncclguard.policy.schedule import ClassCount
from ncclguard.sched import classfile, group

__all__ = ["CAPPED", "Decision", "JobDesc", "choose", "constraints", "container_image", "decide",
           "environment_key", "image_key", "trusted"]

NO_VAL = 4294967294
NO_VAL16 = 65534
MAX_REQ_NODES = 65536  # job_submit.lua's MAX_REQ_NODES: the longest -w list read
#: The job fields Slurm caps at 1024 characters after the plugin ran (the lua's CAPPED).
CAPPED = ("features", "prefer", "comment", "extra", "partition", "tres_per_job")
#: How pyxis's ``--container-image`` reaches job_submit: an entry of ``spank_job_env``
#: (docs/slurm.md, "What job_submit.lua sees of a SPANK option at submit").
IMAGE_OPTION = "_SLURM_SPANK_OPTION_pyxis_container_image="
#: The most ``spank_job_env`` entries looked at (the lua's MAX_SPANK_ENV); a job with more
#: is left as one without an image (the gate judges its image).
MAX_SPANK_ENV = 256
#: The longest ``--container-image`` value read (the lua's MAX_IMAGE_VALUE): its
#: white space is stripped inside slurmctld (two scans, one of the reversed value).
MAX_IMAGE_VALUE = 4096


@dataclass(frozen=True)
class JobDesc:
    """The fields of Slurm's ``job_desc`` that the lua reads (None: not set)."""

    features: str | None = None
    prefer: str | None = None
    comment: str | None = None
    extra: str | None = None
    partition: str | None = None
    tres_per_job: str | None = None
    req_nodes: str | None = None
    min_nodes: int | None = None
    max_nodes: int | None = None
    num_tasks: int | None = None
    ntasks_per_node: int | None = None
    het_job_offset: int | None = None
    spank_job_env: tuple[str, ...] | None = None  # the lua's 0-based table, and its size
    script: str | None = None  # a batch job's script (Slurm sends the environment with it)
    environment: tuple[str, ...] | None = None  # NAME=value entries, as sbatch sent them


Action = Literal["keep", "set", "cap", "reject"]


@dataclass(frozen=True)
class Decision:
    """``keep``: the job as it came; ``set``: with ``features`` (and ``prefer``); ``cap``:
    a field past Slurm's cap, ``features`` and ``prefer`` as the lua leaves them (cut),
    refused by Slurm next; ``reject``: refused with ``code`` (the ``slurm`` table's name)
    and ``message``."""

    action: Action
    features: str | None = None
    prefer: str | None = None
    code: str = ""
    message: str = ""


KEEP = Decision("keep")


def trusted(cf: classfile.ClassFile, now: int, loaded_at: int) -> str | None:
    """Why the lua would not trust a file verified at ``cf.verified``, or None."""
    if cf.verified <= loaded_at:
        return "the classes were not verified since this slurmctld started"
    if now - cf.verified > classfile.LUA_FRESH_S:
        return f"the classes were last verified {now - cf.verified} s ago"
    if cf.verified > now + 2:
        return "the classes were verified in the future"
    return None


def container_image(job: JobDesc) -> str | None:
    """The job's ``--container-image`` as written: the one ``spank_job_env`` entry of
    :data:`IMAGE_OPTION` (None: none, more than one, or more than :data:`MAX_SPANK_ENV`
    entries)."""
    env = job.spank_job_env
    if env is None or not 1 <= len(env) <= MAX_SPANK_ENV:
        return None
    found = [e[len(IMAGE_OPTION):] for e in env if e.startswith(IMAGE_OPTION)]
    return found[0] if len(found) == 1 else None


def image_key(value: str | None) -> str | None:
    """The key the gate looks an image up by (prolog/gate.py ``decide``): an absolute path
    as given, or a registry reference's :attr:`~ncclguard.fingerprint.imageref.Reference.key`;
    None for anything else (a relative path, a reference enroot would not take, anything
    outside printable ASCII, which the lua does not read)."""
    if value is None or len(value.encode()) > MAX_IMAGE_VALUE:
        return None
    v = value.strip(" \t\n\r\v\f")
    if classfile.IMAGE_KEY.fullmatch(v) is None or v.startswith("."):
        return None
    if v.startswith("/"):
        return v
    try:
        return parse_ref(v).key
    except RefError:
        return None


def _image(cf: classfile.ClassFile, job: JobDesc, now: int
           ) -> tuple[str, classfile.ImageGroup] | None:
    """The job's image and its line in the file, while that holds."""
    key = image_key(container_image(job))
    g = cf.images.get(key) if key is not None else None
    if key is None or g is None or (g.until and now > g.until):
        return None
    return key, g


def environment_key(job: JobDesc) -> str | None:
    """The lua's ``env_key(job_desc.environment)``: a lookup gives the first entry of that
    name (``_job_env_field`` in job_submit_lua.c), then
    :func:`~ncclguard.fingerprint.jobenv.submit_key`."""
    from ncclguard.fingerprint.jobenv import INPUTS, submit_key

    if job.environment is None:
        return None
    first: dict[str, str] = {}
    wanted = set(INPUTS)
    for entry in job.environment:
        name, eq, value = entry.partition("=")
        if eq and name in wanted and name not in first:
            first[name] = value
    return submit_key(first)


def _set(v: int | None, none: int) -> bool:
    return v is not None and v != none


def _spans(job: JobDesc, threshold: int) -> bool:
    minn, maxn = job.min_nodes, job.max_nodes
    if _set(maxn, NO_VAL) and 0 < maxn < threshold:  # type: ignore[operator]
        return False
    if _set(minn, NO_VAL) and minn >= threshold:  # type: ignore[operator]
        return True
    if _set(maxn, NO_VAL) and maxn >= threshold:  # type: ignore[operator]
        return True
    tasks, per_node = job.num_tasks, job.ntasks_per_node
    if _set(tasks, NO_VAL) and tasks >= threshold:  # type: ignore[operator]
        return not (_set(per_node, NO_VAL16) and per_node >= tasks)  # type: ignore[operator]
    return job.tres_per_job is not None and "gpu" in job.tres_per_job


def _words(text: str) -> list[str]:
    """Lua's ``[^%s,;]+`` over ASCII white space."""
    out: list[str] = []
    word: list[str] = []
    for ch in text:
        if ch in " \t\n\r\v\f,;":
            if word:
                out.append("".join(word))
                word = []
        else:
            word.append(ch)
    if word:
        out.append("".join(word))
    return out


def _opted_out(job: JobDesc) -> bool:
    for text in (job.comment or "", job.extra or ""):
        lowered = "".join(c.lower() if "A" <= c <= "Z" else c for c in text)
        if "ncclguard=off" in _words(lowered):
            return True
    return False


def _guarded(cf: classfile.ClassFile, partition: str | None) -> bool:
    if not cf.guarded or partition is None:
        return True
    return any(p in cf.guarded for p in partition.split(",") if p)


def _classes_for(cf: classfile.ClassFile, partition: str | None,
                 lists: Mapping[str, tuple[ClassCount, ...]]
                 ) -> tuple[tuple[ClassCount, ...], str]:
    name = partition if partition is not None else cf.default  # lua: "" is a name
    if name is not None and "," not in name and name in lists:
        return lists[name], f"partition {name}"
    return lists.get(classfile.ALL, ()), "the cluster"


def choose(classes: Sequence[ClassCount], need: int, limit: int) -> list[str]:
    """The classes a job of ``need`` nodes is offered, in the file's order, at most
    ``limit``."""
    return [c.feature for c in classes if c.nodes >= need][:limit]


def _some(hosts: Sequence[str]) -> str:
    text = ",".join(hosts[:4])
    return text + (f" and {len(hosts) - 4} more" if len(hosts) > 4 else "")


def _required_hosts(cf: classfile.ClassFile, req: str | None) -> list[str] | None:
    if not req or cf.required_nodes != "refuse":
        return None
    try:
        hosts = classfile.expand_members(req, max(_nodes(cf), 1))
    except ValueError:
        return None
    return list(dict.fromkeys(hosts))


def _nodes(cf: classfile.ClassFile) -> int:
    return sum(len(classfile.expand_members(h)) for h in cf.members.values())


def _required_class(cf: classfile.ClassFile, hosts: Sequence[str],
                    classes: Sequence[ClassCount], need: int, pname: str
                    ) -> tuple[ClassCount | None, str]:
    member = {h: f for f, hl in cf.members.items() for h in classfile.expand_members(hl)}
    by: dict[str, list[str]] = {}
    for h in hosts:
        f = member.get(h)
        if f is None:
            return None, "gate"
        by.setdefault(f, []).append(h)
    if len(by) > 1:
        order = list(by)
        parts = [f"{f}: {_some(by[f])}" for f in order[:4]]
        if len(order) > 4:
            parts.append(f"and {len(order) - 4} more classes")
        return None, (f"ncclguard: the required nodes (-w) have {len(order)} different NCCL "
                      f"stacks ({'; '.join(parts)}); ask for nodes of one class (see "
                      "`ncclguard classes`)")
    (f,) = by
    for c in classes:
        if c.feature == f:
            if c.nodes >= need:
                return c, ""
            return None, (f"ncclguard: this job needs {need} nodes with one NCCL stack, but "
                          f"its required nodes (-w) are in class {f}, which has {c.nodes} "
                          f"nodes in {pname} (see `ncclguard classes`)")
    size = len(classfile.expand_members(cf.members[f]))
    if size < need:
        return None, (f"ncclguard: this job needs {need} nodes with one NCCL stack, but its "
                      f"required nodes (-w) are in class {f}, which has {size} nodes (see "
                      "`ncclguard classes`)")
    return None, "gate"


def _too_many_terms(constraint: str | None) -> str | None:
    if constraint is None:
        return None
    count = group.terms(constraint)
    if count > group.MAX_TERMS:
        return (f"ncclguard: a bracket group ([a|b|...]) may name at most {group.MAX_TERMS} "
                f"features (Slurm's limit); this one names {count}")
    return None


def _oversized(job: JobDesc) -> Decision | None:
    """A field past Slurm's cap: Slurm refuses the job next. The lua cuts a constraint or
    preference that long to ``MAX_CONSTRAINT + 1`` characters (still refused, for its
    length, but without Slurm reading megabytes of it)."""
    if not any(len(v) > group.MAX_CONSTRAINT for f in CAPPED
               if isinstance(v := getattr(job, f), str)):
        return None

    def cut(v: str | None) -> str | None:
        return v[: group.MAX_CONSTRAINT + 1] if v is not None else None

    return Decision("cap", features=cut(job.features), prefer=cut(job.prefer))


def _crash_check(job: JobDesc) -> Decision | None:
    for value in (job.features, job.prefer):
        msg = _too_many_terms(value)
        if msg:
            return Decision("reject", code="ERROR", message=msg)
    return None


def decide(cf: classfile.ClassFile | None, job: JobDesc, now: int = 0) -> Decision:
    """The lua's ``ncclguard.submit(job_desc)``; ``cf``: the file as the lua would use it
    (None: missing, malformed or not trusted, see :func:`trusted`); ``now``: the lua's
    clock, for the file's image lines."""
    capped = _oversized(job)
    if capped:
        return capped  # Slurm refuses it next
    if job.req_nodes is not None and len(job.req_nodes) > MAX_REQ_NODES:
        return KEEP  # a -w list too long to read: the gate's
    crash = _crash_check(job)
    if crash:
        return crash
    if _set(job.het_job_offset, NO_VAL):
        return KEEP
    user, prefer = job.features, job.prefer
    if (user is not None and "[" in user) or (prefer is not None and "[" in prefer):
        return KEEP
    if cf is None:
        return KEEP
    threshold = max(2, cf.min_nodes)
    has_req = bool(job.req_nodes)
    if has_req and cf.required_nodes != "refuse":
        return KEEP
    hosts = _required_hosts(cf, job.req_nodes)
    if not (_spans(job, threshold) or (hosts is not None and len(hosts) >= threshold)):
        return KEEP
    if cf.opt_out and _opted_out(job):
        return KEEP
    if not _guarded(cf, job.partition):
        return KEEP
    classes, pname = _classes_for(cf, job.partition, cf.partitions)
    if not classes:
        return KEEP
    need = 1
    if job.min_nodes is not None and job.min_nodes != NO_VAL and job.min_nodes > 1:
        need = job.min_nodes
    stack, see = "with one NCCL stack", "`ncclguard classes`"
    image = _image(cf, job, now)
    if image is not None:
        key, g = image
        must = need >= threshold or (hosts is not None and len(hosts) >= threshold)
        if not g.classes and must:
            return Decision("reject", code="ERROR", message=(
                f"ncclguard: container image {key} runs on no class of nodes: its NCCL "
                "cannot use the net plugin the nodes give containers, and would fall back "
                f"to another transport (see `ncclguard check --image {key}`)"))
        runnable = tuple(c for c in classes if c.feature in g.classes)
        if runnable:  # else none of the partition's listed classes: the gate decides
            classes = runnable
            stack = f"that run image {key} with one NCCL stack"
            see = f"`ncclguard check --image {key}`"
    elif cf.envs and job.script is not None and image_key(container_image(job)) is None:
        # a batch job whose environment names a libnccl the collector read: the second
        # family's classes that run it (issue 40)
        ek = environment_key(job)
        able = cf.envs.get(ek) if ek is not None else None
        if able is not None and has_req:
            # -w: the file's members are of host classes, which such a job does not load;
            # the gate judges it by its own NCCL
            return KEEP
        if able is not None:
            listed, aname = _classes_for(cf, job.partition, cf.adds)
            runnable = tuple(c for c in listed if c.feature in able)
            if runnable:  # else the host classes, and the gate decides
                classes, pname = runnable, aname
                stack, see = "that run its own NCCL with one stack", "`ncclguard check --env`"
    if has_req:
        if hosts is None:
            return KEEP
        need = max(need, len(hosts))
        c, msg = _required_class(cf, hosts, classes, need, pname)
        if c is None:
            return KEEP if msg == "gate" else Decision("reject", code="ERROR", message=msg)
        classes = (c,)
    chosen = choose(classes, need, cf.max_alternatives)
    if not chosen:
        largest = max(c.nodes for c in classes)
        return Decision("reject", code="ESLURM_INVALID_NODE_COUNT", message=(
            f"ncclguard: this job needs {need} nodes {stack}, but the largest "
            f"such set in {pname} has {largest} nodes (ask for at most {largest}, or see "
            f"{see})"))
    joined = constraints(chosen, user, prefer)
    if joined is None:
        return KEEP
    return Decision("set", features=joined[0], prefer=joined[1])


def constraints(chosen: Sequence[str], user: str | None, prefer: str | None
                ) -> tuple[str, str | None] | None:
    """The job's constraint and preference with the group of as many of ``chosen`` as keep
    both within Slurm's cap (the first ones: the file's order is the preference), or None
    where a user's expression cannot take the group (:func:`~ncclguard.sched.group.joinable`)
    or not even one class fits. Lengths are counted, not built (the lua does the same)."""
    has_prefer = bool(prefer)
    if not group.joinable(user) or (has_prefer and not group.joinable(prefer)):
        return None
    longest = max(len(user or ""), len(prefer or "") if has_prefer else 0)
    room = group.MAX_CONSTRAINT - (longest + 3 if longest else 0)
    k, length = 0, 1
    for i, f in enumerate(chosen, start=1):
        length += len(f) + 1
        if length > room:
            break
        k = i
    if k == 0:
        return None
    g = group.render(chosen[:k])
    features = group.join(user, g)
    assert features is not None
    return features, (group.join(prefer, g) if has_prefer else None)


def decide_modify(job: JobDesc) -> Decision:
    """The lua's ``ncclguard.modify(job_desc)``."""
    return _oversized(job) or _crash_check(job) or KEEP
