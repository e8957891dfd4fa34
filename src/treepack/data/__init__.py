"""Built-in workloads: synthetic RL batches. Imports nothing of treepack."""
