"""What this node injects into containers (fingerprint ``containers``, docs/containers.md).

A job's container brings its own libnccl; the net plugin may come from the node. Sites
put aws-ofi-nccl, HPC-X or GIB plugins in with enroot's system configuration (pyxis runs
enroot), ``--container-mounts``, or Apptainer's bind paths. Read here, never run:

- enroot (``/etc/enroot``, ``ENROOT_SYSCONF_PATH``'s default): ``mounts.d/*.fstab``
  (``source target type options``, fstab(5) with enroot's extensions), ``environ.d/*.env``
  (``NAME=value``; only ``NCCL_*`` and ``LD_LIBRARY_PATH`` kept), ``hooks.d/*.sh`` (their
  names and hashes, and every absolute ``libnccl-*.so`` path their text names);
- pyxis: the ``spank_pyxis.so`` lines of ``/etc/slurm/plugstack.conf`` and
  ``plugstack.conf.d/*.conf``, with their arguments;
- Apptainer/Singularity: ``bind path`` lines of ``apptainer.conf``/``singularity.conf``.

Every NCCL plugin file such a mount, bind or hook brings in (a file, or a directory's
``libnccl-*.so*`` files up to three levels down) is analysed like the node's own
(:func:`inventoryd.probes.plugins.describe`). ``net_plugin`` is the one a container loads:
the file named by an injected ``NCCL_NET_PLUGIN``, else one whose target is
``libnccl-net.so``; None when the node injects none (the image's own is used then).
Stock enroot hooks inject no NCCL, nor does Apptainer's ``nvliblist.conf`` (issue 15).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from inventoryd.filecache import FileCache
from inventoryd.nodefs import ErrorLog, NodeFS
from inventoryd.probes import plugins as plugin_probe

PROBE = "containers"
ENROOT = "/etc/enroot"
PLUGSTACK = "/etc/slurm/plugstack.conf"
APPTAINER_CONFS = ("/etc/apptainer/apptainer.conf", "/etc/singularity/singularity.conf")
MAX_FILES = 64  # per directory
MAX_PLUGINS = 32
MAX_READ = 64 * 1024
MAX_WALK_DEPTH = 3  # a mounted directory is searched this deep (HPC-X: <dir>/<plugin>/lib)
MAX_WALK = 4096  # entries looked at per mounted directory
_PLUGIN_PATH = re.compile(r"(/[A-Za-z0-9_./+-]*/libnccl-[a-z]+[A-Za-z0-9_.+-]*\.so[0-9.]*)")


def empty() -> dict[str, Any]:
    return {"enroot": {"mounts": [], "environ": {}, "hooks": []}, "pyxis": [],
            "apptainer_binds": [], "plugins": [], "net_plugin": None}


def _files(fs: NodeFS, errors: ErrorLog, d: str, suffix: str) -> list[str]:
    names = fs.list_dir(d, errors, PROBE, f"containers:{d}") or []
    return [f"{d}/{n}" for n in names if n.endswith(suffix)][:MAX_FILES]


def _text(fs: NodeFS, errors: ErrorLog, path: str) -> str | None:
    got = fs.read_bytes(path, MAX_READ, errors, PROBE, "containers")
    return None if got is None else got[0].decode("utf-8", "replace")


def parse_fstab(text: str) -> list[dict[str, str]]:
    """enroot's fstab lines: ``source target [type [options]]`` (``#`` comments)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) < 2:
            continue
        out.append({"source": parts[0], "target": parts[1],
                    "type": parts[2] if len(parts) > 2 else "none",
                    "options": parts[3] if len(parts) > 3 else ""})
    return out


