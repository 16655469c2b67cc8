"""Plugin probe: gcc-built net/tuner plugins against real NCCL libraries."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.parts import build_plugin, place, run_ldconfig

from inventoryd.elf import ElfReader
from inventoryd.filecache import FileCache
from inventoryd.nodefs import ErrorLog, NodeFS
from inventoryd.probes import nccl, plugins
from ncclguard.config import InventorydConfig
from ncclguard.fingerprint.abi import exported, highest_common

MULTIARCH = "/usr/lib/x86_64-linux-gnu"


@pytest.fixture(scope="module")
def real_lib(nccl_lib: Callable[[str], Path]) -> Callable[[str], dict[str, Any]]:
    """The libnccl record of a real library, as the nccl probe makes it (default)."""
    memo: dict[str, dict[str, Any]] = {}

    def get(version: str) -> dict[str, Any]:
        if version not in memo:
            path = nccl_lib(version)
            with open(path, "rb") as f:
                facts = nccl.analyze(f, str(path))
            memo[version] = {"path": f"{MULTIARCH}/libnccl.so.2", "realpath": None, **facts,
                             "default": True, "origin": "linker"}
        return dict(memo[version])

    return get


def _probe(
    root: Path, lib: dict[str, Any] | None, settings: dict[str, str] | None = None,
    config: InventorydConfig | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any], ErrorLog]:
    errors = ErrorLog()
    got = plugins.probe(NodeFS(root), errors, config or InventorydConfig(), settings or {},
                        [lib] if lib else [], FileCache(None))
    return got[0], got[1], errors


@pytest.mark.parametrize(
    ("reloc", "executable", "writable"),
    [("relative", False, False), ("symbol", False, False), ("relr", False, False),
     ("relative", False, True), ("relative", True, False)],
)
def test_exports_and_names(tmp_path: Path, reloc: str, executable: bool, writable: bool) -> None:
    so = build_plugin(tmp_path, net_abis=[8, 7], name="IBext_v8", collnet=[8],
                      collnet_name="SHARP", tuner_abis=[2], tuner_name="ExtTuner",
                      profiler_abis=[1], reloc=reloc, executable=executable, writable=writable)
    with open(so, "rb") as f:
        facts = plugins.analyze(f, "/x/libnccl-net.so")
    assert facts["error"] is None
    assert facts["abis"] == {"net": [8, 7], "collnet": [8], "tuner": [2], "profiler": [1],
                            "env": [], "gin": [], "rma": []}
    assert facts["names"] == {"net": "IBext_v8", "collnet": "SHARP", "tuner": "ExtTuner",
                              "profiler": "testprof"}


def test_abis_of_2_32_and_after(tmp_path: Path) -> None:
    """The ABIs 2.32.3 added (RMA v16, v15: rma.cc at NVIDIA/nccl 12df1a11) and those the
    2.32.6 wheel looks up beyond it (GIN v15, profiler v8, RMA v17, tuner v7) are read from
    the plugin's symbols like any other: no list of known versions to extend."""
    so = build_plugin(tmp_path, rma_abis=[17, 16, 15], rma_name="NewRma", gin_abis=[15, 13],
                      gin_name="NewGin", tuner_abis=[7], profiler_abis=[8],
                      filename="libnccl-rma.so")
    with open(so, "rb") as f:
        facts = plugins.analyze(f, "/x/libnccl-rma.so")
    assert facts["error"] is None
    assert facts["abis"] == {"net": [], "collnet": [], "tuner": [7], "profiler": [8],
                             "env": [], "gin": [15, 13], "rma": [17, 16, 15]}
    assert facts["names"]["rma"] == "NewRma" and facts["names"]["gin"] == "NewGin"
    # RMA v13 from GIN v13 (rma_v13.cc v2.30.7-1, v2.31.2-1): 2.32.3 (v16..v13) uses v16
    assert exported(facts["abis"], "rma") == [17, 16, 15, 13]
    assert highest_common([16, 15, 14, 13], exported(facts["abis"], "rma")) == 16


def test_name_of_the_highest_abi(tmp_path: Path) -> None:
    src = build_plugin(tmp_path / "a", net_abis=[7], name="old")
    with open(src, "rb") as f:
        elf = ElfReader(f, str(src))
        sym = elf.exported()["ncclNetPlugin_v7"]
        assert elf.pointed_string(sym.value) == "old"
        assert elf.pointed_string(sym.value + 8) is None  # a NULL function pointer


