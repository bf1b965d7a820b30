"""Exceptions that cross the engine boundary."""

from __future__ import annotations


class RetryableStepError(RuntimeError):
    """The step ran nothing and may simply be scheduled again (its executor already knows why,
    e.g. a lost KV holder whose requests it recomputes); the engine re-raises it untouched."""


class EngineUnavailableError(RuntimeError):
    """No live worker can take the request now (lost, or still restarting): a server fault, retry later."""
