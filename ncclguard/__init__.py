"""ncclguard: keep multi-node NCCL jobs off nodes whose communication stacks disagree."""

__version__ = "0.1.0"
