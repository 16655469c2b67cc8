"""The env, GIN and RMA plugins, and which tuner, profiler, GIN and RMA NCCL really loads
(issues 13 and 28).

Real parts only: ``libnccl.so.2`` from the nvidia-nccl wheels (the releases of
``devtools.ncclwheels.NCCL_WHEELS``: 2.19.3, 2.20.5 and 2.21.5 cu11 included, 2.30.7 cu13);
plugins built by gcc that export only the symbols named; node trees under ``--root``.
The expected values come from each library's own strings (``tests/test_probe_nccl.py``,
``FACTS``) and NCCL's source at the tags that the rows of the loading-rules table cite
(``ncclguard/fingerprint/loading.py``, docs/fingerprint.md "Loading rules by release"):

- ``src/misc/tuner.cc`` (v2.19.1-1, v2.20.5-1): ``dlopen(getenv("NCCL_TUNER_PLUGIN"))``
  only: no default name, no other library; v2.21.5-1: ``libnccl-tuner.so``, then
  NCCL_NET_PLUGIN's names opened anew (whether or not the net plugin loaded).
- ``src/plugin/plugin_open.cc`` (v2.30.7-1): prefixes ``libnccl-net``, ``-gin``, ``-rma``,
  ``-tuner``, ``-profiler``, ``-env``; a name tried as given, then as
  ``libnccl-<kind>-NAME.so`` unless it has a ``/`` or is ``lib*.so`` (v2.27.5-1 on).
- ``src/plugin/tuner.cc`` (v2.28.9-1, v2.30.7-1): ``none`` disables; a tuner library
  that does not open falls back to the net plugin's (``ncclGetNetPluginLib``); one that
  opens without a known ``ncclTunerPlugin_vN`` is "unsupported" (``goto fail``): no tuner.
- ``src/plugin/profiler.cc``: the net plugin fallback is in v2.28.3-1, not in v2.27.7-1.
- ``src/plugin/env.cc`` (v2.28.7-1 to v2.30.7-1): ``initEnv()`` (``src/misc/param.cc``:
  ``/etc/nccl.conf`` into the environment, ``setenv(..., 0)``) and then
  ``getenv("NCCL_ENV_PLUGIN")``: ``/etc/nccl.conf`` can name the env plugin.
- ``src/plugin/net/net_v11.cc`` (v2.28.9-1): GIN v11 is ``dlsym``ed from the net plugin's
  library only; ``src/plugin/gin.cc`` (v2.29.7-1 on): ``NCCL_GIN_PLUGIN`` (a list, or
  ``none``), default ``libnccl-gin.so``, then the net plugin's library.
- ``src/plugin/gin.cc`` (v2.30.4-1): the GIN library's ``ncclRmaPlugin_v13`` is looked up
  but never initialized: no external RMA at all.
- ``src/plugin/rma.cc`` (v2.30.7-1): ``NCCL_RMA_PLUGIN``, default ``libnccl-rma.so``, then
  the net plugin's library (GIN's is listed before it, but ``src/init.cc`` runs
  ``ncclRmaInit`` before ``ncclGinInit``, so it is never open yet);
  ``rma/rma_v13.cc`` takes ``ncclGinPlugin_v13`` when ``ncclRmaPlugin_v13`` is missing;
  v2.32.3-1 (NVIDIA/nccl commit 12df1a11, no tag fetched): four places reserved, so
  ``NCCL_RMA_PLUGIN`` keeps 12 items (13 before), and RMA v16..v13.

Over 500 lines: one gcc-built plugin library per kind and ABI, against every NCCL
release's loading rules; the kinds share the builder and the real libnccl files.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.parts import build_plugin

from devtools.nodetree import LIBDIR, build_node
from inventoryd.filecache import FileCache
from inventoryd.node.fingerprint import collect
from inventoryd.node.textfile import registry_for
from inventoryd.nodefs import ErrorLog, NodeFS
from inventoryd.probes import plugins
from ncclguard.config import InventorydConfig, PolicyConfig
from ncclguard.fingerprint.compat import compat_values
from ncclguard.fingerprint.fields import net_plugin, plugin_in_force
from ncclguard.policy import evaluate
from ncclguard.policy.fpdiff import diff
from ncclguard.store import Inventory

NET = f"{LIBDIR}/libnccl-net.so"
TUNER = f"{LIBDIR}/libnccl-tuner.so"
ENV = f"{LIBDIR}/libnccl-env.so"
GIN = f"{LIBDIR}/libnccl-gin.so"
RMA = f"{LIBDIR}/libnccl-rma.so"


@pytest.fixture
def node(
    tmp_path: Path, nccl_lib: Callable[[str], Path], cache_dir: Path
) -> Callable[..., dict[str, Any]]:
    """``node("n1", "2.32.3", files={node_path: so}, conf="...")`` -> its fingerprint."""

    trees = iter(range(1 << 20))

    def make(host: str, nccl: str, files: dict[str, Path] | None = None,
             conf: str | None = None) -> dict[str, Any]:
        root = build_node(tmp_path / f"{host}-{next(trees)}", libnccl=nccl_lib(nccl), hostname=host,
                          nccl_conf=conf, extra_files=files or {})
        return dict(collect(str(root), host, InventorydConfig()))

    return make


@pytest.fixture(scope="module")
def so(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``so("packed", net_abis=[...], ...)``: a gcc-built plugin, once per module."""
    memo: dict[str, tuple[dict[str, Any], Path]] = {}
    base = tmp_path_factory.mktemp("plugins")

    def get(key: str, **kw: Any) -> Path:
        if key not in memo:
            options = dict(kw)
            filename = options.pop("filename", "libnccl-net.so")
            memo[key] = (kw, build_plugin(base / key, filename=filename, **options))
        assert memo[key][0] == kw, f"so({key!r}) was built with other options"
        return memo[key][1]

    return get


