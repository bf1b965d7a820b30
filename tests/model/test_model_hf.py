"""Our paged-attention forward vs HF transformers, logit for logit (float32)."""

from __future__ import annotations

import json

import pytest
import torch
from tile_modes import amx

from kvmosaic.attention.paged import KernelAttention
from kvmosaic.config import CacheConfig, EngineConfig
from kvmosaic.model.loader import load_model
from kvmosaic.outputs import ScheduledRequest
from kvmosaic.sampling_params import SamplingParams
from kvmosaic.worker.model_runner import DECODE_ROW_SPAN, ModelRunner
from kvmosaic.worker.worker import Worker

transformers = pytest.importorskip("transformers")

# float32 logits (magnitude ~10-30) after 30 layers summed in other orders than HF's: a lone decode
# row's attention splits its context over the threads and merges the pieces, which moved the largest
# difference from just under 1e-4 to just over it; a wrong kernel is off by orders of magnitude more
TOL = 2e-4
DECODE_STEPS = 20
GREEDY = SamplingParams(temperature=0.0)


def _write_random_checkpoint(out_dir, arch: str, tokenizer_json: str, head_dim: int = 16,
                             **overrides) -> torch.nn.Module:
    """A small random HF model with GQA and an odd head count, saved as safetensors."""
    torch.manual_seed(0)
    common = dict(vocab_size=49152, intermediate_size=96, num_hidden_layers=3, max_position_embeddings=256,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    if arch == "llama":
        cfg = transformers.LlamaConfig(hidden_size=9 * head_dim, num_attention_heads=9, num_key_value_heads=3,
                                       **common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(hidden_size=7 * head_dim, num_attention_heads=7, num_key_value_heads=1,
                                       **common)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # HF initialises biases to zero; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "tokenizer.json").write_text(tokenizer_json)
    (out_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    return model


def _worker(loaded, block_size: int = 4, num_blocks: int = 64, kernels=None, dtype: str = "float32",
            deterministic: bool = True) -> Worker:
    """The engine's own assembly (kernels as built unless given, backend chosen by the worker) over ``loaded``."""
    config = EngineConfig(dtype=dtype, cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                          deterministic=deterministic)
    return Worker.start(config, loader=lambda path, dtype: loaded, kernels=kernels)


def _runner(loaded, block_size: int = 4, num_blocks: int = 64) -> ModelRunner:
    return _worker(loaded, block_size, num_blocks).runner


class LayerByLayer(KernelAttention):
    """The kernel backend without the all-layers call: every step runs the layer loop."""

    def layer_stack(self):
        return None


def _step(runner: ModelRunner, token_ids: list[int], start: int, table: list[int]) -> torch.Tensor:
    req = ScheduledRequest("r", token_ids, start, table, GREEDY, sample_ids=["r"], sample_seeds=[None])
    _, logits = runner.compute_logits([req])
    return logits[0]


def _compare(hf_model, loaded, prompt: list[int], prefill_chunk: int | None = None) -> None:
    runner = _runner(loaded)
    table = list(range(40))[::-1]  # non-contiguous, reversed block ids
    ids = list(prompt)
    chunk = prefill_chunk or len(ids)
    for start in range(0, len(ids), chunk):
        ours = _step(runner, ids[start:start + chunk], start, table)
    for step in range(DECODE_STEPS + 1):
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0, -1].float()
        diff = (ours - ref).abs().max().item()
        assert diff < TOL, f"step {step}: max abs logit diff {diff}"
        if step == DECODE_STEPS:
            break
        ids.append(int(ref.argmax()))
        ours = _step(runner, ids[-1:], len(ids) - 1, table)


@pytest.fixture(scope="module")
def smollm_tokenizer_json(default_model):
    return default_model.tokenizer.to_json()


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "tie_word_embeddings": True}),
    ("qwen2", {}),
])
def test_random_checkpoint_matches_hf(tmp_path, smollm_tokenizer_json, arch, overrides):
    hf_model = _write_random_checkpoint(tmp_path, arch, smollm_tokenizer_json, **overrides)
    loaded = load_model(str(tmp_path), torch.float32)
    assert loaded.config.architecture == arch
    prompt = [int(t) for t in torch.randint(3, 49152, (23,), generator=torch.Generator().manual_seed(1))]
    _compare(hf_model, loaded, prompt)
    _compare(hf_model, loaded, prompt, prefill_chunk=5)


