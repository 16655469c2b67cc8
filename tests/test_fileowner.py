"""The owner a message names: under PrivateUsers= an unmapped owner is not "uid 65534".

The real case (the node unit, PrivateUsers=yes, a libnccl of uid 1000) runs under systemd
in tests/test_install_systemd.py; here the rule itself, on uid maps as the kernel writes
them."""

from __future__ import annotations

from pathlib import Path

from ncclguard import fileowner

FULL = "         0          0 4294967295\n"  # the initial user namespace
# what PrivateUsers=yes writes for a unit of user 995: root, the unit's user, nothing else
PRIVATE = "         0          0          1\n       995        995          1\n"


def test_uid_maps_as_the_kernel_writes_them() -> None:
    assert fileowner.parse_uid_map(FULL) == ((0, 0, 4294967295),)
    assert fileowner.parse_uid_map(PRIVATE) == ((0, 0, 1), (995, 995, 1))
    assert fileowner.parse_uid_map("") == ()
    assert fileowner.parse_uid_map("garbage\n1 2\n") == ()
    # this process's own map reads as at least one range
    assert fileowner.parse_uid_map(Path("/proc/self/uid_map").read_text())


def test_an_unmapped_owner_is_not_named_as_the_overflow_uid() -> None:
    private = fileowner.parse_uid_map(PRIVATE)
    text = fileowner.owner(65534, uid_map=private, overflow_uid=65534)
    assert "uid 65534" not in text.split("(")[0]
    assert text.startswith("a user outside this process's user namespace")
    assert "PrivateUsers=" in text
    # the ids the namespace maps are named as they are
    assert fileowner.owner(0, uid_map=private, overflow_uid=65534) == "uid 0"
    assert fileowner.owner(995, uid_map=private, overflow_uid=65534) == "uid 995"
    # in the initial namespace uid 65534 is nobody itself, and named so
    full = fileowner.parse_uid_map(FULL)
    assert fileowner.owner(65534, uid_map=full, overflow_uid=65534) == "uid 65534"
    assert fileowner.owner(1000, uid_map=full, overflow_uid=65534) == "uid 1000"
    # another overflow uid (sysctl kernel.overflowuid)
    assert fileowner.owner(65534, uid_map=private, overflow_uid=4242) == "uid 65534"
    assert fileowner.owner(4242, uid_map=private, overflow_uid=4242).startswith("a user")
