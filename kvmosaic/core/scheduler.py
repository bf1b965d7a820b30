"""Decides, each step, how many tokens every sequence runs (vLLM-v1 style, no prefill/decode phases).

A request needs ``num_tokens - num_computed_tokens`` tokens; the scheduler hands
them out within a token budget: running sequences first, then swapped ones coming
back, then waiting ones in arrival order. Prefills longer than the chunk limit or
the remaining budget run in chunks. When the KV cache is full the newest running
sequence is preempted (recompute or swap). Preemption policy lives only here.

Speculative decoding (a ``Speculator`` handed in) adds proposed tokens after a decoding
sequence's next token: they are more tokens to compute, inside the same budget, and get blocks
only if free ones are left (proposals never preempt). After the step the rejected ones are
rolled back: ``num_computed_tokens`` drops by their count and the KV manager frees the blocks
only they occupied. Block hashes cover ``all_token_ids``, which only ever holds accepted tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvmosaic.core.beam_search import BeamHypothesis
from kvmosaic.core.beam_steps import BeamSteps
from kvmosaic.core.kv_arrivals import KVArrivals
from kvmosaic.core.lifecycle import Lifecycle, SequenceQueues
from kvmosaic.core.multi_step import MultiStep
from kvmosaic.core.sequence_rules import scheduled_request
from kvmosaic.core.spec_steps import NoSpeculation, SpeculationSteps
from kvmosaic.core.step_plan import StepPlan
from kvmosaic.outputs import ModelOutput, SchedulerOutput
from kvmosaic.request import Request, RequestStatus

if TYPE_CHECKING:
    from collections import deque

    from kvmosaic.config import SchedulerConfig
    from kvmosaic.core.kv_cache_manager import KVCacheManager
    from kvmosaic.core.speculation.speculator import Speculator

class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv_manager: KVCacheManager, eos_token_ids: Iterable[int] = (),
        speculator: Speculator | None = None, arrivals: KVArrivals | None = None,
    ) -> None:
        """``speculator``: proposes tokens for decoding sequences to verify (None: no speculation);
        ``arrivals``: prompt K/V computed elsewhere, loaded instead of computed on admission."""
        self.config = config
        self.kv_manager = kv_manager
        self.arrivals = arrivals if arrivals is not None else KVArrivals(kv_manager.block_size)
        self.speculator = speculator
        self.spec = (SpeculationSteps(speculator, kv_manager, config.max_model_len) if speculator is not None
                     else NoSpeculation())
        self.eos_token_ids = frozenset(eos_token_ids)
        self.queues = SequenceQueues()
        self.lifecycle = Lifecycle(self.queues, kv_manager, self.arrivals, self.spec, self.eos_token_ids,
                                   config.max_model_len)
        self.beams = BeamSteps(self.eos_token_ids, fork=self.lifecycle.fork_beam, drop=self.lifecycle.drop_beam)
        self.multi_step = MultiStep(config.num_scheduler_steps, kv_manager, config.max_model_len)
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queries
    @property
    def requests(self) -> dict[str, Request]:
        return self.queues.requests

    @property
    def running(self) -> list[Request]:
        return self.queues.running

    @property
    def waiting(self) -> deque[Request]:
        return self.queues.waiting

    @property
    def swapped(self) -> deque[Request]:
        return self.queues.swapped

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def has_unfinished_requests(self) -> bool:
        return self.queues.has_unfinished()

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` fits the context and the whole KV pool (check at add time)."""
        num_slots = self.kv_manager.num_reachable_blocks * self.kv_manager.block_size
        return num_tokens <= min(self.config.max_model_len, num_slots)

    # ------------------------------------------------------------- entry points
    def add_request(self, request: Request) -> None:
        self.queues.add(request)

    def add_prefilled(self, request: Request) -> None:
        """Queue a sequence whose prompt ran elsewhere and whose first token was sampled there; it
        finishes at once when that token ends it (then ``request.is_finished`` after the call)."""
        self.add_request(request)
        self.lifecycle.stop_if_done(request, self.waiting)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish sequences from outside (abort, stop string): free their blocks and drop them from queues."""
        if not status.finished:
            raise ValueError(f"{status.name} is not a finished status")
        request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        groups = {*request_ids, *(r.group_id for i in request_ids if (r := self.requests.get(i)) is not None)}
        beams = self.beams.group_members(groups)  # a beam search ends with all its beams
        for request_id in dict.fromkeys([*request_ids, *beams]):
            request = self.requests.get(request_id)
            if request is not None:
                self.queues.remove(request)
                self.lifecycle.finish(request, status)
        for group_id in groups:
            self.beams.forget(group_id)

    def recompute(self, request_ids: Iterable[str]) -> None:
        """Drop the KV of live sequences and queue them to run again from the start (their blocks were lost)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self.queues.remove(request)
            request.num_preemptions += 1
            self.num_preemptions += 1
            self.kv_manager.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        plan = StepPlan(budget=self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        # A step that had to preempt has no room to spare for anyone else.
        if not plan.preempted:
            self._schedule_swapped(plan)
            # Swapped sequences come back before new ones may take their room.
            if not self.swapped:
                self._schedule_waiting(plan)
        self.multi_step.extend(plan)
        finished_ids = self.lifecycle.take_finished_ids()
        scheduled = [scheduled_request(request, n, plan.proposals.get(request.request_id),
                                       self.kv_manager.get_block_table(request.request_id),
                                       plan.steps.get(request.request_id, 1))
                     for request, n in plan.scheduled]
        self.spec.ask_for_drafts((r for r, _ in plan.scheduled), scheduled, len(self.running))
        return SchedulerOutput(
            scheduled=scheduled,
            blocks_to_swap_out=plan.swap_out,
            blocks_to_swap_in=plan.swap_in,
            blocks_to_copy=self.kv_manager.take_pending_copies(),
            kv_loads=plan.kv_loads,
            finished_request_ids=finished_ids,
            preempted_request_ids=plan.preempted,
        )

    def update_from_output(self, scheduler_output: SchedulerOutput, model_output: ModelOutput,
                           step_seconds: float = 0.0) -> list[Request]:
        """Advance the scheduled sequences by the step's results (``step_seconds``: how long the
        step ran, when timed: speculation fits its cost model to it).

        Returns the sequences that got a token (forked children right after their
        parent), then any the scheduler itself finished this step (never fitting the
        cache). Call it for every step, even an empty one.
        """
        updated: list[Request] = []
        beams: list[Request] = []
        self.spec.receive(model_output.proposals)
        self.spec.observe_step(scheduler_output.scheduled, step_seconds - model_output.draft_seconds)
        self.spec.observe_draft(scheduler_output.scheduled, model_output.draft_passes, model_output.draft_seconds)
        for scheduled in scheduler_output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished from outside since the step was scheduled
            request.num_computed_tokens += scheduled.num_tokens
            if not scheduled.sample_ids:
                if request.num_computed_tokens == request.num_tokens:  # max_tokens 0: only the prompt to score
                    self.running.remove(request)
                    self.lifecycle.finish(request, RequestStatus.FINISHED_LENGTH)
                    updated.append(request)
                continue
            if request.sampling_params.use_beam_search:
                beams.append(request)  # the search picks the tokens, once every beam has its candidates
                continue
            tokens = [t.token_id for t in model_output.new_tokens(request.request_id)]
            if scheduled.spec_token_ids:
                self.spec.roll_back(request, len(scheduled.spec_token_ids), len(tokens) - 1)
            request.append_output_token(tokens[0])
            sequences = [request, *self.lifecycle.fork_children(request, scheduled, model_output)]
            for sequence in sequences:
                self.lifecycle.stop_if_done(sequence, self.running)
            for token in tokens[1:]:  # accepted proposals came first; stop at the first token that ends it
                if request.is_finished:
                    break
                request.append_output_token(token)
                self.lifecycle.stop_if_done(request, self.running)
            if scheduled.num_steps > 1:  # every token kept but the last was fed back: its K/V is computed
                request.num_computed_tokens = request.num_tokens - 1
            for sequence in sequences:
                self.lifecycle.follow_guide(sequence)
            updated.extend(sequences)
        self.beams.advance(beams, model_output)
        updated.extend(self.lifecycle.take_finished_by_scheduler())
        return updated

    def take_beam_results(self) -> list[tuple[str, list[BeamHypothesis]]]:
        """(request id, best hypotheses) of the beam searches finished since the last call."""
        return self.beams.take_results()

    # ---------------------------------------------------------------- the queues
    def _schedule_running(self, plan: StepPlan) -> None:
        proposals = self.spec.propose(self.running)
        index = 0
        while index < len(self.running) and plan.budget > 0:
            request = self.running[index]
            proposal = proposals.get(request.request_id)
            num_later = len(self.running) - index - 1
            if proposal is not None and (fitted := self.spec.fit(request, proposal, plan.budget, num_later)):
                plan.proposals[request.request_id] = fitted
                plan.add(request, 1 + len(fitted.token_ids))
                index += 1
                continue
            num_new_tokens = self._num_new_tokens(request, plan.budget)
            if not self._allocate_or_preempt(request, num_new_tokens, plan):
                return
            plan.add(request, num_new_tokens)
            index += 1

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, plan: StepPlan) -> bool:
        """Make room by preempting the newest sequences; False if ``request`` itself had to go."""
        while self.kv_manager.allocate_slots(request, num_new_tokens) is None:
            victim = self.running.pop()
            if victim is not request:
                self._preempt(victim, plan)
                continue
            if self.running or self.kv_manager.num_reachable_blocks > self.kv_manager.num_blocks:
                # With lenders (kvmosaic.distributed) blocks elsewhere may free up: wait, do not give up.
                self._preempt(request, plan)
            else:
                # Alone with the whole pool and still no room: it can never grow further.
                self.lifecycle.finish_unfittable(request)
            return False
        return True

    def _schedule_swapped(self, plan: StepPlan) -> None:
        while self.swapped and plan.budget > 0:
            request = self.swapped[0]
            if not self.queues.has_seq_room(request, self.config.max_num_seqs):
                return
            num_new_tokens = self._num_new_tokens(request, plan.budget)
            pairs = self.kv_manager.swap_in(request, num_new_tokens)
            if pairs is None:
                if self.running:
                    return
                self.swapped.popleft()
                self.lifecycle.finish_unfittable(request)
                continue
            self.swapped.popleft()
            plan.swap_in.extend(pairs)
            if self.kv_manager.allocate_slots(request, num_new_tokens) is None:
                raise RuntimeError("swap_in reserved room for the step, yet allocate_slots failed")
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.add(request, num_new_tokens)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        while self.waiting and plan.budget > 0:
            request = self.waiting[0]
            if not self.can_ever_fit(request.num_tokens):
                self.waiting.popleft()
                self.lifecycle.finish_unfittable(request)
                continue
            if not self.queues.has_seq_room(request, self.config.max_num_seqs):
                return
            hit_blocks, num_hit_tokens = self.kv_manager.get_computed_blocks(request)
            num_arrived = self.arrivals.num_external_tokens(request, num_hit_tokens)
            num_known = num_hit_tokens + num_arrived
            num_new_tokens = min(request.num_tokens - num_known, plan.budget, self.config.prefill_chunk)
            table = self.kv_manager.allocate_slots(request, num_arrived + num_new_tokens, hit_blocks)
            if table is None:
                return
            self.waiting.popleft()
            if num_arrived:
                plan.kv_loads.append(self.arrivals.take_load(request, table, num_hit_tokens, num_arrived))
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_hit_tokens  # first admission only: a metric of the prompt
            request.num_computed_tokens = num_known
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.add(request, num_new_tokens)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        return min(request.num_tokens - request.num_computed_tokens, budget, self.config.prefill_chunk)

    # ------------------------------------------------------- state transitions
    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Take a sequence (already out of ``running``) off the device: swap it out or recompute it later."""
        request.num_preemptions += 1
        self.num_preemptions += 1
        plan.preempted.append(request.request_id)
        if self.config.preemption_mode == "swap":
            pairs = self.kv_manager.swap_out(request)
            if pairs is not None:
                request.status = RequestStatus.SWAPPED
                self.swapped.appendleft(request)
                plan.swap_out.extend(pairs)
                return
        # Recompute keeps the output tokens; prompt + outputs run again, helped by the prefix cache.
        self.kv_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
