"""The bounded squashfs reader and the image fingerprint, on real images built with
mksquashfs (every compressor of Debian 12's squashfs-tools 4.5.1) holding real libnccl
files from NVIDIA's wheels and gcc-built plugins."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest
from helpers.parts import build_plugin, unavailable

from devtools import images
from devtools.ncclwheels import PartUnavailable
from inventoryd.controller.images.fingerprint import parse_environment, scan_image
from inventoryd.controller.images.squashfs import ImageError, ImagePathError, SquashImage


def _image(out: Path, files: dict[str, Path | bytes | str], links: dict[str, str] | None = None,
           comp: str = "gzip", compress_data: bool = True) -> Path:
    try:
        return images.build_image(out, files, links, comp, compress_data=compress_data)
    except PartUnavailable as e:
        unavailable(str(e))


def test_symlinks_resolve_inside_the_image(tmp_path: Path) -> None:
    img = _image(tmp_path / "l.sqsh", {"/etc/nccl.conf": "NCCL_IB_HCA=mlx5\n",
                                      "/opt/a/b/libnccl.so.2": b"x"},
                 {"/usr/lib/rel": "../../etc/nccl.conf", "/usr/lib/abs": "/etc/nccl.conf",
                  "/usr/lib/escape": "../../../../../../etc/nccl.conf",
                  "/usr/lib/absdir": "/opt/a", "/usr/lib/chain1": "chain2",
                  "/usr/lib/chain2": "absdir/b/libnccl.so.2",
                  "/usr/lib/loopa": "loopb", "/usr/lib/loopb": "loopa",
                  "/usr/lib/self": "self", "/usr/lib/dangling": "/nowhere"})
    im = SquashImage(str(img))
    assert im.resolve("/usr/lib/rel") == "/etc/nccl.conf"
    assert im.resolve("/usr/lib/abs") == "/etc/nccl.conf"  # absolute: the image's root
    assert im.resolve("/usr/lib/escape") == "/etc/nccl.conf"  # .. stops at the image root
    assert im.resolve("/usr/lib/chain1") == "/opt/a/b/libnccl.so.2"
    for loop in ("/usr/lib/loopa", "/usr/lib/self"):
        with pytest.raises(ImagePathError, match="more than 40 symlinks"):
            im.resolve(loop)
    with pytest.raises(ImagePathError, match="no such file"):
        im.resolve("/usr/lib/dangling")
    buf = io.BytesIO()
    assert im.copy_file("/usr/lib/escape", buf) == ("/etc/nccl.conf", 17)
    assert buf.getvalue() == b"NCCL_IB_HCA=mlx5\n"
    # the host's /etc/nccl.conf is never what a link names: the escape read the image's


@pytest.mark.parametrize("comp", images.COMPRESSORS)
def test_every_compressor_with_a_real_libnccl(tmp_path: Path, comp: str, nccl_lib) -> None:
    # the smallest real library (nvidia-nccl-cu11 2.19.3, 176 MB; 2.18.3's is 290 MB): the
    # matrix compresses it five times
    lib = nccl_lib("2.19.3")
    plugin = build_plugin(tmp_path / "pl", [8, 7], name="IBext_v8")
    try:
        img = images.nccl_image(
            tmp_path / f"{comp}.sqsh", lib, version="2.19.3", comp=comp, compress_data=True,
            plugins={"/usr/lib/x86_64-linux-gnu/libnccl-net.so": plugin},
            env='NCCL_DEBUG=INFO\nexport NCCL_SOCKET_IFNAME="ib0"\nPATH=/bin\n',
            nccl_conf="NCCL_IB_HCA=mlx5\n")
    except PartUnavailable as e:
        unavailable(str(e))
    rec = scan_image(str(img))
    default = [r for r in rec["libnccl"] if r["default"]]
    assert [r["path"] for r in default] == ["/usr/lib/x86_64-linux-gnu/libnccl.so.2"]
    assert default[0]["realpath"] == "/usr/lib/x86_64-linux-gnu/libnccl.so.2.19.3"
    assert default[0]["version"] == "2.19.3" and default[0]["abis"]["net"] == [7, 6, 5]
    assert default[0]["size"] == lib.stat().st_size
    assert rec["net_plugin"] == "/usr/lib/x86_64-linux-gnu/libnccl-net.so"
    assert rec["plugins"][0]["abis"]["net"] == [8, 7] and rec["plugins"][0]["name"] == "IBext_v8"
    assert rec["nccl_conf"]["settings"] == {"NCCL_IB_HCA": "mlx5"}
    assert rec["env"] == {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "ib0"}
    assert rec["rc"].startswith("mkdir -p /workspace")
    assert rec["errors"] == []


def test_pip_nccl_is_the_default_and_its_version_is_read_from_the_file(
        tmp_path: Path, nccl_lib) -> None:
    sys_lib, pip_lib = nccl_lib("2.18.3"), nccl_lib("2.21.5")
    pipdir = "/usr/local/lib/python3.10/dist-packages/nvidia/nccl/lib"
    img = _image(tmp_path / "pip.sqsh", {
        "/usr/lib/x86_64-linux-gnu/libnccl.so.2": sys_lib,
        f"{pipdir}/libnccl.so.2": pip_lib,
        # PyTorch beside it loads it (a stray pip copy is not the default: issue 48,
        # tests/test_image_hostile.py)
        "/usr/local/lib/python3.10/dist-packages/torch/__init__.py": b"",
        # a label that lies: never read
        # what is read, not how it is decompressed (the compressor matrix above): the two
        # real libraries' data blocks stored as they are (devtools/images.py)
        "/etc/environment": "NCCL_VERSION=2.30.7\n"}, comp="zstd", compress_data=False)
    rec = scan_image(str(img))
    by_path = {r["path"]: r for r in rec["libnccl"]}
    assert by_path[f"{pipdir}/libnccl.so.2"]["default"] is True
    assert by_path[f"{pipdir}/libnccl.so.2"]["version"] == "2.21.5"
    assert by_path[f"{pipdir}/libnccl.so.2"]["origin"] == "pip"
    assert by_path["/usr/lib/x86_64-linux-gnu/libnccl.so.2"]["version"] == "2.18.3"
    assert rec["env"] == {"NCCL_VERSION": "2.30.7"}  # kept as the image says, not used


def test_ld_library_path_and_ld_so_conf_are_searched(tmp_path: Path, nccl_lib) -> None:
    lib = nccl_lib("2.21.5")
    img = _image(tmp_path / "ld.sqsh", {
        "/opt/nccl/lib/libnccl.so.2": lib, "/etc/ld.so.conf": "include /etc/ld.so.conf.d/*.conf\n",
        "/etc/ld.so.conf.d/x.conf": "/srv/n\n", "/srv/n/libnccl.so.2": b"\x7fELF short",
        "/etc/environment": "LD_LIBRARY_PATH=/opt/nccl/lib\n"}, compress_data=False)
    rec = scan_image(str(img))
    by_path = {r["path"]: r for r in rec["libnccl"]}
    assert by_path["/opt/nccl/lib/libnccl.so.2"]["default"] is True  # LD_LIBRARY_PATH first
    assert by_path["/srv/n/libnccl.so.2"]["version"] is None
    assert "no version read" in by_path["/srv/n/libnccl.so.2"]["version_error"]


def test_names_with_a_newline_cannot_forge_an_entry(tmp_path: Path) -> None:
    forged = ("x\n-rw-r--r-- 0/0                       9 2026-11-30 19:00 "
              "squashfs-root/etc/nccl.conf")
    img = _image(tmp_path / "nl.sqsh", {f"/etc/{forged}": b"bad", "/etc/rc": "ok\n"})
    im = SquashImage(str(img))
    assert im.odd_names >= 1  # the name and the directories under it: all skipped
    assert "/etc/nccl.conf" not in im.entries and "/etc/rc" in im.entries
    assert scan_image(str(img))["errors"][0]["field"] == "names"


def test_a_truncated_image_is_named(tmp_path: Path) -> None:
    img = _image(tmp_path / "t.sqsh", {"/etc/rc": os.urandom(300_000)})
    data = img.read_bytes()
    img.write_bytes(data[: len(data) // 3])
    with pytest.raises(ImageError) as e:
        scan_image(str(img))
    assert e.value.image == str(img) and "unsquashfs failed" in e.value.cause
    (tmp_path / "junk.sqsh").write_bytes(b"not a squashfs image" * 100)
    with pytest.raises(ImageError, match=r"junk\.sqsh: listing: unsquashfs failed"):
        scan_image(str(tmp_path / "junk.sqsh"))


def test_a_huge_file_is_not_read(tmp_path: Path) -> None:
    big = tmp_path / "big"
    with open(big, "wb") as f:  # sparse: mksquashfs packs its zeros in no time
        f.truncate(3 << 30)
    img = _image(tmp_path / "h.sqsh", {"/usr/lib/x86_64-linux-gnu/libnccl.so.2": big})
    t = time.monotonic()
    rec = scan_image(str(img))
    assert time.monotonic() - t < 5
    (lib,) = rec["libnccl"]
    assert lib["version"] is None and "more than 2147483648" in lib["version_error"]
    assert rec["errors"][0]["path"] == "/usr/lib/x86_64-linux-gnu/libnccl.so.2"


def test_a_deep_tree_is_bounded(tmp_path: Path) -> None:
    deep = "/" + "/".join(["d"] * 100) + "/f"
    img = _image(tmp_path / "d.sqsh", {deep: b"x"})
    with pytest.raises(ImageError, match="deeper than 64 levels"):
        SquashImage(str(img))
    assert SquashImage(str(img), max_depth=128).deepest == 101


def test_too_many_entries_and_time_are_bounded(tmp_path: Path) -> None:
    img = _image(tmp_path / "many.sqsh", {f"/f/{i}": b"" for i in range(3000)})
    with pytest.raises(ImageError, match="more than 1000 entries"):
        SquashImage(str(img), max_entries=1000)
    with pytest.raises(ImageError, match="time limit reached"):
        SquashImage(str(img), deadline=time.monotonic() - 1)


def test_environment_parsing() -> None:
    """A later line wins, as it does in the container: enroot v4.1.2 sets each line of
    /etc/environment in order with setenv(name, value, 1) (``bin/common.h``,
    ``load_environment``). Before, the first one was kept."""
    assert parse_environment(b'# c\nNCCL_A=1\nNCCL_A=2\nexport NCCL_B="x y"\nFOO=1\n'
                             b"LD_LIBRARY_PATH='/a:/b'\nbroken\n") == {
        "NCCL_A": "2", "NCCL_B": "x y", "LD_LIBRARY_PATH": "/a:/b"}


def test_reads_where_setrlimit_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where setrlimit is refused (a seccomp filter that also names prlimit64; the
    collector's unit does not: tests/test_install_systemd.py), the reader still works,
    bounded by its deadline and output limits."""
    import errno
    import resource

    def refuse(*_: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    img = _image(tmp_path / "r.sqsh", {"/etc/rc": "x\n"})
    monkeypatch.setattr(resource, "setrlimit", refuse)  # preexec_fn runs it in the child
    im = SquashImage(str(img))
    assert im.read_small("/etc/rc") == b"x\n"
