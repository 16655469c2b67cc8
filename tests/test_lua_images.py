"""job_submit.lua's image lines (issue 30), outside slurmctld: real ``--container-image``
values keyed by the lua as the gate keys them, and named cases of image jobs through the
lua and its Python mirror (tests/helpers/lua.py). The random corpus, image jobs among
its cases: tests/test_lua_submit.py; on a real slurmctld: tests/test_image_groups_slurm.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from helpers.lua import (
    IMAGE_ODD,
    IMAGE_VALUES,
    LUA,
    NOW,
    OTHER_SPANK,
    REAL_REFS,
    ROOT,
    cf_ab,
    feature,
    lua5_1,
    one,
)

from ncclguard.sched import classfile, submit
from ncclguard.sched.submit import JobDesc

KEYS_DRIVER = ROOT / "tests" / "lua" / "image_keys.lua"
A, B = feature(1), feature(2)


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
