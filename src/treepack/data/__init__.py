"""Built-in data: synthetic RL batches (:mod:`.synthetic`) and tiny random-init models of
many transformers families (:mod:`.zoo`: configs here, built with transformers on demand).
Imports nothing of treepack."""
