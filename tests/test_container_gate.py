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

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest_slurm import require_slurm

from devtools import images
from devtools.devcluster import DevCluster
from devtools.ncclwheels import PartUnavailable
from devtools.nodetree import build_node
from inventoryd.collect import collect
from inventoryd.filecache import FileCache
from ncclguard import audit
from tests.conftest import build_plugin, extract_nccl, unavailable

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

FSTAB = b"/opt/site/libnccl-net.so /usr/lib/x86_64-linux-gnu/libnccl-net.so none bind,ro\n"


@pytest.fixture(scope="module")
def pyxis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DevCluster, Path]]:
    require_slurm()
    root = tmp_path_factory.mktemp("pyxis")
    try:
        stub = images.build_pyxis_stub(root / "spank")
        img_dir = root / "images"
        img_dir.mkdir()
        image = images.nccl_image(img_dir / "pytorch-nccl2.18.sqsh", extract_nccl("2.18.3"),
                                  version="2.18.3", comp="zstd")
    except PartUnavailable as e:
        unavailable(str(e))
    plugstack = root / "plugstack.conf"
    plugstack.write_text(f"required {stub}\n")
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
        "NCCL 2.18.3 cannot use the node's IBext_v10 (v10..v9; it wants v6..v4)")
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
