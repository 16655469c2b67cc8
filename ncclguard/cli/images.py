"""``ncclguard images``: the container image index (docs/containers.md).

``images`` lists the indexed images, squashfs files and registry references;
``images show IMAGE`` prints one image's NCCL stack; ``images diff A B`` the facts in
which two images differ. IMAGE is a path (``/`` or ``.``) or a registry reference as
pyxis takes it (``nvcr.io#nvidia/pytorch:25.01-py3``).
"""

from __future__ import annotations

from typing import Any

import click

from ncclguard.cli import output as out
from ncclguard.cli.context import format_options, get_ctx
from ncclguard.cli.errors import fail

COLUMNS: list[out.Column] = [
    ("path", "IMAGE"), ("nccl_version", "NCCL"), ("net_plugin", "NET PLUGIN"),
    ("size", "SIZE"), ("scanned", "SCANNED"), ("digest12", "DIGEST"), ("error", "ERROR"),
]


@click.group(invoke_without_command=True)
@format_options
@click.pass_context
def images(ctx: click.Context, as_json: bool, as_csv: bool) -> None:
    """Squashfs images under [images] roots and the registry references the collector
    resolved ([registry]): the NCCL each holds, or why it could not be read."""
    if ctx.invoked_subcommand is not None:
        return
    c = get_ctx(as_json, as_csv)
    rows = c.inv("images")
    for r in rows:
        r["scanned"] = out.iso(r["scanned_at"])
        rec = (c.inv("image", r["path"]) or {}).get("record") or {}
        r["net_plugin"] = _plugin_text(rec)
        r["error"] = r["error"] or ""
        r["digest12"] = ""
    for t in c.inv("registry_images"):
        row = _registry_row(c.inv("registry_image", t["ref"]))
        row["net_plugin"] = _plugin_text(row.get("record") or {})
        row["digest12"] = (row.get("digest") or "")[:19]
        row.pop("record", None)
        rows.append(row)
    text = None
    if c.fmt == "table":
        text = out.table(rows, COLUMNS, c.width) + f"{len(rows)} images\n"
    c.emit(lambda: {"count": len(rows), "images": rows}, rows=rows, columns=COLUMNS, text=text)


def _plugin_text(rec: dict[str, Any]) -> str:
    net = rec.get("net_plugin")
    for p in rec.get("plugins") or []:
        if p.get("path") == net:
            abis = p.get("abis", {}).get("net") or []
            span = f"v{abis[0]}..v{abis[-1]}" if abis else "no ABI"
            return f"{p.get('name') or net} ({span})"
    return "none" if rec else ""


def _registry_row(t: dict[str, Any]) -> dict[str, Any]:
    """A registry reference's row in the shape of a squashfs image's."""
    error = t.get("image_error") or (None if t.get("state") == "ok" else
                                     f"{t.get('state')}: {t.get('error')}")
    return {"path": t["ref"], "size": t.get("size"), "scanned_at": t.get("scanned_at"),
            "scanned": out.iso(t["resolved_at"]) if t.get("resolved_at") else "",
            "nccl_version": t.get("nccl_version"), "error": error or "",
            "digest": t.get("digest"), "resolved_at": t.get("resolved_at"),
            "moved_at": t.get("moved_at"), "record": t.get("record")}


def _get(c: Any, name: str) -> dict[str, Any]:
    from ncclguard.policy.rules.container import is_path_image

    if is_path_image(name):
        row = c.inv("image", name)
        if row is None:
            fail(f"{out.cell(name)}: not in the image index (is it under [images] roots, "
                 "and has the collector scanned it?)")
        assert isinstance(row, dict)
        return row
    from ncclguard.fingerprint.imageref import RefError, parse

    try:
        key = parse(name).key
    except RefError as e:
        fail(f"{out.cell(name)}: {e}")
    t = c.inv("registry_image", key)
    if t is None:
        fail(f"{out.cell(key)}: not in the registry index ([registry] enabled, and refs or "
             "a job that used it; resolved at the collector's next pass)")
    return _registry_row(t)


def facts(row: dict[str, Any]) -> dict[str, Any]:
    """The comparable facts of an image, flat: ``libnccl[path].version`` and so on."""
    rec = row.get("record") or {}
    f: dict[str, Any] = {"error": row.get("error")}
    for lib in rec.get("libnccl") or []:
        key = f"libnccl[{lib['path']}]"
        f[f"{key}.version"] = lib.get("version")
        f[f"{key}.sha256"] = lib.get("sha256")
        f[f"{key}.net_abis"] = (lib.get("abis") or {}).get("net")
        f[f"{key}.default"] = lib.get("default")
    for p in rec.get("plugins") or []:
        key = f"plugins[{p['path']}]"
        f[f"{key}.name"] = p.get("name")
        f[f"{key}.abis"] = {k: v for k, v in (p.get("abis") or {}).items() if v}
        f[f"{key}.sha256"] = p.get("sha256")
    f["net_plugin"] = rec.get("net_plugin")
    for k, v in ((rec.get("nccl_conf") or {}).get("settings") or {}).items():
        f[f"nccl_conf.{k}"] = v
    for k, v in (rec.get("env") or {}).items():
        f[f"env.{k}"] = v
    return f


