"""What this node injects into containers (fingerprint ``containers``, docs/containers.md).

A job's container brings its own libnccl; the net plugin may come from the node. Sites
put aws-ofi-nccl, HPC-X or GIB plugins in with enroot's system configuration (pyxis runs
enroot), ``--container-mounts``, or Apptainer's bind paths. Read here, never run:

- enroot (``/etc/enroot``, ``ENROOT_SYSCONF_PATH``'s default): ``mounts.d/*.fstab`` read
  as ``enroot-mount`` reads them (:func:`parse_fstab`), ``environ.d/*.env`` as
  ``enroot-switchroot`` sets them (the last line of a name wins; only ``NCCL_*`` and
  ``LD_LIBRARY_PATH`` kept), ``hooks.d/*.sh`` (their names and hashes, and every absolute
  ``libnccl-*.so`` path their text names);
- pyxis: the ``spank_pyxis.so`` lines of ``/etc/slurm/plugstack.conf`` and
  ``plugstack.conf.d/*.conf``, with their arguments;
- Apptainer/Singularity: ``bind path`` lines of ``apptainer.conf``/``singularity.conf``.

Only what a container could load counts (issue 47): a bind mount's absolute source that
is root's and writable by no one else, up to the node's root (:func:`untrusted`); a
mounted directory is searched three levels deep, never into a directory others can write
(``/dev/shm``, ``/tmp``: any user could plant a plugin there) nor into the kernel's
filesystems (``/proc``, ``/sys``, ``/dev``: enroot's stock ``10-system.fstab`` binds them,
and no library lives there). ``net_plugin`` is the one a container loads, in the linker's
order: the file named by an injected ``NCCL_NET_PLUGIN`` (else ``libnccl-net.so``) in the
first directory of the injected ``LD_LIBRARY_PATH``, then of the system directories
(:data:`SYSTEM_DIRS`), that holds it; None when the node injects none (the image's own is
used then). When the probe cannot say (a configuration file it cannot read, a walk cut
short, the plugin injected only where the image's own linker path decides, the probe
failing) ``unknown`` says why, and the gate reads the node as not known (``image-unknown``),
never as "injects nothing". Stock enroot hooks inject no NCCL, nor does Apptainer's
``nvliblist.conf`` (issue 15).
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import stat
from collections.abc import Sequence
from typing import Any

from inventoryd.filecache import FileCache
from inventoryd.nodefs import ErrorLog, NodeFS
from inventoryd.probes import plugins as plugin_probe
from ncclguard.fileowner import owner

PROBE = "containers"
ENROOT = "/etc/enroot"
PLUGSTACK = "/etc/slurm/plugstack.conf"
APPTAINER_CONFS = ("/etc/apptainer/apptainer.conf", "/etc/singularity/singularity.conf")
MAX_FILES = 64  # per directory
MAX_PLUGINS = 32
MAX_READ = 64 * 1024
MAX_WALK_DEPTH = 3  # a mounted directory is searched this deep (HPC-X: <dir>/<plugin>/lib)
MAX_WALK = 4096  # entries looked at per mounted directory
MAX_WALK_TOTAL = 16384  # entries looked at by one probe, every mount together
REFUSED = "refused"  # a place others can write: what is there is a user's choice
_PLUGIN_PATH = re.compile(r"(/[A-Za-z0-9_./+-]*/libnccl-[a-z]+[A-Za-z0-9_.+-]*\.so[0-9.]*)")
#: The kernel's filesystems: enroot's stock ``10-system.fstab`` binds them into every
#: container; no library lives there, and walking them costs time for nothing.
KERNEL_FS = ("/proc", "/sys", "/dev")
#: Where a container's dynamic linker looks after ``LD_LIBRARY_PATH`` whatever the image:
#: glibc's trusted directories and the multiarch ones Debian, Ubuntu and RHEL images put
#: in their ``ld.so.cache``. A plugin injected elsewhere is loaded only if the image's own
#: ``LD_LIBRARY_PATH`` or ``ld.so.conf`` names its directory: not known on the node.
SYSTEM_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu",
               "/usr/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib")
# getmntent(3)'s escapes in an fstab field: space, tab, newline, backslash
_ESCAPE = re.compile(r"\\(040|011|012|134)")
#: enroot-mount's option names (enroot v4.1.2 ``bin/enroot-mount.c`` ``mount_opts``): a
#: bare second or third fstab field that is one of them (or holds a comma) is options
MOUNT_OPTIONS = frozenset({
    "async", "atime", "bind", "dev", "diratime", "dirsync", "exec", "iversion", "loud", "mand",
    "noatime", "nodev", "nodiratime", "noexec", "noiversion", "nomand", "norelatime",
    "nostrictatime", "nosuid", "private", "rbind", "relatime", "remount", "ro", "rprivate",
    "rshared", "rslave", "runbindable", "rw", "shared", "silent", "slave", "strictatime",
    "suid", "sync", "unbindable", "lazytime", "nolazytime", "auto", "defaults", "group",
    "noauto", "nofail", "nogroup", "noowner", "nouser", "nousers", "owner", "user", "users",
    "x-create=dir", "x-create=file", "x-create=auto", "x-move", "x-detach",
})


def empty(unknown: str | None = None) -> dict[str, Any]:
    """The part of a node without enroot, Apptainer or pyxis; ``unknown``: why what the
    node injects is not known (a probe that failed)."""
    return {"enroot": {"mounts": [], "environ": {}, "hooks": []}, "pyxis": [],
            "apptainer_binds": [], "plugins": [], "net_plugin": None, "unknown": unknown}


def _files(fs: NodeFS, errors: ErrorLog, d: str, suffix: str, why: list[str]) -> list[str]:
    names = fs.list_dir(d, errors, PROBE, f"containers:{d}") or []
    matching = [f"{d}/{n}" for n in names if n.endswith(suffix)]
    if len(matching) > MAX_FILES:
        why.append(f"{d}: more than {MAX_FILES} *{suffix} files; only the first read")
    return matching[:MAX_FILES]


def _text(fs: NodeFS, errors: ErrorLog, path: str, why: list[str]) -> str | None:
    got = fs.read_bytes(path, MAX_READ, errors, PROBE, "containers")
    if got is None:
        return None
    if got[1]:
        why.append(f"{path}: longer than {MAX_READ} bytes; the rest not read")
    return got[0].decode("utf-8", "replace")


def _is_options(word: str) -> bool:
    """Whether an fstab word is mount options, as enroot-mount's ``ismntopt`` says."""
    return "," in word or word in MOUNT_OPTIONS