def packed(so: Callable[..., Path]) -> Path:
    """One library: net v12..v10, tuner v6..v4, profiler v7/v5/v4, GIN v14/v11."""
    return so("packed", net_abis=[12, 11, 10], name="IBext_v12", tuner_abis=[6, 5, 4],
              tuner_name="PackedTuner", profiler_abis=[7, 5, 4], profiler_name="PackedProf",
              gin_abis=[14, 11], gin_name="PackedGin")


def eff(fp: dict[str, Any], kind: str) -> tuple[str | None, int | None, str | None]:
    rec = fp["effective"][kind]
    return (rec["via"], rec["abi"], rec["name"])


# ---- the packed net+tuner+profiler+GIN library, across the era boundaries --------------


@pytest.mark.parametrize(
    ("nccl", "net", "tuner", "profiler", "gin"),
    [
        # 2.27.7: tuner v4..v2 (falls back to the net library), profiler v4..v1 but no net
        # fallback (profiler.cc v2.27.7-1), no GIN at all
        ("2.27.7", 10, ("net", 4, "PackedTuner"), (None, None, None), (None, None, None)),
        # 2.28.9: net v11, tuner v5, profiler v5 from the net library; GIN v11 (net_v11.cc)
        ("2.28.9", 11, ("net", 5, "PackedTuner"), ("net", 5, "PackedProf"),
         ("net", 11, "PackedGin")),
        # 2.30.7 (cu13): net v12, tuner v6, profiler v6, GIN v14..v13
        ("2.30.7", 12, ("net", 6, "PackedTuner"), ("net", 5, "PackedProf"),
         ("net", 14, "PackedGin")),
        # 2.32.3: profiler v7 (its strings name ncclProfiler_v1..v7)
        ("2.32.3", 12, ("net", 6, "PackedTuner"), ("net", 7, "PackedProf"),
         ("net", 14, "PackedGin")),
    ],
)
def test_packed_library_per_era(node, so, nccl, net, tuner, profiler, gin) -> None:
    fp = node("n1", nccl, {NET: packed(so)})
    assert fp["net"]["effective_net_abi"] == net
    assert eff(fp, "tuner") == tuner
    assert eff(fp, "profiler") == profiler
    assert eff(fp, "gin") == gin
    assert eff(fp, "rma") == (None, None, None)  # it exports no RMA (nor GIN v13)
    # one file, one record: the net plugin's; its other kinds are not "default" records
    assert [(p["kind"], p["default"]) for p in fp["plugins"]] == [("net", True)]
    # the policy's reading agrees with the probe's
    for kind, want in (("tuner", tuner), ("profiler", profiler), ("gin", gin)):
        got = plugin_in_force(fp, kind)
        assert got == (("none", 0) if want[1] is None else (want[2], want[1]))


def test_profiler_is_2_30_7_v6_not_v7(node, so) -> None:
    """2.30.7 looks for ncclProfiler_v6..v1: the packed library's v7 is not known to it,
    so the highest common one (v5) is in force (table row above); 2.32.3 takes v7."""
    fp = node("n1", "2.30.7", {NET: packed(so)})
    lib = next(x for x in fp["libnccl"] if x["default"])
    assert lib["abis"]["profiler"] == [6, 5, 4, 3, 2, 1]
    assert fp["effective"]["profiler"]["abi"] == 5


