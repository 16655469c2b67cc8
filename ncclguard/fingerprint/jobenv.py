"""Which ``libnccl.so.2`` a job loads, from the variables of its environment (issue 40).

Most multi-node jobs bring their own NCCL. Where it comes from, in the order that decides
(the evidence: docs/jobs.md, "Which libnccl a job loads", each rule with its source):

1. ``LD_PRELOAD``: an entry named ``libnccl.so*`` is loaded before anything else, and a
   later ``dlopen("libnccl.so.2")`` (torch's, NCCL's users') gets that object
   (ld.so(8)).
2. ``VIRTUAL_ENV``: pip's ``nvidia-nccl-cu11``/``-cu12``/``-cu13`` wheel, at
   ``site-packages/nvidia/nccl/lib/libnccl.so.2`` (the wheels' ``RECORD``). torch's
   libraries carry an RPATH ``$ORIGIN/../../nvidia/nccl/lib`` that ld.so searches before
   ``LD_LIBRARY_PATH``, and JAX 0.6.2 on loads that file by its absolute path.
3. ``CONDA_PREFIX``: pip's wheel inside the env first (the same RPATH), else conda-forge's
   ``$CONDA_PREFIX/lib/libnccl.so.2``, which the env's binaries find through conda-build's
   RPATH ``$ORIGIN/../lib``, also before ``LD_LIBRARY_PATH``.
4. ``LD_LIBRARY_PATH``: the first directory holding ``libnccl.so.2`` (what ``module load
   nccl`` prepends: EasyBuild's and the NVIDIA HPC SDK's modules).
5. None of these: the node's own libnccl (the dynamic linker's cache and directories),
   which the host-stack rules judge.

:func:`locate` applies these rules with a caller's file test, so that the same decision
runs on the controller (the collector, ``ncclguard check --env``) and in the tests. It
never reads a library: what the file is (its version and ABIs) is the reader's business.
Only the variables named in :data:`INPUTS` and :data:`NCCL_VARS` are looked at, each
bounded (:data:`MAX_VALUE`, :data:`MAX_ENTRIES`): a job's environment is its owner's.

Standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

__all__ = ["INPUTS", "MAX_ENTRIES", "MAX_SUBMIT_KEY", "MAX_VALUE", "NCCL_VARS", "Found",
           "NotKnown", "env_key", "loading_vars", "locate", "submit_key", "wheel_paths"]

#: The variables that decide which libnccl a job loads.
INPUTS = ("LD_PRELOAD", "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH")
#: The NCCL variables that change what a node gives the job's NCCL (loading, transport);
#: the job's environment wins over /etc/nccl.conf (``setenv(..., 0)``: docs/nccl.md).
NCCL_VARS = ("NCCL_NET_PLUGIN", "NCCL_NET", "NCCL_IB_DISABLE", "NCCL_IB_HCA",
             "NCCL_SOCKET_IFNAME", "NCCL_TUNER_PLUGIN", "NCCL_PROFILER_PLUGIN",
             "NCCL_ENV_PLUGIN", "NCCL_GIN_PLUGIN", "NCCL_RMA_PLUGIN", "NCCL_CONF_FILE")
#: A value longer than this is not read (PATH_MAX is 4,096; a list of paths a few).
MAX_VALUE = 64 << 10
#: At most this many entries of a list (LD_PRELOAD, LD_LIBRARY_PATH) are looked at.
MAX_ENTRIES = 256
#: Python minor versions a venv's ``lib/python3.N`` is looked for under, newest first.
PYTHONS = tuple(f"python3.{n}" for n in range(20, 5, -1))
SONAME = "libnccl.so.2"


class NotKnown(Exception):
    """Raised by a :func:`locate` file test for a candidate it cannot judge (a file this
    reader may not look at, though the job might load it): the search stops there and
    what the job loads is not known, never a later candidate's library."""


class Found(NamedTuple):
    """Where the job's libnccl comes from: ``source`` (``LD_PRELOAD``, ``VIRTUAL_ENV``,
    ``CONDA_PREFIX``, ``LD_LIBRARY_PATH`` or ``host``), ``path`` (None for the host's),
    ``why`` (the rule, in words), ``nccl`` (the job's own ``NCCL_*`` variables among
    :data:`NCCL_VARS`) and ``problems`` (what was not read, and why)."""

    source: str
    path: str | None
    why: str
    nccl: dict[str, str]
    problems: tuple[str, ...] = ()


def wheel_paths(prefix: str) -> list[str]:
    """Where pip puts the nvidia-nccl wheel's library under a venv or conda ``prefix``."""
    base = prefix.rstrip("/") or "/"
    return [f"{base}/lib/{py}/site-packages/nvidia/nccl/lib/{SONAME}" for py in PYTHONS]


