# shellcheck shell=bash
# Sourced by scripts/slurm-root.sh and scripts/systemd-root.sh: how both make a Debian
# root with debootstrap.

# this machine's Debian mirror (the registries it can reach), else Debian's own
debian_mirror() {
    local uri
    uri=$(sed -n 's/^URIs:[[:space:]]*//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null |
        grep -v security | head -n1 || true)
    # one-line format: "deb [options] URI suite ...": the first field that is a URI
    [[ -n $uri ]] || uri=$(awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {
        if ($0 !~ /security/) { print $i; exit } } }' /etc/apt/sources.list 2>/dev/null || true)
    echo "${uri:-http://deb.debian.org/debian}"
}

# debian_debootstrap SUITE ROOT LOG [debootstrap options]: a minbase root of SUITE from
# this machine's mirror; its output goes to LOG. bookworm's debootstrap has no forky
# script: forky is built as sid is. After a forky root, apt inside it does not check
# Valid-Until (this mirror's forky Release file is past its date, docs/slurm-versions.md).
debian_debootstrap() {
    local suite=$1 root=$2 log=$3
    shift 3
    local script=()
    [[ -e /usr/share/debootstrap/scripts/$suite ]] || script=(/usr/share/debootstrap/scripts/sid)
    debootstrap --variant=minbase "$@" "$suite" "$root" "$(debian_mirror)" "${script[@]}" \
        >"$log" 2>&1 || return 1
    if [[ $suite == forky ]]; then
        echo 'Acquire::Check-Valid-Until "false";' >"$root/etc/apt/apt.conf.d/99ncclguard"
    fi
}
