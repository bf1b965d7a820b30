"""Each kernel a token goes through computes its row the same, bit for bit, whether the row is alone,
one of a few decode rows or one of hundreds of prefill rows, at every ISA level built here: the
activation quantization and the order of every sum are the row's own. (Attention is checked in
tests/attention; here a sequence's first token, whose attention is its own value vector at any split,
carries the whole stack through the decode team, the per-layer path and a prefill span.)"""

from __future__ import annotations

import pytest
import torch

from kvmosaic.attention.paged import KernelAttention
from kvmosaic.config import CacheConfig, EngineConfig
from kvmosaic.model.layers.linear_methods import PackedFloat, linear_method
from kvmosaic.model.loader import load_model
from kvmosaic.ops import Kernels
from kvmosaic.outputs import ScheduledRequest
from kvmosaic.quant import interleaved as qi
from kvmosaic.quant import weights as qw
from kvmosaic.sampling_params import SamplingParams
from kvmosaic.worker.model_runner import ModelRunner
from kvmosaic.worker.worker import Worker

DTYPES = [torch.float32, torch.bfloat16]
# a decode row alone, a few (one team with every thread doing the small phases), the decode rows of a
# speculative step, many decode rows, a prefill's rows
ROW_COUNTS = [2, 3, 4, 5, 12, 17, 64, 512]  # 17: past the AMX tiles' 16 rows
K, N = 512, 48  # q4_k and q6_k need whole 256-weight super-blocks


@pytest.fixture
def ops(level_kernels: Kernels):
    return level_kernels.ops


def _same_row_at_any_count(product, row: torch.Tensor, gen: torch.Generator) -> None:
    """product(x [m, K]) -> [m, ...]: the row alone gives what it gives first, in the middle and last
    of m rows, for every m of ROW_COUNTS."""
    alone = product(row[None])
    for m in ROW_COUNTS:
        for at in {0, m // 2, m - 1}:
            rows = (torch.randn(m, row.shape[0], generator=gen) * 2).to(row.dtype)
            rows[at] = row
            got = product(rows)[at:at + 1]
            assert torch.equal(got, alone), f"row {at} of {m}: max diff {(got.float() - alone.float()).abs().max()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q4_k", "q6_k"])
