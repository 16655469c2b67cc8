"""The env, GIN and RMA plugins, and which tuner and profiler NCCL really loads (issue 13).

Real parts only: ``libnccl.so.2`` from the nvidia-nccl-cu12 wheels 2.21.5 (cu11), 2.27.7,
2.28.9, 2.32.3 and nvidia-nccl-cu13 2.30.7; plugins built by gcc that export only the
symbols named; node trees under ``--root``. The expected values come from each library's
own strings (``tests/test_probe_nccl.py``, ``FACTS``) and NCCL's source:

- ``src/plugin/plugin_open.cc`` (v2.30.7-1): prefixes ``libnccl-net``, ``-gin``, ``-rma``,
  ``-tuner``, ``-profiler``, ``-env``; a name tried as given, then as
  ``libnccl-<kind>-NAME.so`` unless it has a ``/`` or is ``lib*.so`` (v2.27.5-1 on).
- ``src/plugin/tuner.cc`` (v2.28.9-1, v2.30.7-1): ``none`` disables; a tuner library
  that does not open falls back to the net plugin's (``ncclGetNetPluginLib``); one that
  opens without a known ``ncclTunerPlugin_vN`` is "unsupported" (``goto fail``): no tuner.
- ``src/plugin/profiler.cc``: the net plugin fallback is in v2.28.9-1, not in v2.27.7-1.
- ``src/plugin/env.cc`` (v2.28.9-1, v2.30.7-1): ``std::getenv("NCCL_ENV_PLUGIN")``, the
  environment only: ``/etc/nccl.conf`` cannot name the env plugin.
- ``src/plugin/net/net_v11.cc`` (v2.28.9-1): GIN v11 is ``dlsym``ed from the net plugin's
  library only; ``src/plugin/gin.cc`` (v2.29.7-1 on): ``NCCL_GIN_PLUGIN`` (a list, or
  ``none``), default ``libnccl-gin.so``, then the net plugin's library.
- ``src/plugin/rma.cc`` (v2.30.7-1): ``NCCL_RMA_PLUGIN``, default ``libnccl-rma.so``,
  then GIN's library, then the net plugin's; ``rma/rma_v13.cc`` takes
  ``ncclGinPlugin_v13`` when ``ncclRmaPlugin_v13`` is missing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from devtools.nodetree import LIBDIR, build_node
from inventoryd.collect import collect
from inventoryd.metrics import registry_for
from ncclguard.config import InventorydConfig, PolicyConfig
from ncclguard.fingerprint.compat import compat_values
from ncclguard.fingerprint.fields import plugin_in_force
from ncclguard.policy import evaluate
from ncclguard.policy.fpdiff import diff
from ncclguard.store import Inventory
from tests.conftest import build_plugin

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
    memo: dict[str, Path] = {}
    base = tmp_path_factory.mktemp("plugins")

    def get(key: str, **kw: Any) -> Path:
        if key not in memo:
            filename = kw.pop("filename", "libnccl-net.so")
            memo[key] = build_plugin(base / key, filename=filename, **kw)
        return memo[key]

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


def test_env_plugin_only_by_default_name_and_abi(node, so) -> None:
    e2 = so("e2", env_abis=[2], env_name="SiteEnv", filename="libnccl-env.so")
    other = so("e2b", env_abis=[2], env_name="Other", filename="libnccl-env-other.so")
    # 2.28.9 knows ncclEnvPlugin_v1 only
    assert node("n1", "2.28.9", {ENV: e2})["effective"]["env"]["abi"] is None
    fp = node("n2", "2.30.7", {ENV: e2, f"{LIBDIR}/libnccl-env-other.so": other},
              conf="NCCL_ENV_PLUGIN=other\n")
    # NCCL_ENV_PLUGIN in /etc/nccl.conf is not read (env.cc: std::getenv)
    assert eff(fp, "env") == ("env", 2, "SiteEnv")
    assert compat_values(fp)["env_plugin"] == "SiteEnv v2"
    # 2.27.7 loads no env plugin at all
    assert node("n3", "2.27.7", {ENV: e2})["effective"]["env"]["plugin"] is None


def test_gin_library_and_rma_fallbacks(node, so) -> None:
    g13 = so("g13", gin_abis=[13], gin_name="Gin13", filename="libnccl-gin.so")
    fp = node("n1", "2.30.7", {GIN: g13})
    assert eff(fp, "gin") == ("gin", 13, "Gin13")
    # RMA v13 takes ncclGinPlugin_v13 (rma_v13.cc), from GIN's library
    assert fp["effective"]["rma"]["plugin"] == GIN
    assert (fp["effective"]["rma"]["via"], fp["effective"]["rma"]["abi"]) == ("gin", 13)
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
    assert rules(v) == {"env-plugin": "refuse"} and v.decision == "refuse"
    assert v.odd_nodes == ["n3"]
    fps["n3"] = node("n3", "2.32.3", {TUNER: t6, GIN: g13})
    v = evaluate(fps, PolicyConfig())
    assert rules(v) == {"tuner": "warn", "gin-rma": "warn"} and v.decision == "warn"
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