@pytest.mark.slow
def test_default_gguf_matches_hf(default_model, hf_gguf_model):
    prompt = default_model.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    _compare(hf_gguf_model, default_model, prompt)
    _compare(hf_gguf_model, default_model, prompt, prefill_chunk=4)


def test_last_layer_skips_rows_without_logits(tmp_path, smollm_tokenizer_json):
    """Two prefill chunks in one batch: logits of their last rows are the same whether the last
    layer carries every row (logits_indices=None) or only those rows."""
    _write_random_checkpoint(tmp_path, "llama", smollm_tokenizer_json)
    runner = _runner(load_model(str(tmp_path), torch.float32))
    first, second = list(range(5, 16)), list(range(100, 107))
    reqs = [ScheduledRequest(name, ids, 0, table, GREEDY, sample_ids=[name], sample_seeds=[None])
            for name, ids, table in (("a", first, [0, 1, 2]), ("b", second, [3, 4]))]
    input_ids, positions, meta, last_rows = runner._prepare(reqs)
    every_row = runner.model(input_ids, positions, runner.attention, meta)
    _, _, meta, _ = runner._prepare(reqs)
    picked = runner.model(input_ids, positions, runner.attention, meta, torch.tensor(last_rows))
    assert last_rows == [len(first) - 1, len(first) + len(second) - 1]
    torch.testing.assert_close(picked, every_row[last_rows], atol=1e-5, rtol=1e-5)


def test_short_spans_are_decode_rows(tmp_path, smollm_tokenizer_json):
    """A span of up to DECODE_ROW_SPAN tokens (a verification, a short prompt tail) becomes decode
    rows, each over the context up to itself; a longer prefill chunk stays a span, after them."""
    _write_random_checkpoint(tmp_path, "llama", smollm_tokenizer_json)
    runner = _runner(load_model(str(tmp_path), torch.float32))
    long_chunk = list(range(3, 3 + DECODE_ROW_SPAN + 1))
    reqs = [ScheduledRequest("p", long_chunk, 0, [9, 10, 11, 12], GREEDY, sample_ids=["p"], sample_seeds=[None]),
            ScheduledRequest("v", [5, 6, 7, 8], 6, [4, 2, 7], GREEDY, sample_ids=["v"], sample_seeds=[None],
                             spec_token_ids=[6, 7, 8]),
            ScheduledRequest("d", [11], 2, [5], GREEDY, sample_ids=["d"], sample_seeds=[None])]
    ids, positions, meta, last_rows = runner._prepare(sorted(reqs, key=lambda s: s.num_tokens > DECODE_ROW_SPAN))
    assert ids.tolist() == [5, 6, 7, 8, 11, *long_chunk]
    assert positions.tolist() == [6, 7, 8, 9, 2, *range(len(long_chunk))]
    assert meta.num_decode_tokens == 5 and last_rows == [3, 4, 4 + len(long_chunk)]
    assert meta.decode_context_lens.tolist() == [7, 8, 9, 10, 3]
    assert meta.decode_block_tables.tolist() == [[4, 2, 7]] * 4 + [[5, 0, 0]]
    assert meta.slot_mapping[:5].tolist() == [2 * 4 + 2, 2 * 4 + 3, 7 * 4, 7 * 4 + 1, 5 * 4 + 2]
    [span] = meta.prefills
    assert (span.token_start, span.num_tokens, span.context_len) == (5, len(long_chunk), len(long_chunk))
    assert span.block_table.tolist() == [9, 10, 11, 12]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(("dtype", "quantization"), [(torch.float32, None), (torch.bfloat16, None),
                                                     (torch.float32, "q4_1"), (torch.bfloat16, "q8_0")])