def test_quantized_linear_row_is_the_same_at_any_row_count(ops, fmt, dtype):
    gen = torch.Generator().manual_seed(1)
    weight = qi.interleave(qw.quantize(torch.randn(N, K, generator=gen) * 0.05, fmt))
    bias = torch.randn(N, generator=gen)
    row = (torch.randn(K, generator=gen) * 2).to(dtype)
    _same_row_at_any_count(lambda x: ops.quantized_linear(x, weight.codes, weight.scale, weight.extra, bias), row, gen)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_products_row_is_the_same_at_any_row_count(ops, dtype):
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(2 * N, K, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(2 * N, generator=gen)
    packed, gate_up = ops.pack_linear_weight(weight), ops.pack_swiglu_weight(weight[:64])
    row = torch.randn(K, generator=gen).to(dtype)
    _same_row_at_any_count(lambda x: ops.packed_linear(x, packed, bias), row, gen)
    _same_row_at_any_count(lambda x: ops.packed_swiglu(x, gate_up), row, gen)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_float_weight_of_odd_width_is_packed_not_left_to_onednn(level_kernels, dtype):
    """A width that is not whole 16-column blocks (a vocab with a few added tokens) is packed with zero
    columns and cut back, instead of running oneDNN / F.linear, whose result for a row changes with the
    row count (float32: by a few ulps from 2 rows on); the stack, which does not cut, leaves it out."""
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(37, K, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(37, generator=gen)
    method = linear_method(weight, bias, level_kernels)
    assert isinstance(method, PackedFloat) and method.out_features == 37 and method.stack_weights() is None
    row = torch.randn(K, generator=gen).to(dtype)
    out = method.apply(row[None])
    assert out.shape == (1, 37) and out.is_contiguous()
    torch.testing.assert_close(out.float(), torch.nn.functional.linear(row[None].float(), weight.float(), bias),
                               atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    _same_row_at_any_count(method.apply, row, gen)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_and_swiglu_rows_are_the_same_at_any_row_count(ops, dtype):
    gen = torch.Generator().manual_seed(4)
    weight = torch.rand(K, generator=gen).to(dtype)
    delta = torch.randn(K, generator=gen).to(dtype)

    def norm(x: torch.Tensor) -> torch.Tensor:  # residual += delta, then the norm: both rows compared
        residual = x.clone()
        out = ops.add_rms_norm(residual, delta.expand_as(x).contiguous(), weight, 1e-5)
        return torch.cat([residual, out], dim=1)

    _same_row_at_any_count(norm, (torch.randn(K, generator=gen) * 3).to(dtype), gen)
    _same_row_at_any_count(ops.silu_and_mul, torch.randn(K, generator=gen).to(dtype), gen)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_and_cache_write_of_a_row_is_the_same_at_any_row_count(ops, dtype):
    hq, hk, d = 9, 3, 64
    cos, sin = torch.randn(700, d // 2), torch.randn(700, d // 2)
    gen = torch.Generator().manual_seed(5)

    def rope(qkv: torch.Tensor) -> torch.Tensor:
        """Row r at position 600 - 5 r, written to cache slot r: its rotated q, k and v side by side."""
        m = qkv.shape[0]
        k_cache = torch.zeros(m, 1, hk, d, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        q = ops.rope_and_cache(qkv, 600 - 5 * torch.arange(m), cos, sin, k_cache, v_cache, torch.arange(m), hq, hk)
        return torch.cat([q.flatten(1), k_cache.flatten(1), v_cache.flatten(1)], dim=1)

    row = torch.randn((hq + 2 * hk) * d, generator=gen).to(dtype)
    alone = rope(row[None])
    for m in ROW_COUNTS:  # the row first (at the same position), others after it
        rows = torch.cat([row[None], torch.randn(m - 1, row.shape[0], generator=gen).to(dtype)])
        assert torch.equal(rope(rows)[:1], alone), f"{m} rows"


def test_argmax_and_embedding_rows_are_the_same_at_any_row_count(ops):
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(49152, generator=gen)
    _same_row_at_any_count(ops.argmax_rows, logits, gen)
    table = qi.interleave(qw.quantize(torch.randn(64, K, generator=gen), "q8_0"))
    for dtype in DTYPES:
        alone = ops.quantized_rows(table.codes, table.scale, table.extra, torch.tensor([7]), dtype)
        many = ops.quantized_rows(table.codes, table.scale, table.extra, torch.arange(64), dtype)
        assert torch.equal(many[7:8], alone)


def test_amx_tiles_take_no_product_while_the_kernels_keep_batch_invariance(ops):
    """The AMX tiles sum a product of 16 rows or more in another order than the vector kernels (and
    take q8 / q4 rows as bf16, not int8): switched on, they still take nothing while batch invariance
    is on (the default), and take their products where supported once it is off."""
    invariant = ops.batch_invariant()
    ops.set_batch_invariant(False)
    switch = ops.amx_enabled()
    try:
        ops.set_amx(True)
        ops.set_batch_invariant(True)
        assert not ops.amx_enabled()
        ops.set_batch_invariant(False)
        assert ops.amx_enabled() == ops.amx_supported()
    finally:
        ops.set_amx(switch)
        ops.set_batch_invariant(invariant)


# ---- the whole stack, on a sequence's first token ----------------------------------------------------

class LayerByLayer(KernelAttention):
    """The kernel backend without the all-layers call: every step runs the per-layer path."""

    def layer_stack(self):
        return None


@pytest.fixture(scope="module")
def q4_1_models() -> dict[torch.dtype, object]:
    """The shipped Q4_1 weights with float32 and bfloat16 activations."""
    return {dtype: load_model(None, dtype) for dtype in DTYPES}


def _runners(loaded, kernels: Kernels, dtype: torch.dtype) -> tuple[ModelRunner, ModelRunner]:
    config = EngineConfig(dtype=str(dtype).removeprefix("torch."), cache=CacheConfig(block_size=16, num_blocks=20))
    worker = Worker.start(config, loader=lambda path, d: loaded, kernels=kernels)
    looped = ModelRunner(worker.model, LayerByLayer(loaded.config, worker.kv_cache, kernels.ops), ())
    return worker.runner, looped


def _first_token(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """The logits of tokens[0] as the first token of its sequence, in one step with each other token
    the first of a sequence of its own (decode rows)."""
    greedy = SamplingParams(temperature=0.0)
    batch = [ScheduledRequest(str(i), [t], 0, [i], greedy, sample_ids=[str(i)], sample_seeds=[None])
             for i, t in enumerate(tokens)]
    requests, logits = runner.compute_logits(batch)
    return logits[[r.request_id for r in requests].index("0")][None]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_first_token_logits_are_the_same_alone_among_rows_and_in_a_prefill(level_kernels, q4_1_models, dtype):
    """The logits of a sequence's first token (attention: its own value vector, at any split) through
    the decode team (one row; a few rows, every thread doing the small phases; many rows, the phases
    shared), the per-layer path, and as the first row of a prefill span, bit for bit the same."""
    stacked, looped = _runners(q4_1_models[dtype], level_kernels, dtype)
    gen = torch.Generator().manual_seed(7)
    token = 1234
    alone = _first_token(stacked, [token])
    for count in (3, 17):  # every thread doing the small phases; shared phases, past AMX_MIN_ROWS
        tokens = [token, *torch.randint(10, 40000, (count - 1,), generator=gen).tolist()]
        assert torch.equal(_first_token(stacked, tokens), alone), f"decode team, {count} rows"
        assert torch.equal(_first_token(looped, tokens), alone), f"per-layer path, {count} rows"
    prompt = [token, *torch.randint(10, 40000, (15,), generator=gen).tolist()]
    for runner in (stacked, looped):  # a prefill span's rows all give logits: its first is the token alone
        assert torch.equal(runner.chunk_logits(prompt, 0, [0])[:1].float(), alone)
