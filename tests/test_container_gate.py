"""The gate end to end for a job in a container image: a real slurmctld whose plugstack
loads a stub SPANK plugin registering pyxis's options (compiled here against
libslurm-dev's ``spank.h``), so that ``sbatch --container-image=PATH`` reaches
PrologSlurmctld as ``SPANK__SLURM_SPANK_OPTION_pyxis_container_image`` exactly as with
pyxis; node records fingerprinted from real node trees (enroot mounts a gcc-built net
plugin into containers), signed and collected; the image indexed by the collector from a
real squashfs file holding a real libnccl.

n1, n2, n4 inject a plugin of ABIs v6..v5, n3 one of v10..v9; the image's NCCL 2.18.3
asks for v6..v4: it cannot use n3's plugin.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.parts import build_plugin, extract_nccl, place, pyxis_plugstack, unavailable
from helpers.slurm import require_slurm

from devtools import images
from devtools.devcluster import DevCluster
from devtools.ncclwheels import PartUnavailable
from devtools.nodetree import build_node
from inventoryd.filecache import FileCache
from inventoryd.node.fingerprint import collect
from ncclguard import audit

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

FSTAB = b"/opt/site/libnccl-net.so /usr/lib/x86_64-linux-gnu/libnccl-net.so none bind,ro\n"


@pytest.fixture(scope="module")
def pyxis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DevCluster, Path]]:
    require_slurm()
    root = tmp_path_factory.mktemp("pyxis")
    plugstack = pyxis_plugstack(root)
    try:
        img_dir = root / "images"
        img_dir.mkdir()
        image = images.nccl_image(img_dir / "pytorch-nccl2.18.sqsh", extract_nccl("2.18.3"),
                                  version="2.18.3", comp="zstd")
    except PartUnavailable as e:
        unavailable(str(e))
    with DevCluster(root / "cluster", nodes=4, prolog=True,
                    extra_conf=f"PlugStackConfig={plugstack}") as c:
        old = build_plugin(root / "p6", [6, 5], name="IBext_v6")
        new = build_plugin(root / "p10", [10, 9], name="IBext_v10")
        for host in c.node_names:
            node = build_node(root / "nodes" / host, libnccl=extract_nccl("2.21.5"), extra_files={
                "/opt/site/libnccl-net.so": new if host == "n3" else old,
                "/etc/enroot/mounts.d/50-net.fstab": FSTAB})
            c.publish_fingerprint(host, collect(str(node), host, cache=FileCache(None)))
        _configure(c, image)
        # the collector indexes the image under [images] roots in the same scan
        r = c.collect()
        assert "4 accepted, 0 rejected" in r.stderr, r.stderr
        assert "images: 1 scanned" in r.stderr, r.stderr
        yield c, image


def _configure(c: DevCluster, image: Path) -> None:
    c.write_gate_config(f'[gate]\naudit_log = "{c.audit_path}"\nsteer_wait_s = 30\n'
                        f'[images]\nroots = ["{image.parent}"]\n')


def test_image_job_is_refused_on_a_node_whose_plugin_it_cannot_use_and_steered(
        pyxis_cluster: tuple[DevCluster, Path]) -> None:
    c, image = pyxis_cluster
    c.cancel_all()
    _configure(c, image)
    # the host libnccl is 2.21.5 everywhere: without the image this job would be accepted
    job = c.sbatch(["-N3", f"--container-image={image}", "--wrap", "hostname"])
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 120) == "COMPLETED"
    recs = audit.read(c.audit_path, job=job)
    refusal = next(r for r in recs if r.get("decision") == "refuse")
    assert refusal["image"] == str(image)
    assert refusal["nodes"] == "n[1-3]" and refusal["odd_nodes"] == ["n3"]
    (f,) = [f for f in refusal["findings"] if f["rule"] == "image-stack"]
    assert str(image) in f["message"] and "cannot use the net plugin" in f["message"]
    assert {g["nodes"]: g["value"] for g in f["groups"]}["n3"].startswith(
        "NCCL 2.18.3 (pytorch-nccl2.18.sqsh) cannot use the node's IBext_v10 (v10..v9; "
        "it wants v6..v4)")
    # what the user sees: the AdminComment names the image and the node
    comment = c.slurm().job(job).admin_comment  # type: ignore[union-attr]
    assert comment.startswith("ncclguard: refuse, odd n3: image-stack [NCCL 2.18.3 "
                              "(pytorch-nccl2.18.sqsh) cannot use"), comment
    assert "requeued without n3" in comment
    assert recs[-1]["decision"] == "accept" and recs[-1]["nodes"] == "n[1-2,4]"
    assert c.job_field(job, "ExcNodeList") == "n3"


def test_the_same_image_on_compatible_nodes_runs(pyxis_cluster: tuple[DevCluster, Path]) -> None:
    c, image = pyxis_cluster
    c.cancel_all()
    _configure(c, image)
    job = c.sbatch(["-N2", "-w", "n[1-2]", f"--container-image={image}", "--wrap", "true"])
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 60) == "COMPLETED"
    (rec,) = audit.read(c.audit_path, job=job)
    assert rec["decision"] == "accept" and rec["image"] == str(image)


def test_a_registry_image_is_unknown_and_warned(pyxis_cluster: tuple[DevCluster, Path]) -> None:
    c, image = pyxis_cluster
    c.cancel_all()
    _configure(c, image)
    job = c.sbatch(["-N2", "-w", "n[1-2]", "--container-image=nvcr.io#nvidia/pytorch:24.01-py3",
                    "--wrap", "true"])
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 60) == "COMPLETED"
    (rec,) = audit.read(c.audit_path, job=job)
    assert rec["decision"] == "warn"
    assert rec["findings"][0]["rule"] == "image-unknown"
    assert "image-unknown" in c.slurm().job(job).admin_comment  # type: ignore[union-attr]


def test_the_enroot_hook_records_what_each_node_ran(
        pyxis_cluster: tuple[DevCluster, Path], tmp_path: Path) -> None:
    """The hook's command on each node of a finished job, in the container root enroot
    would have made of the image (unsquashfs -d, as enroot create does), signed by that
    node's munged; the collector keeps them and ``decisions --job`` shows them. A
    record that a node's munged signs under another node's name is rejected, and so is
    one for a job that did not run on its node (Slurm's node list of the job; the
    signer, root, is the job's owner, by Slurm's user_id)."""
    import json
    import subprocess

    from helpers.cli import run_cli

    c, image = pyxis_cluster
    c.cancel_all()
    _configure(c, image)
    (c.records / "containers").mkdir(mode=0o1733, exist_ok=True)  # the admin's install step
    job = c.sbatch(["-N2", "-w", "n[1-2]", f"--container-image={image}", "--wrap", "true"])
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 60) == "COMPLETED"
    rootfs = tmp_path / "rootfs"
    subprocess.run(["unsquashfs", "-no-progress", "-d", str(rootfs), str(image)], check=True,
                   capture_output=True)
    # n3 claims to be n1; then n3 records for itself a job that did not run there
    for host, name, step in (("n1", "n1", "0"), ("n2", "n2", "0"), ("n3", "n1", "1"),
                             ("n3", "n3", "0")):
        env = {"PATH": "/usr/bin:/bin", "ENROOT_ROOTFS": str(rootfs), "SLURM_JOB_ID": str(job),
               "SLURM_STEP_ID": step, "SLURMD_NODENAME": name,
               "NCCLGUARD_CONFIG": str(c.node_config(host))}
        r = subprocess.run([sys.executable, "-m", "inventoryd.main", "container-record"],
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "not published" not in r.stderr, r.stderr
        assert "containers/" in r.stderr, r.stderr
    r = c.collect()
    assert "container record n1+" in r.stderr and "which is not n1's" in r.stderr, r.stderr
    # Slurm's own answer: job J ran on n[1-2] as root, who signed n1's and n2's records
    assert f"container record n3+{job}+0.rec rejected (wrong-node): job {job} did not run " \
        "on n3" in r.stderr, r.stderr
    assert "container records: 2 kept, 2 rejected" in r.stderr, r.stderr
    base = {"db": c.db, "config": c.config_path}
    out = run_cli("decisions", "--job", str(job), **base)
    assert out.exit_code == 0, out.output
    assert "what each node's container had" in out.output
    rows = [ln for ln in out.output.splitlines() if ln.startswith("0 ")]  # step 0's
    assert len(rows) == 2 and all("2.18.3" in ln for ln in rows), out.output
    assert out.output.count("libnccl.so.2") == 2, out.output  # the paths, wrapped not cut
    doc = json.loads(run_cli("decisions", "--job", str(job), "--json", **base).output)
    assert [(r["step"], r["host"], r["nccl_version"]) for r in doc["containers"]] == [
        ("0", "n1", "2.18.3"), ("0", "n2", "2.18.3")]
    log = tmp_path / "job.out"
    log.write_text("n1:1:1 [0] NCCL INFO NCCL version 2.18.3+cuda12.1\n")
    out = run_cli("diagnose", "--job", str(job), str(log), **base)
    assert out.exit_code == 0, out.output
    assert "what each node's container had" in out.output and "2.18.3" in out.output


def test_the_hook_command_never_fails(tmp_path: Path) -> None:
    import subprocess

    for env in ({}, {"ENROOT_ROOTFS": str(tmp_path), "SLURM_JOB_ID": "1",
                     "NCCLGUARD_CONFIG": str(tmp_path / "missing.toml")}):
        r = subprocess.run([sys.executable, "-m", "inventoryd.main", "container-record"],
                           env={"PATH": "/usr/bin:/bin", **env}, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0
        assert "nothing done" in r.stderr or "not published" in r.stderr


def test_a_registry_image_is_judged_by_the_digest_its_tag_resolved_to(
        pyxis_cluster: tuple[DevCluster, Path], tmp_path: Path) -> None:
    """A real registry on loopback (tests/helpers/registry.py): ``ml/train:v1`` holds NCCL
    2.18.3 (it asks for net v6..v4, n3 injects v10..v9), ``ml/train:ok`` 2.26.2. The
    collector resolves and reads both; ``sbatch -N3 --container-image=HOST#ml/train:v1``
    is refused naming n3, requeued and completes on n[1-2,4]; the compatible tag runs;
    after v1 is moved to the 2.26.2 image the next job is judged by the new digest."""
    from helpers.registry import Registry, nccl_layer, push_image

    c, image = pyxis_cluster
    c.cancel_all()
    with Registry(tmp_path / "registry") as reg:
        v1 = push_image(reg, "ml/train", "v1", [nccl_layer("2.18.3")])
        ok = push_image(reg, "ml/train", "ok", [nccl_layer("2.26.2")])
        ref, ok_ref = f"{reg.host}#ml/train:v1", f"{reg.host}#ml/train:ok"
        c.write_gate_config(
            f'[gate]\naudit_log = "{c.audit_path}"\nsteer_wait_s = 30\n'
            f'[images]\nroots = ["{image.parent}"]\n'
            f'[registry]\nenabled = true\ninsecure = ["{reg.host}"]\nplatform = "linux/amd64"\n'
            f'refs = ["{ref}", "{ok_ref}"]\nresolve_interval_s = 0.0\n')
        r = c.collect()  # (a registry reference an earlier test's job used is tried too)
        assert f"registry: {reg.host}/ml/train:v1 read as {v1}" in r.stderr, r.stderr
        assert f"registry: {reg.host}/ml/train:ok read as {ok}" in r.stderr, r.stderr

        job = c.sbatch(["-N3", f"--container-image={ref}", "--wrap", "hostname"])
        assert c.wait_job(job, {"COMPLETED", "FAILED"}, 120) == "COMPLETED"
        recs = audit.read(c.audit_path, job=job)
        refusal = next(x for x in recs if x.get("decision") == "refuse")
        assert refusal["image"] == ref and refusal["image_digest"] == v1
        assert refusal["nodes"] == "n[1-3]" and refusal["odd_nodes"] == ["n3"]
        (f,) = [f for f in refusal["findings"] if f["rule"] == "image-stack"]
        assert "cannot use the net plugin" in f["message"]
        assert recs[-1]["decision"] == "accept" and recs[-1]["nodes"] == "n[1-2,4]"

        job = c.sbatch(["-N2", "-w", "n[1-2]", f"--container-image={ok_ref}", "--wrap", "true"])
        assert c.wait_job(job, {"COMPLETED", "FAILED"}, 60) == "COMPLETED"
        (rec,) = audit.read(c.audit_path, job=job)
        assert rec["decision"] == "accept" and rec["image_digest"] == ok
        assert not rec["findings"], rec["findings"]

        moved = push_image(reg, "ml/train", "v1", [nccl_layer("2.26.2")])
        assert moved == ok != v1  # the same image under the moved tag
        r = c.collect()
        job = c.sbatch(["-N3", f"--container-image={ref}", "--wrap", "true"])
        assert c.wait_job(job, {"COMPLETED", "FAILED"}, 120) == "COMPLETED"
        first = audit.read(c.audit_path, job=job)[0]
        assert first["image_digest"] == moved and first["nodes"] == "n[1-3]"
        # 2.26.2 can use n3's v10 and the others' v6: no longer "cannot use"; the two
        # plugins still differ, so the job is held to one transport
        messages = " ".join(f["message"] for f in first["findings"])
        assert "cannot use the net plugin" not in messages, messages
        assert audit.read(c.audit_path, job=job)[-1]["nodes"] == "n[1-2,4]"

    # what each node's container really had, against the digest the gate judged: n2
    # imported the tag before it moved (its container had 2.18.3)
    import subprocess

    from helpers.cli import run_cli

    (c.records / "containers").mkdir(mode=0o1733, exist_ok=True)
    # (the hook reads the linker's libnccl, not pip's: the same file, its sha256 compared)
    for host, version in (("n1", "2.26.2"), ("n2", "2.18.3")):
        rootfs = tmp_path / f"rootfs-{host}"
        place(rootfs, "/usr/lib/x86_64-linux-gnu/libnccl.so.2", extract_nccl(version))
        env = {"PATH": "/usr/bin:/bin", "ENROOT_ROOTFS": str(rootfs), "SLURM_JOB_ID": str(job),
               "SLURM_STEP_ID": "0", "SLURMD_NODENAME": host,
               "NCCLGUARD_CONFIG": str(c.node_config(host))}
        r = subprocess.run([sys.executable, "-m", "inventoryd.main", "container-record"],
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "containers/" in r.stderr, r.stderr
    r = c.collect()
    assert "container records: 2 kept" in r.stderr, r.stderr
    out = run_cli("decisions", "--job", str(job), "--json", db=c.db, config=c.config_path)
    rows = {x["host"]: x for x in json.loads(out.output)["containers"]}
    assert rows["n1"]["judged"] == f"the libnccl of {moved[:19]}", rows
    assert rows["n2"]["judged"].startswith("another libnccl than"), rows
