"""The NCCL stack inside one squashfs image (an ``image record``), read, never run.

What (docs/containers.md):

- every ``libnccl.so*`` on the image's linker paths (``LD_LIBRARY_PATH`` from the image's
  ``/etc/environment``, the directories of ``/etc/ld.so.conf`` and ``ld.so.conf.d/*.conf``,
  the standard ones) and in pip's ``site-packages/nvidia/nccl/lib`` (also
  ``dist-packages``), each analysed like a node's (:func:`inventoryd.probes.nccl.analyze`:
  the banner and the plugin ABIs read from the file, never an ``NCCL_VERSION`` label);
- the NCCL plugins in the same directories (:func:`inventoryd.probes.plugins.analyze`);
- ``/etc/nccl.conf`` (parsed as NCCL parses it), the ``NCCL_*`` and ``LD_LIBRARY_PATH``
  settings of ``/etc/environment`` (enroot's image format: the container's environment),
  and the head of ``/etc/rc`` (enroot's entrypoint script: where the image came from).

Which libnccl the job loads (``default``): pip's copy where a framework in the same
``site-packages`` loads it (PyTorch by its RUNPATH, JAX's CUDA plugin, CuPy), else what
the linker finds for ``libnccl.so.2`` first, else any pip copy.
Which net plugin: ``NCCL_NET_PLUGIN`` from the environment, then ``/etc/nccl.conf``,
expanded with the default libnccl's rules, else ``libnccl-net.so``, searched in the same
directories.

Every file is streamed out of the image into an unlinked temporary file and read there;
the whole image shares one deadline (:mod:`inventoryd.controller.images.squashfs`),
checked in every loop here too. The search directories are normalized, resolved inside
the image and each real directory searched once (at most :data:`MAX_SEARCH_DIRS` named),
and the lists of libraries and plugins stop at their caps while they are built (issue 48;
docs/containers.md, "The image reader's bounds").
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from inventoryd.controller.images.squashfs import SquashImage
from inventoryd.controller.images.tree import (
    CHECK_EVERY,
    ImageError,
    ImagePathError,
    ImageStopped,
    ImageTree,
)
from inventoryd.probes import nccl as nccl_probe
from inventoryd.probes import ncclconf
from inventoryd.probes import plugins as plugin_probe
from inventoryd.probes.linker import standard_dirs
from ncclguard.fingerprint.abi import ABI_KINDS

SCHEMA = 1
MAX_SMALL = 64 * 1024  # /etc/environment, /etc/rc, ld.so.conf files
MAX_RC = 4096  # bytes of /etc/rc kept
MAX_LIBRARIES = 64
MAX_PLUGINS = 64
MAX_CONF_FILES = 64
#: directories named by LD_LIBRARY_PATH and ld.so.conf together (each spelling once),
#: searched at most: the linker's own paths are searched after them in any case
MAX_SEARCH_DIRS = 1024
MAX_PIP_DIRS = 16  # site-packages/nvidia/nccl/lib directories searched at most
PIP_SUFFIXES = ("/site-packages/nvidia/nccl/lib", "/dist-packages/nvidia/nccl/lib")
#: packages that load pip's libnccl from their own site-packages (:func:`_default_lib`)
FRAMEWORKS = ("torch", "jax_plugins", "cupy")
ENV_FILE = "/etc/environment"
RC_FILE = "/etc/rc"
PLUGIN_PREFIX = "libnccl-"


def parse_environment(data: bytes) -> dict[str, str]:
    """``NAME=value`` lines of enroot's ``/etc/environment`` (pam_env's plain form; an
    ``export`` prefix and one pair of surrounding quotes are removed). Only ``NCCL_*`` and
    ``LD_LIBRARY_PATH`` are kept; a later line wins, as in the container (enroot v4.1.2
    ``bin/common.h``, ``load_environment``: ``setenv(name, value, 1)`` line by line)."""
    out: dict[str, str] = {}
    for raw in data.decode("utf-8", "replace").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").lstrip()
        name, eq, value = line.partition("=")
        if not eq or not (name.startswith("NCCL_") or name == "LD_LIBRARY_PATH"):
            continue
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        out[name] = value[:4096]
    return out


def _conf_dirs(image: ImageTree, errors: list[dict[str, Any]], room: int) -> list[str]:
    """Directories of the image's ``/etc/ld.so.conf`` (one ``include`` level of globs
    in ``/etc/ld.so.conf.d``, as Debian and RHEL ship it), each spelling once (a dict:
    a list's membership test made 64 files of 64 KiB a 63 s pass), at most ``room``."""
    files = ["/etc/ld.so.conf"]
    for k, n in enumerate(image.children("/etc/ld.so.conf.d")):
        if k % CHECK_EVERY == 0:
            image.check()
        if len(files) > MAX_CONF_FILES:
            break
        if n.endswith(".conf"):
            files.append(f"/etc/ld.so.conf.d/{n}")
    dirs: dict[str, None] = {}
    for f in files:
        image.check()
        if image.entry(f) is None:
            continue
        try:
            data = image.read_small(f, MAX_SMALL)
        except ImageError as e:
            errors.append(_error("linker", f, e.cause))
            continue
        for k, line in enumerate(data.decode("utf-8", "replace").splitlines()):
            if k % CHECK_EVERY == 0:
                image.check()
            line = line.split("#", 1)[0].strip()
            if line.startswith("/"):
                d = _normal(line)
                if d not in dirs and len(dirs) >= room:
                    errors.append(_error("linker", f, f"more than {MAX_SEARCH_DIRS} search "
                                         "directories named (LD_LIBRARY_PATH, ld.so.conf); "
                                         "the rest are not searched"))
                    return list(dirs)
                dirs[d] = None
    return list(dirs)


def _normal(d: str) -> str:
    """A directory's spelling without ``.``, repeated or trailing slashes (``..`` is
    left to :meth:`ImageTree.resolve`: it depends on symlinks)."""
    return "/" + "/".join(p for p in d.split("/") if p and p != ".")


def _search(image: ImageTree, named: list[str]) -> list[tuple[str, str]]:
    """``(spelling, real directory)`` of each directory of the image that ``named``
    names, in order, each real directory once (40,000 spellings of one directory of
    100,000 files listed it 40,000 times: 10 min 42 s)."""
    out: dict[str, str] = {}  # real directory -> the first spelling that named it
    for d in named:
        image.check()
        try:
            real = image.resolve(d)
        except ImagePathError:
            continue
        e = image.entries.get(real)
        if e is not None and e.kind == "d":
            out.setdefault(real, d)
    return [(d, real) for real, d in out.items()]


def _error(field: str, path: str | None, cause: str) -> dict[str, Any]:
    return {"probe": "image", "field": field, "path": path, "error": cause}


def read_tree(image: ImageTree, *, tmpdir: str | None = None,
              config_env: dict[str, str] | None = None) -> dict[str, Any]:
    """The NCCL stack in an image's file tree (the module docstring): ``libnccl``,
    ``plugins``, ``net_plugin``, ``nccl_conf``, ``env``, ``rc``, ``errors``.
    ``config_env``: a registry image's config ``Env`` (``NCCL_*``, ``LD_LIBRARY_PATH``),
    which takes the place of its ``/etc/environment`` (docs/containers.md, "Registry
    images")."""
    errors: list[dict[str, Any]] = []
    if image.odd_names:
        errors.append(_error("names", None, f"{image.odd_names} entries with control "
                              "characters or overlong names were skipped"))
    env: dict[str, str] = {}
    if config_env is not None:
        # enroot writes the config's Env as the container's /etc/environment, in a layer
        # of its own above the image's (v4.1.2 src/docker.sh, docker::configure)
        env = dict(config_env)
    elif image.entry(ENV_FILE) is not None:
        try:
            env = parse_environment(image.read_small(ENV_FILE, MAX_SMALL))
        except ImageError as e:
            errors.append(_error("env", ENV_FILE, e.cause))
    rc = None
    if image.entry(RC_FILE) is not None:
        try:
            rc = image.read_small(RC_FILE, MAX_SMALL)[:MAX_RC].decode("utf-8", "replace")
        except ImageError as e:
            errors.append(_error("rc", RC_FILE, e.cause))
    conf = _nccl_conf(image, errors)

    ld_path: dict[str, None] = {}
    for d in env.get("LD_LIBRARY_PATH", "").split(":"):
        if d.startswith("/"):
            ld_path[_normal(d)] = None
    named = list(ld_path)[:MAX_SEARCH_DIRS]
    if len(ld_path) > MAX_SEARCH_DIRS:
        errors.append(_error("linker", ENV_FILE, f"more than {MAX_SEARCH_DIRS} search "
                             "directories named (LD_LIBRARY_PATH, ld.so.conf); the rest "
                             "are not searched"))
    named += _conf_dirs(image, errors, MAX_SEARCH_DIRS - len(named))
    pip_named: list[str] = []
    for k, d in enumerate(image.directories()):
        if k % CHECK_EVERY == 0:
            image.check()
        if d.endswith(PIP_SUFFIXES):
            pip_named.append(d)
    pip_named.sort()
    if len(pip_named) > MAX_PIP_DIRS:
        errors.append(_error("linker", None, f"more than {MAX_PIP_DIRS} pip NCCL "
                             "directories (site-packages/nvidia/nccl/lib); the rest are "
                             "not searched"))
        del pip_named[MAX_PIP_DIRS:]
    pip_search = _search(image, pip_named)
    pip_dirs = [d for d, _ in pip_search]
    loaded = {d for d in pip_dirs if _loaded_by_a_framework(image, d)}
    pip_real = {real for _, real in pip_search}
    search_dirs = [*pip_search, *(
        (d, real) for d, real in _search(image, [*named, *standard_dirs()])
        if real not in pip_real)]
    search = [d for d, _ in search_dirs]

    libs: list[dict[str, Any]] = []
    nets: list[tuple[str, str]] = []  # (path, kind): read first
    others: list[tuple[str, str]] = []
    dropped = {"libnccl": 0, "plugins": 0}
    for d, real in search_dirs:
        for k, name in enumerate(image.children(real)):
            if k % CHECK_EVERY == 0:
                image.check()
            p = f"{d.rstrip('/')}/{name}"
            if name == "libnccl.so" or name.startswith("libnccl.so."):
                if len(libs) < MAX_LIBRARIES:
                    libs.append({"path": p, "origin": "pip" if d in pip_dirs else "linker"})
                else:
                    dropped["libnccl"] += 1
            elif name.startswith(PLUGIN_PREFIX) and ".so" in name:
                kind = plugin_probe._kind_of(p)
                if kind is None:
                    continue
                # stopped at the cap while listed: 400,000 files named 328 ways made a
                # list of 6.2 GB before it was cut
                keep = nets if kind == "net" else others
                if len(keep) < MAX_PLUGINS:
                    keep.append((p, kind))
                else:
                    dropped["plugins"] += 1
    plugin_files = [*nets, *others][:MAX_PLUGINS]
    dropped["plugins"] += len(nets) + len(others) - len(plugin_files)
    for field, n in dropped.items():
        if n:
            cap = MAX_LIBRARIES if field == "libnccl" else MAX_PLUGINS
            what = "plugin" if field == "plugins" else field
            errors.append(_error(field, None, f"more than {cap} {what} files on the search "
                                 f"path: {n} more not read"))
    with tempfile.TemporaryDirectory(dir=tmpdir, prefix="ncclguard-image-") as tmp:
        # read in the order the gate needs them; listed in the search order
        read: dict[int, dict[str, Any] | None] = {}
        for i in sorted(range(len(libs)), key=lambda i: _default_rank(libs[i], loaded)):
            read[i] = _library(image, libs[i], tmp, errors)
        out_libs = [r for i in range(len(libs)) if (r := read[i]) is not None]
        default = _default_lib(out_libs, loaded)
        for rec in out_libs:
            rec["default"] = rec["path"] == default
        plugins = []
        for p, kind in plugin_files:
            prec = _plugin(image, kind, p, tmp, errors)
            if prec is not None:
                plugins.append(prec)
        default_lib = next((r for r in out_libs if r["default"]), None)
        net = _net_plugin(image, env, conf, default_lib, plugins, search)
        for prec in plugins:
            prec["default"] = prec["path"] == net
    return {
        "libnccl": sorted(out_libs, key=lambda r: r["path"]),
        "plugins": sorted(plugins, key=lambda r: (r["kind"], r["path"])),
        "net_plugin": net,
        "nccl_conf": conf,
        "env": env,
        "rc": rc,
        "errors": errors,
    }


def scan_image(
    path: str, *, unsquashfs: str = "", timeout_s: float = 30.0, tmpdir: str | None = None,
    max_file_bytes: int | None = None, max_read_bytes: int | None = None,
    stop: Callable[[], bool] | None = None, fd: int | None = None,
) -> dict[str, Any]:
    """The image record of the squashfs file at ``path``. Raises ImageError when the image
    as a whole cannot be read (the cause names it); one unreadable file inside costs its
    own entry and an ``errors`` item.

    What the gate uses is read first: the libnccl a job loads (:func:`_default_lib`'s
    candidates, in its order), then the net plugins; the other libraries and plugins
    only while the image's read budget lasts (``max_read_bytes``, and at most
    ``MAX_EXPANSION`` times the image's own size: a sparse member is never read whole);
    those past it are listed with the reason. ``fd``: the image opened by the caller
    (:func:`.squashfs.open_image`): what is read, and the identity recorded, are that
    file's."""
    st = os.stat(path) if fd is None else os.fstat(fd)
    t0 = time.monotonic()
    kw: dict[str, Any] = {}
    if max_file_bytes is not None:
        kw["max_file_bytes"] = max_file_bytes
    if max_read_bytes is not None:
        kw["max_read_bytes"] = max_read_bytes
    image = SquashImage(path, deadline=t0 + timeout_s, unsquashfs=unsquashfs, stop=stop,
                        fd=fd, **kw)
    facts = read_tree(image, tmpdir=tmpdir)
    st2 = os.stat(path) if fd is None else os.fstat(fd)
    if (st.st_ino, st.st_size, st.st_mtime_ns) != (st2.st_ino, st2.st_size, st2.st_mtime_ns):
        raise ImageError(path, "changed while it was read; read again at the next scan")
    return {
        "schema": SCHEMA,
        "image": {"path": path, "inode": st.st_ino, "size": st.st_size,
                  "mtime_ns": st.st_mtime_ns, "entries": image.listed},
        **facts,
        "scan_seconds": round(time.monotonic() - t0, 3),
    }


def _nccl_conf(image: ImageTree, errors: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"present": False, "sha256": None, "raw": None,
                           "settings": {}, "comment_settings": {}}
    if image.entry(ncclconf.PATH) is None:
        return out
    out["present"] = True
    try:
        data = image.read_small(ncclconf.PATH, ncclconf.MAX_PARSE)
    except ImageError as e:
        errors.append(_error("nccl_conf", ncclconf.PATH, e.cause))
        out["settings"] = out["comment_settings"] = None
        return out
    out["sha256"] = hashlib.sha256(data).hexdigest()
    out["raw"] = data[: ncclconf.MAX_RAW].decode("utf-8", "replace")
    out["settings"], out["comment_settings"] = ncclconf.parse(data)
    return out


def _library(image: ImageTree, rec: dict[str, Any], tmp: str,
             errors: list[dict[str, Any]]) -> dict[str, Any] | None:
    p = rec["path"]
    try:
        real, facts = image.analyze(p, nccl_probe.analyze, tmp)
    except ImageError as e:
        if "no such file" in e.cause:
            return None  # a dangling link: not loadable
        if isinstance(e, ImageStopped):
            raise
        errors.append(_error("libnccl", p, e.cause))
        if "time limit" in e.cause:
            raise
        return {"path": p, "realpath": None, "size": None, "sha256": None, "version": None,
                "version_code": None, "cuda_version": None, "version_source": None,
                "version_error": e.cause, "git_version": None,
                "abis": {k: [] for k in ABI_KINDS}, "origin": rec["origin"]}
    return {"path": p, "realpath": real, **facts, "origin": rec["origin"]}


def _plugin(image: ImageTree, kind: str, p: str, tmp: str,
            errors: list[dict[str, Any]]) -> dict[str, Any] | None:
    try:
        real, facts = image.analyze(p, plugin_probe.analyze, tmp)
    except ImageError as e:
        if "no such file" in e.cause:
            return None
        if isinstance(e, ImageStopped):
            raise
        errors.append(_error(f"plugins.{kind}", p, e.cause))
        if "time limit" in e.cause:
            raise
        return None
    rec = {"kind": kind, "path": p, "realpath": real, **facts}
    rec["name"] = rec["names"].get(kind)
    if rec["error"]:
        errors.append(_error(f"plugins.{kind}", p, rec["error"]))
    return rec


def _loaded_by_a_framework(image: ImageTree, pip_dir: str) -> bool:
    """Whether a framework that loads pip's libnccl is installed beside it, in the same
    ``site-packages``: PyTorch (its libraries' RUNPATH ``$ORIGIN/../../nvidia/nccl/lib``
    and ``_load_global_deps``), JAX's CUDA plugin, CuPy."""
    site = pip_dir[: -len("/nvidia/nccl/lib")]
    return any(image.is_dir(f"{site}/{name}") for name in FRAMEWORKS)


def _default_rank(lib: dict[str, Any], loaded: set[str]) -> int:
    """How likely a listed libnccl is the one a job loads (:func:`_default_lib`): pip's
    ``libnccl.so.2`` beside a framework, then the linker's, then other pip copies, then
    the other names."""
    if not lib["path"].endswith("/libnccl.so.2"):
        return 3
    if lib["origin"] != "pip":
        return 1
    return 0 if lib["path"].rsplit("/", 1)[0] in loaded else 2


def _default_lib(libs: list[dict[str, Any]], loaded: set[str]) -> str | None:
    """The libnccl a job loads, as the loader finds it: pip's copy where a framework
    beside it loads it (``loaded``: those directories), else the linker's first
    ``libnccl.so.2`` (libs are listed directory by directory, in search order), else a
    pip copy (a framework this reader does not know). A stray pip copy anywhere in the
    image is not what the linker loads (issue 48)."""
    so2 = [r for r in libs if r["path"].endswith("/libnccl.so.2")]
    best = min(so2, key=lambda r: _default_rank(r, loaded), default=None)
    return None if best is None else str(best["path"])


def _net_plugin(image: ImageTree, env: dict[str, str], conf: dict[str, Any],
                lib: dict[str, Any] | None, plugins: list[dict[str, Any]],
                search: list[str]) -> str | None:
    """The path of the net plugin NCCL loads inside the image (no injection), or None."""
    value = env.get("NCCL_NET_PLUGIN")
    if value is None and conf.get("settings"):
        value = conf["settings"].get("NCCL_NET_PLUGIN")
    groups = plugin_probe.net_plugin_names(value, plugin_probe._version(lib))
    by_path = {r["path"]: r for r in plugins}
    for group in groups:
        for name in group:
            candidates = [name] if "/" in name else [f"{d}/{name}" for d in search]
            for c in candidates:
                if c in by_path and by_path[c]["abis"]["net"]:
                    return c
    return None
