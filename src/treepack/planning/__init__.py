"""Planning: packs under a token budget, rank assignment, collation, GRPO group placement.
Imports the core only."""