# ---- a tuner that exports only the newest symbol ---------------------------------------


@pytest.mark.parametrize(("nccl", "abi"), [("2.21.5", None), ("2.28.9", None),
                                           ("2.30.7", 6), ("2.32.3", 6)])
def test_tuner_v6_only_is_loaded_from_2_30(node, so, nccl, abi) -> None:
    """2.21.5 looks for ncclTunerPlugin_v2, 2.28.9 for v5..v2: neither loads a v6-only
    tuner (the record was ``default: true`` before issue 13)."""
    t6 = so("t6", tuner_abis=[6], tuner_name="NewTuner", filename="libnccl-tuner.so")
    fp = node("n1", nccl, {TUNER: t6})
    rec = fp["effective"]["tuner"]
    tuner = next(p for p in fp["plugins"] if p["path"] == TUNER)
    assert (rec["plugin"], rec["via"], rec["abi"]) == (TUNER, "tuner", abi)
    assert tuner["default"] is (abi is not None)
    if abi is None:
        assert rec["reason"].startswith("no common ABI") and "v6" in rec["reason"]
        assert plugin_in_force(fp, "tuner") == ("NewTuner", 0)  # there, and ignored


def test_an_unsupported_tuner_library_is_not_followed_by_the_net_one(node, so) -> None:
    """tuner.cc: a libnccl-tuner.so that opens without a known symbol fails the tuner;
    NCCL does not then look in the net plugin's library (which has v5)."""
    t6 = so("t6", tuner_abis=[6], tuner_name="NewTuner", filename="libnccl-tuner.so")
    fp = node("n1", "2.28.9", {TUNER: t6, NET: packed(so)})
    assert fp["effective"]["tuner"]["plugin"] == TUNER
    assert fp["effective"]["tuner"]["abi"] is None


# ---- era-specific NCCL_*_PLUGIN settings in /etc/nccl.conf -----------------------------


def test_tuner_none_disables_from_2_28_only(node, so) -> None:
    t = so("t4", tuner_abis=[4], tuner_name="T4", filename="libnccl-tuner.so")
    old = node("n1", "2.27.7", {TUNER: t}, conf="NCCL_TUNER_PLUGIN=none\n")
    new = node("n2", "2.28.9", {TUNER: t}, conf="NCCL_TUNER_PLUGIN=none\n")
    # 2.27.7: "none" is a name: libnccl-tuner-none.so is tried and not found
    assert "libnccl-tuner-none.so" in old["effective"]["tuner"]["reason"]
    assert new["effective"]["tuner"]["reason"].startswith("NCCL_TUNER_PLUGIN=none")
    assert plugin_in_force(old, "tuner") == plugin_in_force(new, "tuner") == ("none", 0)


def test_named_tuner_expansion_and_path(node, so) -> None:
    t = so("t5", tuner_abis=[5], tuner_name="Site", filename="libnccl-tuner-site.so")
    by_name = node("n1", "2.28.9", {f"{LIBDIR}/libnccl-tuner-site.so": t},
                   conf="NCCL_TUNER_PLUGIN=site\n")
    assert eff(by_name, "tuner") == ("tuner", 5, "Site")
    # a path is tried as given only (plugin_open.cc v2.27.5-1 on)
    by_path = node("n2", "2.28.9", {"/opt/t/libnccl-tuner-site.so": t},
                   conf="NCCL_TUNER_PLUGIN=/opt/t/libnccl-tuner-site.so\n")
    assert by_path["effective"]["tuner"]["plugin"] == "/opt/t/libnccl-tuner-site.so"
    assert by_path["effective"]["tuner"]["abi"] == 5


