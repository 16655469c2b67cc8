"""ncclguard.hostlist against the real ``scontrol show hostnames`` of the installed Slurm."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from ncclguard.hostlist import MAX_HOSTS, HostlistError, compress, compress_within, expand

SCONTROL = shutil.which("scontrol") or "/usr/bin/scontrol"
HAVE_SCONTROL = os.access(SCONTROL, os.X_OK)
REQUIRE = os.environ.get("NCCLGUARD_REQUIRE_SLURM") == "1"


def _release() -> tuple[int, int]:
    """The installed Slurm's release (``slurmctld -V`` needs no slurm.conf)."""
    ctld = shutil.which("slurmctld") or "/usr/sbin/slurmctld"
    try:
        out = subprocess.run([ctld, "-V"], capture_output=True, text=True, timeout=10).stdout
        major, minor = out.split()[-1].split(".")[:2]
        return int(major), int(minor)
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return (0, 0)


SLURM_RELEASE = _release()


@pytest.fixture(scope="module")
def scontrol_hostnames(tmp_path_factory: pytest.TempPathFactory):
    """``scontrol show hostnames`` with a minimal private slurm.conf (no daemon needed)."""
    if not HAVE_SCONTROL:
        if REQUIRE:
            pytest.fail("scontrol is not installed and NCCLGUARD_REQUIRE_SLURM=1")
        pytest.skip("scontrol not installed (apt-get install slurm-wlm)")
    d: Path = tmp_path_factory.mktemp("hostlist-conf")
    conf = d / "slurm.conf"
    conf.write_text(
        "ClusterName=hl\nSlurmctldHost=localhost\nAuthType=auth/none\n"
        "NodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n"
    )
    env = {"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"}

    def run(hostlist: str) -> list[str]:
        out = subprocess.run(
            [SCONTROL, "show", "hostnames", hostlist],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        assert "Invalid hostlist" not in out.stdout + out.stderr, (hostlist, out.stdout)
        return out.stdout.split()

    return run


def _range(rng: random.Random) -> str:
    width = rng.choice([0, 0, 2, 3, 5])
    lo = rng.randrange(0, 120)
    if rng.random() < 0.3:
        return f"{lo:0{width}d}" if width else str(lo)
    hi = lo + rng.randrange(0, 40)
    lo_s = f"{lo:0{width}d}" if width else str(lo)
    hi_s = f"{hi:0{rng.choice([0, width])}d}" if width else str(hi)  # "1-03" too
    return f"{lo_s}-{hi_s}"


def _item(rng: random.Random, prefixes: list[str]) -> str:
    prefix = rng.choice(prefixes)
    kind = rng.random()
    if kind < 0.15:
        return f"{prefix}{rng.randrange(0, 999):0{rng.choice([1, 3])}d}"  # plain name
    brackets = "[" + ",".join(_range(rng) for _ in range(rng.randint(1, 4))) + "]"
    if kind < 0.8:
        return prefix + brackets
    # a suffix after the brackets: Slurm allows it only as a second bracket set
    second = "[" + ",".join(_range(rng) for _ in range(rng.randint(1, 2))) + "]"
    return prefix + brackets + rng.choice(["-ib", "x", "-", "_nic"]) + second


def _generated(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    prefixes = ["n", "gpu", "node-", "r1c", "a.b", "X_", "dgx0"]
    return [",".join(_item(rng, prefixes) for _ in range(rng.randint(1, 4))) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_generated_lists_match_scontrol(scontrol_hostnames, seed: int) -> None:
    lists = _generated(seed, 120)
    # One scontrol call per batch: the concatenation expands to the concatenation.
    theirs = scontrol_hostnames(",".join(lists))
    ours = [name for hl in lists for name in expand(hl)]
    assert ours == theirs
    # and a few one by one, so that a mistake is reported on a single list
    for hl in lists[:8]:
        assert expand(hl) == scontrol_hostnames(hl), hl


@pytest.mark.parametrize(
    "hostlist",
    [
        "n[1-3]",
        "n[01-03,7]",
        "n[009-011]",
        "n[8-12]",
        "n[01-3]",
        "n[1-03]",
        "n[00-02]",
        "n[0-0]",
        "n[1-2,2]",  # duplicates kept, as Slurm does
        "n[1-2],n1",
        "x1,x[2-3],y[08-11]",
        "rack[1-2]-node[01-02]",
        "a[1-2][3-4]",
        "a1b[1-2]",
        "n[1-2]-[3-4]",
        "[1-2]",
        "n1,,n2",
        "n[1-2]\tm3",
        "n1 n2",
        "N[1-2],n-x_y.z",
        "",
    ],
)
def test_known_lists_match_scontrol(scontrol_hostnames, hostlist: str) -> None:
    assert expand(hostlist) == scontrol_hostnames(hostlist)


def test_three_bracket_sets_same_hosts_as_scontrol(scontrol_hostnames) -> None:
    # Slurm orders the names of 3+ bracket sets differently; the set is what counts.
    hl = "n[1-2]x[3-4]z[5-6]"
    assert sorted(expand(hl)) == sorted(scontrol_hostnames(hl))


@pytest.mark.parametrize(
    ("hostlist", "problem"),
    [
        ("n[1-2", "unbalanced '['"),
        ("n[1-2,", "unbalanced '['"),
        ("n]", "unbalanced ']'"),
        ("n[1-2]]x", "unbalanced ']'"),
        ("n[[1]]", "nested"),
        ("n[3-1]", "start > stop"),
        ("n[a-b]", "inside brackets"),
        ("n[]", "bad range"),
        ("n[,1]", "bad range"),
        ("n[1--2]", "bad range"),
        ("n[1, 2]", "inside brackets"),
        ("n[1-100000]", "more than"),
    ],
)
def test_malformed_lists_raise_naming_the_list(hostlist: str, problem: str) -> None:
    with pytest.raises(HostlistError) as err:
        expand(hostlist)
    assert problem in str(err.value)
    assert repr(hostlist) in str(err.value) or hostlist[:50] in str(err.value)
    assert err.value.hostlist == hostlist


def test_malformed_lists_are_rejected_by_slurm_too(scontrol_hostnames, tmp_path: Path) -> None:
    # The lists every Slurm calls invalid ("Invalid hostlist", with exit 0): we refuse them
    for hl in ["n[3-1]", "n[a-b]", "n[1-100000]"]:
        with pytest.raises(AssertionError):
            scontrol_hostnames(hl)
        with pytest.raises(HostlistError):
            expand(hl)
    # 22.05 "repairs" a missing ']' into a host named "n]"; 23.02 on refuse it, as we do
    with pytest.raises(HostlistError, match="missing"):
        expand("n[1-")
    if SLURM_RELEASE >= (23, 2):
        with pytest.raises(AssertionError):
            scontrol_hostnames("n[1-")
    else:
        assert scontrol_hostnames("n[1-") == ["n]"]


@pytest.mark.parametrize(
    ("hostlist", "names"),
    [("a[1-2]b", ["a1b", "a2b"]), ("a[1-2]-b1", ["a1-b1", "a2-b1"]),
     ("n[1-2].ib", ["n1.ib", "n2.ib"]), ("n[1-2]x[1]y", ["n1x1y", "n2x1y"]),
     ("gpu[01-02]-ib,n3", ["gpu01-ib", "gpu02-ib", "n3"])],
)  # fmt: skip
def test_text_after_brackets_as_slurm_2311_reads_it(
    scontrol_hostnames, hostlist: str, names: list[str]
) -> None:
    """Text after the last ']': Slurm 23.11+ expands it (as listed, seen on 24.11.5),
    22.05 refuses it. We read it as 23.11+ does on every release (no Slurm writes such
    lists; admins may type them)."""
    assert expand(hostlist) == names
    if SLURM_RELEASE >= (23, 11):
        assert names == scontrol_hostnames(hostlist)
    else:
        with pytest.raises(AssertionError):
            scontrol_hostnames(hostlist)


def test_too_many_hosts_over_several_items() -> None:
    hl = ",".join(f"p{i}[00000-{MAX_HOSTS // 4}]" for i in range(5))
    with pytest.raises(HostlistError, match="more than"):
        expand(hl)


def test_not_a_string() -> None:
    with pytest.raises(HostlistError, match="expected a string"):
        expand(None)  # type: ignore[arg-type]


def test_compress_round_trips() -> None:
    for hl in _generated(99, 50):
        names = expand(hl)
        assert sorted(set(expand(compress(names)))) == sorted(set(names))
    assert compress(["n3", "n1", "n2", "x01", "x02", "x10", "login"]) == "login,n[1-3],x[01-02,10]"
    assert compress([]) == ""


@pytest.mark.parametrize("bad", ["n[1]", "a,b", "a b", ""])
def test_compress_rejects_non_names(bad: str) -> None:
    with pytest.raises(HostlistError, match="not a host name"):
        compress(["n1", bad])


def test_compress_is_accepted_by_slurm(scontrol_hostnames) -> None:
    for hl in _generated(7, 40):
        names = expand(hl)
        assert sorted(set(scontrol_hostnames(compress(names)))) == sorted(set(names))


@pytest.mark.parametrize(("names", "parts"), [
    ([f"gpu{i:05d}" for i in range(1, 16385)], ["gpu[00001-16384]"]),  # 147 KB joined
    ([f"node-{i:05d}" for i in range(1, 12001)], ["node-[00001-12000]"]),  # 132 KB joined
    ([f"n{i}" for i in range(1, 16385, 2)], None),  # odd numbers only: no two in a range
    ([f"h{i:x}-ib" for i in range(16384)], None),  # no trailing number: nothing compresses
])
def test_compress_within_fits_one_argument_and_names_every_host_once(
    names: list[str], parts: list[str] | None,
) -> None:
    limit = 64 * 1024
    assert len(",".join(names)) > limit or parts is None
    got = compress_within(reversed(names), limit)
    if parts is not None:
        assert got == parts
    assert all(len(p.encode()) <= limit for p in got)
    listed = [h for p in got for h in expand(p)]
    assert sorted(listed) == sorted(names)  # every host once, none twice
    assert len(got) <= 2 * -(-len(",".join(names)) // limit)  # halving: few parts


def test_compress_within_refuses_a_name_longer_than_the_limit() -> None:
    assert compress_within([], 10) == []
    with pytest.raises(HostlistError, match="a host name longer than 10 bytes"):
        compress_within(["n1", "x" * 11], 10)


def test_compress_within_parts_are_accepted_by_slurm(scontrol_hostnames) -> None:
    names = [f"h{i:x}-ib" for i in range(3000)]
    for part in compress_within(names, 4096):
        assert sorted(scontrol_hostnames(part)) == sorted(expand(part))
