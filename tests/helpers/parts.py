"""Real parts for the tests and benchmarks: NCCL libraries from PyPI wheels, gcc-built
plugins and shared objects, ``ldconfig`` caches, a copy of the checkout; the fixtures that
hand them out (a plugin of tests/conftest.py).

- ``nccl_lib(version)`` -> path of a real ``libnccl.so.2``, extracted once from the
  ``nvidia-nccl-cu11``/``-cu12`` wheel into ``~/.cache/ncclguard/nccl/<pkg>-<ver>/``.
  A missing wheel is fetched with ``pip download --no-deps --only-binary=:all:`` into
  ``~/.cache/ncclguard/wheels`` (``$NCCLGUARD_TEST_CACHE`` moves both); without network
  the test is skipped with the reason, or fails under ``NCCLGUARD_REQUIRE_PARTS=1`` (CI).
- ``compile_plugin(tmp_path, net_abis=[...], name=..., ...)`` -> a ``.so`` built by gcc
  from a tiny C file that exports the chosen ``ncclNetPlugin_vN`` (etc.) structs, each
  starting with its name string.
- ``place(root, node_path, src)`` -> put a file into a root tree by hardlink (copy if
  the hardlink is refused), creating the directories. The hardlink is the cache's own
  file: a test that changes its mode or owner fails (``_cached_libs_unchanged``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import pytest

from devtools import images, ncclwheels
from devtools.ncclwheels import PartUnavailable
from helpers import REPO

# The real parts (NCCL wheels, gcc-built plugins) come from devtools.ncclwheels, which
# the demo uses too. A part that cannot be had is a skip that says why, except where
# NCCLGUARD_REQUIRE_PARTS=1 (scripts/test.sh, so CI): there it fails the test (and any
# skip at all fails the run: tests/conftest.py).
REQUIRE_PARTS = os.environ.get("NCCLGUARD_REQUIRE_PARTS") == "1"


def unavailable(why: str) -> NoReturn:
    """Skip for want of a real part, or fail under NCCLGUARD_REQUIRE_PARTS=1."""
    if REQUIRE_PARTS:
        pytest.fail(f"{why} (NCCLGUARD_REQUIRE_PARTS=1: a missing part fails the run)",
                    pytrace=False)  # fmt: skip
    pytest.skip(why)


def extract_nccl(version: str) -> Path:
    """The path of a real ``libnccl.so.2`` of ``version`` (downloaded and cached once)."""
    try:
        return ncclwheels.extract_nccl(version)
    except PartUnavailable as e:
        unavailable(str(e))


@pytest.fixture(scope="session")
def nccl_lib() -> Callable[[str], Path]:
    """``nccl_lib("2.21.5")`` -> Path of that real libnccl.so.2 (skips if not obtainable)."""
    return extract_nccl


def _cached_libs() -> dict[Path, tuple[int, int, int]]:
    """Mode, owner and group of each cached real libnccl (a few stats)."""
    out = {}
    for lib in (ncclwheels.cache_dir() / "nccl").glob("*/libnccl.so.2"):
        try:
            st = lib.stat()
        except OSError:
            continue
        out[lib] = (st.st_mode & 0o7777, st.st_uid, st.st_gid)
    return out


@pytest.fixture(autouse=True)
def _cached_libs_unchanged() -> Iterator[None]:
    """The cached real libraries reach node trees by hardlink (:func:`place`): a test that
    chmods or chowns its "copy" changes the one file every later test places (CI of stop
    50: a 0600 libnccl 2.21.5 left by tests/test_jobenv_index.py made the install guide's
    second node unreadable to its daemon). Such a test fails here, named, and the
    file's mode and owner are put back."""
    before = _cached_libs()
    yield
    changed = {p: (was, now) for p, now in _cached_libs().items()
               if (was := before.get(p)) is not None and was != now}
    for p, (was, _now) in changed.items():
        os.chown(p, was[1], was[2])
        os.chmod(p, was[0])
    if changed:
        pytest.fail("this test changed a cached real library shared by hardlink (copy it "
                    "before chmod or chown): " + ", ".join(
                        f"{p}: mode {oct(w[0])} uid {w[1]} -> mode {oct(n[0])} uid {n[1]}"
                        for p, (w, n) in changed.items()), pytrace=False)


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


def build_plugin(out_dir: Path, net_abis: Sequence[int] = (), name: str = "testnet",
                 **options: Any) -> Path:
    """Compile a plugin with gcc (see :func:`devtools.ncclwheels.build_plugin`)."""
    try:
        return ncclwheels.build_plugin(out_dir, net_abis, name, **options)
    except PartUnavailable as e:
        unavailable(str(e))


def pyxis_plugstack(root: Path) -> Path:
    """A ``plugstack.conf`` under ``root`` that loads the pyxis stub
    (:func:`devtools.images.build_pyxis_stub`, compiled with gcc): slurm.conf's
    ``PlugStackConfig=`` for a cluster whose jobs take pyxis's options."""
    try:
        stub = images.build_pyxis_stub(root / "spank")
    except PartUnavailable as e:
        unavailable(str(e))
    plugstack = root / "plugstack.conf"
    plugstack.write_text(f"required {stub}\n")
    return plugstack


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
        unavailable("ldconfig is not installed")
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
        unavailable("gcc is not installed")
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_name(out.name + ".c")
    src.write_text(body)
    cmd = ["gcc", "-shared", "-fPIC", "-o", str(out), str(src)]
    if soname:
        cmd.insert(1, f"-Wl,-soname,{soname}")
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    src.unlink()
    return out


def checkout_copy(dest: Path) -> Path:
    """The working tree's tracked and unignored files, as a fresh checkout would have them."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, check=True, timeout=60).stdout.split(b"\0")
    for f in filter(None, (x.decode() for x in files)):
        src, dst = REPO / f, dest / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():  # the sysfs fixtures are links, some on purpose unreadable
            dst.symlink_to(os.readlink(src))
        elif src.is_file():
            shutil.copy2(src, dst)
    return dest


@pytest.fixture(scope="session")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``venv("2.18.3")``: a virtualenv with pip's nvidia-nccl wheel of that release."""
    made: dict[str, Path] = {}

    def make(version: str) -> Path:
        if version not in made:
            extract_nccl(version)  # the wheel is cached (or the test skips/fails)
            project = ncclwheels.NCCL_WHEELS[version]
            dest = tmp_path_factory.mktemp(f"venv-{version}")
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)],
                           check=True, timeout=120)
            subprocess.run([sys.executable, "-m", "pip", "--python", str(dest / "bin/python"),
                            "install", "-q", "--no-deps", "--no-index", "--find-links",
                            str(ncclwheels.cache_dir() / "wheels"), f"{project}=={version}"],
                           check=True, timeout=600)
            made[version] = dest
        return made[version]

    return make


@pytest.fixture
def world() -> Iterator[Path]:
    """A directory every uid may enter (``tmp_path`` sits under a 0700 directory of
    root's): what a job's uid and the unprivileged collector may read is put here."""
    d = Path(tempfile.mkdtemp(prefix="ncclguard-world-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)