def test_env_plugin_by_default_name_by_nccl_conf_and_abi(node, so) -> None:
    e2 = so("e2", env_abis=[2], env_name="SiteEnv", filename="libnccl-env.so")
    other = so("e2b", env_abis=[2], env_name="Other", filename="libnccl-env-other.so")
    # 2.28.9 knows ncclEnvPlugin_v1 only
    assert node("n1", "2.28.9", {ENV: e2})["effective"]["env"]["abi"] is None
    files = {ENV: e2, f"{LIBDIR}/libnccl-env-other.so": other}
    assert eff(node("n2", "2.30.7", files), "env") == ("env", 2, "SiteEnv")
    # env.cc runs initEnv() (param.cc: /etc/nccl.conf into the environment) before
    # getenv("NCCL_ENV_PLUGIN"): the file names the env plugin (the record said SiteEnv
    # before issue 28)
    fp = node("n2", "2.30.7", files, conf="NCCL_ENV_PLUGIN=other\n")
    assert eff(fp, "env") == ("env", 2, "Other")
    assert compat_values(fp)["env_plugin"] == "Other v2"
    off = node("n2", "2.30.7", files, conf="NCCL_ENV_PLUGIN=NONE\n")
    assert off["effective"]["env"]["reason"] == "NCCL_ENV_PLUGIN=NONE: env plugins are disabled"
    assert compat_values(off)["env_plugin"] == "none"
    # 2.27.7 loads no env plugin at all
    assert node("n3", "2.27.7", {ENV: e2})["effective"]["env"]["plugin"] is None


def test_gin_library_and_rma_fallbacks(node, so) -> None:
    g13 = so("g13", gin_abis=[13], gin_name="Gin13", filename="libnccl-gin.so")
    fp = node("n1", "2.30.7", {GIN: g13})
    assert eff(fp, "gin") == ("gin", 13, "Gin13")
    # rma.cc lists GIN's library, but init.cc runs ncclRmaInit before ncclGinInit: it is
    # not open yet, and RMA is not taken from it (before issue 28: RMA v13 via gin)
    rma = fp["effective"]["rma"]
    assert (rma["plugin"], rma["abi"]) == (None, None)
    assert rma["reason"] == ("no external rma plugin (libnccl-rma.so not found; not in the "
                             "net plugin's library): NCCL uses its internal one, if any")
    # ncclGinPlugin_v13 as RMA v13 (rma_v13.cc) where RMA does look: its own library, the
    # net plugin's
    assert eff(node("n1", "2.30.7", {RMA: so("g13r", gin_abis=[13], gin_name="Gin13",
                                              filename="libnccl-rma.so")}), "rma") == (
        "rma", 13, "Gin13")
    both = node("n1", "2.30.7", {NET: so("net-g13", net_abis=[12], name="IBext_v12",
                                         gin_abis=[13], gin_name="NetGin")})
    assert eff(both, "rma") == ("net", 13, "NetGin") and eff(both, "gin") == ("net", 13, "NetGin")
    # 2.28.9 has no libnccl-gin.so (GIN lives in the net plugin's library only)
    old = node("n2", "2.28.9", {GIN: g13})
    assert old["effective"]["gin"]["plugin"] is None
    assert all(p["path"] != GIN for p in old["plugins"])
    # NCCL_GIN_PLUGIN=none empties the list; the net plugin's library is still tried
    off = node("n3", "2.32.3", {GIN: g13, NET: packed(so)}, conf="NCCL_GIN_PLUGIN=none\n")
    assert eff(off, "gin") == ("net", 14, "PackedGin")


def test_rma_v16_only_from_2_32(node, so) -> None:
    r16 = so("r16", rma_abis=[16], rma_name="Rma16", filename="libnccl-rma.so")
    assert eff(node("n1", "2.32.3", {RMA: r16}), "rma") == ("rma", 16, "Rma16")
    fp = node("n2", "2.30.7", {RMA: r16})  # 2.30.7 looks for v14, v13
    assert fp["effective"]["rma"]["abi"] is None
    assert plugin_in_force(fp, "rma") == ("Rma16", 0)
    named = node("n3", "2.32.3", {f"{LIBDIR}/libnccl-rma-x.so": r16},
                 conf="NCCL_RMA_PLUGIN=x\n")
    assert eff(named, "rma") == ("rma", 16, "Rma16")


def test_rma_list_keeps_12_items_from_2_32(node, so) -> None:
    """rma.cc v2.32.3-1 reserves four places (GIN's library, the net plugin's, internal IB
    and the new internal Socket RMA): NCCL_RMA_PLUGIN keeps 12 items, 13 before."""
    r13 = so("r13-x", rma_abis=[13], rma_name="Rma13", filename="libnccl-rma-x.so")
    conf = "NCCL_RMA_PLUGIN=" + ",".join([f"p{i}" for i in range(12)] + ["x"]) + "\n"
    files = {f"{LIBDIR}/libnccl-rma-x.so": r13}
    assert eff(node("n1", "2.30.7", files, conf=conf), "rma") == ("rma", 13, "Rma13")
    fp = node("n2", "2.32.3", files, conf=conf)
    rma = fp["effective"]["rma"]
    assert (rma["plugin"], rma["abi"]) == (None, None)
    assert "libnccl-rma-p11.so not found" in rma["reason"]
    assert "libnccl-rma-x.so" not in rma["reason"]
    assert all(p["path"] != f"{LIBDIR}/libnccl-rma-x.so" for p in fp["plugins"])


