#!/usr/bin/env bash
# Newer Slurm releases for the tests: a Debian root made by debootstrap, cached between
# runs, with that suite's slurm-wlm. scripts/test.sh runs the whole suite on this
# machine's Slurm first, then inside each root.
#
#   NCCLGUARD_SLURM_SUITE=trixie (default): Debian 13, Slurm 24.11, Python 3.13
#   NCCLGUARD_SLURM_SUITE=forky:            Debian forky, Slurm 26.05, Python 3.14 (made
#                                           with debootstrap's sid script; this mirror's
#                                           forky Release is past its Valid-Until date)
#
#   scripts/slurm-root.sh test [pytest args]   build or reuse the root, copy the checkout
#                                              in, run scripts/test.sh there
#   scripts/slurm-root.sh shell                a shell in the root (the checkout copy)
#   scripts/slurm-root.sh run CMD [ARGS]       one command there, in the checkout copy
#                                              (its venv: .venv; files it writes stay in
#                                              $NCCLGUARD_SLURM_ROOT/src/ncclguard)
#   scripts/slurm-root.sh build                only build (or check) the root
#   scripts/slurm-root.sh remove               delete the cached root
#
# NCCLGUARD_SLURM_CACHE: where the roots live (default /var/cache/ncclguard: the root is
# <cache>/<suite>-slurm); NCCLGUARD_SLURM_ROOT: one suite's root exactly (overrides).
# Needs root (debootstrap, chroot, mount). A package added to the list below is installed
# into the cached root (apt-get, no rebuild); the root is rebuilt only when the suite or
# the root's version tag changes; `remove` forces it. Facts: docs/slurm-versions.md.
set -euo pipefail
cd "$(dirname "$0")/.."
me=scripts/slurm-root.sh
action=${1:-test}
[[ $# -gt 0 ]] && shift
suite=${NCCLGUARD_SLURM_SUITE:-trixie}
case $suite in
trixie | forky) ;;
*) echo "$me: NCCLGUARD_SLURM_SUITE=$suite: want trixie or forky" >&2; exit 2 ;;
esac
root=$(realpath -m -- "${NCCLGUARD_SLURM_ROOT:-${NCCLGUARD_SLURM_CACHE:-/var/cache/ncclguard}/$suite-slurm}")
# everything scripts/test.sh and the tests need inside, so that the cached root is complete
# (prometheus: promtool and the server for the alert-rule tests; docker-registry and
# skopeo: the real OCI registry of the image client's tests)
packages=(slurm-wlm munge python3 python3-venv gcc libc6-dev systemd make git
          ca-certificates procps iproute2 prometheus squashfs-tools libslurm-dev lua5.1
          docker-registry skopeo)
root_version=v1 # a new tag rebuilds the root; a new package is only installed into it
stamp_want="$suite ${packages[*]} $root_version"

die() { echo "$me: $*" >&2; exit 2; }

case $action in
test | shell | run | build | remove) ;;
*) die "usage: $me [test|shell|run|build|remove] [args]" ;;
esac
[[ $(id -u) -eq 0 ]] || die "needs root (debootstrap, chroot and mount); run it as root"
# the root is deleted and rebuilt: only a plain, deep enough path of its own
[[ $root =~ ^(/[A-Za-z0-9._-]+){2,}$ ]] ||
    die "NCCLGUARD_SLURM_ROOT=$root: want an absolute path of two or more plain components"
owner=$root/.ncclguard-slurm-root # marks a directory this script made (and may delete)

# one run at a time: another run's unmount or rebuild would pull the root from under us
mkdir -p "$(dirname "$root")"
exec {lock_fd}>"$root.lock"
flock -w 1800 "$lock_fd" || die "another $me holds $root.lock (waited 30 min)"

# debian_mirror, debian_debootstrap
# shellcheck source=scripts/debian-root.sh
source scripts/debian-root.sh

mounts_under_root() {
    # every mount point inside the root, deepest first (left over by a killed run, too)
    awk -v r="$root/" 'index($2, r) == 1 {print $2}' /proc/self/mounts | sort -r
}
unmount_all() {
    local m
    for m in $(mounts_under_root); do
        umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
    done
}
trap unmount_all EXIT

remove_root() {
    # never delete through a bind mount (/dev, /sys, the wheel cache): unmount, check, and
    # delete only a directory this script made
    [[ -e $root ]] || return 0
    if [[ ! -e $owner ]] && [[ -n $(ls -A "$root") ]]; then
        die "$root is not a root this script made (no $(basename "$owner")): not deleting it"
    fi
    unmount_all
    if [[ -n $(mounts_under_root) ]] || mountpoint -q "$root/root/.cache/ncclguard" 2>/dev/null; then
        die "cannot unmount everything under $root; not deleting it: $(mounts_under_root | tr '\n' ' ')"
    fi
    rm -rf --one-file-system "$root"
}

