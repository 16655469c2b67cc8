"""job_submit.lua's logic outside slurmctld: one corpus of job descriptions and files of
classes through ``lua5.1`` (tests/lua/driver.lua, a stub ``slurm`` table and clock) and
through the Python mirror (``ncclguard.sched.submit`` over ``ncclguard.sched.classfile``),
every outcome compared, the message to the user included. The real slurmctld runs the
same script in tests/test_sched_slurm.py and tests/test_controller_safety.py.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import pytest
from helpers.parts import unavailable

from ncclguard.config import FeaturesConfig
from ncclguard.hostlist import compress
from ncclguard.policy.schedule import MAX_ALTERNATIVES, ClassCount
from ncclguard.sched import classfile, submit
from ncclguard.sched.submit import JobDesc

ROOT = Path(__file__).resolve().parents[1]
LUA = ROOT / "slurm" / "job_submit.lua"
DRIVER = ROOT / "tests" / "lua" / "driver.lua"
KEYS_DRIVER = ROOT / "tests" / "lua" / "image_keys.lua"
NOW = 1_800_000_000
#: --container-image values from public threads (their provenance is in the file)
REAL_REFS = [ln for ln in (ROOT / "tests" / "data" / "image_refs.txt").read_text().splitlines()
             if ln and not ln.startswith("#")]


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


# ------------------------------------------------------------------ the corpus
def feature(i: int) -> str:
    return "nc_" + f"{i * 2654435761 % (1 << 32):08x}"


def a_file(rng: random.Random, *, verified: int = NOW - 1) -> classfile.ClassFile:
    nodes = [f"n{i}" for i in range(1, rng.choice([4, 8, 16, 40]) + 1)] + \
            [f"gpu{i:03d}" for i in range(1, rng.choice([0, 3, 12]) + 1)]
    nclasses = rng.choice([1, 2, 3, 5, 70])
    classes = {h: feature(rng.randrange(nclasses)) for h in nodes}
    if rng.random() < 0.2:
        classes[nodes[-1]] = "nc_unknown"
    by: dict[str, list[str]] = {}
    for h, f in classes.items():
        by.setdefault(f, []).append(h)
    ranked = sorted((ClassCount(f, len(hs)) for f, hs in by.items() if len(hs) >= 2),
                    key=lambda c: (c.feature == "nc_unknown", -c.nodes, c.feature))
    limit = rng.choice([MAX_ALTERNATIVES, 3, 1])
    half = nodes[: len(nodes) // 2]
    part = sorted((ClassCount(f, n) for f in by if (n := sum(h in half for h in by[f])) >= 2),
                  key=lambda c: (-c.nodes, c.feature))
    images = {}
    if rng.random() < 0.7:
        every = list(by)
        for key in rng.sample(IMAGE_KEYS, rng.randrange(2, 6)):
            chosen = tuple(f for f in every if rng.random() < 0.4)
            until = rng.choice([0, 0, NOW + 100, NOW - 10])
            images[key] = classfile.ImageGroup(until, chosen if rng.random() < 0.85 else ())
    return classfile.ClassFile(
        verified=verified,
        min_nodes=rng.choice([2, 2, 3]),
        max_alternatives=limit,
        opt_out=rng.random() < 0.8,
        required_nodes=rng.choice(["refuse", "refuse", "gate"]),
        guarded=rng.choice([(), (), ("debug",), ("gpu", "debug")]),
        default=rng.choice([None, "debug", "gpu"]),
        partitions={"*": tuple(ranked[:limit]), "debug": tuple(part[:limit]),
                    **({"gpu": tuple(ranked[:1])} if rng.random() < 0.5 else {})},
        members={f: compress(hs) for f, hs in by.items()},
        images=images,
    )


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


def spank_env(rng: random.Random) -> tuple[str, ...] | None:
    if rng.random() < 0.5:
        return None
    value = pick(rng, MATCHING, [*REAL_REFS, *IMAGE_ODD], 0.3)
    entry = submit.IMAGE_OPTION + value
    return pick(rng, [(entry,), (OTHER_SPANK, entry), (OTHER_SPANK,)], [
        (entry, entry), (entry, submit.IMAGE_OPTION + "centos"), (OTHER_SPANK,) * 300 + (entry,),
        (OTHER_SPANK,) * 255 + (entry,), ("_SLURM_SPANK_OPTION_pyxis_container_image" + value,)])


def pick(rng: random.Random, usual: list[Any], odd: list[Any], odds: float = 0.25) -> Any:
    return rng.choice(odd if rng.random() < odds else usual)


def strings(rng: random.Random) -> str | None:
    return pick(rng, [None, None, None, "fast", "fast&big", "fast|big"], [
        "", "fast,big", "a&", "a|", "a,", "&a",
        "a&&b", "(a|b)&c", "gpu*2", "[a|b]", "a& ", " ", "gpu:a100", "x=y", "has space",
        "&".join(["fast"] * 60), "f" * 1024, "f" * 1025, "[" + "|".join("abcdefgh") * 9 + "]",
        "|".join(f"t{i}" for i in range(70)), "a" * 300,
        "[" + "|".join(f"t{i}" for i in range(65)) + "]",
    ])


def req_nodes(rng: random.Random) -> str | None:
    return pick(rng, [None] * 6 + ["n1", "n1,n2", "n[1-2]", "n[1-4]", "n1,n5"], [
        "n[1-3],gpu001", "n[1-40]", "gpu[001-003]", "n[01-02]", "n[1-2]x", "n1,,n2",
        "n[5-1]", "zz9",
        "n1 n2", "n[1-99999999]", "n" + ",n".join(str(i) for i in range(1, 41)),
        "n1," * 30000,
    ])


def a_job(rng: random.Random) -> JobDesc:
    return JobDesc(
        features=strings(rng),
        prefer=pick(rng, [None, None, "fast"], ["a&", "(x)", "p" * 1030]),
        comment=pick(rng, [None, "", "hello"],
                     ["ncclguard=off", "x NCCLGUARD=OFF;y", "c" * 1025]),
        extra=pick(rng, [None], ["ncclguard=off"]),
        partition=pick(rng, [None, "debug", "gpu"], ["other", "debug,gpu", "", "p" * 1025]),
        tres_per_job=pick(rng, [None, None, "gres/gpu:8"], ["t" * 1025], 0.05),
        req_nodes=req_nodes(rng),
        min_nodes=pick(rng, [None, 2, 3, 4, 8], [1, 12, 41, submit.NO_VAL]),
        max_nodes=pick(rng, [None], [1, 2, 100]),
        num_tasks=pick(rng, [None], [1, 4, 16]),
        ntasks_per_node=pick(rng, [None], [1, 16, submit.NO_VAL16]),
        het_job_offset=pick(rng, [None], [submit.NO_VAL, 0, 1], 0.1),
        spank_job_env=spank_env(rng),
    )


def broken(rng: random.Random, text: str) -> str | bytes:
    lines = text.split("\n")
    pick = rng.randrange(9)
    if pick == 0:
        return text[:-1]  # no final newline
    if pick == 1:
        return text.replace("ncclguard-classes 3", "ncclguard-classes 2")
    if pick == 2:
        return "\n".join([lines[0], *lines[2:3], lines[1], *lines[3:]])  # verified moved
    if pick == 3:
        return text.replace("end\n", "end\nextra\n")
    if pick == 4:
        return text.replace("opt_out", "opt_out 1\nopt_out")
    if pick == 5:
        return text.replace("members nc_", "members nc_zz", 1)
    if pick == 6:
        return text.replace("partition *", "partition * nc_0:x", 1)
    if pick == 7:
        return text.encode() + b"\xff\n"
    return text.replace("max_alternatives", "max_alternatives 0\nbogus", 1)


def corpus(seed: int, count: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        cf = a_file(rng)
        text = classfile.render(cf).decode()
        roll = rng.random()
        if roll < 0.08:
            text_or = broken(rng, text)
        elif roll < 0.1:
            text_or = None
        else:
            text_or = text
        now = pick(rng, [NOW], [NOW + 61, NOW - 5, NOW - 200], 0.1)
        cases.append(Case(text_or, a_job(rng), now=now, modify=rng.random() < 0.05))
    return cases


def compare(tmp_path: Path, cases: list[Case]) -> None:
    lua = run_lua(tmp_path, cases)
    diffs = []
    for i, (c, got) in enumerate(zip(cases, lua, strict=True)):
        want = python_outcome(c)
        if replace(got, error=None) != want:
            diffs.append(f"case {i}: job {c.job}\n  lua:    {got}\n  python: {want}")
    assert not diffs, f"{len(diffs)} of {len(cases)} differ:\n" + "\n".join(diffs[:5])


def test_lua_and_python_decide_the_same_on_a_random_corpus(tmp_path: Path) -> None:
    compare(tmp_path, corpus(seed=24, count=3000))


def test_every_kind_of_outcome_occurs_in_the_corpus() -> None:
    """The corpus exercises what it must: each action, each refusal, bad files."""
    seen = {}
    for c in corpus(seed=24, count=3000):
        o = python_outcome(c)
        kind = ("set" if o.features != c.job.features else o.rc if o.rc != "SUCCESS"
                else "keep") + ("" if o.usable else "-unusable")
        seen[kind] = seen.get(kind, 0) + 1
        if o.user:
            seen[o.user.split(",")[0][:40]] = 1
            if "nodes that run image" in o.user:
                seen["too many nodes for the image"] = 1
    for kind in ("set", "keep", "ERROR", "ESLURM_INVALID_NODE_COUNT", "keep-unusable"):
        assert seen.get(kind, 0) >= 5, (kind, seen)
    assert any(k.startswith("ncclguard: the required nodes (-w) have") for k in seen), seen
    assert any(k.startswith("ncclguard: a bracket group") for k in seen), seen
    assert any(k.startswith("ncclguard: container image") for k in seen), seen
    assert "too many nodes for the image" in seen, seen


def test_the_corpus_offers_image_jobs_only_the_classes_that_run_their_image() -> None:
    """Where the job's image has a line, the group the mirror sets names only its classes
    (the lua is compared with the mirror above); it happens often enough to count."""
    narrowed = 0
    for c in corpus(seed=24, count=3000):
        o = python_outcome(c)
        if not o.usable or o.features == c.job.features:
            continue
        cf = classfile.parse(c.text)  # type: ignore[arg-type]
        key = submit.image_key(submit.container_image(c.job))
        if key not in cf.images:
            continue
        g = cf.images[key]
        if g.until and c.now > g.until:
            continue
        group = set(o.features.rsplit("[", 1)[1].rstrip("]").split("|"))  # type: ignore[union-attr]
        offered = {k.feature for k in submit._classes_for(cf, c.job.partition)[0]}
        if offered & set(g.classes):
            assert group <= set(g.classes), (key, g, o.features)
            narrowed += 1
    assert narrowed >= 3, narrowed


def test_the_lua_keys_every_image_as_the_gate_does(tmp_path: Path) -> None:
    """Real --container-image values (tests/data/image_refs.txt) and odd ones, through
    job_submit.lua's ncclguard.image_key and ncclguard.sched.submit.image_key: the same
    key or none, and for real ones the key the gate looks the image up by
    (imageref.parse, as enroot v4.1.2 reads a reference)."""
    from ncclguard.fingerprint.imageref import parse

    odd = [*IMAGE_ODD, "docker://", "docker:///x", "oci://x/y", "@nvcr.io#a/b", "a@b@c/d:e",
           "nvcr.io#a/b@sha256:" + "AB" * 32, "nvcr.io#a/b:" + "t" * 129, "h:123456/a:b",
           "-h.io/a:b", "h-.io/a:b", "h..io/a:b", "nvcr.io#a__b/c", "nvcr.io#a___b/c",
           "nvcr.io#a._b/c", "nvcr.io#a--b/c:t", "nvcr.io#a/b/", "localhost:5000/a/b:c",
           "user.name$x@nvcr.io#nvidia/pytorch:1", "u@sha256:x/y", "a:b:c", "\t/a.sqsh\t",
           "nvcr.io#a/b:t@sha256:" + "0" * 64, "x" * 1024, "nvcr.io#" + "a" * 1020]
    values = [*REAL_REFS, *IMAGE_VALUES, *odd]
    listing = tmp_path / "values"
    listing.write_text("".join(v.encode().hex() + "\n" for v in values))
    r = subprocess.run([lua5_1(), str(KEYS_DRIVER), str(LUA), str(listing)], capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    got = [None if ln == "-" else bytes.fromhex(ln).decode() for ln in r.stdout.splitlines()]
    assert len(got) == len(values)
    diffs = [(v, g, submit.image_key(v)) for v, g in zip(values, got, strict=True)
             if g != submit.image_key(v)]
    assert not diffs, diffs[:5]
    keyed = dict(zip(values, got, strict=True))
    assert keyed["centos"] == "registry-1.docker.io/library/centos:latest"
    assert keyed["hello-world.sqsh"] == "registry-1.docker.io/library/hello-world.sqsh:latest"
    assert keyed["./hello-world.sqsh"] is None  # relative: the gate cannot know the file
    assert keyed["192.168.61.4:5000#/cosmoflow-nvidia:0.4"] is None
    assert keyed["evuedsoacr.azurecr.io/dc-ecosys-appl-eng/mlperf-nvidia:stable_diffusion-pyt"] \
        == "evuedsoacr.azurecr.io/dc-ecosys-appl-eng/mlperf-nvidia:stable_diffusion-pyt"
    assert keyed["nvcr.io#nvidia/pytorch:20.02-py3"] == "nvcr.io/nvidia/pytorch:20.02-py3"
    for v in REAL_REFS:  # every real one as the gate keys it (paths as given)
        if keyed[v] is not None and not v.startswith("/"):
            assert keyed[v] == parse(v).key, v
    assert sum(k is not None for k in keyed.values()) >= 20


# --------------------------------------------------------- chosen cases, by name
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


A, B = feature(1), feature(2)


@pytest.mark.parametrize("user", ["a&", "a|", "a,", "fast|"])
def test_a_trailing_operator_is_left_as_slurm_accepts_it(tmp_path: Path, user: str) -> None:
    """``a&`` alone is valid for Slurm; ``(a&)&[...]`` is not: left to the gate."""
    got = one(tmp_path, cf_ab(), JobDesc(features=user, min_nodes=2))
    assert (got.rc, got.features) == ("SUCCESS", user)


def test_a_user_constraint_is_joined(tmp_path: Path) -> None:
    got = one(tmp_path, cf_ab(), JobDesc(features="fast|big", prefer="fast", min_nodes=2))
    assert got.features == f"(fast|big)&[{A}|{B}]"
    assert got.prefer == f"(fast)&[{A}|{B}]"


@pytest.mark.parametrize("field_name", submit.CAPPED)
def test_a_field_past_slurms_cap_is_handed_back_for_slurm_to_refuse(tmp_path: Path,
                                                           field_name: str) -> None:
    """Slurm refuses it after the plugin; nothing is scanned or joined first, even a
    constraint that would otherwise be refused for too many terms. A constraint or
    preference is cut to 1025 characters (still past the cap: still refused)."""
    big = "|".join(f"t{i}" for i in range(400))
    value = ("[" + big + "]") if field_name in ("features", "prefer") else "x" * 1025
    job = replace(JobDesc(min_nodes=2), **{field_name: value})
    got = one(tmp_path, cf_ab(), job)
    assert got.rc == "SUCCESS" and got.user is None
    if field_name in ("features", "prefer"):  # cut to 1025: Slurm still refuses it
        assert getattr(got, field_name) == value[:1025]
    else:
        assert got.features == job.features


def test_ten_megabytes_of_constraint_are_handed_back_at_once(tmp_path: Path) -> None:
    huge = "a&" * (5 << 20)
    got = one(tmp_path, cf_ab(), JobDesc(features=huge, min_nodes=2), )
    assert got.rc == "SUCCESS" and got.features == huge[:1025]


def test_more_than_64_terms_is_refused(tmp_path: Path) -> None:
    job = JobDesc(features="[" + "|".join(f"t{i}" for i in range(65)) + "]", min_nodes=2)
    got = one(tmp_path, cf_ab(), job)
    assert got.rc == "ERROR" and got.user is not None and "names 65" in got.user
    got = one(tmp_path, None, job, modify=True)
    assert got.rc == "ERROR"


def test_required_nodes_across_classes_are_refused_naming_them(tmp_path: Path) -> None:
    got = one(tmp_path, cf_ab(), JobDesc(req_nodes="n1,n5", min_nodes=2))
    assert got.rc == "ERROR"
    assert got.user == (f"ncclguard: the required nodes (-w) have 2 different NCCL stacks "
                        f"({A}: n1; {B}: n5); ask for nodes of one class (see `ncclguard "
                        "classes`)")
    # without -N too: the -w list's size decides that the job spans nodes
    assert one(tmp_path, cf_ab(), JobDesc(req_nodes="n[4-5]")).rc == "ERROR"


def test_required_nodes_in_one_class_get_that_class_alone(tmp_path: Path) -> None:
    got = one(tmp_path, cf_ab(), JobDesc(req_nodes="n[1-2]", min_nodes=3))
    assert (got.rc, got.features) == ("SUCCESS", f"[{A}]")
    got = one(tmp_path, cf_ab(), JobDesc(req_nodes="n5", min_nodes=3))
    assert got.rc == "ERROR" and got.user is not None and "which has 2 nodes" in got.user


def _in(image: str) -> tuple[str, ...]:
    return (OTHER_SPANK, submit.IMAGE_OPTION + image)


def test_an_image_job_gets_only_the_classes_that_run_its_image(tmp_path: Path) -> None:
    ref, key = "nvcr.io#nvidia/pytorch:25.01-py3", "nvcr.io/nvidia/pytorch:25.01-py3"
    cf = cf_ab(images={key: classfile.ImageGroup(0, (B,))})
    got = one(tmp_path, cf, JobDesc(min_nodes=2, spank_job_env=_in(ref)))
    assert (got.rc, got.features) == ("SUCCESS", f"[{B}]")
    # the same image written as enroot also reads it; another image: every class
    got = one(tmp_path, cf, JobDesc(min_nodes=2, spank_job_env=_in(f"docker://{key}")))
    assert got.features == f"[{B}]"
    got = one(tmp_path, cf, JobDesc(min_nodes=2, spank_job_env=_in("nvcr.io#nvidia/x:1")))
    assert got.features == f"[{A}|{B}]"
    # more nodes than the classes that run it hold
    got = one(tmp_path, cf, JobDesc(min_nodes=3, spank_job_env=_in(ref)))
    assert got.rc == "ESLURM_INVALID_NODE_COUNT" and got.user == (
        f"ncclguard: this job needs 3 nodes that run image {key} with one NCCL stack, but the "
        f"largest such set in the cluster has 2 nodes (ask for at most 2, or see `ncclguard "
        f"check --image {key}`)")
    # the line has passed its time (the tag's resolution is too old): every class
    cf = cf_ab(images={key: classfile.ImageGroup(NOW - 1, (B,))})
    got = one(tmp_path, cf, JobDesc(min_nodes=2, spank_job_env=_in(ref)))
    assert got.features == f"[{A}|{B}]"


def test_an_image_no_class_runs_is_refused_and_an_unreadable_one_left_alone(
        tmp_path: Path) -> None:
    cf = cf_ab(images={"/images/old.sqsh": classfile.ImageGroup(0, ())})
    got = one(tmp_path, cf, JobDesc(min_nodes=2, spank_job_env=_in(" /images/old.sqsh")))
    assert got.rc == "ERROR" and got.user is not None
    assert got.user.startswith("ncclguard: container image /images/old.sqsh runs on no class")
    # jobs that may run on one node (the gate leaves them alone: found by review, they
    # were refused), two images, more entries than read, a relative path: as before
    old = _in("/images/old.sqsh")
    for job in (JobDesc(min_nodes=1, max_nodes=1, spank_job_env=old),
                JobDesc(tres_per_job="gres/gpu:4", spank_job_env=old),
                JobDesc(num_tasks=4, spank_job_env=old),
                JobDesc(min_nodes=1, max_nodes=4, spank_job_env=old),
                JobDesc(min_nodes=2, spank_job_env=_in("/images/old.sqsh") * 2),
                JobDesc(min_nodes=2, spank_job_env=(OTHER_SPANK,) * 256 + _in("/images/old.sqsh")),
                JobDesc(min_nodes=2, spank_job_env=_in("./images/old.sqsh"))):
        got = one(tmp_path, cf, job)
        assert got.rc == "SUCCESS", job


def test_a_bad_image_line_makes_the_file_unusable(tmp_path: Path) -> None:
    good = classfile.render(cf_ab(images={"/a.sqsh": classfile.ImageGroup(0, (A,))})).decode()
    for bad in ("image /a.sqsh 0 nc_zz", "image /a.sqsh x", "image /a.sqsh", "image a\x01 0"):
        got = one(tmp_path, good.replace("image /a.sqsh 0 " + A, bad),
                  JobDesc(min_nodes=2))
        assert not got.usable, bad
    twice = good.replace("image /a.sqsh 0 " + A, f"image /a.sqsh 0 {A}\nimage /a.sqsh 0")
    assert not one(tmp_path, twice, JobDesc(min_nodes=2)).usable
    many = "\n".join(f"image /{i}.sqsh 0" for i in range(classfile.MAX_IMAGES + 1))
    assert not one(tmp_path, good.replace("image /a.sqsh 0 " + A, many),
                   JobDesc(min_nodes=2)).usable


@pytest.mark.parametrize("req", ["n[1-2]x", "n1 n5", "zz9", "n[1-99999999]"])
def test_a_required_list_the_lua_cannot_read_is_left_to_the_gate(tmp_path: Path,
                                                                  req: str) -> None:
    got = one(tmp_path, cf_ab(), JobDesc(req_nodes=req, min_nodes=2))
    assert (got.rc, got.features) == ("SUCCESS", None)


def test_required_nodes_gate_setting_leaves_them_to_the_gate(tmp_path: Path) -> None:
    got = one(tmp_path, cf_ab(required_nodes="gate"), JobDesc(req_nodes="n1,n5", min_nodes=2))
    assert (got.rc, got.features) == ("SUCCESS", None)


def test_an_injected_error_leaves_the_job_accepted_without_a_group(tmp_path: Path) -> None:
    for inject in ("spans", "classes", "parse", "expand"):
        case = Case(classfile.render(cf_ab()).decode(),
                    JobDesc(min_nodes=2, req_nodes="n1,n2" if inject == "expand" else None),
                    inject=inject)
        (got,) = run_lua(tmp_path, [case])
        assert (got.rc, got.features, got.user) == ("SUCCESS", None, None), inject
        assert got.error is not None and "injected error" in got.error, inject
        assert "the gate checks it" in got.error


def test_a_fifo_at_the_file_never_blocks(tmp_path: Path) -> None:
    fifo = tmp_path / "classes"
    os.mkfifo(fifo)
    case = Case(None, JobDesc(min_nodes=2), path=fifo)
    (got,) = run_lua(tmp_path, [case], timeout=20)
    assert (got.rc, got.features, got.usable) == ("SUCCESS", None, False)
    with pytest.raises(classfile.ClassFileError, match="not a regular file"):
        classfile.read(fifo)


def test_a_directory_or_a_file_too_large_is_not_used(tmp_path: Path) -> None:
    d = tmp_path / "classes-dir"
    d.mkdir()
    (got,) = run_lua(tmp_path, [Case(None, JobDesc(min_nodes=2), path=d)])
    assert (got.rc, got.features, got.usable) == ("SUCCESS", None, False)
    text = classfile.render(cf_ab()).decode()
    big = text.replace("end\n", "\n" * (classfile.MAX_BYTES) + "end\n")
    got = one(tmp_path, big, JobDesc(min_nodes=2))
    assert (got.features, got.usable) == (None, False)


def test_the_body_is_parsed_again_only_when_it_changes(tmp_path: Path) -> None:
    """One loaded script over three files: a new ``verified`` reuses the parsed body,
    a new body is parsed (its classes used), a broken one is not used."""
    path = tmp_path / "classes"
    t1 = classfile.render(cf_ab(verified=NOW - 2)).decode()
    t3 = classfile.render(cf_ab(verified=NOW - 1, members={A: "n[1-6]"},
                                partitions={"*": (ClassCount(A, 6),)})).decode()
    script = tmp_path / "seq.lua"
    script.write_text(f"""
