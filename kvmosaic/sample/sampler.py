"""One sampling step for a batch: penalties -> bans -> greedy or (temperature, top-k/p, min-p, draw).

Everything is vectorized over rows except the draws of seeded rows, which use each row's own
generator so a seeded request samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvmosaic.outputs import SampledToken
from kvmosaic.sample.penalties import apply_penalties, pad_token_ids
from kvmosaic.sample.topk_topp import mask_top_k_top_p_min_p_
from kvmosaic.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to pick one token for one sequence (one logits row)."""

    params: SamplingParams
    generator: torch.Generator | None  # set for seeded sequences; advanced by every draw
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: tuple[int, ...] = ()  # masked to -inf, e.g. EOS/stop ids until min_tokens
    allowed_token_mask: bytes | None = None  # a grammar's packed bitmask of allowed ids (None: all)


Argmax = Callable[[torch.Tensor], torch.Tensor]  # [rows, n] -> each row's first largest index


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, rows: list[SamplingRow], argmax: Argmax = torch_argmax) -> list[SampledToken]:
    """Pick one token per row of logits [num_rows, vocab]; logprobs are of the raw logits. ``argmax``
    picks greedy rows' tokens: ``logits.argmax(dim=-1)`` or a kernel that gives the same ids."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} sampling rows")
    logits = logits.float()
    processed = penalize_and_ban(logits, rows)
    token_ids = _choose_tokens(processed, rows, argmax)
    return sampled_tokens(logits, token_ids, rows)


def argmax_only(params: SamplingParams, num_outputs: int) -> bool:
    """Whether the row's token is the argmax of its raw logits with nothing else to report: greedy,
    no penalty, bias or ban (min_tokens reached after ``num_outputs``), no logprobs (no grammar)."""
    return (params.greedy and not _has_penalty(params) and not params.logit_bias and not params.tracks_logprobs
            and not params.num_top_logprobs and num_outputs >= params.min_tokens)


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the vocab, in float32."""
    return torch.log_softmax(logits.float(), dim=-1)


def random_sample(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token id per row of probs [num_rows, vocab] (rows need not be normalized).

    Seeded rows run an exponential race with their own generator (argmax of p / q, q ~ Exp(1)):
    the draw depends only on that row. Unseeded rows share one uniform per row and invert the
    CDF, since drawing vocab-many randoms is the dominant cost of sampling on CPU.
    """
    token_ids = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        token_ids[unseeded] = _inverse_cdf_sample(_take_rows(probs, unseeded))
    for i, generator in enumerate(generators):
        if generator is not None:
            token_ids[i] = _exponential_race(probs[i], generator)
    return token_ids


def _inverse_cdf_sample(probs: torch.Tensor) -> torch.Tensor:
    cdf = probs.cumsum(dim=-1)
    # u in (0, total]: never lands before the first token with non-zero probability.
    u = (1.0 - torch.rand(probs.shape[0], 1, device=probs.device)) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).flatten().clamp_max_(probs.shape[-1] - 1)


def _exponential_race(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    u = torch.rand(probs.shape, generator=generator, device=probs.device)
    # -log(u) ~ Exp(1), several times cheaper than exponential_(); the floor keeps q finite.
    q = u.clamp_min_(torch.finfo(u.dtype).tiny).log_().neg_()
    return (probs / q).argmax()


def penalize_and_ban(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Penalties, logit bias, banned ids to -inf, then ids a grammar disallows to -inf, on a copy
    made only when some row needs any of them."""
    penalized = [_has_penalty(r.params) for r in rows]
    biased = any(r.params.logit_bias for r in rows)
    banned = any(r.banned_token_ids for r in rows)
    guided = [i for i, r in enumerate(rows) if r.allowed_token_mask is not None]
    if not (any(penalized) or biased or banned or guided):
        return logits
    logits = logits.clone()
    if any(penalized):
        _penalize_(logits, rows, penalized)
    if biased:
        add_logit_bias_(logits, [r.params.logit_bias for r in rows])
    if banned:
        _ban_(logits, rows)
    if guided:
        allowed = unpack_token_masks([rows[i].allowed_token_mask for i in guided], logits.shape[-1])
        logits[guided] = logits[guided].masked_fill_(~allowed, float("-inf"))
    return logits


def add_logit_bias_(logits: torch.Tensor, biases: list[dict[int, float] | None]) -> None:
    """Add each row's {token id: bias} to its logits (ids beyond the vocabulary are ignored)."""
    vocab = logits.shape[-1]
    rows_of: dict[int, tuple[dict[int, float], list[int]]] = {}
    for row, bias in enumerate(biases):
        if bias:  # the n samples of a request share one dict: its entries are read once, not once per row
            rows_of.setdefault(id(bias), (bias, []))[1].append(row)
    for bias, rows in rows_of.values():
        entries = [(t, b) for t, b in bias.items() if t < vocab]
        if entries:
            ids, values = zip(*entries)
            row_ids = torch.tensor(rows).repeat_interleave(len(ids))
            logits.index_put_((row_ids, torch.tensor(ids).repeat(len(rows))),
                              torch.tensor(values, dtype=logits.dtype).repeat(len(rows)), accumulate=True)


def unpack_token_masks(masks: list[bytes], vocab_size: int) -> torch.Tensor:
    """Packed bitmasks (bit t of little-endian 32-bit words allows token t) -> bool [rows, vocab_size];
    ids past a mask's end are disallowed."""
    bits = np.unpackbits(np.frombuffer(b"".join(masks), dtype=np.uint8), bitorder="little")
    bits = torch.from_numpy(bits.reshape(len(masks), -1)).bool()
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    return torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]), value=False)


