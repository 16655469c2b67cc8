"""Ground truth after the fact: what NCCL a container really had on each node (issue 15).

``ncclguard-inventoryd container-record``, run by an enroot hook
(``slurm/enroot/hooks.d/90-ncclguard.sh``) when a container starts on a node: it
fingerprints the container's root (``ENROOT_ROOTFS``) with the node probes' own code (the
libnccl a job loads there, the net plugin in force, ``/etc/nccl.conf``) and publishes it,
signed by the local munged as the job's user, to ``<spool>/containers/<node>.<job>.<step>.rec``.
The collector verifies it (:mod:`inventoryd.controller.container_records`: authentic, fresh, signed
from that node's address by the owner of a job that ran there, of the record's shape)
and keeps it in the inventory (``container_runs``); ``ncclguard decisions --job`` shows
it.

The hook never fails a node or a container: the shell script ignores every exit status,
and this command catches everything, prints one line on stderr and exits 0.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ncclguard import config as configmod
from ncclguard.spool import CONTAINER_RECORD_VERSION as RECORD_VERSION
from ncclguard.spool import CONTAINER_SUBDIR, container_record_name


def container_record(rootfs: str, host: str, job: str, step: str) -> dict[str, Any]:
    """The record of one container's root: what NCCL a job there loads."""
    from inventoryd.filecache import FileCache
    from inventoryd.nodefs import ErrorLog, NodeFS
    from inventoryd.probes import nccl, ncclconf, plugins

    fs = NodeFS(rootfs)
    errors = ErrorLog()
    cfg = configmod.InventorydConfig()
    cache = FileCache(None)
    libs = nccl.probe(fs, errors, cfg, cache)
    conf = ncclconf.probe(fs, errors)
    found, net, _, _ = plugins.probe(fs, errors, cfg, conf.get("settings") or {}, libs, cache,
                                     with_offers=False)
    used = next((p for p in found if p.get("path") == net.get("plugin")), None)
    return {
        "ncclguard_container_record": RECORD_VERSION, "host": host, "job": job, "step": step,
        "libnccl": [{k: lib.get(k) for k in ("path", "realpath", "version", "sha256",
                                             "default")} for lib in libs],
        "net": {"plugin": net.get("plugin"), "name": (used or {}).get("name"),
                "abi": net.get("effective_net_abi"), "reason": net.get("reason")},
        "nccl_conf": conf.get("settings"), "errors": errors.entries[:32],
    }


def publish(record: dict[str, Any], spool_cfg: configmod.SpoolConfig) -> Path:
    from ncclguard import munge, spool

    data = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    cred = munge.encode(data, socket_path=spool_cfg.munge_socket or None,
                        ttl=spool_cfg.record_ttl_s)
    d = spool_cfg.spool_path() / CONTAINER_SUBDIR
    name = container_record_name(record["host"], record["job"], record["step"])
    return spool.atomic_write(d / name, cred, 0o644)


def main(env: dict[str, str] | None = None, config_path: str | None = None) -> int:
    """The hook's command: never raises, always 0."""
    e = dict(os.environ if env is None else env)
    try:
        rootfs = e.get("ENROOT_ROOTFS", "")
        job = e.get("SLURM_JOB_ID", "")
        if not rootfs or not job:
            print("ncclguard container-record: not in a Slurm job's enroot container "
                  "(ENROOT_ROOTFS, SLURM_JOB_ID unset); nothing done", file=sys.stderr)
            return 0
        step = e.get("SLURM_STEP_ID", "") or "batch"
        host = e.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
        cfg = configmod.load(config_path)
        t = time.monotonic()
        path = publish(container_record(rootfs, host, job, step), cfg.spool)
        print(f"ncclguard container-record: {path} in {time.monotonic() - t:.2f}s",
              file=sys.stderr)
    except Exception as err:  # the hook never fails a container
        print(f"ncclguard container-record: not published: {type(err).__name__}: {err}",
              file=sys.stderr)
    return 0
