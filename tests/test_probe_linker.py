"""The linker's view of a node root: real ld.so.cache files from ldconfig, ld.so.conf, links."""

from __future__ import annotations

import errno
import os
import struct
import subprocess
from pathlib import Path

import pytest
from helpers.parts import build_shared_lib, run_ldconfig

from inventoryd.nodefs import ErrorLog, NodeFS
from inventoryd.probes import linker

MULTIARCH = "/usr/lib/x86_64-linux-gnu"


def _lib(root: Path, node_path: str, soname: str) -> Path:
    return build_shared_lib(root / node_path.lstrip("/"), soname)


def test_parses_a_cache_that_ldconfig_wrote(tmp_path: Path) -> None:
    _lib(tmp_path, "/opt/nccl/lib/libnccl.so.2.21.5", "libnccl.so.2")
    _lib(tmp_path, "/opt/other/libfoo.so.1.0", "libfoo.so.1")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/ld.so.conf").write_text("/opt/nccl/lib\n/opt/other\n")
    cache = run_ldconfig(tmp_path)
    entries = linker.parse_ld_so_cache(cache.read_bytes(), str(cache))
    by_name = {e.soname: e for e in entries}
    assert by_name["libnccl.so.2"].path == "/opt/nccl/lib/libnccl.so.2"
    assert by_name["libfoo.so.1"].path == "/opt/other/libfoo.so.1"
    assert by_name["libnccl.so.2"].flags == linker.arch_flags("x86_64")
    # ldconfig made the soname link; the view resolves it inside the root
    fs = NodeFS(tmp_path)
    view = linker.LinkerView.load(fs, ErrorLog())
    assert view.lookup("libnccl.so.2") == "/opt/nccl/lib/libnccl.so.2"
    assert linker.resolve(fs, "/opt/nccl/lib/libnccl.so.2") == "/opt/nccl/lib/libnccl.so.2.21.5"
    assert "/opt/nccl/lib" in view.dirs() and "/opt/other" in view.dirs()


def test_cache_from_ldconfig_C_and_f(tmp_path: Path) -> None:
    _lib(tmp_path, "/sw/a/libnccl.so.2", "libnccl.so.2")
    conf = tmp_path / "my.conf"
    conf.write_text(f"{tmp_path}/sw/a\n")
    out = tmp_path / "my.cache"
    subprocess.run(["ldconfig", "-X", "-C", str(out), "-f", str(conf)], check=True,
                   capture_output=True, timeout=120)
    entries = linker.parse_ld_so_cache(out.read_bytes(), str(out))
    assert [e.path for e in entries if e.soname == "libnccl.so.2"] == [
        f"{tmp_path}/sw/a/libnccl.so.2"]


def test_lookup_order_cache_then_standard_dirs(tmp_path: Path) -> None:
    _lib(tmp_path, "/opt/a/libx.so.1", "libx.so.1")
    _lib(tmp_path, f"{MULTIARCH}/libx.so.1", "libx.so.1")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/ld.so.conf").write_text("/opt/a\n")
    run_ldconfig(tmp_path)
    fs = NodeFS(tmp_path)
    # /opt/a comes first in the cache: ldconfig lists conf dirs before the trusted ones
    assert linker.LinkerView.load(fs, ErrorLog()).lookup("libx.so.1") == "/opt/a/libx.so.1"
    # a stale entry (file gone) falls through to the standard directories, as in glibc
    (tmp_path / "opt/a/libx.so.1").unlink()
    assert linker.LinkerView.load(fs, ErrorLog()).lookup("libx.so.1") == f"{MULTIARCH}/libx.so.1"
    # without any cache: the standard directories only; conf dirs are not searched
    (tmp_path / "etc/ld.so.cache").unlink()
    _lib(tmp_path, "/opt/a/liby.so.1", "liby.so.1")
    view = linker.LinkerView.load(fs, ErrorLog())
    assert view.cache is None
    assert view.lookup("liby.so.1") is None
    assert view.lookup("libx.so.1") == f"{MULTIARCH}/libx.so.1"
    # a name with a slash is a path
    assert view.lookup("/opt/a/liby.so.1") == "/opt/a/liby.so.1"
    assert view.lookup("/opt/a/nothere.so") is None


