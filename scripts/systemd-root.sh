#!/usr/bin/env bash
# A Debian root that boots with systemd as PID 1 under systemd-nspawn, for the install
# test (tests/test_install_systemd.py): debootstrap with systemd, dbus, Slurm and munge,
# cached between runs. The test copies it, boots the copy and follows docs/install.md
# inside; the cached root itself is never booted, so every run starts from the same one.
#
#   scripts/systemd-root.sh build [SUITE]    build (or check) the root; print its path
#   scripts/systemd-root.sh remove [SUITE]   delete the cached root
#
# SUITE: bookworm (Debian 12, Slurm 22.05; the default) or forky (Debian testing, Slurm
# 26.05, systemd 262; debootstrap uses sid's script for it). NCCLGUARD_SYSTEMD_ROOTS: where the
# roots live (default /var/cache/ncclguard; each is systemd-<suite>). Needs root
# (debootstrap) and installs debootstrap and systemd-container (systemd-nspawn) on this
# machine when they are missing. The root is rebuilt when its package list or version tag
# changes, or after `remove`.
set -euo pipefail
cd "$(dirname "$0")/.."
me=scripts/systemd-root.sh
action=${1:-build}
suite=${2:-bookworm}

die() { echo "$me: $*" >&2; exit 2; }

case $action in
build | remove) ;;
*) die "usage: $me [build|remove] [SUITE]" ;;
esac
case $suite in
bookworm | forky) ;;
*) die "suite $suite: bookworm (Debian 12) or forky (Debian 14, Slurm 26.05)" ;;
esac
[[ $(id -u) -eq 0 ]] || die "needs root (debootstrap); run it as root"
base=$(realpath -m -- "${NCCLGUARD_SYSTEMD_ROOTS:-/var/cache/ncclguard}")
root=$base/systemd-$suite
# the root is deleted and rebuilt: only a plain, deep enough path of its own
[[ $root =~ ^(/[A-Za-z0-9._-]+){2,}$ ]] ||
    die "root $root: want an absolute path of two or more plain components"
owner=$root/.ncclguard-systemd-root # marks a directory this script made (and may delete)

# What the install guide expects of a machine before it starts (docs/install.md, "Before
# you start"): systemd as PID 1 with dbus, Slurm and munge from Debian, Python with venv.
# procps and iproute2 for the checks; curl for the metrics step; squashfs-tools for the
# image index (the guide's section 8: the collector reads a user's hostile image under its
# unit, its watchdog and its stop).
packages=(systemd systemd-sysv dbus slurm-wlm munge python3 python3-venv procps iproute2
          curl ca-certificates squashfs-tools)
root_version=v1 # a new tag rebuilds the root
stamp_want="$suite ${packages[*]} $root_version"

mkdir -p "$base"
exec {lock_fd}>"$root.lock"
flock -w 1800 "$lock_fd" || die "another $me holds $root.lock (waited 30 min)"

# debian_mirror, debian_debootstrap
# shellcheck source=scripts/debian-root.sh
source scripts/debian-root.sh

remove_root() {
    [[ -e $root ]] || return 0
    if [[ ! -e $owner ]] && [[ -n $(ls -A "$root") ]]; then
        die "$root is not a root this script made (no $(basename "$owner")): not deleting it"
    fi
    if awk -v r="$root/" 'index($2, r) == 1 {found = 1} END {exit !found}' /proc/self/mounts; then
        die "something is mounted under $root (a container still running?): not deleting it"
    fi
    rm -rf --one-file-system "$root"
}

host_tools() {
    local need=()
    command -v debootstrap >/dev/null || need+=(debootstrap)
    command -v systemd-nspawn >/dev/null || need+=(systemd-container)
    command -v nsenter >/dev/null || need+=(util-linux)
    ((${#need[@]})) || return 0
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null ||
        die "apt-get install ${need[*]} failed"
}

build() {
    host_tools
    local have=""
    [[ -f $root/.ncclguard-root ]] && have=$(cat "$root/.ncclguard-root")
    [[ $have == "$stamp_want" ]] && return 0
    echo "$me: building a Debian $suite root in $root (about 90 s) ..." >&2
    remove_root
    mkdir -p "$root"
    touch "$owner"
    local log include
    log=$(mktemp)
    include=$(IFS=,; echo "${packages[*]}")
    if ! debian_debootstrap "$suite" "$root" "$log" --include="$include"; then
        tail -n 20 "$log" >&2
        rm -f "$log"
        die "debootstrap $suite failed (log above)"
    fi
    rm -f "$log"
    # apt's caches are not needed to boot (about 60 MB less to copy for every run)
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*_dists_*
    echo "$stamp_want" >"$root/.ncclguard-root"
    echo "$me: $(chroot "$root" dpkg-query -W -f '${Package} ${Version}; ' systemd slurm-wlm \
        python3 2>/dev/null)" >&2
}

case $action in
remove)
    remove_root
    echo "$me: removed $root" >&2
    ;;
build)
    build
    echo "$root"
    ;;
esac