def _value(env: Mapping[str, str], name: str, problems: list[str]) -> str | None:
    value = env.get(name)
    # an empty NCCL_* is set all the same: it keeps /etc/nccl.conf's line out (setenv(...,
    # 0)) and NCCL reads "" (docs/jobs.md); an empty input names no library
    if value is None or (value == "" and name not in NCCL_VARS):
        return None
    if not isinstance(value, str) or len(value) > MAX_VALUE:
        problems.append(f"{name}: longer than {MAX_VALUE} characters, not read")
        return None
    if "\0" in value:
        problems.append(f"{name}: holds a NUL byte, not read")
        return None
    return value


def _absolute(path: str) -> bool:
    """Absolute, without a ``..`` component, not into /proc, /sys or /dev however
    spelled (``//proc``, ``/./dev``: the string's components, not where links lead)."""
    if not path.startswith("/"):
        return False
    parts = [p for p in path.split("/") if p not in ("", ".")]
    return ".." not in parts and not (parts and parts[0] in ("proc", "sys", "dev"))


def loading_vars(env: Mapping[str, str]) -> tuple[dict[str, str], tuple[str, ...]]:
    """The variables of ``env`` that decide which libnccl a job loads and what a node
    gives it (:data:`INPUTS` set and non-empty, :data:`NCCL_VARS` set, each bounded
    as :func:`locate` reads it), and the problems met: what the gate hands on, and
    :func:`env_key` names."""
    problems: list[str] = []
    got = {k: v for k in INPUTS + NCCL_VARS if (v := _value(env, k, problems)) is not None}
    return got, tuple(problems)


#: The longest key job_submit.lua builds from a job's environment (its MAX_ENV_KEY).
MAX_SUBMIT_KEY = 4096


def submit_key(env: Mapping[str, str]) -> str | None:
    """The name job_submit.lua gives, at submit, the variables that decide which libnccl a
    batch job loads (``slurm/job_submit.lua`` ``env_key``; the file of classes' ``env``
    lines are written under it, docs/scheduling.md): ``NAME=value`` for each of
    :data:`INPUTS` that is set and not empty, in that order, joined by NUL (no value
    holds one). Four lookups and a join per job, no scan of a value. None when none is
    set (the job loads the host's libnccl), a value is not ASCII (the lua reads bytes),
    or the key is longer than :data:`MAX_SUBMIT_KEY`: the lua then has no line for the
    job, and offers it the host classes. ``NCCL_*`` variables are not part of it: they do
    not change which libnccl loads (the gate's :func:`env_key` has them)."""
    parts = [f"{k}={v}" for k in INPUTS if (v := env.get(k))]
    key = "\0".join(parts)
    if not parts or len(key) > MAX_SUBMIT_KEY or not key.isascii():
        return None
    return key


def env_key(variables: Mapping[str, str]) -> str:
    """One name for a job's loading variables (:func:`loading_vars`): the gate looks a job
    up by it and the collector files what it resolved under it. Two jobs with the same
    variables load the same library (as long as the files stay as they were)."""
    text = json.dumps(dict(sorted(variables.items())), separators=(",", ":"),
                      ensure_ascii=True)
    return _sha256(text.encode()).hexdigest()


def _sha256(data: bytes) -> Any:
    """SHA-256 from CPython's builtin module where it has one (``_sha2`` from 3.12,
    ``_sha256`` before): the gate computes :func:`env_key` for every batch job, and
    ``import hashlib`` loads OpenSSL's ``_hashlib`` first (3.5 ms of the gate's run,
    measured with ``python -X importtime``). The same digest either way."""
    import importlib

    for name in ("_sha2", "_sha256"):
        try:
            return importlib.import_module(name).sha256(data)
        except (ImportError, AttributeError):
            continue
    import hashlib

    return hashlib.sha256(data)


def locate(env: Mapping[str, str], is_file: Callable[[str], bool]) -> Found:
    """The job's libnccl by the rules of the module doc. ``is_file(path)``: whether a
    regular file the job could load is at that absolute path (the caller decides what it
    may read, and as whom); it raises :class:`NotKnown` for a path it cannot judge."""
    try:
        return _locate(env, is_file)
    except NotKnown as e:
        why = f"{e}: what the job loads is not known"
        return Found("unknown", None, f"not known: {why}", {}, (why,))


