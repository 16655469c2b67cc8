"""The containers probe on enroot's shipped configuration (issue 47): the mount and
environment files enroot installs on every node (``tests/data/enroot``, copied from its
releases with their provenance) beside a site's own, gcc-built plugins, node trees whose
owners and modes are those of a real node.

Before issue 47, enroot's stock ``tmpfs /tmp tmpfs ...`` line made the probe raise (a
relative source handed to ``NodeFS.is_dir``), and the node's part fell back to "injects
nothing"; and any ``libnccl-net*.so`` under a bound ``/dev/shm`` counted as injected,
whoever wrote it, the first by target name winning."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.enroot import USER, plant, stock_files
from helpers.parts import build_plugin

from devtools.nodetree import build_node
from inventoryd.filecache import FileCache
from inventoryd.node.fingerprint import collect
from inventoryd.nodefs import ErrorLog, NodeFS
from inventoryd.probes import containers
from ncclguard.policy.evaluation import container_values

SITE = "/opt/site/lib/libnccl-net.so"
SITE_FSTAB = (f"{SITE} /usr/lib/x86_64-linux-gnu/libnccl-net.so none "
              "x-create=file,bind,ro,nosuid\n").encode()


@pytest.fixture(scope="module")
def plugins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("plugins")
    return {"v6": build_plugin(d / "p6", [6, 5], name="IBext_v6"),
            "v10": build_plugin(d / "p10", [10, 9], name="IBext_v10")}


def _node(tmp_path: Path, name: str, files: dict[str, Path | bytes]) -> Path:
    return build_node(tmp_path / name, extra_files=files, rdma="mlx5-ib")


def _probe(root: Path) -> dict:
    return containers.probe(NodeFS(root), ErrorLog(), FileCache(None))


@pytest.mark.parametrize("release", ["v4.1.2", "v2.2.0"])
def test_the_stock_files_are_read_and_the_sites_plugin_is_found(
        tmp_path: Path, plugins: dict[str, Path], release: str) -> None:
    root = _node(tmp_path, "n1", {**stock_files(release), SITE: plugins["v6"],
                                  "/etc/enroot/mounts.d/50-site.fstab": SITE_FSTAB})
    fp = collect(str(root), "n1", cache=FileCache(None))
    part = fp["containers"]
    assert not [e for e in fp["errors"] if e["probe"] == "containers"], fp["errors"]
    assert part["unknown"] is None
    assert part["net_plugin"]["name"] == "IBext_v6" and part["net_plugin"]["abis"] == [6, 5]
    mounts = {m["target"]: m for m in part["enroot"]["mounts"]}
    assert mounts["/tmp"]["type"] == "tmpfs" and mounts["/dev/shm"]["options"].startswith(
        "x-create=dir,bind")
    assert container_values(fp)["injected"] == "IBext_v6|6,5"


def test_the_stock_files_alone_inject_nothing_and_say_so(tmp_path: Path) -> None:
    root = _node(tmp_path, "n1", stock_files())
    part = _probe(root)
    assert part["unknown"] is None and part["net_plugin"] is None and part["plugins"] == []


@pytest.mark.parametrize("where", ["/dev/shm", "/tmp/x"])
def test_a_plugin_a_user_plants_changes_nothing(
        tmp_path: Path, plugins: dict[str, Path], where: str) -> None:
    """``/dev/shm`` (bound by the stock ``10-system.fstab``, and under the rbound ``/dev``)
    and a world-writable directory a site binds: a plugin any user puts there is not
    what the node injects (both sort before the site's by target: the first by name won)."""
    files = {**stock_files(), SITE: plugins["v6"],
             "/etc/enroot/mounts.d/50-site.fstab": SITE_FSTAB,
             "/etc/enroot/mounts.d/60-scratch.fstab":
                 b"/tmp/x /usr/lib/x86_64-linux-gnu/aa-scratch none x-create=dir,bind\n"}
    clean = _probe(_node(tmp_path, "clean", files))
    root = _node(tmp_path, "n1", files)
    plant(root, where, plugins["v10"])
    part = _probe(root)
    assert part == clean
    assert part["net_plugin"]["name"] == "IBext_v6" and part["unknown"] is None


def test_a_user_owned_plugin_named_by_the_site_is_unknown(
        tmp_path: Path, plugins: dict[str, Path]) -> None:
    """NCCL_NET_PLUGIN=evil names a file a user owns in the site's directory: never
    analysed as the node's, and not "none" either (issue 47's review: a container may
    load it): the node's injection is unknown."""
    files = {**stock_files(), "/etc/enroot/environ.d/50-nccl.env": b"NCCL_NET_PLUGIN=evil\n",
             "/etc/enroot/mounts.d/50-site.fstab":
                 b"/opt/site/lib /usr/lib/x86_64-linux-gnu/site none x-create=dir,rbind\n"}
    root = _node(tmp_path, "n1", files)
    plant(root, "/opt/site/lib", plugins["v10"], mode=0o755, name="libnccl-net-evil.so")
    part = _probe(root)
    assert part["plugins"] == [] and part["net_plugin"] is None
    assert "libnccl-net-evil.so: a file others can write" in part["unknown"]


def test_the_choice_follows_the_linkers_order(tmp_path: Path, plugins: dict[str, Path]) -> None:
    """Two plugins injected as ``libnccl-net.so``: in ``/usr/lib`` (sorts first by name)
    and in the multiarch directory (the linker's first); an injected LD_LIBRARY_PATH
    comes before both."""
    files: dict[str, Path | bytes] = {
        **stock_files(), "/opt/a/libnccl-net.so": plugins["v10"],
        "/opt/b/libnccl-net.so": plugins["v6"],
        "/etc/enroot/mounts.d/50-a.fstab":
            b"/opt/a/libnccl-net.so /usr/lib/libnccl-net.so none x-create=file,bind\n",
        "/etc/enroot/mounts.d/60-b.fstab":
            b"/opt/b/libnccl-net.so /usr/lib/x86_64-linux-gnu/libnccl-net.so none bind\n"}
    part = _probe(_node(tmp_path, "n1", files))
    assert part["net_plugin"]["target"] == "/usr/lib/x86_64-linux-gnu/libnccl-net.so"
    assert part["net_plugin"]["name"] == "IBext_v6"
    files["/etc/enroot/environ.d/50-path.env"] = b'LD_LIBRARY_PATH="/usr/lib:${LD_LIBRARY_PATH}"\n'
    part = _probe(_node(tmp_path, "n2", files))
    assert part["net_plugin"]["target"] == "/usr/lib/libnccl-net.so"
    assert part["net_plugin"]["name"] == "IBext_v10"


def test_a_later_environ_file_wins(tmp_path: Path, plugins: dict[str, Path]) -> None:
    """enroot-switchroot sets the environ.d lines in order: the last value of a name is
    the container's (it was the first before)."""
    files: dict[str, Path | bytes] = {
        **stock_files(), "/opt/a/libnccl-net-a.so": plugins["v10"],
        "/opt/b/libnccl-net-b.so": plugins["v6"],
        "/etc/enroot/mounts.d/50-ab.fstab":
            b"/opt/a/libnccl-net-a.so /usr/lib/libnccl-net-a.so none bind\n"
            b"/opt/b/libnccl-net-b.so /usr/lib/libnccl-net-b.so none bind\n",
        "/etc/enroot/environ.d/10-a.env": b"NCCL_NET_PLUGIN=a\n",
        "/etc/enroot/environ.d/90-b.env": b"  NCCL_NET_PLUGIN='b'\n"}
    part = _probe(_node(tmp_path, "n1", files))
    assert part["enroot"]["environ"]["NCCL_NET_PLUGIN"] == "b"
    assert part["net_plugin"]["name"] == "IBext_v6"


def test_a_plugin_off_every_known_linker_path_is_unknown(
        tmp_path: Path, plugins: dict[str, Path]) -> None:
    """HPC-X bound at /opt/hpcx: the image's own LD_LIBRARY_PATH decides whether a
    container loads it, which the node cannot know; an injected LD_LIBRARY_PATH can."""
    plugin = "/opt/hpcx/nccl_rdma_sharp_plugin/lib/libnccl-net.so"
    files: dict[str, Path | bytes] = {
        **stock_files(), plugin: plugins["v10"],
        "/etc/enroot/mounts.d/50-hpcx.fstab": b"/opt/hpcx /opt/hpcx none x-create=dir,rbind,ro\n"}
    fp = collect(str(_node(tmp_path, "n1", files)), "n1", cache=FileCache(None))
    assert fp["containers"]["net_plugin"] is None
    assert "depends on the image's own linker path" in fp["containers"]["unknown"]
    assert container_values(fp)["injected"] is None  # the gate: image-unknown for it
    files["/etc/enroot/environ.d/50-hpcx.env"] = (
        b"LD_LIBRARY_PATH=/opt/hpcx/nccl_rdma_sharp_plugin/lib\n")
    part = _probe(_node(tmp_path, "n2", files))
    assert part["unknown"] is None and part["net_plugin"]["path"] == plugin


def test_an_unreadable_mounts_file_is_unknown_not_nothing(tmp_path: Path) -> None:
    """A FIFO where a mounts.d file belongs: never blocks, and the node's answer is
    unknown (the file may bind a plugin)."""
    root = _node(tmp_path, "n1", stock_files())
    os.mkfifo(root / "etc/enroot/mounts.d/50-site.fstab")
    fp = collect(str(root), "n1", cache=FileCache(None))
    assert "50-site.fstab" in fp["containers"]["unknown"]
    assert container_values(fp)["injected"] is None


def test_a_failing_probe_is_unknown_not_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe that raises (the stock-config bug before issue 47: ValueError) costs its
    part, which says the answer is not known: the gate reads image-unknown, never "the
    node injects no plugin"."""
    def broken(*_a: object) -> dict:
        raise ValueError("node paths are absolute: 'tmpfs'")

    monkeypatch.setattr(containers, "probe", broken)
    fp = collect(str(_node(tmp_path, "n1", {})), "n1", cache=FileCache(None))
    assert fp["containers"]["unknown"]
    assert container_values(fp)["injected"] is None
    assert any("probe failed: ValueError" in e["error"] for e in fp["errors"])


@pytest.mark.parametrize("line,want", [
    # enroot-mount's guesses (bin/enroot-mount.c mount_fstab's comment)
    ("tmpfs /dst", {"source": "tmpfs", "target": "/dst", "type": "tmpfs", "options": ""}),
    ("/src", {"source": "/src", "target": "/src", "type": "none",
              "options": "rbind,x-create=auto"}),
    ("/src bind", {"source": "/src", "target": "/src", "type": "none", "options": "bind"}),
    ("/src /dst", {"source": "/src", "target": "/dst", "type": "none",
                   "options": "rbind,x-create=auto"}),
    ("/src /dst bind", {"source": "/src", "target": "/dst", "type": "none", "options": "bind"}),
    ("none /dst devpts", {"source": "none", "target": "/dst", "type": "devpts", "options": ""}),
    # getmntent's octal escapes
    (r"/opt/my\040site/lib /usr/lib/site none rbind",
     {"source": "/opt/my site/lib", "target": "/usr/lib/site", "type": "none",
      "options": "rbind"}),
    ("  # a comment", None),
])
def test_fstab_lines_are_read_as_enroot_mount_reads_them(line: str, want: dict | None) -> None:
    got = containers.parse_fstab(line)
    assert got == ([want] if want else [])


@pytest.mark.parametrize("mount,source", [
    ({"source": "/proc", "target": "/proc", "type": "none", "options": "rbind"}, "/proc"),
    ({"source": "tmpfs", "target": "/tmp", "type": "tmpfs", "options": "rw"}, None),
    ({"source": "${HOME}/.plugins", "target": "/p", "type": "none", "options": "bind"}, None),
    ({"source": "/a//b/../c", "target": "/c", "type": "none", "options": "bind"}, "/a/c"),
    ({"source": "/a", "target": "/a", "type": "none", "options": "x-detach"}, None),
    ({"source": "/dev/sdb1", "target": "/data", "type": "ext4", "options": "ro"}, None),
])
def test_only_an_absolute_bind_source_brings_files_in(mount: dict, source: str | None) -> None:
    assert containers.bind_source(mount) == source


def _scratch(root: Path) -> Path:
    """A world-writable directory of the node (``/scratch``, mode 1777)."""
    d = root / "scratch"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o1777)
    return d