def parse_env(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        name, eq, value = line.strip().partition("=")
        if eq and (name.startswith("NCCL_") or name == "LD_LIBRARY_PATH"):
            out.setdefault(name, value.strip().strip("\"'"))
    return out


def _plugin_files(fs: NodeFS, source: str) -> list[tuple[str, str]]:
    """(node path, name) of the NCCL plugin files a mount source brings in."""
    name = source.rsplit("/", 1)[-1]
    if plugin_probe._kind_of(source) is not None:
        return [(source, name)]
    out: list[tuple[str, str]] = []
    if not fs.is_dir(source):
        return out
    todo = [(source.rstrip("/") or "/", 0)]
    seen = 0
    while todo:  # breadth first, MAX_WALK_DEPTH levels, MAX_WALK entries in all
        d, depth = todo.pop(0)
        for n in fs.list_dir(d) or []:
            seen += 1
            if seen > MAX_WALK:
                return out
            p = f"{d}/{n}"
            if n.startswith("libnccl-") and ".so" in n:
                out.append((p, n))
            elif depth < MAX_WALK_DEPTH and fs.is_dir(p) and not fs.host(p).is_symlink():
                todo.append((p, depth + 1))
    return out


def probe(fs: NodeFS, errors: ErrorLog, cache: FileCache) -> dict[str, Any]:
    out = empty()
    mounts: list[dict[str, str]] = []
    for f in _files(fs, errors, f"{ENROOT}/mounts.d", ".fstab"):
        text = _text(fs, errors, f)
        for m in parse_fstab(text or ""):
            mounts.append({"file": f, **m})
    environ: dict[str, str] = {}
    for f in _files(fs, errors, f"{ENROOT}/environ.d", ".env"):
        for k, v in parse_env(_text(fs, errors, f) or "").items():
            environ.setdefault(k, v)
    hooks = []
    hook_paths: list[str] = []
    for f in _files(fs, errors, f"{ENROOT}/hooks.d", ".sh"):
        got = fs.read_bytes(f, MAX_READ, errors, PROBE, "containers.hooks")
        data = got[0] if got else b""
        hooks.append({"path": f, "sha256": hashlib.sha256(data).hexdigest() if got else None})
        hook_paths += _PLUGIN_PATH.findall(data.decode("utf-8", "replace"))
    out["enroot"] = {"mounts": mounts, "environ": environ, "hooks": hooks}

    pyxis = []
    for f in [PLUGSTACK, *_files(fs, errors, PLUGSTACK + ".d", ".conf")]:
        for line in (_text(fs, errors, f) or "").splitlines():
            words = line.split("#", 1)[0].split()
            if len(words) >= 2 and "spank_pyxis" in words[1]:
                pyxis.append({"file": f, "plugin": words[1], "args": words[2:]})
    out["pyxis"] = pyxis

    binds: list[str] = []
    for f in APPTAINER_CONFS:
        for line in (_text(fs, errors, f) or "").splitlines():
            key, eq, value = line.partition("=")
            if eq and key.strip().lower() == "bind path":
                binds.append(value.strip())
    out["apptainer_binds"] = binds

    # the plugin files brought in, with where the container sees them
    found: list[tuple[str, str, str]] = []  # (node path, target, via)
    for m in mounts:
        for path, name in _plugin_files(fs, m["source"]):
            target = m["target"]
            if path != m["source"]:
                target = f"{target.rstrip('/')}{path[len(m['source'].rstrip('/')):]}"
            elif plugin_probe._kind_of(target) is None:
                target = f"{target.rstrip('/')}/{name}"
            found.append((path, target, f"enroot:{m['file']}"))
    for b in binds:
        src, _, dst = b.partition(":")
        for path, _name in _plugin_files(fs, src):
            found.append((path, (dst or src) + path[len(src):], "apptainer"))
    for p in hook_paths:
        if plugin_probe._kind_of(p) is not None and fs.exists(p):
            found.append((p, p, "enroot-hook"))
    plugins = []
    for path, target, via in found[:MAX_PLUGINS]:
        kind = plugin_probe._kind_of(path) or "net"
        rec = plugin_probe.describe(fs, errors, kind, path, via, cache)
        plugins.append({"target": target, "via": via, "kind": kind, "path": path,
                        "name": rec.get("name"), "abis": rec.get("abis"),
                        "sha256": rec.get("sha256"), "error": rec.get("error")})
    plugins.sort(key=lambda r: (r["target"], r["path"]))
    out["plugins"] = plugins
    out["net_plugin"] = _net(plugins, environ)
    return out


def _net(plugins: list[dict[str, Any]], environ: dict[str, str]) -> dict[str, Any] | None:
    nets = [p for p in plugins if p["kind"] == "net" and (p.get("abis") or {}).get("net")]
    wanted = environ.get("NCCL_NET_PLUGIN")
    for p in nets:
        base = p["target"].rsplit("/", 1)[-1]
        if wanted and (p["target"] == wanted or base in (wanted, f"libnccl-net-{wanted}.so")):
            return _summary(p)
    if not wanted:
        for p in nets:
            if p["target"].rsplit("/", 1)[-1] == "libnccl-net.so":
                return _summary(p)
    return None


def _summary(p: dict[str, Any]) -> dict[str, Any]:
    return {"name": p["name"], "abis": (p.get("abis") or {}).get("net") or [],
            "path": p["path"], "target": p["target"]}
