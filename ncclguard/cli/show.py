"""``ncclguard show NODE``: one node's whole fingerprint, readable, with its probe errors,
what it adds to a job's own NCCL release by release, and whether the canary holds it
(docs/cli.md, docs/canary.md)."""

from __future__ import annotations

from typing import Any

import click

from ncclguard.cli import output as out
from ncclguard.cli.canary import held_doc, held_text, holds
from ncclguard.cli.context import Ctx, format_options, get_ctx
from ncclguard.cli.errors import fail
from ncclguard.cli.inventory import NO_HOST_NCCL
from ncclguard.fingerprint import offers
from ncclguard.policy.freshness import is_stale

__all__ = ["show"]

#: show's columns that wrap rather than being cut to fit (a path, a field, an error: read
#: whole); the others (a plugin's ABIs, an address list) are cut
_LONG = ("path", "plugin", "via", "field", "error", "version_error", "reason")
SHOWN_STEPS = 20  # the last job steps seen on the node, with what they loaded


def _load_one(c: Ctx, host: str) -> Any:
    rec = c.inv("load", [host]).get(host)
    if rec is None:
        fail(f"{host}: not in the inventory {c.inventory.path}")
    return rec


def _abi_summary(abis: Any) -> str:
    """``tuner v6-v2 profiler v7-v1 env v2-v1 gin v14-v13 rma v16-v13`` (what is there)."""
    if not isinstance(abis, dict):
        return ""
    parts = []
    for kind in ("tuner", "profiler", "env", "gin", "rma"):
        vs = [v for v in abis.get(kind) or () if isinstance(v, int)]
        if vs:
            parts.append(f"{kind} v{max(vs)}" + (f"-v{min(vs)}" if len(vs) > 1 else ""))
    return " ".join(parts)


def _in_force(fp: dict[str, Any]) -> list[dict[str, Any]]:
    from ncclguard.fingerprint.fields import plugins_in_force

    return plugins_in_force(fp)


def _obj(x: Any) -> dict[str, Any]:
    """A part that should be an object; any other stored shape shows as empty."""
    return x if isinstance(x, dict) else {}


def _objs(x: Any) -> list[dict[str, Any]]:
    """A part that should be a list of objects: its objects (any stored shape)."""
    return [i for i in x if isinstance(i, dict)] if isinstance(x, list) else []


