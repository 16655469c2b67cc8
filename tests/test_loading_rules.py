"""The loading-rules table (ncclguard/fingerprint/loading.py) against the real libraries.

Every release of ``devtools.ncclwheels.NCCL_WHEELS`` (the releases the tests use) is
checked against its row with the library's own strings
(:func:`devtools.ncclwheels.loading_check`); the rows were read in NVIDIA/nccl at the tags
they cite. The same check over every release on PyPI is ``python -m devtools.ncclwheels
sweep VERSION=PROJECT ...`` (docs/fingerprint.md, "Loading rules by release").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from devtools.ncclwheels import NCCL_WHEELS, loading_check
from ncclguard.fingerprint import loading
from ncclguard.fingerprint.loading import EXECUTABLE, ROWS, own_names, rules_for

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def lib_bytes(nccl_lib: Callable[[str], Path]) -> Callable[[str], bytes]:
    memo: dict[str, bytes] = {}

    def get(version: str) -> bytes:
        if version not in memo:
            memo[version] = nccl_lib(version).read_bytes()
        return memo[version]

    return get


@pytest.mark.parametrize("version", sorted(NCCL_WHEELS, key=loading.parse_version))
def test_every_release_the_tests_use_agrees_with_its_row(version: str, lib_bytes) -> None:
    v = loading.parse_version(version)
    assert v is not None
    assert loading_check(lib_bytes(version), v) == []
    assert rules_for(v).caveat is None


@pytest.mark.parametrize(
    ("version", "rules_of", "wrong"),
    [
        # 2.30.4 read with 2.30.7's rules: no libnccl-rma, no NCCL_RMA_PLUGIN in its strings
        ("2.30.4", (2, 30, 7), {"rma: libnccl-rma", "rma: NCCL_RMA_PLUGIN",
                                "rma: libnccl-rma.so"}),
        # 2.19.3 with 2.21.5's: no default tuner name, no libnccl-tuner-%s.so
        ("2.19.3", (2, 21, 5), {"tuner: libnccl-tuner", "tuner: libnccl-tuner-%s.so"}),
        # 2.23.4 with 2.22.3's: the profiler is there
        ("2.23.4", (2, 22, 3), {"profiler: the strings name ncclProfiler_vN",
                                "profiler: libnccl-profiler", "profiler: NCCL_PROFILER_PLUGIN"}),
        # 2.28.9 with 2.26.2's: the env plugin, GIN in the net library, none, lists
        ("2.28.9", (2, 26, 2), {"env: the strings name ncclEnvPlugin_vN",
                                "gin: the strings name ncclGinPlugin_vN",
                                "env: libnccl-env", "env: NCCL_ENV_PLUGIN"}),
    ],
)
def test_the_check_tells_a_wrong_row(version, rules_of, wrong, lib_bytes) -> None:
    got = loading_check(lib_bytes(version), rules_of)
    assert {re.sub(r"[:,] the \d.*", "", p) for p in got} == wrong, got


def test_a_kind_the_table_does_not_know_is_reported(lib_bytes) -> None:
    """A future release with a log plugin (NCCL_LOG_PLUGIN, libnccl-log.so, in NCCL's tree
    after 2.32.3): its strings would not agree with the newest row."""
    data = lib_bytes("2.32.3") + b"\0NCCL_LOG_PLUGIN\0libnccl-log.so\0"
    assert loading_check(data, (2, 32, 3)) == [
        "the strings name NCCL_LOG_PLUGIN: a kind the table does not know",
        "the strings name libnccl-log: a kind the table does not know",
    ]


def test_rows_are_ordered_and_cite_their_evidence() -> None:
    releases = [r.release for r in ROWS]
    assert releases == sorted(set(releases))
    for r in ROWS:
        assert re.match(rf"v{re.escape(r.label)}-1[:, ]", r.source), r.source  # its own tag
        assert re.search(r"src/\S+\.cc", r.source), r.source


def test_the_newest_rows_cite_the_commit_they_were_read_at() -> None:
    """No v2.31/v2.32 tag in NVIDIA/nccl as fetched: 2.31.2 and 2.32.3 were read at the
    commits whose makefiles/version.mk say so (889806836, 12df1a11)."""
    by = {r.label: r.source for r in ROWS}
    assert by["2.31.2"].startswith(
        "v2.31.2-1 (commit 889806836097808572f87a2019eefd01f27aae68): src/plugin/rma.cc")
    assert by["2.32.3"].startswith(
        "v2.32.3-1 (commit 12df1a11afad322be5a204a2db890161cbf8131d): src/plugin/rma.cc")


def test_docs_show_every_row() -> None:
    text = (REPO / "docs" / "fingerprint.md").read_text()
    table = text[text.index("## Loading rules by release"):]
    for r in ROWS:
        assert re.search(rf"^\| {re.escape(r.label)} \|", table, re.M), r.label
        tag = r.source.split(":")[0].split(",")[0].split(" ")[0]
        if tag.startswith("v"):
            assert tag in table, tag


@pytest.mark.parametrize(
    ("v", "kind", "want"),
    [
        ((2, 18, 3), "tuner", None),
        ((2, 19, 1), "tuner", (None, loading.GIVEN, ())),
        ((2, 20, 5), "tuner", (None, loading.GIVEN, ())),
        ((2, 21, 5), "tuner", ("libnccl-tuner.so", loading.BOTH, (loading.NET_NAMES,))),
        ((2, 26, 2), "tuner", ("libnccl-tuner.so", loading.BOTH, (loading.NET,))),
        ((2, 22, 3), "profiler", None),
        ((2, 25, 1), "profiler", ("libnccl-profiler.so", loading.GIVEN, ())),
        ((2, 27, 7), "profiler", ("libnccl-profiler.so", loading.BOTH_UNLESS, ())),
        ((2, 28, 3), "profiler", ("libnccl-profiler.so", loading.BOTH_UNLESS, (loading.NET,))),
        ((2, 28, 3), "env", None),
        ((2, 28, 9), "env", ("libnccl-env.so", loading.BOTH_UNLESS, ())),
        ((2, 29, 3), "gin", (None, loading.BOTH_UNLESS, (loading.NET,))),
        ((2, 29, 7), "gin", ("libnccl-gin.so", loading.BOTH_UNLESS, (loading.NET,))),
        ((2, 30, 7), "rma", ("libnccl-rma.so", loading.BOTH_UNLESS, (loading.NET,))),
        # rma.cc v2.31.2-1 and v2.32.3-1: GIN's library is listed before the net plugin's,
        # but init.cc (v2.31.2-1) runs ncclRmaInit before ncclGinInit: never open then
        ((2, 31, 2), "rma", ("libnccl-rma.so", loading.BOTH_UNLESS, (loading.NET,))),
        ((2, 32, 3), "rma", ("libnccl-rma.so", loading.BOTH_UNLESS, (loading.NET,))),
        ((2, 32, 3), "gin", ("libnccl-gin.so", loading.BOTH_UNLESS, (loading.NET,))),
    ],
)
def test_rules_per_release(v, kind, want) -> None:
    rule = rules_for(v).kinds.get(kind)
    got = None if rule is None else (rule.default, rule.names, rule.fallbacks)
    assert got == want


def test_external_rma_and_own_gin_by_release() -> None:
    assert not rules_for((2, 28, 9)).kinds["gin"].own
    assert rules_for((2, 29, 7)).kinds["gin"].own
    assert not rules_for((2, 30, 4)).kinds["rma"].external
    assert rules_for((2, 30, 7)).kinds["rma"].external
    assert "rma" not in rules_for((2, 29, 7)).kinds


def test_caveats_name_the_rows_used() -> None:
    assert rules_for((2, 31, 2)).caveat is None and rules_for((2, 31, 2)).row == "2.31.2"
    assert rules_for((2, 31, 9)).row == "2.31.2" and rules_for((2, 32, 2)).row == "2.31.2"
    assert rules_for((2, 32, 3)).caveat is None
    newer = rules_for((2, 32, 6))
    assert newer.row == "2.32.3" and newer.kinds == rules_for((2, 32, 3)).kinds
    assert newer.caveat == ("libnccl 2.32.6 is newer than the newest release in the "
                            "loading-rules table (2.32.3): read with that release's rules")
    assert rules_for((3, 0, 0)).caveat is not None
    older = rules_for((2, 4, 2))
    assert older.row == "2.10.3" and "older than the oldest release" in (older.caveat or "")
    unknown = rules_for(None)
    assert unknown.row == "2.32.3" and "version is unknown" in (unknown.caveat or "")


@pytest.mark.parametrize(
    ("kind", "value", "v", "want"),
    [
        ("tuner", None, (2, 19, 3), []),
        ("tuner", "", (2, 19, 3), [[EXECUTABLE]]),  # dlopen(""): the main program
        ("tuner", "x", (2, 20, 5), [["x"]]),
        ("tuner", "", (2, 21, 5), [["libnccl-tuner.so"]]),
        ("tuner", "static", (2, 21, 5), [["static", "libnccl-tuner-static.so"]]),
        ("tuner", "static", (2, 22, 3), [[EXECUTABLE, "libnccl-tuner-static.so"]]),
        ("tuner", "STATIC_PLUGINX", (2, 28, 9), [["STATIC_PLUGINX",
                                                  "libnccl-tuner-STATIC_PLUGINX.so"]]),
        ("tuner", "None", (2, 27, 7), [["None", "libnccl-tuner-None.so"]]),
        ("tuner", "None", (2, 28, 3), None),  # off: no fallback either
        ("profiler", "p", (2, 24, 3), [["p"]]),
        ("gin", "none", (2, 30, 7), []),  # an empty list: the net plugin's is still tried
        ("gin", "", (2, 30, 7), []),
        ("gin", "a,,b", (2, 30, 7), [["a", "libnccl-gin-a.so"], ["b", "libnccl-gin-b.so"]]),
        ("rma", "x", (2, 30, 4), []),  # no library of its own
        ("env", "/opt/e.so", (2, 30, 7), [["/opt/e.so"]]),
    ],
)
def test_own_names(kind, value, v, want) -> None:
    assert own_names(kind, value, rules_for(v)) == want


def test_lists_keep_what_nccl_keeps() -> None:
    """net.cc/gin.cc/rma.cc: at most 14 / 15 (2.29.7) / 13 (2.30.7) items, RMA 12 from
    2.32.3 (rma.cc v2.32.3-1: four places reserved, NCCL_RMA_MAX_PLUGINS 16); an item of
    255 bytes or more is skipped and does not count."""
    many = ",".join(f"p{i}" for i in range(20))
    assert len(own_names("net", many, rules_for((2, 30, 7))) or []) == 14
    assert len(own_names("gin", many, rules_for((2, 29, 7))) or []) == 15
    assert len(own_names("gin", many, rules_for((2, 30, 7))) or []) == 13
    assert len(own_names("rma", many, rules_for((2, 30, 7))) or []) == 13
    assert len(own_names("rma", many, rules_for((2, 31, 2))) or []) == 13
    twelve = own_names("rma", many, rules_for((2, 32, 3))) or []
    assert len(twelve) == 12 and twelve[-1] == ["p11", "libnccl-rma-p11.so"]
    assert len(own_names("gin", many, rules_for((2, 32, 3))) or []) == 13
    assert len(own_names("net", many, rules_for((2, 32, 3))) or []) == 14
    long = "x" * 255
    assert own_names("net", f"{long},a", rules_for((2, 30, 7))) == [["a", "libnccl-net-a.so"]]
    assert own_names("net", f"{long[:-1]}", rules_for((2, 30, 7))) == [
        [long[:-1], f"libnccl-net-{long[:-1]}.so"]]