# (plugin ABIs, {libnccl version: effective ABI or None})
MATRIX = [
    ([8, 7], {"2.18.3": None, "2.21.5": 8, "2.26.2": 8}),
    ([10, 9], {"2.18.3": None, "2.21.5": None, "2.26.2": 10}),
    ([6, 5], {"2.18.3": 6, "2.21.5": 6, "2.26.2": 6}),
    ([4], {"2.18.3": 4, "2.21.5": None, "2.26.2": None}),
    ([12, 11], {"2.18.3": None, "2.21.5": None, "2.26.2": None}),
]


@pytest.mark.parametrize(("abis", "expect"), MATRIX)
def test_effective_net_abi_against_real_libraries(
    tmp_path: Path, real_lib, abis: list[int], expect: dict[str, int | None]
) -> None:
    so = build_plugin(tmp_path / "build", net_abis=abis, name=f"net{abis[0]}")
    root = tmp_path / "root"
    place(root, f"{MULTIARCH}/libnccl-net.so", so)
    for version, effective in expect.items():
        lib = real_lib(version)
        recs, net, errors = _probe(root, lib)
        assert errors.entries == []
        assert [(r["kind"], r["path"], r["default"], r["origin"]) for r in recs] == [
            ("net", f"{MULTIARCH}/libnccl-net.so", True, "linker")]
        assert recs[0]["name"] == f"net{abis[0]}"
        assert net["libnccl"] == lib["path"] and net["plugin"] == f"{MULTIARCH}/libnccl-net.so"
        assert net["effective_net_abi"] == effective, version
        if effective is None:
            assert net["reason"].startswith("no common ABI")
            assert "v" + str(abis[0]) in net["reason"]
        else:
            assert net["reason"] is None


def test_no_plugin_and_no_library(tmp_path: Path, real_lib) -> None:
    recs, net, _ = _probe(tmp_path, real_lib("2.21.5"))
    assert recs == []
    assert net["plugin"] is None and net["effective_net_abi"] is None
    assert net["reason"].startswith("no net plugin (libnccl-net.so")
    so = build_plugin(tmp_path / "b", net_abis=[8])
    place(tmp_path / "r", f"{MULTIARCH}/libnccl-net.so", so)
    _, net, _ = _probe(tmp_path / "r", None)
    assert net["libnccl"] is None and net["effective_net_abi"] is None
    assert "no default libnccl" in net["reason"]


@pytest.mark.parametrize(
    ("value", "version", "groups"),
    [
        (None, (2, 21, 5), [["libnccl-net.so"]]),
        ("", (2, 26, 2), [["libnccl-net.so"]]),
        # 2.27 on, set but empty is a list of no item: no external plugin (net.cc at
        # v2.27.3-1, v2.30.7-1: strtok_r of ""); it was the default before issue 28
        ("", (2, 28, 3), []),
        ("ofi", (2, 10, 3), [["libnccl-net.so"]]),
        ("ofi", (2, 11, 4), [["libnccl-net-ofi.so"]]),
        ("ofi", (2, 20, 5), [["libnccl-net-ofi.so"]]),
        ("ofi", (2, 21, 5), [["ofi", "libnccl-net-ofi.so"]]),
        ("/opt/x/libp.so", (2, 26, 2), [["/opt/x/libp.so", "libnccl-net-/opt/x/libp.so.so"]]),
        ("a,b", (2, 26, 2), [["a,b", "libnccl-net-a,b.so"]]),
        # 2.27.3 (plugin_open.cc at v2.27.3-1): a lib*.so name as given only, any other
        # only as libnccl-net-X.so
        ("a,b", (2, 27, 3), [["libnccl-net-a.so"], ["libnccl-net-b.so"]]),
        ("none", (2, 27, 3), [["libnccl-net-none.so"]]),
        ("libp.so,b", (2, 27, 3), [["libp.so"], ["libnccl-net-b.so"]]),
        # 2.27.5 on: the second try is skipped for a path or a lib*.so name
        ("a,/opt/x/libp.so", (2, 27, 7), [["a", "libnccl-net-a.so"], ["/opt/x/libp.so"]]),
        ("libp.so", (2, 30, 7), [["libp.so"]]),
        ("none", (2, 28, 3), []),
        ("NONE", (2, 29, 1), []),
        ("ofi", None, [["ofi", "libnccl-net-ofi.so"]]),
    ],
)
def test_net_plugin_name_rules_per_era(value, version, groups) -> None:
    assert plugins.net_plugin_names(value, version) == groups


