"""The ISA levels kernel tests run on: every level built and runnable here (AVX-512, AVX2, portable, ...),
each loaded explicitly, so an AVX-512 host also checks the AVX2 and portable builds."""

from __future__ import annotations

import functools

import pytest

from kvmosaic.ops import Kernels, available_levels

LEVELS = available_levels()


def level_params(*extra: str) -> list:
    """``extra`` (e.g. "reference") followed by one param per built level, with readable ids."""
    return [*extra, *(pytest.param(name, id=name) for name in LEVELS)]


@functools.cache
def kernels_for(name: str) -> Kernels:
    """The kernels of a level name, or the PyTorch reference for "reference"."""
    return Kernels.reference() if name == "reference" else Kernels.load(level=name)
