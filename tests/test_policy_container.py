"""The policy for a job in a container image, on node_values records (no files): each
node's effective stack, the odd nodes, and what cannot be checked."""

from __future__ import annotations

import copy

from helpers.fingerprints import fingerprint

from ncclguard.config import PolicyConfig
from ncclguard.fingerprint.image import effective_stack
from ncclguard.policy import evaluate_image, node_values

IMAGE = {"v": 1, "nccl_version": "2.18.3", "nccl_path": "/usr/lib/libnccl.so.2",
         "net_abis": [6, 5, 4], "plugin": None}
REF = "/shared/pt.sqsh"


def _node(host: str, injected: tuple[str, list[int]] | None, **kw: object) -> dict:
    fp = fingerprint(host, **kw)  # type: ignore[arg-type]
    fp["containers"] = {"net_plugin": None if injected is None else
                        {"name": injected[0], "abis": injected[1], "path": "/p", "target": "/t"}}
    return node_values(fp)


def test_effective_stack_uses_the_highest_common_abi_or_falls_back() -> None:
    st = effective_stack(IMAGE, {"name": "X", "abis": [8, 6, 5]}, "IB")
    assert (st["abi"], st["transport"], st["fallback"], st["source"]) == (6, "X", False, "node")
    st = effective_stack(IMAGE, {"name": "X", "abis": [10, 9]}, "IB")
    assert (st["abi"], st["transport"], st["fallback"]) == (None, "IB", True)
    own = {**IMAGE, "plugin": {"name": "Own", "abis": [5]}}
    assert effective_stack(own, None, "IB")["transport"] == "Own"
    assert effective_stack(IMAGE, None, "Socket")["transport"] == "Socket"


def test_the_largest_usable_group_is_kept_even_when_a_fallback_group_is_larger() -> None:
    recs = {"n1": _node("n1", ("A", [6])), "n2": _node("n2", ("B", [10])),
            "n3": _node("n3", ("B", [10])), "n4": _node("n4", ("B", [10]))}
    v = evaluate_image(recs, PolicyConfig(), REF, (IMAGE, None))
    assert v.decision == "refuse" and v.odd_nodes == ["n2", "n3", "n4"]


def test_the_host_stack_is_not_compared_but_rdma_still_is() -> None:
    recs = {"n1": _node("n1", None, nccl="2.18.3"), "n2": _node("n2", None, nccl="2.21.5")}
    v = evaluate_image(recs, PolicyConfig(), REF, (IMAGE, None))
    assert v.decision == "accept", v.format_text()
    assert any("host's NCCL stack is not compared" in n for n in v.notes)
    slow = copy.deepcopy(recs)
    slow["n2"]["rules"]["rdma-rate"] = {"rate": "200"}
    assert [f.rule for f in evaluate_image(slow, PolicyConfig(), REF, (IMAGE, None)).findings
            ] == ["rdma-rate"]


def test_nodes_that_do_not_say_what_they_inject_are_unknown() -> None:
    old = node_values(fingerprint("n2"))
    old.pop("container")  # a record from before issue 15
    recs = {"n1": _node("n1", None), "n2": old}
    v = evaluate_image(recs, PolicyConfig(), REF, (IMAGE, None))
    assert v.decision == "warn"
    (f,) = v.findings
    assert f.rule == "image-unknown" and f.hosts() == ["n2"]


def test_unreadable_image_and_ignored_rules() -> None:
    recs = {"n1": _node("n1", ("A", [6])), "n2": _node("n2", ("B", [10]))}
    v = evaluate_image(recs, PolicyConfig(), REF, (None, "listing: unsquashfs failed: x"))
    assert v.decision == "warn" and "unreadable: listing" in v.findings[0].message
    quiet = PolicyConfig(severity={"image-stack": "ignore", "image-unknown": "ignore"})
    assert evaluate_image(recs, quiet, REF, (IMAGE, None)).decision == "accept"
    assert evaluate_image(recs, quiet, "nvcr.io#x", None).decision == "accept"
    # one node: out of scope, as for any job
    assert evaluate_image({"n1": recs["n1"]}, PolicyConfig(), REF, (IMAGE, None)).notes


