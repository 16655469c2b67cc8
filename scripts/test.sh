#!/usr/bin/env bash
# Install what the tests need (Slurm, munge, gcc, Prometheus, python3-venv, the venv), run ruff, the
# layering contract (import-linter) and mypy, then the whole suite, the real-Slurm tests
# included, on this machine's Slurm, then the real-Slurm tests on Debian 13's Slurm 24.11
# and the whole suite on Debian forky's 26.05, each in a debootstrap root
# (scripts/slurm-root.sh). `make test` and CI (.ci/run) call exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
# prometheus: promtool (the alert rules' unit tests) and the server (scraping the collector);
# lua5.1: job_submit.lua's logic run outside slurmctld (tests/test_lua_submit.py);
# docker-registry, skopeo: a real OCI registry on loopback and what pushes the test's
# images to it, for the image client's tests (tests/helpers/registry.py); tinyproxy: a
# real HTTP proxy on loopback that registries are reached through (test_registry_hostile.py,
# test_registry_longrun.py: plain HTTP and a CONNECT tunnel to a TLS registry)
for cmd in slurmctld:slurm-wlm slurmd:slurm-wlm munged:munge gcc:gcc systemd-analyze:systemd \
           ldconfig:libc-bin python3:python3 promtool:prometheus prometheus:prometheus \
           mksquashfs:squashfs-tools unsquashfs:squashfs-tools lua5.1:lua5.1 \
           docker-registry:docker-registry skopeo:skopeo tinyproxy:tinyproxy; do
    command -v "${cmd%%:*}" >/dev/null 2>&1 || need_apt+=("${cmd##*:}")
done
# the stub SPANK plugin of the container tests is compiled against <slurm/spank.h>
[[ -f /usr/include/slurm/spank.h ]] || need_apt+=(libslurm-dev)
# Debian's python3 has no venv/ensurepip without python3-venv
if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    need_apt+=(python3-venv)
fi
if ((${#need_apt[@]})); then
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
        echo "scripts/test.sh: missing ${need_apt[*]}; install them as root with apt-get" >&2
        exit 2
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test]'

.venv/bin/ruff check .
# imports run one way (pyproject.toml, [tool.importlinter]), and the packages type-check
.venv/bin/lint-imports --no-cache
.venv/bin/mypy
# The real NCCL libraries the tests use, fetched up front (about 2.6 GB the first time,
# cached in ~/.cache/ncclguard): a part that cannot be had stops the run here, named.
if ! .venv/bin/python -m devtools.ncclwheels fetch >/dev/null; then
    echo "scripts/test.sh: a real NCCL library the tests need cannot be had (above); the" \
        "tests do not run without it (PyPI must be reachable, or the cache filled)" >&2
    exit 2
fi
# The Slurm tests must run here, and every real part: with these set, a test that would
# skip fails instead, and any skip fails the run (tests/conftest.py).
export NCCLGUARD_REQUIRE_SLURM=1 NCCLGUARD_REQUIRE_PARTS=1
echo "scripts/test.sh: the suite on $(slurmctld -V 2>/dev/null || echo 'Slurm ?') and $(.venv/bin/python --version)"
# The order: shuffled across files (pytest-randomly prints its seed, and
# --randomly-seed=SEED repeats it), so that no test leans on what another left behind;
# NCCLGUARD_SHUFFLE=0 keeps the written order.
# --durations: the slowest tests of each run in its log, where CI's time goes
if [[ ${NCCLGUARD_SHUFFLE:-1} == 1 ]]; then
    .venv/bin/python -m pytest --durations=25 "$@"
else
    .venv/bin/python -m pytest --randomly-dont-reorganize --durations=25 "$@"
fi

# Then the same suite on the newer Slurm releases, each in a cached debootstrap root
# (scripts/slurm-root.sh): Debian 13's 24.11 and Debian forky's 26.05. Inside a root this
# script runs once more and stops here.
if [[ -z ${NCCLGUARD_IN_SLURM_ROOT:-} ]]; then
    if [[ ${NCCLGUARD_SECOND_SLURM:-1} == 0 ]]; then
        echo "scripts/test.sh: NCCLGUARD_SECOND_SLURM=0: NOT run on Slurm 24.11 and 26.05" \
            "(CI always runs them)" >&2
    else
        for suite in ${NCCLGUARD_SLURM_SUITES:-trixie forky}; do
            # The oldest Slurm (here) runs the whole suite; 24.11 and 26.05 the tests
            # that start a real Slurm (-m slurm), so that CI's three releases fit its hour
            # (README, docs/development.md). Everything there too:
            # NCCLGUARD_WHOLE_SUITE_ON="trixie forky".
            sel=()
            if [[ " ${NCCLGUARD_WHOLE_SUITE_ON:-} " != *" $suite "* ]]; then
                sel=(-m slurm)
            fi
            NCCLGUARD_SLURM_SUITE=$suite bash scripts/slurm-root.sh test "${sel[@]}" "$@"
        done
    fi
fi
