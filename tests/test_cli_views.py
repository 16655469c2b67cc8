"""The views an admin reads (issue 46): one rendering of a fact in every view, ``none``
(there is none), ``unknown`` (it could not be read), ``-`` (nothing applies), in
``nodes``, ``classes``, ``show``, ``check``, ``drain-recommend`` and ``diff`` (docs/cli.md,
"Values: none, unknown, -"); and output that fits 100 columns, ``--wide`` for the rest."""

from __future__ import annotations

import re
from pathlib import Path

import helpers.fingerprints as pf
import pytest
from helpers.cli import Run, ok, runner
from helpers.inventory import NodeSpec, build, standard


def specs() -> dict[str, NodeSpec]:
    """The standard inventory and one node of each rendering: n17 has no net plugin, n18's
    NCCL version could not be read, n19 has no libnccl (no plugin in force: ``-``), n20 was
    sent by a daemon of issue 39 (what it adds is known)."""
    s = standard()
    s["n17"] = NodeSpec(plugin=False)
    s["n18"] = NodeSpec(nccl=None)
    s["n19"] = NodeSpec(extra={"libnccl": [], "net": {
        "libnccl": None, "plugin": pf.PLUGIN, "effective_net_abi": None,
        "reason": "no libnccl"}})
    s["n20"] = NodeSpec(extra={"offers": pf.offers_part(pf.plugin(abis=[8, 7, 6, 5]))})
    return s


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("views")
    # n05's older record had no net plugin: history shows the plugins part, a long value
    db = build(d / "inv.db", specs(), history={"n05": [NodeSpec(plugin=False, nccl="2.18.3")]})
    cfg = d / "config.toml"
    cfg.write_text("[drain]\nmax_share = 0.5\n")
    return db, cfg


@pytest.fixture
def run(env: tuple[Path, Path]) -> Run:
    return runner(*env)


def parse(text: str, first: str) -> list[dict[str, str]]:
    """The table whose header line starts with ``first`` (after its blank mark column):
    one dict per row, each cell cut at its header's column (cells may hold a space)."""
    lines = text.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith(first))
    header = lines[at]
    spans = [(m.start(), m.group()) for m in re.finditer(r"\S+(?: \S+)*", header)]
    rows = []
    for line in lines[at + 1:]:
        if not line.strip():
            break
        row = {}
        for i, (start, name) in enumerate(spans):
            end = spans[i + 1][0] if i + 1 < len(spans) else None
            row[name] = line[start:end].strip()
        rows.append(row)
    return rows


def by(rows: list[dict[str, str]], key: str) -> dict[str, dict[str, str]]:
    return {r[key]: r for r in rows}


def test_nodes_say_none_unknown_and_dash_as_classes_and_show_do(run: Run) -> None:
    """Before: ``nodes`` showed ``-`` for n17's absent plugin where ``classes`` and
    ``show`` said ``none``, ``-`` for n18's unreadable NCCL where ``check`` said
    ``unknown``, n19's plugin file by name where ``classes`` said ``-`` (no libnccl: none
    in force), and ADDS ``-`` for a record that does not say (``diff``: unknown)."""
    nodes = by(parse(ok(run("nodes", "--wide")).stdout, "HOST"), "HOST")
    assert nodes["n17"]["PLUGIN"] == "none" and nodes["n17"]["ABI"] == "0"
    assert nodes["n18"]["NCCL"] == "unknown"
    assert (nodes["n19"]["NCCL"], nodes["n19"]["PLUGIN"], nodes["n19"]["ABI"]) == (
        "none", "-", "-")
    assert nodes["n01"]["ADDS"] == "unknown" and nodes["n20"]["ADDS"] == "IBext_v8 v8..v5"
    classes = by(parse(ok(run("classes", "--wide")).stdout, "CLASS"), "HOSTS")
    for host, row in nodes.items():
        if host in classes:  # a class of its own: the same cells
            got = classes[host]
            assert [got[k] for k in ("NCCL", "PLUGIN", "ABI", "ADDS", "TRANSPORT")] == [
                row[k] for k in ("NCCL", "PLUGIN", "ABI", "ADDS", "TRANSPORT")], host
    assert "None" not in ok(run("classes", "--wide")).stdout  # ALSO DIFFERS said =None
    for host in ("n17", "n18", "n19", "n20"):
        kv = dict(re.findall(r"^  (\w[\w ]*?)  +(\S.*)$", ok(run("show", host)).stdout,
                             re.M)[:6])
        assert [kv["nccl"], kv["net plugin"], kv["net ABI"], kv["adds"], kv["transport"]] \
            == [nodes[host][k] for k in ("NCCL", "PLUGIN", "ABI", "ADDS", "TRANSPORT")], host


