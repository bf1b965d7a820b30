"""Executors: what the engine hands each scheduled step to (a local worker, a mock, later several workers)."""
