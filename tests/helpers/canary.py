"""The canary's model of Slurm on a virtual clock and its cluster (issue 43): shared by
tests/test_canary.py, tests/test_canary_hostile.py and bench/bench_canary.py.

:class:`FakeSlurm` is a small scheduler (idle nodes, held and released jobs, a time per
job); :class:`Cluster` is a real inventory written as the collector writes it, the model
and the service (``inventoryd.controller.canary``) on one clock.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers.inventory import NodeSpec, base_fingerprint, build
from inventoryd.controller.canary import CanaryService
from ncclguard.config import CanaryConfig, Config, InventoryConfig, PolicyConfig
from ncclguard.hostlist import expand
from ncclguard.policy.schedule import class_values
from ncclguard.sched.sync import desired
from ncclguard.slurm import SlurmError
from ncclguard.slurm.model import JobInfo, NodeInfo
from ncclguard.store import Inventory

__all__ = ["Clock", "Cluster", "FakeSlurm", "failing", "history", "two_classes"]


class FakeSlurm:
    """A scheduler on a virtual clock: a released job starts when all its nodes are idle
    and ends ``duration`` later with ``outcome(nodes)``; a node runs one job at a time."""

    def __init__(self, hosts: list[str], clock: Callable[[], float]) -> None:
        self.hosts = hosts
        self.clock = clock
        self.drained: dict[str, str] = {}
        self.busy: set[str] = set()  # taken by other work
        self.jobs: dict[int, dict[str, Any]] = {}
        self.next_id = 100
        self.up = True
        self.duration = 60.0
        self.outcome: Callable[[list[str]], str] = lambda nodes: "COMPLETED"
        self.calls: list[tuple[str, Any]] = []

    def _check(self) -> None:
        if not self.up:
            raise SlurmError("squeue: exit 1: Unable to contact slurm controller")

    def default_partition(self) -> str:
        self._check()
        return "batch"

    def _allocated(self) -> set[str]:
        return {h for j in self.jobs.values() if j["state"] == "RUNNING" for h in j["nodes"]}

    def nodes(self) -> list[NodeInfo]:
        self._check()
        alloc = self._allocated() | self.busy
        out = []
        for h in self.hosts:
            flags = ("DRAIN",) if h in self.drained else ()
            out.append(NodeInfo(name=h, state="allocated" if h in alloc else "idle",
                                flags=flags, reason=self.drained.get(h, ""),
                                partitions=("batch",)))
        return out

    def submit(self, args: list[str], script: str) -> int:
        self._check()
        self.calls.append(("submit", args))
        nodes = expand(args[args.index("-w") + 1])
        assert args[args.index("-N") + 1] == str(len(nodes))
        assert "-H" in args and "--exclusive" in args and "--no-requeue" in args
        job = self.next_id
        self.next_id += 1
        self.jobs[job] = {"state": "PENDING", "nodes": nodes, "priority": 0,
                          "start": None, "script": script, "submitted": self.clock()}
        return job

    def release(self, job: int) -> None:
        self._check()
        self.calls.append(("release", job))
        self.jobs[job]["priority"] = 1

    def cancel(self, job: int) -> None:
        self._check()
        self.calls.append(("cancel", job))
        if self.jobs[job]["state"] in ("PENDING", "RUNNING"):
            self.jobs[job]["state"] = "CANCELLED"

    def job_progress(self, job: int) -> JobInfo | None:
        self._check()
        j = self.jobs.get(job)
        if j is None:
            return None
        return JobInfo(job_id=job, state=j["state"], priority=j["priority"],
                       start_time=j["start"], state_reason="None")

    def own_jobs(self, name: str) -> list[JobInfo]:
        self._check()
        return [JobInfo(job_id=job, state=j["state"], priority=j["priority"], name=name)
                for job, j in self.jobs.items() if j["state"] in ("PENDING", "RUNNING")]

    def tick(self) -> None:
        """Start and end jobs as of now."""
        now = self.clock()
        for j in self.jobs.values():
            if j["state"] == "RUNNING" and now >= j["start"] + self.duration:
                j["state"] = self.outcome(j["nodes"])
        for _, j in sorted(self.jobs.items()):
            alloc = self._allocated() | self.busy | set(self.drained)
            if j["state"] == "PENDING" and j["priority"] > 0 and not set(j["nodes"]) & alloc:
                j["state"], j["start"] = "RUNNING", now

    def running(self) -> int:
        return sum(1 for j in self.jobs.values() if j["state"] == "RUNNING")

    # what the service must never call: an admin's drain is never touched
    def update_nodes(self, *a: Any) -> None:
        raise AssertionError("the canary changed a node's state in Slurm")

    drain = resume = update_nodes


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _config(db: Path, **canary: Any) -> Config:
    c = {"enabled": True, "command": ("nccl-check", "--quick"), "settle_s": 60.0,
         "interval_s": 15.0, "max_running": 2, "max_nodes": 4, "peers": 1,
         "time_limit_s": 300.0, "pending_timeout_s": 300.0, **canary}
    return Config(inventory=InventoryConfig(db=str(db), stale_after_s=1e9),
                  canary=CanaryConfig(**c))


def _set(db: Path, host: str, spec: NodeSpec, now: float) -> None:
    with Inventory(db, values=class_values(PolicyConfig())) as inv:
        inv.upsert(base_fingerprint(host, spec), now=now)


class Cluster:
    """An inventory, the model of Slurm and the service, on one virtual clock."""

    def __init__(self, tmp_path: Path, specs: dict[str, NodeSpec], **canary: Any) -> None:
        self.clock = Clock()
        self.db = build(tmp_path / "inventory.db", specs, now=self.clock())
        self.cfg = _config(self.db, **canary)
        self.slurm = FakeSlurm(sorted(specs), self.clock)
        self.svc = CanaryService(self.cfg, self.slurm, clock=self.clock)  # type: ignore[arg-type]
        self.notes = [self.svc.apply()]

    def change(self, host: str, spec: NodeSpec) -> None:
        _set(self.db, host, spec, self.clock())

    def passes(self, seconds: float) -> None:
        """The service's passes over ``seconds``, Slurm's time moving between them."""
        end = self.clock.t + seconds
        while self.clock.t < end:
            self.clock.t += self.cfg.canary.interval_s
            self.slurm.tick()
            self.notes.append(self.svc.apply())

    def rows(self) -> dict[str, dict[str, Any]]:
        with Inventory(self.db, readonly=True, values=class_values(PolicyConfig())) as inv:
            return inv.canary_nodes()

    def state(self, host: str) -> str:
        return str(self.rows()[host]["state"])

    def classes(self) -> dict[str, str | None]:
        return desired(self.cfg, self.slurm.hosts, self.clock())


def two_classes(n: int = 4) -> dict[str, NodeSpec]:
    """n1..n(n/2) on NCCL 2.21.5, the rest on 2.18.3: two classes."""
    half = n // 2
    return {f"n{i}": NodeSpec(nccl="2.21.5" if i <= half else "2.18.3")
            for i in range(1, n + 1)}


def history(c: Cluster, host: str) -> list[dict[str, Any]]:
    """``host``'s canary events, newest first."""
    with Inventory(c.db, readonly=True, values=class_values(PolicyConfig())) as inv:
        return inv.canary_history(host)


def failing(tmp_path: Path, **canary: Any) -> tuple[Cluster, Path]:
    """A cluster whose canaries fail, with a private output directory, and n4 upgraded
    (2.18.3 to 2.21.5): its canary is next."""
    out = tmp_path / "out"
    out.mkdir(mode=0o700)
    c = Cluster(tmp_path, two_classes(), output_dir=str(out), **canary)
    c.slurm.outcome = lambda nodes: "FAILED"
    c.change("n4", NodeSpec(nccl="2.21.5"))
    return c, out