def _locate(env: Mapping[str, str], is_file: Callable[[str], bool]) -> Found:
    problems: list[str] = []
    nccl = {k: v for k in NCCL_VARS if (v := _value(env, k, problems)) is not None}

    def first(paths: list[str], name: str) -> str | None:
        skipped = 0
        for p in paths:
            if not _absolute(p):
                skipped += 1
                continue
            if is_file(p):
                return p
        if skipped:
            problems.append(f"{name}: {skipped} path(s) not absolute, or into /proc, /sys "
                            "or /dev, or through '..': not looked at")
        return None

    def unknown(name: str, why: str) -> Found:
        problems.append(f"{name}: {why}")
        return Found(name, None, f"not known: {why}", nccl, tuple(problems))

    def wheel(name: str, base: str) -> str | Found | None:
        # every python's site-packages: which one the job's python imports is not read
        got = [p for p in wheel_paths(base) if is_file(p)]
        if len(got) > 1:
            return unknown(name, f"nvidia-nccl wheels under {len(got)} python versions "
                           f"({', '.join(got[:3])}): which the job's python imports is not "
                           "known")
        return got[0] if got else None

    def prefix(name: str) -> str | Found | None:
        value = _value(env, name, problems)
        if value is not None and not _absolute(value):
            # the job's python is under it wherever it leads (a relative one from the
            # working directory): its wheel, not a later rule's library
            return unknown(name, f"{value[:200]!r}: not an absolute path outside /proc, "
                           "/sys and /dev: not looked at, what the job loads is not known")
        return value

    preload = _value(env, "LD_PRELOAD", problems)
    if preload is not None:
        # ld.so: LD_PRELOAD is separated by spaces or colons; a name without a slash is
        # searched for as a library is, a relative one opened from the working directory,
        # $LIB, $PLATFORM and $ORIGIN expanded: the collector cannot follow those
        entries = preload.replace(":", " ").split()
        if len(entries) > MAX_ENTRIES:
            return unknown("LD_PRELOAD", f"{len(entries)} entries, more than the "
                           f"{MAX_ENTRIES} looked at: what it loads is not known")
        for entry in entries:
            if "$" in entry:
                return unknown("LD_PRELOAD", f"{entry[:200]!r} holds a token ld.so expands "
                               "($LIB, $PLATFORM, $ORIGIN): what it loads is not known")
            if entry.rsplit("/", 1)[-1].startswith("libnccl.so"):
                if not _absolute(entry):
                    return unknown("LD_PRELOAD", f"names {entry[:200]!r}, not an absolute "
                                   "path outside /proc, /sys and /dev: ld.so finds it by "
                                   "its search or from the job's working directory")
                if is_file(entry):
                    return Found("LD_PRELOAD", entry, "LD_PRELOAD loads it before anything "
                                 "else", nccl, tuple(problems))
                problems.append(f"LD_PRELOAD names {entry}, which is not a file")
    venv = prefix("VIRTUAL_ENV")
    if isinstance(venv, Found):
        return venv
    if venv is not None:
        got = wheel("VIRTUAL_ENV", venv)
        if isinstance(got, Found):
            return got
        if got is not None:
            return Found("VIRTUAL_ENV", got, "pip's nvidia-nccl wheel in the virtualenv: "
                         "torch's RPATH and JAX find it before LD_LIBRARY_PATH", nccl,
                         tuple(problems))
    conda = prefix("CONDA_PREFIX")
    if isinstance(conda, Found):
        return conda
    if conda is not None:
        got = wheel("CONDA_PREFIX", conda)
        if isinstance(got, Found):
            return got
        if got is not None:
            return Found("CONDA_PREFIX", got, "pip's nvidia-nccl wheel in the conda env "
                         "(torch's RPATH)", nccl, tuple(problems))
        got = first([f"{conda.rstrip('/')}/lib/{SONAME}"], "CONDA_PREFIX")
        if got is not None:
            return Found("CONDA_PREFIX", got, "conda's nccl package: the env's binaries "
                         "find it through their RPATH $ORIGIN/../lib", nccl, tuple(problems))
    path = _value(env, "LD_LIBRARY_PATH", problems)
    if path is not None:
        # ld.so searches every entry in order: an empty one is the working directory, a
        # relative one is relative to it, $LIB and $PLATFORM are expanded. An entry the
        # collector cannot look at, before the first that holds libnccl.so.2, may hold
        # the library the job loads: the answer is then not known (never a later one).
        dirs = path.replace(";", ":").split(":")
        for i, d in enumerate(dirs):
            if i >= MAX_ENTRIES:
                return unknown("LD_LIBRARY_PATH", f"{len(dirs)} entries, none of the first "
                               f"{MAX_ENTRIES} holds libnccl.so.2: the rest are not looked "
                               "at")
            if d == "" or "$" in d or not _absolute(d):
                why = ("an empty entry (ld.so: the working directory)" if d == "" else
                       f"{d[:200]!r}: relative, a token ld.so expands, into /proc, /sys or "
                       "/dev, or through '..'")
                return unknown("LD_LIBRARY_PATH", f"{why}, searched before any entry that "
                               "holds libnccl.so.2: what the job loads is not known")
            if is_file(f"{d.rstrip('/')}/{SONAME}"):
                return Found("LD_LIBRARY_PATH", f"{d.rstrip('/')}/{SONAME}", "the first "
                             "LD_LIBRARY_PATH directory that holds libnccl.so.2 (a "
                             "module's)", nccl, tuple(problems))
    return Found("host", None, "no libnccl of the job's own: the node's (the dynamic "
                 "linker's cache and directories)", nccl, tuple(problems))