def test_conf_includes_like_ldconfig(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    (etc / "ld.so.conf.d").mkdir(parents=True)
    (etc / "ld.so.conf").write_text(
        "# comment\ninclude /etc/ld.so.conf.d/*.conf\n/opt/top  # trailing comment\n"
        "hwcap 0 nosegneg\n")
    (etc / "ld.so.conf.d/b.conf").write_text("/opt/b\ninclude sub/*.conf\n")
    (etc / "ld.so.conf.d/a.conf").write_text("/opt/a/\n")
    (etc / "ld.so.conf.d/sub").mkdir()
    (etc / "ld.so.conf.d/sub/c.conf").write_text("/opt/c\n")
    (etc / "ld.so.conf.d/ignored.txt").write_text("/opt/never\n")
    for d in ("opt/a", "opt/b", "opt/c", "opt/top"):
        (tmp_path / d).mkdir(parents=True)
    errors = ErrorLog()
    dirs = linker.conf_dirs(NodeFS(tmp_path), errors)
    assert dirs == ["/opt/a", "/opt/b", "/opt/c", "/opt/top"]
    assert errors.entries == []
    # the real ldconfig reads the same directories from the same files
    r = subprocess.run(["ldconfig", "-r", str(tmp_path), "-v", "-N", "-X"], capture_output=True,
                       text=True, timeout=120)
    seen = [line.split(":")[0] for line in r.stdout.splitlines()
            if not line.startswith("\t") and "(from /etc/" in line]
    assert seen == dirs


def test_include_loop_and_depth_are_bounded(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "ld.so.conf").write_text("include /etc/ld.so.conf\n/opt/x\n")
    errors = ErrorLog()
    assert linker.conf_dirs(NodeFS(tmp_path), errors) == ["/opt/x"]


def test_resolve_stays_inside_the_root(tmp_path: Path) -> None:
    (tmp_path / "usr/lib").mkdir(parents=True)
    (tmp_path / "usr/lib/real.so").write_bytes(b"x")
    (tmp_path / "lib").symlink_to("/usr/lib")  # absolute: means <root>/usr/lib
    (tmp_path / "usr/lib/up").symlink_to("../../../../../usr/lib/real.so")
    fs = NodeFS(tmp_path)
    assert linker.resolve(fs, "/lib/real.so") == "/usr/lib/real.so"
    assert linker.resolve(fs, "/usr/lib/up") == "/usr/lib/real.so"
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/passwd-link").symlink_to("/etc/shadow-not-in-root")
    with pytest.raises(FileNotFoundError):
        linker.resolve(fs, "/etc/passwd-link")  # never the host's /etc


def test_symlink_loop_is_eloop_not_a_hang(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to("/b")
    (tmp_path / "b").symlink_to("/a")
    with pytest.raises(OSError) as e:
        linker.resolve(NodeFS(tmp_path), "/a/libnccl.so.2")
    assert e.value.errno == errno.ELOOP


def test_glob_is_chroot_style_sorted_and_bounded(tmp_path: Path) -> None:
    for env in ("b", "a", "c"):
        (tmp_path / f"conda/envs/{env}/lib").mkdir(parents=True)
    (tmp_path / "conda/envs/.hidden/lib").mkdir(parents=True)
    (tmp_path / "shared").symlink_to("/conda")
    fs = NodeFS(tmp_path)
    errors = ErrorLog()
    got = linker.glob(fs, "/shared/envs/*/lib", errors)
    assert got == ["/shared/envs/a/lib", "/shared/envs/b/lib", "/shared/envs/c/lib"]
    assert linker.glob(fs, "/shared/envs/*/lib", errors, limit=2) == got[:2]
    assert "more than 2" in errors.entries[-1]["error"]
    assert linker.glob(fs, "/nowhere/*", ErrorLog()) == []
    rel = ErrorLog()
    assert linker.glob(fs, "relative/*", rel) == []
    assert "absolute" in rel.entries[0]["error"]


def _new_format(entries: list[tuple[str, str]], flags: int = 0x0303) -> bytes:
    """A new-format cache laid out per glibc's cache_file_new (for the combined format)."""
    strings = b""
    offs = []
    base = 48 + 24 * len(entries)
    for key, value in entries:
        k = base + len(strings)
        strings += key.encode() + b"\0"
        v = base + len(strings)
        strings += value.encode() + b"\0"
        offs.append((k, v))
    head = struct.pack("<20sIIB3xI12x", b"glibc-ld.so.cache1.1", len(entries), len(strings), 0, 0)
    body = b"".join(struct.pack("<iIIIQ", flags, k, v, 0, 0) for k, v in offs)
    return head + body + strings


def test_old_and_combined_formats(tmp_path: Path) -> None:
    new = _new_format([("libnccl.so.2", "/opt/n/libnccl.so.2")])
    assert [e.path for e in linker.parse_ld_so_cache(new)] == ["/opt/n/libnccl.so.2"]
    # glibc < 2.32 "compat": the old table, then the new one at the next 8-byte boundary
    old_strings = b"libnccl.so.2\0/old/libnccl.so.2\0"
    old = b"ld.so-1.7.0\0" + struct.pack("<I", 1) + struct.pack("<iII", 0x0303, 0, 13)
    pad = b"\0" * (-len(old) % 8)
    combined = old + pad + new
    assert [e.path for e in linker.parse_ld_so_cache(combined)] == ["/opt/n/libnccl.so.2"]
    # old format alone: offsets count from the end of the table
    entries = linker.parse_ld_so_cache(old + old_strings)
    assert [(e.soname, e.path) for e in entries] == [("libnccl.so.2", "/old/libnccl.so.2")]


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda b: b[:30], "truncated header"),
        (lambda b: b[:60], "longer than the file"),
        (lambda b: b"\x00" * 64, "unknown magic"),
        (lambda b: b[:48 + 24] + b"", "outside the file"),
    ],
)
def test_corrupt_cache_is_a_clear_error(tmp_path: Path, mangle, message: str) -> None:
    _lib(tmp_path, "/opt/n/libnccl.so.2", "libnccl.so.2")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/ld.so.conf").write_text("/opt/n\n")
    cache = run_ldconfig(tmp_path)
    data = mangle(cache.read_bytes())
    with pytest.raises(linker.LinkerError, match=message) as e:
        linker.parse_ld_so_cache(data, "/etc/ld.so.cache")
    assert "/etc/ld.so.cache" in str(e.value)
    # through the view: recorded, and the standard directories still work
    cache.write_bytes(data)
    _lib(tmp_path, f"{MULTIARCH}/libnccl.so.2", "libnccl.so.2")
    errors = ErrorLog()
    view = linker.LinkerView.load(NodeFS(tmp_path), errors, "nccl")
    assert view.cache is None
    assert errors.entries[0]["path"] == "/etc/ld.so.cache" and message in errors.entries[0]["error"]
    assert view.lookup("libnccl.so.2") == f"{MULTIARCH}/libnccl.so.2"


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    os.mkfifo(tmp_path / "etc/ld.so.cache")
    errors = ErrorLog()
    view = linker.LinkerView.load(NodeFS(tmp_path), errors)
    assert view.cache is None
    assert "not a regular file" in errors.entries[0]["error"]