def parse_fstab(text: str) -> list[dict[str, str]]:
    """enroot's fstab lines as ``enroot-mount`` reads them (enroot v4.1.2
    ``bin/compat.h`` ``compat_getmntent_r``, ``bin/enroot-mount.c`` ``mount_fstab``):
    ``source [target [type [options [freq [passno]]]]]``, blank and ``#`` lines skipped,
    getmntent's octal escapes decoded, and the missing fields guessed as enroot does
    (``/src`` alone: bound at ``/src``, ``rbind``; ``/src /dst``: ``rbind``; a second or
    third field that is options: the type is ``none``; ``tmpfs /dst``: a tmpfs)."""
    out = []
    for line in text.splitlines():
        words = [_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), w) for w in line.split()]
        if not words or words[0].startswith("#"):
            continue
        source = words[0]
        target = words[1] if len(words) > 1 else ""
        type_ = words[2] if len(words) > 2 else ""
        options = words[3] if len(words) > 3 else ""
        if target and not type_ and not options and _is_options(target):
            target, type_, options = "", "none", target
        if type_ and not options and _is_options(type_):
            type_, options = "none", type_
            if target == "none":
                target = ""
        if source == "tmpfs":
            type_ = "tmpfs" if type_ in ("", "none") else type_
        else:
            target = target or source
            if type_ in ("", "none"):
                type_ = "none"
                options = options or "rbind,x-create=auto"
        out.append({"source": source, "target": target, "type": type_, "options": options})
    return out


def bind_source(m: dict[str, str]) -> str | None:
    """The node path a mount brings into the container (a bind of an absolute source),
    normalised; None for anything else (a tmpfs, ``proc``, a device, an unmount, a source
    enroot fills in from the job's environment: ``${HOME}``)."""
    opts = {o.split("=", 1)[0] for o in m.get("options", "").split(",")}
    source = m.get("source", "")
    if m.get("type") != "none" or not opts & {"bind", "rbind"} or "x-detach" in opts:
        return None
    if not source.startswith("/") or "${" in source or not m.get("target", "").startswith("/"):
        return None
    return posixpath.normpath(source).replace("//", "/")


