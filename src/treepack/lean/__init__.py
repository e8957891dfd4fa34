"""Lean log-probs (from hidden states, without [T', V] logits) and the losses that read them.
Imports the core only."""
