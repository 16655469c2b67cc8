"""One probe per source of facts. Each takes the node root (``--root``) as a value."""
