"""The shared SQLite inventory: the one place where ncclguard speaks SQL (docs/store.md).

- :mod:`.inventory`: :class:`Inventory`, its writes (``upsert``, ``heartbeat``) and queries;
- :mod:`.connection`: opening the file safely, transactions, retries, hot journals;
- :mod:`.schema`: the migrations and the gate's narrow tables (:class:`GateValues`);
- :mod:`.rows`: the query columns derived from a fingerprint;
- :mod:`.errors`: :class:`InventoryError` and one subclass per cause.

The store imports the fingerprint model, never the policy: what the policy derives of a
fingerprint for the gate is handed in as ``values=`` (``ncclguard.policy.GATE_VALUES``).
"""

from ncclguard.store.errors import (
    InventoryCorrupt,
    InventoryError,
    InventoryFull,
    InventoryLocked,
    InventoryMissing,
    InventoryReadOnly,
    InventoryUnsafe,
)
from ncclguard.store.inventory import DEFAULT_HEARTBEAT_S, Inventory, NodeClass, NodeRecord
from ncclguard.store.schema import SCHEMA_VERSION, GateValues

__all__ = [
    "DEFAULT_HEARTBEAT_S",
    "SCHEMA_VERSION",
    "GateValues",
    "Inventory",
    "InventoryCorrupt",
    "InventoryError",
    "InventoryFull",
    "InventoryLocked",
    "InventoryMissing",
    "InventoryReadOnly",
    "InventoryUnsafe",
    "NodeClass",
    "NodeRecord",
]