# ---- the policy, diff, show, classes and metrics ---------------------------------------


def rules(v: Any) -> dict[str, str]:
    return {f.rule: f.severity for f in v.findings}


def test_rules_on_real_nodes(node, so, tmp_path: Path) -> None:
    e2 = so("e2", env_abis=[2], env_name="SiteEnv", filename="libnccl-env.so")
    t6 = so("t6", tuner_abis=[6], tuner_name="NewTuner", filename="libnccl-tuner.so")
    g13 = so("g13", gin_abis=[13], gin_name="Gin13", filename="libnccl-gin.so")
    base = node("n1", "2.32.3")
    fps = {
        "n1": base,
        "n2": node("n2", "2.32.3"),
        "n3": node("n3", "2.32.3", {ENV: e2}),
    }
    v = evaluate(fps, PolicyConfig())
    # node-adds too: a job that brings its own NCCL (2.28.9 on) loads that env plugin
    assert rules(v) == {"env-plugin": "refuse", "node-adds": "refuse"}
    assert v.decision == "refuse" and v.odd_nodes == ["n3"]
    r13 = so("r13", rma_abis=[13], rma_name="Rma13", filename="libnccl-rma.so")
    fps["n3"] = node("n3", "2.32.3", {TUNER: t6, GIN: g13, RMA: r13})
    v = evaluate(fps, PolicyConfig())
    assert rules(v) == {"tuner": "warn", "gin-rma": "warn", "node-adds": "warn"}
    assert v.decision == "warn"
    text = v.format_text()
    assert "tuner NewTuner v6" in text and "GIN plugin Gin13 v13" in text
    # diff: the fingerprint fields, each with its rule
    d = diff({"n1": fps["n1"], "n3": fps["n3"]}, PolicyConfig())
    by_field = {x.field: (x.rule, x.severity) for x in d.differences}
    assert by_field["effective.tuner.abi"] == ("tuner", "warn")
    assert by_field["effective.gin.abi"] == ("gin-rma", "warn")
    assert by_field["effective.rma.abi"] == ("gin-rma", "warn")
    # the store's v4 columns, and the metrics
    db = tmp_path / "inv.db"
    from ncclguard.policy import GATE_VALUES

    with Inventory(db, values=GATE_VALUES) as inv:
        for fp in fps.values():
            inv.upsert(fp, now=time.time())
        rows = {r["host"]: r for r in inv.nodes({"tuner_abi": 6})}
    assert list(rows) == ["n3"] and rows["n3"]["gin_plugin"] == "Gin13"
    from prometheus_client import generate_latest

    text = generate_latest(registry_for(fps["n3"], last_change=None, publish_ok=None,
                                        last_publish=None)).decode()
    assert 'ncclguard_plugin_abi_in_force{kind="tuner"} 6.0' in text
    assert 'ncclguard_plugin_abi_in_force{kind="rma"} 13.0' in text
    assert 'ncclguard_plugin_abi_in_force{kind="env"} 0.0' in text


# ---- issue 28: what each release really loads (ncclguard/fingerprint/loading.py) ------


