"""``ncclguard``: the admin CLI over the shared inventory, the policy and Slurm.

The CLI is thin: it parses options, calls the same :class:`~ncclguard.store.Inventory`,
:mod:`ncclguard.policy` and :class:`~ncclguard.slurm.Slurm` adapter as the daemon and the
gate, and hands plain values to :mod:`.output`. Every command prints a table for people,
``--json`` (and ``--csv`` where rows fit) for scripts. Nothing here needs root except
``drain-recommend --apply/--resume``.

- :mod:`.group`: the command group and its global options; each command is imported when run;
- :mod:`.context`: the shared context (config, inventory, Slurm), node sets, ``TIME``;
- :mod:`.errors`: the exit codes (0 ok; ``check`` 1 warn, 2 refuse; 3 any error);
- :mod:`.output`: tables, CSV, JSON;
- one module per command group: :mod:`.inventory` (nodes, classes, show), :mod:`.changes`
  (diff, history), :mod:`.check`, :mod:`.decisions`, :mod:`.drain` (drain-recommend),
  :mod:`.diagnose`.
"""

from ncclguard.cli.group import main

__all__ = ["main"]
