"""Prevention inside Slurm's scheduler: class features on the nodes, and the file of
classes that the shipped ``slurm/job_submit.lua`` reads (docs/scheduling.md).

- :mod:`.classfile`: that file: written atomically, parsed strictly (the lua reads it the
  same way).
- :mod:`.sync`: what each node's features should be (the policy's
  :func:`~ncclguard.policy.schedule.scheduling_classes` over the inventory), what Slurm
  has, the fewest ``scontrol update`` calls that make them agree, and the file.

The CLI (``ncclguard features``), the sync daemon (``ncclguard-inventoryd features``)
and the restore hooks Slurm runs all call :func:`.sync.sync`.
"""