@pytest.mark.parametrize("nccl", ["2.19.3", "2.20.5"])
def test_tuner_2_19_and_2_20_only_where_named(node, so, nccl) -> None:
    """src/misc/tuner.cc (v2.19.1-1, v2.20.5-1): dlopen(getenv("NCCL_TUNER_PLUGIN")) and
    nothing else: no default name, no libnccl-tuner-NAME.so, no net plugin's library.
    Before issue 28 the file below was the tuner in force (abi 1)."""
    t1 = so("t1", tuner_abis=[1], tuner_name="T1", filename="libnccl-tuner.so")
    fp = node("n1", nccl, {TUNER: t1})
    rec = fp["effective"]["tuner"]
    assert (rec["plugin"], rec["via"], rec["abi"]) == (None, None, None)
    assert rec["reason"] == (f"no tuner plugin (libnccl {nccl} opens one only where "
                             "NCCL_TUNER_PLUGIN names it, and /etc/nccl.conf does not (a "
                             "job's own environment may))")
    assert "libnccl-tuner" not in rec["reason"]  # it never looks for that name
    assert all(p["path"] != TUNER for p in fp["plugins"])  # never opened, not listed
    assert plugin_in_force(fp, "tuner") == ("none", 0)
    # named: as given only, a path or a library name the linker finds
    by_path = node("n2", nccl, {"/opt/t/libnccl-tuner.so": t1},
                   conf="NCCL_TUNER_PLUGIN=/opt/t/libnccl-tuner.so\n")
    assert eff(by_path, "tuner") == ("tuner", 1, "T1")
    assert eff(node("n3", nccl, {TUNER: t1}, conf="NCCL_TUNER_PLUGIN=libnccl-tuner.so\n"),
               "tuner") == ("tuner", 1, "T1")
    site = so("t1s", tuner_abis=[2, 1], tuner_name="Site", filename="libnccl-tuner-site.so")
    by_name = node("n4", nccl, {f"{LIBDIR}/libnccl-tuner-site.so": site},
                   conf="NCCL_TUNER_PLUGIN=site\n")
    assert by_name["effective"]["tuner"]["reason"] == "no tuner plugin (site not found)"
    # 2.21.5 also tries libnccl-tuner-site.so (and speaks v2)
    assert eff(node("n5", "2.21.5", {f"{LIBDIR}/libnccl-tuner-site.so": site},
                    conf="NCCL_TUNER_PLUGIN=site\n"), "tuner") == ("tuner", 2, "Site")
    # no fallback to the net plugin's library either
    packed_v1 = so("packed-v1", net_abis=[7], name="IBext_v7", tuner_abis=[1],
                   tuner_name="PackedT1")
    fp = node("n6", nccl, {NET: packed_v1})
    assert fp["net"]["effective_net_abi"] == 7
    assert fp["effective"]["tuner"]["plugin"] is None


def test_tuner_2_21_opens_the_net_plugins_names_itself(node, so) -> None:
    """src/misc/tuner.cc (v2.21.5-1): without a tuner library, NCCL opens NCCL_NET_PLUGIN's
    names (or libnccl-net.so) anew, whether or not the net plugin loaded; 2.26.2's
    ncclGetNetPluginLib is the net plugin's library as loaded (src/plugin/tuner.cc)."""
    odd = so("net-v4", net_abis=[4], name="OldNet", tuner_abis=[2], tuner_name="NetTuner")
    fp = node("n1", "2.21.5", {NET: odd})
    assert fp["net"]["effective_net_abi"] is None  # 2.21.5 looks for v8..v5
    assert eff(fp, "tuner") == ("net", 2, "NetTuner")
    named = node("n2", "2.21.5", {f"{LIBDIR}/libnccl-net-odd.so": odd},
                 conf="NCCL_NET_PLUGIN=odd\n")
    assert eff(named, "tuner") == ("net", 2, "NetTuner")
    later = node("n3", "2.26.2", {NET: odd})
    assert later["net"]["effective_net_abi"] is None
    assert later["effective"]["tuner"]["reason"] == (
        "no tuner plugin (libnccl-tuner.so not found; not in the net plugin's library)")


def test_profiler_2_23_takes_the_value_as_given_only(node, so) -> None:
    """src/misc/profiler.cc (v2.23.4-1 to v2.25.1-1) tries NCCL_PROFILER_PLUGIN as given
    (twice), never libnccl-profiler-NAME.so; plugin_open.cc (v2.26.2-1) does."""
    p1 = so("p1", profiler_abis=[1], profiler_name="Prof1",
            filename="libnccl-profiler-site.so")
    files = {f"{LIBDIR}/libnccl-profiler-site.so": p1}
    old = node("n1", "2.23.4", files, conf="NCCL_PROFILER_PLUGIN=site\n")
    assert old["effective"]["profiler"]["reason"] == "no profiler plugin (site not found)"
    new = node("n2", "2.26.2", files, conf="NCCL_PROFILER_PLUGIN=site\n")
    assert eff(new, "profiler") == ("profiler", 1, "Prof1")


