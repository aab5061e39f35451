"""Speculative decoding components: the n-gram proposer, the drafter policy the scheduler
asks for drafts, and the verifier that turns the target's samples into accepted tokens."""
