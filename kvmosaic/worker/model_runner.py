"""SchedulerOutput -> flat tensors -> model -> sampler -> ModelOutput."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvmosaic.attention.backend import AttentionBackend
from kvmosaic.attention.metadata import AttentionMetadata, PrefillSpan
from kvmosaic.core.sequence_rules import ends_on_token, stop_tokens
from kvmosaic.outputs import ModelOutput, SampledToken, ScheduledRequest, SchedulerOutput
from kvmosaic.sample.prompt_logprobs import first_rows, prompt_targets, score_prompt_rows
from kvmosaic.sample.sampler import Argmax, SamplingRow, argmax_only, sample, torch_argmax
from kvmosaic.sample.verify import Verification, verify
from kvmosaic.sampling_params import SamplingParams
from kvmosaic.worker.decode_rows import DecodeRows

if TYPE_CHECKING:
    from kvmosaic.worker.drafter import Drafter

# A sequence's tokens in a step of up to this many are computed as decode rows, each over the context up
# to itself: a speculative verification, a drafter's catch-up, the short tail of a prompt. They then run
# in the decode path (one team of threads for the whole step), whose per-row attention beat the span's
# gather-then-attend at 9 rows (21.2 vs 23.2 ms a step at 2,048 tokens of context, 7.0 vs 7.8 ms at 160)
# and lost at 16 rows with a long context (33.1 vs 30.8 ms at 2,048; default model, Q4_1 weights,
# float32 activations, AVX-512 host). Longer spans keep prefill attention.
DECODE_ROW_SPAN = 12


def fed_back(s: ScheduledRequest, *tokens: int) -> ScheduledRequest:
    """The decoding sequence's pass after it sampled ``tokens`` in turn (each fed back into the next
    pass): the last of them as its input, as many slots on."""
    return dataclasses.replace(s, token_ids=[tokens[-1]], start_pos=s.start_pos + len(tokens),
                               output_token_ids=[*s.output_token_ids, *tokens])


def greedy_decode_row(s: ScheduledRequest) -> bool:
    """Whether the step runs one token of the sequence and its next token is the argmax of the
    logits with nothing else to report (no proposals, forks, grammar mask or prompt logprobs)."""
    return (s.num_tokens == 1 and not s.spec_token_ids and s.sample_ids == [s.request_id]
            and not any(s.token_masks) and not prompt_targets(s)
            and argmax_only(s.sampling_params, len(s.output_token_ids)))


def _longs(values) -> torch.Tensor:
    """An int64 tensor of a list (of lists) of ints: through numpy, ~1.5 us against ~5-8 us for
    torch.tensor on a short list; a single-stream decode step builds six of them."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64))