def test_rma_2_30_4_loads_no_external_plugin(node, so) -> None:
    """2.30.4 has no libnccl-rma.so nor NCCL_RMA_PLUGIN (its strings); src/plugin/gin.cc
    (v2.30.4-1) looks up ncclRmaPlugin_v13 in the GIN library but never raises its state
    from LoadReady, so no external RMA is initialized. Before issue 28 each file below was
    reported as RMA v13 in force."""
    r13 = so("r13-only", rma_abis=[13], rma_name="Rma13", filename="libnccl-rma.so")
    g13 = so("g13", gin_abis=[13], gin_name="Gin13", filename="libnccl-gin.so")
    both = so("g13r13", gin_abis=[13], gin_name="Gin13", rma_abis=[13], rma_name="Rma13",
              filename="libnccl-gin.so")
    why = ("libnccl 2.30.4 loads no external rma plugin: it looks up ncclRmaPlugin_v13 in "
           "the GIN library but never initializes an external RMA plugin (src/plugin/gin.cc "
           "v2.30.4-1); there is no libnccl-rma.so nor NCCL_RMA_PLUGIN")
    fp = node("n1", "2.30.4", {RMA: r13}, conf="NCCL_RMA_PLUGIN=libnccl-rma.so\n")
    assert fp["effective"]["rma"] == {"plugin": None, "via": None, "name": None, "abi": None,
                                      "reason": why}
    assert all(p["path"] != RMA for p in fp["plugins"])
    for gin in (g13, both):
        fp = node("n2", "2.30.4", {GIN: gin})
        assert eff(fp, "gin") == ("gin", 13, "Gin13")
        assert fp["effective"]["rma"]["reason"] == why
        assert plugin_in_force(fp, "rma") == ("none", 0)
    # 2.30.7 opens libnccl-rma.so
    assert eff(node("n3", "2.30.7", {RMA: r13}), "rma") == ("rma", 13, "Rma13")


def test_gin_reason_when_nothing_is_set(node) -> None:
    """2.28.x: GIN only in the net plugin's library; the reason read NCCL_GIN_PLUGIN=None."""
    fp = node("n1", "2.28.9")
    assert fp["effective"]["gin"]["reason"] == (
        "no external gin plugin (libnccl 2.28.9 has no gin library of its own; not in the "
        "net plugin's library): NCCL uses its internal one, if any")
    fp = node("n2", "2.30.7", conf="NCCL_GIN_PLUGIN=none\n")
    assert fp["effective"]["gin"]["reason"] == (
        "no external gin plugin (NCCL_GIN_PLUGIN=none: its list is empty; not in the net "
        "plugin's library): NCCL uses its internal one, if any")


def test_the_jobs_executable_is_unknown(node, so) -> None:
    """A prefix of STATIC_PLUGIN (2.22.3 on: tryOpenLib, dlopen(NULL)) or, in 2.19 and 2.20,
    an empty NCCL_TUNER_PLUGIN (dlopen("")) opens the job's own executable: what it
    exports is not on the node, so the kind is unknown (an error), never "none"."""
    t5 = so("t5-default", tuner_abis=[5], tuner_name="T5", filename="libnccl-tuner.so")
    for nccl, conf in (("2.28.9", "NCCL_TUNER_PLUGIN=static_plugin\n"),
                       ("2.28.9", "NCCL_TUNER_PLUGIN=Stat\n"),
                       ("2.19.3", "NCCL_TUNER_PLUGIN=\n")):
        fp = node("n1", nccl, {TUNER: t5}, conf=conf)
        assert fp["effective"]["tuner"]["plugin"] is None
        assert "job's own executable" in fp["effective"]["tuner"]["reason"]
        assert [e["field"] for e in fp["errors"]] == ["plugins.tuner"]
        assert plugin_in_force(fp, "tuner") is None
    # 2.21.5 has no STATIC_PLUGIN: the name is a name (and libnccl-tuner-static_plugin.so)
    fp = node("n2", "2.21.5", {TUNER: t5}, conf="NCCL_TUNER_PLUGIN=static_plugin\n")
    assert fp["errors"] == [] and fp["effective"]["tuner"]["plugin"] is None
    # the net plugin too: unknown, not "no plugin"
    fp = node("n3", "2.30.7", {NET: packed(so), TUNER: t5},
              conf="NCCL_NET_PLUGIN=STATIC_PLUGIN\n")
    assert fp["net"]["plugin"] is None and "job's own executable" in fp["net"]["reason"]
    assert net_plugin(fp) is None
    # and so is what falls back to the net plugin's library; a library of its own is not
    assert [e["field"] for e in fp["errors"]] == [
        "plugins.net", "plugins.profiler", "plugins.gin", "plugins.rma"]
    assert eff(fp, "tuner") == ("tuner", 5, "T5")
    # an earlier usable item decides before it
    fp = node("n4", "2.30.7", {NET: packed(so)},
              conf="NCCL_NET_PLUGIN=libnccl-net.so,STATIC_PLUGIN\n")
    assert fp["net"]["effective_net_abi"] == 12 and fp["errors"] == []