bind_system() {
    local d
    for d in proc sys dev; do
        mkdir -p "$root/$d"
        mountpoint -q "$root/$d" && continue
        mount --rbind "/$d" "$root/$d"
        mount --make-rslave "$root/$d"
    done
    # the host's network settings, CA bundle and pip settings (the registries need them);
    # copied after every apt step: installing ca-certificates rewrites the bundle
    # (--remove-destination: a symlink in the root must not send the copy out of it)
    local f
    for f in /etc/resolv.conf /etc/hosts /etc/ssl/certs/ca-certificates.crt /etc/pip.conf \
        ${PIP_CONFIG_FILE:-} ${PIP_CERT:-} ${SSL_CERT_FILE:-} ${REQUESTS_CA_BUNDLE:-} \
        ${CURL_CA_BUNDLE:-}; do
        [[ -f $f ]] || continue
        mkdir -p "$root$(dirname "$f")"
        cp -L --remove-destination "$f" "$root$f"
    done
    if [[ -d /etc/xdg/pip ]]; then
        mkdir -p "$root/etc/xdg"
        rm -rf "$root/etc/xdg/pip"
        cp -r /etc/xdg/pip "$root/etc/xdg/pip"
    fi
    # the real libnccl wheels the fingerprint tests use (downloaded once, shared)
    local cache=${NCCLGUARD_TEST_CACHE:-$HOME/.cache/ncclguard}
    mkdir -p "$cache" "$root/root/.cache/ncclguard"
    if ! mountpoint -q "$root/root/.cache/ncclguard"; then
        mount --bind "$cache" "$root/root/.cache/ncclguard"
    fi
}

in_root() {
    # the root's own PATH and a clean environment, but the pip/CA settings of this host
    local keep=()
    local v
    for v in $(compgen -e); do
            case $v in
        PIP_FIND_LINKS | NCCLGUARD_TEST_CACHE | NCCLGUARD_SLURM_ROOT | NCCLGUARD_SLURM_CACHE) ;; # host paths
        PIP_* | *_CA_BUNDLE | SSL_CERT_* | *CA_CERTS* | NCCLGUARD_* | http_proxy | https_proxy | \
            no_proxy | HTTP_PROXY | HTTPS_PROXY | NO_PROXY) keep+=("$v=${!v}") ;;
        esac
    done
    chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        NCCLGUARD_TEST_CACHE=/root/.cache/ncclguard "${keep[@]}" "$@"
}

install_packages() {
    # apt-get install the package list in the root (what is there already stays as it is)
    local log
    log=$(mktemp)
    if ! in_root bash -c 'export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@"' \
        apt "${packages[@]}" >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        rm -f "$log"
        return 1
    fi
    rm -f "$log"
}

build() {
    local have=""
    [[ -f $root/.ncclguard-root ]] && have=$(cat "$root/.ncclguard-root")
    if [[ $have == "$stamp_want" ]]; then
        return 0
    fi
    # the same suite and root version, another package list (one added): install what it
    # lacks into the cached root instead of building it again
    if [[ -n $have && -e $owner && ${have%% *} == "$suite" && ${have##* } == "$root_version" ]]; then
        echo "$me: installing the packages the cached root in $root lacks ..."
        bind_system
        install_packages || die "apt-get install in the $suite root failed (log above)"
        bind_system # again: ca-certificates may have rewritten the bundle
        echo "$stamp_want" >"$root/.ncclguard-root"
        return 0
    fi
    command -v debootstrap >/dev/null || {
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            debootstrap >/dev/null
    }
    echo "$me: building a Debian $suite root in $root (about a minute) ..."
    remove_root
    mkdir -p "$root"
    touch "$owner"
    local log
    log=$(mktemp)
    if ! debian_debootstrap "$suite" "$root" "$log"; then
        tail -n 20 "$log" >&2
        die "debootstrap $suite failed (log above)"
    fi
    rm -f "$log"
    bind_system
    install_packages || die "apt-get install in the $suite root failed (log above)"
    bind_system # again: ca-certificates rewrote the bundle
    echo "$stamp_want" >"$root/.ncclguard-root"
    echo "$me: $(in_root sh -c 'dpkg-query -W -f "slurm-wlm \${Version}, " slurm-wlm; python3 --version')"
}

copy_checkout() {
    # the working tree as git sees it (tracked and new files, not ignored ones), afresh
    local src=$root/src/ncclguard
    rm -rf "$src"
    mkdir -p "$src" "$root/opt"
    local f
    git ls-files -z --cached --others --exclude-standard |
        while IFS= read -r -d '' f; do # deleted in the work tree: not copied
            if [[ -e $f || -L $f ]]; then printf '%s\0' "$f"; fi
        done |
        tar --null --no-recursion -T - -cf - | tar -xf - -C "$src"
    # a git work tree of its own (the tests list the project's files with git)
    in_root git -C /src/ncclguard init -q
    # the venv lives outside the copy, so it is kept between runs
    [[ -x $root/opt/ncclguard-venv/bin/python ]] || in_root python3 -m venv /opt/ncclguard-venv
    ln -s /opt/ncclguard-venv "$src/.venv"
}

case $action in
remove)
    remove_root
    echo "$me: removed $root"
    ;;
build)
    build
    ;;
shell)
    build
    bind_system
    copy_checkout
    in_root bash -c 'cd /src/ncclguard && exec bash -i'
    ;;
run)
    [[ $# -gt 0 ]] || die "run: which command?"
    build
    bind_system
    copy_checkout
    in_root bash -c 'cd /src/ncclguard && exec "$@"' run "$@"
    ;;
test)
    build
    bind_system
    copy_checkout
    echo "$me: the suite${*:+ ($*)} on $(in_root sh -c 'dpkg-query -W -f "Slurm \${Version}" slurm-wlm; echo " and $(python3 --version)"')"
    in_root bash -c 'cd /src/ncclguard && NCCLGUARD_IN_SLURM_ROOT=1 NCCLGUARD_SHUFFLE=1 \
        exec bash scripts/test.sh "$@"' \
        test "$@"
    ;;
esac
