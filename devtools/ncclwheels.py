"""Real NCCL parts for the tests and the demo: libnccl.so.2 from PyPI wheels, gcc plugins.

- :func:`extract_nccl` ``("2.21.5")`` -> the path of a real ``libnccl.so.2``, extracted once
  from the ``nvidia-nccl-cu11``/``-cu12`` wheel into ``~/.cache/ncclguard/nccl/<pkg>-<ver>/``.
  A missing wheel is fetched with ``pip download --no-deps --only-binary=:all:`` into
  ``~/.cache/ncclguard/wheels`` (``$NCCLGUARD_TEST_CACHE`` moves both). Failure raises
  :class:`PartUnavailable` naming the cause (no network, pip failing).
- :func:`build_plugin` ``(out_dir, net_abis=[8, 7], name="IBext_v8")`` -> a ``.so`` that gcc
  builds from a tiny C file exporting the chosen ``ncclNetPlugin_vN`` (etc.) structs, each
  starting with its name string, as real plugins do (docs/nccl-facts.md).

The cache layout and the version table are those of ``tests/conftest.py``, so the demo and
the tests share one download.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

WHEEL_MEMBER = "nvidia/nccl/lib/libnccl.so.2"

# version -> PyPI project; checked on these very files (docs/nccl-facts.md).
NCCL_WHEELS: dict[str, str] = {
    "2.18.3": "nvidia-nccl-cu12",
    "2.21.5": "nvidia-nccl-cu11",
    "2.26.2": "nvidia-nccl-cu12",
    # the plugin-kind boundaries of issue 13 (docs/fingerprint.md, "Plugin kinds by NCCL")
    "2.23.4": "nvidia-nccl-cu12",
    "2.27.7": "nvidia-nccl-cu12",
    "2.28.9": "nvidia-nccl-cu12",
    "2.30.7": "nvidia-nccl-cu13",  # the cu13 build: a CUDA 13 libnccl among the cu12 ones
    "2.32.3": "nvidia-nccl-cu12",
}


class PartUnavailable(RuntimeError):
    """A real part (a wheel, a compiler) that cannot be had here; the message says why."""


def cache_dir() -> Path:
    env = os.environ.get("NCCLGUARD_TEST_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ncclguard"


def _wheel_for(wheels: Path, project: str, version: str) -> Path | None:
    stem = project.replace("-", "_")
    found = sorted(wheels.glob(f"{stem}-{version}-*.whl"))
    return found[0] if found else None


def _download(wheels: Path, project: str, version: str, timeout: float) -> Path:
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--dest", str(wheels), f"{project}=={version}"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PartUnavailable(
            f"pip download {project}=={version} timed out after {timeout:.0f}s (no network?)"
        ) from None
    wheel = _wheel_for(wheels, project, version)
    if r.returncode != 0 or wheel is None:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise PartUnavailable(f"cannot download {project}=={version} (no network?): {tail[0]}")
    return wheel


def nccl_path(version: str) -> Path:
    """Where :func:`extract_nccl` puts (or has put) that version's ``libnccl.so.2``."""
    project = NCCL_WHEELS[version]
    return cache_dir() / "nccl" / f"{project.replace('-', '_')}-{version}" / "libnccl.so.2"


def extract_nccl(version: str, timeout: float = 900) -> Path:
    """The path of a real ``libnccl.so.2`` of ``version`` (a key of :data:`NCCL_WHEELS`)."""
    if version not in NCCL_WHEELS:
        raise PartUnavailable(f"no wheel known for NCCL {version} (known: "
                              f"{', '.join(NCCL_WHEELS)})")
    project = NCCL_WHEELS[version]
    dest = nccl_path(version)
    if dest.is_file():
        return dest
    wheels = cache_dir() / "wheels"
    wheel = _wheel_for(wheels, project, version) or _download(wheels, project, version, timeout)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".libnccl.so.2.{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(WHEEL_MEMBER) as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        tmp.unlink(missing_ok=True)
        raise PartUnavailable(
            f"{wheel}: not a usable NCCL wheel ({e}); delete it and retry") from None
    os.replace(tmp, dest)
    return dest


