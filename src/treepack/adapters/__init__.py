"""Adapters to frameworks: transformers (``hf``), TRL, verl, and the model zoo. Imported by
the short paths ``treepack.hf``, ``treepack.trl``, ``treepack.verl``, ... (see treepack.PATHS)."""
