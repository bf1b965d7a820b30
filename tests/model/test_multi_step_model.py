"""Multi-step decoding on the embedded SmolLM2 model: the same tokens, logprobs, texts and finish
reasons as one pass a step, with the float weights and with the shipped Q4_1 weights on the
kernels; greedy steps' passes in one kernel call (one pass a step too) against the model and the
sampler; and the later passes' inputs, moved one slot on in place, equal a fresh build's."""

from __future__ import annotations

import pytest
import torch

from kvmosaic import LLM, SamplingParams
from kvmosaic.config import CacheConfig, EngineConfig
from kvmosaic.model.loader import load_model
from kvmosaic.outputs import ScheduledRequest
from kvmosaic.worker.decode_rows import DecodeRows
from kvmosaic.worker.model_runner import fed_back
from kvmosaic.worker.worker import Worker

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List of fruits: apple, banana,",
]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=17, repetition_penalty=1.2, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=30, stop=[" the"], logprobs=0),
    SamplingParams(temperature=0.0, max_tokens=9, min_tokens=5, presence_penalty=0.5),
]


def _summary(outs) -> list[tuple]:
    return [(c.token_ids, c.text, c.finish_reason, c.logprobs) for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def float_engines(cached_loader) -> dict[int, LLM]:
    return {steps: LLM(model_loader=cached_loader, dtype="float32", kv_cache_memory="64MiB",
                       num_scheduler_steps=steps) for steps in (1, 5)}


def test_float_outputs_equal_one_pass_a_step(float_engines):
    expected = _summary(float_engines[1].generate(PROMPTS, PARAMS))
    got = _summary(float_engines[5].generate(PROMPTS, PARAMS))
    assert got == expected
    assert any(reason == "stop" for _, _, reason, _ in expected)  # a stop string ended one mid-run


def test_chat_replies_that_end_at_eos_are_unchanged(float_engines):
    """Greedy chat replies end at EOS at different passes of a step; later passes drop them."""
    messages = [[{"role": "user", "content": q}] for q in ("Say hi.", "What is 2+2?", "Name a color.")]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    outs = {steps: [float_engines[steps].chat(m, params)[0].outputs[0] for m in messages] for steps in (1, 5)}
    assert [(c.token_ids, c.finish_reason) for c in outs[5]] == [(c.token_ids, c.finish_reason) for c in outs[1]]
    assert any(c.finish_reason == "stop" for c in outs[1])


@pytest.fixture(scope="module")
def native_model():
    """The default model as shipped: Q4_1 layers, a Q8_0 token table tied to the head."""
    return load_model(None, torch.float32)


def test_native_q4_1_weights_on_the_kernels_give_the_same_tokens():
    """The default engine (the shipped Q4_1 weights, the layer-stack kernel): greedy and seeded rows."""
    params = [SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=5, max_tokens=14, ignore_eos=True, logprobs=1)]
    outs = {}
    for steps in (1, 6):
        llm = LLM(kv_cache_memory="64MiB", num_scheduler_steps=steps)
        outs[steps] = _summary(llm.generate(PROMPTS[:2], params))
    assert outs[6] == outs[1]


def _count_forwards(runner) -> list[tuple[bool, bool, int]]:
    """Per step the runner executes from now on: (every row decoding one token, every row
    multi-step, forwards through the model and the sampler in the step)."""
    steps: list[tuple[bool, bool, int]] = []
    forward, execute = runner._forward, runner.execute

    def counted_forward(*args, **kwargs):
        steps[-1] = (*steps[-1][:2], steps[-1][2] + 1)
        return forward(*args, **kwargs)

    def recorded_execute(sched):
        rows = sched.scheduled
        steps.append((bool(rows) and all(s.num_tokens == 1 for s in rows),
                      bool(rows) and all(s.num_steps > 1 for s in rows), 0))
        return execute(sched)

    runner._forward, runner.execute = counted_forward, recorded_execute
    return steps


def _tokens(outs) -> list[tuple]:
    return [(c.token_ids, c.finish_reason) for o in outs for c in o.outputs]


def test_greedy_steps_run_every_pass_in_one_kernel_call():
    """A step whose rows are all greedy runs its first pass in the kernel call too (no forward
    through the sampler): the same tokens and finish reasons as one pass a step through the model
    and the sampler (logprobs asked for), a stop token mid-step included."""
    params = [SamplingParams(temperature=0.0, max_tokens=26, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=26)]
    sampled = [SamplingParams(temperature=0.0, max_tokens=26, ignore_eos=True, logprobs=0),
               SamplingParams(temperature=0.0, max_tokens=26, logprobs=0)]
    engines = {steps: LLM(kv_cache_memory="64MiB", num_scheduler_steps=steps) for steps in (1, 6)}
    prompts = [engines[1].encode_chat([{"role": "user", "content": q}]) for q in ("Name a color.", "Say hi.")]
    expected = engines[1].generate(prompts, sampled)
    steps = _count_forwards(engines[6].engine.executor.worker.runner)
    got = engines[6].generate(prompts, params)
    assert _tokens(got) == _tokens(expected)
    assert any(c.finish_reason == "stop" for o in expected for c in o.outputs)
    multi = [forwards for _, every_row, forwards in steps if every_row]
    assert multi and not any(multi)
    assert steps[0][2] == 1  # the prompts' step