local CLOCK = {NOW - 100}
os.time = function() return CLOCK end
slurm = {{ SUCCESS = 0, ERROR = -1, ESLURM_INVALID_NODE_COUNT = 2006,
  log_user = function() end, log_info = function() end, log_debug = function() end,
  log_error = function(...) print("ERROR", ...) end }}
assert(loadfile({lua_string(str(LUA))}))()
local _, ng = debug.getupvalue(slurm_job_submit, 1)
ng.CLASSES_FILE = {lua_string(str(path))}
local parses, parse_body = 0, ng.parse_body
ng.parse_body = function(...) parses = parses + 1; return parse_body(...) end
local function write(text) local f = io.open(ng.CLASSES_FILE, "w"); f:write(text); f:close() end
local function job()
  local j = {{ min_nodes = 2 }}; slurm_job_submit(j, nil, 0); return j.features
end
CLOCK = {NOW}
write({lua_string(t1)})
print(job(), parses)
for i = 1, 5 do
  CLOCK = CLOCK + 1
  write((string.gsub({lua_string(t1)}, "verified %d+", "verified " .. CLOCK - 1)))
  print(job(), parses)
end
CLOCK = CLOCK + 1
write({lua_string(t3)})
print(job(), parses)
CLOCK = CLOCK + 1
write("ncclguard-classes 3\\nverified " .. CLOCK - 1 .. "\\nnonsense\\n")
print(job(), parses)
""")
    r = subprocess.run([lua5_1(), str(script)], capture_output=True, text=True, timeout=30,
                       check=True)
    lines = [ln.split("\t") for ln in r.stdout.splitlines()]
    assert lines[0] == [f"[{A}|{B}]", "1"]
    assert all(ln == [f"[{A}|{B}]", "1"] for ln in lines[1:6]), lines
    assert lines[6] == [f"[{A}]", "2"]
    assert lines[7] == ["nil", "3"]


def test_the_lua_and_python_agree_on_limits() -> None:
    lua = LUA.read_text()
    assert f"ncclguard.FRESH_S = {classfile.LUA_FRESH_S}\n" in lua
    assert f"ncclguard.MAX_TERMS = {MAX_ALTERNATIVES} " in lua
    assert f"ncclguard.MAX_FILE = {classfile.MAX_BYTES} " in lua
    assert f"ncclguard.MAX_MEMBERS = {classfile.MAX_MEMBERS} " in lua
    assert f"ncclguard.MAX_REQ_NODES = {submit.MAX_REQ_NODES} " in lua
    assert f'ncclguard.MAGIC = "{classfile.MAGIC}"' in lua
    assert f'ncclguard.CLASSES_FILE = "{FeaturesConfig().classes_file}"' in lua
    capped = re.search(r"ncclguard\.CAPPED = \{([^}]*)\}", lua)
    assert capped is not None
    assert tuple(re.findall(r'"(\w+)"', capped[1])) == submit.CAPPED



