"""job_submit.lua's logic outside slurmctld: one corpus of job descriptions and files of
classes through ``lua5.1`` (tests/lua/driver.lua, a stub ``slurm`` table and clock) and
through the Python mirror (``ncclguard.sched.submit`` over ``ncclguard.sched.classfile``),
every outcome compared, the message to the user included (the harness:
tests/helpers/lua.py; image jobs' named cases: tests/test_lua_images.py).

Over 500 lines: the corpus's generators (files, jobs, images, environments) and the named
cases share the harness and the decisions they check; split, each half would repeat the
other's helpers. The real
slurmctld runs the same script in tests/test_sched_slurm.py and
tests/test_controller_safety.py.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from helpers.lua import (
    IMAGE_KEYS,
    IMAGE_ODD,
    LUA,
    MATCHING,
    NOW,
    OTHER_SPANK,
    REAL_REFS,
    Case,
    adds_feature,
    cf_ab,
    feature,
    lua5_1,
    lua_string,
    one,
    python_outcome,
    run_lua,
)

from ncclguard.config import FeaturesConfig
from ncclguard.fingerprint.jobenv import INPUTS, MAX_SUBMIT_KEY, submit_key
from ncclguard.hostlist import compress
from ncclguard.policy.schedule import MAX_ALTERNATIVES, ClassCount
from ncclguard.sched import classfile, submit
from ncclguard.sched.submit import JobDesc

# ------------------------------------------------------------------ the corpus
#: batch jobs' environments (NAME=value entries as sbatch sends them): a pip venv, a
#: conda env, an Lmod module's LD_LIBRARY_PATH, with NCCL_* beside them; and odd ones
ENVS: list[tuple[str, ...]] = [
    ("VIRTUAL_ENV=/home/alice/venv", "PATH=/usr/bin"),
    ("CONDA_PREFIX=/opt/conda/envs/torch", "NCCL_NET=IB", "NCCL_IB_HCA=mlx5_0:1"),
    ("LD_LIBRARY_PATH=/sw/nccl/2.23.4/lib:/usr/local/cuda/lib64", "NCCL_DEBUG=INFO"),
    ("VIRTUAL_ENV=/home/bob/my venv;x%y", "NCCL_SOCKET_IFNAME=ib0"),
    ("LD_PRELOAD=/home/alice/lib/libnccl.so.2", "VIRTUAL_ENV=/home/alice/venv"),
]
ENV_ODD: list[tuple[str, ...]] = [
    ("VIRTUAL_ENV=/home/alice/venv", "VIRTUAL_ENV=/home/mallory/venv"),  # the first counts
    ("VIRTUAL_ENV=/home/mallory/venv", "VIRTUAL_ENV=/home/alice/venv"),
    ("VIRTUAL_ENV=", "CONDA_PREFIX=/opt/conda/envs/torch", "NCCL_NET=IB", "NCCL_IB_HCA=mlx5_0:1"),
    ("NCCL_NET=IB",),  # NCCL_* alone: the host's libnccl
    ("VIRTUAL_ENV=/home/caf\xe9/venv",),  # not ASCII: no key
    ("VIRTUAL_ENV=/x\ty",),  # a tab: no key
    ("LD_LIBRARY_PATH=" + "/p" * (MAX_SUBMIT_KEY // 2),),  # one byte too long
    ("LD_LIBRARY_PATH=" + "/p" * (MAX_SUBMIT_KEY // 2 - 8),),  # just fits
    ("LD_LIBRARY_PATH=" + "/p" * 1500, "VIRTUAL_ENV=" + "/v" * 600),  # too long together
    ("VIRTUAL_ENV=/home/alice/venv", "NCCL_NET=Socket"),  # NCCL_* is not in the key
    ("PATH=" + "/usr/bin:" * 3000, "VIRTUAL_ENV=/home/alice/venv"),
    (*(f"V{i}=x" for i in range(5000)), "CONDA_PREFIX=/opt/conda/envs/torch"),
]


def env_keys() -> list[str]:
    keys = []
    for entries in ENVS + ENV_ODD:
        first: dict[str, str] = {}
        for e in entries:
            name, _, value = e.partition("=")
            first.setdefault(name, value)
        if (k := submit_key(first)) is not None:
            keys.append(k)
    return keys


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
    adds: dict[str, tuple[ClassCount, ...]] = {}
    envs: dict[str, tuple[str, ...]] = {}
    if rng.random() < 0.6:  # the second family ([features] own_nccl)
        nadds = rng.choice([1, 2, 2, 3, 70])
        family = {h: adds_feature(rng.randrange(nadds)) for h in nodes}
        aby: dict[str, list[str]] = {}
        for h, f in family.items():
            aby.setdefault(f, []).append(h)
        aranked = sorted((ClassCount(f, len(hs)) for f, hs in aby.items() if len(hs) >= 2),
                         key=lambda c: (-c.nodes, c.feature))
        apart = sorted((ClassCount(f, n) for f in aby
                        if (n := sum(h in half for h in aby[f])) >= 2),
                       key=lambda c: (-c.nodes, c.feature))
        adds = {"*": tuple(aranked[:limit]), "debug": tuple(apart[:limit])}
        keys = env_keys()
        for key in rng.sample(keys, rng.randrange(2, len(keys) + 1)):
            envs[key] = tuple(f for f in aby if rng.random() < 0.7) \
                if rng.random() < 0.9 else ()
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
        adds=adds,
        envs=envs,
    )


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
        **batch(rng),
    )


def batch(rng: random.Random) -> dict[str, Any]:
    """A batch job's script and environment (half the jobs), or an srun/salloc's none."""
    roll = rng.random()
    if roll < 0.3:
        return {}
    env = pick(rng, ENVS, ENV_ODD, 0.3)
    if roll < 0.35:
        return {"environment": env}  # no script: the lua does not read it
    return {"script": "#!/bin/sh\nsrun train.py\n", "environment": env}


def broken(rng: random.Random, text: str) -> str | bytes:
    lines = text.split("\n")
    pick = rng.randrange(9)
    if pick == 0:
        return text[:-1]  # no final newline
    if pick == 1:
        return text.replace(classfile.MAGIC, "ncclguard-classes 3")
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
    seen: dict[str, int] = {}
    for c in corpus(seed=24, count=3000):
        o = python_outcome(c)
        kind = ("set" if o.features != c.job.features else o.rc if o.rc != "SUCCESS"
                else "keep") + ("" if o.usable else "-unusable")
        seen[kind] = seen.get(kind, 0) + 1
        if o.features and "[nc_j" in o.features:
            seen["own NCCL"] = seen.get("own NCCL", 0) + 1
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
    assert seen.get("own NCCL", 0) >= 5, seen


def test_the_corpus_offers_jobs_from_a_known_environment_only_its_classes() -> None:
    """Where a batch job's environment has an env line, the group the mirror sets names
    only the second-family classes of that line (the lua is compared with the mirror
    above); never for a job without a script or with an image."""
    narrowed = 0
    for c in corpus(seed=24, count=3000):
        o = python_outcome(c)
        if not o.usable or o.features == c.job.features or o.features is None:
            continue
        group = set(o.features.rsplit("[", 1)[1].rstrip("]").split("|"))
        if not any(f.startswith("nc_j") for f in group):
            continue
        assert c.job.script is not None, c.job
        assert submit.image_key(submit.container_image(c.job)) is None, c.job
        cf = classfile.parse(c.text)  # type: ignore[arg-type]
        key = submit.environment_key(c.job)
        assert key is not None and group <= set(cf.envs[key]), (key, o.features)
        narrowed += 1
    assert narrowed >= 10, narrowed


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
        offered = {k.feature for k in submit._classes_for(cf, c.job.partition,
                                                          cf.partitions)[0]}
        if offered & set(g.classes):
            assert group <= set(g.classes), (key, g, o.features)
            narrowed += 1
    assert narrowed >= 3, narrowed


# --------------------------------------------------------- chosen cases, by name
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
    changed: dict[str, Any] = {field_name: value}
    job = replace(JobDesc(min_nodes=2), **changed)
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


def test_required_nodes_of_a_job_from_a_known_environment_are_left_to_the_gate(
        tmp_path: Path) -> None:
    """n1 and n5 are in two host classes: a -w job of the host's NCCL is refused at submit.
    A batch job from an environment with an env line does not load the hosts' libnccl and
    the file names no second-family members: it goes on without a group, the gate judges
    it by its own NCCL (before: refused for a difference it never loads)."""
    j = adds_feature(1)
    cf = cf_ab(adds={"*": (ClassCount(j, 6),)}, envs={"VIRTUAL_ENV=/home/a/v": (j,)})
    env = ("VIRTUAL_ENV=/home/a/v",)
    got = one(tmp_path, cf, JobDesc(req_nodes="n1,n5", min_nodes=2, script="#!/bin/sh\n",
                                    environment=env))
    assert (got.rc, got.features) == ("SUCCESS", None), got
    other = ("VIRTUAL_ENV=/home/a/other",)
    for job in (JobDesc(req_nodes="n1,n5", min_nodes=2, script="#!/bin/sh\n",
                        environment=other),
                JobDesc(req_nodes="n1,n5", min_nodes=2, environment=env)):  # no script
        got = one(tmp_path, cf, job)
        assert got.rc == "ERROR" and "the required nodes (-w) have 2" in str(got.user), got


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
write("{classfile.MAGIC}\\nverified " .. CLOCK - 1 .. "\\nnonsense\\n")
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
    assert f"ncclguard.MAX_ENVS = {classfile.MAX_ENVS} " in lua
    assert f"ncclguard.MAX_ENV_KEY = {MAX_SUBMIT_KEY}\n" in lua
    listed = re.search(r"ncclguard\.ENV_INPUTS = \{([^}]*)\}", lua)
    assert listed is not None and tuple(re.findall(r'"(\w+)"', listed[1])) == INPUTS
    assert f'ncclguard.CLASSES_FILE = "{FeaturesConfig().classes_file}"' in lua
    capped = re.search(r"ncclguard\.CAPPED = \{([^}]*)\}", lua)
    assert capped is not None
    assert tuple(re.findall(r'"(\w+)"', capped[1])) == submit.CAPPED



def test_an_env_line_with_a_non_ascii_byte_is_refused_by_both(tmp_path: Path) -> None:
    """A key written with %80..%FF (the sync never writes one: keys are ASCII) decodes in
    the lua to bytes that a job's UTF-8 value matches, where the mirror's key of that job is
    None: both refuse such a line (the file is not used), so they never decide apart."""
    j = adds_feature(1)
    text = classfile.render(cf_ab(adds={"*": (ClassCount(j, 4),)},
                                  envs={"VIRTUAL_ENV=/x": (j,)})).decode()
    for word in ("VIRTUAL_ENV=/home/caf%C3%A9/venv", "VIRTUAL_ENV=/a%80", "VIRTUAL_ENV=/a%FF"):
        bad = text.replace("end\n", f"env {word} {j}\nend\n")
        assert classfile.decode_key(word) is None
        got = one(tmp_path, bad, JobDesc(min_nodes=2, script="#!/bin/sh\n",
                                         environment=("VIRTUAL_ENV=/home/caf\u00e9/venv",)))
        assert not got.usable and got.features is None
    assert classfile.decode_key("VIRTUAL_ENV=/a%7F%00") == "VIRTUAL_ENV=/a\x7f\0"