def parse_env(text: str) -> dict[str, str]:
    """``NCCL_*`` and ``LD_LIBRARY_PATH`` of an environ.d file, as enroot formats it
    (``common::envfmt``: leading blanks and comments dropped, quotes around a value taken
    off); the last line of a name wins, as ``enroot-switchroot`` sets them in order."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        name, eq, value = line.lstrip().partition("=")
        if eq and (name.startswith("NCCL_") or name == "LD_LIBRARY_PATH"):
            value = value.rstrip()
            if len(value) >= 2 and value[0] in "\"'" and value[-1] in "\"'":
                value = value[1:-1]
            out[name] = value
    return out


def _kernel(node_path: str) -> bool:
    return any(node_path == k or node_path.startswith(k + "/") for k in KERNEL_FS)


def _mode_why(node_path: str, st: os.stat_result) -> str | None:
    if st.st_uid != 0:
        return f"{node_path} is owned by {owner(st.st_uid)}, not root"
    if st.st_mode & 0o022:
        return f"{node_path} is writable by others (mode {oct(st.st_mode & 0o7777)})"
    return None


class _Untrusted(Exception):
    pass


def trusted_path(fs: NodeFS, node_path: str) -> tuple[str | None, str | None]:
    """``(the node path with its links resolved, None)`` when every directory the path
    goes through (those holding its links too), up to ``/``, and what it names are root's
    and writable by no one else, and none is in a kernel filesystem; else ``(None,
    why)``. Checked component by component as the path is resolved (issue 47's review: a
    link in a world-writable directory on the way let a user choose the file, which a
    check of the final path alone did not see); nothing on such a path can change under
    a non-root user between this check and the read."""

    def visit(path: str, st: os.stat_result) -> None:
        why = "a kernel filesystem" if _kernel(path) else _mode_why(path, st)
        if why is not None:
            raise _Untrusted(why)

    try:
        visit("/", os.lstat(fs.host("/")))
        return fs.resolve(node_path, strict=True, visit=visit), None
    except _Untrusted as e:
        return None, str(e)
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        return None, f"cannot resolve {node_path}: {getattr(e, 'strerror', None) or e}"


Found = tuple[list[tuple[str, str]], list[str], str | None]


class Walk:
    """What the mounts bring in: the plugin files a container could load and the places
    where a user decides what is there (refused), within one budget of entries for the
    whole probe (issue 47's review: a 64 KiB fstab binding one big directory ran past
    100 s). Each source is walked once, however many lines bind it."""

    def __init__(self, fs: NodeFS) -> None:
        self.fs = fs
        self.left = MAX_WALK_TOTAL
        self.cut: str | None = None
        self._done: dict[str, Found] = {}

    def source(self, source: str) -> Found:
        """``(plugin files (node path, name), refused node paths, why the walk stopped)``
        of a bind source."""
        if source not in self._done:
            self._done[source] = self._walk(source)
        return self._done[source]

    def _walk(self, source: str) -> Found:
        fs = self.fs
        try:  # not there at all (a link that leads nowhere is there: it is checked)
            os.lstat(fs.host(source))
        except (OSError, ValueError):  # ValueError: a NUL in the path, no usable bind
            return [], [], None
        if _kernel(source):
            return [], [], None
        real, _why = trusted_path(fs, source)
        if real is None:
            return [], [source], None  # a user may decide what is there
        if plugin_probe._kind_of(source) is not None:
            return [(source, source.rsplit("/", 1)[-1])], [], None
        out: list[tuple[str, str]] = []
        refused: list[str] = []
        if not fs.is_dir(real):
            return out, refused, None
        todo = [(source.rstrip("/") or "/", real, 0)]
        seen = 0
        while todo:  # breadth first, MAX_WALK_DEPTH levels, MAX_WALK entries a source
            d, d_real, depth = todo.pop(0)
            for n in fs.list_dir(d_real) or []:
                seen += 1
                self.left -= 1
                if seen > MAX_WALK or self.left < 0:
                    self.cut = (f"{source}: the walk of the injected directories stopped at "
                                f"{MAX_WALK} entries a source, {MAX_WALK_TOTAL} in all")
                    return out, refused, self.cut
                p = f"{d}/{n}"
                r = self._entry(f"{d_real}/{n}")
                if n.startswith("libnccl-") and ".so" in n:
                    if r is None:
                        refused.append(p)
                    else:
                        out.append((p, n))
                elif depth >= MAX_WALK_DEPTH or _kernel(f"{d_real}/{n}"):
                    continue
                elif r is not None and fs.is_dir(r):  # links to root's directories too
                    todo.append((p, r, depth + 1))
                elif r is None and fs.is_dir(f"{d_real}/{n}"):
                    refused.append(p)  # a directory others can write inside a bound one
        return out, refused, None

    def _entry(self, node_path: str) -> str | None:
        """:func:`trusted_path` of an entry of a directory already trusted (its real
        path): only the entry itself is checked, unless it is a link to follow."""
        try:
            st = os.lstat(self.fs.host(node_path))
        except (OSError, ValueError):
            return None
        if stat.S_ISLNK(st.st_mode):
            return trusted_path(self.fs, node_path)[0]
        return None if _kernel(node_path) or _mode_why(node_path, st) else node_path


def probe(fs: NodeFS, errors: ErrorLog, cache: FileCache) -> dict[str, Any]:
    why: list[str] = []  # what makes the answer not known
    out = _configuration(fs, errors, why)
    found, refused = _brought_in(fs, out, why)
    if len(found) > MAX_PLUGINS:
        why.append(f"more than {MAX_PLUGINS} plugin files injected; only the first analysed")
    plugins = []
    for path, target, via in found[:MAX_PLUGINS]:
        kind = plugin_probe._kind_of(path) or "net"
        rec = plugin_probe.describe(fs, errors, kind, path, via, cache)
        plugins.append({"target": target, "via": via, "kind": kind, "path": path,
                        "name": rec.get("name"), "abis": rec.get("abis"),
                        "sha256": rec.get("sha256"), "error": rec.get("error")})
    plugins.sort(key=lambda r: (r["target"], r["path"]))
    out["plugins"] = plugins
    net, unknown = choose_net(plugins, out["enroot"]["environ"], refused)
    out["net_plugin"] = net
    if unknown:
        why.append(unknown)
    out["unknown"] = "; ".join(why) if why else None
    return out


def _configuration(fs: NodeFS, errors: ErrorLog, why: list[str]) -> dict[str, Any]:
    """The part without its plugins: enroot's mounts, environment and hooks (with the
    plugin paths the hooks' text names, ``hook_paths``, not published), pyxis's lines,
    Apptainer's binds. A file that cannot be read is added to ``why``."""
    out = empty()
    before = len(errors.for_probe(PROBE))
    mounts: list[dict[str, str]] = []
    for f in _files(fs, errors, f"{ENROOT}/mounts.d", ".fstab", why):
        for m in parse_fstab(_text(fs, errors, f, why) or ""):
            mounts.append({"file": f, **m})
    environ: dict[str, str] = {}
    for f in _files(fs, errors, f"{ENROOT}/environ.d", ".env", why):
        environ.update(parse_env(_text(fs, errors, f, why) or ""))
    hooks = []
    hook_paths: list[str] = []
    for f in _files(fs, errors, f"{ENROOT}/hooks.d", ".sh", why):
        got = fs.read_bytes(f, MAX_READ, errors, PROBE, "containers.hooks")
        data = got[0] if got else b""
        hooks.append({"path": f, "sha256": hashlib.sha256(data).hexdigest() if got else None})
        hook_paths += _PLUGIN_PATH.findall(data.decode("utf-8", "replace"))
    out["enroot"] = {"mounts": mounts, "environ": environ, "hooks": hooks}
    out["hook_paths"] = hook_paths
    for f in [PLUGSTACK, *_files(fs, errors, PLUGSTACK + ".d", ".conf", why)]:
        for line in (_text(fs, errors, f, why) or "").splitlines():
            words = line.split("#", 1)[0].split()
            if len(words) >= 2 and "spank_pyxis" in words[1]:
                out["pyxis"].append({"file": f, "plugin": words[1], "args": words[2:]})
    for f in APPTAINER_CONFS:
        for line in (_text(fs, errors, f, why) or "").splitlines():
            key, eq, value = line.partition("=")
            if eq and key.strip().lower() == "bind path":
                out["apptainer_binds"].append(value.strip())
    why += [f"cannot read {e['path']}: {e['error']}" for e in errors.for_probe(PROBE)[before:]]
    return out


