"""Values and checks the config modules share (kept apart so that they import nothing of each other)."""

from __future__ import annotations

WEIGHT_QUANTIZATIONS = ("auto", "none", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k")  # kvmosaic.model.loader.QUANTIZATIONS


def is_fraction(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