_PLUGIN_TYPE = "typedef struct { const char *name; void *fn[16]; } ncclguard_plugin_t;\n"


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def plugin_source(exports: Sequence[tuple[str, str]], reloc: str = "relative",
                  writable: bool = False) -> str:
    """C source exporting one struct per (symbol, name); the name is the first field."""
    lines = [_PLUGIN_TYPE]
    qual = "" if writable else "const "
    for i, (symbol, name) in enumerate(exports):
        if reloc == "symbol":  # a pointer to an exported string: R_X86_64_64 against it
            lines.append(f"const char ncclguard_name_{i}[] = {_c_string(name)};")
            init = f"ncclguard_name_{i}"
        else:  # a string literal: R_X86_64_RELATIVE
            init = _c_string(name)
        lines.append(f'__attribute__((visibility("default"))) {qual}ncclguard_plugin_t '
                     f"{symbol} = {{ {init}, {{0}} }};")
    return "\n".join(lines) + "\n"


def build_plugin(
    out_dir: Path,
    net_abis: Sequence[int] = (),
    name: str = "testnet",
    *,
    tuner_abis: Sequence[int] = (),
    collnet: Sequence[int] = (),
    profiler_abis: Sequence[int] = (),
    env_abis: Sequence[int] = (),
    gin_abis: Sequence[int] = (),
    rma_abis: Sequence[int] = (),
    collnet_name: str = "testcoll",
    tuner_name: str = "testtuner",
    profiler_name: str = "testprof",
    env_name: str = "testenv",
    gin_name: str = "testgin",
    rma_name: str = "testrma",
    filename: str = "libnccl-net.so",
    reloc: str = "relative",
    writable: bool = False,
    executable: bool = False,
) -> Path:
    """Compile a plugin with gcc; raises :class:`PartUnavailable` without gcc.

    ``reloc``: "relative" (a string literal), "symbol" (an exported string), "relr" (packed
    relative relocations; :class:`PartUnavailable` if the linker cannot).
    ``executable``: a non-PIE executable exporting the structs (``-rdynamic``).
    """
    gcc = shutil.which("gcc")
    if gcc is None:
        raise PartUnavailable("gcc is not installed (apt-get install gcc)")
    exports = [(f"ncclNetPlugin_v{v}", name) for v in net_abis]
    exports += [(f"ncclCollNetPlugin_v{v}", collnet_name) for v in collnet]
    exports += [(f"ncclTunerPlugin_v{v}", tuner_name) for v in tuner_abis]
    exports += [(f"ncclProfiler_v{v}", profiler_name) for v in profiler_abis]
    exports += [(f"ncclEnvPlugin_v{v}", env_name) for v in env_abis]
    exports += [(f"ncclGinPlugin_v{v}", gin_name) for v in gin_abis]
    exports += [(f"ncclRmaPlugin_v{v}", rma_name) for v in rma_abis]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / (filename + ".c")
    body = plugin_source(exports, reloc, writable)
    if executable:
        body += "int main(void) { return 0; }\n"
    src.write_text(body)
    out = out_dir / filename
    if executable:
        cmd = [gcc, "-O1", "-no-pie", "-fno-pie", "-rdynamic", "-o", str(out), str(src)]
    else:
        cmd = [gcc, "-O1", "-shared", "-fPIC", "-o", str(out), str(src)]
        if reloc == "relr":
            cmd.insert(1, "-Wl,-z,pack-relative-relocs")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        if reloc == "relr":
            raise PartUnavailable(f"this linker cannot pack relative relocations: "
                                  f"{r.stderr.strip()}")
        raise RuntimeError(f"gcc failed: {r.stderr.strip()}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m devtools.ncclwheels fetch``: have every NCCL of :data:`NCCL_WHEELS` in
    the cache (scripts/test.sh runs it before the tests). Exit 2 naming the part that
    cannot be had."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args != ["fetch"]:
        print("usage: python -m devtools.ncclwheels fetch", file=sys.stderr)
        return 2
    for version, project in NCCL_WHEELS.items():
        try:
            path = extract_nccl(version)
        except PartUnavailable as e:
            print(f"ncclwheels: the real part libnccl.so.2 {version} ({project}=={version}) "
                  f"cannot be had: {e}", file=sys.stderr)
            return 2
        print(f"NCCL {version}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