def _brought_in(fs: NodeFS, part: dict[str, Any], why: list[str]
                ) -> tuple[list[tuple[str, str, str]], list[str]]:
    """``([(node path, target, via)], refused targets)``: the plugin files the mounts,
    binds and hooks bring in, where the container sees them, in mount order (a later
    mount at a target hides the earlier one), and the targets that are places others can
    write (a user decides what is there). Takes ``hook_paths`` out of ``part``."""
    walk = Walk(fs)
    found: list[tuple[str, str, str]] = []

    def bring(source: str, target: str, via: str) -> None:
        files, refused, cut = walk.source(source)
        why.extend([cut] if cut and cut not in why else [])
        for path, via_ in [*((f, via) for f, _n in files), *((r, REFUSED) for r in refused)]:
            t = target
            if path != source:
                t = f"{target.rstrip('/')}{path[len(source.rstrip('/')):]}"
            elif via_ != REFUSED and plugin_probe._kind_of(target) is None:
                t = f"{target.rstrip('/')}/{path.rsplit('/', 1)[-1]}"
            found.append((path, posixpath.normpath(t), via_))

    for m in part["enroot"]["mounts"]:
        source = bind_source(m)
        if source is not None:
            bring(source, m["target"], f"enroot:{m['file']}")
    for b in part["apptainer_binds"]:
        src, _, dst = b.partition(":")
        if src.startswith("/"):
            src = posixpath.normpath(src)
            bring(src, dst or src, "apptainer")
    for p in part.pop("hook_paths"):
        p = posixpath.normpath(p)
        if plugin_probe._kind_of(p) is not None and fs.exists(p):
            found.append((p, p, "enroot-hook" if trusted_path(fs, p)[0] else REFUSED))
    last = {target: i for i, (_, target, _) in enumerate(found)}
    found = [f for i, f in enumerate(found) if last[f[1]] == i]
    return ([f for f in found if f[2] != REFUSED],
            [t for _, t, via in found if via == REFUSED])


