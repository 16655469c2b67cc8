"""What the adapter returns, the same on every Slurm release: typed results and errors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_TEXT = 1000  # longest AdminComment / notify text we send


class SlurmError(Exception):
    """A Slurm command failed. ``argv``, ``returncode`` and ``stderr`` say how."""

    def __init__(
        self,
        message: str,
        argv: Sequence[str] = (),
        returncode: int | None = None,
        stderr: str = "",
    ) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(message)


class SlurmTimeout(SlurmError):
    """A Slurm command ran past its timeout (or the caller's deadline) and was killed."""


class SlurmNotFound(SlurmError):
    """The Slurm command is not installed where we looked."""


class SlurmSchemaError(SlurmError):
    """Slurm answered, but in a shape this ncclguard cannot read (the message names the
    Slurm release and data parser). Callers treat it as any failed Slurm call."""


@dataclass(frozen=True, order=True)
class Release:
    """A Slurm release, as ``scontrol --version`` or an answer's ``meta`` names it."""

    major: int
    minor: int
    micro: int = 0

    @classmethod
    def parse(cls, text: str) -> Release:
        """``"24.11.5"``, ``"slurm 24.11.5"``, ``"slurm-wlm 22.05.8"`` or ``"25.11.0-0rc1"``."""
        word = text.split()[-1] if text.split() else ""
        parts = word.split("-")[0].split(".")
        try:
            major, minor = int(parts[0]), int(parts[1])
            micro = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else 0
        except (IndexError, ValueError):
            raise SlurmError(f"not a Slurm version: {text.strip()[:80]!r}") from None
        return cls(major, minor, micro)

    def __str__(self) -> str:
        return f"{self.major}.{self.minor:02d}.{self.micro}"


@dataclass(frozen=True)
class NodeInfo:
    name: str
    state: str  # the base state, lower case: "idle", "allocated", "mixed", "down", ...
    flags: tuple[str, ...] = ()  # upper case: "DRAIN", "NOT_RESPONDING", ...
    reason: str = ""
    partitions: tuple[str, ...] = ()
    features: tuple[str, ...] = ()  # the node's available features
    active_features: tuple[str, ...] = ()
    cpus: int = 0
    address: str = ""  # NodeAddr (Slurm fills in NodeHostname, then NodeName, when unset)
    hostname: str = ""  # NodeHostname

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.flags or self.state.startswith("drain")


@dataclass(frozen=True)
class JobInfo:
    job_id: int
    state: str  # as squeue %T says: "PENDING", "RUNNING", "CONFIGURING", "COMPLETED", ...
    user: str = ""
    user_id: int | None = None  # the job's uid
    partition: str = ""
    nodes: str = ""  # allocated hostlist ("" while pending)
    node_count: int = 0
    required_nodes: str = ""  # -w / --nodelist
    excluded_nodes: str = ""  # -x / --exclude
    state_reason: str = ""
    restart_count: int = 0
    batch: bool = False
    admin_comment: str = ""
    comment: str = ""
    priority: int = 0
    name: str = ""
    start_time: float | None = None  # epoch seconds; None while pending (Slurm says 0)
    end_time: float | None = None  # epoch; running: the expected end (start + time limit)
    work_dir: str = ""
    batch_host: str = ""  # the node that runs the batch script ("" while pending)
    array_job_id: int = 0  # 0: not an array job
    array_task_id: int | None = None
    std_out: str = ""  # the StdOut file (%j etc. expanded, %N left: only the node knows it)
    std_err: str = ""  # the StdErr file, the same way (StdOut's file when not given)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


def clean_text(text: str, limit: int = MAX_TEXT) -> str:
    """One line of printable text, at most ``limit`` characters (for AdminComment/notify)."""
    line = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
