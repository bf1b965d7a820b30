"""The worker's side of model-based speculation: a draft model that runs after every step.

Where it runs: in the model runner, after the target's step is sampled and verified (the scheduler
never calls a model). It returns, with the ModelOutput, up to ``num_draft_tokens`` proposals for
each sequence the scheduler asked about (``DraftedProposer`` hands them over at the next step), and
how many draft passes that took and how long, so adaptive k can weigh a proposal's draft cost.

Drafting: the draft runs the target's new token and then its own guesses, one pass each, the
sequences that draft batched together. Greedy sequences take the draft's argmax; sampled ones draw
from the draft's distribution q under the request's temperature / top-k / top-p / min-p, and q is
returned so the target's verification applies min(1, p/q). Seeded sampled sequences take the
argmax too, without q: they are verified by the target's own seeded draw (the one-hot rule), so
they draw once per emitted token as plain decoding does and reproduce whatever their batch.

The draft's K/V of the sequence so far comes one of two ways:

- ``CacheSharingDrafter`` (``self``: the target's own architecture, its weights requantized): the
  draft attends over the target's K/V. The draft's passes only write positions the target has not
  computed (its new token and the guesses), which the target rewrites before it ever reads them:
  a verification computes every position it reads past the sequence's computed tokens. Nothing is
  mirrored, no pool is added, and the draft's context is the target's exact one.
- ``MirroringDrafter`` (``draft``: another model): the draft keeps its own pools over the target's
  block ids (``KVCache.draft``) and mirrors the tokens the target computed and kept (see there).

Guesses past a sequence's blocks go to scratch blocks (ids past the block pool's). With a prompt
lookup (``lookup_first``), a sequence whose last tokens occurred earlier takes what followed them
there and is not drafted: copying text is where the lookup beats any draft, and it costs nothing.
"""

from __future__ import annotations

import itertools
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Container, Iterator
from dataclasses import dataclass, field

import torch

from kvmosaic.core.speculation.ngram import lookup
from kvmosaic.core.speculation.proposer import Proposal
from kvmosaic.outputs import ModelOutput, ScheduledRequest
from kvmosaic.sample.sampler import Argmax, SamplingRow, random_sample, target_probs, torch_argmax


@dataclass(slots=True)
class DraftWork:
    """What one step's drafting proposed, and what it cost."""

    proposals: dict[str, Proposal] = field(default_factory=dict)
    passes: int = 0  # forward passes that drafted (0: only mirrored, or nothing)
    seconds: float = 0.0  # all the draft model's time this step, mirroring included


@dataclass(slots=True)
class _Draft:
    request: ScheduledRequest  # the sequence's current draft pass
    k: int
    greedy: bool  # propose the argmax (one-hot); else draw from q, unseeded
    token_ids: list[int]
    probs: list[torch.Tensor]


class Drafter(ABC):
    def __init__(self, runner, num_blocks: int, num_scratch_blocks: int, max_positions: int,
                 lookup_sizes: tuple[int, int] | None = None, argmax: Argmax = torch_argmax) -> None:
        """``runner``: a ModelRunner over the draft model and the attention its K/V lives in; block
        ids ``num_blocks`` .. ``num_blocks + num_scratch_blocks - 1`` are scratch. ``lookup_sizes``:
        (min, max) n-gram sizes of a prompt lookup tried before drafting (None: none). ``argmax``:
        greedy sequences' pick (``Kernels.argmax``: torch's ids, faster)."""
        self.runner = runner
        self.argmax = argmax
        self.lookup_sizes = lookup_sizes
        self.block_size = runner.block_size
        self.num_blocks = num_blocks
        self.num_scratch_blocks = num_scratch_blocks
        self.max_positions = max_positions

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledRequest], out: ModelOutput) -> DraftWork:
        """Draft for the sequences the step asked about (after what the subclass runs first)."""
        started = time.perf_counter()
        looked_up = self._look_up(scheduled, out)
        drafts: dict[str, _Draft] = {}
        pending = self._first_pass(scheduled, out, drafts, itertools.count(self.num_blocks), looked_up)
        passes = 0
        while pending:
            requests, logits = self.runner.compute_logits(pending)
            passes += bool(drafts)
            pending = []
            for row, s in enumerate(requests):
                draft = drafts[s.request_id]
                self._choose(draft, logits[row:row + 1])
                if len(draft.token_ids) < draft.k:
                    r = draft.request
                    draft.request = ScheduledRequest(r.request_id, [draft.token_ids[-1]], r.start_pos + r.num_tokens,
                                                     r.block_table, r.sampling_params, sample_ids=[r.request_id])
                    pending.append(draft.request)
        proposals = {seq_id: Proposal(d.token_ids, torch.cat(d.probs) if d.probs else None)
                     for seq_id, d in drafts.items()}
        return DraftWork({**looked_up, **proposals}, passes, time.perf_counter() - started)

    @abstractmethod
    def _first_pass(self, scheduled: list[ScheduledRequest], out: ModelOutput, drafts: dict[str, _Draft],
                    scratch: Iterator[int], looked_up: Container[str]) -> list[ScheduledRequest]:
        """The rows of the first pass; fills ``drafts`` with the sequences that draft (their first
        row samples); those in ``looked_up`` do not."""

    def _look_up(self, scheduled: list[ScheduledRequest], out: ModelOutput) -> dict[str, Proposal]:
        """Prompt-lookup proposals of the sequences asked for some, over their tokens after this step."""
        if self.lookup_sizes is None:
            return {}
        found = {}
        for s in scheduled:
            sampled = _sampled(s, out)
            if sampled is None or s.num_lookup_tokens < 1:
                continue
            accepted = [t.token_id for t in out.accepted.get(s.request_id, ())]
            tokens = [*s.prompt_token_ids, *s.output_token_ids, *accepted, sampled.token_id]
            k = min(s.num_lookup_tokens, self.max_positions - len(tokens))
            guess = lookup(tokens, k, *self.lookup_sizes) if k > 0 else []
            if guess:
                found[s.request_id] = Proposal(guess, looked_up=True)
        return found

    def _draft(self, s: ScheduledRequest, tokens: list[int], start: int, k: int, scratch: Iterator[int]) -> _Draft:
        """A sequence's first draft row: ``tokens`` from ``start``, the target's new token last."""
        table = self._with_scratch(s.block_table, start + len(tokens) + k - 1, scratch)
        first = ScheduledRequest(s.request_id, tokens, start, table, s.sampling_params, sample_ids=[s.request_id])
        greedy = s.sampling_params.greedy or s.sample_seeds[0] is not None
        return _Draft(first, k, greedy, [], [])

    def _draft_length(self, s: ScheduledRequest, context: int) -> int:
        """Guesses the sequence asked for that fit the model's positions (context: with the new token)."""
        return min(s.num_draft_tokens, self.max_positions - context)

    def _choose(self, draft: _Draft, logits: torch.Tensor) -> None:
        if draft.greedy:
            draft.token_ids.append(int(self.argmax(logits)[0]))
            return
        q = target_probs(logits.float(), [SamplingRow(draft.request.sampling_params, None, [], [])])
        draft.token_ids.append(int(random_sample(q, [None])[0]))
        draft.probs.append(q)

    def _with_scratch(self, table: list[int], num_positions: int, scratch: Iterator[int]) -> list[int]:
        """The block table extended with scratch blocks to cover ``num_positions`` positions."""
        missing = math.ceil(num_positions / self.block_size) - len(table)
        if missing <= 0:
            return table
        extra = [next(scratch) for _ in range(missing)]
        if extra[-1] >= self.num_blocks + self.num_scratch_blocks:
            raise RuntimeError("the draft ran out of scratch blocks")
        return table + extra


