"""The NCCL releases a node is judged against when the job's NCCL is not known (issue 39).

A job that brings its own NCCL (a pip wheel, a conda env, a module) loads the node's
plugins, not its libnccl. What a node adds to such a job depends on the job's release:
which library that release opens for each plugin kind (the loading rules,
:mod:`ncclguard.fingerprint.loading`) and which ABIs it looks for (here). The plugin probe
(``inventoryd/probes/plugins.py``) works out, for every release of :data:`RELEASES`, the
library each kind would load and at which ABI: the fingerprint's ``offers`` part. Two
nodes give every release of this table the same stack, or they are told apart.

Each row is one release whose looked-for ABIs were read, from the strings of the wheel's
own ``libnccl.so.2`` (``tests/helpers/ncclfacts.py``, ``FACTS``, which
``tests/test_probe_nccl.py`` checks every wheel against and ``tests/test_offers.py`` the
rows) or, before the wheels, from NVIDIA/nccl's source at the tag
named (docs/nccl.md, "Plugins NCCL loads"). A release between two rows loads as the rows
around it say; one the table lacks (2.22.3, 2.29.7) is not judged on its own. The rows
start at the loading-rules table's first release (2.10.3): an older NCCL is not judged.

Standard library only: the gate's path imports it.
"""

from __future__ import annotations

#: ``(2, 21, 5)``: as :data:`ncclguard.fingerprint.loading.Version`, which is not imported
#: here: its dataclasses cost the gate 15 ms of imports per job (``python -X importtime``)
Version = tuple[int, int, int]

__all__ = ["RELEASES", "Release", "by_label", "looks_for"]


class Release:
    """One release and the plugin ABIs its libnccl looks for, per kind, newest first.
    (A plain class: a NamedTuple costs the gate's imports a millisecond.)"""

    __slots__ = ("abis", "label", "loads", "source", "version")

    def __init__(self, label: str, abis: dict[str, tuple[int, ...]], source: str,
                 internal: tuple[str, ...] = ()) -> None:
        self.label = label
        self.abis = abis
        self.source = source
        #: the kinds whose external plugin this release loads, in the order of
        #: ``offers.KINDS``: every kind it looks for, but those it looks up and never
        #: initializes (``internal``; the loading rules' ``external``)
        self.loads = tuple(k for k in ("net", "tuner", "profiler", "env", "gin", "rma")
                           if abis.get(k) and k not in internal)
        a, b, c = (int(x) for x in label.split("."))
        self.version: Version = (a, b, c)

    def __repr__(self) -> str:
        return f"Release({self.label!r})"


def _r(label: str, source: str, internal: tuple[str, ...] = (),
       **abis: tuple[int, ...]) -> Release:
    return Release(label, {"net": abis.pop("net"), **abis}, source, internal)


_V = tuple(range(12, 5, -1))  # net v12..v6: 2.30.4 to 2.32.3

#: Oldest first. ``collnet`` is looked for with the same ABIs as ``net`` (docs/nccl.md).
RELEASES: tuple[Release, ...] = (
    _r("2.10.3", "v2.8.4-1, v2.11.4-1: src/include/nccl_net.h (NCCL_PLUGIN_SYMBOL "
       "ncclNetPlugin_v4)", net=(4,)),
    _r("2.11.4", "v2.11.4-1: src/include/nccl_net.h", net=(4,)),
    _r("2.12.12", "v2.12.12-1: src/net.cc (ncclNetPlugin_v5, then v4)", net=(5, 4)),
    _r("2.18.3", "nvidia-nccl-cu12 2.18.3 strings; v2.13.4-1, v2.18.3-1: src/net.cc "
       "(v6..v4)", net=(6, 5, 4)),
    _r("2.19.3", "nvidia-nccl-cu11 2.19.3 strings", net=(7, 6, 5), tuner=(1,)),
    _r("2.20.5", "nvidia-nccl-cu12 2.20.5 strings", net=(8, 7, 6, 5), tuner=(1,)),
    _r("2.21.5", "nvidia-nccl-cu11 2.21.5 strings", net=(8, 7, 6, 5), tuner=(2,)),
    _r("2.23.4", "nvidia-nccl-cu12 2.23.4 strings", net=(8, 7, 6, 5), tuner=(3, 2),
       profiler=(1,)),
    _r("2.26.2", "nvidia-nccl-cu12 2.26.2 strings", net=(10, 9, 8, 7, 6), tuner=(4, 3, 2),
       profiler=(3, 2, 1)),
    _r("2.27.7", "nvidia-nccl-cu12 2.27.7 strings", net=(10, 9, 8, 7, 6), tuner=(4, 3, 2),
       profiler=(4, 3, 2, 1)),
    _r("2.28.9", "nvidia-nccl-cu12 2.28.9 strings", net=(11, 10, 9, 8, 7, 6),
       tuner=(5, 4, 3, 2), profiler=(5, 4, 3, 2, 1), env=(1,), gin=(11,)),
    _r("2.30.4", "nvidia-nccl-cu12 2.30.4 strings; RMA v13 is looked up, never initialized "
       "(loading.py's 2.30.3 row)", internal=("rma",), net=_V, tuner=(6, 5, 4, 3, 2),
       profiler=(6, 5, 4, 3, 2, 1), env=(1,), gin=(13, 12, 11), rma=(13,)),
    _r("2.30.7", "nvidia-nccl-cu13 2.30.7 strings", net=_V, tuner=(6, 5, 4, 3, 2),
       profiler=(6, 5, 4, 3, 2, 1), env=(2, 1), gin=(14, 13), rma=(14, 13)),
    _r("2.31.2", "nvidia-nccl-cu12 2.31.2 strings (the sweep); v2.31.2-1, NVIDIA/nccl "
       "commit 889806836: src/plugin/rma.cc (v15..v13), src/plugin/profiler.cc (v7..v1)",
       net=_V, tuner=(6, 5, 4, 3, 2), profiler=(7, 6, 5, 4, 3, 2, 1), env=(2, 1),
       gin=(14, 13), rma=(15, 14, 13)),
    _r("2.32.3", "nvidia-nccl-cu12 2.32.3 strings; v2.32.3-1, NVIDIA/nccl commit 12df1a11: "
       "src/plugin/rma.cc (v16..v13)", net=_V, tuner=(6, 5, 4, 3, 2),
       profiler=(7, 6, 5, 4, 3, 2, 1), env=(2, 1), gin=(14, 13), rma=(16, 15, 14, 13)),
)

_BY_LABEL = {r.label: r for r in RELEASES}


def by_label(label: str) -> Release | None:
    return _BY_LABEL.get(label)


def looks_for(release: Release, kind: str) -> tuple[int, ...]:
    """The ``kind`` ABIs ``release`` looks for (collnet: the net ones)."""
    return release.abis.get("net" if kind == "collnet" else kind, ())
