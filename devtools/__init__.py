"""Development tools: the dev Slurm cluster, the demo, node trees, NCCL wheels. Not in the wheel."""