class ModelRunner:
    def __init__(self, model: torch.nn.Module, attention: AttentionBackend, eos_token_ids: tuple[int, ...],
                 drafter: Drafter | None = None, argmax: Argmax = torch_argmax) -> None:
        """``drafter``: a draft model that follows every step and proposes for the next (speculation);
        ``argmax``: how greedy rows pick their token (``Kernels.argmax``: the same ids, faster)."""
        self.model = model
        self.argmax = argmax
        self.drafter = drafter
        self.attention = attention
        self.kv_cache = attention.kv_cache
        self.block_size = self.kv_cache.block_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.generators: dict[str, torch.Generator | None] = {}

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        for seq_id in sched.finished_request_ids:
            self.generators.pop(seq_id, None)
        self.kv_cache.swap_out(sched.blocks_to_swap_out)
        self.kv_cache.swap_in(sched.blocks_to_swap_in)
        self.kv_cache.copy(sched.blocks_to_copy)
        for load in sched.kv_loads:
            self.kv_cache.write_blocks(list(load.block_ids), load.data)
        if not sched.scheduled:
            return ModelOutput()
        out = ModelOutput()
        if all(map(greedy_decode_row, sched.scheduled)):
            self._decode_on(sched.scheduled, out, step=0)  # every pass, one or more, in one kernel call
        if not out.sampled:
            requests, logits, scored = self._forward(sched.scheduled)
            out = self._sample(logits, requests)
            out.prompt_logprobs = scored
            self._decode_on([s for s in sched.scheduled if s.num_steps > 1], out)
        if self.drafter is not None:
            work = self.drafter.propose(sched.scheduled, out)
            out.proposals, out.draft_passes, out.draft_seconds = work.proposals, work.passes, work.seconds
        return out

    def _decode_on(self, scheduled: list[ScheduledRequest], out: ModelOutput, step: int = 1) -> None:
        """The passes of multi-step decoding after the first ``step``: each sequence runs on the
        token it just sampled, in the next slot, until its passes are done or a token ends it; its
        earlier tokens move to ``out.accepted``, in order, and the newest stays in ``out.sampled``.
        Greedy rows run their passes in one kernel call where the model has one. With ``step=0``
        the passes start from the scheduled tokens, and only if the kernel can run them all (else
        ``out`` stays empty: the first pass goes through the model and the sampler).

        One kernel call for a step's passes, the first included (and for a one-pass step of greedy
        rows), saves the Python of a forward and the sampler, which costs ~4x what it costs in a loop
        of its own after a step streamed the weights through the caches (single-stream Q4_1 decode,
        AVX-512 host: ~270 against ~70 us)."""
        rows: DecodeRows | None = None
        local = not self.attention.spanning(scheduled)  # else the backend needs each pass's batch
        while True:
            if step:
                live = [(s, t) for s in scheduled if s.num_steps > step
                        and not self._ends(s, t := out.sampled[s.request_id].token_id)]
                if not live:
                    return
                scheduled = [fed_back(s, t) for s, t in live]
            passes = self._kernel_passes(scheduled, min(s.num_steps for s in scheduled) - step) if local else None
            if passes is None:
                if not step:
                    return
                rows = self._moved_rows(rows, scheduled, [t for _, t in live]) if local else None
                passes = [self._one_pass(scheduled, rows)]
            else:
                rows = None
            for sampled in passes:
                for seq_id, token in sampled.items():
                    if seq_id in out.sampled:
                        out.accepted.setdefault(seq_id, []).append(out.sampled[seq_id])
                    out.sampled[seq_id] = token
            if len(passes) > 1:  # each pass's inputs were the previous pass's tokens: the last pass's inputs
                scheduled = [fed_back(s, *(p[s.request_id].token_id for p in passes[:-1])) for s in scheduled]
            step += len(passes)

    def _moved_rows(self, rows: DecodeRows | None, scheduled: list[ScheduledRequest], tokens: list[int]) -> DecodeRows:
        if rows is not None and rows.num_rows == len(scheduled):  # the same rows (only ever dropped), one slot on
            rows.advance(tokens)
            return rows
        return DecodeRows(scheduled, self.block_size)

    def _one_pass(self, scheduled: list[ScheduledRequest], rows: DecodeRows | None) -> dict[str, SampledToken]:
        if rows is None:
            scheduled, logits, _ = self._forward(scheduled, score_prompts=False)
        else:
            logits = self.model(rows.input_ids, rows.position_ids, self.attention.bind(scheduled, rows.meta),
                                rows.meta, rows.logits_indices)
        return self._sample_pass(logits, scheduled)

    def _kernel_passes(self, scheduled: list[ScheduledRequest], count: int) -> list[dict[str, SampledToken]] | None:
        """Up to ``count`` passes of greedy rows in one kernel call (ending after a pass where any row
        sampled a token that may end it), or None when some row needs the sampler or the model
        cannot."""
        run = getattr(self.model, "decode_passes", None)
        if run is None or not all(argmax_only(s.sampling_params, len(s.output_token_ids)) for s in scheduled):
            return None
        # the kernel takes the rows' first tokens, positions and block tables only (not DecodeRows'
        # metadata for the Python passes: ~20 us a token of a multi-step step, cold, at 8 passes)
        width = max(len(s.block_table) for s in scheduled)
        tables = _longs([s.block_table + [0] * (width - len(s.block_table)) for s in scheduled])
        stops = set().union(*(stop_tokens(s.sampling_params, self.eos_token_ids) for s in scheduled))
        tokens = run(_longs([s.token_ids[0] for s in scheduled]), _longs([s.start_pos for s in scheduled]),
                     self.attention, tables, count, sorted(stops))
        if tokens is None:
            return None
        return [{s.request_id: SampledToken(t, None) for s, t in zip(scheduled, row, strict=True)}
                for row in tokens.tolist()]

    def _sample_pass(self, logits: torch.Tensor, scheduled: list[ScheduledRequest]) -> dict[str, SampledToken]:
        if all(argmax_only(s.sampling_params, len(s.output_token_ids)) for s in scheduled):
            tokens = self.argmax(logits).tolist()
            return {s.request_id: SampledToken(t, None) for s, t in zip(scheduled, tokens, strict=True)}
        return self._sample(logits, scheduled).sampled

    def _ends(self, s: ScheduledRequest, token: int) -> bool:
        return ends_on_token(s.sampling_params, token, len(s.output_token_ids) + 1, self.eos_token_ids)

    @torch.inference_mode()
    def compute_logits(self, scheduled: list[ScheduledRequest]) -> tuple[list[ScheduledRequest], torch.Tensor]:
        """Run one forward; logits rows follow the returned requests (those with sample ids),
        ``num_logits_rows`` each (the last token's, after one per proposal being verified)."""
        requests, logits, _ = self._forward(scheduled, score_prompts=False)
        return requests, logits

    def _forward(self, scheduled: list[ScheduledRequest], score_prompts: bool = True
                 ) -> tuple[list[ScheduledRequest], torch.Tensor, dict[str, tuple[int, list[dict[int, float]]]]]:
        """``compute_logits``, and the prompt logprobs of this step's prompt tokens for the sequences
        that asked (their logits rows come after the sampling rows)."""
        # Decode rows first (single tokens and short spans) so they form one batched block; longer
        # spans follow in order. Sequences whose KV
        # the backend reaches elsewhere go last: the local tables never see their rows.
        spanning = self.attention.spanning(scheduled)
        batch = sorted(scheduled, key=lambda s: (s.request_id in spanning, s.num_tokens > DECODE_ROW_SPAN))
        input_ids, positions, meta, last_rows = self._prepare(batch, spanning)
        sampled = [(i, s) for i, s in enumerate(batch) if s.sample_ids]
        logits_indices = _longs([row for i, s in sampled
                                 for row in range(last_rows[i] - s.num_logits_rows + 1, last_rows[i] + 1)])
        scoring = [(s, first_row, targets) for s, first_row in zip(batch, first_rows(last_rows, batch))
                   if score_prompts and (targets := prompt_targets(s))]
        score_rows = [first_row + p - s.start_pos for s, first_row, targets in scoring for p, _ in targets]
        if score_rows:
            logits_indices = torch.cat([logits_indices, _longs(score_rows)])
        attention = self.attention.bind(batch, meta)
        logits = self.model(input_ids, positions, attention, meta, logits_indices)
        num_sample_rows = logits.shape[0] - len(score_rows)
        scored = score_prompt_rows(logits[num_sample_rows:], [(s, targets) for s, _, targets in scoring])
        return [s for _, s in sampled], logits[:num_sample_rows], scored

    @torch.inference_mode()
    def chunk_logits(self, token_ids: list[int], start: int, block_table: list[int]) -> torch.Tensor:
        """Logits [n, vocab] of every position of one sequence's chunk at positions [start, start + n),
        its earlier tokens already cached (evaluation needs all rows, sampling only the last)."""
        bs = self.block_size
        context = start + len(token_ids)
        positions = range(start, context)
        meta = AttentionMetadata(
            slot_mapping=_longs([block_table[p // bs] * bs + p % bs for p in positions]),
            num_decode_tokens=0, decode_block_tables=None, decode_mask=None,
            prefills=[PrefillSpan(0, len(token_ids), context, _longs(block_table[: -(-context // bs)]))])
        return self.model(_longs(token_ids), _longs(positions), self.attention, meta)

    def _prepare(self, batch: list[ScheduledRequest], spanning: frozenset[str] = frozenset()):
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        bs = self.block_size
        for s in batch:
            start = len(ids)
            n = s.num_tokens
            ids.extend(s.token_ids)
            positions = range(s.start_pos, s.start_pos + n)
            pos.extend(positions)
            slots.extend(s.block_table[p // bs] * bs + p % bs for p in positions)
            last_rows.append(start + n - 1)
            context = s.start_pos + n
            needed = s.block_table[: (context + bs - 1) // bs]
            if s.request_id in spanning:
                continue
            if n <= DECODE_ROW_SPAN:
                decode_tables.extend([needed] * n)
                decode_lens.extend(range(s.start_pos + 1, context + 1))
            else:
                prefills.append(PrefillSpan(start, n, context, _longs(needed)))
        meta = AttentionMetadata(
            slot_mapping=_longs(slots),
            num_decode_tokens=len(decode_tables),
            decode_block_tables=None,
            decode_mask=None,
            prefills=prefills,
        )
        if decode_tables:  # the reference attention's mask is built from the lengths when it runs
            width = max(len(t) for t in decode_tables)
            meta.decode_block_tables = _longs([t + [0] * (width - len(t)) for t in decode_tables])
            meta.decode_context_lens = _longs(decode_lens)
        return _longs(ids), _longs(pos), meta, last_rows

    def _sample(self, logits: torch.Tensor, requests: list[ScheduledRequest]) -> ModelOutput:
        rows: list[SamplingRow] = []
        row_index: list[int] = []
        seq_ids: list[str] = []
        verifications: list[Verification] = []
        verify_index: list[int] = []
        offset = 0
        for s in requests:
            if s.spec_token_ids:
                verifications.append(self._verification(s))
                verify_index.extend(range(offset, offset + s.num_logits_rows))
            else:
                for seq_id, seed in zip(s.sample_ids, s.sample_seeds, strict=True):
                    rows.append(self._sampling_row(s, self._generator(seq_id, seed)))
                    row_index.append(offset)
                    seq_ids.append(seq_id)
            offset += s.num_logits_rows
        out = ModelOutput()
        if rows:
            # one row per request and no verification rows: the logits are already in row order
            identity = not verifications and len(row_index) == logits.shape[0]
            tokens = sample(logits if identity else logits[row_index], rows, self.argmax)
            out.sampled = dict(zip(seq_ids, tokens, strict=True))
        if verifications:
            spec_requests = [s for s in requests if s.spec_token_ids]
            for s, emitted in zip(spec_requests, verify(logits[verify_index], verifications, self.argmax), strict=True):
                out.accepted[s.request_id] = emitted[:-1]
                out.sampled[s.request_id] = emitted[-1]
        return out

    def _sampling_row(self, s: ScheduledRequest, generator: torch.Generator | None,
                      num_proposed: int = 0) -> SamplingRow:
        """The row that samples after the sequence's tokens and its first ``num_proposed`` proposals."""
        outputs = s.output_token_ids + s.spec_token_ids[:num_proposed] if num_proposed else s.output_token_ids
        return SamplingRow(params=s.sampling_params, generator=generator, prompt_token_ids=s.prompt_token_ids,
                           output_token_ids=outputs, banned_token_ids=self._banned(s.sampling_params, len(outputs)),
                           allowed_token_mask=s.token_masks[num_proposed] if s.token_masks else None)

    def _verification(self, s: ScheduledRequest) -> Verification:
        if len(s.sample_ids) != 1:
            raise ValueError(f"{s.request_id}: proposals are verified for one sequence, not {len(s.sample_ids)}")
        generator = self._generator(s.sample_ids[0], s.sample_seeds[0])
        rows = [self._sampling_row(s, generator, i) for i in range(len(s.spec_token_ids) + 1)]
        return Verification(rows, s.spec_token_ids, s.draft_probs)

    def _generator(self, seq_id: str, seed: int | None) -> torch.Generator | None:
        if seq_id not in self.generators:
            self.generators[seq_id] = None if seed is None else torch.Generator().manual_seed(seed)
        return self.generators[seq_id]

    def _banned(self, params: SamplingParams, num_outputs: int) -> tuple[int, ...]:
        if num_outputs >= params.min_tokens:
            return ()
        eos = () if params.ignore_eos else self.eos_token_ids
        return tuple(eos) + tuple(params.stop_token_ids)
