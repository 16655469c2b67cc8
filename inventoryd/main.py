"""ncclguard-inventoryd: "once" prints this node's fingerprint, "run" keeps its signed
record in the spool current, "collect" (on the controller) writes the inventory and serves
the cluster's metrics, "metrics" prints those once, and "features" (on the controller,
as SlurmUser) keeps Slurm's class features current.

argparse rather than click: the daemon runs on every node, and stays small.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ncclguard import config as configmod
from ncclguard.policy import load_config


def _controller_command(sub: Any, name: str, text: str) -> argparse.ArgumentParser:
    """A controller-side command, with --config and --db."""
    c: argparse.ArgumentParser = sub.add_parser(name, help=text, description=text)
    c.add_argument("--config", default=None, help="config file (default: $NCCLGUARD_CONFIG "
                   "or /etc/ncclguard/config.toml)")
    c.add_argument("--db", default=None, help="inventory database (overrides the config)")
    return c


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ncclguard-inventoryd",
        description="Fingerprint this node's NCCL communication stack (libnccl, NCCL "
        "plugins and their ABIs, RDMA ports, /etc/nccl.conf, GPU driver) and publish it, "
        "signed with MUNGE, to the spool; on the controller, collect the spool into the "
        "inventory. See docs/fingerprint.md and docs/collector.md.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (
        ("once", "collect this node's fingerprint once"),
        ("run", "collect, publish and heartbeat until SIGTERM (the node's systemd service)"),
    ):
        s = sub.add_parser(name, help=text, description=text)
        s.add_argument("--root", default="/", help="prefix for every path read (default: /)")
        s.add_argument("--hostname", default=None, help="node name (default: the short hostname)")
        s.add_argument("--config", default=None, help="config file (default: $NCCLGUARD_CONFIG "
                       "or /etc/ncclguard/config.toml)")
        s.add_argument("--db", default=None, help="inventory database (overrides the config)")
    once = sub.choices["once"]
    once.add_argument("--json", action="store_true", help="print the fingerprint as JSON")
    once.add_argument("--publish", action="store_true",
                      help="also publish it, signed, to the spool")
    once.add_argument("--store", action="store_true",
                      help="also write it straight into an inventory this process can write "
                      "(tests, one machine; cluster nodes publish instead)")
    c = _controller_command(sub, "collect", "verify the spool's signed records and write the "
                            "inventory (the controller's service)")
    c.add_argument("--spool", default=None, help="spool directory (overrides the config)")
    c.add_argument("--once", action="store_true", help="one scan, then exit")
    c.add_argument("--quiet", "-q", action="store_true", help="with --once: no progress line "
                   "(it is shown on a terminal only, on stderr)")
    f = _controller_command(sub, "features", "keep Slurm's class features and job_submit.lua's "
                            "file current (the controller's service, as SlurmUser; "
                            "docs/scheduling.md)")
    f.add_argument("--once", action="store_true", help="one sync, then exit")
    f.add_argument("--hook", action="store_true", help="what Slurm's hooks run: return at "
                   "once, and sync from a detached process once slurmctld answers (the "
                   "same as ncclguard-features-hook)")
    f.add_argument("--log", default=None, help="with --hook: the detached sync's log file "
                   "(default: syslog)")
    k = _controller_command(sub, "canary", "hold a changed node out of multi-node jobs until "
                            "a canary job on it and a known-good peer passes (the "
                            "controller's service, as ncclguard; docs/canary.md)")
    k.add_argument("--once", action="store_true", help="one pass, then exit")
    h = sub.add_parser("container-record", help="record the NCCL of a starting container "
                       "(run by the enroot hook; never fails)",
                       description="Fingerprint the container root ENROOT_ROOTFS of Slurm job "
                       "SLURM_JOB_ID and publish it, signed, to <spool>/containers "
                       "(docs/containers.md). Always exits 0.")
    h.add_argument("--config", default=None)
    r = sub.add_parser("read-nccl", help="print what a job's own libnccl.so.2 is: its "
                       "version and the plugin ABIs it looks for, as JSON (docs/jobs.md)",
                       description="Read the libnccl at PATH as the node probe reads one "
                       "(bounded; never loaded) and print its version and ABIs as JSON. "
                       "Run as the job's owner or an unprivileged user.")
    r.add_argument("path")
    j = sub.add_parser("jobmaps", help="read what the running Slurm job steps on this node "
                       "mapped (libnccl, NCCL plugins) for the node's record (the "
                       "ncclguard-jobmaps service; needs CAP_SYS_PTRACE)",
                       description="Every [runtime] scan_interval_s, find this node's Slurm "
                       "job steps (their cgroups, or their slurmstepd), read their "
                       "processes' /proc/PID/maps, identify each libnccl and NCCL plugin "
                       "mapped, and write it to [runtime] loaded_file (docs/runtime.md).")
    j.add_argument("--config", default=None)
    j.add_argument("--hostname", default=None, help="node name (default: the short hostname)")
    j.add_argument("--out", default=None, help="the file written (default: [runtime] "
                   "loaded_file)")
    j.add_argument("--once", action="store_true", help="one scan, then exit")
    m = _controller_command(sub, "metrics", "print the cluster's metrics once, as the "
                            "collector serves them to Prometheus (docs/metrics.md)")
    m.add_argument("--no-slurm", action="store_true",
                   help="do not ask Slurm for the partitions (no partition metrics)")
    return p


def _features_once(cfg: configmod.Config) -> int:
    from inventoryd.controller.features import FeatureKeeper
    from ncclguard.sched.classfile import ClassFileError
    from ncclguard.slurm import SlurmError
    from ncclguard.store import InventoryError

    try:
        did = FeatureKeeper(cfg).apply()
    except (SlurmError, InventoryError, ClassFileError) as e:
        print(f"ncclguard-inventoryd: {e}", file=sys.stderr)
        return 1
    print(f"ncclguard-inventoryd: {did}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "read-nccl":  # needs no config: a file and its facts
        from inventoryd.controller.jobnccl import read

        got = read(args.path)
        json.dump(got, sys.stdout, sort_keys=True)
        sys.stdout.write("\n")
        return 0 if got["error"] is None else 1
    if args.command == "container-record":  # before the config: it must never fail
        from inventoryd.node import containerhook

        return containerhook.main(config_path=args.config)
    try:
        cfg = load_config(args.config)
    except configmod.ConfigError as e:
        print(f"ncclguard-inventoryd: {e}", file=sys.stderr)
        return 2
    if getattr(args, "db", None):
        os.environ["NCCLGUARD_DB"] = args.db
    if getattr(args, "spool", None):
        os.environ["NCCLGUARD_SPOOL"] = args.spool
    if args.command == "jobmaps":
        from inventoryd.node import jobmaps

        out = args.out or cfg.runtime.loaded_file
        if not out:
            print("ncclguard-inventoryd: jobmaps: [runtime] loaded_file is empty and no "
                  "--out given: nowhere to write", file=sys.stderr)
            return 2
        return jobmaps.main(args.hostname, out, cfg.runtime, once=args.once,
                            config_path=args.config)
    if args.command == "features":
        from inventoryd.controller import features

        if args.hook:
            return features.hook_main([*(["--config", args.config] if args.config else []),
                                       *(["--log", args.log] if args.log else [])])
        if args.once:
            return _features_once(cfg)
        return features.run(args.config, cfg)
    if args.command == "canary":
        from inventoryd.controller import canary

        if args.once:
            from ncclguard.slurm import SlurmError
            from ncclguard.store import InventoryError

            try:
                did = canary.CanaryService(cfg).apply()
            except (SlurmError, InventoryError) as e:
                print(f"ncclguard-inventoryd: canary: {e}", file=sys.stderr)
                return 1
            print(f"ncclguard-inventoryd: canary: {did or 'nothing to do'}", file=sys.stderr)
            return 0
        return canary.run(args.config, cfg)
    if args.command == "collect":
        from inventoryd.controller import collector_service as collector

        if args.once:
            from ncclguard.progress import Progress

            shown = Progress(sys.stderr, "ncclguard-inventoryd collect", enabled=not args.quiet)
            try:
                res = collector.collect_once(cfg, progress=shown.update if shown.enabled
                                             else None)
            except (configmod.ConfigError, collector.InventoryError) as e:
                shown.done()
                print(f"ncclguard-inventoryd: {e}", file=sys.stderr)
                return 1
            shown.done()
            print(f"ncclguard-inventoryd: {res.files} records in the spool, "
                  f"{len(res.accepted)} accepted, {len(res.rejected)} rejected, "
                  f"{res.deferred} deferred", file=sys.stderr)
            return 1 if res.deferred else 0
        return collector.run(args.config, cfg)
    if args.command == "metrics":
        from inventoryd.controller.exporter import Served, from_config

        exporter = from_config(cfg, None, ask_partitions=not args.no_slurm)
        if exporter.partitions is not None:
            exporter.partitions.refresh()
        sys.stdout.write(Served(exporter).text())
        return 0 if exporter.refresh() is not None else 1
    if args.command == "once":
        from inventoryd.node.fingerprint import collect

        fp = collect(root=args.root, hostname=args.hostname, config=cfg.inventoryd)
        if args.publish:
            from inventoryd.node.daemon import publish_once

            rc = publish_once(fp, cfg)
            if rc:
                return rc
        if args.store:
            from inventoryd.node.daemon import store_once

            rc = store_once(fp, cfg)
            if rc:
                return rc
        if args.json or not (args.store or args.publish):
            try:
                json.dump(fp, sys.stdout, indent=2, sort_keys=True)
                sys.stdout.write("\n")
                sys.stdout.flush()
            except BrokenPipeError:  # `once --json | head`: the reader left, not an error
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    from inventoryd.node.daemon import run

    return run(root=args.root, hostname=args.hostname, config_path=args.config, config=cfg)


if __name__ == "__main__":
    sys.exit(main())