def test_an_image_that_cannot_be_checked_is_judged_by_the_nodes_own_stacks() -> None:
    """A registry reference, a ./ path, an image not indexed or with no libnccl: the image
    is unknown (warn), and what the nodes alone show still refuses: nodes with and
    without the net plugin differ for any image. The host's libnccl version alone says
    nothing about the container's."""
    from helpers.fingerprints import plugin

    mixed = {"n1": _node("n1", None, plugins=[plugin("IBext_v8", abis=[8])]),
             "n2": _node("n2", None)}
    no_nccl = {**IMAGE, "nccl_version": None, "net_abis": []}
    for ref, image in (("nvcr.io#nvidia/pytorch:24.01", None), ("./pt.sqsh", (IMAGE, None)),
                       (REF, None), (REF, (no_nccl, None))):
        v = evaluate_image(mixed, PolicyConfig(), ref, image)
        assert v.decision == "refuse", (ref, v.format_text())
        assert {f.rule for f in v.findings} >= {"image-unknown", "net-plugin"}
        assert any("cannot be checked" in n for n in v.notes)
    versions = {"n1": _node("n1", None, nccl="2.18.3"), "n2": _node("n2", None, nccl="2.21.5")}
    v = evaluate_image(versions, PolicyConfig(), "nvcr.io#x", None)
    assert v.decision == "warn" and [f.rule for f in v.findings] == ["image-unknown"]
    v = evaluate_image(versions, PolicyConfig(), "./pt.sqsh", (IMAGE, None))
    assert "give an absolute path" in v.findings[0].message


def test_an_image_without_a_libnccl_is_not_refused_on_every_node() -> None:
    recs = {"n1": _node("n1", ("A", [6])), "n2": _node("n2", ("A", [6]))}
    no_nccl = {**IMAGE, "nccl_version": None, "net_abis": []}
    v = evaluate_image(recs, PolicyConfig(), REF, (no_nccl, None))
    assert v.decision == "warn" and v.odd_nodes == []
    assert "no libnccl the job would load" in v.findings[0].message


def _stack_findings(recs: dict, image: dict) -> list[str]:
    v = evaluate_image(recs, PolicyConfig(), REF, (image, None))
    return [f.severity for f in v.findings if f.rule == "image-stack"]


def test_the_classes_that_run_an_image_are_those_the_gate_accepts_it_on() -> None:
    """runnable_classes (what job_submit.lua offers an image job) against the gate's own
    evaluate_image, on random classes of nodes injecting random plugins: a class said to
    run the image gets no image-stack finding on any two or more of its nodes, a class
    said not to run it is refused on every such set, and None comes only where a class
    holds both."""
    import random

    from ncclguard.policy.rules.container import class_samples, runnable_classes, stacks

    rng = random.Random(30)
    plugins = [None, ("A", [6, 5]), ("B", [10, 9]), ("C", [8, 7])]
    images = [IMAGE, {**IMAGE, "nccl_version": "2.26.2", "net_abis": [10, 9, 8, 7, 6]},
              {**IMAGE, "nccl_version": "2.21.5", "net_abis": [8, 7, 6, 5]}]
    seen = {"runs": 0, "not": 0, "none": 0}
    for _ in range(150):
        hosts = [f"n{i}" for i in range(rng.randrange(2, 9))]
        classes = {h: f"nc_{rng.randrange(3):08x}" for h in hosts}
        recs = {h: _node(h, rng.choice(plugins[:rng.choice([2, 4])])) for h in hosts}
        image = rng.choice(images)
        able = runnable_classes(image, class_samples(recs, classes))
        for cls in set(classes.values()):
            members = [h for h in hosts if classes[h] == cls]
            subsets = [members] + [rng.sample(members, 2) for _ in range(3) if len(members) > 2]
            verdicts = [_stack_findings({h: recs[h] for h in s}, image) for s in subsets
                        if len(s) >= 2]
            if able is None:
                continue
            if cls in able:
                assert all(v == [] for v in verdicts), (cls, image, verdicts)
                seen["runs"] += 1
            else:
                assert all(v == ["refuse"] for v in verdicts), (cls, image, verdicts)
                seen["not"] += 1
        if able is None:
            seen["none"] += 1
            mixed = []
            for cls in set(classes.values()):
                st = stacks(image, {h: r for h, r in recs.items() if classes[h] == cls})
                mixed.append(len({(x["fallback"], x["transport"]) for x in st.values() if x}) > 1)
            assert any(mixed), recs
    assert min(seen.values()) >= 10, seen