def _adds_rows(fp: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per release of the table: the plugin each kind gives it on this node
    ("none": that release loads no such plugin; "unknown": the record does not say)."""
    got = offers.read(fp)
    every = got[0] if got is not None else dict.fromkeys(offers.KINDS)
    picked = {k: None if sel is None else dict(sel) for k, sel in every.items()}
    rows = []
    for release in offers.RELEASES:
        row: dict[str, Any] = {"release": release.label}
        for kind in offers.KINDS:
            sel = picked[kind]
            row[kind] = out.UNKNOWN if sel is None else sel.get(release.label, out.NONE)
        rows.append(row)
    return rows



def _show_text(rec: Any, now: float, ttl: float, klass: str | None,
               width: int | None = None, held: str | None = None) -> str:
    from ncclguard.fingerprint.fields import plugins_in_force

    fp = rec.fingerprint
    from ncclguard.policy.fpdiff import derived

    d = derived(fp)
    age = now - rec.last_heartbeat
    hostless = d.get("compat.nccl") == "none"
    parts = [out.wrap(out.section(f"node {rec.host}", out.kv([
        ("class", klass or "-"),
        *([("canary", held)] if held else []),
        ("nccl", out.known(d.get("compat.nccl"))),
        ("net plugin", NO_HOST_NCCL if hostless else out.known(d.get("compat.net_plugin"))),
        ("net ABI", NO_HOST_NCCL if hostless else out.known(d.get("compat.net_abi"))),
        ("adds", out.known(d.get("compat.adds"))),
        ("transport", out.known(d.get("compat.transport"))),
        ("last heartbeat", f"{out.iso(rec.last_heartbeat)} ({out.age(age)} ago"
                           + (", STALE)" if is_stale(rec.last_heartbeat, now, ttl) else ")")),
        ("collected at", out.iso(rec.collected_at)), ("first seen", out.iso(rec.first_seen)),
        ("fingerprint", rec.fp_hash[:16]),
    ])), width)]
    host = _obj(fp.get("host"))
    parts.append(out.section("host", out.kv([(k, host.get(k)) for k in
                                             ("kernel", "boot_id", "tool_version")])))
    libs = [{**x, "abi_net": _obj(x.get("abis")).get("net"),
             "abi_other": _abi_summary(x.get("abis"))} for x in _objs(fp.get("libnccl"))]
    parts.append(out.section("libnccl", out.table(libs, [
        ("path", "PATH"), ("version", "VERSION"), ("cuda_version", "CUDA"),
        ("abi_net", "NET ABIS"), ("abi_other", "OTHER PLUGIN ABIS"), ("default", "DEFAULT"),
        ("origin", "ORIGIN"), ("version_error", "ERROR")], width, wrap=_LONG)))
    plugins = [{**x, "abi": _obj(x.get("abis")).get(str(x.get("kind")))}
               for x in _objs(fp.get("plugins"))]
    parts.append(out.section("plugins", out.table(plugins, [
        ("kind", "KIND"), ("path", "PATH"), ("name", "NAME"), ("abi", "ABIS"),
        ("default", "DEFAULT"), ("origin", "ORIGIN"), ("error", "ERROR")], width, wrap=_LONG)))
    net = _obj(fp.get("net"))
    parts.append(out.section("net (default libnccl x default net plugin)", out.kv(
        [(k, net.get(k)) for k in ("libnccl", "plugin", "effective_net_abi", "reason")])))
    parts.append(out.section("plugins in force (default libnccl x the library NCCL loads "
                             "for each kind)", out.table(_objs(plugins_in_force(fp)), [
        ("kind", "KIND"), ("plugin", "PLUGIN"), ("via", "VIA"), ("name", "NAME"),
        ("abi", "ABI"), ("reason", "REASON")], width, wrap=_LONG)))
    parts.append(out.section("what the node adds to a job's own NCCL, by release (issue 39)",
                             out.table(_adds_rows(fp), [
                                 ("release", "NCCL"), *((k, k.upper()) for k in offers.KINDS)],
                                 width)))
    rdma = _obj(fp.get("rdma"))
    ports = [{"device": dv.get("name"), "fw_ver": dv.get("fw_ver"),
              "hca_type": dv.get("hca_type"), **p}
             for dv in _objs(rdma.get("devices")) for p in _objs(dv.get("ports")) or [{}]]
    abi = _obj(rdma.get("abi_version"))
    ibv = _obj(rdma.get("libibverbs"))
    parts.append(out.section("rdma", out.kv([
        ("verbs ABI", abi.get("verbs")), ("mad ABI", abi.get("mad")),
        ("libibverbs", f"{ibv.get('path')} {ibv.get('version') or ''}".strip()
         if ibv else None),
        ("providers", rdma.get("providers"))]) + out.table(ports, [
            ("device", "DEVICE"), ("port", "PORT"), ("state", "STATE"),
            ("phys_state", "PHYS"), ("rate", "RATE"), ("link_layer", "LINK"),
            ("fw_ver", "FIRMWARE"), ("hca_type", "HCA")], width)))
    parts.append(out.section("netifs", out.table(_objs(fp.get("netifs")), [
        ("name", "NAME"), ("up", "UP"), ("addresses", "ADDRESSES")], width)))
    conf = _obj(fp.get("nccl_conf"))
    settings = _obj(conf.get("settings"))
    parts.append(out.section("nccl.conf", out.kv(
        [("path", conf.get("path")), ("present", conf.get("present"))]
        + [(str(k), v) for k, v in sorted(settings.items(), key=lambda kv: str(kv[0]))])))
    gpu = _obj(fp.get("gpu"))
    parts.append(out.section("gpu", out.kv([(k, gpu.get(k)) for k in
                                            ("driver_version", "count", "models", "peermem")])))
    errs = _objs(fp.get("errors"))
    parts.append(out.section(f"probe errors ({len(errs)})", out.table(errs, [
        ("probe", "PROBE"), ("field", "FIELD"), ("path", "PATH"), ("error", "ERROR")], width,
        keep=("path",), wrap=_LONG)
        if errs else "  none\n"))
    return "\n".join(parts)


@click.command()
@click.argument("node")
@format_options
def show(node: str, as_json: bool, as_csv: bool) -> None:
    """The whole fingerprint of NODE, readable, with probe errors."""
    c = get_ctx(as_json, as_csv)
    if c.fmt == "csv":
        fail("--csv is not available for show (a fingerprint is not rows); use --json")
    rec = _load_one(c, node)
    klass = c.class_names().get(rec.host)
    hold = holds(c, [rec.host]).get(rec.host)
    age = c.now - rec.last_heartbeat
    doc = {
        "host": rec.host, "class": klass, "held": held_text(hold), "canary": held_doc(hold),
        "fp_hash": rec.fp_hash,
        "first_seen": out.iso(rec.first_seen), "collected_at": out.iso(rec.collected_at),
        "last_heartbeat": out.iso(rec.last_heartbeat), "age_s": round(age, 1),
        "stale": is_stale(rec.last_heartbeat, c.now, c.stale_after),
        "errors": rec.fingerprint.get("errors") or [],
        "in_force": _in_force(rec.fingerprint),
        "fingerprint": rec.fingerprint,
    }
    # the evidence of what its processes last loaded (docs/runtime.md): its last steps
    from ncclguard.store import InventoryError

    try:
        seen = c.inventory.host_loads(rec.host, limit=SHOWN_STEPS)
    except InventoryError:
        seen = []
    doc["job_loads"] = seen
    text = None
    if c.fmt == "table":
        text = _show_text(rec, c.now, c.stale_after, klass, c.width, held_text(hold))
        if seen:
            from ncclguard.policy.loaded import shown_lib

            rows = [{"job": f"{x['job']}.{x['step']}",
                     "loaded": ", ".join(shown_lib(lib) for lib in x["libs"]
                                         if lib.get("kind") != "ibverbs"),
                     "seen": out.iso(x["seen_at"]),
                     "state": "running" if x["gone_at"] is None else "ended"} for x in seen]
            text = (text.rstrip("\n") + f"\n\nwhat its job steps loaded (the last "
                    f"{len(rows)}, ncclguard jobs):\n"
                    + out.table(rows, [("job", "STEP"), ("loaded", "LOADED"),
                                       ("seen", "SEEN"), ("state", "STATE")], c.width,
                                wrap=("loaded",)))
    c.emit(doc, text=text)
