"""The node inventory: the one place where ncclguard speaks SQL.

One :class:`Inventory` serves the daemon (``upsert``/``heartbeat``), the Slurm gate
(``Inventory(readonly=True, values=GATE_VALUES).load_values(hosts)``) and the admin CLI
(``classes``, ``nodes``, ``history``, ``fingerprint_at``, ``stale``). See docs/store.md
for the schema, the locking model and the failure modes.

Its table families live in modules of their own, one class each, which ``Inventory``
combines: :mod:`.nodes` (the nodes, their history, the gate's values), :mod:`.classes`
(each node's class), :mod:`.records` (the collector's publishers, rejections and write
stamp), :mod:`.images` (the image index and the container runs), :mod:`.jobenvs` (the job
environments the collector resolved), :mod:`.runtime` (what running job steps loaded,
and the steps found mixed); :mod:`.connection`
opens, locks and migrates the file.

The read-only path imports only the standard library and the fingerprint model:
sqlite-utils is imported lazily, where the schema is created or migrated. What the
policy derives of a fingerprint (``GATE_VALUES``, or ``class_values`` with the classes)
is handed in by the caller.
"""

from __future__ import annotations

from pathlib import Path

from ncclguard.config import InventoryConfig
from ncclguard.store.canary import CanaryTables
from ncclguard.store.classes import ClassTables, NodeClass
from ncclguard.store.images import ImageState, ImageTables, RegistryTables, RegistryTag
from ncclguard.store.jobenvs import JobEnv, JobEnvTables
from ncclguard.store.nodes import DEFAULT_HEARTBEAT_S, NodeRecord, NodeTables, NodeWrite
from ncclguard.store.records import REFUSED, Published, Quota, RecordTables, Rejected
from ncclguard.store.runtime import RuntimeTables
from ncclguard.store.schema import GateValues

__all__ = [
    "DEFAULT_HEARTBEAT_S", "REFUSED", "ImageState", "Inventory", "JobEnv", "NodeClass",
    "NodeRecord", "NodeTables", "NodeWrite", "Published", "Quota", "RegistryTag", "Rejected",
]


class Inventory(ClassTables, RecordTables, ImageTables, RegistryTables, JobEnvTables,
                RuntimeTables, CanaryTables):
    """The node inventory in one SQLite file (:class:`~ncclguard.store.connection.Database`
    says how it is opened, locked and migrated).

    ``heartbeat_s``: how often :meth:`upsert` rewrites an unchanged fingerprint's
    heartbeat (a writer's setting).
    """

    def __init__(
        self,
        path: Path | str | None = None,
        *,
        readonly: bool = False,
        config: InventoryConfig | None = None,
        values: GateValues | None = None,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    ) -> None:
        self.heartbeat_s = heartbeat_s
        super().__init__(path, readonly=readonly, config=config, values=values)
        if not readonly and values is not None and values.class_policy is not None:
            self.derive_classes()

    def integrity_check(self) -> str:
        """``PRAGMA integrity_check``: "ok" or SQLite's list of problems."""
        rows = self._reading(
            "check integrity", lambda c: c.execute("PRAGMA integrity_check").fetchall()
        )
        return "\n".join(r[0] for r in rows)

    def schema_version(self) -> int:
        return int(
            self._reading("read version", lambda c: c.execute("PRAGMA user_version").fetchone()[0])
        )
