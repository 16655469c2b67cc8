#!/bin/sh
# ncclguard: record which NCCL this container really has on this node (docs/containers.md).
# Install as /etc/enroot/hooks.d/90-ncclguard.sh (mode 0755). enroot runs it as the
# container's user with ENROOT_ROOTFS set; pyxis passes the job's SLURM_* environment.
# It never fails the container: bounded by timeout, every status ignored.
timeout 20 /opt/ncclguard/bin/ncclguard-inventoryd container-record </dev/null >/dev/null 2>&1 || true
exit 0
