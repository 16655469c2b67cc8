"""job_submit.lua outside slurmctld, for tests/test_lua_submit.py and
tests/test_lua_images.py: cases (a file of classes and a job description) run through
``lua5.1`` (tests/lua/driver.lua, a stub ``slurm`` table and clock) and through the Python
mirror (``ncclguard.sched.submit`` over ``ncclguard.sched.classfile``), and the
``--container-image`` values both key."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from helpers import REPO
from helpers.parts import unavailable
from ncclguard.policy.schedule import ClassCount
from ncclguard.sched import classfile, submit
from ncclguard.sched.submit import JobDesc

ROOT = REPO
LUA = ROOT / "slurm" / "job_submit.lua"
DRIVER = ROOT / "tests" / "lua" / "driver.lua"
NOW = 1_800_000_000
def lua5_1() -> str:
    exe = shutil.which("lua5.1")
    if exe is None:
        unavailable("lua5.1 is not installed (apt-get install lua5.1)")
    return exe


def lua_string(s: str) -> str:
    out = ['"']
    for b in s.encode():
        c = chr(b)
        if c in '"\\':
            out.append("\\" + c)
        elif 32 <= b < 127:
            out.append(c)
        else:
            out.append(f"\\{b:03d}")
    out.append('"')
    return "".join(out)


def lua_value(v: Any) -> str:
    if v is None:
        return "nil"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return lua_string(v)
    if isinstance(v, tuple):  # Slurm's 0-based arrays (spank_job_env)
        return "{" + ", ".join(f"[{i}] = {lua_value(x)}" for i, x in enumerate(v)) + "}"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"[{lua_string(k)}] = {lua_value(x)}" for k, x in v.items()
                               if x is not None) + "}"
    raise TypeError(v)


@dataclass
class Case:
    text: str | bytes | None  # the file's content; None: no file
    job: JobDesc
    now: int = NOW
    loaded: int = NOW - 100
    modify: bool = False
    inject: str | None = None  # a function of the ncclguard table that raises
    path: Path | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Outcome:
    rc: str
    features: str | None
    prefer: str | None
    user: str | None
    error: str | None
    usable: bool


_RUNS = iter(range(1 << 30))


def run_lua(tmp_path: Path, cases: list[Case], timeout: float = 120) -> list[Outcome]:
    listing = []
    run = next(_RUNS)
    for i, c in enumerate(cases):
        if c.path is None:
            c.path = tmp_path / f"classes-{run}-{i}"
            if c.text is not None:
                c.path.write_bytes(c.text if isinstance(c.text, bytes) else c.text.encode())
        job = {f.name: getattr(c.job, f.name) for f in fields(c.job)}
        if c.job.spank_job_env is not None:
            job["spank_job_env_size"] = len(c.job.spank_job_env)
        # job_desc.environment: looked up by name, the first entry of it (_job_env_field);
        # for a job without one, Slurm's lookups give nil
        first: dict[str, str] = {}
        for entry in c.job.environment or ():
            name, eq, value = entry.partition("=")
            if eq:
                first.setdefault(name, value)
        job["environment"] = first
        listing.append("{" + f"file = {lua_string(str(c.path))}, now = {c.now}, "
                       f"loaded = {c.loaded}, modify = {lua_value(c.modify)}, "
                       f"inject = {lua_value(c.inject)}, job = {lua_value(job)}" + "}")
    cases_file = tmp_path / f"cases-{run}.lua"
    cases_file.write_text("return {\n" + ",\n".join(listing) + "\n}\n")
    r = subprocess.run([lua5_1(), str(DRIVER), str(LUA), str(cases_file)],
                       capture_output=True, text=True, timeout=timeout, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    out = []
    for line in r.stdout.splitlines():
        _, *cols = line.split("\t")
        vals = [None if v == "-" else bytes.fromhex(v).decode() for v in cols]
        rc, feats, pref, user, err, why = vals
        assert rc is not None and why is not None
        out.append(Outcome(rc, feats, pref, user, err, why == ""))
    assert len(out) == len(cases), r.stderr[-2000:]
    return out


def python_outcome(c: Case) -> Outcome:
    cf: classfile.ClassFile | None = None
    if c.text is not None:
        try:
            text = c.text.decode() if isinstance(c.text, bytes) else c.text
            cf = classfile.parse(text)
            if len(text.encode()) > classfile.MAX_BYTES:
                cf = None
        except (classfile.ClassFileError, UnicodeDecodeError):
            cf = None
    usable = cf is not None and submit.trusted(cf, c.now, c.loaded) is None
    d = submit.decide_modify(c.job) if c.modify else submit.decide(cf if usable else None, c.job,
                                                                   c.now)
    rc = {"keep": "SUCCESS", "set": "SUCCESS", "cap": "SUCCESS"}.get(d.action, d.code)
    if d.action == "cap":
        return Outcome(rc, d.features, d.prefer, None, None, usable)
    if d.action == "set":
        return Outcome(rc, d.features, d.prefer if c.job.prefer else c.job.prefer,
                       None, None, usable)
    return Outcome(rc, c.job.features, c.job.prefer, d.message or None, None, usable)


def feature(i: int) -> str:
    return "nc_" + f"{i * 2654435761 % (1 << 32):08x}"


def adds_feature(i: int) -> str:
    """A class of the second family (``nc_j...``)."""
    return "nc_j" + f"{i * 2246822519 % (1 << 32):08x}"


def cf_ab(**kw: Any) -> classfile.ClassFile:
    a, b = feature(1), feature(2)
    base = dict(verified=NOW - 1, partitions={"*": (ClassCount(a, 4), ClassCount(b, 2))},
                members={a: "n[1-4]", b: "n[5-6]"})
    base.update(kw)
    return classfile.ClassFile(**base)  # type: ignore[arg-type]


def one(tmp_path: Path, cf: classfile.ClassFile | str | None, job: JobDesc,
        **kw: Any) -> Outcome:
    text = classfile.render(cf).decode() if isinstance(cf, classfile.ClassFile) else cf
    case = Case(text, job, **kw)
    (got,) = run_lua(tmp_path, [case])
    want = python_outcome(case)
    assert replace(got, error=None) == want, (got, want)
    return got


# ------------------------------------------------- --container-image values
#: --container-image values from public threads (their provenance is in the file)
REAL_REFS = [ln for ln in (ROOT / "tests" / "data" / "image_refs.txt").read_text().splitlines()
             if ln and not ln.startswith("#")]
#: keys a file names, and values that name them (or not) as users write them
IMAGE_KEYS = ["nvcr.io/nvidia/pytorch:25.01-py3", "registry-1.docker.io/library/centos:latest",
              "/images/train.sqsh", "127.0.0.1:5000/ml/train:v1",
              "nvcr.io/nvidia/pytorch@sha256:" + "ab" * 32]
MATCHING = ["nvcr.io#nvidia/pytorch:25.01-py3", "nvcr.io/nvidia/pytorch:25.01-py3",
            " docker://nvcr.io#nvidia/pytorch:25.01-py3\n", "centos", "centos:latest",
            "/images/train.sqsh", "127.0.0.1:5000#ml/train:v1", "127.0.0.1:5000/ml/train:v1",
            "nvcr.io#nvidia/pytorch:25.01-py3@sha256:" + "ab" * 32]
IMAGE_VALUES = [*MATCHING, *REAL_REFS]
IMAGE_ODD = ["./images/train.sqsh", "nvcr.io#nvidia/PyTorch:25.01", "nvcr.io", "",
             "/images/train.sqsh ", "/images/t rain.sqsh", "u@nvcr.io#nvidia/pytorch:25.01-py3",
             "nvcr.io#nvidia/pytorch:25.01-py3\u00a0", "x" * 5000, " " * 4000 + "centos"]
OTHER_SPANK = "_SLURM_SPANK_OPTION_pyxis_container_mounts=/scratch:/scratch"