def test_layer_stack_equals_layer_loop(tmp_path, smollm_tokenizer_json, arch, dtype, quantization, level_kernels):
    """Every step runs all layers in one kernel call (ops.layer_stack) when every product is packed;
    its logits equal the per-layer path's bit for bit: prefills, pure-decode steps (one team of
    threads for the whole stack) over three and over six sequences with different context lengths,
    one whose unsampled row stops at the last attention, and mixed steps of decode rows (a speculated
    verification and a prompt's short tail are decode rows too) with a prefill chunk longer than
    DECODE_ROW_SPAN, where only the sampled rows go past the last layer's attention (a step of five
    decode rows keeps two), a step of one decode row and one of two keeping one, a step of three rows
    where one reads the new K/V of another (each thread of the team computes a few rows' small phases
    for itself and writes the K/V its attention reads first, unless a row reads another's); with q/k/v biases
    for qwen2, float and quantized weights, float32 and bfloat16 activations, on every ISA level built."""
    # quantized weights need 32-wide blocks of inputs; head size 64 takes the register-blocked attention
    _write_random_checkpoint(tmp_path, arch, smollm_tokenizer_json, head_dim=16 if quantization is None else 64)
    loaded = load_model(str(tmp_path), dtype, quantization)
    dtype_name = str(dtype).removeprefix("torch.")
    worker = _worker(loaded, kernels=level_kernels, dtype=dtype_name)
    assert worker.model._packed_weights is not None and worker.attention.layer_stack() is not None
    calls = []

    class Counted(KernelAttention):
        def layer_stack(self):
            stack = super().layer_stack()
            return lambda *args: calls.append(1) or stack(*args)

    stacked = ModelRunner(worker.model, Counted(loaded.config, worker.kv_cache, worker.kernels.ops), ())
    other = _worker(loaded, kernels=level_kernels, dtype=dtype_name)
    looped = ModelRunner(other.model, LayerByLayer(loaded.config, other.kv_cache, other.kernels.ops), ())
    gen = torch.Generator().manual_seed(3)
    seqs = {name: [int(t) for t in torch.randint(3, 49152, (n,), generator=gen)]
            for name, n in (("a", 3), ("b", 17), ("c", 9), ("d", DECODE_ROW_SPAN + 8), ("e", 5), ("f", 7))}
    tables = {"a": [0, 1, 2, 3, 4], "b": [20, 6, 7, 8, 9, 10, 11], "c": [12, 13, 14, 15, 16, 17],
              "d": [21, 22, 23, 24, 25, 26], "e": [27, 28, 29], "f": [30, 31, 32]}

    def request(name: str, ids: list[int], start: int, spec: int = 0, sampled: bool = True) -> ScheduledRequest:
        return ScheduledRequest(name, ids, start, tables[name], GREEDY, sample_ids=[name] if sampled else [],
                                sample_seeds=[None] if sampled else [],
                                spec_token_ids=ids[len(ids) - spec:] if spec else [])

    for runner in (stacked, looped):
        for name in "abcef":
            runner.compute_logits([request(name, seqs[name], 0)])
    steps = [[request(name, [seqs[name][-1] + step], len(seqs[name]) + step) for name in "abc"]
             for step in range(3)]
    # a and c decode; b verifies three speculated tokens; d prefills its first chunk (a span), then its
    # short rest (decode rows)
    first = DECODE_ROW_SPAN + 4
    steps.append([request("a", [7], 6), request("c", [8], 12), request("b", [5, 6, 7, 8], 20, spec=3),
                  request("d", seqs["d"][:first], 0)])
    steps.append([request("a", [9], 7), request("d", seqs["d"][first:], first)])
    # six decode rows (the int8 activations of more than four rows are shared by the team)
    steps.append([request("a", [10], 8), request("b", [11], 24), request("c", [12], 13),
                  request("d", [13], len(seqs["d"])),
                  request("e", [14], 5), request("f", [15], 7)])
    # c samples nothing this step: its row stops after the last attention
    steps.append([request("a", [16], 9), request("c", [17], 14, sampled=False), request("e", [18], 6)])
    # one row (its context split among the threads, then the splits merged), then two rows keeping one
    steps.append([request("a", [19], 10)])
    steps.append([request("b", [20], 25, sampled=False), request("e", [21], 7)])
    # few rows, one sequence's two among them (a verification): its second row reads its first's new K/V
    steps.append([request("a", [22], 11), request("b", [23, 24], 26, spec=1)])
    for step, reqs in enumerate(steps):
        _, ours = stacked.compute_logits(reqs)
        _, ref = looped.compute_logits(reqs)
        assert ours.shape == ref.shape
        assert torch.equal(ours, ref), f"step {step}: max diff {(ours - ref).abs().max().item()}"
    assert len(calls) == 5 + len(steps)


