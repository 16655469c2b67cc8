"""``ncclguard check HOSTLIST``: the gate's verdict for any set of nodes, as if a job had
been given them (exit 0 accept, 1 warn, 2 refuse, 3 error).

It judges as the gate does, through the same path: the gate's read of the inventory
(``load_values``: the stored policy values, trusted only when their key and types check
out), :func:`~ncclguard.policy.evaluate_values`, the same stale nodes
(:func:`~ncclguard.policy.stale_hosts`), and the same tie-break
(:func:`~ncclguard.policy.break_tie`: keep the majority class of ``--partition``'s nodes
as Slurm lists them, else of the whole inventory).
"""

from __future__ import annotations

import click

from ncclguard.cli.context import (
    Ctx,
    SlurmUnreachable,
    expand_hosts,
    format_options,
    get_ctx,
    known_partition,
    partitions,
)
from ncclguard.cli.errors import DECISION_EXIT, EXIT_ERROR, fail
from ncclguard.text import safe

__all__ = ["check"]


def _job_nccl(env_dir: str) -> tuple[dict | None, str | None]:
    """``(what the job's libnccl is, None)`` or ``(None, why not)`` for ``--env DIR``:
    the environment such a job has (:func:`ncclguard.fingerprint.jobenv.locate`), and
    the library read by ``ncclguard-inventoryd read-nccl`` (bounded, as this user)."""
    import os

    from ncclguard.fingerprint.jobenv import locate
    from ncclguard.fingerprint.jobread import read_library

    base = os.path.abspath(env_dir)
    if not os.path.isdir(base):
        fail(f"--env {safe(env_dir)}: not a directory")
    if os.path.isfile(os.path.join(base, "pyvenv.cfg")):
        env = {"VIRTUAL_ENV": base}
    elif os.path.isdir(os.path.join(base, "conda-meta")):
        env = {"CONDA_PREFIX": base}
    else:
        env = {"LD_LIBRARY_PATH": base}
    found = locate(env, os.path.isfile)
    if found.path is None and found.source != "host":
        fail(f"--env {safe(env_dir)}: which libnccl.so.2 a job would load is "
             f"{safe(found.why)}")
    if found.path is None:
        fail(f"--env {safe(env_dir)}: no libnccl.so.2 there that a job would load "
             f"(read as {', '.join(env)}={safe(base)}; docs/jobs.md)")
    return read_library(found.path, found.source)


def _variables(given: tuple[str, ...]) -> dict[str, str]:
    """``--var NCCL_NAME=VALUE`` options as the gate takes a job's variables: the names
    it reads of a saved environment (``jobenv.NCCL_VARS``), the last of one name wins."""
    from ncclguard.fingerprint.jobenv import NCCL_VARS

    out: dict[str, str] = {}
    for item in given:
        name, eq, value = item.partition("=")
        if not eq:
            fail(f"--var {safe(item)}: give NCCL_NAME=VALUE")
        if name not in NCCL_VARS:
            fail(f"--var {safe(name)}: not one the gate reads of a job's environment "
                 f"({', '.join(NCCL_VARS)})")
        out[name] = value
    return out


def _members(c: Ctx, names: set[str]) -> list[str]:
    """The nodes of any of the partitions ``names``, as Slurm lists them; [] when Slurm
    cannot be reached (the tie-break then reads the whole inventory)."""
    try:
        parts = partitions(c)
    except SlurmUnreachable:
        return []
    return sorted({h for p in names for h in parts.get(p, [])})


@click.command()
@click.argument("hostlist")
@click.option("--partition", "-p", default=None,
              help="Judge as a job in this partition (the guarded-partition setting applies).")
@click.option("--image", default=None, metavar="IMAGE",
              help="Judge as a job with pyxis's --container-image=IMAGE: can this image "
                   "run on these nodes (a squashfs path from the image index, or a "
                   "registry reference the collector resolved).")
