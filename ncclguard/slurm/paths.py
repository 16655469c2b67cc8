"""The files a batch job writes its output to, from Slurm's ``--output``/``--error`` patterns."""

from __future__ import annotations

import os


def output_path(
    pattern: str,
    *,
    job_id: int,
    name: str = "",
    user: str = "",
    array_job_id: int = 0,
    array_task_id: int | None = None,
    work_dir: str = "",
    batch: bool = True,
    array_mod10: bool = False,
) -> str:
    """The file a batch job writes for the ``--output``/``--error`` ``pattern``.

    ``pattern`` "" is Slurm's default, ``slurm-%j.out`` (``slurm-%A_%a.out`` for an array
    task) in the working directory; interactive jobs have none. A relative pattern is
    taken from ``work_dir``. ``%A %a %j %J %u %x`` are expanded, with a width
    (``%5j``: zero-padded) and ``%%`` as ``%``, as the node does when it opens the file
    (``scontrol show job`` on 22.05 expands the same letters but leaves widths and ``%%``
    as written). ``%N`` (and the step-level ``%n %s %t``) stay: only the node knows them,
    and ``%N`` there is its short host name, not always the node name.

    ``array_mod10``: also ``%b`` (the array task id modulo 10), which the node expands
    from Slurm 24.11 on; before, it stays as written. (25.11's ``%r`` and ``%S`` are
    not expanded here.)
    """
    in_array = array_task_id is not None and array_job_id > 0
    if not pattern:
        if not batch:
            return ""
        pattern = "slurm-%A_%a.out" if in_array else "slurm-%j.out"
    task = array_task_id if in_array and array_task_id is not None else 4294967294  # NO_VAL
    subs = {
        "A": str(array_job_id if in_array else job_id),
        "a": str(task),  # NO_VAL for a plain job, as Slurm prints it
        "j": str(job_id),
        "J": str(job_id),
        **({"b": str(task % 10)} if array_mod10 else {}),
        "u": user,
        "x": name,
    }
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "%" and i + 1 < len(pattern):
            if pattern[i + 1] == "%":
                out.append("%")
                i += 2
                continue
            j = i + 1
            while j < len(pattern) and pattern[j].isdigit():
                j += 1
            key = pattern[j] if j < len(pattern) else ""
            if key in subs:
                width = min(int(pattern[i + 1 : j] or 0), 10)
                val = subs[key]
                out.append(val.zfill(width) if key in "AabjJ" and width else val)
                i = j + 1
                continue
        out.append(c)
        i += 1
    path = "".join(out)
    if work_dir and not path.startswith("/"):
        path = os.path.join(work_dir, path)
    return path
