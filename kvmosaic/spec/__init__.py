"""Speculative decoding: proposers guess the next tokens, the target verifies them in one pass."""
