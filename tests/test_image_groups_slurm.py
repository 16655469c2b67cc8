"""Prevention at submit for container-image jobs (issue 30): on a real slurmctld with the
shipped job_submit.lua, the pyxis stub (``--container-image`` reaches the lua in
``spank_job_env``), the features daemon and a real registry on loopback, a job in a
registry image is offered only the classes whose nodes run that image.

n[1-4] use and inject a gcc-built net plugin of ABIs v8..v7, n[5-6] one of v10..v9 (two
classes; the host libnccl is 2.21.5 on all). In the registry, ``ml/train:mid`` holds NCCL
2.21.5 (it knows v8, not v10: it runs on n[1-4] only), ``ml/train:new`` 2.26.2 (both
plugins: every class) and ``ml/train:old`` 2.18.3 (v6..v4: no class).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest
from helpers.parts import build_plugin, extract_nccl, pyxis_plugstack
from helpers.registry import Registry, nccl_layer, push_image
from helpers.slurm import require_slurm
from helpers.wait import wait_until

from devtools.devcluster import DevCluster
from devtools.nodetree import build_node
from inventoryd.filecache import FileCache
from inventoryd.node.fingerprint import collect
from ncclguard import audit
from ncclguard.hostlist import expand
from ncclguard.sched import classfile

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

PLUGIN = "/usr/lib/x86_64-linux-gnu/libnccl-net.so"  # the host's NCCL loads it
FSTAB = f"/opt/site/libnccl-net.so {PLUGIN} none bind,ro\n".encode()  # enroot injects it


class Site:
    def __init__(self, cluster: DevCluster, registry: Registry) -> None:
        self.c, self.reg = cluster, registry
        self.ref = {tag: f"{registry.host}#ml/train:{tag}" for tag in ("old", "mid", "new")}
        self.key = {tag: f"{registry.host}/ml/train:{tag}" for tag in self.ref}

    def classes(self) -> dict[str, str | None]:
        """host -> its class feature, as Slurm has it (None: none yet)."""
        return {n.name: next((f for f in n.active_features if f.startswith("nc_")), None)
                for n in self.c.slurm().nodes()}

    def images(self) -> dict[str, classfile.ImageGroup]:
        try:
            return classfile.read(self.c.classes_file).images
        except classfile.ClassFileError:
            return {}

    def submit(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.c.run(["sbatch", *args], check=False)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    require_slurm()
    root = tmp_path_factory.mktemp("imagegroups")
    plugstack = pyxis_plugstack(root)
    with Registry(root / "registry") as reg, \
            DevCluster(root / "cluster", nodes=6, prolog=True, job_submit=True,
                       extra_conf=f"PlugStackConfig={plugstack}") as c:
        v8 = build_plugin(root / "p8", [8, 7], name="IBext_v8")
        v10 = build_plugin(root / "p10", [10, 9], name="IBext_v10")
        for i, host in enumerate(c.node_names):
            plugin = v8 if i < 4 else v10
            node = build_node(root / "nodes" / host, libnccl=extract_nccl("2.21.5"), extra_files={
                "/opt/site/libnccl-net.so": plugin, PLUGIN: plugin,
                "/etc/enroot/mounts.d/50-net.fstab": FSTAB})
            c.publish_fingerprint(host, collect(str(node), host, cache=FileCache(None)))
        for tag, version in (("old", "2.18.3"), ("mid", "2.21.5"), ("new", "2.26.2")):
            push_image(reg, "ml/train", tag, [nccl_layer(version)])
        s = Site(c, reg)
        refs = ", ".join(f'"{r}"' for r in s.ref.values())
        c.write_gate_config(
            f'[gate]\naudit_log = "{c.audit_path}"\nsteer_wait_s = 30\n'
            f'[features]\nclasses_file = "{c.classes_file}"\ninterval_s = 0.5\n'
            f'[registry]\nenabled = true\ninsecure = ["{reg.host}"]\n'
            f'platform = "linux/amd64"\nrefs = [{refs}]\nresolve_interval_s = 0.0\n')
        r = c.collect()
        assert "6 accepted, 0 rejected" in r.stderr, r.stderr
        for key in s.key.values():
            assert f"registry: {key} read as" in r.stderr, r.stderr
        c.start_features_daemon()
        wait_until(lambda: len(set(s.classes().values()) - {None}) == 2 and set(s.images()) == {
            s.key["old"], s.key["mid"]}, 60, "two classes and two image lines",
            detail=lambda: c.classes_file.read_text() if c.classes_file.exists() else "none")
        # the lua trusts a file verified after this slurmctld loaded it: a second later
        wait_until(lambda: "[nc_" in _group(s), 30, "the class group")
        yield s


def _group(s: Site, *args: str) -> str:
    """The constraint job_submit.lua gives a held two-node job (the job then cancelled)."""
    r = s.submit("--hold", "-N2", *args, "--wrap", "true")
    assert r.returncode == 0, r.stderr
    job = int(r.stdout.split()[-1])
    try:
        return s.c.job_field(job, "Features")
    finally:
        s.c.run(["scancel", str(job)], check=False)


def test_an_image_job_is_offered_only_the_classes_that_run_its_image(site: Site) -> None:
    s, c = site, site.c
    classes = s.classes()
    small, large = sorted(set(classes.values()), key=list(classes.values()).count)
    assert {h for h, f in classes.items() if f == large} == {"n1", "n2", "n3", "n4"}
    assert s.images()[s.key["mid"]].classes == (large,)
    assert s.images()[s.key["old"]].classes == ()
    # without an image, and with one every class runs: the whole group, largest first
    for args in ((), (f"--container-image={s.ref['new']}",)):
        assert _group(s, *args) == f"[{large}|{small}]", args
    # 2.21.5 cannot use n[5-6]'s v10 plugin: Slurm is offered n[1-4]'s class alone
    r = s.submit("-N2", f"--container-image={s.ref['mid']}", "--wrap", "true")
    assert r.returncode == 0, r.stderr
    job = int(r.stdout.split()[-1])
    assert c.job_field(job, "Features") == f"[{large}]"
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 60) == "COMPLETED"
    (rec,) = audit.read(c.audit_path, job=job)  # one decision: no refusal, no requeue
    assert rec["decision"] == "accept" and rec["image_ref"] == s.key["mid"], rec
    assert not rec["findings"], rec["findings"]
    assert set(expand(rec["nodes"])) <= {"n1", "n2", "n3", "n4"}, rec["nodes"]


def test_an_image_no_class_runs_is_refused_at_submit_naming_it(site: Site) -> None:
    s = site
    r = s.submit("-N2", f"--container-image={s.ref['old']}", "--wrap", "true")
    assert r.returncode != 0
    assert f"ncclguard: container image {s.key['old']} runs on no class of nodes" in r.stderr
    assert f"`ncclguard check --image {s.key['old']}`" in r.stderr
    # too many nodes for the class that runs it: refused, saying so
    r = s.submit("-N5", f"--container-image={s.ref['mid']}", "--wrap", "true")
    assert r.returncode != 0
    assert (f"this job needs 5 nodes that run image {s.key['mid']} with one NCCL stack, but "
            "the largest such set in partition debug has 4 nodes") in r.stderr, r.stderr


def test_the_group_follows_the_tag_when_it_moves(site: Site) -> None:
    """``mid`` pushed again as the 2.18.3 image: after the collector's next pass the
    daemon rewrites the file's image lines (no class changed) and the next job is
    refused at submit; then put back (the module's other tests, shuffled, come after)."""
    s, c = site, site.c
    before = s.images()[s.key["mid"]].classes
    assert before

    def mid_runs_on(classes: tuple[str, ...]) -> bool:
        g = s.images().get(s.key["mid"])
        return g is not None and g.classes == classes

    push_image(s.reg, "ml/train", "mid", [nccl_layer("2.18.3")])
    try:
        c.collect()
        # its line names no class now, as old's does (the ends may differ: a changed line
        # gets a new one, an unchanged line keeps the file's)
        wait_until(lambda: mid_runs_on(()), 30, "the moved tag's line",
                   detail=lambda: c.classes_file.read_text())
        r = s.submit("-N2", f"--container-image={s.ref['mid']}", "--wrap", "true")
        assert r.returncode != 0 and "runs on no class of nodes" in r.stderr, r.stderr
        assert "image groups: 2 images some class cannot run; changed: " \
            f"{s.key['mid']}" in c.log_tail("features", 200)
    finally:
        push_image(s.reg, "ml/train", "mid", [nccl_layer("2.21.5")])
        c.collect()
        wait_until(lambda: mid_runs_on(before), 30, "mid's line as before",
                   detail=lambda: c.classes_file.read_text())
    # the lua trusts the file again a second after it is written
    wait_until(lambda: "[nc_" in _group(s, f"--container-image={s.ref['mid']}"), 30,
               "mid's group again")
