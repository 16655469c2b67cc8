"""libnccl probe on real NCCL libraries from the PyPI wheels (see conftest.nccl_lib)."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.ncclfacts import FACTS
from helpers.parts import place, run_ldconfig

from inventoryd.filecache import FileCache
from inventoryd.nodefs import ErrorLog, NodeFS
from inventoryd.probes import nccl
from ncclguard.config import InventorydConfig

MULTIARCH = "/usr/lib/x86_64-linux-gnu"

def test_the_facts_cover_every_release_the_tests_use() -> None:
    """The sweep below runs on every wheel of devtools.ncclwheels.NCCL_WHEELS, and only
    those: a release added there for a test is added here too."""
    from devtools.ncclwheels import NCCL_WHEELS

    assert sorted(FACTS) == sorted(NCCL_WHEELS)


@pytest.fixture(scope="module")
def analyzed(nccl_lib: Callable[[str], Path]) -> Callable[[str], dict[str, Any]]:
    memo: dict[str, dict[str, Any]] = {}

    def get(version: str) -> dict[str, Any]:
        if version not in memo:
            path = nccl_lib(version)
            with open(path, "rb") as f:
                memo[version] = nccl.analyze(f, str(path))
        return memo[version]

    return get


@pytest.mark.parametrize("version", sorted(FACTS))
def test_real_library_matches_the_facts(version: str, analyzed, nccl_lib) -> None:
    got = analyzed(version)
    want = FACTS[version]
    assert got["version"] == version
    assert got["version_code"] == want["code"]
    assert got["cuda_version"] == want["cuda"]
    assert got["version_source"] == "banner" and got["version_error"] is None
    assert got["abis"] == {"net": want["net"], "collnet": want["net"],
                           "tuner": want["tuner"], "profiler": want["profiler"],
                           "env": want["env"], "gin": want["gin"], "rma": want["rma"]}
    path = nccl_lib(version)
    assert got["size"] == path.stat().st_size
    with open(path, "rb") as f:
        assert got["sha256"] == hashlib.file_digest(f, "sha256").hexdigest()


@pytest.mark.parametrize("version", sorted(FACTS))
def test_ncclgetversion_subprocess_agrees(version: str, nccl_lib) -> None:
    assert nccl.nccl_get_version(str(nccl_lib(version))) == FACTS[version]["code"]


def test_ncclgetversion_failure_is_an_error(tmp_path: Path) -> None:
    bogus = tmp_path / "libnccl.so.2"
    bogus.write_bytes(b"not a library")
    with pytest.raises(RuntimeError, match="loading failed"):
        nccl.nccl_get_version(str(bogus))


@pytest.mark.parametrize(
    ("v", "code"), [((2, 8, 4), 2804), ((2, 9, 6), 20906), ((2, 21, 5), 22105),
                    ((2, 3, 5), 2305), ((3, 0, 1), 30001)])
def test_version_code_schemes(v: tuple[int, int, int], code: int) -> None:
    assert nccl.version_code(*v) == code
    assert nccl.version_from_code(code) == ".".join(map(str, v))


def _scan(data: bytes) -> dict[str, Any]:
    return nccl.scan(io.BytesIO(data))


def test_scan_finds_strings_across_chunk_boundaries() -> None:
    for cut in (3, 13, 20, 27):
        banner = b"NCCL version 2.19.3+cuda12.10\0"
        pad = b"\xff" * (nccl.CHUNK - cut)
        got = _scan(pad + banner + b"\0ncclNetPlugin_v7\0" + b"\xff" * 100)
        assert got["banner"] == (2, 19, 3, 12, 10), cut
        assert got["abis"]["net"] == [7]
    # a plugin literal cut by the chunk boundary, and the very end of the file
    got = _scan(b"\xff" * (nccl.CHUNK - 5) + b"\0ncclCollNetPlugin_v12\0NCCL version 2.3.5+cuda9.2")
    assert got["abis"]["collnet"] == [12]
    assert got["banner"] == (2, 3, 5, 9, 2)


def test_scan_counts_only_whole_literals() -> None:
    data = (b"\0_ZL15ncclProfiler_v1\0" b"17ncclProfiler_v2_t\0" b"ncclNetPlugin_v9x\0"
            b"ncclNetPlugin_v81234567\0" b"\0Failed to find ncclNetPlugin_v6\0"
            b"\0ncclTunerPlugin_v3\0" b"NCCL git version master 0123abcd\0"
            b"\0ncclGinPlugin_v14\0" b"_ZL16ncclRmaPlugin_v16\0" b"\0ncclEnvPlugin_v2\0")
    got = _scan(data)
    # tail-merged "... ncclNetPlugin_v6" is still the dlsym literal; "v9x" and a run of
    # digits are not an ABI literal; mangled names and type names do not count
    assert got["abis"] == {"net": [6], "collnet": [], "tuner": [3], "profiler": [],
                           "env": [2], "gin": [14], "rma": []}
    assert got["git"] == "master 0123abcd"
    assert got["banner"] is None


def _root_with(tmp_path: Path, nccl_lib, layout: dict[str, str]) -> Path:
    root = tmp_path / "root"
    for node_path, version in layout.items():
        place(root, node_path, nccl_lib(version))
    return root


def test_probe_finds_linker_and_configured_libraries(tmp_path: Path, nccl_lib) -> None:
    root = _root_with(tmp_path, nccl_lib, {
        f"{MULTIARCH}/libnccl.so.2.21.5": "2.21.5",
        "/opt/conda/envs/torch/lib/libnccl.so.2": "2.18.3",
    })
    (root / "etc").mkdir(parents=True, exist_ok=True)
    run_ldconfig(root)  # creates libnccl.so.2 -> libnccl.so.2.21.5 and the cache entry
    assert (root / MULTIARCH.lstrip("/") / "libnccl.so.2").is_symlink()
    cfg = InventorydConfig(nccl_search_paths=("/opt/conda/envs/*/lib", "/opt/none/*"))
    errors = ErrorLog()
    cache = FileCache(None)
    libs = nccl.probe(NodeFS(root), errors, cfg, cache)
    assert errors.entries == []
    assert [x["path"] for x in libs] == [
        "/opt/conda/envs/torch/lib/libnccl.so.2",
        f"{MULTIARCH}/libnccl.so.2",
        f"{MULTIARCH}/libnccl.so.2.21.5",
    ]
    by = {x["path"]: x for x in libs}
    default = by[f"{MULTIARCH}/libnccl.so.2"]
    assert default["default"] is True and default["origin"] == "linker"
    assert default["realpath"] == f"{MULTIARCH}/libnccl.so.2.21.5"
    assert default["version"] == "2.21.5" and default["cuda_version"] == "11.0"
    conda = by["/opt/conda/envs/torch/lib/libnccl.so.2"]
    assert conda["default"] is False and conda["origin"] == "config"
    assert conda["version"] == "2.18.3" and conda["abis"]["net"] == [6, 5, 4]
    assert sum(x["default"] for x in libs) == 1
    # one file behind two names is read once
    assert cache.misses == 2 and cache.hits == 1


def test_default_from_standard_dir_without_cache(tmp_path: Path, nccl_lib) -> None:
    root = _root_with(tmp_path, nccl_lib, {"/usr/lib64/libnccl.so.2": "2.26.2"})
    libs = nccl.probe(NodeFS(root), ErrorLog(), InventorydConfig(), FileCache(None))
    assert [(x["path"], x["default"], x["version"]) for x in libs] == [
        ("/usr/lib64/libnccl.so.2", True, "2.26.2")]


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar")


def test_warm_run_reads_nothing_large(tmp_path: Path, nccl_lib) -> None:
    root = _root_with(tmp_path, nccl_lib, {f"{MULTIARCH}/libnccl.so.2": "2.21.5"})
    store = tmp_path / "cache" / "filecache.json"
    fs, cfg = NodeFS(root), InventorydConfig()
    size = (root / MULTIARCH.lstrip("/") / "libnccl.so.2").stat().st_size
    before = _rchar()
    cold_cache = FileCache(store)
    cold = nccl.probe(fs, ErrorLog(), cfg, cold_cache)
    assert cold_cache.save() is None
    cold_read = _rchar() - before
    before = _rchar()
    warm_cache = FileCache(store)  # a new process would load it the same way
    warm = nccl.probe(fs, ErrorLog(), cfg, warm_cache)
    warm_read = _rchar() - before
    assert warm == cold
    assert warm_cache.hits == 1 and warm_cache.misses == 0
    assert cold_read >= size
    assert warm_read < 1024 * 1024
    # a replaced file (new inode, size, mtime) is read again, never served stale
    place(root, f"{MULTIARCH}/libnccl.so.2", nccl_lib("2.18.3"))
    again = FileCache(store)
    assert nccl.probe(fs, ErrorLog(), cfg, again)[0]["version"] == "2.18.3"
    assert again.misses == 1 and again.hits == 0


def test_ncclgetversion_option_cross_checks(tmp_path: Path, nccl_lib) -> None:
    root = _root_with(tmp_path, nccl_lib, {f"{MULTIARCH}/libnccl.so.2": "2.21.5"})
    errors = ErrorLog()
    cfg = InventorydConfig(ncclgetversion=True)
    libs = nccl.probe(NodeFS(root), errors, cfg, FileCache(None))
    assert errors.entries == []
    assert libs[0]["version_code"] == 22105 and libs[0]["version_source"] == "banner"


def test_scan_skips_device_code_but_hashes_it() -> None:
    pad = b"\xff" * nccl.CHUNK
    data = b"\0ncclNetPlugin_v5\0" + pad + pad + b"\0ncclNetPlugin_v9\0" + pad + pad
    skipped = nccl.scan(io.BytesIO(data), [(nccl.CHUNK, 3 * nccl.CHUNK)])
    whole = nccl.scan(io.BytesIO(data))
    assert whole["abis"]["net"] == [9, 5]
    assert skipped["abis"]["net"] == [5]  # v9 lies wholly inside the skipped chunks
    assert skipped["sha256"] == whole["sha256"] == hashlib.sha256(data).hexdigest()
    assert skipped["size"] == len(data)


def test_ncclgetversion_never_loads_a_library_others_control(tmp_path: Path) -> None:
    """Issue 12: with ``ncclgetversion = true`` a ``libnccl.so.2`` in a user's conda env
    ran its constructor in the daemon's process tree. Only a file whose whole path is
    root's and writable by no one else is loaded now."""
    import os

    from helpers.parts import build_shared_lib

    marker = tmp_path / "ran"
    body = (
        "#include <stdio.h>\n"
        "__attribute__((constructor)) static void pwn(void) {\n"
        f'  FILE *f = fopen("{marker}", "a"); if (f) {{ fputs("x", f); fclose(f); }}\n'
        "}\n"
        "int ncclGetVersion(int *v) { *v = 22105; return 0; }\n"
    )
    root = tmp_path / "node"
    conda = root / "home" / "alice" / "conda" / "lib"
    lib = build_shared_lib(conda / "libnccl.so.2", soname="libnccl.so.2", body=body)
    os.chown(root / "home" / "alice", 1000, 1000)  # the user's own tree
    cfg = InventorydConfig(ncclgetversion=True, nccl_search_paths=("/home/alice/conda/lib",))
    errors = ErrorLog()
    libs = nccl.probe(NodeFS(root), errors, cfg, FileCache(None))
    assert [x["path"] for x in libs] == ["/home/alice/conda/lib/libnccl.so.2"]
    assert not marker.exists()  # its code never ran
    (msg,) = [e["error"] for e in errors.entries if e["field"] == "libnccl.version"]
    assert msg == "ncclGetVersion not called: /home/alice is owned by uid 1000, not root"
    # the same file where only root can write: loaded (so the test's library does run)
    os.chown(root / "home" / "alice", 0, 0)
    os.chmod(lib, 0o666)
    errors = ErrorLog()
    nccl.probe(NodeFS(root), errors, cfg, FileCache(None))
    assert not marker.exists()
    assert "libnccl.so.2 is writable by others" in errors.entries[-1]["error"]
    os.chmod(lib, 0o644)
    errors = ErrorLog()
    got = nccl.probe(NodeFS(root), errors, cfg, FileCache(None))
    assert marker.exists() and got[0]["version_code"] == 22105