class CacheSharingDrafter(Drafter):
    """A draft of the target's own shape attending over the target's K/V: only drafting runs."""

    def _first_pass(self, scheduled, out, drafts, scratch, looked_up):
        rows = []
        for s in scheduled:
            sampled = _sampled(s, out)
            if sampled is None or s.num_draft_tokens < 1 or s.request_id in looked_up:
                continue
            position = s.start_pos + s.num_tokens - len(s.spec_token_ids) + len(out.accepted.get(s.request_id, ()))
            k = self._draft_length(s, position + 1)
            if k < 1:
                continue
            drafts[s.request_id] = self._draft(s, [sampled.token_id], position, k, scratch)
            rows.append(drafts[s.request_id].request)
        return rows


class MirroringDrafter(Drafter):
    """A draft with its own K/V pools over the target's block ids: every step it mirrors the tokens
    the target computed and kept this step (prefill chunks, a decode's token, accepted proposals)
    at the same positions, in the same slots. So wherever the target's K/V is valid the draft's is
    too: prefix-cache hits, swaps and copy-on-write (they move both pools), recompute after
    preemption (both run again), and rejected proposals (their slots are overwritten when the target
    computes those positions again).

    Decode tokens of a sequence that drafts nothing this step are only noted and mirrored the next
    time it drafts (one multi-token row), so a draft costs nothing while adaptive k is 0 (large
    batches, unpredictable text). Prefill chunks are always mirrored, so prompt blocks, the ones
    prefix hits reuse, carry the draft's K/V. A block of decoded tokens a sequence never drafted over
    holds stale draft K/V; a prefix hit on it costs acceptance, never correctness."""

    def __init__(self, runner, num_blocks: int, num_scratch_blocks: int, max_positions: int,
                 lookup_sizes: tuple[int, int] | None = None, argmax: Argmax = torch_argmax) -> None:
        super().__init__(runner, num_blocks, num_scratch_blocks, max_positions, lookup_sizes, argmax)
        # Decoded tokens not yet mirrored, per sequence: (position of the first, the tokens).
        self._unmirrored: dict[str, tuple[int, list[int]]] = {}

    def _first_pass(self, scheduled, out, drafts, scratch, looked_up):
        rows: list[ScheduledRequest] = []
        unmirrored: dict[str, tuple[int, list[int]]] = {}
        for s in scheduled:
            kept = s.token_ids[:s.num_tokens - len(s.spec_token_ids) + len(out.accepted.get(s.request_id, ()))]
            start, behind = self._unmirrored.get(s.request_id, (s.start_pos, []))
            if start + len(behind) != s.start_pos:  # recomputed or rolled back since: nothing to carry
                start, behind = s.start_pos, []
            tokens = [*behind, *kept]
            sampled = _sampled(s, out)
            k = 0 if s.request_id in looked_up else self._draft_length(s, start + len(tokens) + 1)
            if k < 1 or sampled is None:
                if s.num_tokens - len(s.spec_token_ids) == 1 and sampled is not None:  # a decode: later
                    unmirrored[s.request_id] = (start, tokens)
                else:
                    rows.append(ScheduledRequest(s.request_id, tokens, start, s.block_table, s.sampling_params))
                continue
            drafts[s.request_id] = self._draft(s, [*tokens, sampled.token_id], start, k, scratch)
            rows.append(drafts[s.request_id].request)
        self._unmirrored = unmirrored  # sequences not scheduled this step drop theirs (stale K/V later)
        return rows


def _sampled(s: ScheduledRequest, out: ModelOutput):
    """The target's new token of the sequence this step (None: a prefill chunk that samples nothing)."""
    return out.sampled.get(s.request_id) if s.sample_ids else None
