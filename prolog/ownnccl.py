"""A batch job's own NCCL, at the gate (issue 40, docs/jobs.md).

A job from a virtualenv, a conda env or a module loads the libnccl its environment names,
not the node's. The gate learns that environment from the copy slurmctld saved at submit
(``StateSaveLocation/hash.N/job.ID/environment``: slurmctld's file, mode 0600, which
PrologSlurmctld may read as SlurmUser; its content is the user's: docs/slurm.md). It keeps
only the variables that decide loading (:func:`ncclguard.fingerprint.jobenv.loading_vars`)
and names them by :func:`~ncclguard.fingerprint.jobenv.env_key`. It never opens a user's
file: the collector resolves each environment the gate's audit trail names, as an
unprivileged user and only what the job's owner may read, and files the library it found
under that key (``job_envs``); the gate looks the key up. So:

- an environment the collector resolved to a library: the job is judged by that library
  on each node (``evaluate_nccl``), not by the host's libnccl;
- one it could not read: by what holds for any NCCL and the host's stack, with
  ``job-nccl-unknown`` saying why;
- one it has not seen yet (the first job from a new env), or that names no library of its
  own: as every job is judged without one (the host's stack and what the nodes add), and
  the verdict's note says so;
- no saved environment (``salloc``/``srun``, ``sbatch --export=NONE``, a purged file):
  likewise, with the reason in the audit record.

Hot path: standard library and ncclguard's core only; nothing here blocks on a user's file.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from ncclguard.config import PolicyConfig
    from ncclguard.policy.verdict import Verdict
    from ncclguard.store.inventory import JobEnv

__all__ = ["MAX_HANDED", "JobVars", "judge", "read", "summary"]

#: The most of a job's loading variables handed on in the audit record (its JSON): an
#: audit line holds 64 KiB (ncclguard/audit.py); an environment over this is not resolved.
MAX_HANDED = 32 * 1024


class JobVars(NamedTuple):
    """What the gate took of a job's saved environment."""

    key: str  # env_key(inputs): the inputs alone decide which libnccl loads
    variables: dict[str, str]  # the loading variables that were set, NCCL_* ones included
    own: bool  # whether any of them may name a libnccl of the job's own (jobenv.INPUTS)
    problems: tuple[str, ...]  # what was not read, and why

    @property
    def inputs(self) -> dict[str, str]:
        """The variables that decide which libnccl the job loads (``jobenv.INPUTS``)."""
        from ncclguard.fingerprint.jobenv import INPUTS

        return {k: v for k, v in self.variables.items() if k in INPUTS}

    @property
    def nccl(self) -> dict[str, str]:
        """The job's ``NCCL_*`` variables: applied at the gate, never handed on."""
        return {k: v for k, v in self.variables.items() if k.startswith("NCCL_")}

    def record(self, uid: int | None) -> dict[str, Any]:
        """The audit record's ``job_env``: what the collector resolves, the inputs only (a
        job's ``NCCL_*`` variables do not change which library loads: every combination
        of them is one resolution, not one each)."""
        return {"key": self.key, "vars": self.inputs, "uid": uid}


def state_dir(gate: Any) -> tuple[str | None, str | None]:
    """``(StateSaveLocation, None)`` or ``(None, why not)``: ``[gate]
    state_save_location``, else slurm.conf's."""
    if gate.state_save_location:
        return gate.state_save_location, None
    from ncclguard.slurm.conf import conf_path, setting

    path = conf_path(gate.slurm_conf)
    value, why = setting(path, "StateSaveLocation")
    if why is not None:
        return None, why
    if value is None:
        return None, f"{path} sets no StateSaveLocation"
    return value, None


def read(gate: Any, job_id: int, array_job_id: int | None) -> tuple[JobVars | None, str | None]:
    """``(the job's loading variables, None)``, or ``(None, why not)`` (no saved
    environment, or one that cannot be read)."""
    from ncclguard.fingerprint.jobenv import INPUTS, MAX_VALUE, NCCL_VARS, env_key, loading_vars
    from ncclguard.slurm import savedenv

    where, why = state_dir(gate)
    if where is None:
        return None, f"the job's saved environment: {why}"
    path = savedenv.environment_path(where, job_id, array_job_id)
    saved = savedenv.read(path, INPUTS + NCCL_VARS, max_value=MAX_VALUE)
    if saved.missing:
        return None, f"{path}: no saved environment (not an sbatch job's, or purged)"
    if saved.twice:  # ld.so takes the last LD_* (rtld.c), bash binds the last: not the
        # first this reader keeps; which one the job's processes see is not one answer
        return None, (f"{path}: {', '.join(saved.twice)} saved more than once: which value "
                      "the job's processes use is not known: not resolved")
    if saved.problems and not saved.values:  # a file not taken (whose, what), or unreadable
        return None, "; ".join(saved.problems)
    variables, problems = loading_vars(saved.values)
    problems = (*saved.problems, *problems)
    inputs = {k: v for k, v in variables.items() if k in INPUTS}
    # what is handed on is the inputs alone: the NCCL_* variables, applied here, never
    # count (a 40 KB NCCL_TUNER_PLUGIN dropped the job's NCCL_IB_DISABLE with them)
    size = len(json.dumps(inputs, ensure_ascii=True))
    if size > MAX_HANDED:
        return None, (f"{path}: the job's loading variables take {size} bytes, more than "
                      f"{MAX_HANDED} handed on: not resolved")
    own = any(k in variables for k in INPUTS)
    return JobVars(env_key(inputs), variables, own, problems), None


def summary(resolved: JobEnv) -> dict[str, Any]:
    """The audit record's ``job_nccl``: what the collector found for the job's environment
    (a ``JobEnv`` of ``Inventory.load_job_env``)."""
    library = resolved.library or {}
    return {"source": resolved.source, "path": resolved.path,
            "nccl_version": library.get("nccl_version"), "error": resolved.error,
            "resolved_at": resolved.resolved_at}


def judge(
    records: Mapping[str, dict | None],
    config: PolicyConfig,
    stale: Collection[str],
    partition: str | None,
    env: JobVars | None,
    resolved: JobEnv | None,
    prefer: Collection[str] = (),
) -> Verdict:
    """The verdict for a job without a container image: by its own libnccl where the
    collector resolved one for ``env`` (``resolved``: ``Inventory.load_job_env``'s
    answer, None when the key is not filed yet), else as any job (module doc); the job's
    ``NCCL_*`` variables applied to each node either way (``ncclguard.policy.jobvars``).
    ``prefer``: the tie-break's nodes to keep (``ncclguard.policy.break_tie``)."""
    from ncclguard.policy import evaluate_env, evaluate_nccl, evaluate_values

    if env is None:
        return evaluate_values(records, config, stale, partition, prefer)
    if not env.own:
        return evaluate_env(records, config, env.variables, stale, partition, prefer)
    from ncclguard.fingerprint.jobenv import INPUTS

    if resolved is not None and resolved.source != "host":
        return evaluate_nccl(records, config, resolved.library, resolved.error, stale,
                             partition, prefer, env.variables)
    named = ", ".join(f"{k}={v[:120]}" for k, v in env.variables.items() if k in INPUTS)
    verdict = evaluate_env(records, config, env.variables, stale, partition, prefer)
    verdict.notes.append(
        f"the job's own NCCL ({named}) is not read yet: judged by the nodes' stacks and "
        "what they add; the collector reads it for the next job from this environment"
        if resolved is None else
        f"the job's environment ({named}) names no libnccl of its own that its owner may "
        "read: judged by the node's")
    return verdict
