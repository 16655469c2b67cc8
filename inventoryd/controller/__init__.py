"""What runs on the Slurm controller: the collector (``ncclguard-inventoryd collect``: it
verifies the spool's records and is the one writer of the inventory), its metrics, the
image index and the container records it keeps, and the class-features daemon
(``ncclguard-inventoryd features``) with its hook. Never imports :mod:`inventoryd.node`."""
