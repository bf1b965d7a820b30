"""Multi-step decoding, the scheduler's side: a step whose every sequence is decoding one token
(no prefill chunk, swap, load or preemption in it) lets each run several forward passes in a row,
feeding its sampled token back each time, with cache slots reserved for all of them up front.

The scheduling and output work between tokens then happens once per step instead of once per
token. What the sequence gains is handled as accepted proposals are: every token but the last has
its K/V computed, and the tokens after one that ends the sequence are dropped. Sequences whose
next token needs the scheduler (a grammar's mask, a beam search, forks) run one pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmosaic.core.guide import UNGUIDED
from kvmosaic.core.sequence_rules import max_speculative_tokens
from kvmosaic.core.step_plan import StepPlan
from kvmosaic.request import Request

if TYPE_CHECKING:
    from kvmosaic.core.kv_cache_manager import KVCacheManager


def runs_alone(request: Request, num_tokens: int) -> bool:
    """Whether the sequence decodes one token this step with nothing the scheduler must decide
    between its tokens."""
    return (num_tokens == 1 and request.num_computed_tokens == request.num_tokens - 1 and not request.num_forks
            and not request.sampling_params.use_beam_search and request.guide is UNGUIDED)


class MultiStep:
    def __init__(self, num_steps: int, kv_manager: KVCacheManager, max_model_len: int) -> None:
        self.num_steps = num_steps
        self.kv_manager = kv_manager
        self.max_model_len = max_model_len

    def extend(self, plan: StepPlan) -> None:
        """Give the step's sequences more passes (``plan.steps``) if it is decode-only: each as many
        as its max_tokens and the context allow, the budget holds and free blocks fit (extra passes
        never preempt; a sequence that gets no room runs one)."""
        if (self.num_steps == 1 or not plan.scheduled or plan.preempted or plan.swap_in or plan.swap_out
                or plan.kv_loads or not all(runs_alone(r, n) for r, n in plan.scheduled)):
            return
        share = plan.budget // len(plan.scheduled)
        for request, _ in plan.scheduled:
            steps = min(self.num_steps, 1 + share, 1 + max_speculative_tokens(request, self.max_model_len))
            if steps > 1 and self.kv_manager.allocate_slots(request, steps) is not None:
                plan.steps[request.request_id] = steps
                plan.budget -= steps - 1