def test_one_pass_steps_of_greedy_rows_run_in_the_kernel_call():
    """With one pass a step, a step of greedy decode rows runs through ops.decode_passes (lookup,
    layers, head and argmax in one call; no forward through the model and the sampler), while rows
    that need the sampler (logprobs asked for) take the forward: the same tokens either way."""
    llm = LLM(kv_cache_memory="64MiB")
    steps = _count_forwards(llm.engine.executor.worker.runner)
    got = llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True))
    decode_forwards = [forwards for decoding, _, forwards in steps if decoding]
    assert len(decode_forwards) == 18 and not any(decode_forwards)
    steps.clear()
    expected = llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True, logprobs=0))
    assert [forwards for decoding, _, forwards in steps if decoding] == [1] * 18
    assert _tokens(got) == _tokens(expected)


def test_rows_moved_one_slot_on_equal_a_fresh_build(float_engines):
    """DecodeRows.advance against the runner's own inputs for the fed-back batch, pass after pass,
    across a block boundary (block size 16)."""
    engine = float_engines[5].engine
    runner = engine.executor.worker.runner
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for prompt in ("a b c d e f g h i j k l m", "one two"):
        engine.add_request(None, prompt, params)
    engine.step()
    batch = engine.scheduler.schedule().scheduled  # the tables now hold the slots of 5 passes
    assert [s.num_steps for s in batch] == [5, 5] and batch[0].start_pos < 16 < batch[0].start_pos + 5
    rows = DecodeRows(batch, runner.block_size)
    for token in range(7, 12):
        ids, positions, meta, _ = runner._prepare(batch)
        assert rows.input_ids.tolist() == ids.tolist() and rows.position_ids.tolist() == positions.tolist()
        assert rows.meta.slot_mapping.tolist() == meta.slot_mapping.tolist()
        assert rows.meta.decode_context_lens.tolist() == meta.decode_context_lens.tolist()
        width = meta.decode_block_tables.shape[1]
        assert rows.meta.decode_block_tables[:, :width].tolist() == meta.decode_block_tables.tolist()
        if token < 11:
            batch = [fed_back(s, token) for s in batch]
            rows.advance([token] * len(batch))
    for request_id in list(engine.scheduler.requests):
        engine.abort(request_id)


# ---- the kernel's passes, at every ISA level built here --------------------------------------------

def _worker(level_kernels, loaded, dtype: str) -> Worker:
    config = EngineConfig(dtype=dtype, cache=CacheConfig(block_size=16, num_blocks=8))
    return Worker.start(config, loader=lambda path, d: loaded, kernels=level_kernels)


def _greedy_step(worker: Worker, new: list[int], start: int) -> int:
    req = ScheduledRequest("r", new, start, list(range(8)), SamplingParams(temperature=0.0), sample_ids=["r"],
                           sample_seeds=[None])
    return int(worker.runner.compute_logits([req])[1][0].argmax())


@pytest.fixture(scope="module")
def bf16_native_model():
    return load_model(None, torch.bfloat16)


@pytest.mark.parametrize("weights", ["q4_1", "q4_1-bf16", "float32"])
def test_kernel_passes_equal_step_by_step_greedy_decode(level_kernels, weights, default_model, request):
    """ops.decode_passes (layer stack, head, argmax, embedding lookup, next slot, all in C++) gives
    the tokens of one forward a token, for the shipped Q4_1 weights (embedding read through the
    tied Q8_0 head, float32 and bfloat16 activations) and the float32 model (float table); it stops
    after the first pass that samples a stop token, and refuses positions past the block tables."""
    loaded = {"q4_1": lambda: request.getfixturevalue("native_model"),
              "q4_1-bf16": lambda: request.getfixturevalue("bf16_native_model"),
              "float32": lambda: default_model}[weights]()
    worker = _worker(level_kernels, loaded, "bfloat16" if weights.endswith("bf16") else "float32")
    model, attention = worker.model, worker.runner.attention
    prompt = worker.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    first = _greedy_step(worker, prompt, 0)
    expected = [first]
    for _ in range(6):  # crosses from block 0 into block 1
        expected.append(_greedy_step(worker, expected[-1:], len(prompt) + len(expected) - 1))
    tables = torch.arange(8)[None]

    def passes(count: int, stops: list[int]) -> list[int]:
        tokens = model.decode_passes(torch.tensor([first]), torch.tensor([len(prompt)]), attention, tables, count,
                                     stops)
        assert tokens is not None and tokens.shape[1] == 1
        return tokens[:, 0].tolist()

    assert passes(6, []) == expected[1:]
    stop = expected[3]
    assert passes(6, [stop, -5]) == expected[1:expected.index(stop, 1) + 1]
    with pytest.raises(RuntimeError, match="past row 0's blocks"):
        model.decode_passes(torch.tensor([first]), torch.tensor([8 * 16]), attention, tables, 2, [])
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    with pytest.raises(RuntimeError, match=f"token id {vocab} of row 0 is outside the vocab of {vocab}"):
        model.decode_passes(torch.tensor([vocab]), torch.tensor([len(prompt)]), attention, tables, 1, [])
    wide = [torch.zeros(vocab, hidden + 16, dtype=model.embed_tokens.dtype)]
    with pytest.raises(RuntimeError, match=f"embedding's rows are {hidden + 16} wide, not the hidden size {hidden}"):
        attention.decode_passes()(torch.tensor([first]), model.embed_tokens.dtype, model._packed_weights, model.rotary,
                                  torch.tensor([len(prompt)]), tables, wide, [], 1, model.config.rms_norm_eps)
