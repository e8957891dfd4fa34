"""Built-in data: synthetic RL batches (:mod:`.synthetic`), tiny random-init models of
many transformers families (:mod:`.zoo`: configs here, built with transformers on demand), and
small RL tasks with rule rewards and a character tokenizer (:mod:`.tasks`). Imports nothing of
treepack."""
