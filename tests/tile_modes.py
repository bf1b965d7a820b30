"""The bf16 prefill paths a kernel test checks: the AVX-512 / AVX2 register kernels, and the AMX tiles
where this build and CPU have them (the avx512_bf16 kernels on Sapphire Rapids and later). A test
runs its checks once per mode instead of skipping the tiles elsewhere."""

from __future__ import annotations

import contextlib

import torch


def tile_modes(ops, dtype: torch.dtype) -> list[bool]:
    """[False] (registers), plus True (tiles) for bfloat16 where the kernels can use them."""
    return [False, True] if dtype == torch.bfloat16 and ops.amx_supported() else [False]


@contextlib.contextmanager
def amx(ops, on: bool):
    """Runs the block with the tiles switched on or off, then restores the switch. The tiles take only
    products of many rows, so they run only with batch invariance off (ops.set_batch_invariant)."""
    invariant = ops.batch_invariant()
    ops.set_batch_invariant(False)
    before = ops.amx_enabled()  # the switch alone
    assert ops.set_amx(on) == on
    ops.set_batch_invariant(not on)
    try:
        yield
    finally:
        ops.set_amx(before)
        ops.set_batch_invariant(invariant)