def _lib_record(version: str, net: list[int]) -> dict[str, Any]:
    """A libnccl record for eras without a wheel here (the rules read only these fields)."""
    return {"path": f"{MULTIARCH}/libnccl.so.2", "version": version,
            "abis": {"net": net, "collnet": net, "tuner": [], "profiler": []},
            "default": True, "version_error": None}


def test_nccl_conf_names_per_era(tmp_path: Path, real_lib) -> None:
    root = tmp_path / "root"
    place(root, f"{MULTIARCH}/libnccl-net-ofi.so",
          build_plugin(tmp_path / "b1", net_abis=[8, 7, 6], name="AWS Libfabric",
                       filename="libnccl-net-ofi.so"))
    place(root, "/opt/hpcx/libnccl-net.so",
          build_plugin(tmp_path / "b2", net_abis=[8, 7], name="IBext_v8"))
    place(root, f"{MULTIARCH}/libnccl-net.so",
          build_plugin(tmp_path / "b3", net_abis=[6], name="Default"))
    # 2.18: "ofi" -> libnccl-net-ofi.so
    recs, net, _ = _probe(root, real_lib("2.18.3"), {"NCCL_NET_PLUGIN": "ofi"})
    assert net["plugin"] == f"{MULTIARCH}/libnccl-net-ofi.so" and net["effective_net_abi"] == 6
    assert [r["origin"] for r in recs] == ["nccl.conf"]
    # 2.18: a path is not understood (libnccl-net-/opt/....so): no plugin
    _, net, _ = _probe(root, real_lib("2.18.3"), {"NCCL_NET_PLUGIN": "/opt/hpcx/libnccl-net.so"})
    assert net["plugin"] is None and "libnccl-net-/opt/hpcx" in net["reason"]
    # 2.21: the path as given
    _, net, _ = _probe(root, real_lib("2.21.5"), {"NCCL_NET_PLUGIN": "/opt/hpcx/libnccl-net.so"})
    assert net["plugin"] == "/opt/hpcx/libnccl-net.so" and net["effective_net_abi"] == 8
    # unset: the linker's libnccl-net.so
    _, net, _ = _probe(root, real_lib("2.26.2"))
    assert net["plugin"] == f"{MULTIARCH}/libnccl-net.so" and net["effective_net_abi"] == 6
    # 2.27: a list; the first item that exists and speaks the ABI wins
    lib27 = _lib_record("2.27.3", [10, 9, 8, 7, 6])
    recs, net, _ = _probe(root, lib27, {"NCCL_NET_PLUGIN": "missing,ofi,/opt/hpcx/libnccl-net.so"})
    assert net["plugin"] == f"{MULTIARCH}/libnccl-net-ofi.so" and net["effective_net_abi"] == 8
    assert [r["default"] for r in recs] == [True]
    # 2.28: none
    lib28 = _lib_record("2.28.3", [11, 10, 9, 8, 7, 6])
    recs, net, _ = _probe(root, lib28, {"NCCL_NET_PLUGIN": "none"})
    assert recs == [] and net["plugin"] is None
    assert net["reason"].startswith("NCCL_NET_PLUGIN=none")


def test_list_skips_an_item_without_common_abi(tmp_path: Path) -> None:
    root = tmp_path / "root"
    place(root, f"{MULTIARCH}/libnccl-net-old.so",
          build_plugin(tmp_path / "b1", net_abis=[4], name="old", filename="libnccl-net-old.so"))
    place(root, f"{MULTIARCH}/libnccl-net-new.so",
          build_plugin(tmp_path / "b2", net_abis=[9], name="new", filename="libnccl-net-new.so"))
    lib = _lib_record("2.27.3", [10, 9, 8, 7, 6])
    recs, net, _ = _probe(root, lib, {"NCCL_NET_PLUGIN": "old,new"})
    assert net["plugin"] == f"{MULTIARCH}/libnccl-net-new.so" and net["effective_net_abi"] == 9
    assert {r["name"]: r["default"] for r in recs} == {"old": False, "new": True}
    # with only the old one: it is the plugin, and it is ignored
    _, net, _ = _probe(root, lib, {"NCCL_NET_PLUGIN": "old"})
    assert net["plugin"] == f"{MULTIARCH}/libnccl-net-old.so"
    assert net["effective_net_abi"] is None and "no common ABI" in net["reason"]


