"""Shared fixtures: real NCCL libraries from PyPI wheels, gcc-built plugins, node root trees.

- ``nccl_lib(version)`` -> path of a real ``libnccl.so.2``, extracted once from the
  ``nvidia-nccl-cu11``/``-cu12`` wheel into ``~/.cache/ncclguard/nccl/<pkg>-<ver>/``.
  A missing wheel is fetched with ``pip download --no-deps --only-binary=:all:`` into
  ``~/.cache/ncclguard/wheels`` (``$NCCLGUARD_TEST_CACHE`` moves both); without network
  the test is skipped with the reason.
- ``compile_plugin(tmp_path, net_abis=[...], name=..., ...)`` -> a ``.so`` built by gcc
  from a tiny C file that exports the chosen ``ncclNetPlugin_vN`` (etc.) structs, each
  starting with its name string.
- ``place(root, node_path, src)`` -> put a file into a root tree by hardlink (copy if
  the hardlink is refused), creating the directories.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("NCCLGUARD_TEST_CACHE") or Path.home() / ".cache" / "ncclguard")
WHEELS = CACHE / "wheels"
LIBS = CACHE / "nccl"
WHEEL_MEMBER = "nvidia/nccl/lib/libnccl.so.2"

# version -> PyPI project. Facts (docs/nccl-facts.md), checked on these very files.
NCCL_WHEELS: dict[str, str] = {
    "2.18.3": "nvidia-nccl-cu12",
    "2.21.5": "nvidia-nccl-cu11",
    "2.26.2": "nvidia-nccl-cu12",
}


def _wheel_for(project: str, version: str) -> Path | None:
    stem = project.replace("-", "_")
    found = sorted(WHEELS.glob(f"{stem}-{version}-*.whl"))
    return found[0] if found else None


def _download(project: str, version: str) -> Path:
    WHEELS.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--dest", str(WHEELS), f"{project}=={version}"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip download {project}=={version} timed out (no network?)")
    wheel = _wheel_for(project, version)
    if r.returncode != 0 or wheel is None:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        pytest.skip(f"cannot download {project}=={version} (no network?): {tail[0]}")
    return wheel


def extract_nccl(version: str) -> Path:
    project = NCCL_WHEELS[version]
    dest = LIBS / f"{project.replace('-', '_')}-{version}" / "libnccl.so.2"
    if dest.is_file():
        return dest
    wheel = _wheel_for(project, version) or _download(project, version)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".libnccl.so.2.{os.getpid()}")
    with zipfile.ZipFile(wheel) as z, z.open(WHEEL_MEMBER) as src, open(tmp, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    os.replace(tmp, dest)
    return dest


@pytest.fixture(scope="session")
def nccl_lib() -> Callable[[str], Path]:
    """``nccl_lib("2.21.5")`` -> Path of that real libnccl.so.2 (skips if not obtainable)."""
    return extract_nccl


def place(root: Path, node_path: str, src: Path) -> Path:
    """Put ``src`` at ``node_path`` inside ``root`` (hardlink, else copy); returns the path."""
    dest = root / node_path.lstrip("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists() or dest.is_symlink():
        dest.unlink()
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)
    return dest


@pytest.fixture
def place_file() -> Callable[[Path, str, Path], Path]:
    return place


_PLUGIN_TYPE = "typedef struct { const char *name; void *fn[16]; } ncclguard_test_plugin_t;\n"


def _c_source(
    exports: Sequence[tuple[str, str]], reloc: str, writable: bool
) -> str:
    lines = [_PLUGIN_TYPE]
    qual = "" if writable else "const "
    for i, (symbol, name) in enumerate(exports):
        literal = '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if reloc == "symbol":
            # a pointer to an exported string: an R_X86_64_64 against that symbol
            lines.append(f"const char ncclguard_name_{i}[] = {literal};")
            init = f"ncclguard_name_{i}"
        else:
            init = literal
        lines.append(
            f"__attribute__((visibility(\"default\"))) {qual}ncclguard_test_plugin_t "
            f"{symbol} = {{ {init}, {{0}} }};"
        )
    return "\n".join(lines) + "\n"


def build_plugin(
    out_dir: Path,
    net_abis: Sequence[int] = (),
    name: str = "testnet",
    tuner_abis: Sequence[int] = (),
    collnet: Sequence[int] = (),
    profiler_abis: Sequence[int] = (),
    collnet_name: str = "testcoll",
    tuner_name: str = "testtuner",
    profiler_name: str = "testprof",
    filename: str = "libnccl-net.so",
    reloc: str = "relative",
    writable: bool = False,
    executable: bool = False,
) -> Path:
    """Compile a plugin with gcc. ``reloc``: "relative" (a string literal: R_X86_64_RELATIVE),
    "symbol" (an exported string: R_X86_64_64), "relr" (packed relative relocations).
    ``executable``: a non-PIE executable exporting the structs (-rdynamic)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    exports = [(f"ncclNetPlugin_v{v}", name) for v in net_abis]
    exports += [(f"ncclCollNetPlugin_v{v}", collnet_name) for v in collnet]
    exports += [(f"ncclTunerPlugin_v{v}", tuner_name) for v in tuner_abis]
    exports += [(f"ncclProfiler_v{v}", profiler_name) for v in profiler_abis]
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / (filename + ".c")
    body = _c_source(exports, reloc, writable)
    if executable:
        body += "int main(void) { return 0; }\n"
    src.write_text(body)
    out = out_dir / filename
    if executable:
        cmd = ["gcc", "-O1", "-no-pie", "-fno-pie", "-rdynamic", "-o", str(out), str(src)]
    else:
        cmd = ["gcc", "-O1", "-shared", "-fPIC", "-o", str(out), str(src)]
        if reloc == "relr":
            cmd.insert(1, "-Wl,-z,pack-relative-relocs")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        if reloc == "relr":
            pytest.skip(f"this linker cannot pack relative relocations: {r.stderr.strip()}")
        raise AssertionError(f"gcc failed: {r.stderr}")
    return out


