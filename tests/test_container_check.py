"""A job's container image against the nodes it would run on: real node trees whose
enroot configuration mounts gcc-built net plugins into containers, a real squashfs image
holding a real libnccl, the real collector path's store writes, and ``ncclguard check
--image`` (the gate's own evaluation, ``evaluate_image``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers.cli import run_cli
from helpers.enroot import plant, stock_files
from helpers.parts import build_plugin, unavailable

from devtools import images
from devtools.ncclwheels import PartUnavailable
from devtools.nodetree import build_node
from inventoryd.controller.images.index import update_index
from inventoryd.filecache import FileCache
from inventoryd.node.fingerprint import collect
from inventoryd.nodefs import ErrorLog, NodeFS
from inventoryd.probes import containers
from ncclguard.config import ImagesConfig
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory

FSTAB = "{src} /usr/lib/x86_64-linux-gnu/libnccl-net.so none x-create=file,bind,ro,nosuid\n"


def test_probe_reads_enroot_pyxis_and_apptainer(tmp_path: Path) -> None:
    plugin = build_plugin(tmp_path / "pl", [8, 7], name="AWS Libfabric",
                          filename="libnccl-net-ofi.so")
    hpcx = build_plugin(tmp_path / "hx", [10, 9], name="IBext_v10")
    root = build_node(tmp_path / "n1", extra_files={
        "/opt/aws-ofi-nccl/lib/libnccl-net-ofi.so": plugin,
        "/opt/hpcx/nccl_rdma_sharp_plugin/lib/libnccl-net.so": hpcx,
        "/etc/enroot/mounts.d/50-ofi.fstab": (
            b"# the site's plugin\n/opt/aws-ofi-nccl/lib/libnccl-net-ofi.so "
            b"/usr/lib/x86_64-linux-gnu/libnccl-net-ofi.so none x-create=file,bind,ro\n"
            b"/opt/hpcx /opt/hpcx none x-create=dir,rbind,ro\n"),
        "/etc/enroot/environ.d/50-nccl.env": b"NCCL_NET_PLUGIN=ofi\nFOO=bar\n",
        "/etc/enroot/hooks.d/10-cgroups.sh": b"#!/bin/sh\nexit 0\n",
        "/etc/slurm/plugstack.conf.d/pyxis.conf":
            b"required /usr/lib/x86_64-linux-gnu/slurm/spank_pyxis.so runtime_path=/run/pyxis\n",
        "/etc/apptainer/apptainer.conf": b"bind path = /etc/localtime\nbind path = /opt/hpcx\n",
    })
    part = containers.probe(NodeFS(root), ErrorLog(), FileCache(None))
    assert part["enroot"]["environ"] == {"NCCL_NET_PLUGIN": "ofi"}
    assert [h["path"] for h in part["enroot"]["hooks"]] == ["/etc/enroot/hooks.d/10-cgroups.sh"]
    assert part["pyxis"][0]["args"] == ["runtime_path=/run/pyxis"]
    assert part["apptainer_binds"] == ["/etc/localtime", "/opt/hpcx"]
    targets = {p["target"]: p for p in part["plugins"]}
    assert targets["/usr/lib/x86_64-linux-gnu/libnccl-net-ofi.so"]["abis"]["net"] == [8, 7]
    assert targets["/opt/hpcx/nccl_rdma_sharp_plugin/lib/libnccl-net.so"]["name"] == "IBext_v10"
    # NCCL_NET_PLUGIN=ofi names libnccl-net-ofi.so: that one, not HPC-X's libnccl-net.so
    assert part["net_plugin"]["name"] == "AWS Libfabric"
    assert part["net_plugin"]["abis"] == [8, 7]


def test_a_node_without_enroot_injects_nothing(tmp_path: Path) -> None:
    fp = collect(str(build_node(tmp_path / "n0")), "n0", cache=FileCache(None))
    assert fp["containers"]["net_plugin"] is None and fp["containers"]["plugins"] == []


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, nccl_lib) -> dict[str, Path]:
    """n1, n2 inject a v6..v5 plugin (NCCL 2.18.3 speaks v6..v4); n3, n4 one of v10..v9;
    n5 injects nothing; n6 has a mounts.d file the probe cannot read (so what it injects
    is not known). Every node has enroot's shipped mounts.d and environ.d files (as a site
    that installs enroot has: issue 47), and a user's v10 plugin planted in n1's
    ``/dev/shm``. The host libnccl is 2.21.5 on n1-n4, 2.18.3 on n5 (not what a container
    loads). One image with NCCL 2.18.3 and no plugin of its own. Built once for the module
    (about 30 s: six cold fingerprints, two images of real libnccl); no test writes the
    inventory or the images."""
    tmp_path = tmp_path_factory.mktemp("containers")
    old = build_plugin(tmp_path / "p6", [6, 5], name="IBext_v6")
    new = build_plugin(tmp_path / "p10", [10, 9], name="IBext_v10")
    host_lib = nccl_lib("2.21.5")
    db = tmp_path / "inv.db"
    with Inventory(db, values=GATE_VALUES) as inv:
        for i, plugin in ((1, old), (2, old), (3, new), (4, new), (5, None), (6, old)):
            files: dict[str, Path | bytes] = dict(stock_files())
            if plugin is not None:
                files["/opt/site/libnccl-net.so"] = plugin
                files["/etc/enroot/mounts.d/50-net.fstab"] = FSTAB.format(
                    src="/opt/site/libnccl-net.so").encode()
            root = build_node(tmp_path / f"n{i}", extra_files=files,
                              libnccl=host_lib if i != 5 else nccl_lib("2.18.3"))
            if i == 1:  # any user can write /dev/shm, which the stock fstab binds
                plant(root, "/dev/shm", new)
            if i == 6:  # a FIFO where a mounts.d file belongs: not read, never blocks
                os.mkfifo(root / "etc/enroot/mounts.d/60-site.fstab")
            inv.upsert(collect(str(root), f"n{i}", cache=FileCache(None)))
        roots = tmp_path / "images"
        roots.mkdir()
        try:
            images.nccl_image(roots / "pt-2.18.sqsh", nccl_lib("2.18.3"), version="2.18.3")
            images.nccl_image(roots / "pt-2.21.sqsh", nccl_lib("2.21.5"), version="2.21.5",
                              where="/usr/local/lib/python3.10/dist-packages/nvidia/nccl/lib")
        except PartUnavailable as e:
            unavailable(str(e))
        update_index(inv, ImagesConfig(roots=(str(roots),)))
    return {"db": db, "images": roots}


@pytest.fixture
def cluster(built: dict[str, Path], tmp_path: Path) -> dict[str, Path]:
    """The module's nodes and images, with a config of this test's own (empty)."""
    cfg = tmp_path / "config.toml"
    cfg.write_text("")
    return {**built, "cfg": cfg}


def _check(cluster: dict[str, Path], *args: str) -> tuple[int, dict]:
    r = run_cli("check", "--json", *args, db=cluster["db"], config=cluster["cfg"])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output
    return r.exit_code, json.loads(r.output)


def test_an_image_that_cannot_use_some_nodes_plugin_is_refused(cluster) -> None:
    img = str(cluster["images"] / "pt-2.18.sqsh")
    code, doc = _check(cluster, "n[1-4]", "--image", img)
    assert code == 2 and doc["decision"] == "refuse"
    (f,) = [f for f in doc["findings"] if f["rule"] == "image-stack"]
    assert img in f["message"]
    groups = {g["nodes"]: g["value"] for g in f["groups"]}
    assert groups["n[1-2]"] == "NCCL 2.18.3 (pt-2.18.sqsh) with the node's IBext_v6 v6"
    assert groups["n[3-4]"].startswith("NCCL 2.18.3 (pt-2.18.sqsh) cannot use the node's "
                                       "IBext_v10 (v10..v9; it wants v6..v4): falls back to IB")
    assert doc["odd_nodes"] == "n[3-4]"
    # the same image on the nodes it can use: accepted, whatever the host's libnccl
    code, doc = _check(cluster, "n[1-2]", "--image", img)
    assert code == 0, doc
    # n5 injects nothing: NCCL 2.18.3 on its own IB, like n3-n4's fallback; the host's
    # 2.18.3 vs 2.21.5 is not compared (the job loads the image's)
    code, doc = _check(cluster, "n[3-5]", "--image", img)
    assert doc["decision"] == "refuse"  # n3-4 fall back: the image cannot use their plugin
    assert not [f for f in doc["findings"] if f["rule"] == "nccl-version"]
    # without an image the host stacks differ: nccl-version refuses n5
    code, doc = _check(cluster, "n[4-5]")
    assert doc["findings"][0]["rule"] == "nccl-version"


def test_a_node_whose_injection_is_not_known_is_image_unknown(cluster) -> None:
    """n6's containers probe could not read a mounts.d file: it is named under
    image-unknown (a warning by default), never taken as injecting nothing."""
    img = str(cluster["images"] / "pt-2.18.sqsh")
    code, doc = _check(cluster, "n[1-2,6]", "--image", img)
    assert code == 1 and doc["decision"] == "warn", doc
    (f,) = [f for f in doc["findings"] if f["rule"] == "image-unknown"]
    assert [g["nodes"] for g in f["groups"]] == ["n6"]
    assert "containers probe could not tell" in f["message"]
    cluster["cfg"].write_text('[policy.severity]\n"image-unknown" = "refuse"\n')
    code, doc = _check(cluster, "n[1-2,6]", "--image", img)
    assert code == 2


def test_an_image_whose_nccl_uses_every_plugin_runs_everywhere(cluster) -> None:
    # NCCL 2.21.5 (pip's copy) speaks v8..v5: n1-n2's v6 yes, n3-n4's v10..v9 no
    img = str(cluster["images"] / "pt-2.21.sqsh")
    code, doc = _check(cluster, "n[1-2]", "--image", img)
    assert code == 0
    code, doc = _check(cluster, "n[2-3]", "--image", img)
    assert code == 2 and doc["odd_nodes"] == "n3"


@pytest.mark.parametrize("ref,why", [
    ("nvcr.io#nvidia/pytorch:24.01-py3", "registry images are not read"),
    ("/nowhere/x.sqsh", "not in the image index"),
])
def test_an_image_that_cannot_be_checked_is_unknown(cluster, ref: str, why: str) -> None:
    code, doc = _check(cluster, "n[1-4]", "--image", ref)
    assert code == 1 and doc["decision"] == "warn"
    (f,) = doc["findings"]
    assert f["rule"] == "image-unknown" and why in f["message"]
    cluster["cfg"].write_text('[policy.severity]\n"image-unknown" = "refuse"\n')
    code, doc = _check(cluster, "n[1-4]", "--image", ref)
    assert code == 2


def test_images_cli_lists_shows_and_diffs(cluster) -> None:
    base = {"db": cluster["db"], "config": cluster["cfg"]}
    a, b = (str(cluster["images"] / n) for n in ("pt-2.18.sqsh", "pt-2.21.sqsh"))
    r = run_cli("images", **base)
    assert r.exit_code == 0 and "2.18.3" in r.output and "2 images" in r.output
    r = run_cli("images", "show", a, **base)
    assert r.exit_code == 0 and "2.18.3 (loaded)" in r.output
    # n[1-4,6] share a host stack (one class) but inject different plugins: 2.18.3 uses
    # n[1-2]'s v6 and falls back on n[3-4]'s v10 (n6's is not known), so the lua cannot
    # offer a group for it; n5 injects nothing (NCCL's own IB): it runs there
    assert "  runs on: nc_" in r.output and "(n5)" in r.output, r.output
    assert "some nodes run it, others not, in: nc_" in r.output and "(n[1-4,6])" in r.output
    doc = json.loads(run_cli("images", "show", a, "--json", **base).output)
    assert [k["nodes"] for k in doc["classes"]["runs"]] == ["n5"]
    assert [k["nodes"] for k in doc["classes"]["mixed"]] == ["n[1-4,6]"]
    assert doc["classes"]["not"] == []
    assert doc["classes"]["lua"].startswith("no line for it (one class feature cannot say")
    # NCCL 2.21.5 (v8..v5) too uses n[1-2]'s v6 and not n[3-4]'s v10; and while
    # image-stack does not refuse there is no line, saying why
    r = run_cli("images", "show", b, **base)
    assert "some nodes run it, others not, in: nc_" in r.output, r.output
    cluster["cfg"].write_text('[policy.severity]\n"image-stack" = "warn"\n')
    r = run_cli("images", "show", a, **base)
    assert "job_submit.lua: no line for it (image-stack does not refuse" in r.output, r.output
    r = run_cli("images", "diff", a, b, **base)
    assert r.exit_code == 1 and all(len(x) <= 100 for x in r.output.splitlines()), r.output
    assert r.output.startswith(f"A  {a}\nB  {b}\n"), r.output  # named once, above
    assert "nvidia/nccl/lib/libnccl.so.2]." in r.output  # the field, wrapped at its width
    r = run_cli("images", "diff", a, b, "--wide", **base)
    assert r.exit_code == 1 and "nvidia/nccl/lib/libnccl.so.2].version" in r.output
    r = run_cli("images", "show", "/nope.sqsh", **base)
    assert r.exit_code == 3 and "not in the image index" in r.output