def test_tuner_and_profiler_when_the_library_looks_for_them(tmp_path: Path, real_lib) -> None:
    root = tmp_path / "root"
    place(root, f"{MULTIARCH}/libnccl-tuner.so",
          build_plugin(tmp_path / "t", tuner_abis=[2], tuner_name="MyTuner",
                       filename="libnccl-tuner.so"))
    place(root, "/opt/t/libnccl-tuner-x.so",
          build_plugin(tmp_path / "t2", tuner_abis=[4, 3], tuner_name="X",
                       filename="libnccl-tuner-x.so"))
    place(root, f"{MULTIARCH}/libnccl-profiler.so",
          build_plugin(tmp_path / "p", profiler_abis=[3, 1], profiler_name="Prof",
                       filename="libnccl-profiler.so"))
    # 2.18.3 names no tuner or profiler symbol: neither is loaded
    recs, _, _ = _probe(root, real_lib("2.18.3"))
    assert recs == []
    recs, _, _ = _probe(root, real_lib("2.21.5"))
    assert [(r["kind"], r["name"], r["abis"]["tuner"], r["default"]) for r in recs] == [
        ("tuner", "MyTuner", [2], True)]
    conf = {"NCCL_TUNER_PLUGIN": "/opt/t/libnccl-tuner-x.so"}
    recs, _, _ = _probe(root, real_lib("2.26.2"), conf)
    assert [(r["kind"], r["path"], r["origin"]) for r in recs] == [
        ("tuner", "/opt/t/libnccl-tuner-x.so", "nccl.conf"),
        ("profiler", f"{MULTIARCH}/libnccl-profiler.so", "linker"),
    ]
    assert recs[1]["abis"]["profiler"] == [3, 1] and recs[1]["name"] == "Prof"


def test_configured_search_paths(tmp_path: Path, real_lib) -> None:
    root = tmp_path / "root"
    place(root, "/opt/plugins/ofi/lib/libnccl-net-ofi.so",
          build_plugin(tmp_path / "a", net_abis=[9, 8], name="AWS Libfabric",
                       filename="libnccl-net-ofi.so"))
    place(root, "/opt/plugins/sharp/lib/libnccl-net.so",
          build_plugin(tmp_path / "b", net_abis=[8], collnet=[8], collnet_name="SHARP",
                       name="IBext_v8"))
    place(root, "/opt/plugins/sharp/lib/README.so", tmp_path / "b" / "libnccl-net.so")
    cfg = InventorydConfig(plugin_search_paths=("/opt/plugins/*/lib",))
    recs, net, errors = _probe(root, real_lib("2.21.5"), config=cfg)
    assert errors.entries == []
    assert [(r["path"], r["kind"], r["origin"], r["default"], r["name"]) for r in recs] == [
        ("/opt/plugins/ofi/lib/libnccl-net-ofi.so", "net", "config", False, "AWS Libfabric"),
        ("/opt/plugins/sharp/lib/libnccl-net.so", "net", "config", False, "IBext_v8"),
    ]
    assert recs[1]["names"] == {"net": "IBext_v8", "collnet": "SHARP"}
    assert net["plugin"] is None  # not where the linker looks


def test_end_to_end_through_ldconfig(tmp_path: Path, nccl_lib) -> None:
    from inventoryd.node.fingerprint import collect

    root = tmp_path / "root"
    place(root, "/opt/nccl/lib/libnccl.so.2.26.2", nccl_lib("2.26.2"))
    place(root, "/opt/hpcx/lib/libnccl-net.so",
          build_plugin(tmp_path / "b", net_abis=[11, 10, 9], name="IBext_v10"))
    (root / "etc").mkdir()
    (root / "etc/ld.so.conf").write_text("/opt/nccl/lib\n/opt/hpcx/lib\n")
    run_ldconfig(root)
    fp = collect(str(root), "n1", InventorydConfig(), FileCache(None))
    assert fp["net"] == {"libnccl": "/opt/nccl/lib/libnccl.so.2",
                         "plugin": "/opt/hpcx/lib/libnccl-net.so",
                         "effective_net_abi": 10, "reason": None}
    assert [p["name"] for p in fp["plugins"]] == ["IBext_v10"]