def test_a_users_link_on_the_way_to_a_bound_source_makes_it_unknown(
        tmp_path: Path, plugins: dict[str, Path]) -> None:
    """From issue 47's review: the site binds /scratch/site at /opt/site (its linker
    path), and /scratch is 1777: a user's link /scratch/site -> /opt/hpcx-a chose which of
    root's plugins the node was said to inject (or "none", pointing it at their own)."""
    files: dict[str, Path | bytes] = {
        **stock_files(), "/opt/hpcx-a/lib/libnccl-net.so": plugins["v6"],
        "/etc/enroot/mounts.d/50-site.fstab": b"/scratch/site /opt/site none x-create=dir,rbind\n",
        "/etc/enroot/environ.d/50-path.env": b"LD_LIBRARY_PATH=/opt/site/lib\n"}
    root = _node(tmp_path, "n1", files)
    link = _scratch(root) / "site"
    link.symlink_to("../opt/hpcx-a")
    os.lchown(link, USER, USER)
    part = _probe(root)
    assert part["net_plugin"] is None
    assert "/opt/site: others can write it" in part["unknown"], part["unknown"]


def test_a_directory_others_can_write_where_the_linker_looks_is_unknown(
        tmp_path: Path, plugins: dict[str, Path]) -> None:
    """From issue 47's review: /scratch/plugins (1777) bound at the injected linker
    directory: whatever a user puts there is what a container loads first; the node's
    answer is unknown, before and after a user plants anything."""
    files: dict[str, Path | bytes] = {
        **stock_files(), SITE: plugins["v6"],
        "/etc/enroot/mounts.d/50-site.fstab": SITE_FSTAB,
        "/etc/enroot/mounts.d/60-plugins.fstab": b"/scratch/plugins /opt/plugins none bind\n",
        "/etc/enroot/environ.d/50-path.env": b"LD_LIBRARY_PATH=/opt/plugins\n"}
    root = _node(tmp_path, "n1", files)
    (_scratch(root) / "plugins").mkdir()
    os.chmod(root / "scratch/plugins", 0o1777)
    before = _probe(root)
    plant(root, "/scratch/plugins", plugins["v10"])
    after = _probe(root)
    for part in (before, after):
        assert part["net_plugin"] is None and "/opt/plugins: others can write it" in (
            part["unknown"] or ""), part