@pytest.mark.parametrize(("dtype", "quantization"), [(torch.float32, "q4_1"), (torch.bfloat16, "q8_0")])
def test_layer_stack_decode_step_of_many_rows_on_quantized_weights(tmp_path, smollm_tokenizer_json, dtype,
                                                                   quantization, level_kernels):
    """A pure-decode step of AMX_MIN_ROWS rows or more (as B's 64-stream steps are) on quantized
    weights, in one team of threads: where the kernels have AMX tiles the team's products run on
    them (float32 rows rounded to bf16 by the team first), as quantized_linear runs a product of that
    many rows, so the logits equal the layer loop's bit for bit; with the tiles switched off both take
    the int8 dot products and are equal again. On every ISA level built (levels without tiles: the
    int8 path only)."""
    ops = level_kernels.ops
    rows = ops.AMX_MIN_ROWS + 2
    _write_random_checkpoint(tmp_path, "llama", smollm_tokenizer_json, head_dim=64)
    loaded = load_model(str(tmp_path), dtype, quantization)
    dtype_name = str(dtype).removeprefix("torch.")
    gen = torch.Generator().manual_seed(5)
    prompts = [[int(t) for t in torch.randint(3, 49152, (3 + i % 4,), generator=gen)] for i in range(rows)]
    logits = {}
    for tiles in (True, False) if ops.amx_supported() else (False,):
        with amx(ops, tiles):  # the tiles run only where the engine gives up batch invariance
            worker = _worker(loaded, kernels=level_kernels, dtype=dtype_name, num_blocks=2 * rows + 1,
                             deterministic=not tiles)
            assert worker.model._packed_weights is not None and worker.attention.layer_stack() is not None
            other = _worker(loaded, kernels=level_kernels, dtype=dtype_name, num_blocks=2 * rows + 1,
                            deterministic=not tiles)
            looped = ModelRunner(other.model, LayerByLayer(loaded.config, other.kv_cache, other.kernels.ops), ())
            tables = [[2 * i + 1, 2 * i + 2] for i in range(rows)]
            for runner in (worker.runner, looped):
                for i, ids in enumerate(prompts):
                    runner.compute_logits([ScheduledRequest(str(i), ids, 0, tables[i], GREEDY, sample_ids=[str(i)],
                                                            sample_seeds=[None])])
            for step in range(2):
                reqs = [ScheduledRequest(str(i), [100 + 7 * i + step], len(ids) + step, tables[i], GREEDY,
                                         sample_ids=[str(i)], sample_seeds=[None]) for i, ids in enumerate(prompts)]
                _, ours = worker.runner.compute_logits(reqs)
                _, ref = looped.compute_logits(reqs)
                assert ours.shape == (rows, 49152)
                assert torch.equal(ours, ref), f"tiles {tiles}, step {step}: max diff {(ours - ref).abs().max()}"
            logits[tiles] = ours
    if ops.amx_supported():  # the two settings really took two paths (bf16 rows against int8 ones)
        assert not torch.equal(logits[True], logits[False])
