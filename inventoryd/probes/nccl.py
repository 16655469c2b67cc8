"""Every ``libnccl.so*`` a job on this node can load, and what each file says it is.

Where: the directories the dynamic linker searches (:mod:`inventoryd.probes.linker`) and
the admin's ``nccl_search_paths`` (directories or globs). The linker's answer for
``libnccl.so.2`` is marked ``default``.

What, read from the file itself and never from its name (docs/nccl.md, "The version,
read from the library file"):
- the banner ``NCCL version X.Y.Z+cudaA.B``, a compile-time literal present since 2.3.5;
- ``NCCL git version <branch> <hash>`` when present;
- the plugin ABIs the library looks up by name with ``dlsym``: the string literals
  ``ncclNetPlugin_vN``, ``ncclCollNetPlugin_vN``, ``ncclTunerPlugin_vN``,
  ``ncclProfiler_vN``, and from 2.28 ``ncclEnvPlugin_vN``, ``ncclGinPlugin_vN``,
  ``ncclRmaPlugin_vN`` (as whole C strings: the mangled ``_ZL15ncclProfiler_v1`` of a
  static variable is not one);
- its sha256.
All in one buffered pass of bounded memory; the result is cached by file identity.
Optionally (config ``ncclgetversion``) ``ncclGetVersion`` is called in a short-lived
subprocess with a timeout, as a cross-check or when the banner is missing. Loading a
library runs its code (constructors): only a file whose whole path, from the node's root
down, is owned by root and writable by no one else is ever loaded (:func:`untrusted`);
a copy in a user's conda env under /home is read, never run.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import re
import subprocess
import sys
from typing import Any, BinaryIO

from inventoryd.filecache import FileCache
from inventoryd.nodefs import ErrorLog, NodeFS
from inventoryd.probes import linker
from ncclguard.config import InventorydConfig
from ncclguard.fileowner import owner
from ncclguard.fingerprint.abi import ABI_KINDS

PROBE = "nccl"
KIND = "libnccl/2"  # /2: the env, GIN and RMA ABIs (issue 13)
KIND_GETVERSION = "libnccl-getversion/1"
DEFAULT_SONAME = "libnccl.so.2"  # what applications link against and frameworks dlopen
NAME_GLOB = "libnccl.so*"
CHUNK = 1 << 20
OVERLAP = 256  # longer than any string searched for, so none is lost at a chunk boundary
MAX_LIBRARIES = 256
PROGRESS_EVERY = 16  # chunks (16 MiB) between two calls of nodefs.progress
GETVERSION_TIMEOUT_S = 10.0
# CUDA device code (fatbins of cubins and PTX) holds no host string literal
DEVICE_CODE_SECTIONS = frozenset({".nv_fatbin", "__nv_relfatbin"})

_BANNER = re.compile(
    rb"NCCL version (\d{1,3})\.(\d{1,3})\.(\d{1,3})\+cuda(\d{1,3})\.(\d{1,3})(?!\d)"
)
_GIT = re.compile(rb"NCCL git version ([\x20-\x7e]{1,200})\x00")
_DIGITS = re.compile(rb"(\d{1,3})\x00")
# "...Plugin_v" hits: the literal's prefix -> ABI kind
_PLUGIN_PREFIXES = ((b"ncclCollNet", "collnet"), (b"ncclNet", "net"), (b"ncclTuner", "tuner"),
                    (b"ncclEnv", "env"), (b"ncclGin", "gin"), (b"ncclRma", "rma"))
_IDENT = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")


def version_code(major: int, minor: int, patch: int) -> int:
    """NCCL_VERSION_CODE: X*10000+Y*100+Z from 2.9 on, X*1000+Y*100+Z before."""
    if (major, minor) >= (2, 9):
        return major * 10000 + minor * 100 + patch
    return major * 1000 + minor * 100 + patch


def version_from_code(code: int) -> str:
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


class _Scanner:
    """Feeds chunks; collects the banner, the git version and the plugin ABI literals."""

    def __init__(self) -> None:
        self.banner: tuple[int, int, int, int, int] | None = None
        self.git: str | None = None
        self.abis: dict[str, set[int]] = {k: set() for k in ABI_KINDS}

    def feed(self, buf: bytearray, end: int, eof: bool) -> None:
        """Search ``buf[:end]``. A match touching ``end`` waits for more data unless ``eof``."""
        if self.banner is None:
            i = buf.find(b"NCCL version ", 0, end)
            while i >= 0 and self.banner is None:
                m = _BANNER.match(buf, i, end)
                if m and (eof or m.end() < end):
                    self.banner = tuple(int(g) for g in m.groups())  # type: ignore[assignment]
                i = buf.find(b"NCCL version ", i + 1, end)
        if self.git is None:
            i = buf.find(b"NCCL git version ", 0, end)
            while i >= 0 and self.git is None:
                m = _GIT.match(buf, i, end)
                if m:
                    self.git = m.group(1).decode("ascii")
                i = buf.find(b"NCCL git version ", i + 1, end)
        i = buf.find(b"Plugin_v", 0, end)
        while i >= 0:
            for prefix, kind in _PLUGIN_PREFIXES:
                start = i - len(prefix)
                if start >= 0 and buf[start:i] == prefix:
                    self._abi(buf, start, i + len(b"Plugin_v"), end, kind)
                    break
            i = buf.find(b"Plugin_v", i + 1, end)
        i = buf.find(b"ncclProfiler_v", 0, end)
        while i >= 0:
            self._abi(buf, i, i + len(b"ncclProfiler_v"), end, "profiler")
            i = buf.find(b"ncclProfiler_v", i + 1, end)

    def _abi(self, buf: bytearray, start: int, digits: int, end: int, kind: str) -> None:
        if start > 0 and buf[start - 1] in _IDENT:
            return  # part of a longer identifier (a mangled name, a type name)
        m = _DIGITS.match(buf, digits, end)
        if m:
            self.abis[kind].add(int(m.group(1)))


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, end)`` ranges sorted, those that overlap or touch made one."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _inside(starts: list[int], ranges: list[tuple[int, int]], a: int, b: int) -> bool:
    """Whether ``[a, b)`` lies wholly in one of the merged ``ranges`` (by bisection)."""
    i = bisect.bisect_right(starts, a) - 1
    return i >= 0 and b <= ranges[i][1]


def scan(f: BinaryIO, skip: list[tuple[int, int]] | None = None,
         limit: int | None = None) -> dict[str, Any]:
    """sha256, size, banner, git version and plugin ABIs of one open file, in one pass.

    At most ``limit`` bytes are read (the size that was checked: a file that grows
    afterwards, a sparse ``truncate -s 1T``, is not read past it). Every byte is hashed;
    the strings are not searched for in chunks that lie wholly in a
    ``skip`` range (CUDA device code: 95 % of a libnccl, and no host string literal).
    """
    from inventoryd.nodefs import progress

    tick = progress.get()
    h = hashlib.sha256()
    sc = _Scanner()
    chunks = 0
    buf = bytearray(OVERLAP + CHUNK)
    view = memoryview(buf)
    keep = 0
    pos = 0
    # merged, then found by bisection: each chunk tested against every range was a
    # linear search per MiB (millions of sections, issue 48)
    ranges = merge_ranges(skip or [])
    starts = [a for a, _ in ranges]
    while True:
        want = CHUNK if limit is None else min(CHUNK, limit - pos)
        n = f.readinto(view[keep : keep + want]) if want > 0 else 0  # type: ignore[attr-defined]
        if not n:
            sc.feed(buf, keep, eof=True)
            break
        h.update(view[keep : keep + n])
        chunks += 1
        if tick is not None and chunks % PROGRESS_EVERY == 0:
            tick()
        start, pos = pos, pos + n
        if _inside(starts, ranges, start, pos):
            sc.feed(buf, keep, eof=True)  # the text before the skipped part ends here
            keep = 0
            continue
        end = keep + n
        sc.feed(buf, end, eof=False)
        keep = min(OVERLAP, end)
        buf[:keep] = buf[end - keep : end]
    view.release()
    abis = {k: sorted(v, reverse=True) for k, v in sc.abis.items()}
    return {"sha256": h.hexdigest(), "size": pos, "banner": sc.banner, "git": sc.git,
            "abis": abis}


def _unread(size: int, why: str) -> dict[str, Any]:
    """The facts of a file that is not read: no hash, no version, the reason."""
    return {
        "size": size, "sha256": None, "version": None, "version_code": None,
        "cuda_version": None, "version_source": None, "version_error": why,
        "git_version": None, "abis": {k: [] for k in ABI_KINDS},
    }


def analyze(f: BinaryIO, label: str) -> dict[str, Any]:
    """The file-only facts of one libnccl (cacheable): the schema fields but path/default."""
    from inventoryd.elf import ElfError, ElfReader  # only on a cache miss: a warm run skips it

    problem = None
    skip: list[tuple[int, int]] = []
    from inventoryd.nodefs import library_unreadable

    # only a library is hashed, and not past the bounds: a 4 GiB sparse file took 15 s,
    # a 1 TB one would outlive the watchdog
    size, why = library_unreadable(f)
    if why is not None:
        return _unread(size, why)
    if size == 0:
        problem = "empty file (0 bytes)"
    else:
        try:
            f.seek(0)
            elf = ElfReader(f, label)
            problem = elf.truncation()
            skip = [] if problem else elf.section_ranges(DEVICE_CODE_SECTIONS)
        except ElfError as e:
            problem = str(e).removeprefix(f"{label}: ")
    f.seek(0)
    s = scan(f, skip, limit=size)
    out: dict[str, Any] = {
        "size": s["size"], "sha256": s["sha256"], "version": None, "version_code": None,
        "cuda_version": None, "version_source": None, "version_error": None,
        "git_version": s["git"], "abis": s["abis"],
    }
    if problem:
        out["version_error"] = f"{problem}; no version read"
        return out
    if s["banner"] is None:
        out["version_error"] = "no NCCL version banner in the file"
        return out
    major, minor, patch, cmaj, cmin = s["banner"]
    out.update(version=f"{major}.{minor}.{patch}", version_code=version_code(major, minor, patch),
               cuda_version=f"{cmaj}.{cmin}", version_source="banner")
    return out


_GETVERSION = (
    "import ctypes, sys\n"
    "lib = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_LOCAL)\n"
    "v = ctypes.c_int(0)\n"
    "rc = lib.ncclGetVersion(ctypes.byref(v))\n"
    "print(rc, v.value)\n"
)


def nccl_get_version(host_path: str, timeout: float = GETVERSION_TIMEOUT_S) -> int:
    """``ncclGetVersion()`` of a library, loaded in a separate Python process. Raises
    RuntimeError with the cause (load failure, nonzero result, timeout)."""
    cmd = [sys.executable, "-I", "-c", _GETVERSION, host_path]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL, env={"PATH": os.defpath})
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"ncclGetVersion: no answer within {timeout:g} s") from None
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"ncclGetVersion: loading failed: {tail}")
    parts = r.stdout.split()
    if len(parts) != 2 or parts[0] != "0" or not parts[1].isdigit():
        raise RuntimeError(f"ncclGetVersion: unexpected answer {r.stdout.strip()!r}")
    return int(parts[1])


def _candidates(
    fs: NodeFS, errors: ErrorLog, config: InventorydConfig, view: linker.LinkerView
) -> dict[str, str]:
    """node path -> origin ("linker" | "config")."""
    found: dict[str, str] = {p: "linker" for p in view.find(NAME_GLOB)}
    for pattern in config.nccl_search_paths:
        for p in linker.glob(fs, pattern, errors, PROBE, "libnccl"):
            try:
                is_dir = os.path.isdir(fs.host(linker.resolve(fs, p)))
            except OSError as e:
                errors.add(PROBE, "libnccl", p, e)
                continue
            if is_dir:
                for q in linker.glob(fs, linker.join_path(p, NAME_GLOB), errors, PROBE, "libnccl"):
                    found.setdefault(q, "config")
            elif _matches_name(p):
                found.setdefault(p, "config")
    return found


def _matches_name(node_path: str) -> bool:
    name = node_path.rsplit("/", 1)[-1]
    return name == "libnccl.so" or name.startswith("libnccl.so.")


def _empty(path: str, origin: str, why: str) -> dict[str, Any]:
    return {
        "path": path, "realpath": None, "size": None, "sha256": None, "version": None,
        "version_code": None, "cuda_version": None, "version_source": None,
        "version_error": why, "git_version": None,
        "abis": {k: [] for k in ABI_KINDS}, "default": False, "origin": origin,
    }


def describe(
    fs: NodeFS, errors: ErrorLog, path: str, origin: str, cache: FileCache,
    getversion: bool = False,
) -> dict[str, Any] | None:
    """The schema record of one libnccl node path; None for a dangling symlink."""
    try:
        facts, st, real = cache.facts(fs, path, KIND, analyze)
    except FileNotFoundError:
        return None  # a dangling link (a -dev symlink without its target): not loadable
    except OSError as e:
        errors.add(PROBE, "libnccl", path, e)
        return _empty(path, origin, f"cannot read: {_oserror(e)}")
    if getversion and facts["size"]:
        _cross_check(fs, errors, path, real, st, facts, cache)
    return {"path": path, "realpath": real, **facts, "default": False, "origin": origin}


def untrusted(fs: NodeFS, real: str) -> str | None:
    """Why the library at node path ``real`` (symlinks resolved) must not be loaded, or
    None: the file and every directory above it, up to the node's root, must be owned
    by root and not writable by group or others (anyone else could put code there)."""
    parts = [p for p in real.split("/") if p]
    for i in range(len(parts), -1, -1):
        node_path = "/" + "/".join(parts[:i])
        try:
            st = os.lstat(fs.host(node_path))
        except OSError as e:
            return f"cannot stat {node_path}: {_oserror(e)}"
        if st.st_uid != 0:
            return f"{node_path} is owned by {owner(st.st_uid)}, not root"
        if st.st_mode & 0o022:
            return f"{node_path} is writable by others (mode {oct(st.st_mode & 0o7777)})"
    return None


def _cross_check(
    fs: NodeFS, errors: ErrorLog, path: str, real: str, st: os.stat_result,
    facts: dict[str, Any], cache: FileCache,
) -> None:
    why = untrusted(fs, real)
    if why is not None:  # its code would run in our process tree: never
        errors.add(PROBE, "libnccl.version", path, f"ncclGetVersion not called: {why}")
        return
    got = cache.get(KIND_GETVERSION, real, st)
    if got is None:
        try:
            got = {"code": nccl_get_version(str(fs.host(real))), "error": None}
        except RuntimeError as e:
            got = {"code": None, "error": str(e)}
        cache.put(KIND_GETVERSION, real, st, got)
    if got["error"]:
        errors.add(PROBE, "libnccl.version", path, got["error"])
        return
    code = got["code"]
    if facts["version_code"] is None:
        facts.update(version=version_from_code(code), version_code=code,
                     version_source="ncclGetVersion",
                     version_error=None)
    elif facts["version_code"] != code:
        errors.add(PROBE, "libnccl.version", path,
                   f"banner says {facts['version']} ({facts['version_code']}) but "
                   f"ncclGetVersion() returns {code}")


def _oserror(e: OSError) -> str:
    return f"[Errno {e.errno}] {e.strerror}" if e.strerror else str(e)


def probe(
    fs: NodeFS, errors: ErrorLog, config: InventorydConfig, cache: FileCache
) -> list[dict[str, Any]]:
    """The ``libnccl`` list of the fingerprint, sorted by path."""
    view = linker.LinkerView.load(fs, errors, PROBE)
    found = _candidates(fs, errors, config, view)
    default = view.lookup(DEFAULT_SONAME)
    if default is not None:
        found.setdefault(default, "linker")
        found[default] = "linker"
    paths = sorted(found)
    if len(paths) > MAX_LIBRARIES:
        errors.add(PROBE, "libnccl", None, f"{len(paths)} libnccl files found; only the first "
                   f"{MAX_LIBRARIES} (by path) are read")
        keep = paths[:MAX_LIBRARIES]
        if default is not None and default not in keep:
            keep[-1] = default
        paths = sorted(keep)
    out = []
    for p in paths:
        rec = describe(fs, errors, p, found[p], cache, config.ncclgetversion)
        if rec is not None:
            rec["default"] = p == default
            out.append(rec)
    return out