def test_show_by_release_says_none_and_unknown(run: Run) -> None:
    """show's table of what a node adds said ``-`` for a release that loads no plugin of a
    kind (``none`` in ADDS and every other view) and ``?`` for unknown."""
    grid = parse(ok(run("show", "n20")).stdout.split("by release (issue 39)\n", 1)[1], "NCCL")
    assert {r["NET"] for r in grid} <= {"none", "IBext_v8 v8", "IBext_v8 v7",
                                        "IBext_v8 v6", "IBext_v8 v5"}
    assert {r["TUNER"] for r in grid} == {"none"}
    grid = parse(ok(run("show", "n01")).stdout.split("by release (issue 39)\n", 1)[1], "NCCL")
    assert {r["NET"] for r in grid} == {"unknown"}


def test_check_drain_and_diff_say_none_and_unknown(run: Run) -> None:
    """The views that quote what the rules compare: the same words."""
    text = ok(run("check", "n[17-20]"), 2).stdout
    assert "nccl unknown: n18" in text and "net plugin none: n[17,19]" in text
    text = ok(run("drain-recommend")).stdout
    assert "net_plugin none (baseline IBext_v8)" in text
    assert "None" not in text
    text = ok(run("diff", "n01", "n17")).stdout
    assert re.search(r"^compat\.net_plugin +IBext_v8 +none ", text, re.M), text


# ---- widths: 100 columns, or wrapped by design; --wide for the rest ----------------------

#: The commands of an admin's first hour, each as it prints on the views' inventory.
COMMANDS = [("nodes",), ("classes",), ("drain-recommend",), ("diff", "n01", "n17"),
            ("diff", "n[01-20]"), ("history",), ("history", "n05"), ("check", "n[01-20]"),
            ("show", "n20")]


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_every_line_fits_100_columns(run: Run, cmd: tuple[str, ...]) -> None:
    """Issue 46: ``drain-recommend`` printed ~150 columns, ``diff`` ~190, ``nodes`` ~150."""
    from ncclguard.cli.output import WIDTH

    r = run(*cmd)
    assert r.exit_code in (0, 2), r.output
    wide = [ln for ln in r.stdout.splitlines() if len(ln) > WIDTH]
    assert not wide, "\n".join(wide)
    r2 = run(*cmd, "--wide")
    assert max(len(ln) for ln in r2.stdout.splitlines()) > WIDTH or cmd[0] == "show"


def test_wide_gives_every_value_whole(run: Run) -> None:
    """Without --wide a value is cut (ending in the one mark, …) or wrapped; with it, whole
    on one line, as JSON has it."""
    import json

    from ncclguard.cli.output import CUT, cell

    doc = json.loads(ok(run("drain-recommend", "--json")).stdout)
    reasons = [g["reason"] for s in doc["node_sets"] for g in s["groups"]]
    longest = max(reasons, key=len)
    assert len(longest) > 100
    narrow, wide = ok(run("drain-recommend")).stdout, ok(run("drain-recommend", "--wide")).stdout
    assert longest not in narrow and all(f"{r} " in wide for r in reasons)
    # the reason wraps: its words are all there, the lines after the first indented
    rows = narrow.split("REASON", 1)[1].splitlines()
    assert any(ln.startswith("  ncclguard") is False and ln.startswith("  ") for ln in rows)
    assert " ".join(w for ln in rows for w in ln.split()).count("(baseline") \
        == sum(r.count("(baseline") for r in reasons)
    # diff: a long value is cut with the mark, whole with --wide
    plugins = json.loads(ok(run("diff", "n01", "n17", "--json")).stdout)
    value = next(d for d in plugins["differences"] if d["field"] == "plugins")
    whole = cell(value["values"][0]["value"])  # a list of records: each as JSON
    assert len(whole) > 100
    narrow = ok(run("diff", "n01", "n17")).stdout
    assert whole not in narrow and re.search(rf"^plugins +\S.*{CUT} ", narrow, re.M)
    assert whole in ok(run("diff", "n01", "n17", "--wide")).stdout
    # --wide before the command, as --json may be
    assert ok(run("--wide", "nodes")).stdout == ok(run("nodes", "--wide")).stdout
    assert "LAST HEARTBEAT" in ok(run("nodes", "--wide")).stdout
    assert "LAST HEARTBEAT" not in ok(run("nodes")).stdout  # AGE says it


def test_the_cut_mark_is_never_a_values_own() -> None:
    """A value's own … is shown escaped, so that … at the end of a cell always means cut."""
    from ncclguard.cli.output import CUT, table

    rows = [{"a": "IBext" + CUT, "b": "x" * 200}]
    text = table(rows, [("a", "A"), ("b", "B")], 40)
    line = text.splitlines()[1]
    assert line.startswith("IBext\\u2026  ") and line.endswith(CUT) and len(line) == 40
    assert table(rows, [("a", "A"), ("b", "B")]).splitlines()[1].endswith("x" * 200)
