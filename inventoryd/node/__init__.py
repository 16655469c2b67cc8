"""What runs on every compute node: the fingerprint (every probe once), the node daemon
(``ncclguard-inventoryd run``), the signed publish to the spool, the node's textfile
metrics, and the enroot hook's command. Never imports :mod:`inventoryd.controller`."""