def _has_penalty(params: SamplingParams) -> bool:
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0


def _penalize_(logits: torch.Tensor, rows: list[SamplingRow], penalized: list[bool]) -> None:
    # Rows without a penalty get empty lists, so long prompts cost nothing where unused.
    prompts = [r.prompt_token_ids if p and r.params.repetition_penalty != 1.0 else [] for r, p in zip(rows, penalized)]
    outputs = [r.output_token_ids if p else [] for r, p in zip(rows, penalized)]
    apply_penalties(
        logits,
        pad_token_ids(prompts, logits.device),
        pad_token_ids(outputs, logits.device),
        _param_tensor(rows, "presence_penalty", logits.device),
        _param_tensor(rows, "frequency_penalty", logits.device),
        _param_tensor(rows, "repetition_penalty", logits.device),
        inplace=True,
    )


def _ban_(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    row_index = [i for i, r in enumerate(rows) for _ in r.banned_token_ids]
    token_index = [t for r in rows for t in r.banned_token_ids]
    index = (torch.tensor(row_index, device=logits.device), torch.tensor(token_index, device=logits.device))
    logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))


def _choose_tokens(logits: torch.Tensor, rows: list[SamplingRow],
                   argmax: Argmax) -> torch.Tensor:
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if len(greedy) == len(rows):  # the common all-greedy batch: no scatter into a result tensor
        return argmax(logits)
    token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    if greedy:
        token_ids[greedy] = argmax(_take_rows(logits, greedy))
    random = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random:
        token_ids[random] = _sample_random(_take_rows(logits, random), [rows[i] for i in random])
    return token_ids


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    return random_sample(target_probs(logits, rows), [r.generator for r in rows])


def target_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution a non-greedy row samples from: temperature, then top-k, top-p and min-p.

    A seeded row's is computed from its logits alone: together, the rows' filters share widths (top-k's
    padding to the batch's largest k) and paths (top-p over the kept values or the whole vocab), which
    move a row's probabilities by float rounding, so its seeded draws would depend on its batch."""
    seeded = [i for i, r in enumerate(rows) if r.generator is not None]
    if not seeded or len(rows) == 1:
        return _batch_probs(logits, rows)
    probs = torch.empty_like(logits)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if unseeded:
        probs[unseeded] = _batch_probs(logits[unseeded], [rows[i] for i in unseeded])
    for i in seeded:
        probs[i] = _batch_probs(logits[i:i + 1], [rows[i]])[0]
    return probs


def _batch_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    device = logits.device
    logits = logits / _param_tensor(rows, "temperature", device)[:, None]  # a copy the masks may overwrite
    top_k = torch.tensor([r.params.top_k for r in rows], dtype=torch.long, device=device)
    top_p = _param_tensor(rows, "top_p", device)
    mask_top_k_top_p_min_p_(logits, top_k, top_p, _param_tensor(rows, "min_p", device))
    return logits.softmax(dim=-1)


def sampled_tokens(raw_logits: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
    # chosen tokens' logprobs only for rows that track them (a full-vocab pass per row otherwise)
    chosen: list[float | None] = [None] * len(rows)
    wanted = [i for i, r in enumerate(rows) if r.params.tracks_logprobs]
    if wanted:
        # the same log-softmax as top and prompt logprobs: a token's logprob is one number wherever it is reported
        logprobs = compute_logprobs(_take_rows(raw_logits, wanted))
        values = logprobs.gather(1, token_ids[wanted][:, None]).flatten()
        for i, value in zip(wanted, values.tolist(), strict=True):
            chosen[i] = value
    tops = _top_logprobs(raw_logits, rows)
    return [SampledToken(t, lp, top) for t, lp, top in zip(token_ids.tolist(), chosen, tops)]


def _top_logprobs(raw_logits: torch.Tensor, rows: list[SamplingRow]) -> list[dict[int, float] | None]:
    """The params.logprobs most likely raw tokens per row; {} for logprobs=0, None when not asked."""
    tops: list[dict[int, float] | None] = [None if not r.params.num_top_logprobs and r.params.logprobs is None
                                           else {} for r in rows]
    wanted = [i for i, r in enumerate(rows) if r.params.num_top_logprobs]
    if not wanted:
        return tops
    num_top = max(rows[i].params.num_top_logprobs for i in wanted)
    values, ids = compute_logprobs(_take_rows(raw_logits, wanted)).topk(num_top, dim=-1)
    for i, row_ids, row_values in zip(wanted, ids.tolist(), values.tolist()):
        n = rows[i].params.num_top_logprobs
        tops[i] = dict(zip(row_ids[:n], row_values[:n]))
    return tops


def _param_tensor(rows: list[SamplingRow], name: str, device: torch.device) -> torch.Tensor:
    return torch.tensor([getattr(r.params, name) for r in rows], dtype=torch.float32, device=device)


def _take_rows(tensor: torch.Tensor, index: list[int]) -> torch.Tensor:
    # Skip the gather copy when every row is selected, the common all-greedy or all-random batch.
    return tensor if len(index) == tensor.shape[0] else tensor[index]