@pytest.fixture
def compile_plugin() -> Callable[..., Path]:
    """``compile_plugin(tmp_path, net_abis=[8, 7], name="IBext_v8", ...)`` -> .so path."""
    return build_plugin


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private inventoryd file cache for one test ($NCCLGUARD_CACHE_DIR)."""
    d = tmp_path / "filecache"
    monkeypatch.setenv("NCCLGUARD_CACHE_DIR", str(d))
    yield d


def run_ldconfig(root: Path) -> Path:
    """Let the real ``ldconfig -r root`` build ``<root>/etc/ld.so.cache`` (and soname links)
    from ``<root>/etc/ld.so.conf``; returns the cache path."""
    exe = shutil.which("ldconfig") or "/sbin/ldconfig"
    if not Path(exe).exists():
        pytest.skip("ldconfig is not installed")
    (root / "etc").mkdir(parents=True, exist_ok=True)
    conf = root / "etc" / "ld.so.conf"
    if not conf.exists():
        conf.write_text("")
    r = subprocess.run([exe, "-r", str(root)], capture_output=True, text=True, timeout=120)
    cache = root / "etc" / "ld.so.cache"
    if r.returncode != 0 or not cache.is_file():
        raise AssertionError(f"ldconfig -r {root} failed: {r.stderr}")
    return cache


def build_shared_lib(out: Path, soname: str | None = None, body: str = "int x = 1;\n") -> Path:
    """A tiny real shared object (gcc), optionally with a SONAME."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_name(out.name + ".c")
    src.write_text(body)
    cmd = ["gcc", "-shared", "-fPIC", "-o", str(out), str(src)]
    if soname:
        cmd.insert(1, f"-Wl,-soname,{soname}")
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    src.unlink()
    return out


# The Slurm fixtures live in their own module (another engineer's); re-exported here so
# that every test module sees them.
from conftest_slurm import cluster, slurm_cluster  # noqa: E402, F401
