"""inventoryd: fingerprint one node's NCCL communication stack and keep it in the inventory."""
