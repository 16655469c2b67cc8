"""enroot as sites install it, for the containers probe's tests: its shipped mounts.d and
environ.d files (``tests/data/enroot``, with their provenance), and a user's plugin
planted where any user can write (issue 47)."""

from __future__ import annotations

import os
from pathlib import Path

STOCK = Path(__file__).resolve().parent.parent / "data" / "enroot"
USER = 1000  # a user's uid: the owner of what a job or a shell on the node writes


def stock_files(release: str = "v4.1.2") -> dict[str, Path | bytes]:
    """enroot's shipped mounts.d and environ.d files of ``release``, where a node has
    them (``build_node``'s ``extra_files``)."""
    out: dict[str, Path | bytes] = {}
    for f in sorted((STOCK / release).iterdir()):
        where = "environ.d" if f.suffix == ".env" else "mounts.d"
        out[f"/etc/enroot/{where}/{f.name}"] = f
    return out


def plant(root: Path, node_dir: str, plugin: Path, mode: int = 0o1777, uid: int = USER,
          name: str = "libnccl-net.so") -> Path:
    """A user's copy of ``plugin`` in ``node_dir`` of the node tree ``root`` (made with
    ``mode``: ``/dev/shm`` is 1777), owned by ``uid``."""
    d = root / node_dir.lstrip("/")
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, mode)
    f = d / name
    f.write_bytes(plugin.read_bytes())
    os.chown(f, uid, uid)
    return f
