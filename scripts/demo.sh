#!/usr/bin/env bash
# The README's first command: ncclguard on a real mini Slurm cluster, on this machine.
#
#   scripts/demo.sh         install what it needs, (re)build the demo in .demo/, show it,
#                           and leave the cluster running (make demo)
#   scripts/demo.sh stop    stop that cluster (make demo-stop)
#
# NCCLGUARD_DEMO_DIR moves the demo's directory (default: .demo in the checkout).
# On a fresh Debian machine run it as root: it installs slurm-wlm, munge, gcc and
# python3-venv with apt-get, then the project into .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
action=${1:-run}
dir=${NCCLGUARD_DEMO_DIR:-.demo}
me=scripts/demo.sh

case $action in
run | stop) ;;
*)
    echo "usage: $me [run|stop]" >&2
    exit 2
    ;;
esac

if [[ $action == stop ]]; then
    if [[ -x .venv/bin/python ]]; then
        exec .venv/bin/python -m devtools.demo stop --dir "$dir"
    fi
    echo "no demo to stop: there is no .venv here, so none was started"
    exit 0
fi

# ---- system packages: program -> Debian package
need=()
have() { command -v "$1" >/dev/null 2>&1 || [[ -x /usr/sbin/$1 || -x /sbin/$1 ]]; }
for pair in slurmctld:slurm-wlm slurmd:slurm-wlm sbatch:slurm-wlm munged:munge \
    gcc:gcc python3:python3; do
    have "${pair%%:*}" || need+=("${pair##*:}")
done
if have python3 && ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    need+=(python3-venv)
fi
mapfile -t need < <(printf '%s\n' "${need[@]}" | awk 'NF && !seen[$0]++')

if ((${#need[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "$me: missing packages: ${need[*]}." >&2
        echo "$me: run it as root (it installs them with apt-get), or first:" >&2
        echo "    sudo apt-get install -y ${need[*]}" >&2
        exit 2
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "$me: missing packages: ${need[*]}, and there is no apt-get here." >&2
        echo "$me: install Slurm (slurmctld, slurmd and the client commands, 22.05 or later)," >&2
        echo "    munge, gcc and Python 3.11+ with venv yourself, then run $me again." >&2
        exit 2
    fi
    echo "$me: installing ${need[*]} with apt-get ..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

if [[ $(id -u) -ne 0 ]]; then
    echo "$me: run it as root (sudo $me): the demo's slurmctld and slurmd run as" >&2
    echo "    SlurmUser=root, like a real controller's daemons." >&2
    exit 2
fi
if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "$me: python3 is $(python3 -V 2>&1 | cut -d' ' -f2); ncclguard needs 3.11 or later" \
        "(Debian 12 or later)." >&2
    exit 2
fi

# ---- the project, into .venv (reinstalled only when pyproject.toml changes)
if [[ ! -x .venv/bin/python ]]; then
    echo "$me: creating .venv ..."
    python3 -m venv .venv
fi
stamp=.venv/.ncclguard-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [[ ! -x .venv/bin/ncclguard || "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    echo "$me: installing ncclguard into .venv (pip install -e .) ..."
    log=.venv/ncclguard-install.log
    if ! { .venv/bin/python -m pip install -q --upgrade pip &&
        .venv/bin/python -m pip install -q -e .; } >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        echo "$me: pip install -e . failed (no network to PyPI?); the whole log: $log" >&2
        exit 1
    fi
    echo "$want" >"$stamp"
fi

exec .venv/bin/python -m devtools.demo run --dir "$dir"
