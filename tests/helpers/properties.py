"""Node kinds and allocations for the property tests (hypothesis): a kind is (NCCL
version, NCCL_IB_DISABLE, net plugin, NCCL_ALGO), None where the part is unreadable."""

from __future__ import annotations

from functools import cache

from hypothesis import strategies as st

from helpers.fingerprints import error, fingerprint, plugin
from ncclguard.config import PolicyConfig
from ncclguard.policy import DEFAULT_SEVERITY

# min_nodes=1 so that "compatible" below means "no refuse-level finding" for any subset
CONFIGS = {
    "default": PolicyConfig(min_nodes=1),
    "strict": PolicyConfig(
        min_nodes=1,
        severity={**DEFAULT_SEVERITY, "unknown-node": "refuse", "nccl-conf": "refuse"},
    ),
}

# (nccl version, transport setting, plugin, nccl.conf extra); None = unreadable
VERSIONS = st.sampled_from(["2.21.5", "2.18.3", "2.26.2", None])
IB_DISABLE = st.sampled_from(["0", "1", None])
PLUGIN = st.sampled_from([None, "IBext_v8"])
ALGO = st.sampled_from([None, "Ring", "Tree"])
KIND = st.tuples(VERSIONS, IB_DISABLE, PLUGIN, ALGO)
NODE = st.one_of(st.none(), KIND)  # None: no record


@cache
def kind_fingerprint(kind: tuple) -> dict:
    """The fingerprint of a node of ``kind`` (one of ``KIND``), made once per kind."""
    version, ib_disable, plug, algo = kind
    conf = {}
    if ib_disable is not None:
        conf["NCCL_IB_DISABLE"] = ib_disable
    if algo is not None:
        conf["NCCL_ALGO"] = algo
    fp = fingerprint(
        "x",
        nccl=version or "2.21.5",
        plugins=[plugin(plug, abis=[8, 7, 6])] if plug else [],
        conf=conf,
    )
    if version is None:  # the nccl probe failed
        fp["libnccl"] = None
        fp["errors"].append(error("libnccl", probe="nccl"))
    if ib_disable is None:  # nccl.conf unreadable
        fp["nccl_conf"] = None
        fp["errors"].append(error("nccl_conf", probe="ncclconf"))
    return fp


#: a job's nodes (n1..n8) and the kind of each, None for a node without a record
allocations = st.dictionaries(
    st.sampled_from([f"n{i}" for i in range(1, 9)]), NODE, min_size=1, max_size=7
)