@images.command()
@click.argument("path")
@format_options
def show(path: str, as_json: bool, as_csv: bool) -> None:
    """One image's NCCL stack: every libnccl, its plugins, nccl.conf and environment."""
    c = get_ctx(as_json, as_csv)
    row = _get(c, path)
    rec = row.get("record") or {}
    v = out.cell  # every value from the image, escaped
    when = out.iso(row["scanned_at"]) if row.get("scanned_at") else "not yet"
    lines = [f"image {v(row['path'])} ({row['size']} bytes, scanned {when})"]
    if row.get("digest"):
        lines.append(f"  digest {v(row['digest'])}, resolved {out.iso(row['resolved_at'])}, "
                     f"last moved {out.iso(row['moved_at'])}")
    if row.get("error"):
        lines.append(f"  not readable: {v(row['error'])}")
    for lib in _dicts(rec.get("libnccl")):
        mark = " (loaded)" if lib.get("default") else ""
        ver = lib.get("version") or f"unknown: {lib.get('version_error')}"
        abis = (lib.get("abis") or {}).get("net") or []
        lines.append(f"  libnccl {v(lib.get('path'))} -> {v(lib.get('realpath'))}: {v(ver)}"
                     f"{mark}, net ABIs {v(str(abis))} [{v(lib.get('origin'))}]")
    for p in _dicts(rec.get("plugins")):
        mark = " (loaded)" if p.get("default") else ""
        abis = {k: x for k, x in (p.get("abis") or {}).items() if x}
        lines.append(f"  plugin {v(p.get('kind'))} {v(p.get('path'))}: {v(p.get('name'))} "
                     f"{v(str(abis))}{mark}"
                     + (f" error: {v(p['error'])}" if p.get("error") else ""))
    conf = rec.get("nccl_conf") or {}
    if conf.get("present"):
        lines.append(f"  /etc/nccl.conf: {v(str(conf.get('settings')))}")
    if rec.get("env"):
        lines.append(f"  environment: {v(str(rec['env']))}")
    for e in _dicts(rec.get("errors")):
        lines.append(f"  error {v(e.get('field'))} {v(e.get('path') or '')}: "
                     f"{v(e.get('error'))}")
    judged = _classes_running(c, row["path"])
    row["classes"] = judged
    for what, label in (("runs", "runs on"), ("not", "cannot run on"),
                        ("mixed", "some nodes run it, others not, in")):
        if judged[what]:
            lines.append(f"  {label}: " + ", ".join(
                f"{v(k['class'])} ({v(k['nodes'])})" for k in judged[what]))
    lines.append(f"  job_submit.lua: {v(judged['lua'])}")
    c.emit(row, text="\n".join(lines) + "\n")


def _classes_running(c: Any, key: str) -> dict[str, Any]:
    """Which classes' nodes run the image without an ``image-stack`` finding, which do
    not, and in which some nodes do and others not, and what job_submit.lua does with a
    job in it: the features daemon's judgement (its classes, ``sync.desired``; its reads,
    ``imagelines.image_judged``; each class through ``runnable_classes``), though not the file
    itself (it is on the controller), nor its cap of 256 lines."""
    from ncclguard.hostlist import compress
    from ncclguard.sched import imagelines, sync

    out: dict[str, Any] = {"runs": [], "not": [], "mixed": [], "lua": ""}
    values, _until, why = imagelines.image_judged(c.config, c.inventory, key, c.now)
    hosts = c.inv("hosts")
    classes = sync.desired(c.config, hosts, c.now, c.inventory)
    members: dict[str, list[str]] = {}
    for h, cls in classes.items():
        if cls is not None:
            members.setdefault(cls, []).append(h)
    if values is None:
        out["lua"] = f"no line for it ({why}): a job in it gets its partition's group"
        return out
    samples = imagelines.samples_of(c.inventory, classes)
    for cls, able in imagelines.class_judgements(values, samples).items():
        what = "mixed" if able is None else ("runs" if able else "not")
        out[what].append({"class": cls, "nodes": compress(sorted(members.get(cls, [])))})
    if out["mixed"]:
        out["lua"] = ("no line for it (one class feature cannot say which of its nodes run "
                      "it): a job in it gets its partition's group, the gate decides")
    elif not out["not"]:
        out["lua"] = "no line for it (every class runs it): a job in it gets its partition's group"
    elif not out["runs"]:
        out["lua"] = "a job in it that must span nodes is refused at submit (no class runs it)"
    else:
        out["lua"] = ("a job in it is offered only "
                      + ", ".join(k["class"] for k in out["runs"]))
    return out


def _dicts(items: Any) -> list[dict[str, Any]]:
    return [x for x in items if isinstance(x, dict)] if isinstance(items, list) else []


@images.command()
@click.argument("a")
@click.argument("b")
@format_options
def diff(a: str, b: str, as_json: bool, as_csv: bool) -> None:
    """The facts in which two indexed images differ (exit 1 when they differ)."""
    c = get_ctx(as_json, as_csv)
    fa, fb = facts(_get(c, a)), facts(_get(c, b))
    rows = [{"field": k, "a": fa.get(k), "b": fb.get(k)}
            for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]
    cols: list[out.Column] = [("field", "FIELD"), ("a", a), ("b", b)]
    text = None
    if c.fmt == "table":  # the images named above the table: a path as a header took
        # the width of the fields (FIELD was cut to 6 columns)
        short: list[out.Column] = [("field", "FIELD"), ("a", "A"), ("b", "B")]
        text = (out.kv([("A", a), ("B", b)], indent=0)
                + (out.table(rows, short, c.width, wrap=("field",)) if rows else "")
                + f"{len(rows)} differences\n")
    c.emit(lambda: {"a": a, "b": b, "differences": rows}, rows=rows, columns=cols, text=text)
    if rows:
        raise click.exceptions.Exit(1)
