"""Build real squashfs images for tests, the demo and the benches (``mksquashfs``).

``build_image(out, files={node path: source Path | bytes}, links={path: target})``
lays out a tree and packs it with the chosen compressor; ``nccl_image`` one laid out like
a CUDA container, ``link_maze`` a hostile one that keeps the image reader busy. Raises
:class:`devtools.ncclwheels.PartUnavailable` when squashfs-tools is not installed.

Data blocks are stored as ``mksquashfs -noD`` writes them (uncompressed, flagged so in
each block's size word, as mksquashfs also stores any block that does not shrink) unless
``compress_data``: compressing a real 176 to 473 MB ``libnccl.so.2`` took 7 s a build on
average, most of the image tests' time (2026-12-07: 327 s of 371 s for the index and
reader tests, 29 builds). The inode, directory and fragment tables stay compressed with
``comp``. The tests whose subject is decompression (the compressor matrix,
``tests/test_image_reader.py``) and the benches compress.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from devtools.ncclwheels import PartUnavailable

COMPRESSORS = ("gzip", "lzo", "lz4", "xz", "zstd")  # all of Debian 12's mksquashfs 4.5.1


def mksquashfs() -> str:
    exe = shutil.which("mksquashfs")
    if exe is None or shutil.which("unsquashfs") is None:
        raise PartUnavailable("squashfs-tools is not installed (apt-get install squashfs-tools)")
    return exe


def lay_out(root: Path, files: Mapping[str, Path | bytes | str],
            links: Mapping[str, str] | None = None) -> None:
    for node_path, src in files.items():
        dest = root / node_path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(src, Path):
            try:
                os.link(src, dest)
            except OSError:
                shutil.copyfile(src, dest)
        else:
            dest.write_bytes(src.encode() if isinstance(src, str) else src)
    for node_path, target in (links or {}).items():
        dest = root / node_path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.symlink_to(target)


def pack(root: Path, out: Path, comp: str = "gzip", extra: tuple[str, ...] = ()) -> Path:
    cmd = [mksquashfs(), str(root), str(out), "-comp", comp, "-noappend", "-quiet",
           "-no-progress", "-all-root", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"mksquashfs failed: {r.stderr.strip() or r.stdout.strip()}")
    return out


def build_image(out: Path, files: Mapping[str, Path | bytes | str],
                links: Mapping[str, str] | None = None, comp: str = "gzip",
                extra: tuple[str, ...] = (), compress_data: bool = False) -> Path:
    """A squashfs image at ``out`` holding ``files`` and ``links`` (absolute image paths);
    data blocks compressed only with ``compress_data`` (module doc)."""
    mksquashfs()
    flags = extra if compress_data else ("-noD", *extra)
    with tempfile.TemporaryDirectory(prefix="ncclguard-imgtree-") as tmp:
        lay_out(Path(tmp), files, links)
        return pack(Path(tmp), Path(out), comp, flags)


def nccl_image(out: Path, libnccl: Path, *, where: str = "/usr/lib/x86_64-linux-gnu",
               version: str = "2.21.5", plugins: Mapping[str, Path] | None = None,
               env: str = "", nccl_conf: str | None = None, comp: str = "gzip",
               compress_data: bool = False) -> Path:
    """An image laid out like a CUDA container: ``libnccl.so.X.Y.Z`` with its soname
    and dev links in ``where`` (or, for a path ending in ``nvidia/nccl/lib``, pip's single
    ``libnccl.so.2``), plugins (image path -> .so), ``/etc/environment``, ``/etc/rc``."""
    files: dict[str, Path | bytes | str] = {}
    links: dict[str, str] = {}
    if where.endswith("nvidia/nccl/lib"):
        files[f"{where}/libnccl.so.2"] = libnccl
    else:
        files[f"{where}/libnccl.so.{version}"] = libnccl
        links[f"{where}/libnccl.so.2"] = f"libnccl.so.{version}"
        links[f"{where}/libnccl.so"] = "libnccl.so.2"
    for p, src in (plugins or {}).items():
        files[p] = src
    files["/etc/environment"] = env
    files["/etc/rc"] = "mkdir -p /workspace\ncd /workspace\nexec \"$@\"\n"
    if nccl_conf is not None:
        files["/etc/nccl.conf"] = nccl_conf
    return build_image(out, files, links, comp, compress_data=compress_data)



def link_maze(out: Path, dirs: int = 1000, hops: int = 39) -> Path:
    """A hostile image that keeps the image reader busy (a few KiB): ``/etc/ld.so.conf``
    names ``dirs`` search directories ``/m0``, ``/m1``..., each a symlink into one chain of
    ``hops`` links, and each link's target is 4 KiB of ``a/../`` before the next link:
    every directory resolves to ``/a`` after ``hops + 1`` links (within the kernel's 40)
    and about 30,000 path components. Within every bound of the reader (the search
    directories are capped at 1,024, the links at 40 per path), it costs 8 s of resolving
    on a quiet 2-core machine and 25 s on a loaded one (squashfs-tools 4.5.1, Python
    3.11, 2026-12-07; CI read it whole once within an 8 s limit): an image that
    runs into its time limit, used where the collector must be seen busy reading
    (tests/test_install_systemd.py, tests/test_collector_watchdog.py)."""
    pad = "a/../" * 796  # 3,980 characters: a target stays under MAX_PATH (4,096)
    links = {f"/l{k}": "/" + pad + (f"l{k + 1}" if k + 1 < hops else "a") for k in range(hops)}
    links.update({f"/m{i}": "/l0" for i in range(dirs)})
    files: dict[str, Path | bytes | str] = {
        "/a/empty": b"", "/etc/ld.so.conf": "".join(f"/m{i}\n" for i in range(dirs))}
    return build_image(out, files, links)

#: A SPANK plugin named ``pyxis`` that registers pyxis's job options and does nothing
#: else: slurmctld then hands PrologSlurmctld the same ``SPANK__SLURM_SPANK_OPTION_pyxis_*``
#: variables as the real pyxis (verified with Slurm 22.05.8; tests/test_container_gate.py).
PYXIS_STUB_C = """\
#include <stddef.h>
#include <slurm/spank.h>
SPANK_PLUGIN(pyxis, 1);
static int noop(int val, const char *optarg, int remote) { return 0; }
static struct spank_option options[] = {
    {"container-image", "[USER@][REGISTRY#]IMAGE[:TAG]|PATH", "stub of pyxis", 1, 0, noop},
    {"container-mounts", "SRC:DST[:FLAGS][,SRC:DST...]", "stub of pyxis", 1, 0, noop},
    {"container-name", "NAME", "stub of pyxis", 1, 0, noop},
    SPANK_OPTIONS_TABLE_END
};
int slurm_spank_init(spank_t sp, int ac, char **av) {
    for (int i = 0; options[i].name != NULL; i++)
        if (spank_option_register(sp, &options[i]) != ESPANK_SUCCESS)
            return -1;
    return 0;
}
"""


def build_pyxis_stub(out_dir: Path) -> Path:
    """Compile :data:`PYXIS_STUB_C` against the installed ``<slurm/spank.h>`` (libslurm-dev);
    raises PartUnavailable without gcc or the header."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise PartUnavailable("gcc is not installed (apt-get install gcc)")
    if not Path("/usr/include/slurm/spank.h").exists():
        raise PartUnavailable("slurm/spank.h is missing (apt-get install libslurm-dev)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / "spank_pyxis_stub.c"
    src.write_text(PYXIS_STUB_C)
    out = out_dir / "spank_pyxis_stub.so"
    r = subprocess.run([gcc, "-shared", "-fPIC", "-Wall", "-Werror", "-o", str(out), str(src)],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"gcc failed: {r.stderr.strip()}")
    return out