@click.option("--env", "env_dir", default=None, metavar="DIR",
              help="Judge as a job that brings its own NCCL: DIR is its virtualenv (a "
                   "pyvenv.cfg), its conda env (a conda-meta/) or the directory a module "
                   "puts on LD_LIBRARY_PATH (docs/jobs.md).")
@click.option("--var", "nccl_vars", multiple=True, metavar="NCCL_NAME=VALUE",
              help="Judge as a job whose environment sets this NCCL variable (repeat for "
                   "more): it wins over the nodes' /etc/nccl.conf, as at the gate "
                   "(docs/jobs.md). Not with --image.")
@format_options
def check(hostlist: str, partition: str | None, image: str | None, env_dir: str | None,
          nccl_vars: tuple[str, ...], as_json: bool, as_csv: bool) -> None:
    """The gate's verdict for a hypothetical allocation (exit 0 accept, 1 warn, 2 refuse)."""
    from ncclguard.policy import (
        break_tie,
        evaluate_env,
        evaluate_image,
        evaluate_nccl,
        stale_hosts,
    )

    c = get_ctx(as_json, as_csv)
    if c.fmt == "csv":
        fail("--csv is not available for check (a verdict is not rows); use --json")
    hosts = expand_hosts([hostlist], "HOSTLIST")
    if not hosts:
        fail("HOSTLIST: the hostlist is empty")
    if partition is not None:
        known_partition(c, partition)
    recs = c.inv("load_values", hosts)
    values = {h: (r[0] if r is not None else None) for h, r in recs.items()}
    stale = stale_hosts({h: r[1] for h, r in recs.items() if r is not None}, c.now,
                        c.stale_after)
    policy = c.config.policy
    if image and env_dir:
        fail("--image and --env: a job in a container loads the image's NCCL; give one")
    if image and nccl_vars:
        fail("--image and --var: a container does not read the node's /etc/nccl.conf "
             "(docs/containers.md); give one")
    variables = _variables(nccl_vars)
    if env_dir:
        job, why = _job_nccl(env_dir)
        verdict = evaluate_nccl(values, policy, job, why, stale, partition,
                                variables=variables)
        tie_break = None
    elif image:
        if image.startswith("./"):
            import os

            image = os.path.abspath(image)
        if image.startswith("/"):
            found = c.inv("load_image_values", image, check_file=True)
        else:  # a registry reference: judged as the gate judges it
            from ncclguard.fingerprint.imageref import RefError, parse
            from ncclguard.policy.rules.container import registry_image

            try:
                ref = parse(image)
            except RefError as e:
                fail(f"--image {safe(image)}: {e}")
            found = registry_image(c.inv("load_registry_values", ref.key), c.now,
                                   c.config.registry, ref.registry)
        verdict = evaluate_image(values, policy, image, found, stale, partition)
        tie_break = None
    else:
        verdict = evaluate_env(values, policy, variables, stale, partition)
        verdict, tie_break = break_tie(
            verdict,
            again=lambda prefer: evaluate_env(values, policy, variables, stale, partition,
                                              prefer),
            classes=lambda among: [k.hosts for k in c.inv("classes", among)],
            members=lambda names: _members(c, names),
        )
    if c.config.canary.enabled and len(hosts) > 1:  # held nodes, as the gate refuses them
        from ncclguard.policy.canary import gate_holds

        verdict, _ = gate_holds(verdict, c.inv("canary_holds", hosts), -1)
    decision = str(verdict.decision)
    doc = verdict.to_dict()
    if tie_break is not None:
        doc["tie_break"] = tie_break
    note = c.writer_note()  # a frozen inventory: the gate says the same in its log
    if note:
        doc["inventory"] = note
    text = None
    if c.fmt == "table":
        text = verdict.format_text().rstrip("\n") + "\n"
        text += f"  note: {safe(note)}\n" if note else ""
    c.emit(doc, text=text)
    ctx = click.get_current_context()
    ctx.exit(DECISION_EXIT.get(decision, EXIT_ERROR))