def test_a_users_file_first_on_the_linker_path_is_unknown(
        tmp_path: Path, plugins: dict[str, Path]) -> None:
    """From issue 47's review: a libnccl-net.so a user owns, first on the linker path,
    was passed over and the next (the site's, later on the path) named."""
    files: dict[str, Path | bytes] = {
        **stock_files(), "/opt/sys/libnccl-net.so": plugins["v6"],
        "/etc/enroot/mounts.d/50-site.fstab":
            b"/opt/site/lib /opt/site/lib none rbind\n"
            b"/opt/sys/libnccl-net.so /usr/lib/x86_64-linux-gnu/libnccl-net.so none bind\n",
        "/etc/enroot/environ.d/50-path.env": b"LD_LIBRARY_PATH=/opt/site/lib\n"}
    root = _node(tmp_path, "n1", files)
    plant(root, "/opt/site/lib", plugins["v10"], mode=0o755)
    part = _probe(root)
    assert part["net_plugin"] is None and "/opt/site/lib/libnccl-net.so: others can write" in (
        part["unknown"] or ""), part


def test_a_linked_directory_on_the_linker_path_is_followed(
        tmp_path: Path, plugins: dict[str, Path]) -> None:
    """From issue 47's review (root's own configuration): /opt/site/lib -> lib64 on the
    injected linker path was not walked, and the plugin of a later directory was named."""
    files: dict[str, Path | bytes] = {
        **stock_files(), "/opt/site/lib64/libnccl-net.so": plugins["v6"],
        "/opt/site/lib2/libnccl-net.so": plugins["v10"],
        "/etc/enroot/mounts.d/50-site.fstab": b"/opt/site /opt/site none x-create=dir,rbind\n",
        "/etc/enroot/environ.d/50-path.env": b"LD_LIBRARY_PATH=/opt/site/lib:/opt/site/lib2\n"}
    root = _node(tmp_path, "n1", files)
    (root / "opt/site/lib").symlink_to("lib64")
    part = _probe(root)
    assert part["unknown"] is None and part["net_plugin"]["name"] == "IBext_v6", part


def test_many_binds_of_one_big_directory_cost_one_walk(tmp_path: Path) -> None:
    """From issue 47's review: 200 fstab lines binding one directory of 4,000 entries
    took 12 s (each line walked it again); one walk, and one budget for the probe."""
    import time

    root = _node(tmp_path, "n1", {})
    big = root / "opt/big"
    big.mkdir(parents=True)
    for i in range(4000):
        (big / f"f{i}").write_bytes(b"")
    lines = b"".join(b"/opt/big /opt/big%d none rbind\n" % i for i in range(200))
    (root / "etc/enroot/mounts.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/enroot/mounts.d/50-big.fstab").write_bytes(lines)
    t = time.monotonic()
    part = _probe(root)
    assert time.monotonic() - t < 3.0
    assert part["unknown"] is None and part["net_plugin"] is None