def test_empty_net_plugin_list_from_2_27(node, so) -> None:
    """net.cc (v2.27.3-1 on): NCCL_NET_PLUGIN set but empty is a list of no item; before
    2.27 (src/net.cc, strlen check) it means the default."""
    fp = node("n1", "2.28.9", {NET: packed(so)}, conf="NCCL_NET_PLUGIN=\n")
    assert fp["net"]["plugin"] is None
    assert fp["net"]["reason"] == ("NCCL_NET_PLUGIN is empty (a list of no item): no "
                                   "external net plugin")
    assert node("n2", "2.26.2", {NET: packed(so)},
                conf="NCCL_NET_PLUGIN=\n")["net"]["effective_net_abi"] == 10


def _probe_as(root: Path, fp: dict[str, Any], version: str) -> tuple[dict, dict]:
    """The plugin probe of ``root`` as if its default libnccl were ``version`` (a release
    that cannot exist yet, or one older than any wheel): the real library's record with
    only its version changed."""
    libs = [dict(x, version=version) if x["default"] else x for x in fp["libnccl"]]
    errors = ErrorLog()
    _, net, effective, _ = plugins.probe(NodeFS(root), errors, InventorydConfig(), {}, libs,
                                         FileCache(None))
    return net, effective


def test_a_release_outside_the_table_is_named(tmp_path: Path, nccl_lib, so) -> None:
    root = build_node(tmp_path / "n1", libnccl=nccl_lib("2.32.3"), hostname="n1",
                      extra_files={NET: packed(so), TUNER: so(
                          "t6", tuner_abis=[6], tuner_name="NewTuner",
                          filename="libnccl-tuner.so")})
    fp = dict(collect(str(root), "n1", InventorydConfig()))
    assert all("loading-rules table" not in (r["reason"] or "")
               for r in (fp["net"], *fp["effective"].values()))
    net, effective = _probe_as(root, fp, "2.33.1")
    note = ("libnccl 2.33.1 is newer than the newest release in the loading-rules table "
            "(2.32.3): read with that release's rules")
    # the newest row's rules: the same plugins in force, and every reason says so
    assert net["effective_net_abi"] == fp["net"]["effective_net_abi"] == 12
    assert net["reason"] == note
    assert effective["tuner"]["abi"] == 6 and effective["tuner"]["reason"] == note
    for kind in ("profiler", "env", "gin", "rma"):
        assert effective[kind]["abi"] == fp["effective"][kind]["abi"]
        before = fp["effective"][kind]["reason"]
        assert effective[kind]["reason"] == (f"{before}; {note}" if before else note)
    # older than the oldest row: its rules (no tuner), named
    net, effective = _probe_as(root, fp, "2.9.9")
    assert effective["tuner"]["reason"] == (
        "libnccl 2.9.9 loads no tuner plugin; libnccl 2.9.9 is older than the oldest "
        "release in the loading-rules table (2.10.3): read with that release's rules")
    # a version not known at all: the newest row's rules, named
    net, effective = _probe_as(root, fp, "x")
    assert effective["tuner"]["abi"] == 6
    assert "the default libnccl's version is unknown" in effective["tuner"]["reason"]


def test_a_reason_text_is_no_difference_a_rule_refuses() -> None:
    """Issue 46: ``diff`` rated ``effective.env.reason`` ("libnccl 2.18.3 loads no env
    plugin" against "... 2.21.5 ...") refuse, though neither node has an env plugin and
    the gate does not fire on it: a reason explains a value, it is not one."""
    from helpers.fingerprints import fingerprint

    from ncclguard.policy.fpdiff import diff

    a, b = fingerprint("a"), fingerprint("b")
    for kind, part in (("env", "effective"), ("tuner", "effective"), ("gin", "effective")):
        a[part][kind] = {**(a[part].get(kind) or {}), "reason": "libnccl 2.18.3 loads none"}
        b[part][kind] = {**(b[part].get(kind) or {}), "reason": "libnccl 2.21.5 loads none"}
    a["net"] = {**a["net"], "reason": "libnccl 2.18.3: no plugin"}
    b["net"] = {**b["net"], "reason": "libnccl 2.21.5: no plugin"}
    got = {d.field: d.severity for d in diff({"a": a, "b": b}).differences}
    assert got == {"effective.env.reason": "info", "effective.tuner.reason": "info",
                   "effective.gin.reason": "info", "net.reason": "info"}, got
