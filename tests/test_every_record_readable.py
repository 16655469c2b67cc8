"""Every record the collector stores can be read by every command (issue 25).

Each part of a fingerprint, and the fields the commands read inside them, is given
each odd JSON shape a node could sign. What the collector's checks let through
(:func:`ncclguard.spool.parse_payload`, then the store's own derivation in
:meth:`~ncclguard.store.Inventory.ingest`: the collector's acceptance path without the
credential) is stored; then every command reads the inventory and must answer (exit 0,
1 or 2), never fail with an internal error. Rows written before the checks existed (a
fingerprint 900 levels deep, a history diff that is not JSON) are read too."""

from __future__ import annotations

import copy
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from helpers.cli import run_cli
from helpers.fingerprints import fingerprint

from ncclguard import audit, spool
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory
from ncclguard.store.inventory import Published

ODD: list[Any] = [5, "x", None, True, [], {}, [5], ["x"], [None], {"a": 1}, [{}], -1.5]
#: (path inside the fingerprint, as keys and list indexes) each odd value goes to
PLACES: list[tuple[Any, ...]] = [
    ("libnccl",), ("libnccl", 0), ("libnccl", 0, "version"), ("libnccl", 0, "abis"),
    ("libnccl", 0, "abis", "net"), ("libnccl", 0, "path"), ("libnccl", 0, "default"),
    ("plugins",), ("plugins", 0), ("plugins", 0, "abis"), ("plugins", 0, "name"),
    ("plugins", 0, "kind"), ("plugins", 0, "path"), ("net",), ("net", "plugin"),
    ("net", "effective_net_abi"), ("rdma",), ("rdma", "devices"), ("rdma", "devices", 0),
    ("rdma", "devices", 0, "ports"), ("rdma", "devices", 0, "ports", 0),
    ("rdma", "devices", 0, "ports", 0, "state"), ("rdma", "devices", 0, "ports", 0, "rate_gbps"),
    ("rdma", "abi_version"), ("rdma", "libibverbs"), ("netifs",), ("netifs", 0),
    ("netifs", 0, "addresses"), ("nccl_conf",), ("nccl_conf", "settings"), ("gpu",),
    ("gpu", "models"), ("gpu", "driver_version"), ("gpu", "count"), ("errors",),
    ("errors", 0), ("host", "kernel"), ("host", "collected_at"), ("effective",),
    ("containers",), ("containers", "net_plugin"),
]


def _put(fp: dict[str, Any], place: tuple[Any, ...], value: Any) -> bool:
    x: Any = fp
    for k in place[:-1]:
        try:
            x = x[k]
        except (KeyError, IndexError, TypeError):
            return False
    if isinstance(x, list) and not (isinstance(place[-1], int) and place[-1] < len(x)):
        return False
    x[place[-1]] = copy.deepcopy(value)
    return True


def _records() -> list[dict[str, Any]]:
    out = []
    n = 0
    for place in PLACES:
        for value in ODD:
            n += 1
            fp = fingerprint(f"h{n}", plugin_abi=8)
            fp["errors"] = [{"probe": "rdma", "field": "f", "path": "p", "error": "e"}]
            if _put(fp, place, value):
                out.append(fp)
    return out


@pytest.fixture(scope="module")
def odd_inventory(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    d = tmp_path_factory.mktemp("odd")
    db = d / "inventory.db"
    accepted: list[str] = []
    with Inventory(db, values=GATE_VALUES) as inv:
        inv.upsert(fingerprint("h0", plugin_abi=8), now=1000.0)
        for fp in _records():
            try:
                rec = spool.parse_payload(spool.payload(fp), max_bytes=1 << 24)
            except (spool.RecordError, ValueError):
                continue  # rejected by the collector before the store
            host = rec.host
            # a change to it
            for i, body in enumerate((fingerprint(host, plugin_abi=8), rec.fingerprint)):
                p = Published(body, 1000.0 + i, f"{host}.rec", "1:1:1", f"d{i}{host}",
                              "10.0.0.1", 0, 1000.0 + i, i)
                (status,) = inv.ingest([p])
                if i and not status.startswith("invalid"):
                    accepted.append(host)
    # rows from before the checks: a fingerprint 900 levels deep, a diff that is no JSON
    deep = "[" * 900 + "]" * 900
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE nodes SET fingerprint = ? WHERE host = 'h0'",
                     (json.dumps({**fingerprint("h0", plugin_abi=8), "gpu": json.loads(deep)}),))
        conn.execute("UPDATE history SET diff = ? WHERE host = 'h0'", (deep,))
        conn.execute("INSERT INTO history (host, at, old_hash, new_hash, diff, fingerprint, "
                     "bytes, stored_at) VALUES ('h0', 1001, 'a', 'b', 'not json', "
                     "'not json', 0, 1001)")
    audit.append(d / "audit.jsonl", {"job": 1, "decision": "refuse", "action": "steer",
                                     "nodes": "h[0-3]", "summary": "x"})
    return db, accepted


def _commands(hosts: list[str]) -> list[list[str]]:
    every = ",".join(["h0", *hosts])
    out = [["nodes"], ["nodes", "--json"], ["nodes", "--csv"], ["nodes", "--errors"],
           ["classes"], ["classes", "--json"], ["history"], ["history", "--json"],
           ["rejections"], ["images"], ["decisions"], ["decisions", "--job", "1"],
           ["drain-recommend", "--nodes", every], ["check", every],
           ["check", every, "--json"], ["diff", every], ["show", "h0"],
           ["history", "h0"], ["fingerprint-at-check"]]
    for h in hosts:
        out += [["show", h], ["show", h, "--json"], ["history", h], ["diff", "h0", h],
                ["check", f"h0,{h}"]]
    return out


def test_the_collector_accepts_odd_shapes_and_every_command_reads_them(
        odd_inventory: tuple[Path, list[str]]) -> None:
    db, hosts = odd_inventory
    assert len(hosts) > 50  # most odd shapes are the node's to report, and stored
    conf = db.with_name("config.toml")
    conf.write_text(f'[gate]\naudit_log = "{db.with_name("audit.jsonl")}"\n')
    failed = []
    for args in _commands(hosts):
        if args == ["fingerprint-at-check"]:
            with Inventory(db, readonly=True) as inv:
                for h in ["h0", *hosts]:
                    inv.fingerprint_at(h, 5000.0)
                    inv.history(h)
            continue
        r = run_cli(*args, db=db, config=conf)
        if r.exit_code not in (0, 1, 2) or (r.exception is not None
                                             and not isinstance(r.exception, SystemExit)):
            failed.append((args, r.exit_code, repr(r.exception), r.output[-300:]))
    assert not failed, failed[:10]