def _wanted(environ: dict[str, str]) -> tuple[list[str], str | None] | None:
    """``(file names, path)`` NCCL opens for the injected ``NCCL_NET_PLUGIN`` (its first
    item: a list from 2.27.3), ``libnccl-net.so`` without one; None for ``none``."""
    value = environ.get("NCCL_NET_PLUGIN")
    if value is None:
        return ["libnccl-net.so"], None
    item = value.split(",", 1)[0].strip()
    if item.lower() == "none":
        return None
    if "/" in item:
        return [], posixpath.normpath(item)
    return [item, f"libnccl-net-{item}.so"], None


def linker_dirs(environ: dict[str, str]) -> list[str]:
    """The directories a container's linker searches whatever its image: the injected
    ``LD_LIBRARY_PATH`` (absolute entries, none that enroot fills in from the job), then
    :data:`SYSTEM_DIRS`."""
    dirs = [posixpath.normpath(d) for d in environ.get("LD_LIBRARY_PATH", "").split(":")
            if d.startswith("/") and "$" not in d]
    return list(dict.fromkeys([*dirs, *SYSTEM_DIRS]))


def choose_net(plugins: list[dict[str, Any]], environ: dict[str, str],
               refused: Sequence[str] = ()) -> tuple[dict[str, Any] | None, str | None]:
    """``(the net plugin a container loads, why that is not known)``: the wanted file in
    the first linker directory that holds one. Not known: a place others can write
    (``refused``: a bound source, or a file or directory in one) that the linker would
    reach first (issue 47's review: a user's file there was passed over, and the node
    said "none" or named the next plugin, while the container loads the user's); a wanted
    file injected only off those directories, or named by a hook, whose target is not
    known, when none is on them: the image's own linker path decides."""
    wanted = _wanted(environ)
    if wanted is None:
        return None, None
    names, path = wanted
    nets = [p for p in plugins if p["kind"] == "net"]

    def user_owned(target: str) -> str | None:
        return next((r for r in refused if target == r or target.startswith(r + "/")), None)

    if path is not None:
        if (r := user_owned(path)) is not None:
            return None, f"{r}: others can write it, and NCCL_NET_PLUGIN names {path} there"
        hits = [p for p in nets if p["target"] == path]
        return (_summary(hits[0]), None) if hits else (None, None)
    matching = [p for p in nets if p["target"].rsplit("/", 1)[-1] in names]
    for d in linker_dirs(environ):
        for name in names:
            if (r := user_owned(f"{d}/{name}")) is not None:
                return None, (f"{r}: others can write it, and the linker looks for {name} "
                              f"there ({d}) first: a user decides what a container loads")
            for p in matching:
                if p["via"] != "enroot-hook" and p["target"] == f"{d}/{name}":
                    if p.get("error"):
                        return None, f"{p['path']}: {p['error']}"
                    return _summary(p), None
    if matching:
        p = matching[0]
        where = "by a hook" if p["via"] == "enroot-hook" else f"at {p['target']}"
        return None, (f"{p['path']} is injected {where}: whether a container loads it "
                      "depends on the image's own linker path")
    theirs = next((r for r in refused if r.rsplit("/", 1)[-1] in names), None)
    if theirs is not None:
        return None, (f"{theirs}: a file others can write is injected there: whether a "
                      "container loads it depends on the image's own linker path")
    return None, None


def _summary(p: dict[str, Any]) -> dict[str, Any]:
    return {"name": p["name"], "abis": (p.get("abis") or {}).get("net") or [],
            "path": p["path"], "target": p["target"]}
